"""JSON (an array of objects): whole files, one piece each."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cached_property

from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.sources.formats.format_reader import READ_BATCH_ROWS, FormatReader, RowBatch
from sft_tokenize.sources.formats.jsonl_reader import SURROGATE_ESCAPE, TOO_DEEP, unicode_checked
from sft_tokenize.sources.records import Part


class JsonArrayReader(FormatReader):
    schemaless = True

    @cached_property
    def items(self) -> list:
        with self.open() as f:
            raw = f.read()
        self.may_hold_surrogates = bool(SURROGATE_ESCAPE.search(raw))
        try:
            data = json.loads(raw.decode("utf-8-sig"))  # with or without a byte order mark
        except UnicodeDecodeError as error:
            raise BadInput(f"{self.url}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            where = f"{self.url}:{error.lineno}"
            raise BadInput(f"{where}: not valid JSON: {error.msg} (column {error.colno})") from None
        except RecursionError:
            raise BadInput(f"{self.url}: {TOO_DEEP.detail}") from None
        if not isinstance(data, list):
            raise BadInput(f"{self.url}: a .json file must hold an array of objects (or be JSON lines), "
                           f"got a JSON {type(data).__name__}")
        return data

    def columns(self, skip_bad_rows: bool = False) -> list[str]:
        objects = [item for item in self.items if isinstance(item, dict)]
        if not objects:
            raise BadInput(f"{self.url}: the array holds no objects")
        return list(objects[0])

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        return [(0, -1, size)]

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        items = self.items
        for start in range(0, len(items), READ_BATCH_ROWS):
            rows = [(unicode_checked(item) if self.may_hold_surrogates else item) if isinstance(item, dict) else
                    BadRow("malformed_json", f"expected a JSON object, got {type(item).__name__}")
                    for item in items[start:start + READ_BATCH_ROWS]]
            yield rows, (lambda i, s=start: f"{self.url}: item {s + i + 1}")
