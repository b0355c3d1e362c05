"""The shard store of a remote cache root (FORMAT.md, "A remote cache root"): shards uploaded by the process
that made them, checked before reuse, leased while a build runs, and garbage-collected.

    URL/.shards/<key>.arrow     the shard, byte for byte a local store's (uploaded with put_file: multipart
                                for a large one, so an upload cut short leaves no visible object)
    URL/.shards/<key>.json      its sidecar plus the object's ETag, uploaded after the shard: a sidecar means
                                the shard object is complete
    URL/.staging/<fingerprint>.lease.json   {"keys", "written_at"}: a running build's keys

There is no rename and no lock on a bucket. Two writers of one key write the same bytes (the key is their
content), so their uploads are idempotent: the last one stands, and either sidecar describes it. A shard is
reused when its sidecar is there and the object still has the sidecar's size and ETag; any other (replaced,
rewritten, truncated) is named in a warning and tokenized again. A build writes its lease before it looks at
the store and rewrites it every LEASE_RENEW_SECONDS while it runs, and gc keeps what a lease younger than its
grace period (`--grace`, an hour by default) names. A build checks its shard objects again once its manifest is
written, and withdraws the version if a gc with a shorter grace removed any meanwhile (remote_publish.py).

What a crashed writer leaves, and what gc does with it:
    a shard object without a sidecar, or with one   an unreferenced shard: removed once no lease younger than
                                                    the grace names it
    its lease                                       removed once older than the grace
    an incomplete multipart upload (invisible)      aborted once older than the grace (S3)
    its local working copy                          reused by the next run on that machine, or left in the
                                                    user's cache (REMOTE_BUILDS) to delete by hand
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sft_tokenize.build.job import Job
from sft_tokenize.build.ownership import FINGERPRINT, foreign_files, is_key, not_a_version, store_key
from sft_tokenize.build.remote_root import root_filesystem
from sft_tokenize.build.shard_check import sidecar_path, sidecar_verdict
from sft_tokenize.build.stopping import in_background
from sft_tokenize.build.store import Collected
from sft_tokenize.errors import Failed, one_line
from sft_tokenize.files import REQUEST_TIMEOUT
from sft_tokenize.format.layout import (
    ETAG,
    LEASE_SUFFIX,
    MANIFEST,
    PREFECT_RESULTS,
    SHARD_STORE,
    SHARD_SUFFIX,
    SIDECAR_SUFFIX,
    STAGING,
)
from sft_tokenize.remote_requests import unanswered
from sft_tokenize.sources.records import Slice

logger = logging.getLogger("sft_tokenize")
T = TypeVar("T")

GRACE_SECONDS = 3600.0  # gc's default: leases, shards and uploads younger than this may be a live build's


def unreachable(error: BaseException, fs: Any, url: str, timeout: float) -> Failed | None:
    """What a request to the root that was refused or got no answer becomes: one line naming the root and its
    endpoint, and what to do; None for any other error."""
    reason = unanswered(error, fs, url, timeout)
    if reason is None:
        return None
    return Failed(f"{reason}; check that the endpoint is up and reachable from here, then run the same command again")


def reaching(function: Callable[..., T]) -> Callable[..., T]:
    """A request to the job's root (its first argument) that is refused or gets no answer fails as one line
    naming the endpoint (unreachable())."""
    @functools.wraps(function)
    def bounded(job: Job, *args: Any, **kwargs: Any) -> T:
        try:
            return function(job, *args, **kwargs)
        except Exception as error:
            fs, _ = root_filesystem(job.remote_root, job.storage_options, job.request_timeout)
            if failed := unreachable(error, fs, job.remote_root, job.request_timeout):
                raise failed from error
            raise

    return bounded


def etag(info: dict) -> str | None:
    """An object's ETag as the store reports it (S3 `ETag`, GCS `etag`), None if it has none."""
    return info.get("ETag") or info.get("etag")


def _store(job: Job) -> tuple[Any, str]:
    fs, root = root_filesystem(job.remote_root, job.storage_options, job.request_timeout)
    return fs, f"{root}/{SHARD_STORE}"


def list_shards(fs: Any, store: str) -> dict[str, dict]:
    """The store's objects by name, with size and ETag: one LIST (paginated by the store's client)."""
    try:
        return {info["name"].rsplit("/", 1)[-1]: info for info in fs.ls(store, detail=True, refresh=True)}
    except FileNotFoundError:
        return {}


