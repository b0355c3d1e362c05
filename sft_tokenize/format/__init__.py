"""The on-disk format: FORMAT.md (the spec, beside the code that writes it) and the manifest every reader checks."""

# Bumped whenever the bytes of a cache change for the same inputs; part of every fingerprint.
CACHE_FORMAT_VERSION = 2  # 2: masks by the turn finder (chat/turns.py); shards keyed by content

# The shard store beside the caches (FORMAT.md): written by the build side, read by `inspect --verify` too.
SHARD_STORE = ".shards"
