"""Does a trainer's own data path train exactly the tokens the cache marks? Checked on batches it makes itself.

    verify_trainer("/data/cache/ultrachat-3f2a9c1d0b7e4f65", "trl", batches=8)    # a TrainerCheck, or raises

For each trainer the dataset and collator are the trainer's own, built from its installed package the way its
trainer builds them over this cache (`for_trl`, `for_axolotl`):

    trl       SFTTrainer's dataset preparation and data collator (a tiny random model: nothing is trained)
    axolotl   axolotl's DataCollatorForSeq2Seq over the axolotl-layout cache, padded to a multiple of 64

llamafactory and skyrl are refused with what to install and why their data paths cannot run beside this
package's pins (NOT_HERE).

Every row of every batch drawn is found in the cache by its token ids, and checked token for token: its labels are
its id exactly where the cache's loss_mask is 1 and -100 elsewhere (padding included); in a padding-free batch
(`position_ids`), positions restart at 0 at each row and count up within it. No row may be drawn twice within an
epoch, and a whole epoch drawn must hold every row. The first row that differs raises a BadInput (the CLI exits 2)
naming the row, the position and how it differs.
"""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from sft_tokenize.errors import BadInput
from sft_tokenize.read.cache import TokenizedCache, open_cache
from sft_tokenize.read.row_batches import row_batches

IGNORE_INDEX = -100
TRAINERS = ("trl", "axolotl", "llamafactory", "skyrl", "megatron", "mds", "litdata")
EXPORT_READERS = ("megatron", "mds", "litdata")  # these read an export (verify_export.py), not the cache
NEEDS = {"trl": ("trl", "torch"), "axolotl": ("axolotl", "torch")}  # the modules each check imports
# Trainers whose own data path cannot be installed beside this package's pins: why, and what runs it elsewhere
NOT_HERE = {
    "llamafactory": "LLaMA-Factory's data path (llamafactory 0.9.5, the newest: llamafactory.data's collator) "
                    "cannot be installed beside this package's trainers extra: it requires trl<=0.24 and "
                    "datasets<=4.0 (the extra has trl 1.16) and imports torchaudio, whose newest build (2.11.0) is "
                    "for torch 2.11, not the extra's torch 2.13. Install it in an environment of its own "
                    "(pip install llamafactory==0.9.5); verify --trainer llamafactory does not run it in this version",
    "skyrl": "SkyRL's SFT data path (skyrl 0.3.0: skyrl.train.sft_trainer.collate_sft_batch) imports SkyRL's Ray "
             "training stack (ray, torchdata, loguru, jaxtyping and its Ray workers) and skyrl-train requires "
             "Python 3.12: it is not installed by any extra of this package. Install it in an environment of its "
             "own (pip install skyrl==0.3.0 and its Ray training stack); verify --trainer skyrl does not run it in "
             "this version",
}
EXTRA = {"trl": "pip install torch==2.13.0 -e '.[trainers]'",
         "axolotl": "pip install torch==2.13.0 -e '.[trainers]' && pip install --no-deps axolotl==0.19.0"}


@dataclass
class TrainerCheck:
    trainer: str
    batches: int
    rows: int  # rows checked (each drawn once)
    tokens: int
    trained: int  # tokens the trainer trains, all equal to the cache's


class _RowFinder:
    """A cache row by its token ids: 64-bit digests of every row's ids, sorted (16 bytes a row)."""

    def __init__(self, cache: TokenizedCache):
        digests = np.empty(len(cache), dtype=np.uint64)
        for batch in row_batches(cache):
            for i in range(len(batch)):
                digests[batch.first + i] = xxhash.xxh3_64_intdigest(
                    batch.input_ids[batch.offsets[i]:batch.offsets[i + 1]])
        self.order = np.argsort(digests, kind="stable")
        self.sorted = digests[self.order]
        self.cache = cache

    def find(self, ids: np.ndarray) -> int | None:
        digest = np.uint64(xxhash.xxh3_64_intdigest(np.ascontiguousarray(ids, dtype=np.int32)))
        at = int(np.searchsorted(self.sorted, digest))
        while at < len(self.sorted) and self.sorted[at] == digest:
            row = int(self.order[at])
            if np.array_equal(self.cache[row]["input_ids"], ids):
                return row
            at += 1
        return None


