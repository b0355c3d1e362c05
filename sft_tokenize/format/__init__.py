"""The on-disk format: FORMAT.md (the spec, beside the code that writes it) and the manifest every reader checks."""

# Bumped whenever the bytes of a cache change for the same inputs; part of every fingerprint.
# 2: masks by the turn finder (chat/turns.py); shards keyed by content. 3: a token holding any trained character
# is trained (encoding/token_mask.py).
CACHE_FORMAT_VERSION = 3

