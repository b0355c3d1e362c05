"""A cache version on object storage (a real S3 API, moto, on 127.0.0.1) read back: materialized once per
machine, checked against its manifest's digests, and the same rows as the local cache it was laid out from."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from support.cli import cli
from support.remote_caches import publish_remote

from sft_tokenize.cli.main import main
from sft_tokenize.errors import CacheError
from sft_tokenize.files import locked
from sft_tokenize.format.layout import LOCK_SUFFIX, MANIFEST, REMOTE_COPIES, SHARD_STORE, STAGING
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.remote_cache import default_local_dir, split_version


def shard_paths(remote) -> dict[str, int]:
    """Each shard object's request path on the server → its size."""
    manifest = json.loads(remote.fs.cat_file(remote.url[len("s3://"):] + "/" + MANIFEST))
    root = remote.url[len("s3:/"):].rpartition("/")[0]
    return {f"{root}/{SHARD_STORE}/{f['key']}.arrow": f["bytes"] for f in manifest["files"]}


def test_open_cache_on_a_url_is_the_local_cache_row_by_row(remote_example, example_cache, tmp_path):
    cache = open_cache(remote_example.url, local_dir=tmp_path / "local")
    local = open_cache(example_cache)
    assert cache.path == tmp_path / "local" / example_cache.name
    assert len(cache) == len(local) == 240 and cache.columns == local.columns
    for name in ("input_ids", "loss_mask"):
        assert cache.table.column(name).to_pylist() == local.table.column(name).to_pylist()
    manifest = json.loads((cache.path / MANIFEST).read_text())
    for entry in manifest["files"]:  # data files are the downloaded shards, linked
        assert (cache.path / entry["name"]).stat().st_ino == (tmp_path / "local" / SHARD_STORE /
                                                             f"{entry['key']}.arrow").stat().st_ino
    # packed sequences over a cache opened from a URL: its index lands beside the local copy
    assert sum(len(bin_["input_ids"]) for bin_ in cache.packed(512)) == sum(cache.lengths)

    remote_example.server.clear()
    again = open_cache(remote_example.url, local_dir=tmp_path / "local")  # complete: no request at all
    assert len(again) == 240 and not remote_example.server.requests


OPEN_AT_ONCE = """
import sys
from sft_tokenize import open_cache
print(open_cache(sys.argv[1]).path)
"""


