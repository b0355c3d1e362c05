"""--layout: each layout's columns, derived in the shard writer from the same tokens and mask."""

from __future__ import annotations

import numpy as np
import pytest
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.cli.main import main
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.layouts import IGNORE_INDEX, LAYOUTS


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {layout: run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                                cache_dir=str(root), shard_size="40KB", layout=layout,
                                                writer_batch_rows=7))
            for layout in LAYOUTS}


def test_each_layout_holds_its_columns_derived_from_the_same_mask(caches):
    import datasets

    reference = open_cache(caches["skyrl"])
    assert len({path.name for path in caches.values()}) == len(LAYOUTS)  # the layout is in the fingerprint
    for layout, path in caches.items():
        dataset = datasets.load_from_disk(str(path))
        assert dataset.column_names == list(LAYOUTS[layout])
        cache = open_cache(path)
        assert cache.manifest["layout"] == layout and cache.manifest["columns"] == list(LAYOUTS[layout])
        assert len(cache) == len(reference) > 0
        for i in range(len(cache)):
            row, want = cache[i], reference[i]
            np.testing.assert_array_equal(row["input_ids"], want["input_ids"])
            if "labels" in row:
                assert row["labels"].dtype == np.int32
                np.testing.assert_array_equal(row["labels"],
                                              np.where(want["loss_mask"] == 1, want["input_ids"], IGNORE_INDEX))
            if "attention_mask" in row:
                assert row["attention_mask"].dtype == np.int8 and (row["attention_mask"] == 1).all()
                assert len(row["attention_mask"]) == len(want["input_ids"])


def test_extra_columns_add_what_a_layout_lacks(tmp_path):
    path = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path), layout="trl", extra_columns=["attention_mask"]))
    assert open_cache(path).columns == ["input_ids", "labels", "attention_mask"]


def test_inspect_shows_the_layout_and_a_bad_layout_is_a_usage_error(caches, capsys):
    assert main(["inspect", str(caches["axolotl"])]) == 0
    out = capsys.readouterr().out
    assert "axolotl (input_ids, attention_mask, labels)" in out
    assert main(["run", str(EXAMPLE_DATA), "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", "x",
                 "--layout", "nemo"]) == 2
    assert "invalid choice: 'nemo'" in capsys.readouterr().err
