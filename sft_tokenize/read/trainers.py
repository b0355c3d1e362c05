"""Loaders for the trainers that cannot safely be given a cache's path as it is.

    from sft_tokenize.read.trainers import for_trl
    SFTTrainer(model=..., args=SFTConfig(...), train_dataset=for_trl(cache_path))

A trainer that prepares a `datasets.Dataset` with `Dataset.map`/`filter` (TRL's SFTTrainer builds labels,
truncates and packs; axolotl adds position ids and filters by length) writes `cache-*.arrow` files next to
the dataset's own files: into a published cache, which must never change, and which fails on a read-only
mount. The loaders here open the cache through a *work view*: a directory of symbolic links to the
cache's data files (the same inodes, memory-mapped, no byte copied) plus copies of its two small metadata
files. `datasets` puts its map cache files beside the files it maps, so they land in the view, which
lives under the user's `datasets` cache; the cache stays byte for byte as published.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np

from sft_tokenize.errors import CacheError
from sft_tokenize.files import atomic_path
from sft_tokenize.format.layout import DATASET_INFO, STATE, is_mixture
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.read.layouts import LAYOUTS
from sft_tokenize.read.mixed_rows import open_mixture
from sft_tokenize.read.remote_cache import cache_location

VIEW_METADATA = (STATE, DATASET_INFO)


def default_work_root() -> Path:
    """Where views live unless told: `datasets`' own cache (HF_DATASETS_CACHE), under sft-tokenize/."""
    from datasets import config

    return Path(config.HF_DATASETS_CACHE) / "sft-tokenize"


def work_view(path: str | Path, work_dir: str | Path | None = None) -> Path:
    """A directory that `load_from_disk` opens as the cache at `path` and where a trainer's map cache files go.

    The view is `work_dir` itself when given, else one directory per cache under `default_work_root()`.
    Building it again is cheap and idempotent: links are replaced, map cache files already there are kept
    (their names are `datasets` fingerprints of the cache's, which names its content)."""
    cache = Path(path).absolute()
    manifest = read_manifest(cache)
    if work_dir is None:
        digest = hashlib.sha256(str(cache).encode()).hexdigest()[:8]
        view = default_work_root() / f"{cache.name}-{digest}"
    else:
        view = Path(work_dir).absolute()
    if view == cache or cache in view.parents:
        raise CacheError(f"{view}: the work view must be outside the cache {cache}, which is never modified")
    view.mkdir(parents=True, exist_ok=True)
    # Not durable: the view is rebuilt by every call, from the cache it mirrors.
    for entry in manifest["files"]:
        with atomic_path(view / entry["name"], durable=False) as tmp:
            tmp.symlink_to(cache / entry["name"])
    for name in VIEW_METADATA:
        with atomic_path(view / name, durable=False) as tmp:
            shutil.copyfile(cache / name, tmp)
    return view


def mixture_dataset(path: str | Path, work_dir: str | Path | None = None):
    """The mixture as one `datasets.Dataset` without copying a row: the sources' work views concatenated and
    selected through an indices mapping (what `Dataset.select` keeps), for TRL and axolotl."""
    from datasets import concatenate_datasets, load_from_disk

    mixed = open_mixture(path)
    views = [load_from_disk(str(work_view(c.path, None if work_dir is None else Path(work_dir) / c.path.name)))
             for c in mixed.caches]
    starts = np.cumsum([0] + [len(c) for c in mixed.caches])[:-1]
    return concatenate_datasets(views).select(starts[np.asarray(mixed.index.sources)] + np.asarray(mixed.index.rows))


def for_trl(path: str | Path, work_dir: str | Path | None = None, local_dir: str | Path | None = None,
            storage_options: dict | None = None):
    """The cache (or a mixture index's rows) as the `datasets.Dataset` to give TRL's `SFTTrainer` as
    `train_dataset`.

    Rows keep their `labels` (layouts trl, axolotl, llama-factory), which SFTTrainer uses as given,
    whatever `completion_only_loss` or `assistant_only_loss` say. A skyrl cache's `loss_mask` is renamed
    `assistant_masks` (a metadata change), the one mask column SFTTrainer always turns into labels.
    Whatever SFTTrainer maps (labels, truncation to `max_length`, packing) is written under the work view,
    never into the cache. A version's URL on object storage is copied into `local_dir` first (see open_cache)."""
    from datasets import load_from_disk

    path = cache_location(path, local_dir, storage_options)
    # a mixture index is the rows of several caches
    dataset = mixture_dataset(path, work_dir) if is_mixture(path) else load_from_disk(str(work_view(path, work_dir)))
    if "labels" not in dataset.column_names:
        dataset = dataset.rename_column("loss_mask", "assistant_masks")
    return dataset


def for_axolotl(path: str | Path, work_dir: str | Path | None = None, local_dir: str | Path | None = None,
                storage_options: dict | None = None) -> Path:
    """The directory to name as a dataset's `path:` in an axolotl config (`ds_type` unset): the work view
    of an axolotl-layout cache, so axolotl's own preprocessing maps write beside it, not into the cache. A
    version's URL on object storage is copied into `local_dir` first (see open_cache)."""
    path = cache_location(path, local_dir, storage_options)
    columns = read_manifest(path)["columns"]
    if columns != list(LAYOUTS["axolotl"]):
        raise CacheError(f"{path}: its columns are {', '.join(columns)}; axolotl needs exactly input_ids, "
                         "attention_mask and labels: rebuild it with `sft-tokenize run ... --layout axolotl`")
    return work_view(path, work_dir)
