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
from support.paths import file_module

from sft_tokenize.errors import BadInput
from sft_tokenize.export import EXPORT_RECORD, export_cache
from sft_tokenize.read.cache import open_cache

# Found as verify_export finds it, by its top package, which is not imported: megatron.core imports torch, seconds
# of every pytest-xdist worker that collects this module, most of which run none of its tests.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is in the export extra")


@pytest.fixture(scope="module")
def indexed_dataset():
    """Megatron-Core's reader of .bin/.idx pairs."""
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


@pytest.fixture
def cache(example_cache, tmp_path) -> Path:
    """A copy of the example cache (an export notes itself in the cache's manifest)."""
    return Path(shutil.copytree(example_cache.parent, tmp_path / "root", symlinks=True)) / example_cache.name


def test_indexed_datasets_hold_each_rows_ids_and_mask(cache, tmp_path, indexed_dataset):
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
    return file_module(path, "megatron_bridge_packing_utils")


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


def test_a_mixture_is_exported_in_its_own_order(example_cache, tmp_path, indexed_dataset):
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


def bridge_sft():
    """Megatron-Bridge's SFT datasets module (megatron/bridge/data/datasets/sft.py) and its HF tokenizer wrapper,
    imported from its wheel's files without megatron/bridge/__init__.py, whose model bridges need
    transformer-engine: the dataset and its collator need only megatron-core, torch and datasets."""
    import sys
    import types

    import megatron

    root = MEGATRON_BRIDGE / "megatron"
    if not (root / "bridge" / "data" / "datasets" / "sft.py").is_file():
        pytest.skip(f"megatron-bridge's files are not under {MEGATRON_BRIDGE} (make test installs them there)")
    if str(root) not in megatron.__path__:
        megatron.__path__.append(str(root))
    for name in ("bridge", "bridge.data", "bridge.data.datasets", "bridge.training", "bridge.training.tokenizers"):
        if f"megatron.{name}" not in sys.modules:
            package = types.ModuleType(f"megatron.{name}")
            package.__path__ = [str(root / name.replace(".", "/"))]
            sys.modules[f"megatron.{name}"] = package
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notes that apex and transformer-engine are absent
        from megatron.bridge.data.datasets import sft
        from megatron.bridge.training.tokenizers.tokenizer import _HuggingFaceTokenizer
    return sft, _HuggingFaceTokenizer


@pytest.mark.parametrize("multiple", [1, 8])
def test_megatron_bridges_own_collator_trains_the_caches_mask_in_thd_bins(cache, tmp_path, multiple):
    """GPTSFTPackedDataset and its collate_fn, as Megatron-Bridge's create_sft_dataset builds them for a packed
    file (pad_seq_to_mult = 2 × context parallelism): cu_seqlens and position ids per row, each row's inputs a
    multiple of `multiple`, its labels the cache's ids and its loss the cache's mask, every row once."""
    from support.paths import EXAMPLE_TOKENIZER

    sft, tokenizer_class = bridge_sft()
    record = export_cache(cache, "megatron", tmp_path / "out", pack_length=512, pad_to_multiple_of=multiple)
    tokenizer = tokenizer_class(str(EXAMPLE_TOKENIZER))
    eos = tokenizer.eos_id
    dataset = sft.create_sft_dataset(tmp_path / "out" / "training_512.npy", tokenizer, seq_length=512,
                                     pad_to_max_length=True, pad_cu_seqlens=True, pad_seq_to_mult=multiple,
                                     pack_metadata_file_path=tmp_path / "out" / "512_metadata.jsonl")
    assert isinstance(dataset, sft.GPTSFTPackedDataset) and len(dataset) == record["packed"]["bins"]
    rows = open_cache(cache)
    by_inputs = {tuple(rows[i]["input_ids"][:-1].tolist()): i for i in range(len(rows))}
    seen = []
    for i in range(len(dataset)):
        batch = dataset.collate_fn([dataset[i]])
        tokens, labels = batch["tokens"][0].numpy(), batch["labels"][0].numpy()
        loss, positions = batch["loss_mask"][0].numpy(), batch["position_ids"][0].numpy()
        cu = [c for c in batch["cu_seqlens"][0].tolist() if c >= 0]
        assert cu == sorted(cu) and set(cu[cu.index(512):]) == {512}  # padded to a fixed size with 512s
        cu = cu[:cu.index(512) + 1]
        assert cu[-1] == 512 and (multiple == 1 or all(c % multiple == 0 for c in cu)), (i, cu)
        assert (multiple > 1) == ("cu_seqlens_unpadded" in batch)
        for a, b in zip(cu, cu[1:], strict=False):
            if a == cu[-2] and tokens[a:b].tolist() == [eos] * (b - a):
                continue  # the bin's tail, padding up to 512
            assert np.array_equal(positions[a:b], np.arange(b - a)), (i, a)  # positions restart at every row
            # the row's inputs (its ids less the last), then, padded, its last id and EOS up to a multiple
            cuts = [c for c in range(b - a, max(b - a - multiple - 1, 0), -1)
                    if tuple(tokens[a:a + c].tolist()) in by_inputs]
            assert cuts, (i, a)
            cut = cuts[0]
            row = by_inputs[tuple(tokens[a:a + cut].tolist())]
            ids, mask = rows[row]["input_ids"], rows[row]["loss_mask"]
            assert cut == len(ids) - 1 and np.array_equal(labels[a:a + cut], ids[1:]), (i, row)
            assert tokens[a + cut:b].tolist() == ([ids[-1]] + [eos] * (b - a - cut - 1) if b - a > cut else [])
            assert np.array_equal(loss[a:a + cut], mask[1:]), (i, row)  # trained: exactly the cache's mask
            assert not loss[a + cut:b].any() and (multiple > 1 or cut == b - a), (i, row)  # padding untrained
            seen.append(row)
    assert sorted(seen) == list(range(len(rows)))


def test_pad_to_multiple_of_is_checked_before_anything_is_written(cache, tmp_path):
    with pytest.raises(BadInput, match="--pack-length 500: not a multiple of --pad-to-multiple-of 8"):
        export_cache(cache, "megatron", tmp_path / "out", pack_length=500, pad_to_multiple_of=8)
    with pytest.raises(BadInput, match="--pad-to-multiple-of 8: .*--pack-length only"):
        export_cache(cache, "megatron", tmp_path / "out", pad_to_multiple_of=8)
    assert not (tmp_path / "out").exists()
    record = export_cache(cache, "megatron", tmp_path / "out", pack_length=512, pad_to_multiple_of=8)
    assert record["options"]["pad_id"] == 2  # <|im_end|>, the example tokenizer's EOS
