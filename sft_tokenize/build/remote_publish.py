"""Publishing to a remote cache root: a version is its metadata objects, the manifest written last in one PUT,
naming its data files' shard objects by content key. Nothing is copied: the shards stay where the workers
uploaded them, and a reader (or `sft-tokenize pull`) materializes the version locally (FORMAT.md, "A remote
cache root"). A version exists when its manifest.json does, so a reader sees a whole version or none.
"""

from __future__ import annotations

import json
import time

from sft_tokenize.build.job import Job, dataset_info
from sft_tokenize.build.publish import build_manifest, image_files, refuse_empty, stamp, state_text
from sft_tokenize.build.remote_root import root_filesystem
from sft_tokenize.build.remote_store import changed_shards, finished_all, reaching
from sft_tokenize.errors import CacheError
from sft_tokenize.format.layout import DATASET_INFO, IMAGE_FILES, MANIFEST, STATE, data_file
from sft_tokenize.read.remote_cache import Remote
from sft_tokenize.sources.records import Slice


def version_url(root_url: str, name: str, fingerprint: str) -> str:
    return f"{root_url.rstrip('/')}/{name}-{fingerprint}"


def is_published_remote(url: str, storage_options: dict | None = None) -> bool:
    """A version is published at `url`: its manifest exists and is one (as the read side checks it); a damaged
    one is published over."""
    try:
        Remote(url, storage_options).manifest()
    except CacheError:
        return False
    return True


@reaching
def publish_remote(job: Job, slices: list[Slice], url: str, inputs: dict, name: str, timings: dict | None = None,
                   reused: int = 0) -> str:
    """Check every slice's shard object (one LIST), then publish the version at `url`; returns `url`."""
    started = time.monotonic()
    done, damaged = finished_all(job, slices)
    for slice_ in slices:
        if slice_.index not in done:
            why = damaged.get(slice_.index, "no finished shard object")
            raise CacheError(f"slice {slice_.index}: {why} in {job.store}")
    shards = [done[s.index] for s in slices]
    if is_published_remote(url, job.storage_options):  # another run with the same fingerprint got there first
        return url
    refuse_empty(slices, shards)
    kept = [(meta, slice_) for meta, slice_ in zip(shards, slices, strict=True) if meta["rows"]]
    files = [{"name": data_file(k, len(kept)), "key": slice_.key, "bytes": meta["bytes"], "digest": meta["digest"],
              "rows": meta["rows"], "tokens": meta["tokens"]} for k, (meta, slice_) in enumerate(kept)]
    read_from = image_files(shards)
    info = dataset_info(job)
    fs, path = root_filesystem(url, job.storage_options, job.request_timeout)
    fs.pipe_file(f"{path}/{STATE}", state_text(job, files, read_from).encode())
    fs.pipe_file(f"{path}/{DATASET_INFO}", info)
    if read_from:
        fs.pipe_file(f"{path}/{IMAGE_FILES}", json.dumps(read_from).encode())
    manifest = build_manifest(job, slices, shards, files, inputs, name)
    stamp(manifest, len(slices), reused, timings, started)
    fs.pipe_file(f"{path}/{MANIFEST}", json.dumps(manifest, indent=2).encode())  # last: the version exists now
    # A gc that took this build for a dead one (a grace shorter than the build) may have removed shard objects
    # after the check above: then the version is withdrawn, never left naming objects that are gone.
    gone = changed_shards(job, kept)
    if gone:
        fs.rm([f"{path}/{MANIFEST}", f"{path}/{STATE}", f"{path}/{DATASET_INFO}",
               *([f"{path}/{IMAGE_FILES}"] if read_from else [])])
        listed = ", ".join(str(index) for index in gone[:10]) + (" ..." if len(gone) > 10 else "")
        raise CacheError(f"{url}: the shard objects of slices {listed} went from {job.store} while this build "
                         "published (a gc whose --grace is shorter than the build?); the version was withdrawn: "
                         "run the same command again to tokenize them again")
    return url
