"""Task entrypoint `tasks/tokenize_slices.py:tokenize_slices` (`prefect task serve`, or a flow file of your own in this
checkout). The task lives in `sft_tokenize.tasks.tokenize_slices`; this file only names it."""

from sft_tokenize.tasks.tokenize_slices import tokenize_slices

__all__ = ["tokenize_slices"]
