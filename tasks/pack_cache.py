"""Task entrypoint `tasks/pack_cache.py:pack_cache` (`prefect task serve`, or a flow file of your own in this
checkout). The task lives in `sft_tokenize.tasks.pack_cache`; this file only names it."""

from sft_tokenize.tasks.pack_cache import pack_cache

__all__ = ["pack_cache"]
