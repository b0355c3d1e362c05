"""Runs at once on one cache directory: two of the same input share one cache, a third of other input gets its
own, and none disturbs the others."""

from __future__ import annotations

from pathlib import Path

from support.caches import published_caches
from support.cli import run_args
from support.paths import EXAMPLE_DATA

from sft_tokenize.read.cache import open_cache


def test_concurrent_runs_share_one_cache_and_leave_others_alone(tmp_path, api_url, launch):
    cache_root = tmp_path / "cache"
    other = EXAMPLE_DATA / "chat-00001.jsonl"
    runs = [launch(run_args(sources, cache_root), tmp_path / f"home-{k}", f"run-{k}", api_url=api_url)
            for k, sources in enumerate([[EXAMPLE_DATA], [EXAMPLE_DATA], [other]])]
    for run in runs:
        assert run.finish() == 0, run.stderr
    same, twin, different = (Path(run.stdout.splitlines()[-1]) for run in runs)
    assert same == twin
    assert published_caches(cache_root) == sorted([same.name, different.name])
    assert len(open_cache(same)) == 240
    assert len(open_cache(different)) == len(other.read_text().splitlines())
    assert list((cache_root / ".staging").iterdir()) == []  # each lock file removed by its last holder
