"""A locally built cache laid out on object storage as a run to a remote cache root publishes it (FORMAT.md,
"Caches on object storage"): its shards by content key with their sidecars (and the store's ETag), then the
version's small files, its manifest last with each data file's key. Readers' tests make remote caches with it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_tokenize.format.layout import DATASET_INFO, IMAGE_FILES, MANIFEST, SHARD_STORE, SIDECAR_SUFFIX, STATE


@dataclass
class RemoteCache:
    """A cache version on the test's S3 server: the server (its request counts), a filesystem on it, its URL."""

    server: Any  # support.s3.S3Server
    fs: Any
    url: str
    bucket: str


def publish_remote(fs, cache: Path, root: str) -> str:
    """Upload the published cache at `cache` (built under its own cache root, whose shard store holds its
    shards' sidecars) under the remote root `root` (a path on `fs`, e.g. `bucket/caches`); returns the version's
    path there. `fs`: an fsspec filesystem of the store."""
    manifest = json.loads((cache / MANIFEST).read_text())
    written = [shard for shard in manifest["shards"] if shard["rows"]]  # a data file per non-empty shard, in order
    assert len(written) == len(manifest["files"])
    for entry, shard in zip(manifest["files"], written, strict=True):
        key = shard["key"]
        target = f"{root}/{SHARD_STORE}/{key}"
        fs.put_file(str(cache / entry["name"]), f"{target}.arrow")
        sidecar = json.loads((cache.parent / SHARD_STORE / f"{key}{SIDECAR_SUFFIX}").read_text())
        sidecar["etag"] = fs.info(f"{target}.arrow", refresh=True)["ETag"]
        fs.pipe_file(f"{target}{SIDECAR_SUFFIX}", json.dumps(sidecar).encode())
        entry["key"] = key
    version = f"{root}/{cache.name}"
    for name in (STATE, DATASET_INFO, IMAGE_FILES):
        if (cache / name).exists():
            fs.put_file(str(cache / name), f"{version}/{name}")
    fs.pipe_file(f"{version}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
    return version
