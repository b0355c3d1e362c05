"""Cutting the input into slices whose boundaries stay put while the dataset grows.

A slice's boundaries depend on its own file and the target size only (FORMAT.md, Slices): a large file is
cut on its own, at the format's cut points (`FormatReader.pieces`); small files are grouped whole, and a group
ends after a file whose name hashes below size / target, so a new file disturbs only the group it lands in.
"""

from __future__ import annotations

import hashlib

from sft_tokenize.sources.formats.table import FORMATS
from sft_tokenize.sources.readers import reader
from sft_tokenize.sources.records import Part, Slice, SourceFile


def _ends_group(source: SourceFile, target: int) -> bool:
    """Whether a small file closes the group it is in: true with probability size/target, decided by a hash of
    the file's name alone, so a group averages about `target` bytes and its ends do not move when files are
    added or removed elsewhere (content-defined chunking, with files as the unit)."""
    name = source.url.rstrip("/").rsplit("/", 1)[-1]
    draw = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") / 2**64
    return draw < source.size / target


def cut_slices(files: list[SourceFile], target: int, storage_options: dict | None = None) -> list[Slice]:
    """Slices of about `target` bytes in source order, whose boundaries depend on their own files only.

    A file of at least `target` bytes is cut on its own: its pieces (line-aligned byte ranges, row groups,
    record batches) are packed into slices within the file. Smaller files are grouped whole with their
    neighbours; a group ends after a file that `_ends_group`, before a large file, or past 2 × target, so
    adding, removing or changing a small file disturbs only the group it is in.
    """
    slices: list[Slice] = []
    parts: list[Part] = []
    nbytes = 0

    def close() -> None:
        nonlocal parts, nbytes
        if parts:
            slices.append(Slice(len(slices), tuple(parts), nbytes))
            parts, nbytes = [], 0

    for source in files:
        pieces = reader(source, storage_options).pieces(source.size, target, target)
        if not pieces:  # e.g. a Parquet file without row groups: nothing to read
            continue
        if source.size < target:
            parts.append(Part(source.url, source.kind, pieces[0][0], pieces[-1][1], source.identity))
            nbytes += sum(weight for _, _, weight in pieces)
            if _ends_group(source, target) or nbytes >= 2 * target:
                close()
            continue
        close()
        for start, stop, weight in pieces:
            if parts and parts[-1].stop == start:
                parts[-1] = Part(source.url, source.kind, parts[-1].start, stop, source.identity)
            else:
                parts.append(Part(source.url, source.kind, start, stop, source.identity))
            nbytes += weight
            # Byte-range pieces are slices already; packing them could shift every later boundary after one edit.
            if nbytes >= target or FORMATS[source.kind].byte_ranges:
                close()
        close()
    close()
    return slices
