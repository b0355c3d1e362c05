"""Task entrypoint `tasks/tokenize_slice.py:tokenize_slice` (`prefect task serve`, or a flow file of your own in this
checkout). The task lives in `sft_tokenize.tasks.tokenize_slice`; this file only names it."""

from sft_tokenize.tasks.tokenize_slice import tokenize_slice

__all__ = ["tokenize_slice"]
