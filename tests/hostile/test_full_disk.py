"""A full disk: the shard that does not fit fails with one clear line, finished shards are kept, and the run
resumes once there is room."""

from __future__ import annotations

import os
import resource
import subprocess
from pathlib import Path

import pytest
from support.caches import published_caches, published_inodes, staged_shards
from support.cli import assert_clean_error, cli, run_args
from support.paths import EXAMPLE_DATA

from sft_tokenize.read.cache import open_cache

FREE_BYTES = 60_000  # a 32 KB shard fits, an 85 KB one does not


@pytest.fixture
def small_disk(tmp_path):
    """A directory with about FREE_BYTES left: a small tmpfs topped up with a ballast file. Yields the
    directory, a file size limit to apply to the CLI instead where mounting is not permitted (else None),
    and a function that gives the space back."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    if not mounted:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (FREE_BYTES, FREE_BYTES))

        yield mount, limit, lambda: None
        return
    try:
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        ballast = mount / "ballast"
        ballast.write_bytes(b"\0" * (free - FREE_BYTES))
        yield mount, None, ballast.unlink
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_fails_the_shard_clearly_and_the_run_resumes_after_space_returns(tmp_path, api_url, small_disk):
    disk, limit, make_room = small_disk
    cache_root = disk / "cache"
    # One worker: the slices are written one after another, so each meets the same free space.
    args = run_args([EXAMPLE_DATA], cache_root, "--workers", "1")
    full = cli(*args, home=tmp_path / "home", api_url=api_url, preexec=limit)
    assert_clean_error(full, 1, "SlicesFailed", "3 of 4 slices failed",
                       "tokenize-00000: OutOfSpace: ", "cannot write the shard (",
                       "run the same command again: finished shards are kept")
    assert "No space left on device" in full.stderr or "File too large" in full.stderr
    kept = staged_shards(cache_root)
    assert len(kept) == 1  # slice 3's, the one small enough
    assert not list(cache_root.glob(".shards/*.tmp-*"))
    assert published_caches(cache_root) == []

    make_room()
    resumed = cli(*args, home=tmp_path / "home", api_url=api_url)
    assert resumed.returncode == 0, resumed.stderr
    assert "tokenizing 4 slices (1 already in the shard store)" in resumed.stderr
    cache_path = Path(resumed.stdout.splitlines()[-1])
    assert len(open_cache(cache_path)) == 240
    assert [published_inodes(cache_path)[3]] == list(kept.values())


def test_a_disk_that_fills_while_publishing_names_the_cache_and_what_a_rerun_reuses(tmp_path, monkeypatch):
    from support.caches import EXAMPLE_SLICES

    from sft_tokenize.build import publish
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.errors import OutOfSpace

    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs is not permitted here")
    try:
        ballast = mount / "ballast"
        refuse_empty = publish.refuse_empty

        def fill_the_disk_then(*args):  # the shards are in the store; the disk fills before the cache is written
            free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
            with ballast.open("wb") as out:
                out.write(b"\0" * free)
            return refuse_empty(*args)

        monkeypatch.setattr(publish, "refuse_empty", fill_the_disk_then)
        options = TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(mount / "cache"))
        with pytest.raises(OutOfSpace) as full:
            run_locally(options)
        said = str(full.value)
        assert "\n" not in said and "No space left on device while publishing" in said, said
        assert f"the 4 finished shards stay in {mount / 'cache' / '.shards'}" in said, said
        assert said.endswith("then run the same command again: it reuses every shard and only publishes"), said
        assert published_caches(mount / "cache") == []
        ballast.unlink()
        monkeypatch.setattr(publish, "refuse_empty", refuse_empty)
        again = open_cache(run_locally(options))
        assert again.manifest["build"]["slices_reused"] == 4 and again.manifest["build"]["slices_tokenized"] == 0
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
