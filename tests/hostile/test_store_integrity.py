"""A damaged shard store: a stored shard truncated, its bytes flipped, two shards swapped, a sidecar garbled or
from before shards were digested. A grown version that would reuse the shard tokenizes it again instead,
with a warning naming it, and publishes exactly what a clean build does; publish itself refuses a shard
damaged after it was tokenized. And gc or a forced rebuild beside another version's build leaves that build's
shards alone. The data plane (run_locally), but for one test of `run --force` and `gc` from the command line."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from support.caches import contents, flip
from support.cli import cli, run_args
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.publish import building, publish_cache
from sft_tokenize.build.shard import tokenize_slice
from sft_tokenize.build.shard_check import finished_shard, sidecar_path
from sft_tokenize.build.store import collect_garbage, discard_shards, leased, remove_cache, store_dir
from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import read_manifest

FIRST = EXAMPLE_DATA / "chat-00000.jsonl"  # version A: two slices; version B adds chat-00001.jsonl (two more)


def options(cache: Path, *sources: Path) -> TokenizeOptions:
    return TokenizeOptions(sources=[str(s) for s in sources or (EXAMPLE_DATA,)], tokenizer=str(EXAMPLE_TOKENIZER),
                           cache_dir=str(cache), name="mix", shard_size="100KB")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    """A cache root holding version A (the first file), and what a clean build of version B publishes."""
    base = tmp_path_factory.mktemp("store")
    run_locally(options(base / "a", FIRST))
    return base / "a", contents(run_locally(options(base / "clean")))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def swap(first: Path, second: Path) -> None:
    aside = first.with_name("aside")
    os.rename(first, aside)
    os.rename(second, first)
    os.rename(aside, second)


def shards_of(cache: Path) -> list[Path]:
    """Version A's shards in the store, in slice order."""
    (path,) = [p for p in cache.iterdir() if p.name.startswith("mix-")]
    return [store_dir(cache) / f"{s['key']}.arrow" for s in read_manifest(path)["shards"]]


DAMAGE = {
    "truncated": (lambda a, b: truncate(a), "bytes, its sidecar says"),
    "flipped": (lambda a, b: flip(a), "its bytes do not match its sidecar's digest"),
    "swapped": (swap, "the stored shard is corrupt"),
    "sidecar-garbled": (lambda a, b: sidecar_path(a).write_text("{\"key\": "), "unreadable sidecar"),
    "sidecar-not-an-object": (lambda a, b: sidecar_path(a).write_text("[]"), "the sidecar is not this shard's"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_stored_shard_is_tokenized_again_not_reused(built, tmp_path, caplog, damage):
    cache = Path(shutil.copytree(built[0], tmp_path / "cache"))
    first, second = shards_of(cache)
    harm, said = DAMAGE[damage]
    harm(first, second)

    with caplog.at_level(logging.WARNING, logger="sft_tokenize"):
        path = run_locally(options(cache))
    assert contents(path) == built[1]
    damaged = [first, second] if damage == "swapped" else [first]
    build = read_manifest(path)["build"]
    assert (build["slices_reused"], build["slices_tokenized"]) == (2 - len(damaged), 2 + len(damaged))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == len(damaged), warned
    for shard, message in zip(damaged, warned, strict=True):
        assert message.startswith(str(shard if "sidecar" not in damage else sidecar_path(shard))), message
        assert said in message and "tokenizing slice" in message


def test_a_sidecar_from_before_shards_were_digested_is_not_trusted(built, tmp_path, caplog):
    cache = Path(shutil.copytree(built[0], tmp_path / "cache"))
    shards = shards_of(cache)
    for shard in shards:
        meta = json.loads(sidecar_path(shard).read_text())
        del meta["digest"]
        sidecar_path(shard).write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="sft_tokenize"):
        path = run_locally(options(cache))
    assert read_manifest(path)["build"]["slices_reused"] == 0 and contents(path) == built[1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # not damage: quietly tokenized again
    assert all("digest" in json.loads(sidecar_path(shard).read_text()) for shard in shards)


def test_publish_refuses_a_shard_damaged_after_it_was_tokenized(built, tmp_path):
    cache = tmp_path / "cache"
    plan = plan_slices(options(cache))
    for slice_ in plan.slices:
        tokenize_slice(plan.job, slice_)
    victim = plan.job.shard_path(plan.slices[1])
    flip(victim)
    assert finished_shard(plan.job, plan.slices[1]) is None
    with pytest.raises(CacheError, match="slice 1 has no finished shard"):
        publish_cache(plan.job, plan.slices, plan.cache_path, plan.inputs, plan.name)
    assert not plan.cache_path.exists()
    assert contents(run_locally(options(cache))) == built[1]  # the rerun tokenizes slice 1 again


def test_gc_and_a_forced_rebuild_beside_another_versions_build_leave_its_shards(built, tmp_path):
    """Version B is building (leased, one new slice tokenized, not published) when gc runs and version A is
    forced (its cache and its shards deleted, as `run --force` does): B's shards, A's two among them, stay."""
    cache = Path(shutil.copytree(built[0], tmp_path / "cache"))
    plan_a, plan_b = plan_slices(options(cache, FIRST)), plan_slices(options(cache))
    with building(plan_b.job), leased(plan_b.job, plan_b.slices) as reused:
        assert reused == {0, 1}
        tokenize_slice(plan_b.job, plan_b.slices[2])
        done = collect_garbage(cache, keep=1)
        assert (done.live_builds, done.removed, done.shards_removed) == (1, [], 0)
        with building(plan_a.job):
            remove_cache(plan_a.cache_path)
            assert discard_shards(plan_a.job, plan_a.slices) == 0  # both are B's too
        assert all(finished_shard(plan_b.job, s) for s in plan_b.slices[:3])
        for slice_ in plan_b.slices:
            tokenize_slice(plan_b.job, slice_)
        path = publish_cache(plan_b.job, plan_b.slices, plan_b.cache_path, plan_b.inputs, plan_b.name,
                             reused=len(reused))
    assert contents(path) == built[1]
    assert read_manifest(path)["build"]["slices_tokenized"] == 2


def test_run_force_and_gc_from_the_command_line_beside_another_versions_build(built, tmp_path, api_url):
    cache = Path(shutil.copytree(built[0], tmp_path / "cache"))
    plan_b = plan_slices(options(cache))
    home = tmp_path / "home"
    with building(plan_b.job), leased(plan_b.job, plan_b.slices) as reused:
        tokenize_slice(plan_b.job, plan_b.slices[2])
        forced = cli(*run_args([FIRST], cache, "--name", "mix", "--force"), home=home, api_url=api_url)
        assert forced.returncode == 0, forced.stderr
        assert "force: kept 2 shards of this plan that another running build uses" in forced.stderr
        collected = cli("gc", str(cache), home=home)
        assert collected.returncode == 0 and "1 running builds" in collected.stdout, collected.stderr
        assert all(finished_shard(plan_b.job, s) for s in plan_b.slices[:3])
        for slice_ in plan_b.slices:
            tokenize_slice(plan_b.job, slice_)
        path = publish_cache(plan_b.job, plan_b.slices, plan_b.cache_path, plan_b.inputs, plan_b.name,
                             reused=len(reused))
    assert contents(path) == built[1]
    assert read_manifest(Path(forced.stdout.splitlines()[-1]))["rows"] == len(FIRST.read_text().splitlines())
