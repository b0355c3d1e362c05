"""What a run leaves on disk, read the way the tests compare it: published caches, finished shards in the
shard store (by key or by slice), a cache's bytes as a value, and the advisory locks of the cache format."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.read.cache import open_cache
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

# The bundled example as most runs of the suite cut it: two files, four slices (one spans both files).
EXAMPLE_SLICES = {"sources": [str(EXAMPLE_DATA)], "tokenizer": str(EXAMPLE_TOKENIZER), "shard_size": "100KB"}
EXAMPLE_SLICE_TASKS = [f"tokenize-{i:05d}" for i in range(4)]  # a flow run's task runs of them, one a slice


def published_caches(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.iterdir() if not p.name.startswith(".")) if cache_root.is_dir() else []


def staged_shards(cache_root: Path) -> dict[str, tuple[int, int]]:
    """The finished shards in the shard store (a sidecar matching the shard's size), by key: (inode, mtime_ns)."""
    finished = {}
    for sidecar in (cache_root / ".shards").glob("*.json"):
        shard = sidecar.with_suffix(".arrow")
        if shard.exists() and json.loads(sidecar.read_text())["bytes"] == shard.stat().st_size:
            finished[shard.name] = (shard.stat().st_ino, shard.stat().st_mtime_ns)
    return finished


def staged_slices(options: TokenizeOptions, min_slices: int = 2) -> dict[int, tuple[int, int]]:
    """The finished shards of the slices that `options` plan into (as a run of two workers cuts them), by slice
    index: (inode, mtime_ns) tells whether a rerun rewrote one. A shard's name is its slice's content key."""
    plan = plan_slices(options, min_slices=min_slices)
    finished = staged_shards(options.cache_root)
    return {s.index: finished[name] for s in plan.slices if (name := plan.job.shard_path(s).name) in finished}


def data_files(cache_path: str | Path) -> dict[str, bytes]:
    """A published cache's data files' bytes by name: its rows, whatever its metadata says."""
    return {path.name: path.read_bytes() for path in sorted(Path(cache_path).glob("data-*.arrow"))}


def assert_no_partial_shard(cache_root: Path) -> None:
    """Every file under a shard's name is a whole Arrow stream, and a shard with a sidecar holds its rows."""
    for shard in (cache_root / ".shards").glob("*.arrow"):
        table = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all()
        sidecar = shard.with_suffix(".json")
        if sidecar.exists():
            assert table.num_rows == json.loads(sidecar.read_text())["rows"], shard


def contents(cache_path: Path) -> dict:
    """A cache as a comparable value: the bytes of its data files and metadata, its manifest less the timings
    and the record of its build (when, how many slices it reused)."""
    manifest = json.loads((cache_path / "manifest.json").read_text())
    del manifest["timings"], manifest["build"]
    for shard in manifest["shards"]:
        del shard["seconds"]
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(cache_path.iterdir())
               if p.name != "manifest.json"}
    return {"files": digests, "manifest": manifest}


def published_inodes(cache_path: Path) -> dict[int, tuple[int, int]]:
    return {int(p.name[5:10]): (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache_path.glob("data-*.arrow")}


@contextlib.contextmanager
def held(lock_file: Path) -> Iterator[None]:
    """Hold an advisory lock of the cache format (flock), as another run would."""
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def someone_waits_for(lock_file: Path) -> bool:
    """A process is blocked waiting for this flock (the kernel lists waiters as `->` in /proc/locks)."""
    st = lock_file.stat()
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return any("->" in line and file_id in line for line in Path("/proc/locks").read_text().splitlines())


def assert_readable_whole(cache_path: Path, rows: int) -> None:
    """If the cache's directory exists at all, it is the whole cache."""
    if cache_path.exists():
        assert len(open_cache(cache_path)) == rows


def flip(path: Path) -> None:
    """Flip one byte in the middle, in place: same size, other bytes."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
