"""Remote inputs through fsspec, against a real S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.data import example_rows
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER
from support.s3 import s3_server

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.shard import tokenize_slice

pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
pytest.importorskip("s3fs", reason="s3fs is in the dev extra")


@pytest.fixture(scope="module")
def s3(monkeypatch_module):
    """A moto S3 server (support/s3.py) with a bucket `data`: its filesystem, and the bytes it served by path."""
    with s3_server() as server:
        for name, value in server.environment.items():
            monkeypatch_module.setenv(name, value)
        fs = server.filesystem()
        fs.mkdir("data")
        yield fs, server.served


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.slow  # an S3 server (moto) and ranged reads of every slice
def test_s3_jsonl_and_parquet_match_local_files_and_slices_fetch_only_their_ranges(tmp_path, s3):
    fs, served = s3
    local = sorted(EXAMPLE_DATA.glob("*.jsonl"))
    for path in local:
        fs.put(str(path), f"data/jsonl/{path.name}")
    pq.write_table(pa.Table.from_pylist(example_rows() * 2), tmp_path / "rows.parquet", row_group_size=40)
    fs.put(str(tmp_path / "rows.parquet"), "data/parquet/rows.parquet")

    def options(sources, cache):
        return TokenizeOptions(sources=sources, tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path / cache),
                               shard_size="40KB", storage_options={"skip_instance_cache": True})

    local_paths = {"s3-jsonl": [str(EXAMPLE_DATA)], "s3-pq": [str(tmp_path / "rows.parquet")]}
    metadata = pq.ParquetFile(tmp_path / "rows.parquet").metadata
    for sources, cache in ((["s3://data/jsonl/*.jsonl"], "s3-jsonl"), (["s3://data/parquet/rows.parquet"], "s3-pq")):
        plan = plan_slices(options(sources, cache))
        assert len(plan.slices) > 2
        for slice_ in plan.slices:
            served.clear()
            tokenize_slice(plan.job, slice_)
            fetched = sum(served.values())
            if slice_.parts[0].kind == "jsonl":  # exactly the byte range of its lines
                assert fetched == sum(p.stop - p.start for p in slice_.parts), (slice_.index, served)
            else:  # its row groups, plus the footer pyarrow reads first (64 KiB at most)
                groups = sum(metadata.row_group(g).column(c).total_compressed_size
                             for c in range(metadata.num_columns) for p in slice_.parts for g in range(p.start, p.stop))
                assert groups <= fetched <= groups + (64 << 10), (slice_.index, fetched, groups)
        reference = datasets.load_from_disk(str(run_locally(options(local_paths[cache], f"local-{cache}"))))
        got = datasets.load_from_disk(str(run_locally(options(sources, cache))))
        assert got["input_ids"] == reference["input_ids"] and got["loss_mask"] == reference["loss_mask"]


def test_a_changed_object_changes_the_fingerprint(tmp_path, s3):
    fs, _ = s3
    fs.pipe("data/one/rows.jsonl", (EXAMPLE_DATA / "chat-00001.jsonl").read_bytes())

    def fingerprint():
        return plan_slices(TokenizeOptions(sources=["s3://data/one/rows.jsonl"], tokenizer=str(EXAMPLE_TOKENIZER),
                                           cache_dir=str(tmp_path / "c"))).job.fingerprint

    before = fingerprint()
    assert fingerprint() == before
    fs.pipe("data/one/rows.jsonl", (EXAMPLE_DATA / "chat-00001.jsonl").read_bytes().replace(b"Dataset", b"Datasat"))
    assert fingerprint() != before
