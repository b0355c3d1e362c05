"""The cache as the trainers read it: TRL's SFTTrainer, axolotl's and LLaMA-Factory's collators, a PyTorch
DataLoader. Needs the `trainers` extra (CPU torch, trl) and axolotl installed without its dependencies
(both done by `make test`). Models are tiny random ones built from a config: no hub."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.layouts import IGNORE_INDEX
from sft_tokenize.read.trainers import for_axolotl, for_trl, work_view


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """The bundled example (240 rows) in every layout, cut into 17 data files."""
    root = tmp_path_factory.mktemp("trainer-caches")
    return {layout: run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                                cache_dir=str(root), shard_size="20KB", layout=layout))
            for layout in ("skyrl", "trl", "axolotl", "llama-factory")}


@pytest.fixture(scope="module")
def mask_of(caches) -> dict[tuple[int, ...], np.ndarray]:
    """Each row's loss_mask, by its token ids, from the skyrl cache of the same data."""
    cache = open_cache(caches["skyrl"])
    return {tuple(cache[i]["input_ids"].tolist()): cache[i]["loss_mask"] for i in range(len(cache))}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))


def tree(path: Path) -> dict[str, tuple[int, int, str]]:
    """Every file and directory under `path`: size, mtime_ns and the SHA-256 of its bytes."""
    out = {}
    for item in sorted([path, *path.rglob("*")]):
        info = item.lstat()
        digest = hashlib.sha256(item.read_bytes()).hexdigest() if item.is_file() else "dir"
        out[str(item.relative_to(path))] = (info.st_size, info.st_mtime_ns, digest)
    return out


def expected_labels(ids: list[int], mask_of) -> np.ndarray:
    mask = mask_of[tuple(ids)]  # a KeyError here: the trainer cut or merged rows
    return np.where(mask == 1, np.asarray(ids), IGNORE_INDEX)


def check_rows(input_ids: list[list[int]], labels: list[list[int]], lengths: list[int], mask_of) -> tuple[int, int]:
    """Labels are the id where loss_mask is 1 and -100 where it is 0 or padding, row by row; returns
    (trained, masked) token counts."""
    trained = masked = 0
    for ids, row_labels, n in zip(input_ids, labels, lengths, strict=True):
        want = expected_labels(ids[:n], mask_of)
        assert row_labels[:n] == want.tolist()
        assert all(label == IGNORE_INDEX for label in row_labels[n:])
        trained += int((want != IGNORE_INDEX).sum())
        masked += int((want == IGNORE_INDEX).sum())
    return trained, masked


def check_packed(input_ids, labels, starts: list[int], end: int, mask_of) -> tuple[int, int]:
    """The same for one packed sequence of whole rows starting at `starts`, unpadded up to `end`."""
    bounds = [*starts, end]
    ids, labels = input_ids.tolist(), labels.tolist()
    pieces = list(zip(bounds, bounds[1:], strict=False))
    return check_rows([ids[a:b] for a, b in pieces], [labels[a:b] for a, b in pieces], [b - a for a, b in pieces],
                      mask_of)


# ---------------------------------------------------------------------------------------------------- TRL
TRL_MODES = {
    "padded": {},  # TRL's defaults: max_length=1024 (it truncates and filters, through Dataset.map)
    "packing": {"packing": True, "max_length": 1024},  # bfd packing, which is padding-free
    "padding_free": {"padding_free": True, "max_length": None},
}