def waited(process: subprocess.Popen, seconds: float = 60) -> str:
    """The line on `process`'s stderr that says it waits for another copy (failing after `seconds`)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and select.select([process.stderr], [], [], left)[0]:
        line = process.stderr.readline()
        if "another process is copying" in line or not line:
            return line
    raise AssertionError(f"process {process.pid} never said it waits")


def test_two_processes_on_one_node_download_each_shard_once(remote_example, tmp_path, monkeypatch):
    """Both start while the version's lock is held, so both are there at once: one copies, the other waits for
    it and then downloads nothing."""
    home = tmp_path / "home"
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(home))
    root, version = split_version(remote_example.url)
    remote_example.server.clear()
    with locked(default_local_dir(root) / STAGING / f"{version}{LOCK_SUFFIX}"):
        processes = [subprocess.Popen([sys.executable, "-c", OPEN_AT_ONCE, remote_example.url], text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        for process in processes:
            assert remote_example.url in waited(process)
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    path = Path(paths.pop())
    assert path.parent.parent == home / REMOTE_COPIES and path.parent.name.startswith(f"{remote_example.bucket}-sft-")
    assert remote_example.server.requests["GET", f"/{remote_example.url[len('s3://'):]}/{MANIFEST}"] == 1
    shards = shard_paths(remote_example)
    assert len(shards) == 4
    for object_path, size in shards.items():
        assert remote_example.server.requests["GET", object_path] == 1, (object_path, remote_example.server.requests)
        assert remote_example.server.served[object_path] == size


def test_a_corrupt_shard_object_is_refused_by_name_and_nothing_is_published(remote_example, example_cache, tmp_path):
    fs = remote_example.fs
    version = publish_remote(fs, example_cache, f"{remote_example.bucket}/damaged")
    manifest = json.loads(fs.cat_file(f"{version}/{MANIFEST}"))
    bad = f"{remote_example.bucket}/damaged/{SHARD_STORE}/{manifest['files'][2]['key']}.arrow"
    data = bytearray(fs.cat_file(bad))
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the digest can tell
    fs.pipe_file(bad, bytes(data))
    local = tmp_path / "local"
    with pytest.raises(CacheError, match=f"^s3://{bad}: its bytes hash to [0-9a-f]+ .*the manifest of s3://{version} "
                                         f"says {manifest['files'][2]['digest']}"):
        open_cache(f"s3://{version}", local_dir=local)
    assert not (local / example_cache.name).exists()
    assert sorted(p.name for p in (local / SHARD_STORE).iterdir()) == sorted(  # the good ones, and no leftover
        f"{f['key']}.arrow" for k, f in enumerate(manifest["files"]) if k != 2)
    assert not list((local / STAGING).iterdir())


def test_pull_makes_a_directory_load_from_disk_opens_and_inspect_reads_the_manifest_alone(
        remote_example, example_cache, cli_home, tmp_path):
    env = remote_example.server.environment
    done = cli("pull", remote_example.url, str(tmp_path / "pulled"), home=cli_home, env=env)
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip().splitlines()[-1]
    assert path == str(tmp_path / "pulled" / example_cache.name)
    pulled, local = datasets.load_from_disk(path), datasets.load_from_disk(str(example_cache))
    assert pulled["input_ids"] == local["input_ids"] and pulled["loss_mask"] == local["loss_mask"]

    remote_example.server.clear()
    shown = cli("inspect", remote_example.url, home=cli_home, env=env)  # from the remote manifest alone
    assert shown.returncode == 0, shown.stderr
    assert remote_example.url in shown.stdout and "240" in shown.stdout
    assert not any(SHARD_STORE in path for _, path in remote_example.server.requests)


def test_pack_of_a_url_packs_its_local_copy_reaching_the_store_with_storage_options(
        remote_example, example_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))  # where the default copy goes
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the store is reached through --storage-options alone
    options = json.dumps({"endpoint_url": remote_example.server.endpoint})
    assert main(["pack", remote_example.url, "--length", "512", "--storage-options", options]) == 0
    index = Path(capsys.readouterr().out.strip().splitlines()[-1])
    copy = default_local_dir(split_version(remote_example.url)[0])
    assert index.is_relative_to(copy) and (copy / example_cache.name / MANIFEST).is_file()
    packed = open_cache(copy / example_cache.name).packed(512)
    assert sum(len(bin_["input_ids"]) for bin_ in packed) == sum(open_cache(example_cache).lengths)


def test_pull_says_what_failed_in_one_line(remote_example, example_cache, tmp_path, capsys, monkeypatch):
    import moto.settings

    version = example_cache.name
    cases = [(f"s3://no-such-bucket/sft/{version}", "no such bucket 'no-such-bucket'"),
             (f"s3://{remote_example.bucket}/sft/data-0123456789abcdef",
              "no published version there (manifest.json is missing"),
             (f"s3://{remote_example.bucket}", "not a cache version's URL"),
             (f"nosuch://{remote_example.bucket}/sft/{version}", "not a usable URL"),
             (remote_example.url, "access denied")]  # last: the server checks credentials from then on
    for url, said in cases:
        if said == "access denied":  # moto's IAM check, which knows no key "test"
            monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        assert main(["pull", url, str(tmp_path / "failed")]) == 2, url
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"sft-tokenize: error: {url}"), (url, lines)
        assert said in lines[0], (url, lines)
    assert not [p for p in (tmp_path / "failed").iterdir() if not p.name.startswith(".")]