def _mismatch(cache: TokenizedCache, trainer: str, row: int, labels: np.ndarray, ids: np.ndarray,
              mask: np.ndarray) -> str | None:
    expected = np.where(mask == 1, ids, IGNORE_INDEX)
    wrong = np.flatnonzero(labels != expected)
    if not len(wrong):
        return None
    p = int(wrong[0])
    if mask[p] == 1 and labels[p] == IGNORE_INDEX:
        how = "does not train it, though its loss_mask is 1"
    elif mask[p] == 0:
        how = (f"trains it (label {int(labels[p])}), though its loss_mask is 0: a collator or template that "
               "re-derives labels, or a mask altered")
    else:
        how = f"trains it as id {int(labels[p])} instead of {int(ids[p])}"
    return (f"{cache.path}: row {row}: {trainer}'s data path differs from the cache at token {p} of {len(ids)} "
            f"(id {int(ids[p])}): it {how}; {len(wrong)} token(s) of the row differ")


def _pieces(batch: dict[str, Any]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Each row of a batch: (ids, labels, positions or None), padding cut off; a padding-free row of several
    sequences is cut where its positions restart at 0."""
    ids_all, labels_all = batch["input_ids"].numpy(), batch["labels"].numpy()
    positions_all = batch["position_ids"].numpy() if "position_ids" in batch else None
    for k in range(len(ids_all)):
        if positions_all is not None and ("attention_mask" not in batch or len(ids_all) == 1):
            positions = positions_all[k]
            starts = [*np.flatnonzero(positions == 0).tolist(), len(positions)]
            for a, b in zip(starts, starts[1:], strict=False):
                yield ids_all[k][a:b], labels_all[k][a:b], positions[a:b]
            continue
        n = int(batch["attention_mask"][k].sum()) if "attention_mask" in batch else len(ids_all[k])
        if np.any(labels_all[k][n:] != IGNORE_INDEX):
            raise BadInput(f"batch row {k}: {int((labels_all[k][n:] != IGNORE_INDEX).sum())} padding token(s) are "
                           "trained")
        yield ids_all[k][:n], labels_all[k][:n], None


def check_batches(cache: TokenizedCache, trainer: str, batches: Iterator[dict[str, Any]], count: int) -> TrainerCheck:
    """The check itself, over batches of torch tensors (input_ids, labels, and attention_mask or position_ids)."""
    finder = _RowFinder(cache)
    seen: set[int] = set()
    drawn = tokens = trained = 0
    whole_epoch = True  # until `count` batches were drawn before the trainer's batches ended
    for batch in batches:
        if drawn == count:
            whole_epoch = False
            break
        drawn += 1
        for ids, labels, positions in _pieces(batch):
            row = finder.find(ids)
            if row is None:
                raise BadInput(f"{cache.path}: {trainer} made a sequence of {len(ids)} tokens that is no row of the "
                               f"cache (starting {ids[:8].tolist()}): it cut, merged or changed rows")
            if row in seen and len(seen) < len(cache):
                raise BadInput(f"{cache.path}: row {row}: {trainer} drew it twice within an epoch")
            seen.add(row)
            if positions is not None and not np.array_equal(positions, np.arange(len(ids))):
                raise BadInput(f"{cache.path}: row {row}: {trainer}'s positions do not run 0..{len(ids) - 1} within "
                               "the row: packed rows would attend across each other")
            message = _mismatch(cache, trainer, row, labels, ids, cache[row]["loss_mask"].astype(np.int8)
                                if "loss_mask" in cache.columns else (cache[row]["labels"] != IGNORE_INDEX))
            if message:
                raise BadInput(message)
            tokens += len(ids)
            trained += int((labels != IGNORE_INDEX).sum())
    if whole_epoch and len(seen) < len(cache):
        missing = next(r for r in range(len(cache)) if r not in seen)
        raise BadInput(f"{cache.path}: row {missing}: {trainer} dropped it: a whole epoch was drawn without it")
    return TrainerCheck(trainer, drawn, len(seen), tokens, trained)


def _tokenizer(cache: TokenizedCache, tokenizer: Any):
    from transformers import AutoTokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    directory = tokenizer or cache.manifest.get("tokenizer")
    if not directory or not Path(directory).is_dir():
        raise BadInput(f"{cache.path}: the tokenizer it was built with ({directory or 'not recorded'}) is not here: "
                       "pass its directory (--tokenizer DIR)")
    return AutoTokenizer.from_pretrained(str(directory))


def _trl_batches(cache: TokenizedCache, tokenizer, batch_size: int, collator: Callable | None,
                 work: Path) -> Iterator[dict[str, Any]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from sft_tokenize.read.trainers import for_trl

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                         pad_token_id=tokenizer.pad_token_id))
    args = SFTConfig(output_dir=str(work / "out"), per_device_train_batch_size=batch_size, use_cpu=True,
                     report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                     dataloader_num_workers=0, max_length=None)
    trainer = SFTTrainer(model=model, args=args, train_dataset=for_trl(cache.path, work / "view"),
                         processing_class=tokenizer, **({"data_collator": collator} if collator else {}))
    yield from trainer.get_train_dataloader()


def _axolotl_batches(cache: TokenizedCache, tokenizer, batch_size: int, collator: Callable | None,
                     work: Path) -> Iterator[dict[str, Any]]:
    from axolotl.utils.collators import DataCollatorForSeq2Seq
    from datasets import load_from_disk

    from sft_tokenize.read.trainers import for_axolotl

    dataset = load_from_disk(str(for_axolotl(cache.path, work / "view")))
    collate = collator or DataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=64, return_tensors="pt")
    for start in range(0, len(dataset), batch_size):
        yield collate([dict(dataset[i]) for i in range(start, min(start + batch_size, len(dataset)))])


def verify_trainer(cache: str | Path | TokenizedCache, trainer: str, batches: int = 8, *, batch_size: int = 4,
                   tokenizer: Any = None, collator: Callable | None = None,
                   export: str | Path | None = None) -> TrainerCheck:
    """Draw `batches` batches from `trainer`'s own data path over `cache` and check them (module docstring);
    `collator` replaces the trainer's own (to check a collator of yours). megatron, mds and litdata read the export
    at `export` instead (verify_export.py). Raises BadInput naming the first row that differs, or the extra to
    install when the trainer's package is missing."""
    if trainer not in TRAINERS:
        raise BadInput(f"--trainer {trainer}: not one this version checks; choose one of {', '.join(TRAINERS)}")
    if trainer in NOT_HERE:
        raise BadInput(f"--trainer {trainer}: not checked here: {NOT_HERE[trainer]}")
    if trainer in EXPORT_READERS:
        from sft_tokenize.consumers.verify_export import verify_export

        if export is None:
            raise BadInput(f"--trainer {trainer} reads an export: name it with --export DIR (`sft-tokenize export`)")
        cache = cache if isinstance(cache, TokenizedCache) else open_cache(cache)
        rows, tokens, trained = verify_export(cache, trainer, export, batches * batch_size)
        return TrainerCheck(trainer, -(-rows // batch_size), rows, tokens, trained)
    missing = [name for name in NEEDS[trainer] if importlib.util.find_spec(name) is None]
    if missing:
        raise BadInput(f"--trainer {trainer}: {', '.join(missing)} is not installed here: {EXTRA[trainer]}")
    cache = cache if isinstance(cache, TokenizedCache) else open_cache(cache)
    tokenizer = _tokenizer(cache, tokenizer)
    make = _trl_batches if trainer == "trl" else _axolotl_batches
    with tempfile.TemporaryDirectory(prefix="sft-tokenize-verify-") as work, warnings.catch_warnings():
        # the trainers' advice about training arguments says nothing about the data path checked here
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        return check_batches(cache, trainer, make(cache, tokenizer, batch_size, collator, Path(work)), batches)
