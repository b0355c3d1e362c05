"""The shards and dataset_info.json are written without `datasets` (it imports pandas: ~1 s of a first run's CPU),
and are the bytes `datasets.ArrowWriter` and `DatasetInfo` write, for every layout, extra column and image cache."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest
from datasets import DatasetInfo, Features, List, Value
from datasets.arrow_writer import ArrowWriter

from sft_tokenize.build.job import arrow_schema, dataset_info, feature_dict
from sft_tokenize.build.shard_writer import ShardWriter, _list_array
from sft_tokenize.read.layouts import COLUMN_TYPES, LAYOUTS, column_values, layout_columns

CASES = [(layout, extra, images) for layout in LAYOUTS for extra in ((), ("labels", "attention_mask"))
         for images in (False, True)] + [("skyrl", ("pixel_values",), True)]


def hf_features(extra, layout, images) -> Features:
    """The cache's Features as they were built with datasets' own classes."""
    columns = {name: List(Value(COLUMN_TYPES[name])) for name in layout_columns(layout, extra)}
    if images:
        columns["images"] = List({"bytes": Value("binary"), "path": Value("string"), "hash": Value("string"),
                                  "size": Value("int64")})
        columns["image_grid_thw"] = List(List(Value("int32")))
        columns["image_sizes"] = List(List(Value("int32")))
        if "pixel_values" in extra:
            columns["pixel_values"] = List(List(Value("float32")))
    return Features(columns)


@pytest.mark.parametrize(("layout", "extra", "images"), CASES)
def test_the_schema_is_the_one_datasets_writes(layout, extra, images):
    features = hf_features(extra, layout, images)
    assert features.to_dict() == feature_dict(extra, layout, images)
    ours = arrow_schema(extra, layout, images)
    stream = io.BytesIO()
    writer = ArrowWriter(stream=stream, features=features)
    writer.finalize(close_stream=False)  # an empty shard: its schema alone
    theirs = ShardWriter(empty := io.BytesIO(), extra, 100, 10**6, layout, images)
    theirs.close()
    assert ours.equals(features.arrow_schema.with_metadata(ours.metadata), check_metadata=True)
    assert empty.getvalue() == stream.getvalue()


@dataclass
class Batch:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_shards_bytes_are_datasets_arrow_writers(layout):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, 250)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    batch = Batch(rng.integers(0, 30000, offsets[-1]).astype(np.int32),
                  (rng.random(offsets[-1]) < 0.5).astype(np.int8), offsets)
    ours = io.BytesIO()
    writer = ShardWriter(ours, ("labels",), 64, 10**6, layout)
    writer.add(batch)
    writer.close()

    theirs = io.BytesIO()
    hf = ArrowWriter(stream=theirs, features=hf_features(("labels",), layout, False), writer_batch_size=64)
    for start in range(0, batch.rows, 64):  # the same record batches, through datasets' writer
        stop = min(batch.rows, start + 64)
        a, b = offsets[start], offsets[stop]
        ids, mask, rows = batch.input_ids[a:b], batch.loss_mask[a:b], lengths[start:stop]
        hf.write_table(pa.table({name: _list_array(rows, column_values(name, ids, mask))
                                 for name in writer.columns}))
    hf.finalize(close_stream=False)
    assert ours.getvalue() == theirs.getvalue()


@pytest.mark.parametrize(("layout", "extra", "images"), CASES)
def test_dataset_info_is_the_json_datasets_writes(tmp_path, layout, extra, images):
    DatasetInfo(features=hf_features(extra, layout, images)).write_to_directory(str(tmp_path))

    @dataclass
    class JobLike:
        extra_columns: tuple
        layout: str
        processor_config: str

    ours = dataset_info(JobLike(extra, layout, "{}" if images else ""))
    assert ours == (tmp_path / "dataset_info.json").read_bytes()
    assert json.loads(ours)["features"] == feature_dict(extra, layout, images)
