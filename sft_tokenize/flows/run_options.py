"""How a run runs, beside what it builds: TokenizeRun, the flow's one parameter (a typed form in the UI).

No Prefect import: the command line reads these declarations before it decides whether Prefect is needed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from sft_tokenize.build.options import SLICES, VERSIONS, TokenizeOptions
from sft_tokenize.encoding.cores import POOL_MIN_BYTES, available_cores
from sft_tokenize.flags import MAX_ENCODE_PROCESSES, Flag, encode_pool_size, positive_int
from sft_tokenize.read.packing_options import PackOptions
from sft_tokenize.tasks import GROUP_ABOVE, GROUP_SIZE, RETRIES


class TokenizeRun(TokenizeOptions):
    """What to tokenize (TokenizeOptions) and how to run it: the flow's one parameter, a typed form in the UI.

    Each field below is declared once, as TokenizeOptions' are: its description is the UI form's text and, with
    its default, `sft-tokenize run --help`'s and docs/cli.md's."""

    runner: Annotated[Literal["threads", "processes", "dask", "ray"], Flag(SLICES)] = Field(
        "threads", description="how the slices run in parallel: threads (threads of one process, their batches "
                               "encoded by the encode processes), processes (one per worker), dask or ray (a "
                               "cluster's workers, which must share the cache root's filesystem); see "
                               "docs/scale-out.md")
    dask_address: Annotated[str | None, Flag(SLICES, metavar="tcp://HOST:PORT")] = Field(
        None, description="runner dask: a running scheduler (default: a temporary cluster on this machine)")
    ray_address: Annotated[str | None, Flag(SLICES, metavar="HOST:PORT")] = Field(
        None, description="runner ray: a running cluster, HOST:PORT or ray://HOST:PORT (default: a temporary local "
                          "instance)")
    workers: Annotated[int | None, Flag(SLICES, metavar="N", parse=positive_int)] = Field(
        None, ge=1, description="slices tokenized at once (default: the number of cores); on a cluster at an address "
                                "the cluster decides, and at least this many slices are cut")
    encode_processes: Annotated[int | None, Flag(SLICES, metavar="N", parse=encode_pool_size)] = Field(
        None, ge=0, le=MAX_ENCODE_PROCESSES,
        description="runner threads: processes that render, mask and encode the slices' batches (default: one per "
                    f"core when the slices to tokenize hold {POOL_MIN_BYTES // 10**6} MB or more or a resident process "
                    "has a pool ready for the job, else 0: the slices' threads encode; at most "
                    f"{MAX_ENCODE_PROCESSES})")
    slices_per_task: Annotated[int | None, Flag(SLICES, metavar="N", parse=positive_int)] = Field(
        None, ge=1, description="slices one Prefect task tokenizes, each into its own shard, on average (groups cut "
                                f"by content; 1: a task per slice); default: 1 up to {GROUP_ABOVE} slices, then up "
                                f"to {GROUP_SIZE}, fewer to keep a task's input within 256 MB and to leave 4 tasks "
                                "per worker")
    retries: Annotated[int, Flag(SLICES, metavar="N", parse=int)] = Field(
        RETRIES, ge=0, description="retries of a failed slice, with exponential backoff")
    force: Annotated[bool, Flag(VERSIONS)] = Field(
        False, description="rebuild: delete the published cache and its shards in the store first")
    pack: PackOptions | None = Field(None, description="Then build the cache's global packing index (if missing).")
    keep_versions: Annotated[int | None, Flag(VERSIONS, metavar="N", parse=positive_int)] = Field(
        None, ge=1, description="after publishing, remove all but the newest N versions of this name, and the stored "
                                "shards no cache uses (as sft-tokenize gc)")

    @field_validator("dask_address", "ray_address")
    @classmethod
    def _address_matches_the_runner(cls, address: str | None, info: ValidationInfo) -> str | None:
        runner = info.field_name.removesuffix("_address")
        if address and info.data.get("runner") != runner:
            raise ValueError(f"an address for {runner} needs runner {runner} (--runner {runner})")
        return address or None

    @property
    def worker_count(self) -> int:
        return self.workers or available_cores()

    def encode_process_count(self, fresh_bytes: int, ready: int = 0) -> int:
        """`ready`: the processes of a pool already started for the run's job (workers.ready_processes)."""
        if self.runner != "threads":
            return 0  # the other runners' workers are processes already
        if self.encode_processes is not None:
            return self.encode_processes
        return available_cores() if fresh_bytes >= POOL_MIN_BYTES else ready

    @property
    def ready_pool_count(self) -> int:
        """The processes of the encode pool a resident keeps ready for the next run like this one (0: none): those
        a run large enough for a pool would take."""
        return self.encode_process_count(POOL_MIN_BYTES)

    @property
    def cluster_address(self) -> str | None:
        return {"dask": self.dask_address, "ray": self.ray_address}.get(self.runner)


# The options that say how a run runs, not what it builds: TokenizeRun's own.
RUN_OPTIONS = tuple(name for name in TokenizeRun.model_fields if name not in TokenizeOptions.model_fields)
