"""`megatron` exports read back by Megatron-Core's own IndexedDataset, and Megatron-Bridge's packed file read as
its GPTSFTPackedDataset reads it: the cache's ids and masks, every row once."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from sft_tokenize.errors import BadInput
from sft_tokenize.export import EXPORT_RECORD, export_cache
from sft_tokenize.read.cache import open_cache

indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                      reason="megatron-core is in the export extra")


@pytest.fixture
def cache(example_cache, tmp_path) -> Path:
    """A copy of the example cache (an export notes itself in the cache's manifest)."""
    return Path(shutil.copytree(example_cache.parent, tmp_path / "root", symlinks=True)) / example_cache.name


def test_indexed_datasets_hold_each_rows_ids_and_mask(cache, tmp_path):
    record = export_cache(cache, "megatron", tmp_path / "out", batch_rows=7)  # batches end mid-file
    rows = open_cache(cache)
    tokens = indexed_dataset.IndexedDataset(str(tmp_path / "out" / "tokens"))
    mask = indexed_dataset.IndexedDataset(str(tmp_path / "out" / "loss_mask"))
    assert len(tokens) == len(mask) == len(rows) == record["rows"]
    for i in range(len(rows)):
        assert tokens[i].dtype == np.int32 and np.array_equal(tokens[i], rows[i]["input_ids"]), i
        assert np.array_equal(mask[i], rows[i]["loss_mask"]), i
    assert np.array_equal(tokens.document_indices, np.arange(len(rows) + 1))
    assert record["tokens"] == int(rows.lengths.sum())


def test_the_export_is_recorded_with_its_digest_and_reused(cache, tmp_path):
    record = export_cache(cache, "megatron", tmp_path / "out")
    on_disk = json.loads((tmp_path / "out" / EXPORT_RECORD).read_text())
    assert on_disk["digest"] == record["digest"] and on_disk["fingerprint"] == open_cache(cache).fingerprint
    assert {f["name"] for f in on_disk["files"]} == {"tokens.bin", "tokens.idx", "loss_mask.bin", "loss_mask.idx"}
    noted = open_cache(cache).manifest["exports"][str(tmp_path / "out")]
    assert noted["digest"] == record["digest"] and noted["target"] == "megatron"
    mtime = (tmp_path / "out" / "tokens.bin").stat().st_mtime_ns
    assert export_cache(cache, "megatron", tmp_path / "out")["reused"] is True
    assert (tmp_path / "out" / "tokens.bin").stat().st_mtime_ns == mtime


def test_a_failed_export_leaves_nothing_and_a_foreign_directory_is_refused(cache, tmp_path, monkeypatch):
    import sft_tokenize.export.megatron as megatron

    def broken(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(megatron, "write_index", broken)
    with pytest.raises(OSError, match="disk gone"):
        export_cache(cache, "megatron", tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out*")) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(BadInput, match="not an export"):
        export_cache(cache, "megatron", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(BadInput, match="inside the cache"):
        export_cache(cache, "megatron", cache / "megatron")
    assert not (cache / "megatron").exists()


def test_the_packed_file_is_the_packing_index_as_megatron_bridge_reads_it(cache, tmp_path):
    record = export_cache(cache, "megatron", tmp_path / "out", pack_length=[512, 1024])
    assert [p["pack_length"] for p in record["packed"]] == [512, 1024]
    assert (tmp_path / "out" / "training_1024.npy").is_file() and (tmp_path / "out" / "1024_metadata.jsonl").is_file()
    rows = open_cache(cache)
    packed = rows.packed(512)
    items = np.load(tmp_path / "out" / "training_512.npy", allow_pickle=True)  # GPTSFTPackedDataset._load_dataset
    assert items.dtype == object and len(items) == len(packed)
    seen = []
    for i, item in enumerate(items):
        # GPTSFTPackedDataset.__getitem__ and collate_fn: boundaries, tokens without each row's last, labels
        # without its first, and the file's mask over the tokens (rolled: it marks the label trained)
        boundaries = item["seq_start_id"] + [len(item["input_ids"])]
        assert len(item["loss_mask"]) == len(item["input_ids"])
        for k, row in enumerate(packed.index.bin(i).tolist()):
            start, end = boundaries[k], boundaries[k + 1]
            ids, mask = rows[row]["input_ids"][:512], rows[row]["loss_mask"][:512]
            assert item["input_ids"][start:end] == ids.tolist()
            assert np.array_equal(np.asarray(item["loss_mask"][start:end - 1], dtype=np.int8), mask[1:]), (i, row)
            seen.append(row)
    assert sorted(seen) == list(range(len(rows)))
    metadata = json.loads((tmp_path / "out" / "512_metadata.jsonl").read_text())
    assert metadata[0]["pack_size"] == 512 and metadata[0]["max_samples_per_bin"] >= 2


MEGATRON_BRIDGE = Path(os.environ.get("SFT_TOKENIZE_MEGATRON_BRIDGE",
                                      Path(__file__).resolve().parents[2] / ".cache" / "consumers" / "megatron-bridge"))


def bridge_packing_utils():
    """Megatron-Bridge's own packer (megatron/bridge/data/datasets/packing_utils.py: numpy and tqdm only), loaded
    from its wheel's files: the package itself needs transformer-engine and CUDA to import."""
    path = MEGATRON_BRIDGE / "megatron" / "bridge" / "data" / "datasets" / "packing_utils.py"
    if not path.is_file():
        pytest.skip(f"megatron-bridge's files are not under {MEGATRON_BRIDGE} (make test installs them there)")
    spec = importlib.util.spec_from_file_location("megatron_bridge_packing_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_packed_file_holds_what_megatron_bridges_own_packer_writes_for_the_same_bins(cache, tmp_path):
    packing_utils = bridge_packing_utils()
    export_cache(cache, "megatron", tmp_path / "out", pack_length=512)
    ours = np.load(tmp_path / "out" / "training_512.npy", allow_pickle=True)
    rows = open_cache(cache)
    packed = rows.packed(512)
    # its input: tokenized examples with a loss_mask; its bins: lists of each row's length less one
    examples = np.array([{"input_ids": rows[i]["input_ids"][:512].tolist(),
                          "loss_mask": rows[i]["loss_mask"][:512].tolist()} for i in range(len(rows))])
    sequences, _ = packing_utils.create_hist(examples, 512)
    assignments = [[len(examples[row]["input_ids"]) - 1 for row in packed.index.bin(i).tolist()]
                   for i in range(len(packed))]
    np.random.seed(0)
    theirs = packing_utils.fill_packing_strategy(assignments, sequences, 512, pad_id=0)

    def segments(items) -> list[tuple]:
        out = []
        for item in items:
            bounds = [*item["seq_start_id"], len(item["input_ids"])]
            out += [(tuple(item["input_ids"][a:b]), tuple(int(x) for x in item["loss_mask"][a:b]))
                    for a, b in zip(bounds, bounds[1:], strict=False)]
        return sorted(out)

    assert len(theirs) == len(ours)
    # rows of one length may trade bins (it draws them from a shuffled pool): per bin the lengths, in all the rows
    assert [sorted(np.diff([*t["seq_start_id"], len(t["input_ids"])]).tolist()) for t in theirs] == \
        [sorted(np.diff([*o["seq_start_id"], len(o["input_ids"])]).tolist()) for o in ours]
    assert segments(theirs) == segments(ours)


def test_a_mixture_is_exported_in_its_own_order(example_cache, tmp_path):
    from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.read.mixed_rows import open_mixture
    from sft_tokenize.read.mixture_index import mix_caches
    from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSource

    sources = [run_locally(TokenizeOptions(sources=[str(path)], tokenizer=str(EXAMPLE_TOKENIZER),
                                           cache_dir=str(tmp_path / "caches")))
               for path in sorted(EXAMPLE_DATA.glob("*.jsonl"))]
    index = mix_caches(MixtureOptions(sources=[MixtureSource(cache=str(sources[0]), weight=0.25),
                                               MixtureSource(cache=str(sources[1]), weight=0.75)], budget=5_000))
    record = export_cache(index.path, "megatron", tmp_path / "out", batch_rows=5)
    mixed = open_mixture(index.path)
    tokens = indexed_dataset.IndexedDataset(str(tmp_path / "out" / "tokens"))
    mask = indexed_dataset.IndexedDataset(str(tmp_path / "out" / "loss_mask"))
    assert record["fingerprint"] == mixed.fingerprint and len(tokens) == len(mixed) > 0
    for i in range(len(mixed)):
        assert np.array_equal(tokens[i], mixed[i]["input_ids"]) and np.array_equal(mask[i], mixed[i]["loss_mask"])


def test_verify_reads_the_export_with_megatron_core_and_names_a_row_whose_mask_differs(cache, tmp_path):
    from sft_tokenize.consumers.verify_trainer import verify_trainer

    export_cache(cache, "megatron", tmp_path / "out")
    rows = open_cache(cache)
    check = verify_trainer(cache, "megatron", 1000, export=tmp_path / "out")
    assert check.rows == len(rows) and check.trained == rows.manifest["trained_tokens"]
    start = int(rows.lengths[:3].sum())  # row 3's first token in loss_mask.bin (one byte a token)
    data = bytearray((tmp_path / "out" / "loss_mask.bin").read_bytes())
    data[start] ^= 1
    (tmp_path / "out" / "loss_mask.bin").write_bytes(bytes(data))
    with pytest.raises(BadInput, match="row 3: megatron reads a loss mask .* differs at token 0"):
        verify_trainer(cache, "megatron", 1000, export=tmp_path / "out")
    with pytest.raises(BadInput, match="--export DIR"):
        verify_trainer(cache, "megatron", 1)
