"""Task entrypoint `tasks/plan_slices.py:plan_slices` (`prefect task serve`, or a flow file of your own in this
checkout). The task lives in `sft_tokenize.tasks.plan_slices`; this file only names it."""

from sft_tokenize.tasks.plan_slices import plan_slices

__all__ = ["plan_slices"]
