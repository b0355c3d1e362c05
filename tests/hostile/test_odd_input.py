"""Hostile input that must be read right: directories of links with the cache inside them, a cache built by
skipping bad rows that a strict run must not reuse, very long file names, a corrupt manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bad_input import BAD_LINE, ROW_ERRORS, built_skipping, write_lines
from support.caches import published_caches
from support.cli import assert_rejected, cli, run_args
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import open_cache


def _snapshot(d: Path) -> tuple[Path, int]:
    """A Hugging Face snapshot directory: links into blobs/, one real file beside them, a README, a nested
    directory. The JSONL and the JSON array start with a byte order mark. Returns it and its row count."""
    rows = example_rows()
    (d / "blobs").mkdir()
    (d / "blobs" / "1f0c").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows[:5]).encode())
    (d / "blobs" / "9a2e").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows[5:8]).encode())
    write_jsonl(d / "blobs" / "77b3", rows[8:10])
    snapshot = d / "snapshot"
    (snapshot / "more").mkdir(parents=True)
    (snapshot / "a.jsonl").symlink_to("../blobs/1f0c")
    (snapshot / "b.json").symlink_to("../blobs/9a2e")
    write_jsonl(snapshot / "c[1].jsonl", rows[10:13])  # a real file, its name a glob pattern
    (snapshot / "more" / "d.jsonl").symlink_to("../../blobs/77b3")
    (snapshot / "README.md").write_text("# a dataset card\n")
    (snapshot / ".gitattributes").write_text("*.jsonl filter=lfs\n")
    return snapshot, 13


def test_a_directory_of_links_is_read_whole_its_cache_inside_never_read_and_its_glob_gives_the_same_cache(
        tmp_path, api_url):
    snapshot, rows = _snapshot(tmp_path)
    cache_root = snapshot / "cache"  # inside the input directory
    args = ("--name", "snap", "--tokenizer", str(EXAMPLE_TOKENIZER), "--shard-size", "1KB", "--workers", "2")
    first = cli("run", str(snapshot), "--cache-dir", str(snapshot / "more" / ".." / "cache"), *args,
                home=tmp_path / "home", api_url=api_url)
    assert first.returncode == 0, first.stderr
    cache_path = Path(first.stdout.splitlines()[-1])
    assert cache_path.parent == cache_root  # printed normalised, without more/..
    assert len(open_cache(cache_path)) == rows  # every row of every file: links, BOMs, the nested one
    manifest = json.loads((cache_path / "manifest.json").read_text())
    assert [Path(url).name for url, *_ in manifest["fingerprint_inputs"]["sources"]] == [
        "a.jsonl", "b.json", "c[1].jsonl", "d.jsonl"]
    assert manifest["fingerprint_inputs"]["ignored_files"] == [str(snapshot / "README.md")]
    assert f"not data, not read: {snapshot / 'README.md'}" in first.stderr

    # The published cache and its staging under the input directory are not input: the same run is a cache
    # hit, and so are the same files named by globs (the README, matched by no glob, is not an input either).
    again = cli("run", str(snapshot), "--cache-dir", str(cache_root), *args, home=tmp_path / "home")
    globbed = cli("run", str(snapshot / "*.json*"), str(snapshot / "more" / "*"), "--cache-dir", str(cache_root),
                  *args, home=tmp_path / "home")
    for hit in (again, globbed):
        assert hit.returncode == 0, hit.stderr
        assert hit.stdout.splitlines() == [str(cache_path)] and hit.stderr == ""
    assert published_caches(cache_root) == [cache_path.name]


def test_a_skip_built_cache_is_not_served_to_a_raise_run(tmp_path, api_url):
    good = [json.dumps(row) for row in example_rows()[:6]]
    lines = [BAD_LINE, good[0], ROW_ERRORS["lone-surrogate"][0], good[1], ROW_ERRORS["deep-nesting"][0], *good[2:]]
    data = write_lines(tmp_path / "messy.jsonl", lines)
    cache_root = tmp_path / "cache"
    cache_path, manifest = built_skipping(data, cache_root, tmp_path / "home", api_url)
    assert manifest["rows"] == len(good) == len(open_cache(cache_path))
    assert manifest["dropped"] == {"malformed_json": 2, "not_unicode": 1}  # the bad line 1 is skipped like any
    assert manifest["fingerprint_inputs"]["on_bad_row"] == "skip"

    raised = cli(*run_args([data], cache_root), home=tmp_path / "home", api_url=api_url)
    assert_rejected(raised, f"{data}:1: not valid JSON: Expecting")
    assert len(raised.stderr.splitlines()) == 1, raised.stderr
    assert published_caches(cache_root) == [cache_path.name]


def test_a_240_character_file_name_gives_a_cache_named_by_its_first_100(tmp_path, api_url):
    data = write_jsonl(tmp_path / ("r" * 234 + ".jsonl"), example_rows()[:3])
    result = cli(*run_args([data], tmp_path / "cache", "--force"), home=tmp_path / "home", api_url=api_url)
    assert result.returncode == 0, result.stderr
    cache_path = Path(result.stdout.splitlines()[-1])
    assert cache_path.name.startswith("r" * 100 + "-") and len(cache_path.name) == 117
    assert len(open_cache(cache_path)) == 3


@pytest.mark.parametrize(("manifest", "force"), [({}, False), ([1], True)])
def test_a_corrupt_manifest_is_rebuilt_by_run_and_by_run_force(tmp_path, api_url, manifest, force):
    cache_root = tmp_path / "cache"
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows()[:4])
    cache_path = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=str(EXAMPLE_TOKENIZER),
                                             cache_dir=str(cache_root)))
    intact = [open_cache(cache_path)[i]["input_ids"].tolist() for i in range(4)]
    (cache_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="manifest.json .* the cache is corrupt"):
        open_cache(cache_path)
    rebuilt = cli(*run_args([data], cache_root, *(["--force"] if force else [])), home=tmp_path / "home",
                  api_url=api_url)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert rebuilt.stdout.splitlines()[-1] == str(cache_path)
    assert [open_cache(cache_path)[i]["input_ids"].tolist() for i in range(4)] == intact