def _verdict(job: Job, slice_: Slice, fs: Any, store: str, sidecar: dict | None,
             shard: dict | None) -> tuple[dict | None, str | None]:
    """(the sidecar of a complete, unchanged shard object, None), or (None, why not: None when there is nothing
    to trust, a message naming the object when it is damaged)."""
    if sidecar is None:
        return None, None
    where = f"{fs.unstrip_protocol(store)}/{slice_.key}"
    trusted, problem = sidecar_verdict(job, slice_, sidecar, where + SIDECAR_SUFFIX)
    if not trusted:
        return None, problem
    if shard is None:
        return None, f"{where}{SHARD_SUFFIX}: missing, though its sidecar is there"
    if shard.get("size") != sidecar["bytes"] or etag(shard) != sidecar.get(ETAG):
        return None, (f"{where}{SHARD_SUFFIX}: {shard.get('size'):,} bytes, ETag {etag(shard)}; its sidecar says "
                      f"{sidecar['bytes']:,} bytes, ETag {sidecar.get(ETAG)}: the shard object was replaced or "
                      "corrupted")
    return sidecar, None


def _read_sidecar(fs: Any, path: str) -> dict | None:
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}  # unreadable: not this shard's (sidecar_verdict names it)


@reaching
def checked_remote(job: Job, slice_: Slice) -> tuple[dict | None, str | None]:
    """This slice's shard object checked before reuse, by the task that would otherwise tokenize it."""
    fs, store = _store(job)
    sidecar = _read_sidecar(fs, f"{store}/{slice_.key}{SIDECAR_SUFFIX}")
    if sidecar is None:
        return None, None
    try:
        shard = fs.info(f"{store}/{slice_.key}{SHARD_SUFFIX}", refresh=True)
    except FileNotFoundError:
        shard = None
    return _verdict(job, slice_, fs, store, sidecar, shard)


def finished_remote(job: Job, slice_: Slice) -> dict | None:
    """The sidecar of this slice's complete shard object, or None."""
    return checked_remote(job, slice_)[0]


@reaching
def finished_all(job: Job, slices: list[Slice]) -> tuple[dict[int, dict], dict[int, str]]:
    """The slices' complete shard objects' sidecars by slice index, and what is damaged: one LIST of the store,
    and the sidecars of the shards it holds read together."""
    fs, store = _store(job)
    listing = list_shards(fs, store)
    present = [s for s in slices if f"{s.key}{SIDECAR_SUFFIX}" in listing]
    texts = fs.cat([f"{store}/{s.key}{SIDECAR_SUFFIX}" for s in present], on_error="return") if present else {}
    by_name = {path.rsplit("/", 1)[-1]: text for path, text in texts.items()}
    done: dict[int, dict] = {}
    damaged: dict[int, str] = {}
    for slice_ in present:
        text = by_name.get(f"{slice_.key}{SIDECAR_SUFFIX}")
        try:
            sidecar = json.loads(text) if isinstance(text, bytes) else None
        except ValueError:
            sidecar = {}
        meta, problem = _verdict(job, slice_, fs, store, sidecar, listing.get(f"{slice_.key}{SHARD_SUFFIX}"))
        if meta is not None:
            done[slice_.index] = meta
        elif problem:
            damaged[slice_.index] = problem
    return done, damaged


@reaching
def changed_shards(job: Job, kept: list[tuple[dict, Slice]]) -> list[int]:
    """Of these (sidecar, slice) pairs, the slices whose shard object is gone or is no longer the sidecar's: one
    LIST of the store."""
    fs, store = _store(job)
    listing = list_shards(fs, store)
    changed = []
    for meta, slice_ in kept:
        shard = listing.get(f"{slice_.key}{SHARD_SUFFIX}")
        if shard is None or shard.get("size") != meta["bytes"] or etag(shard) != meta.get(ETAG):
            changed.append(slice_.index)
    return changed


@reaching
def upload_shard(job: Job, slice_: Slice) -> dict:
    """Upload this process's finished local shard of the slice, then its sidecar with the object's ETag, then
    remove the local copy; returns the remote sidecar."""
    fs, store = _store(job)
    local = job.shard_path(slice_)
    meta = json.loads(sidecar_path(local).read_text())
    target = f"{store}/{slice_.key}{SHARD_SUFFIX}"
    fs.put_file(str(local), target)  # a single PUT, or multipart for a large file: visible only when complete
    meta[ETAG] = etag(fs.info(target, refresh=True))
    fs.pipe_file(f"{store}/{slice_.key}{SIDECAR_SUFFIX}", json.dumps(meta).encode())
    local.unlink(missing_ok=True)
    sidecar_path(local).unlink(missing_ok=True)
    return meta


