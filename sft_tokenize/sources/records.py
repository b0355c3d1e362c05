"""The picklable descriptions of input: a source file, a part of one and a slice; the filesystem a URL is on and
what names a file's version (its identity)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import fsspec

from sft_tokenize.files import REQUEST_TIMEOUT
from sft_tokenize.remote_requests import bounded_filesystem


@dataclass(frozen=True)
class SourceFile:
    url: str  # an absolute local path or a full fsspec URL
    kind: str
    size: int
    identity: tuple  # what changes when the content changes: (size, mtime_ns), or an ETag / version id


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of one file, in the file's unit: bytes (jsonl), row groups (parquet), rows."""

    url: str
    kind: str
    start: int
    stop: int
    identity: tuple = ()  # its file's SourceFile.identity when planned: the slice checks that it still holds


@dataclass(frozen=True)
class Slice:
    index: int
    parts: tuple[Part, ...]
    nbytes: int
    key: str = ""  # the content key of its shard in the store (see build/keys.py); set by the plan

    def describe(self) -> list[list]:
        """A JSON-able description; a staged shard is reused only for the same description."""
        return [[p.url, p.kind, p.start, p.stop] for p in self.parts]


def filesystem(url: str, storage_options: dict | None = None,
               timeout: float = REQUEST_TIMEOUT) -> tuple[fsspec.AbstractFileSystem, str]:
    """The URL's filesystem and path; a remote one's requests each wait at most `timeout` seconds to connect and
    for each answer (--request-timeout)."""
    return bounded_filesystem(url, storage_options, timeout)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """The filesystem is this machine's (paths can be stat'ed, memory-mapped)."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def file_identity(fs: fsspec.AbstractFileSystem, path: str, info: dict) -> tuple:
    """What names a file's version without reading it: size and mtime here, size and ETag-like keys remotely."""
    if is_local(fs):
        st = os.stat(path)
        return ("local", st.st_size, st.st_mtime_ns)
    keys = ("VersionId", "version_id", "ETag", "etag", "md5Hash", "generation", "LastModified", "mtime",
            "last_modified")
    return ("remote", info.get("size"), *(f"{k}={info[k]}" for k in keys if info.get(k) is not None))
