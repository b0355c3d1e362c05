"""A cache damaged after publishing (a data file truncated in place): readers refuse it naming the file, and the
next run rebuilds only the damaged shard, byte for byte, saying which stored shard it found corrupt."""

from __future__ import annotations

import pytest
from support.caches import contents, published_caches
from support.cli import assert_rejected, cli, run_args
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import open_cache, read_manifest


def test_a_truncated_cache_is_refused_and_rebuilt(tmp_path, api_url):
    cache_root = tmp_path / "cache"
    cache_path = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                             cache_dir=str(cache_root), shard_size="100KB"))
    intact = contents(cache_path)
    victim = sorted(cache_path.glob("data-*.arrow"))[1]
    victim.write_bytes(victim.read_bytes()[:-1000])  # in place: the store's link to this shard is truncated too

    with pytest.raises(CacheError, match=f"{victim}: .* bytes, the manifest says .* bytes: the cache is corrupt"):
        open_cache(cache_path)
    inspected = cli("inspect", str(cache_path), home=tmp_path / "home")
    assert_rejected(inspected, str(victim), "the cache is corrupt")

    rebuilt = cli(*run_args([EXAMPLE_DATA], cache_root), home=tmp_path / "home", api_url=api_url)
    assert rebuilt.returncode == 0, rebuilt.stderr
    # Only the truncated shard is tokenized again: the store's size check refuses it like the cache's does.
    assert "tokenizing 4 slices (3 already in the shard store)" in rebuilt.stderr
    store_shard = cache_root / ".shards" / f"{read_manifest(cache_path)['shards'][1]['key']}.arrow"
    assert f"{store_shard}: " in rebuilt.stderr
    assert "the stored shard is corrupt; tokenizing slice 1 again" in rebuilt.stderr
    assert rebuilt.stdout.splitlines()[-1] == str(cache_path)
    assert contents(cache_path) == intact
    assert published_caches(cache_root) == [cache_path.name] and not list(cache_root.glob(".staging/*.corrupt-*"))
