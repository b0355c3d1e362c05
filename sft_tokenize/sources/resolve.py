"""Sources: find the input files and check them, each file's format found by its suffix (formats/table.py).

Every file is reached through fsspec, so local paths and s3://, gs://, hf://, http(s):// URLs take the
same code. A file, a part of one and a slice are small picklable descriptions (records.py), never data; how
each format is cut into pieces and read is sources/formats/, how pieces are packed into slices slicing.py.

A compressed file (`.gz`, `.bz2`, `.zst`, `.xz` after the format's extension) is decompressed as it is
read, by fsspec's codecs; it cannot be read from an offset, so it is one piece, read whole by one slice.
A truncated or corrupt archive is a BadInput naming the file.
"""

from __future__ import annotations

import codecs
import json
import os

import fsspec

from sft_tokenize.errors import BadInput, one_line
from sft_tokenize.files import REQUEST_TIMEOUT, network_failure
from sft_tokenize.remote_requests import unanswered
from sft_tokenize.sources.compressed import COMPRESSIONS, compression_of, format_extension, open_decompressed
from sft_tokenize.sources.formats.table import by_suffix, suffixes
from sft_tokenize.sources.listing import check_regular_file, is_under, list_directory
from sft_tokenize.sources.records import SourceFile, file_identity, filesystem, is_local


def _kind(url: str, fs: fsspec.AbstractFileSystem, path: str) -> str:
    ext = format_extension(url)
    found = by_suffix(ext)
    if found is None:
        raise BadInput(f"{url}: unknown file format {ext or '(no extension)'!r}; "
                       f"supported: {', '.join(sorted(suffixes()))}, each also compressed "
                       f"({', '.join(COMPRESSIONS)}) except {' and '.join(suffixes(compressible=False))}")
    kind = found.kind
    if compression_of(url) and not found.compressible:
        raise BadInput(f"{url}: {ext} files cannot be read compressed ({ext} compresses inside the file); "
                       "decompress it first")
    if kind == "json":  # many .json files are JSON lines: an object on the first line tells
        with open_decompressed(fs, path, url) as f:
            head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
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
    url = os.path.abspath(path) if is_local(fs) else fs.unstrip_protocol(path)
    if not info.get("size"):
        raise BadInput(f"{url}: the file is empty")
    return SourceFile(url, _kind(url, fs, path), int(info["size"]), file_identity(fs, path, info))


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
        raise BadInput(f"hub:{name}: cannot load split {split!r}: {one_line(error)}") from None
    fs = fsspec.filesystem("file")
    files = [_source(fs, entry["filename"]) for entry in dataset.cache_files]
    return [SourceFile(f.url, "arrow", f.size, (*f.identity, f"fingerprint={dataset._fingerprint}")) for f in files]


def resolve(specs: list[str], *, split: str = "train", subset: str | None = None, revision: str | None = None,
            storage_options: dict | None = None, cache_root: str | None = None,
            ignored: list[str] | None = None, timeout: float = REQUEST_TIMEOUT) -> list[SourceFile]:
    """Every input file, in the order given (globs and directories sorted by path). Nothing under
    `cache_root` is read; files of a directory that are not data (README.md) are appended to `ignored`."""
    found: list[SourceFile] = []
    for spec in specs:
        if spec.startswith("hub:"):
            found += _hub_files(spec[4:], subset, split, revision)
            continue
        try:
            found += _resolve_one(spec, split, storage_options, cache_root, ignored if ignored is not None else [],
                                  timeout)
        except BadInput:
            raise
        except Exception as error:  # noqa: BLE001 - unreachable, no credentials, refused: one line naming it
            if network_failure(error):  # its filesystem was made, and names its endpoint
                reason = unanswered(error, filesystem(spec, storage_options, timeout)[0], spec, timeout)
                raise BadInput(f"{reason}; check that the endpoint is up and reachable from here") from None
            raise BadInput(f"{_shown(spec)}: cannot read it ({type(error).__name__}: {one_line(error)})") from None
    return found


def _shown(spec: str) -> str:
    """A spec as printed: a local path absolute and normalised, a URL as given."""
    return spec if "://" in spec else os.path.abspath(os.path.expanduser(spec))


def _resolve_one(spec: str, split: str, storage_options: dict | None, cache_root: str | None,
                 ignored: list[str], timeout: float) -> list[SourceFile]:
    fs, path = filesystem(spec, storage_options, timeout)
    local = is_local(fs)
    # A literal name wins over a glob: `data[1].jsonl` that exists is that file.
    if any(ch in spec for ch in "*?[") and not fs.exists(path):
        matches = [m for m in sorted(fs.glob(path)) if not (local and is_under(m, cache_root))]
        if not matches:
            raise BadInput(f"no files match {_shown(spec)}")
        files = [m for m in matches if not fs.isdir(m)]
        if not files:
            raise BadInput(f"{_shown(spec)} matches only directories ({', '.join(matches[:3])}"
                           f"{', …' if len(matches) > 3 else ''}): name a directory itself, or a glob of files")
        if local:
            for file in files:
                check_regular_file(file)
        return [_source(fs, m) for m in files]
    if fs.isdir(path):
        saved = _saved_dataset_files(fs, path, split)
        if saved is not None:
            if not saved:
                which = f"split {split!r}" if fs.exists(f"{path}/dataset_dict.json") else "its state.json"
                raise BadInput(f"{_shown(spec)}: the saved dataset has no rows ({which} lists no data files)")
            return [SourceFile(s.url, "arrow", s.size, s.identity) for s in (_source(fs, p) for p in saved)]
        files, not_data = list_directory(fs, path, local, exclude=cache_root)
        ignored += [os.path.abspath(p) if local else fs.unstrip_protocol(p) for p in not_data]
        if not files:
            inside = " (the cache dir inside it is never read)" if local and cache_root and \
                is_under(cache_root, path) else ""
            raise BadInput(f"{_shown(spec)}: no data files ({', '.join(sorted(suffixes()))}) in this directory"
                           f"{inside}")
        return [_source(fs, p) for p in files]
    if local:
        if not os.path.lexists(path):
            raise BadInput(f"no such file: {_shown(spec)}")
        check_regular_file(os.path.abspath(path))
        if is_under(path, cache_root):
            raise BadInput(f"{_shown(spec)}: is inside the cache dir {cache_root}, whose files are never read as "
                           "input")
        return [_source(fs, path)]
    if fs.exists(path):
        return [_source(fs, path)]
    raise BadInput(f"no such file: {_shown(spec)}")