def _lease(job: Job) -> tuple[Any, str]:
    fs, root = root_filesystem(job.remote_root, job.storage_options, job.request_timeout)
    return fs, f"{root}/{STAGING}/{job.fingerprint}{LEASE_SUFFIX}"


LEASE_RENEW_SECONDS = 60.0  # how often a running build rewrites its lease: gc keeps what a young lease names


def _write_lease(fs: Any, lease: str, keys: list[str]) -> None:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    fs.pipe_file(lease, json.dumps({"keys": keys, "written_at": now}).encode())


@contextlib.contextmanager
def _renewing(fs: Any, lease: str, keys: list[str]) -> Iterator[None]:
    """Rewrite the lease every LEASE_RENEW_SECONDS while the block runs, so that a build longer than gc's grace
    keeps its shards; a failed renewal is said once and tried again at the next beat."""
    stop = threading.Event()

    def renew() -> None:
        failed = False
        while not stop.wait(LEASE_RENEW_SECONDS):
            try:
                _write_lease(fs, lease, keys)
                failed = False
            except Exception as error:  # noqa: BLE001 - any store's error: the build goes on, gc may not see it
                if not failed:
                    logger.warning("%s: could not renew this build's lease (%s: %s); a gc with a grace shorter "
                                   "than this build may remove its shards, which publishing then finds missing",
                                   fs.unstrip_protocol(lease), type(error).__name__, one_line(error))
                failed = True

    with in_background(renew, "lease-renewal", stop):
        yield


@contextlib.contextmanager
def remote_leased(job: Job, slices: list[Slice]) -> Iterator[set[int]]:
    """Lease the slices' keys (an object gc reads, rewritten while the build runs) for this build; yields the
    indices of the slices whose shard object is complete and unchanged, which this build reuses. The lease is
    deleted when the build ends."""
    fs, lease = _lease(job)
    keys = sorted({s.key for s in slices})
    reaching(lambda job: _write_lease(fs, lease, keys))(job)
    try:
        with _renewing(fs, lease, keys):
            done, damaged = finished_all(job, slices)
            for index, problem in sorted(damaged.items()):
                logger.warning("%s; slice %d is tokenized again", problem, index)
            yield set(done)
    finally:
        try:
            fs.rm_file(lease)
        except Exception as error:  # noqa: BLE001 - never in the place of the error that ends the build
            logger.warning("%s: could not delete this build's lease (%s: %s); gc removes it once older than its "
                           "grace", fs.unstrip_protocol(lease), type(error).__name__, one_line(error))


def _age(info: dict, now: float) -> float:
    """Seconds since the object was last written (S3 LastModified, GCS updated); 0 if the store does not say."""
    when = info.get("LastModified") or info.get("updated") or info.get("mtime")
    if isinstance(when, str):
        when = datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))
    if isinstance(when, datetime.datetime):
        return now - when.timestamp()
    return 0.0


def remote_versions(fs: Any, root: str) -> dict[str, list[tuple[str, dict]]]:
    """Every version under the remote root that this tool wrote (ownership.py) by name, newest first: (its path,
    its manifest)."""
    by_name: dict[str, list[tuple[str, str, dict]]] = {}
    for path in fs.ls(root, detail=False, refresh=True):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("."):
            continue
        try:
            manifest = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))
        except (FileNotFoundError, IsADirectoryError, ValueError):
            continue  # no manifest: not a version (or one being removed)
        if not_a_version(name, manifest, remote=True):
            continue  # someone else's folder, whatever its manifest.json says
        build = manifest.get("build")
        found = (str(build.get("published_at", "")) if isinstance(build, dict) else "", path, manifest)
        by_name.setdefault(manifest["name"], []).append(found)
    return {name: [(path, manifest) for _, path, manifest in sorted(found, key=lambda v: v[0], reverse=True)]
            for name, found in by_name.items()}


