"""Every name of a cache root's layout on disk, spelled here and nowhere else (FORMAT.md says what each holds):

    CACHE_ROOT/
      <name>-<fingerprint>/          a published cache: MANIFEST, STATE, DATASET_INFO, data_file(k, n), IMAGE_FILES
      .staging/                      STAGING, per fingerprint: publish_lock, run_lock, lease_file, the staged cache
      .shards/                       SHARD_STORE: <key>.arrow and its sidecar <key>.json, GC_LOCK, DIGEST_BOOK
      .packing/<cache>/<key>/        PACKING: PACKING_INDEX, INDEX_BUILD and the index's arrays
      .mixtures/<key>/               MIXTURES: MIXTURE_INDEX, INDEX_BUILD and the index's arrays
      .prefect-results/              PREFECT_RESULTS: the Prefect layer's task results, by slice key
"""

from __future__ import annotations

from pathlib import Path

# The cache root's own directories, beside the published caches
STAGING = ".staging"
SHARD_STORE = ".shards"
PACKING = ".packing"
MIXTURES = ".mixtures"
PREFECT_RESULTS = ".prefect-results"  # the Prefect layer's persisted task results: a slice's row count

# A published cache's files (besides its data files): what load_from_disk reads, and ours
MANIFEST = "manifest.json"
STATE = "state.json"
DATASET_INFO = "dataset_info.json"
IMAGE_FILES = "image_files.json"  # an image cache's image files, each [url, *identity]

# In the shard store
GC_LOCK = ".gc.lock"
DIGEST_BOOK = ".digests"  # JSON: a dot file (gc leaves it), not matched by `*.json` (sidecars)
SIDECAR_SUFFIX = ".json"  # <key>.json beside <key>.arrow, written last

# In .staging, each beside `<fingerprint>` (the staging path a job names)
LEASE_SUFFIX = ".lease.json"
STAGED_SUFFIX = ".publish"  # the cache being published, then renamed into place
SET_ASIDE_SUFFIX = ".corrupt"  # a published cache found damaged, moved aside while it is replaced

# An index beside the caches (packing or mixture), in its own directory named by its key
PACKING_INDEX = "index.json"
MIXTURE_INDEX = "mixture.json"
INDEX_BUILD = "build.json"  # how the index was built: seconds, tool version

DELETING = ".deleting"  # `.<version>.deleting-<tag>`: a version being removed, renamed out of the way first


def data_file(k: int, count: int) -> str:
    """The name of a published cache's k-th data file of `count`, as `datasets` names them."""
    return f"data-{k:05d}-of-{count:05d}.arrow"


def publish_lock(job_staging: Path) -> Path:
    """Held while a fingerprint's cache is published (and by gc, to tell a live publish from a killed one)."""
    return job_staging.with_name(f"{job_staging.name}.lock")


def run_lock(job_staging: Path) -> Path:
    """Held by a running build of the fingerprint, for as long as it runs: its lease is live while it is held."""
    return job_staging.with_name(f"{job_staging.name}.run.lock")


def lease_file(job_staging: Path) -> Path:
    """The keys of the shards a running build of the fingerprint uses, which gc keeps."""
    return job_staging.with_name(f"{job_staging.name}{LEASE_SUFFIX}")


def index_lock(index: Path) -> Path:
    """Held while the index at `index` is built: a concurrent build of the same key waits, then reuses it."""
    return index.with_name(f"{index.name}.lock")


def index_building(index: Path) -> Path:
    return index.with_name(f".{index.name}.building")


def index_stale(index: Path) -> Path:
    return index.with_name(f".{index.name}.stale")


def is_mixture(path: str | Path) -> bool:
    """Whether `path` is a mixture index (its MIXTURE_INDEX is there), not a published cache."""
    return (Path(path) / MIXTURE_INDEX).is_file()
