"""A cache published on object storage, materialized on this machine as an ordinary published cache.

    path = materialize("s3://bucket/caches/ultrachat-3f2a9c1d0b7e4f65")   # the version's URL, as a run prints it
    open_cache(path)                                                     # or datasets.load_from_disk(path)

A URL names one published version: `ROOT/<name>-<fingerprint>` (FORMAT.md, "Reading a remote version"), whose
`manifest.json` lists its data files by content key in `ROOT/.shards/`. Its local copy is a cache root of its own,
`LOCAL` (`local_dir`, else a directory under the user's sft-tokenize home named from ROOT):

    LOCAL/.shards/<key>.arrow          each shard object, downloaded once, its size and xxh3-128 digest checked
    LOCAL/<name>-<fingerprint>/        hard links to those shards as data-0000k-of-0000n.arrow (copies where
                                       links fail), state.json, dataset_info.json, image_files.json, manifest.json
    LOCAL/.staging/<version>.lock      held while the version is materialized

The whole materialization runs under that lock, and the version is published locally by one rename: the ranks of
a node that call it together share one download (the first downloads, the others wait, then find it complete),
and a copy cut short (a crash, a corrupt object) leaves no version behind, only verified shards that the next
call reuses. A version once materialized is opened with no request to the store: versions never change.

Only the base layer is imported (and fsspec, with the filesystem the URL's scheme needs, e.g. s3fs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sft_tokenize.errors import BadInput, CacheError, Failed, first_line
from sft_tokenize.files import (
    REQUEST_TIMEOUT,
    atomic_path,
    built_directory,
    file_digest,
    is_remote,
    local_path,
    locked,
    user_cache,
)
from sft_tokenize.format.layout import (
    DATASET_INFO,
    IMAGE_FILES,
    LOCK_SUFFIX,
    MANIFEST,
    REMOTE_COPIES,
    SET_ASIDE_SUFFIX,
    SHARD_STORE,
    SHARD_SUFFIX,
    STAGED_SUFFIX,
    STAGING,
    STATE,
)
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.remote_requests import bounded_filesystem, unanswered

_KEY = re.compile(r"^[0-9A-Za-z_-]{1,128}$")  # a content key names an object: never a path
DOWNLOADS = 8  # shard objects fetched at once


def split_version(url: str) -> tuple[str, str]:
    """(the cache root's URL, the version's name) of a version's URL."""
    root, _, version = url.rstrip("/").rpartition("/")
    if not version or version.startswith(".") or "://" not in root or root.endswith("://"):
        raise BadInput(f"{url}: not a cache version's URL: name the version, ROOT/<name>-<fingerprint> (what "
                       "`sft-tokenize run` prints)")
    return root, version


def default_local_dir(root: str) -> Path:
    """Where a remote cache root is copied unless told: under the user's home, named from its URL, one per root
    (so versions of one root share their shards)."""
    slug = re.sub(r"[^0-9A-Za-z._-]+", "-", root.split("://", 1)[1]).strip("-.")[:80] or "root"
    return user_cache() / REMOTE_COPIES / f"{slug}-{hashlib.sha256(root.encode()).hexdigest()[:8]}"


def materialize(url: str, local_dir: str | Path | None = None, storage_options: dict | None = None,
                request_timeout: float = REQUEST_TIMEOUT) -> Path:
    """The published version at `url` as a local published cache, `LOCAL/<version>`; downloaded (and checked)
    unless a complete copy is there already. `storage_options`: fsspec's, for the URL's filesystem (credentials
    are better taken from the environment, e.g. AWS_* variables); each request waits at most `request_timeout`
    seconds to connect and for each answer."""
    url = url.rstrip("/")
    root, version = split_version(url)
    if root.split("://", 1)[0].lower() == "memory":
        raise BadInput(f"{url}: memory:// is not a cache root: it is not shared between processes")
    local = Path(local_dir if local_dir is not None else default_local_dir(root)).absolute()
    final = local / version
    if _complete(final):
        return final
    remote = Remote(url, storage_options, request_timeout)  # a URL no filesystem takes is refused before anything
    staging = local / STAGING / version
    staging.parent.mkdir(parents=True, exist_ok=True)
    with locked(staging.with_name(version + LOCK_SUFFIX), remove=True,
                waiting=f"another process is copying {url} into {local}; waiting for it"):
        if _complete(final):  # copied by the process this one waited for
            return final
        remote.copy_to(local, final, staging)
    return final


def _complete(path: Path) -> bool:
    try:
        read_manifest(path)
    except CacheError:
        return False
    return True