def _live_keys(fs: Any, root: str, grace: float, now: float, done: Collected) -> set[str]:
    """The keys leased by builds whose lease is younger than `grace` (counted in `done.live_builds`); older leases
    are removed, and their ages recorded in `done.ignored_leases`."""
    live: set[str] = set()
    try:
        leases = [info for info in fs.ls(f"{root}/{STAGING}", detail=True, refresh=True)
                  if info["name"].endswith(LEASE_SUFFIX)]
    except FileNotFoundError:
        return live
    for info in leases:
        if not FINGERPRINT.fullmatch(info["name"].rsplit("/", 1)[-1].removesuffix(LEASE_SUFFIX)):
            continue  # not a lease this tool wrote
        if (age := _age(info, now)) >= grace:
            fs.rm_file(info["name"])
            done.ignored_leases[fs.unstrip_protocol(info["name"])] = age
            continue
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
            live.update(json.loads(fs.cat_file(info["name"]))["keys"])
            done.live_builds += 1
    return live


def abort_stale_uploads(fs: Any, root: str, grace: float, now: float) -> int:
    """Abort the multipart uploads under the root older than `grace` (crashed writers'); S3 only. Returns how
    many."""
    if not hasattr(fs, "call_s3"):
        return 0
    bucket, _, prefix = root.partition("/")
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    aborted = 0
    for upload in uploads:
        folder, _, name = upload["Key"].rpartition("/")
        if folder != f"{prefix}/{SHARD_STORE}".lstrip("/") or store_key(name) is None:
            continue  # not a shard's upload: someone else's
        if now - upload["Initiated"].timestamp() >= grace:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
    return aborted


def collect_remote_garbage(url: str, keep: int = 1, grace: float = GRACE_SECONDS, storage_options: dict | None = None,
                           names: set[str] | None = None, timeout: float = REQUEST_TIMEOUT) -> Collected:
    """Remove every version but the newest `keep` of each name (of `names` only, if given), each by deleting its
    manifest first (a reader sees a whole version or none); then every shard object that no kept version names
    and no lease younger than `grace` seconds names; then stale leases and incomplete uploads (module doc). A
    request refused or unanswered within `timeout` seconds ends it in one line naming the endpoint."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    fs, root = root_filesystem(url, storage_options, timeout)
    try:
        return _collect(fs, root, keep, grace, names)
    except Exception as error:
        if reason := unanswered(error, fs, url, timeout):
            raise Failed(f"{reason}; check that the endpoint is up and reachable from here, then run gc again "
                         "(what it removed is gone, the rest is as it was)") from error
        raise


def _collect(fs: Any, root: str, keep: int, grace: float, names: set[str] | None) -> Collected:
    now = time.time()
    done = Collected()
    live = _live_keys(fs, root, grace, now, done)
    referenced = set(live)
    for name, versions in remote_versions(fs, root).items():
        for position, (path, manifest) in enumerate(versions):
            if position < keep or (names is not None and name not in names):
                done.kept.append(path.rsplit("/", 1)[-1])
                referenced.update(f["key"] for f in manifest.get("files", []) if "key" in f)
                continue
            held = [found.removeprefix(f"{path}/") for found in fs.find(path)]
            if foreign := foreign_files(held, manifest, remote=True):
                done.left[path.rsplit("/", 1)[-1]] = foreign
                referenced.update(f["key"] for f in manifest.get("files", []) if "key" in f)
                continue
            fs.rm_file(f"{path}/{MANIFEST}")  # first: from here on no reader takes it for a version
            rest = [f"{path}/{own}" for own in held if own != MANIFEST]
            if rest:
                fs.rm(rest)  # its own objects, one by one: never the prefix
            done.removed.append(path.rsplit("/", 1)[-1])
    store = f"{root}/{SHARD_STORE}"
    doomed = []
    for name, info in list_shards(fs, store).items():
        key = store_key(name)
        if key is None or info.get("type") == "directory":  # not a shard or sidecar this tool wrote
            continue
        if key in referenced:
            done.shards_kept += name.endswith(SHARD_SUFFIX)
            continue
        if name.endswith(SHARD_SUFFIX):
            done.shards_removed += 1
            done.bytes_freed += info.get("size") or 0
        doomed.append(info["name"])
    try:
        results = fs.ls(f"{root}/{PREFECT_RESULTS}", detail=True, refresh=True)
    except FileNotFoundError:
        results = []
    for info in results:
        name = info["name"].rsplit("/", 1)[-1]
        if info.get("type") != "directory" and is_key(name) and name not in referenced:
            doomed.append(info["name"])
            done.results_removed += 1
    if doomed:
        fs.rm(doomed)
    done.uploads_aborted = abort_stale_uploads(fs, root, grace, now)
    return done
