"""Every name of a cache root's layout on disk, spelled here and nowhere else (FORMAT.md says what each holds):

    CACHE_ROOT/
      <name>-<fingerprint>/          a published cache: MANIFEST, STATE, DATASET_INFO, data_file(k, n), IMAGE_FILES
      .staging/                      STAGING, per fingerprint: its locks, lease and staged cache (beside())
      .shards/                       SHARD_STORE: <key>.arrow and its sidecar <key>.json, GC_LOCK, DIGEST_BOOK
      .packing/<cache>/<key>/        PACKING: PACKING_INDEX, INDEX_BUILD and the index's arrays
      .mixtures/<key>/               MIXTURES: MIXTURE_INDEX, INDEX_BUILD and the index's arrays
      .prefect-results/              PREFECT_RESULTS: the Prefect layer's task results, by slice key

    USER_CACHE/remote/<root>-<hash>/  REMOTE_COPIES: a remote cache root's local copy (read/remote_cache.py), laid out
                                      as a cache root: .shards/<key>.arrow, <name>-<fingerprint>/, .staging/
    USER_CACHE/builds/<root>-<hash>/  REMOTE_BUILDS: a process's working directory for a remote root it builds
                                      (build/remote_root.py): .staging/ (the flow's run lock), .shards/ (a shard
                                      until it is uploaded)
    USER_CACHE/tokenizer-copies/<name>-<hash>/  TOKENIZER_COPIES: a tokenizer directory on object storage, copied
                                      (encoding/tokenizer.py), one directory per URL and version of its files
    USER_CACHE/compiled-templates/<hash>  COMPILED_TEMPLATES: an empty file per chat template that compiled, by the
                                      hash of its text and of transformers' and jinja2's versions
"""

from __future__ import annotations

from pathlib import Path

# The cache root's own directories, beside the published caches
STAGING = ".staging"
SHARD_STORE = ".shards"
PACKING = ".packing"
MIXTURES = ".mixtures"
PREFECT_RESULTS = ".prefect-results"  # the Prefect layer's persisted task results: a slice's row count

# A remote root (FORMAT.md): each process's local working directory for it, under the user's cache, is
# <user cache>/REMOTE_BUILDS/<the URL's name>/ and holds a local root's STAGING and SHARD_STORE
REMOTE_BUILDS = "builds"
ETAG = "etag"  # a remote sidecar's field: the store's ETag of its shard object, read right after the upload

# A published cache's files (besides its data files): what load_from_disk reads, and ours
MANIFEST = "manifest.json"
STATE = "state.json"
DATASET_INFO = "dataset_info.json"
IMAGE_FILES = "image_files.json"  # an image cache's image files, each [url, *identity]

# In the shard store
GC_LOCK = ".gc.lock"
DIGEST_BOOK = ".digests"  # JSON: a dot file (gc leaves it), not matched by `*.json` (sidecars)
SHARD_SUFFIX = ".arrow"  # <key>.arrow: a finished shard, named by its slice's content key
SIDECAR_SUFFIX = ".json"  # <key>.json beside <key>.arrow, written last

# In .staging, each beside `<fingerprint>` (the staging path a job names)
LOCK_SUFFIX = ".lock"  # held while it is published (an index: while it is built); gc tells a live one by it
RUN_LOCK_SUFFIX = ".run.lock"  # held by a running build for as long as it runs: its lease is live while held
LEASE_SUFFIX = ".lease.json"  # the keys of the shards a running build uses, which gc keeps
STAGED_SUFFIX = ".publish"  # the cache being published, then renamed into place
SET_ASIDE_SUFFIX = ".corrupt"  # a published cache found damaged, moved aside while it is replaced

# An index beside the caches (packing or mixture), in its own directory named by its key
PACKING_INDEX = "index.json"
MIXTURE_INDEX = "mixture.json"
INDEX_BUILD = "build.json"  # how the index was built: seconds, tool version

# In the user's sft-tokenize home (files.user_cache): the local copies of remote cache roots, one directory each
REMOTE_COPIES = "remote"
TOKENIZER_COPIES = "tokenizer-copies"  # and of tokenizer directories named by a URL
COMPILED_TEMPLATES = "compiled-templates"  # an empty file per chat template that compiled (chat/template_check.py)

DELETING = ".deleting"  # `.<version>.deleting-<tag>`: a version being removed, renamed out of the way first
BUILDING_SUFFIX, STALE_SUFFIX = ".building", ".stale"  # hidden, beside an index's directory: its new and old copy


def data_file(k: int, count: int) -> str:
    """The name of a published cache's k-th data file of `count`, as `datasets` names them."""
    return f"data-{k:05d}-of-{count:05d}.arrow"


def beside(path: Path, suffix: str, hidden: bool = False) -> Path:
    """What is named after `path` beside it: its name and `suffix`, behind a dot if `hidden` (a fingerprint's
    locks and lease beside its staging path, an index's lock and half-built copies beside its directory)."""
    return path.with_name(f"{'.' if hidden else ''}{path.name}{suffix}")


def is_mixture(path: str | Path) -> bool:
    """Whether `path` is a mixture index (its MIXTURE_INDEX is there), not a published cache."""
    return (Path(path) / MIXTURE_INDEX).is_file()
