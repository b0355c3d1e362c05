"""Task entrypoint `tasks/publish_cache.py:publish_cache` (`prefect task serve`, or a flow file of your own in this
checkout). The task lives in `sft_tokenize.tasks.publish_cache`; this file only names it."""

from sft_tokenize.tasks.publish_cache import publish_cache

__all__ = ["publish_cache"]
