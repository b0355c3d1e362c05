"""How a run runs, beside what it builds: TokenizeRun, the flow's one parameter (a typed form in the UI).

No Prefect import: the command line reads these declarations before it decides whether Prefect is needed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.encoding.pool import POOL_MIN_BYTES, available_cores
from sft_tokenize.read.packing_index import PackOptions
from sft_tokenize.tasks.tokenize_slice import RETRIES


class TokenizeRun(TokenizeOptions):
    """What to tokenize (TokenizeOptions) and how to run it: the flow's one parameter, a typed form in the UI."""

    runner: Literal["threads", "processes", "dask", "ray"] = Field(
        "threads", description="threads: the slices as threads of one process, their batches encoded by the "
        "encode pool (encode_processes); processes: one per worker; "
        "dask, ray: a cluster's workers (they must share the cache root's filesystem)."
    )
    dask_address: str | None = Field(
        None, description="Runner dask: the scheduler, tcp://HOST:PORT; none: a temporary cluster on this machine."
    )
    ray_address: str | None = Field(
        None, description="Runner ray: the cluster, HOST:PORT or ray://HOST:PORT; none: a temporary local instance."
    )
    workers: int | None = Field(None, ge=1, description="Slices tokenized at once; default: the number of cores. "
                                "On a cluster at an address the cluster decides, and this is the fewest slices cut.")
    encode_processes: int | None = Field(
        None, ge=0, description="Runner threads: processes that render, mask and encode the slices' batches; "
        f"default: one per core when the slices to tokenize hold {POOL_MIN_BYTES // 10**6} MB or more, else 0 "
        "(the slices' threads encode)."
    )
    retries: int = Field(RETRIES, ge=0, description="Retries of a failed slice, with exponential backoff.")
    force: bool = Field(False, description="Rebuild: delete the published cache and its shards in the store first.")
    pack: PackOptions | None = Field(None, description="Then build the cache's global packing index (if missing).")
    keep_versions: int | None = Field(None, ge=1, description="After publishing, remove all but the newest N "
                                      "versions of this name, and the stored shards no cache uses (sft-tokenize gc).")

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

    def encode_process_count(self, fresh_bytes: int) -> int:
        if self.runner != "threads":
            return 0  # the other runners' workers are processes already
        if self.encode_processes is not None:
            return self.encode_processes
        return available_cores() if fresh_bytes >= POOL_MIN_BYTES else 0

    @property
    def cluster_address(self) -> str | None:
        return {"dask": self.dask_address, "ray": self.ray_address}.get(self.runner)
