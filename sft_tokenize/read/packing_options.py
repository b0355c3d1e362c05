"""How to pack a cache (PackOptions): the `pack` command's options and the flow's `pack` parameter, declared once
here, where the command line reads them without importing the packer (read/packing_index.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from sft_tokenize.flags import MAX_DATA_PARALLEL, MAX_SEQUENCE_TOKENS, Flag, data_parallel_ranks, sequence_length

Algorithm = Literal["bfd", "ffd"]
PACK = "pack"  # the flags of `sft-tokenize pack`


class PackOptions(BaseModel):
    """How to pack a cache: the `pack` command's options and the flow's `pack` parameter, each declared once."""

    model_config = ConfigDict(extra="forbid")

    length: Annotated[int, Flag(PACK, metavar="N", parse=sequence_length)] = Field(
        gt=0, le=MAX_SEQUENCE_TOKENS, description="tokens per packed sequence: no bin holds more")
    data_parallel: Annotated[int, Flag(PACK, metavar="R", parse=data_parallel_ranks)] = Field(
        1, ge=1, le=MAX_DATA_PARALLEL, description="data-parallel ranks: every rank gets the same number of bins, "
                                                   "and the bins of one step hold nearly the same number of tokens")
    algorithm: Annotated[Algorithm, Flag(PACK)] = Field(
        "bfd", description="bfd: best-fit decreasing; ffd: first-fit decreasing")
    index_dir: Annotated[str | None, Flag(PACK, metavar="DIR")] = Field(
        None, description="write the index under DIR instead of beside the cache (for a read-only cache root)")

    @property
    def key(self) -> str:
        return f"n{self.length}-r{self.data_parallel}-{self.algorithm}"
