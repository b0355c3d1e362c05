"""Sources: find the input files, check them, cut them into byte-balanced slices, and read one slice.

Every file is reached through fsspec, so local paths and s3://, gs://, hf://, http(s):// URLs take the
same code. A slice is a small picklable description (file URLs and ranges), never data:

    jsonl    byte ranges aligned to line starts; a slice seeks to its range and reads only it
    parquet  row groups; a slice reads only its row groups and only the columns it needs
    arrow    row ranges of Arrow IPC (stream or file) files, e.g. a `save_to_disk` directory
    json     (an array of objects) and csv: whole files, one piece each

A compressed file (`.gz`, `.bz2`, `.zst`, `.xz` after the format's extension) is decompressed as it is
read, by fsspec's codecs; it cannot be read from an offset, so it is one piece, read whole by one slice.
A truncated or corrupt archive is a BadInput naming the file.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from .compressed import COMPRESSIBLE, COMPRESSIONS, compression_of, format_extension, open_decompressed
from .errors import BadInput, BadRow

EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv",
              ".arrow": "arrow"}
# Rows handed to the tokenizer at a time: at most this many, and (JSONL) at most this much input. A batch's
# tokenizer output (~100 bytes a token until it is packed into numpy) is what sets a worker's peak memory.
READ_BATCH_ROWS = 256
READ_BATCH_BYTES = 1 << 20
READ_CHUNK_BYTES = 1 << 20  # one read (one range request remotely) of a JSONL slice


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


@dataclass(frozen=True)
class Slice:
    index: int
    parts: tuple[Part, ...]
    nbytes: int

    def describe(self) -> list[list]:
        """A JSON-able description; a staged shard is reused only for the same description."""
        return [[p.url, p.kind, p.start, p.stop] for p in self.parts]


# A batch of rows read from a part: each row is a dict, or the BadRow it could not be read as; and a
# function that names where row i is (file and line or row), called only to report an error.
RowBatch = tuple[list[Any], Callable[[int], str]]


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _identity(fs: fsspec.AbstractFileSystem, path: str, info: dict) -> tuple:
    if _is_local(fs):
        st = os.stat(path)
        return ("local", st.st_size, st.st_mtime_ns)
    keys = ("VersionId", "version_id", "ETag", "etag", "md5Hash", "generation", "LastModified", "mtime",
            "last_modified")
    return ("remote", info.get("size"), *(f"{k}={info[k]}" for k in keys if info.get(k) is not None))


def _kind(url: str, fs: fsspec.AbstractFileSystem, path: str) -> str:
    ext = format_extension(url)
    kind = EXTENSIONS.get(ext)
    if kind is None:
        raise BadInput(f"{url}: unknown file format {ext or '(no extension)'!r}; "
                       f"supported: {', '.join(sorted(EXTENSIONS))}, each also compressed "
                       f"({', '.join(COMPRESSIONS)}) except .parquet and .arrow")
    if compression_of(url) and kind not in COMPRESSIBLE:
        raise BadInput(f"{url}: {ext} files cannot be read compressed ({ext} compresses inside the file); "
                       "decompress it first")
    if kind == "json":  # many .json files are JSON lines: an object on the first line tells
        with open_decompressed(fs, path, url) as f:
            head = f.read(4096).lstrip()
        # A first line that is not a whole object is a pretty-printed document: read as one, it is named
        # as "not an array" (or a syntax error at its line) instead of a broken first line.
        line, newline, _ = head.partition(b"\n")
        kind = "jsonl" if head.startswith(b"{") and (not newline or _is_json(line)) else "json"
    return kind


def _is_json(text: bytes) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _source(fs: fsspec.AbstractFileSystem, path: str, info: dict | None = None) -> SourceFile:
    info = info or fs.info(path)
    url = os.path.abspath(path) if _is_local(fs) else fs.unstrip_protocol(path)
    if not info.get("size"):
        raise BadInput(f"{url}: the file is empty")
    return SourceFile(url, _kind(url, fs, path), int(info["size"]), _identity(fs, path, info))


def _saved_dataset_files(fs: fsspec.AbstractFileSystem, path: str, split: str) -> list[str] | None:
    """The Arrow files of a `save_to_disk` directory (a Dataset, or one split of a DatasetDict)."""
    if fs.exists(f"{path}/dataset_dict.json"):
        splits = json.loads(fs.cat_file(f"{path}/dataset_dict.json"))["splits"]
        if split not in splits:
            raise BadInput(f"{path}: saved DatasetDict has no split {split!r} (splits: {', '.join(splits)})")
        path = f"{path}/{split}"
    if not fs.exists(f"{path}/state.json"):
        return None
    state = json.loads(fs.cat_file(f"{path}/state.json"))
    return [f"{path}/{entry['filename']}" for entry in state["_data_files"]]


def _hub_files(name: str, subset: str | None, split: str, revision: str | None) -> list[SourceFile]:
    """A hub dataset through `datasets.load_dataset`: prepared once into Arrow files, then sliced by rows."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, subset, split=split, revision=revision)
    except Exception as error:
        raise BadInput(f"hub:{name}: cannot load split {split!r}: {str(error).splitlines()[0]}") from None
    fs = fsspec.filesystem("file")
    files = [_source(fs, entry["filename"]) for entry in dataset.cache_files]
    return [SourceFile(f.url, "arrow", f.size, (*f.identity, f"fingerprint={dataset._fingerprint}")) for f in files]


