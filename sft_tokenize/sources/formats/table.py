"""The input formats, one row each: the one table every other place reads.

A row names the format (as plans, content keys and manifests record it), the suffixes that select it, its
reader (a `FormatReader`), whether it may be read through a compression suffix (`.gz`, …), and the unit a
slice cuts it in, as reports name it. resolve.py finds a file's format by its suffix here, readers.py its
reader, and the run's report the unit of each part it lists; slicing, content keys and the dry run ask whether
its parts are byte ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from sft_tokenize.sources.formats.arrow_reader import ArrowReader
from sft_tokenize.sources.formats.csv_reader import CsvReader
from sft_tokenize.sources.formats.format_reader import FormatReader
from sft_tokenize.sources.formats.json_reader import JsonArrayReader
from sft_tokenize.sources.formats.jsonl_reader import JsonLinesReader
from sft_tokenize.sources.formats.parquet_reader import ParquetReader


@dataclass(frozen=True)
class Format:
    kind: str  # the name a plan, a content key and a manifest record (SourceFile.kind, Part.kind)
    suffixes: tuple[str, ...]  # lower case, before any compression suffix
    reader: type[FormatReader]
    compressible: bool  # read through a compression suffix; Parquet and Arrow compress inside the file
    unit: tuple[str, str] | None  # the unit a part counts in (one, many), as reports name it; None: whole files

    @property
    def byte_ranges(self) -> bool:
        """Whether a part is a byte range (cut at line starts): any range reads alone, so a part is a slice's
        worth already, its content is its bytes, and a file grown at its end keeps its earlier parts."""
        return self.unit == ("byte", "bytes")


FORMATS: dict[str, Format] = {row.kind: row for row in (
    Format("jsonl", (".jsonl", ".ndjson"), JsonLinesReader, compressible=True, unit=("byte", "bytes")),
    Format("json", (".json",), JsonArrayReader, compressible=True, unit=None),
    Format("parquet", (".parquet",), ParquetReader, compressible=False, unit=("row group", "row groups")),
    Format("arrow", (".arrow",), ArrowReader, compressible=False, unit=("row", "rows")),
    Format("csv", (".csv",), CsvReader, compressible=True, unit=None),
)}


def by_suffix(suffix: str) -> Format | None:
    """The format a file's suffix (under any compression suffix, lower case) selects, or None."""
    return next((row for row in FORMATS.values() if suffix in row.suffixes), None)


def suffixes(compressible: bool | None = None) -> list[str]:
    """Every format's suffixes in the table's order (`compressible`: only those of formats that are, or are not)."""
    return [suffix for row in FORMATS.values() if compressible in (None, row.compressible) for suffix in row.suffixes]
