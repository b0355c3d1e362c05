"""The Job: what every slice's task needs besides its slice, and the cache's row schema it implies.

Small and picklable, the same for all slices of a run: it travels to every worker (a thread, a process, a
Dask or Ray worker). Its fields are what the plan resolved (the fingerprints, where to write, the tokenizer's
directory, the template's text, the column mapping) and the options the slices read, one field each, as the
option table declares them (options.py), written out so that editors and type checkers see them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path

from sft_tokenize.build.options import (
    Encoder,
    ImageAccess,
    ImagesMode,
    OnBadRow,
    ReasoningTurns,
    Render,
    SpecialText,
    TrainOn,
    Truncation,
)
from sft_tokenize.build.remote_root import working_dir
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.files import REMOTE_TIMEOUT, REQUEST_TIMEOUT
from sft_tokenize.format.layout import DIGEST_BOOK, SHARD_STORE, SHARD_SUFFIX
from sft_tokenize.read.layouts import COLUMN_TYPES, Layout, layout_columns
from sft_tokenize.sources.conversations import ColumnMap
from sft_tokenize.sources.records import Slice


class _JobPaths:
    """Where a job's files are."""

    store: str
    remote_root: str

    @property
    def local_store(self) -> Path:
        """Where this process writes shards: the store itself, or with a remote root this process's own working
        store, derived here (never a path the flow's machine computed: a worker has its own disk)."""
        if self.remote_root:
            return working_dir(self.remote_root) / SHARD_STORE
        return Path(self.store)

    def shard_path(self, slice_: Slice) -> Path:
        return self.local_store / f"{slice_.key}{SHARD_SUFFIX}"

    @property
    def digest_book(self) -> Path:
        return self.local_store / DIGEST_BOOK


@dataclass(frozen=True)
class Job(_JobPaths):
    """What every slice's task needs besides its slice: small and picklable, the same for all slices."""

    fingerprint: str
    staging: str
    tokenizer_dir: str
    chat_template: str | None  # the template's text: the override's, or None for the tokenizer's own
    columns: ColumnMap
    # The options the slices read, in the option table's order and as it declares them (options.py: their
    # `job`); test_options checks that these fields are that table's.
    images: ImagesMode = "embed"
    image_root: str | None = None
    image_access: ImageAccess = "root"
    image_timeout: float = REMOTE_TIMEOUT
    max_image_bytes: int = 50 * 10**6
    system_prompt: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    reasoning_turns: ReasoningTurns = "as-rendered"
    special_text: SpecialText = "literal"
    train_on: TrainOn = "all_assistant"
    max_length: int | None = None
    truncation: Truncation = "truncate"
    extra_columns: tuple[str, ...] = ()
    layout: Layout = "skyrl"
    encoder: Encoder = "auto"
    render: Render = "skeleton"
    on_bad_row: OnBadRow = "raise"
    max_row_bytes: int = 2 * 10**6
    storage_options: dict = field(default_factory=dict)
    request_timeout: float = REQUEST_TIMEOUT
    writer_batch_rows: int = 1000
    writer_batch_bytes: int = 16 * 10**6
    trust_remote_code: bool = False
    # the shard store: finished shards by content key, shared by every cache under the root
    store: str = ""
    # the fingerprint of everything that changes how a row is tokenized
    tokenization: str = ""
    # where the tokenizer is kept prepared (prepared.py); empty: loaded and checked each time
    prepared: str = ""
    # the processor's configuration as JSON text (image rows, encoding/vision.py); empty: no processor
    processor_config: str = ""
    # the tokenizer's URL when it is on object storage: each process loads its own copy (fetch_tokenizer), since
    # tokenizer_dir is the planning machine's
    tokenizer_url: str = ""
    # the URL of a remote cache root (remote_root.py); empty: a local root. Then `store` is its store's URL, and
    # each process writes its shards into its own working store (local_store) before uploading them
    remote_root: str = ""
    # this run's own id: what a process learned while encoding (chat/skeleton.py) is never carried into another run
    run: str = ""

    @cached_property
    def masks(self) -> MaskSettings:
        """The mask settings of this job's rows, made once: its fields of MaskSettings' names, and skeletons as
        --render says."""
        named = {f.name: getattr(self, f.name) for f in fields(MaskSettings) if f.name != "skeletons"}
        return MaskSettings(**named, skeletons=self.render == "skeleton")


def feature_dict(extra_columns: tuple[str, ...] = (), layout: str = "skyrl", images: bool = False) -> dict:
    """The cache's row schema as `datasets` writes its Features (`Features.to_dict()`): the layout's columns (see
    layouts.py), extras on request, and with a processor each row's images (FORMAT.md, "Image rows"). Plain data,
    so that writing a shard imports no `datasets` (nor pandas, which it imports)."""
    def value(dtype: str) -> dict:
        return {"dtype": dtype, "_type": "Value"}

    def listed(feature: dict) -> dict:
        return {"feature": feature, "_type": "List"}

    columns = {name: listed(value(COLUMN_TYPES[name])) for name in layout_columns(layout, extra_columns)}
    if images:
        columns["images"] = listed({"bytes": value("binary"), "path": value("string"), "hash": value("string"),
                                    "size": value("int64")})
        columns["image_grid_thw"] = listed(listed(value("int32")))
        columns["image_sizes"] = listed(listed(value("int32")))
        if "pixel_values" in extra_columns:  # each image's patches, one row of floats each, as SkyRL reads them
            columns["pixel_values"] = listed(listed(value("float32")))
    return columns


def _arrow_type(feature: dict):
    import pyarrow as pa

    if feature.get("_type") == "Value":
        return pa.binary() if feature["dtype"] == "binary" else pa.type_for_alias(feature["dtype"])
    if feature.get("_type") == "List":
        return pa.list_(_arrow_type(feature["feature"]))
    return pa.struct([(name, _arrow_type(inner)) for name, inner in feature.items()])


def arrow_schema(extra_columns: tuple[str, ...] = (), layout: str = "skyrl", images: bool = False):
    """The shards' Arrow schema, with the metadata `datasets.ArrowWriter` gives it (`load_from_disk` reads the
    features back from it): the same bytes as that writer's."""
    import pyarrow as pa

    columns = feature_dict(extra_columns, layout, images)
    metadata = {"huggingface": json.dumps({"info": {"features": columns}})}
    return pa.schema([(name, _arrow_type(feature)) for name, feature in columns.items()], metadata=metadata)


def dataset_info(job: Job) -> bytes:
    """The cache's dataset_info.json, as `datasets.DatasetInfo(features=...).write_to_directory` writes it."""
    return json.dumps({"description": "", "citation": "", "homepage": "", "license": "",
                       "features": job_feature_dict(job)}).encode()


def features(extra_columns: tuple[str, ...] = (), layout: str = "skyrl", images: bool = False):
    """feature_dict as `datasets` Features (imports datasets: for the peers a benchmark compares, not for a run)."""
    from datasets import Features

    return Features.from_dict(feature_dict(extra_columns, layout, images))


def job_feature_dict(job: Job) -> dict:
    """feature_dict of the job's cache: what its shards hold and its dataset_info.json says."""
    return feature_dict(job.extra_columns, job.layout, images=bool(job.processor_config))

