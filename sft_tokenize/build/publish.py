"""publish_cache: the finished shards become a `datasets.load_from_disk` directory, no row copied.

The shards are hard-linked from the shard store (copied where links are not supported) into a fresh
directory under staging, the metadata is written beside them, and that directory is renamed to its final
name in one step: a reader sees the whole cache or none of it. A run killed during publish leaves the
store intact. Each build publishes a new version, `<name>-<fingerprint>`; earlier versions stay readable
until `store.collect_garbage` removes them.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.build.job import Job, dataset_info, job_feature_dict
from sft_tokenize.build.shard_check import finished_shard
from sft_tokenize.build.workers import vision_family
from sft_tokenize.errors import BadInput, CacheError, OutOfSpace
from sft_tokenize.files import built_directory, locked
from sft_tokenize.fingerprint import fingerprint
from sft_tokenize.format import CACHE_FORMAT_VERSION
from sft_tokenize.format.layout import (
    DATASET_INFO,
    IMAGE_FILES,
    LOCK_SUFFIX,
    MANIFEST,
    RUN_LOCK_SUFFIX,
    SET_ASIDE_SUFFIX,
    STAGED_SUFFIX,
    STATE,
    beside,
    data_file,
)
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.sources.images import changed_file, image_base
from sft_tokenize.sources.records import Slice
from sft_tokenize.version import __version__

PERCENTILES = (50, 90, 99)
logger = logging.getLogger("sft_tokenize")


def building(job: Job) -> contextlib.AbstractContextManager[None]:
    """Held by a run from tokenizing to publishing: a second run of the same fingerprint waits for the
    first, then finds its cache published, instead of tokenizing the same slices beside it. Removed on
    release, as the publish lock is: `.staging` keeps no empty lock file per version built (files.locked)."""
    return locked(beside(Path(job.staging), RUN_LOCK_SUFFIX), remove=True,
                  waiting=f"another run is building the cache {job.fingerprint}; waiting for it to finish")


def length_summary(histogram: Counter) -> dict[str, float]:
    """min, mean, percentiles and max of the row lengths, exact, from a {length: rows} histogram."""
    if not histogram:
        return {}
    values = np.array(sorted(histogram), dtype=np.int64)
    counts = np.array([histogram[v] for v in values], dtype=np.int64)
    cumulative = np.cumsum(counts)
    mean = float((values * counts).sum() / cumulative[-1])
    summary: dict[str, float] = {"min": int(values[0]), "mean": round(mean, 1)}
    for p in PERCENTILES:
        rank = int(np.ceil(p / 100 * cumulative[-1]))
        summary[f"p{p}"] = int(values[np.searchsorted(cumulative, rank)])
    summary["max"] = int(values[-1])
    return summary


# Per-shard counts about how masks were made, summed into the manifest's "masks".
MASK_COUNTS = ("rows_all_trained", "rows_exact", "rows_expanded", "rows_special_text", "tokens_straddling")
# Per-shard counts of skeleton fills, summed into the manifest's build record: they say how this build made its
# rows, not what the rows are (which process learned which shape first, and which fills the run's seed drew).
FILL_COUNTS = ("rows_filled", "rows_checked", "skeleton_mismatches")


def describe_drops(dropped: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in sorted(dropped.items())) or "none"


def total_drops(shards: list[dict]) -> Counter:
    """Rows dropped by reason, over the shards' sidecars."""
    dropped: Counter = Counter()
    for shard in shards:
        dropped.update(shard["dropped"])
    return dropped


