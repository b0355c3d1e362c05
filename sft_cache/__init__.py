"""The data plane: plain Python building blocks of the tokenized SFT cache (no Prefect import).

plan.py     resolve sources, validate them, fingerprint the run, cut byte-balanced slices
slicing.py  cut the inputs into slices whose boundaries stay put as the data grows
content.py  a slice's content key: the bytes it reads and how they are tokenized
shard.py    tokenize one slice and stream it into its own Arrow shard, in the shard store
encode_pool.py  the threads runner's encoder processes: a slice's batches rendered and masked on every core
template.py a chat template: rendered as apply_chat_template does, probed once for its turn shapes
turns.py    where each trained assistant turn lies in the rendered text
chat.py     tokenizer loading and encoding: text, trained spans and max_length become ids and masks
encoders.py the fastest exact encoder for a tokenizer (fastokens or HF), checked
prepared.py a tokenizer prepared once per content, for every later process and run
publish.py  turn the finished shards into a `datasets.load_from_disk` cache (a new version)
store.py    the shard store's build leases, and gc of old versions and unused shards
reader.py   open a published cache, memory-mapped, for a trainer
binpack.py  best-fit / first-fit decreasing over row lengths, and the data-parallel arrangement
packing.py  the global packing index beside a published cache
packed.py   packed sequences and a per-rank sampler over a cache and its index
layouts.py  the columns a cache holds for the trainer that reads it (--layout)
trainers.py loaders for trainers that would write into a cache (TRL, axolotl)
FORMAT.md   the on-disk format of staging and of a published cache
"""

__version__ = "0.1.0"
# Bumped whenever the bytes of a cache change for the same inputs; part of every fingerprint.
CACHE_FORMAT_VERSION = 2  # 2: masks by the turn finder (turns.py); shards keyed by content
