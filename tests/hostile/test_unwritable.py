"""A cache root or a PREFECT_HOME that cannot be written: a run with work to do exits 2 with one line naming
the directory, before Prefect starts; a cache hit on a read-only root is still served; once the directory is
writable again the same command builds the cache a clean run builds.

The suite may run as root, whom modes do not stop: there the directory is made read-only by a read-only bind
mount of itself (EROFS for everyone), or failing that the immutable attribute (chattr +i); a test that can
do neither is skipped, saying why."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.caches import contents
from support.cli import assert_rejected, cli, run_args
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import BadInput

SOURCE = EXAMPLE_DATA / "chat-00001.jsonl"


def _run(*command: str) -> bool:
    return subprocess.run(command, capture_output=True).returncode == 0


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[str]:
    """`directory` and everything under it unwritable for this process and its children; yields how."""
    directories = [directory, *(p for p in directory.rglob("*") if p.is_dir())]
    if os.geteuid() != 0:
        for d in directories:
            d.chmod(0o555)
        try:
            yield "mode 555"
        finally:
            for d in directories:
                d.chmod(0o755)
        return
    if _run("mount", "--bind", str(directory), str(directory)):
        try:
            if not _run("mount", "-o", "remount,bind,ro", str(directory)):
                pytest.skip("running as root where a bind mount cannot be made read-only")
            yield "read-only bind mount"
        finally:
            subprocess.run(["umount", str(directory)], check=True)
        return
    if shutil.which("chattr") and _run("chattr", "+i", *map(str, directories)):
        try:
            yield "chattr +i"
        finally:
            subprocess.run(["chattr", "-i", *map(str, directories)], check=True)
        return
    pytest.skip("running as root without mount or chattr +i: no way to make a directory read-only")


def options(cache: Path) -> TokenizeOptions:
    return TokenizeOptions(sources=[str(SOURCE)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(cache),
                           shard_size="100KB")


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    return contents(run_locally(options(tmp_path_factory.mktemp("clean") / "cache")))


def test_a_read_only_cache_root_is_refused_before_any_work_and_serves_its_caches(tmp_path, clean):
    cache = tmp_path / "cache"
    (cache / ".staging").mkdir(parents=True)
    with read_only(cache) as how:
        print(f"read-only by {how}")
        with pytest.raises(BadInput, match=f"^cache dir {cache}: not writable \\(.+\\): a run that tokenizes"):
            run_locally(options(cache))
    assert sorted(p.name for p in cache.rglob("*")) == [".staging"]  # no probe, no lock, no shard left
    path = run_locally(options(cache))
    assert contents(path) == clean
    with read_only(cache):
        assert run_locally(options(cache)) == path  # a cache hit writes nothing


def test_run_on_a_read_only_cache_root_exits_2_in_one_line(tmp_path, api_url, clean):
    cache, home = tmp_path / "cache", tmp_path / "home"
    (cache / ".staging").mkdir(parents=True)
    args = run_args([SOURCE], cache, "--workers", "1")  # the slices run_locally cuts
    with read_only(cache):
        refused = cli(*args, home=home, api_url=api_url)
    assert_rejected(refused, f"cache dir {cache}: not writable (", "choose a writable --cache-dir")
    built = cli(*args, home=home, api_url=api_url)
    assert built.returncode == 0, built.stderr
    path = Path(built.stdout.splitlines()[-1])
    assert contents(path) == clean
    with read_only(cache):
        hit = cli(*args, home=home, api_url=api_url)
        forced = cli(*args, "--force", home=home, api_url=api_url)
    assert hit.returncode == 0 and hit.stdout.splitlines()[-1] == str(path), hit.stderr
    assert_rejected(forced, f"cache dir {cache}: not writable (")
    assert contents(path) == clean


def test_a_read_only_prefect_home_exits_2_naming_it_before_prefect_starts(tmp_path, cli_home):
    home = cli_home
    home.mkdir()
    with read_only(home):
        refused = cli(*run_args([SOURCE], tmp_path / "cache"), home=home)
    assert_rejected(refused, f"PREFECT_HOME {home}: Prefect's embedded server cannot keep its database there (",
                    "PREFECT_HOME at a writable directory")
    assert not any(home.iterdir())