def build_manifest(job: Job, slices: list[Slice], shards: list[dict], files: list[dict], inputs: dict,
                   name: str) -> dict[str, Any]:
    dropped = total_drops(shards)
    lengths: Counter = Counter()
    for shard in shards:
        lengths.update(dict(zip(shard["lengths"]["values"], shard["lengths"]["counts"], strict=True)))
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "tool_version": __version__,
        "name": name,
        "fingerprint": job.fingerprint,
        "fingerprint_inputs": inputs,
        # where it was loaded from, for `inspect --row` (not fingerprinted)
        "tokenizer": job.tokenizer_url or job.tokenizer_dir,
        "tokenization_fingerprint": job.tokenization,
        "layout": job.layout,
        "columns": list(job_feature_dict(job)),
        "rows": sum(s["rows"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "trained_tokens": sum(s["trained_tokens"] for s in shards),
        "dropped": dict(sorted(dropped.items())),
        "masks": {key: sum(s.get(key, 0) for s in shards) for key in MASK_COUNTS},
        "render": job.render,
        "build": {"skeletons": {key: sum(s.get(key, 0) for s in shards) for key in FILL_COUNTS}},
        "lengths": length_summary(lengths),
        **({"images": image_record(job, slices, shards)} if job.processor_config else {}),
        "files": files,
        "shards": [{"slice": slice_.describe(), "key": slice_.key,
                    **{k: s[k] for k in ("rows", "tokens", "trained_tokens", "dropped", "seconds")}}
                   for slice_, s in zip(slices, shards, strict=True)],
    }


def image_record(job: Job, slices: list[Slice], shards: list[dict]) -> dict[str, Any]:
    """What a reader of an image cache needs (the collator rebuilds the processor's pixels from it, and reads
    referenced images under the same access policy and roots) and what it holds: FORMAT.md, "Image rows"."""
    vision = vision_family(job)
    config = vision.config_fingerprint()
    roots = [job.image_root if "://" in job.image_root else os.path.abspath(job.image_root)] if job.image_root \
        else sorted({image_base(part.url) for slice_ in slices for part in slice_.parts})
    return {"mode": job.images, "access": job.image_access, "roots": roots,
            "family": vision.name, "pil_class": vision.pil_class,
            "settings": json.loads(vision.settings_json), "image_token_ids": config["image_token_ids"],  # run order
            "config": config, "image_files": len(image_files(shards)),
            **{key: sum(s.get(key, 0) for s in shards) for key in ("images", "image_tokens", "image_bytes")},
            **({"pixel_bytes": sum(s.get("pixel_bytes", 0) for s in shards)} if "pixel_values" in job.extra_columns
               else {})}



def is_published(path: Path, storage_options: dict | None = None, timeout: float | None = None) -> bool:
    """A valid cache is at `path` and none of the image files its rows were made from changed since (a
    stale one is built again and replaced)."""
    try:
        read_manifest(path)
    except CacheError:
        return False
    return changed_image(path, storage_options, timeout) is None


def changed_image(path: Path, storage_options: dict | None = None, timeout: float | None = None) -> str | None:
    """The first image file of the cache at `path` that changed since it was built, or None (`timeout`: of each
    remote file's answer)."""
    try:
        files = json.loads((path / IMAGE_FILES).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return f"{path / IMAGE_FILES} (unreadable: {error})"
    return changed_file(files, storage_options, timeout)


def image_files(shards: list[dict]) -> list[list]:
    """The image files of all these shards, one entry per URL, sorted."""
    return sorted({entry[0]: entry for meta in shards for entry in meta.get("image_files", ())}.values())


def refuse_empty(slices: list[Slice], shards: list[dict]) -> None:
    """A cache with no row is not published: say which input gave none and why."""
    if any(s["rows"] for s in shards):
        return
    dropped = total_drops(shards)
    sources = list(dict.fromkeys(part.url for slice_ in slices for part in slice_.parts))
    where = sources[0] if len(sources) == 1 else f"{sources[0]} and {len(sources) - 1} more files"
    raise BadInput(f"{where}: no row has a trained token: {sum(dropped.values())} rows dropped "
                   f"({describe_drops(dropped)}); nothing was published")


def state_text(job: Job, files: list[dict], read_from: list[list]) -> str:
    """The cache's state.json, as `datasets` writes it: its data files and its fingerprint."""
    # datasets' fingerprint of the cache: the image files' versions are a part of what it is made of
    content = fingerprint({"cache": job.fingerprint, "image_files": read_from}) if read_from else job.fingerprint
    state = {"_data_files": [{"filename": f["name"]} for f in files], "_fingerprint": content,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    return json.dumps(state, indent=2, sort_keys=True)


def stamp(manifest: dict, slices: int, reused: int, timings: dict | None, started: float) -> None:
    """What the manifest says about the build that published it."""
    manifest["build"] = {"published_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds"),
                         "slices_reused": reused, "slices_tokenized": slices - reused, **manifest.get("build", {})}
    manifest["timings"] = {**(timings or {}), "publish_seconds": round(time.monotonic() - started, 3)}


@contextlib.contextmanager
def out_of_space(cache_path: Path, job: Job, shards: int) -> Iterator[None]:
    """A full disk (or quota) while publishing is one line naming the cache and what a rerun reuses."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f"{error.filename}" if error.filename else str(cache_path)
        raise OutOfSpace(f"{where}: {error.strerror} while publishing {cache_path.name}; nothing was published, and "
                         f"the {shards} finished shards stay in {job.store}: free space under {cache_path.parent}, "
                         "then run the same command again: it reuses every shard and only publishes") from None


def publish_cache(job: Job, slices: list[Slice], cache_path: Path, inputs: dict, name: str,
                  timings: dict | None = None, reused: int = 0) -> Path:
    """Check every shard, then publish them as the cache at `cache_path`; returns that path. `reused`: how
    many slices' shards the store held before this build, recorded in the manifest."""
    started = time.monotonic()
    shards = []
    for slice_ in slices:
        meta = finished_shard(job, slice_)
        if meta is None:
            raise CacheError(f"slice {slice_.index} has no finished shard in {job.store}")
        shards.append(meta)
    staging = Path(job.staging)
    with locked(beside(staging, LOCK_SUFFIX), remove=True):
        # Left by a run killed while publishing; under the lock no other run is building them.
        for leftover in [*staging.parent.glob(f"{staging.name}{STAGED_SUFFIX}-*"),
                         *staging.parent.glob(f"{staging.name}{SET_ASIDE_SUFFIX}-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        # another run with the same fingerprint got there first
        if is_published(cache_path, job.storage_options, job.image_timeout):
            return cache_path
        refuse_empty(slices, shards)
        kept = [(s, slice_) for s, slice_ in zip(shards, slices, strict=True) if s["rows"]]
        # A corrupt cache at cache_path (is_published said no) is replaced, never served.
        staged, set_aside = beside(staging, STAGED_SUFFIX), beside(staging, SET_ASIDE_SUFFIX)
        with out_of_space(cache_path, job, len(kept)), built_directory(cache_path, staged, set_aside) as building:
            files = []
            for k, (meta, slice_) in enumerate(kept):
                target = building / data_file(k, len(kept))
                source = job.shard_path(slice_)
                try:
                    os.link(source, target)
                except OSError:  # a filesystem without hard links: the store keeps its copy for the next build
                    shutil.copyfile(source, target)
                files.append({"name": target.name, "bytes": meta["bytes"], "digest": meta["digest"],
                              "rows": meta["rows"], "tokens": meta["tokens"]})
            read_from = image_files(shards)
            if read_from:
                (building / IMAGE_FILES).write_text(json.dumps(read_from))
            (building / STATE).write_text(state_text(job, files, read_from))
            (building / DATASET_INFO).write_bytes(dataset_info(job))
            manifest = build_manifest(job, slices, shards, files, inputs, name)
            stamp(manifest, len(slices), reused, timings, started)
            (building / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return cache_path