def train_trl(dataset, tokenizer, out: Path, **config) -> list[dict]:
    """Train a tiny random Llama for 2 steps with SFTTrainer; returns the batches the model received."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id))
    seen: list[dict] = []

    class Recording(SFTTrainer):  # what reaches the loss, after TRL's own dataset preparation and collator
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)})
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = SFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                     save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                     **config)
    Recording(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()
    return seen


def check_trl_batches(batches: list[dict], mask_of) -> None:
    trained = masked = 0
    for batch in batches:
        if "position_ids" in batch:  # padding-free: one row, sequences restart at position 0
            positions = batch["position_ids"][0]
            starts = (positions == 0).nonzero().flatten().tolist()
            t, m = check_packed(batch["input_ids"][0], batch["labels"][0], starts, len(positions), mask_of)
        else:
            t, m = check_rows(batch["input_ids"].tolist(), batch["labels"].tolist(),
                              batch["attention_mask"].sum(1).tolist(), mask_of)
        trained, masked = trained + t, masked + m
    assert len(batches) == 2 and trained > 0 and masked > 0


@pytest.mark.parametrize("mode", list(TRL_MODES))
def test_trl_trains_on_loss_mask_only_and_leaves_the_cache_alone(caches, mask_of, tokenizer, tmp_path, mode):
    before = tree(caches["trl"])
    batches = train_trl(for_trl(caches["trl"], tmp_path / "view"), tokenizer, tmp_path / "out", **TRL_MODES[mode])
    check_trl_batches(batches, mask_of)
    assert tree(caches["trl"]) == before


def test_trl_builds_labels_from_a_skyrl_cache_outside_it(caches, mask_of, tokenizer, tmp_path):
    """A default (skyrl) cache works too: its loss_mask reaches SFTTrainer as assistant_masks, which TRL turns
    into labels with Dataset.map, whose cache file lands in the work view."""
    before = tree(caches["skyrl"])
    batches = train_trl(for_trl(caches["skyrl"], tmp_path / "view"), tokenizer, tmp_path / "out", max_length=None)
    check_trl_batches(batches, mask_of)
    assert tree(caches["skyrl"]) == before
    assert list((tmp_path / "view").glob("cache-*.arrow")), "TRL's labels map should have been cached in the view"


def test_trl_trains_on_a_cache_read_from_a_bucket(remote_example, example_cache, tokenizer, tmp_path):
    """for_trl(url): the version is copied to this machine (local_dir), and SFTTrainer trains on its rows."""
    local = open_cache(example_cache)
    mask_of = {tuple(local[i]["input_ids"].tolist()): local[i]["loss_mask"] for i in range(len(local))}
    dataset = for_trl(remote_example.url, tmp_path / "view", local_dir=tmp_path / "local")
    assert len(dataset) == len(local)
    check_trl_batches(train_trl(dataset, tokenizer, tmp_path / "out", max_length=None), mask_of)
    assert (tmp_path / "local" / example_cache.name / "manifest.json").is_file()


def test_trl_trains_on_a_mixture_of_two_caches_and_leaves_them_alone(caches, mask_of, tokenizer, tmp_path):
    from sft_tokenize.read.mixture_index import mix_caches
    from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSource

    sources = [run_locally(TokenizeOptions(sources=[str(path)], tokenizer=str(EXAMPLE_TOKENIZER),
                                           cache_dir=str(tmp_path / "caches"), layout="trl"))
               for path in sorted(EXAMPLE_DATA.glob("*.jsonl"))]
    before = [tree(path) for path in sources]
    index = mix_caches(MixtureOptions(sources=[MixtureSource(cache=str(sources[0]), weight=0.25),
                                               MixtureSource(cache=str(sources[1]), weight=0.75)],
                                      budget=5_000))
    dataset = for_trl(index.path, tmp_path / "views")
    assert len(dataset) == len(index)
    batches = train_trl(dataset, tokenizer, tmp_path / "out", max_length=None)
    check_trl_batches(batches, mask_of)
    assert [tree(path) for path in sources] == before


class ReadOnly:
    """Makes `root` read-only for this process, as far as an unprivileged test can.

    chmod takes away every write bit (enough for a normal user). Root ignores those, so an audit hook also
    refuses, with EROFS, any open for writing and any create, rename, remove or link under `root` made by
    Python code; and where the kernel allows it (CAP_LINUX_IMMUTABLE), chattr +i makes every file and
    directory immutable even for root, which also covers writes from native code."""

    guarded: Path | None = None
    hooked = False

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.immutable = False

    @classmethod
    def _audit(cls, event: str, args: tuple) -> None:
        if cls.guarded is None:
            return
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            written = [path] if writing else []
        elif event in ("os.symlink", "os.link"):  # (target, new link): only the link is created
            written = [args[1]]
        elif event == "os.rename":  # also os.replace
            written = list(args[:2])
        elif event in {"os.mkdir", "os.remove", "os.rmdir", "os.truncate", "os.chmod", "os.utime", "shutil.rmtree",
                       "shutil.move"}:
            written = list(args[:1])
        else:
            return
        for path in written:
            if isinstance(path, (str, bytes, os.PathLike)):
                path = os.path.abspath(os.fsdecode(path))  # open follows a symbolic link; rename and remove do not
                resolved = Path(os.path.realpath(path) if event == "open" else
                                os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)))
                if resolved == cls.guarded or cls.guarded in resolved.parents:
                    raise OSError(errno.EROFS, f"read-only cache (test): {event}", path)

    def _chattr(self, flag: str) -> bool:
        items = [str(p) for p in [self.root, *self.root.rglob("*")]]
        try:
            return subprocess.run(["chattr", flag, *items], capture_output=True).returncode == 0
        except FileNotFoundError:
            return False

    def __enter__(self) -> ReadOnly:
        for item in [self.root, *self.root.rglob("*")]:
            item.chmod(0o555 if item.is_dir() else 0o444)
        self.immutable = self._chattr("+i")
        if not ReadOnly.hooked:
            sys.addaudithook(ReadOnly._audit)
            ReadOnly.hooked = True
        ReadOnly.guarded = self.root
        return self

    def __exit__(self, *exc_info) -> None:
        ReadOnly.guarded = None
        self._chattr("-i")  # also after a +i that failed part way
        for item in [self.root, *self.root.rglob("*")]:
            item.chmod(0o755 if item.is_dir() else 0o644)


@pytest.mark.parametrize("mode", list(TRL_MODES))
def test_trl_on_a_read_only_cache(caches, mask_of, tokenizer, tmp_path, mode):
    cache = caches["trl"]
    before = tree(cache)
    with ReadOnly(cache) as read_only:
        with pytest.raises(OSError) as refused:  # the guard holds: a write into the cache fails
            (cache / "probe.arrow").write_bytes(b"x")
        assert refused.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        dataset = for_trl(cache, tmp_path / "view")
        batches = train_trl(dataset, tokenizer, tmp_path / "out", **TRL_MODES[mode])
    check_trl_batches(batches, mask_of)
    assert tree(cache) == before
    print(f"read-only by chmod, audit hook{', chattr +i' if read_only.immutable else ' (chattr +i not permitted)'}")


def test_sfttrainer_refuses_open_cache_so_the_readme_says_for_trl(caches, tokenizer, tmp_path):
    with pytest.raises((TypeError, ValueError), match="Dataset"):
        train_trl(open_cache(caches["trl"]), tokenizer, tmp_path / "out")


def test_work_view_is_never_inside_the_cache_and_axolotl_needs_its_columns(caches, tmp_path):
    from sft_tokenize.errors import CacheError

    with pytest.raises(CacheError, match="outside the cache"):
        work_view(caches["trl"], caches["trl"] / "view")
    with pytest.raises(CacheError, match="columns are input_ids, loss_mask; axolotl needs exactly"):
        for_axolotl(caches["skyrl"], tmp_path / "view")
    assert for_axolotl(caches["llama-factory"], tmp_path / "view") == tmp_path / "view"  # the same columns


def test_the_default_work_view_is_under_the_datasets_cache(caches, tmp_path, monkeypatch):
    from datasets import config, load_from_disk

    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    view = work_view(caches["trl"])
    assert view.parent == tmp_path / "hf-datasets" / "sft-tokenize" and view.name.startswith(caches["trl"].name)
    assert work_view(caches["trl"]) == view  # again: the same view, rebuilt in place
    cache = open_cache(caches["trl"])
    assert all((view / f["name"]).resolve() == cache.path.resolve() / f["name"] for f in cache.manifest["files"])
    assert len(load_from_disk(str(view))) == len(cache)


# ------------------------------------------------------------------------------------------------ axolotl
def axolotl_collators():
    return pytest.importorskip("axolotl.utils.collators", reason="needs axolotl: pip install --no-deps axolotl==0.19.0")


def axolotl_rows(caches, tmp_path, n: int) -> list[dict]:
    from datasets import load_from_disk

    dataset = load_from_disk(str(for_axolotl(caches["axolotl"], tmp_path / "view")))
    assert dataset.column_names == ["input_ids", "attention_mask", "labels"]  # exactly what axolotl accepts
    return [dataset[i] for i in range(n)]


def test_axolotl_collator_takes_the_axolotl_layout(caches, mask_of, tokenizer, tmp_path):
    """axolotl's own collator (axolotl.utils.collators, as its trainer builder configures it: padding to a
    multiple of 64), on 6 rows; and the skyrl layout's extra loss_mask is what made it fail."""
    DataCollatorForSeq2Seq = axolotl_collators().DataCollatorForSeq2Seq

    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=64, return_tensors="pt")
    rows = axolotl_rows(caches, tmp_path, 6)
    batch = collate([dict(row) for row in rows])
    assert batch["input_ids"].shape[1] % 64 == 0
    lengths = [len(row["input_ids"]) for row in rows]
    assert batch["attention_mask"].sum(1).tolist() == lengths
    trained, masked = check_rows(batch["input_ids"].tolist(), batch["labels"].tolist(), lengths, mask_of)
    assert trained > 0 and masked > 0

    skyrl = open_cache(caches["skyrl"])
    with pytest.raises(ValueError):  # ragged loss_mask lists cannot become a tensor
        collate([{**{k: v.tolist() for k, v in skyrl[i].items()}, "labels": rows[i]["labels"]} for i in range(6)])