def resolve(specs: list[str], *, split: str = "train", subset: str | None = None, revision: str | None = None,
            storage_options: dict | None = None) -> list[SourceFile]:
    """Every input file, in the order given (globs and directories sorted by path)."""
    found: list[SourceFile] = []
    for spec in specs:
        if spec.startswith("hub:"):
            found += _hub_files(spec[4:], subset, split, revision)
            continue
        fs, path = filesystem(spec, storage_options)
        if any(ch in spec for ch in "*?["):
            matches = sorted(fs.glob(path))
            if not matches:
                raise BadInput(f"no files match {spec}")
            found += [_source(fs, m) for m in matches if not fs.isdir(m)]
        elif fs.isdir(path):
            saved = _saved_dataset_files(fs, path, split)
            if saved is not None:
                found += [SourceFile(s.url, "arrow", s.size, s.identity) for s in (_source(fs, p) for p in saved)]
                continue
            files = sorted(p for p, info in fs.find(path, detail=True).items()
                           if info["type"] == "file" and format_extension(p) in EXTENSIONS
                           and not os.path.basename(p).startswith("."))
            if not files:
                raise BadInput(f"{spec}: no data files ({', '.join(sorted(EXTENSIONS))}) in this directory")
            found += [_source(fs, p) for p in files]
        elif fs.exists(path):
            found.append(_source(fs, path))
        else:
            raise BadInput(f"no such file: {spec}")
    return found


# -- per-format inspection, pieces and reading ----------------------------------------------------------------


class _Reader:
    """One file format: its columns, its pieces (cut points with byte weights) and how to read a part."""

    def __init__(self, source: SourceFile | Part, storage_options: dict | None, max_row_bytes: int | None = None):
        self.url = source.url
        self.fs, self.path = filesystem(source.url, storage_options)
        self.compressed = compression_of(source.url) is not None
        self.max_row_bytes = max_row_bytes

    def open(self, exact: bool = False):
        # exact: every read is one range request of exactly its size, no read-ahead past a slice.
        # Otherwise small blocks: finding a line start should not fetch megabytes of object storage.
        options = {"cache_type": "none"} if exact and not self.compressed else {"block_size": 1 << 16}
        return open_decompressed(self.fs, self.path, self.url, READ_CHUNK_BYTES, **options)

    def columns(self) -> list[str]:
        raise NotImplementedError

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        """(start, stop, bytes) in the format's unit, cut (where the format can be cut) after `first` bytes,
        which fill the slice under way, and then every `target` bytes."""
        raise NotImplementedError

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        raise NotImplementedError


