"""The shard store and its garbage collector: shards by content key, shared by every cache under one root.

    CACHE_ROOT/.shards/<key>.arrow, <key>.json    finished shards (immutable once renamed into place)
    CACHE_ROOT/.staging/<fingerprint>.lease.json  the keys a running build uses

A published cache holds hard links to store shards, so removing a store entry never breaks a cache: it
only means the next build that needs those bytes tokenizes them again. What gc must never do is remove a
shard a build is about to link. Builds therefore lease their keys, and the lease and gc's sweep exclude
each other through one lock file, `.shards/.gc.lock`:

    build  holds `<fingerprint>.run.lock` (flock), then, under a shared flock of .gc.lock, writes its lease
           and only then looks at which shards the store already has; it drops the lease after publishing
    gc     under an exclusive flock of .gc.lock, reads every lease whose run lock is held (a live build),
           and the manifests of the versions it keeps, and removes everything else

so a build either registered before gc looked (its shards are kept) or looks at the store after gc is done
(it tokenizes whatever gc removed). A lease whose run lock nobody holds belongs to a killed build: its
shards are garbage like any other unreferenced shard.

A mixture index names the versions it reads (`source_caches` in its mixture.json). gc keeps every version
that an index under `CACHE_ROOT/.mixtures/` reads, however old, and says which index holds it: removing the
version would leave the index unreadable, and removing the index would take a training run's data order
away without being asked. Remove the index (its directory) and gc again to free them. An index written
elsewhere (`--index-dir`) is not seen.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sft_tokenize.build.job import Job
from sft_tokenize.build.ownership import foreign_files, is_key, not_a_version, store_key
from sft_tokenize.build.shard_check import finished_shard, sidecar_path
from sft_tokenize.errors import CacheError
from sft_tokenize.files import atomic_write, is_locked, locked
from sft_tokenize.format.layout import (
    DELETING,
    GC_LOCK,
    LEASE_SUFFIX,
    LOCK_SUFFIX,
    MANIFEST,
    MIXTURE_INDEX,
    MIXTURES,
    PREFECT_RESULTS,
    RUN_LOCK_SUFFIX,
    SHARD_STORE,
    SHARD_SUFFIX,
    STAGED_SUFFIX,
    STAGING,
    beside,
)
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.sources.records import Slice

logger = logging.getLogger("sft_tokenize")


def store_dir(root: Path) -> Path:
    return Path(root) / SHARD_STORE


def lease_path(job: Job) -> Path:
    return beside(Path(job.staging), LEASE_SUFFIX)



@contextlib.contextmanager
def leased(job: Job, slices: list[Slice]) -> Iterator[set[int]]:
    """Lease the slices' keys for this build (held inside `publish.building(job)`); yields the indices of the
    slices whose shard the store already holds, which this build reuses instead of tokenizing."""
    store = Path(job.store)
    store.mkdir(parents=True, exist_ok=True)
    lease = lease_path(job)
    with locked(store / GC_LOCK, waiting="the shard store is being garbage-collected; waiting", shared=True):
        # Not durable: a lease lives only as long as its build, which a crash ends too.
        atomic_write(lease, json.dumps({"keys": sorted({s.key for s in slices})}), durable=False)
        reused = {s.index for s in slices if finished_shard(job, s) is not None}
    try:
        yield reused
    finally:
        lease.unlink(missing_ok=True)


def _live_keys(staging: Path, remove_dead: bool = False, besides: Path | None = None) -> tuple[set[str], int]:
    """The keys leased by live builds (their run lock is held), and how many builds; call under .gc.lock.
    `remove_dead`: delete the leases of killed builds; `besides`: a lease not to count (the caller's own)."""
    live: set[str] = set()
    builds = 0
    for lease in sorted(staging.glob(f"*{LEASE_SUFFIX}")):
        if lease == besides:
            continue
        job_staging = staging / lease.name.removesuffix(LEASE_SUFFIX)
        if is_locked(beside(job_staging, RUN_LOCK_SUFFIX)):
            with contextlib.suppress(OSError, ValueError):
                live.update(json.loads(lease.read_text())["keys"])
                builds += 1
        elif remove_dead:
            lease.unlink(missing_ok=True)
    return live, builds


def published_versions(root: Path) -> dict[str, list[tuple[Path, dict]]]:
    """Every published cache under `root` that this tool wrote (ownership.py) by its name, newest first."""
    by_name: dict[str, list[tuple[str, Path, dict]]] = {}
    for path in sorted(Path(root).iterdir()):
        if path.name.startswith(".") or not path.is_dir():
            continue
        try:
            manifest = read_manifest(path)
        except CacheError:
            continue
        if not_a_version(path.name, manifest, remote=False):
            continue
        when = manifest.get("build", {}).get("published_at") or datetime.datetime.fromtimestamp(
            (path / MANIFEST).stat().st_mtime, datetime.UTC).isoformat(timespec="microseconds")
        by_name.setdefault(manifest["name"], []).append((when, path, manifest))
    return {name: [(path, manifest) for _, path, manifest in sorted(found, key=lambda v: v[0], reverse=True)]
            for name, found in by_name.items()}


def mixture_holds(root: Path) -> dict[str, str]:
    """The versions under `root` that a mixture index in `root/.mixtures` reads: version name → an index's path."""
    held: dict[str, str] = {}
    root = Path(os.path.realpath(root))
    for meta in sorted((root / MIXTURES).glob(f"*/{MIXTURE_INDEX}")):
        try:
            caches = json.loads(meta.read_text())["source_caches"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not an index anything can read
        for cache in caches:
            path = Path(os.path.realpath(cache))
            if path.parent == root:
                held.setdefault(path.name, str(meta.parent))
    return held


@dataclass
class Collected:
    """What one garbage collection did."""

    kept: list[str] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)  # kept only because a mixture index reads it: its path
    removed: list[str] = field(default_factory=list)
    left: dict[str, list[str]] = field(default_factory=dict)  # not removed: it holds files this tool did not write
    live_builds: int = 0
    ignored_leases: dict[str, float] = field(default_factory=dict)  # a remote lease older than the grace: its age
    shards_kept: int = 0
    shards_removed: int = 0
    bytes_freed: int = 0  # of shards no cache held a link to, and of removed versions' files no other name held
    results_removed: int = 0  # Prefect task results (by slice key) no kept version or running build names
    uploads_aborted: int = 0  # a remote root's incomplete multipart uploads, left by crashed writers


def held_files(path: Path) -> list[str]:
    """Every file and directory under `path`, relative to it."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def remove_cache(path: Path) -> int:
    """Rename aside, then delete (readers see a whole cache or none, and gc finishes a deletion a kill cut
    short); returns the bytes actually freed."""
    doomed = beside(path, f"{DELETING}-{uuid.uuid4().hex[:8]}", hidden=True)
    os.rename(path, doomed)
    freed = sum(f.stat().st_size for f in doomed.iterdir() if f.is_file() and f.stat().st_nlink == 1)
    shutil.rmtree(doomed)
    return freed


def collect_garbage(root: Path, keep: int = 1, names: set[str] | None = None) -> Collected:
    """Remove every published version but the newest `keep` of each name (of `names` only, if given) and those a
    mixture index reads, then every store shard that no kept version and no running build references. Safe
    while other runs build and publish (module doc)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    root = Path(root)
    store, staging = store_dir(root), root / STAGING
    store.mkdir(parents=True, exist_ok=True)
    done = Collected()
    with locked(store / GC_LOCK):
        live, done.live_builds = _live_keys(staging, remove_dead=True)
        referenced = set(live)
        mixed = mixture_holds(root)
        for name, versions in published_versions(root).items():
            for position, (path, manifest) in enumerate(versions):
                if position < keep or (names is not None and name not in names) or path.name in mixed:
                    done.kept.append(path.name)
                    if position >= keep and path.name in mixed:
                        done.held[path.name] = mixed[path.name]
                    referenced.update(s["key"] for s in manifest["shards"] if "key" in s)
                elif foreign := foreign_files(held_files(path), manifest, remote=False):
                    done.left[path.name] = foreign
                    referenced.update(s["key"] for s in manifest["shards"] if "key" in s)
                else:
                    done.bytes_freed += remove_cache(path)
                    done.removed.append(path.name)
        for shard in sorted(store.iterdir()):
            key = store_key(shard.name, temporary=True)
            if key is None or not shard.is_file():  # not a shard or sidecar this tool wrote: someone else's
                continue
            if ".tmp-" in shard.name:  # a shard being written: only a live build still needs one
                if key not in live:
                    shard.unlink(missing_ok=True)
                continue
            if key in referenced:
                done.shards_kept += shard.suffix == SHARD_SUFFIX
                continue
            if shard.suffix == SHARD_SUFFIX:
                done.shards_removed += 1
                done.bytes_freed += shard.stat().st_size if shard.stat().st_nlink == 1 else 0
            shard.unlink(missing_ok=True)
        done.results_removed = remove_results(root / PREFECT_RESULTS, referenced)
        # Left by killed runs: half-deleted versions, half-built caches whose publish lock nobody holds.
        for leftover in root.glob(f".*{DELETING}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in staging.glob(f"*{STAGED_SUFFIX}-*"):
            fingerprint = leftover.name.split(f"{STAGED_SUFFIX}-", 1)[0]
            if not is_locked(beside(staging / fingerprint, LOCK_SUFFIX)):
                shutil.rmtree(leftover, ignore_errors=True)
    return done


def remove_results(results: Path, referenced: set[str]) -> int:
    """Remove the Prefect task results (named by their slice's content key) under `results` that no kept version
    and no running build names; returns how many. Any other file there is left alone."""
    removed = 0
    for result in sorted(results.iterdir()) if results.is_dir() else []:
        if is_key(result.name) and result.name not in referenced and result.is_file():
            result.unlink(missing_ok=True)
            removed += 1
    return removed


def discard_shards(job: Job, slices: list[Slice]) -> int:
    """Remove these slices' shards from the store (a forced rebuild), but those another running build has
    leased: it may be about to link them (those are checked, then reused). Returns how many were removed."""
    store = Path(job.store)
    store.mkdir(parents=True, exist_ok=True)
    removed = kept = 0
    with locked(store / GC_LOCK, waiting="the shard store is being garbage-collected; waiting"):
        in_use, _ = _live_keys(Path(job.staging).parent, besides=lease_path(job))
        for slice_ in slices:
            shard = job.shard_path(slice_)
            if slice_.key in in_use:
                kept += shard.exists()
                continue
            removed += shard.exists()
            shard.unlink(missing_ok=True)
            sidecar_path(shard).unlink(missing_ok=True)
    if kept:
        logger.warning("force: kept %d shards of this plan that another running build uses; they are checked "
                       "against their sidecars and reused", kept)
    return removed