def test_axolotl_sample_packing_collator(caches, mask_of, tokenizer, tmp_path):
    """With sample packing axolotl adds position_ids (0..n-1 per row, its add_position_ids) and its multipack
    sampler hands the collator bins of rows; V2BatchSamplerDataCollatorForSeq2Seq concatenates each bin and
    numbers the rows of a bin 1, 2, ... in attention_mask."""
    V2BatchSamplerDataCollatorForSeq2Seq = axolotl_collators().V2BatchSamplerDataCollatorForSeq2Seq

    rows = [{**row, "position_ids": list(range(len(row["input_ids"])))} for row in axolotl_rows(caches, tmp_path, 6)]
    bins = [rows[0:3], rows[3:6]]
    collate = V2BatchSamplerDataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=64,
                                                   return_tensors="pt")
    batch = collate(bins)
    trained = masked = 0
    for b, rows_in_bin in enumerate(bins):
        lengths = [len(row["input_ids"]) for row in rows_in_bin]
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        assert (batch["position_ids"][b][starts] == 0).all()
        segment_ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)
        assert batch["attention_mask"][b][:sum(lengths)].tolist() == segment_ids.tolist()
        assert (batch["attention_mask"][b][sum(lengths):] == 0).all()
        t, m = check_packed(batch["input_ids"][b], batch["labels"][b], starts, sum(lengths), mask_of)
        assert (batch["labels"][b][sum(lengths):] == IGNORE_INDEX).all()
        trained, masked = trained + t, masked + m
    assert trained > 0 and masked > 0


