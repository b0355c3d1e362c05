"""Where an export is written, and its record: a reader sees a whole export or none of it.

    with ExportOutput("s3://bucket/exports/ultrachat-mds", storage_options) as out:
        with out.open("shard.00000.mds") as f: ...        # data files first
        with out.open("index.json") as f: ...             # the consumer's index last
        out.finish(record)                                # EXPORT_RECORD, then the directory is published

A local directory is built as a hidden sibling (`.<name>.building-<id>`) and renamed into place in one step
(files.built_directory), so a reader of the directory sees the previous export or the new one. On object storage
there is no rename: every object is written whole once, the data objects before the index objects that name them,
and EXPORT_RECORD last; a consumer opens an export through its index, which is written only after its data. An
export is never written over another one at the same URL (that would change objects under a reader): a URL that
holds an export of the same cache and options is reused as it is; one that holds anything else is refused.

A local export made again in place may reuse files of the export it replaces (`reuse_previous`, set when the two
have the same target and options): a file of the same name is hard-linked (or copied) into the new directory with
its recorded digest, not written again; the record counts `files_written` and `files_reused`.

Every file's xxh3-128 digest is computed as it is written (no second read); the export's digest is the digest of
their names, sizes and digests.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from sft_tokenize.errors import BadInput
from sft_tokenize.files import REQUEST_TIMEOUT, built_directory, is_remote, local_path
from sft_tokenize.remote_requests import bounded_filesystem

EXPORT_RECORD = "export.json"  # written last: the export's target, options, source cache, files and digest


class _Digesting:
    """A binary file that hashes (xxh3-128) and counts what is written through it."""

    def __init__(self, handle: BinaryIO):
        self.handle, self.digest, self.bytes = handle, xxhash.xxh3_128(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.bytes += len(view)
        return self.handle.write(view)


def export_digest(files: list[dict[str, Any]]) -> str:
    """The export's digest: of every file's name, size and digest, in name order."""
    digest = xxhash.xxh3_128()
    for entry in sorted(files, key=lambda f: f["name"]):
        digest.update(f"{entry['name']}\0{entry['bytes']}\0{entry['digest']}\n".encode())
    return digest.hexdigest()


class ExportOutput:
    """An export's directory (local path or fsspec URL), written file by file, published by `finish`."""

    def __init__(self, location: str | Path, storage_options: dict | None = None,
                 request_timeout: float = REQUEST_TIMEOUT):
        self.location = str(location)
        self.remote = is_remote(self.location)
        self.storage_options = storage_options or {}
        self.files: list[dict[str, Any]] = []
        self._building: Path | None = None
        self._finished = False
        self.reuse_previous = False  # reuse same-named files of the export at this place (same target, options)
        self.reused = 0
        if self.remote:
            self.fs, self.root = bounded_filesystem(self.location, self.storage_options, request_timeout)
            self.root = self.root.rstrip("/")
        else:
            self.final = Path(os.path.abspath(local_path(self.location)))
            self.location = str(self.final)

    def existing_record(self) -> dict[str, Any] | None:
        """The record of the export already at this location, if one is there whole."""
        try:
            if self.remote:
                with self.fs.open(f"{self.root}/{EXPORT_RECORD}", "rb") as f:
                    return json.loads(f.read())
            return json.loads((self.final / EXPORT_RECORD).read_text())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None

    def _holds_anything(self) -> bool:
        if self.remote:
            return self.fs.exists(self.root) and bool(self.fs.ls(self.root))
        return self.final.exists() and (not self.final.is_dir() or any(self.final.iterdir()))

    def __enter__(self) -> ExportOutput:
        if self.remote:
            if self._holds_anything():
                raise BadInput(f"{self.location}: holds other objects (an export is never written over objects a "
                               "reader may be reading): export to a new URL, or remove these first")
            return self
        if self.final.exists() and not self.final.is_dir():
            raise BadInput(f"{self.final}: a file, not a directory to export into")
        if self.final.exists() and any(self.final.iterdir()) and self.existing_record() is None:
            raise BadInput(f"{self.final}: a directory holding files that are not an export; export into a new or "
                           "empty directory (an earlier export there is replaced whole)")
        previous = self.existing_record() if self.reuse_previous else None
        self._previous = {entry["name"]: entry for entry in (previous or {}).get("files", [])}
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._context = built_directory(self.final, self.final.with_name(f".{self.final.name}.building"),
                                        self.final.with_name(f".{self.final.name}.stale"))
        self._building = self._context.__enter__()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if not self.remote:
            if error is None and not self._finished:
                error = RuntimeError("export not finished")
            self._context.__exit__(type(error) if error else None, error, traceback)

    @contextmanager
    def open(self, name: str) -> Iterator[_Digesting]:
        """A new file of the export, written whole or not at all (an error removes the directory or leaves the
        URL without the export's record)."""
        with self.fs.open(f"{self.root}/{name}", "wb") if self.remote else open(self._building / name, "wb") as handle:
            writer = _Digesting(handle)
            yield writer
        self.files.append({"name": name, "bytes": writer.bytes, "digest": writer.digest.hexdigest()})

    def reuse(self, name: str) -> bool:
        """Put the earlier export's file `name` in the new one as it is, if it holds one whole (its recorded size);
        False if it does not (the caller writes the file)."""
        entry = None if self.remote else self._previous.get(name)
        if entry is None:
            return False
        source = self.final / name
        if not source.is_file() or source.stat().st_size != entry["bytes"]:
            return False
        try:
            os.link(source, self._building / name)
        except OSError:
            shutil.copyfile(source, self._building / name)
        self.files.append(dict(entry))
        self.reused += 1
        return True

    def write(self, name: str, data: bytes) -> None:
        with self.open(name) as f:
            f.write(data)

    def finish(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write EXPORT_RECORD (the record, its files and its digest) last; the directory is published when the
        `with` block ends. Returns the record as written."""
        record = {**record, "files": list(self.files), "digest": export_digest(self.files),
                  "files_written": len(self.files) - self.reused + 1, "files_reused": self.reused}
        data = json.dumps(record, indent=1).encode()
        if self.remote:
            with self.fs.open(f"{self.root}/{EXPORT_RECORD}", "wb") as f:
                f.write(data)
        else:
            (self._building / EXPORT_RECORD).write_bytes(data)
        self._finished = True
        return record