class _JsonLines(_Reader):
    def columns(self) -> list[str]:
        for number, line in enumerate(self._lines(0, -1), start=1):
            if isinstance(line, int) or not line.strip():
                continue  # a row over max_row_bytes is not decoded, even to find the columns
            row = _parse_line(line)
            if isinstance(row, BadRow):
                raise row.at(f"{self.url}:{number}")
            return list(row)
        raise BadInput(f"{self.url}: the file has no rows")

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        if self.compressed:
            return [(0, -1, size)]
        cuts = [0]
        with self.open() as f:
            offset = first
            while offset < size:
                f.seek(offset - 1)
                f.readline()  # to the start of the next line (offset itself if a line starts there)
                if f.tell() >= size:
                    break
                cuts.append(f.tell())
                offset = f.tell() + target  # from the actual cut, so no piece is under target
        cuts.append(size)
        return [(a, b, b - a) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    def _lines(self, start: int, stop: int) -> Iterator[bytes | int]:
        """The lines of bytes [start, stop) (stop -1: to the end), which begin and end on line starts, read in
        bounded chunks. Exactly that range is read: on object storage a slice fetches its own bytes and no
        others. A line longer than max_row_bytes is never held whole: its length (an int) stands for it."""
        limit = self.max_row_bytes
        with self.open(exact=True) as f:
            if start:
                f.seek(start)
            position, carry, skipped = start, [], 0  # carry: the pieces of an unfinished line
            while stop < 0 or position < stop:
                chunk = f.read(READ_CHUNK_BYTES if stop < 0 else min(stop - position, READ_CHUNK_BYTES))
                if not chunk:
                    break
                position += len(chunk)
                lines = chunk.split(b"\n")
                last = lines.pop()
                for line in lines:
                    whole = skipped + len(line) if skipped else b"".join([*carry, line]) if carry else line
                    yield len(whole) if limit is not None and not isinstance(whole, int) and len(whole) > limit \
                        else whole
                    carry, skipped = [], 0
                if skipped:
                    skipped += len(last)
                else:
                    carry.append(last)
                    if limit is not None and sum(map(len, carry)) > limit:
                        skipped, carry = sum(map(len, carry)), []
            if skipped:
                yield skipped
            elif any(carry):
                yield b"".join(carry)

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        first_line = _LazyLineNumber(self, part.start)
        rows: list[Any] = []
        lines: list[int] = []  # line index of each row, relative to the part's first line
        pending = 0
        for index, line in enumerate(self._lines(part.start, part.stop)):
            if isinstance(line, int):
                rows.append(BadRow("row_too_large", f"the row is {line:,} bytes, over the {self.max_row_bytes:,}-byte "
                                   "limit (--max-row-bytes; --on-bad-row skip drops such rows)"))
                lines.append(index)
                pending += READ_BATCH_BYTES  # alone in its batch: the rows before it need not wait
            elif line.strip():
                rows.append(_parse_line(line))
                lines.append(index)
                pending += len(line)
                if len(rows) >= READ_BATCH_ROWS or pending >= READ_BATCH_BYTES:
                    yield rows, _line_locator(self.url, first_line, lines)
                    rows, lines, pending = [], [], 0
        if rows:
            yield rows, _line_locator(self.url, first_line, lines)


class _LazyLineNumber:
    """The 1-based line number of a byte offset, counted only when an error needs it."""

    def __init__(self, reader: _Reader, offset: int):
        self.reader, self.offset = reader, offset

    @cached_property
    def value(self) -> int:
        newlines, remaining = 0, self.offset
        with self.reader.open() as f:
            while remaining > 0:
                chunk = f.read(min(remaining, 16 << 20))
                if not chunk:
                    break
                newlines += chunk.count(b"\n")
                remaining -= len(chunk)
        return newlines + 1


def _line_locator(url: str, first: _LazyLineNumber, lines: list[int]) -> Callable[[int], str]:
    return lambda i: f"{url}:{first.value + lines[i]}"


def _parse_line(line: bytes) -> dict | BadRow:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return BadRow("not_utf8", f"not valid UTF-8 (byte 0x{line[error.start]:02x} at column {error.start + 1})")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        return BadRow("malformed_json", f"not valid JSON: {error.msg} (column {error.colno})")
    if not isinstance(row, dict):
        return BadRow("malformed_json", f"expected a JSON object, got {type(row).__name__}")
    return row


class _JsonArray(_Reader):
    @cached_property
    def items(self) -> list:
        with self.open() as f:
            try:
                data = json.load(io.TextIOWrapper(f, encoding="utf-8"))
            except UnicodeDecodeError as error:
                raise BadInput(f"{self.url}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
            except json.JSONDecodeError as error:
                where = f"{self.url}:{error.lineno}"
                raise BadInput(f"{where}: not valid JSON: {error.msg} (column {error.colno})") from None
        if not isinstance(data, list):
            raise BadInput(f"{self.url}: a .json file must hold an array of objects (or be JSON lines), "
                           f"got a JSON {type(data).__name__}")
        return data

    def columns(self) -> list[str]:
        objects = [item for item in self.items if isinstance(item, dict)]
        if not objects:
            raise BadInput(f"{self.url}: the array holds no objects")
        return list(objects[0])

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        return [(0, -1, size)]

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        items = self.items
        for start in range(0, len(items), READ_BATCH_ROWS):
            rows = [item if isinstance(item, dict) else
                    BadRow("malformed_json", f"expected a JSON object, got {type(item).__name__}")
                    for item in items[start:start + READ_BATCH_ROWS]]
            yield rows, (lambda i, s=start: f"{self.url}: item {s + i}")


class _Parquet(_Reader):
    @cached_property
    def file(self) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self.path if _is_local(self.fs) else self.open(exact=True))
        except Exception as error:
            raise BadInput(f"{self.url}: not a readable Parquet file ({error})") from None

    def columns(self) -> list[str]:
        return self.file.schema_arrow.names

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        meta = self.file.metadata
        return [(g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        meta = self.file.metadata
        row = sum(meta.row_group(g).num_rows for g in range(part.start))
        try:
            batches = self.file.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=range(part.start, part.stop),
                                             columns=columns)
            for batch in batches:
                yield batch.to_pylist(), (lambda i, r=row: f"{self.url}: row {r + i}")
                row += batch.num_rows
        except OSError as error:
            raise BadInput(f"{self.url}: row {row}: cannot read Parquet data ({error})") from None


class _Arrow(_Reader):
    def _batches(self) -> Iterator[pa.RecordBatch]:
        source = pa.memory_map(self.path) if _is_local(self.fs) else self.open()
        try:
            try:
                reader = pa.ipc.open_file(source)
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                yield from pa.ipc.open_stream(source)
        except pa.ArrowInvalid as error:
            raise BadInput(f"{self.url}: not a readable Arrow IPC file ({error})") from None

    def columns(self) -> list[str]:
        return next(iter(self._batches())).schema.names

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        pieces, row = [], 0
        for batch in self._batches():
            pieces.append((row, row + batch.num_rows, batch.nbytes))
            row += batch.num_rows
        return pieces

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        row = 0
        for batch in self._batches():
            begin, end = max(part.start - row, 0), min(part.stop - row, batch.num_rows)
            if begin < end:
                chosen = batch.slice(begin, end - begin).select(columns)
                for start in range(0, chosen.num_rows, READ_BATCH_ROWS):
                    rows = chosen.slice(start, READ_BATCH_ROWS).to_pylist()
                    yield rows, (lambda i, r=row + begin + start: f"{self.url}: row {r + i}")
            row += batch.num_rows
            if row >= part.stop:
                break


class _Csv(_Reader):
    def _reader(self, column_types: dict | None = None):
        # Every column is text: "3" in an output column is the string "3", not a number.
        try:
            return pa_csv.open_csv(self.open(), read_options=pa_csv.ReadOptions(block_size=READ_BATCH_BYTES),
                                   convert_options=pa_csv.ConvertOptions(column_types=column_types))
        except pa.ArrowInvalid as error:
            raise BadInput(f"{self.url}: not a readable CSV file ({error})") from None

    def columns(self) -> list[str]:
        return self._reader().schema.names

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        return [(0, -1, size)]

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        row = 0
        try:
            for batch in self._reader({name: pa.string() for name in self.columns()}):
                table = batch.select(columns)
                for start in range(0, table.num_rows, READ_BATCH_ROWS):
                    rows = table.slice(start, READ_BATCH_ROWS).to_pylist()
                    yield rows, (lambda i, r=row + start: f"{self.url}:{r + i + 2}")  # line 1 is the header
                row += table.num_rows
        except pa.ArrowInvalid as error:
            raise BadInput(f"{self.url}: near line {row + 2}: cannot parse CSV ({error})") from None


READERS: dict[str, type[_Reader]] = {"jsonl": _JsonLines, "json": _JsonArray, "parquet": _Parquet, "arrow": _Arrow,
                                     "csv": _Csv}


def reader(source: SourceFile | Part, storage_options: dict | None = None,
           max_row_bytes: int | None = None) -> _Reader:
    return READERS[source.kind](source, storage_options, max_row_bytes)


def cut_slices(files: list[SourceFile], target: int, storage_options: dict | None = None) -> list[Slice]:
    """Consecutive pieces packed into slices of about `target` bytes each, in source order."""
    slices: list[Slice] = []
    parts: list[Part] = []
    nbytes = 0
    for source in files:
        for start, stop, weight in reader(source, storage_options).pieces(source.size, target, target - nbytes):
            if parts and parts[-1].url == source.url and parts[-1].stop == start:
                parts[-1] = Part(source.url, source.kind, parts[-1].start, stop)
            else:
                parts.append(Part(source.url, source.kind, start, stop))
            nbytes += weight
            if nbytes >= target:
                slices.append(Slice(len(slices), tuple(parts), nbytes))
                parts, nbytes = [], 0
    if parts:
        slices.append(Slice(len(slices), tuple(parts), nbytes))
    return slices


def read_slice(slice_: Slice, columns: list[str], storage_options: dict | None = None,
               max_row_bytes: int | None = None) -> Iterator[RowBatch]:
    """The slice's rows in batches; a JSON line over `max_row_bytes` comes as a BadRow `row_too_large`."""
    for part in slice_.parts:
        yield from reader(part, storage_options, max_row_bytes).read(part, columns)