# ------------------------------------------------------------------------------------------ LLaMA-Factory
def test_llama_factory_collator_contract(caches, mask_of, tokenizer):
    """LLaMA-Factory is not installable beside torch 2.13 (it needs torchaudio and pins torch 2.14, transformers
    5.6, datasets 4.0), so its contract is tested as read in llamafactory 0.9.5's data/collator.py: for text
    rows, SFTDataCollatorWith4DAttentionMask pops images/videos/audios (absent here), adds nothing for a
    text-only template, and calls transformers' DataCollatorForSeq2Seq, built by its SFT workflow with
    pad_to_multiple_of=8 and label_pad_token_id=-100. `tokenized_path` data is loaded with load_from_disk
    and given to that collator as it is."""
    from datasets import load_from_disk
    from transformers import DataCollatorForSeq2Seq

    collate = DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8, label_pad_token_id=IGNORE_INDEX)
    dataset = load_from_disk(str(caches["llama-factory"]))
    assert dataset.column_names == ["input_ids", "attention_mask", "labels"]
    rows = [dataset[i] for i in range(6)]
    batch = collate([dict(row) for row in rows])  # no images/videos/audios for LLaMA-Factory to pop first
    lengths = [len(row["input_ids"]) for row in rows]
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["attention_mask"].sum(1).tolist() == lengths
    trained, masked = check_rows(batch["input_ids"].tolist(), batch["labels"].tolist(), lengths, mask_of)
    assert trained > 0 and masked > 0

    skyrl = open_cache(caches["skyrl"])  # the reported crash: an extra ragged loss_mask at the first batch
    with pytest.raises(ValueError):
        collate([{**{k: v.tolist() for k, v in skyrl[i].items()}, "labels": rows[i]["labels"]} for i in range(6)])


# ----------------------------------------------------------------------------------------------- PyTorch
def collate_in_worker(row: dict) -> dict:
    """The DataLoader's default conversion, in the worker, with warnings as errors, plus the worker's id."""
    from torch.utils.data import default_convert, get_worker_info

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "The given NumPy array is not writable"
        return {**default_convert(row), "worker": get_worker_info().id}


def test_rows_are_writable_tensors_without_a_warning(caches):
    import torch

    cache = open_cache(caches["skyrl"])
    row = cache[5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = torch.from_numpy(row["input_ids"])
    ids[0] = -1  # the row's own copy
    assert cache[5]["input_ids"][0] != -1
    assert all(a.flags.writeable and a.flags.owndata for a in row.values())


def test_dataloader_with_two_spawn_workers_reads_every_row(caches):
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.utils.data import DataLoader

    cache = open_cache(caches["skyrl"])
    assert len(cache.manifest["files"]) > 2
    sent = len(ForkingPickler.dumps(cache))  # what spawn sends each worker: the path, not the rows
    assert sent < 1024 and len(pickle.dumps(cache)) < 1024
    loader = DataLoader(cache, batch_size=None, num_workers=2, multiprocessing_context="spawn",
                        collate_fn=collate_in_worker)
    rows = list(loader)
    assert len(rows) == len(cache)
    for i, row in enumerate(rows):
        assert torch.equal(row["input_ids"], torch.from_numpy(cache[i]["input_ids"]))
        assert torch.equal(row["loss_mask"], torch.from_numpy(cache[i]["loss_mask"]))
    assert {row["worker"] for row in rows} == {0, 1}