class Remote:
    """One version on object storage, read through fsspec; every failure is one line naming the URL."""

    def __init__(self, url: str, storage_options: dict | None = None, timeout: float = REQUEST_TIMEOUT):
        self.url = url
        self.root, self.version = split_version(url)
        self.timeout = timeout
        try:
            # its own client: one the process made earlier may name another endpoint (AWS_ENDPOINT_URL)
            self.fs, self.path = bounded_filesystem(url, storage_options, timeout, skip_instance_cache=True)
        except ImportError as error:
            raise BadInput(f"{url}: its filesystem is not installed ({first_line(error)})") from None
        except (ValueError, TypeError) as error:
            raise BadInput(f"{url}: not a usable URL ({first_line(error)})") from None
        self.root_path = self.path.rstrip("/").rpartition("/")[0]

    def _failed(self, error: BaseException, what: str, missing: str | None = None) -> Exception:
        """The error a failed request becomes: CacheError (exit 2) for what the user must fix, Failed (exit 1)
        for a store that did not answer."""
        if reason := unanswered(error, self.fs, what, self.timeout):
            return Failed(f"{reason}; check that the endpoint is up and reachable from here, then try again")
        if isinstance(error, PermissionError):
            return CacheError(f"{what}: access denied: check the credentials ({first_line(error)})")
        if isinstance(error, FileNotFoundError):
            bucket = self.path.split("/", 1)[0]
            if "bucket" in str(error).lower() or not self._exists(bucket):
                return CacheError(f"{what}: no such bucket {bucket!r}")
            return CacheError(f"{what}: not found" if missing is None else f"{what}: {missing}")
        return CacheError(f"{what}: {first_line(error) or type(error).__name__}")

    def _exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(path))
        except Exception:  # noqa: BLE001 - only a hint for the message of an error being raised
            return True

    def read(self, name: str, missing_ok: bool = False) -> bytes | None:
        """A small file of the version, whole (None if `missing_ok` and it is not there)."""
        try:
            return self.fs.cat_file(f"{self.path}/{name}")
        except FileNotFoundError as error:
            if missing_ok:
                return None
            raise self._failed(error, self.url, f"no published version there ({name} is missing)") from None
        except Exception as error:  # noqa: BLE001 - reported as what failed, by kind
            raise self._failed(error, f"{self.url}/{name}") from None

    def manifest(self) -> tuple[bytes, dict[str, Any]]:
        """The version's manifest as stored, and parsed; its data files checked to name store objects."""
        data = self.read(MANIFEST)
        try:
            manifest = json.loads(data)
        except ValueError as error:
            raise CacheError(f"{self.url}/{MANIFEST}: not JSON ({error})") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, list) or not all(
                isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"] == Path(f["name"]).name
                and not f["name"].startswith(".") and isinstance(f.get("bytes"), int)
                and isinstance(f.get("digest"), str) and isinstance(f.get("key"), str) and _KEY.match(f["key"])
                for f in files):
            raise CacheError(f"{self.url}/{MANIFEST}: not a remote version's manifest (each data file needs a name, "
                             "bytes, digest and the key of its shard object)")
        return data, manifest

    def object_url(self, key: str) -> str:
        return f"{self.root}/{SHARD_STORE}/{key}{SHARD_SUFFIX}"

    def fetch_shard(self, entry: dict, store: Path) -> Path:
        """The shard object of data file `entry` in the local store, downloaded unless a verified copy is there;
        checked (size, then digest) before it gets its name: a mismatch is a CacheError naming the object."""
        key = entry["key"]
        target = store / f"{key}{SHARD_SUFFIX}"
        if target.is_file() and target.stat().st_size == entry["bytes"] and file_digest(str(target)) == entry["digest"]:
            return target
        where = self.object_url(key)
        # Not durable: the shard can be downloaded again, and the version is checked whole before it is published.
        with atomic_path(target, durable=False) as tmp:
            try:
                self.fs.get_file(f"{self.root_path}/{SHARD_STORE}/{key}{SHARD_SUFFIX}", str(tmp))
            except Exception as error:  # noqa: BLE001 - reported as what failed, by kind
                raise self._failed(error, where) from None
            size = tmp.stat().st_size
            if size != entry["bytes"]:
                raise CacheError(f"{where}: {size} bytes, the manifest of {self.url} says {entry['bytes']}: the object "
                                 "is corrupt or was replaced; nothing was copied")
            digest = file_digest(str(tmp))
            if digest != entry["digest"]:
                raise CacheError(f"{where}: its bytes hash to {digest} (xxh3-128), the manifest of {self.url} says "
                                 f"{entry['digest']}: the object is corrupt; nothing was copied")
        return target

    def copy_to(self, local: Path, final: Path, staging: Path) -> None:
        """Download the version's shards into `local`'s store, then publish it at `final` in one rename."""
        manifest_bytes, manifest = self.manifest()
        store = local / SHARD_STORE
        store.mkdir(parents=True, exist_ok=True)
        small = {name: self.read(name, missing_ok=name == IMAGE_FILES) for name in (STATE, DATASET_INFO, IMAGE_FILES)}
        files = manifest["files"]
        with ThreadPoolExecutor(max_workers=max(1, min(DOWNLOADS, len(files)))) as pool:
            shards = list(pool.map(lambda entry: self.fetch_shard(entry, store), files))
        with built_directory(final, staging.with_name(staging.name + STAGED_SUFFIX),
                             staging.with_name(staging.name + SET_ASIDE_SUFFIX)) as building:
            for entry, shard in zip(files, shards, strict=True):
                try:
                    os.link(shard, building / entry["name"])
                except OSError:  # a filesystem without hard links: a copy, the store keeps its own
                    shutil.copyfile(shard, building / entry["name"])
            for name, data in small.items():
                if data is not None:
                    (building / name).write_bytes(data)
            (building / MANIFEST).write_bytes(manifest_bytes)  # last: what makes the directory a cache
            try:
                read_manifest(building)
            except CacheError as error:
                raise CacheError(f"{self.url}: its {STATE} and {MANIFEST} do not make a cache "
                                 f"({str(error).split(': ', 1)[-1]})") from None


def cache_location(location: str | Path, local_dir: str | Path | None = None,
                   storage_options: dict | None = None, request_timeout: float = REQUEST_TIMEOUT) -> str | Path:
    """Where a reader opens `location`: a remote version materialized first (its local path); a local path as
    it is (`file://` removed)."""
    if is_remote(location):
        return materialize(str(location), local_dir, storage_options, request_timeout)
    return local_path(location)


def remote_manifest(url: str, storage_options: dict | None = None,
                    request_timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """The manifest of the version at `url`, read from the store: nothing is downloaded but it."""
    return Remote(url.rstrip("/"), storage_options, request_timeout).manifest()[1]
