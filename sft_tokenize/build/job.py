"""The Job: what every slice's task needs besides its slice, and the cache's row schema it implies.

Small and picklable, the same for all slices of a run: it travels to every worker (a thread, a process, a
Dask or Ray worker). Its fields are what the plan resolved (the fingerprints, where to write, the tokenizer's
directory, the template's text, the column mapping) and the options the slices read, one field each, as the
option table declares them (options.py).
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from pathlib import Path

from sft_tokenize.build.options import job_options
from sft_tokenize.format.layout import DIGEST_BOOK
from sft_tokenize.read.layouts import COLUMN_TYPES, layout_columns
from sft_tokenize.sources.conversations import ColumnMap
from sft_tokenize.sources.resolve import Slice


class _JobPaths:
    """Where a job's files are."""

    store: str

    def shard_path(self, slice_: Slice) -> Path:
        return Path(self.store) / f"{slice_.key}.arrow"

    @property
    def digest_book(self) -> Path:
        return Path(self.store) / DIGEST_BOOK


def _option_field(default):
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default))
    return field(default=default)


Job = make_dataclass(
    "Job",
    [
        ("fingerprint", str),
        ("staging", str),
        ("tokenizer_dir", str),
        ("chat_template", "str | None"),  # the template's text: the override's, or None for the tokenizer's own
        ("columns", ColumnMap),
        *((name, kind, _option_field(default)) for name, kind, default in job_options()),
        # the shard store: finished shards by content key, shared by every cache under the root
        ("store", str, field(default="")),
        # the fingerprint of everything that changes how a row is tokenized
        ("tokenization", str, field(default="")),
        # where the tokenizer is kept prepared (prepared.py); empty: loaded and checked each time
        ("prepared", str, field(default="")),
        # the processor's configuration as JSON text (image rows, encoding/vision.py); empty: no processor
        ("processor_config", str, field(default="")),
    ],
    bases=(_JobPaths,),
    frozen=True,
)
Job.__module__ = __name__  # pickled by reference, as a class written out would be
Job.__doc__ = "What every slice's task needs besides its slice: small and picklable, the same for all slices."


def features(extra_columns: tuple[str, ...] = (), layout: str = "skyrl", images: bool = False):
    """The cache's row schema as `datasets` Features: the layout's columns (see layouts.py), extras on request,
    and with a processor each row's images (FORMAT.md, "Image rows")."""
    from datasets import Features, List, Value

    columns = {name: List(Value(COLUMN_TYPES[name])) for name in layout_columns(layout, extra_columns)}
    if images:
        columns["images"] = List({"bytes": Value("binary"), "path": Value("string"), "hash": Value("string"),
                                  "size": Value("int64")})
        columns["image_grid_thw"] = List(List(Value("int32")))
        columns["image_sizes"] = List(List(Value("int32")))
        if "pixel_values" in extra_columns:  # each image's patches, one row of floats each, as SkyRL reads them
            columns["pixel_values"] = List(List(Value("float32")))
    return Features(columns)


def job_features(job: Job):
    """The row schema of the job's cache: what its shards hold and its dataset_info.json says."""
    return features(job.extra_columns, job.layout, images=bool(job.processor_config))
