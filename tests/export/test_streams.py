"""`mds` and `litdata` exports read back by each consumer's own StreamingDataset, locally and from a bucket (moto),
and an MDS export byte for byte what mosaicml-streaming's own MDSWriter writes for the same rows.

mosaicml-streaming pins an older transformers and huggingface-hub than datasets needs, so it lives apart: `make test`
installs it without its dependencies under .cache/consumers/streaming, and it runs here in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sft_tokenize.export import export_cache
from sft_tokenize.read.cache import open_cache

ROOT = Path(__file__).resolve().parents[2]
STREAMING = Path(os.environ.get("SFT_TOKENIZE_STREAMING", ROOT / ".cache" / "consumers" / "streaming"))

# streaming/__init__.py imports its vision datasets (torchvision, absent beside CPU torch); streaming.base is the
# whole reader and writer: its parent package is made without running that __init__.
READ_WITH_STREAMING = """
import importlib.util, json, sys, types
spec = importlib.util.find_spec("streaming")
package = types.ModuleType("streaming")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["streaming"] = package
import numpy as np
from streaming.base import MDSWriter, StreamingDataset

export, mine, size_limit, remote = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
parts = json.loads(sys.argv[5])  # rows per cache data file: MDSWriter writes each into a directory of its own
kwargs = {"remote": remote, "local": mine + "-local"} if remote != "-" else {"local": export}
dataset = StreamingDataset(shuffle=False, batch_size=1, **kwargs)
rows = [dataset[i] for i in range(len(dataset))]
first = 0
for k, count in enumerate(parts):
    with MDSWriter(out=f"{mine}/part-{k}", columns={"input_ids": "ndarray:int32", "loss_mask": "ndarray:int8"},
                   size_limit=size_limit) as writer:
        for row in rows[first:first + count]:
            writer.write(row)
    first += count
print(json.dumps([[row["input_ids"].tolist(), row["loss_mask"].tolist(), str(row["input_ids"].dtype),
                   str(row["loss_mask"].dtype)] for row in rows]))
"""


def read_with_streaming(export: str, mine: Path, size_limit: int, remote: str = "-", parts: list[int] = ()) -> list:
    if not (STREAMING / "streaming").is_dir():
        pytest.skip(f"mosaicml-streaming is not under {STREAMING} (make test installs it there)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STREAMING), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", READ_WITH_STREAMING, export, str(mine),
                             str(size_limit), remote, json.dumps(list(parts) or [10 ** 9])],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_rows(cache: Path, rows: list) -> None:
    opened = open_cache(cache)
    assert len(rows) == len(opened)
    for i, (ids, mask, ids_type, mask_type) in enumerate(rows):
        assert (ids_type, mask_type) == ("int32", "int8")
        assert ids == opened[i]["input_ids"].tolist() and mask == opened[i]["loss_mask"].tolist(), i


@pytest.fixture
def cache(example_cache, tmp_path) -> Path:
    return Path(shutil.copytree(example_cache.parent, tmp_path / "root", symlinks=True)) / example_cache.name


def test_mds_shards_are_what_mdswriter_writes_and_streaming_reads_them(cache, tmp_path):
    record = export_cache(cache, "mds", tmp_path / "mds", shard_bytes=50_000, batch_rows=7)
    assert record["shards"] > 3  # shards end mid-batch and batches mid-shard
    files = open_cache(cache).manifest["files"]
    rows = read_with_streaming(str(tmp_path / "mds"), tmp_path / "theirs", 50_000, parts=[f["rows"] for f in files])
    assert_rows(cache, rows)
    # MDSWriter over each data file's rows writes our shards of that file, byte for byte (ours named by its digest)
    ours = json.loads((tmp_path / "mds" / "index.json").read_text())["shards"]
    theirs = [(k, shard) for k in range(len(files))
              for shard in json.loads((tmp_path / "theirs" / f"part-{k}" / "index.json").read_text())["shards"]]
    assert len(ours) == len(theirs) == record["shards"]
    for mine, (k, shard) in zip(ours, theirs, strict=True):
        name = mine["raw_data"]["basename"]
        assert name.startswith(f"shard.{files[k]['digest']}.")
        assert {**mine, "raw_data": {**mine["raw_data"], "basename": None}} == \
            {**shard, "raw_data": {**shard["raw_data"], "basename": None}}
        assert (tmp_path / "mds" / name).read_bytes() == \
            (tmp_path / "theirs" / f"part-{k}" / shard["raw_data"]["basename"]).read_bytes(), name


def test_litdata_reads_the_export_row_for_row(cache, tmp_path):
    litdata = pytest.importorskip("litdata", reason="litdata: make test installs it")
    record = export_cache(cache, "litdata", tmp_path / "lit", shard_bytes=50_000, batch_rows=7)
    assert record["chunks"] > 3
    dataset = litdata.StreamingDataset(str(tmp_path / "lit"))
    opened = open_cache(cache)
    from sft_tokenize.consumers.verify_trainer import verify_trainer

    assert verify_trainer(cache, "litdata", 1000, export=tmp_path / "lit").rows == len(opened)
    assert len(dataset) == len(opened)
    for i in range(len(opened)):
        item = dataset[i]
        assert item["input_ids"].dtype == np.int32 and item["loss_mask"].dtype == np.int8
        assert np.array_equal(item["input_ids"], opened[i]["input_ids"]), i
        assert np.array_equal(item["loss_mask"], opened[i]["loss_mask"]), i


@pytest.fixture
def bucket(remote_example):
    """The S3 server (moto) of the module, with a bucket for exports."""
    fs = remote_example.server.filesystem()
    name = f"exports-{os.urandom(4).hex()}"
    fs.mkdir(name)
    return remote_example.server, fs, name


def test_exports_to_a_bucket_are_read_from_it(cache, tmp_path, bucket):
    server, fs, name = bucket
    options = {"client_kwargs": {"endpoint_url": server.endpoint}, "key": "test", "secret": "test"}
    url = f"s3://{name}/mds"
    record = export_cache(cache, "mds", url, shard_bytes=50_000, storage_options=options)
    assert fs.exists(f"{name}/mds/export.json") and fs.exists(f"{name}/mds/index.json")
    assert open_cache(cache).manifest["exports"][url]["digest"] == record["digest"]
    rows = read_with_streaming(url, tmp_path / "theirs", 50_000, remote=url)
    assert_rows(cache, rows)
    assert export_cache(cache, "mds", url, shard_bytes=50_000, storage_options=options)["reused"] is True
    with pytest.raises(Exception, match="holds other objects"):
        export_cache(cache, "litdata", url, storage_options=options)

    litdata = pytest.importorskip("litdata", reason="litdata: make test installs it")
    export_cache(cache, "litdata", f"s3://{name}/lit", shard_bytes=50_000, storage_options=options)
    dataset = litdata.StreamingDataset(f"s3://{name}/lit", cache_dir=str(tmp_path / "lit-cache"),
                                       storage_options={"endpoint_url": server.endpoint})
    opened = open_cache(cache)
    assert len(dataset) == len(opened)
    assert all(np.array_equal(dataset[i]["input_ids"], opened[i]["input_ids"]) for i in range(len(opened)))


@pytest.mark.parametrize("target", ["litdata", "mds"])
def test_exporting_a_grown_cache_again_writes_only_its_new_data_files_chunks(tmp_path, target):
    """A cache version that shares data files with the one exported at OUT: exported again to OUT, the chunks of
    the shared files are the earlier export's files (same inode), and only the new files' chunks are written."""
    from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally

    data = tmp_path / "data"
    data.mkdir()
    first, second = sorted(EXAMPLE_DATA.glob("*.jsonl"))
    shutil.copy(first, data / first.name)

    def build() -> Path:
        return Path(run_locally(TokenizeOptions(sources=[str(data)], tokenizer=str(EXAMPLE_TOKENIZER),
                                                shard_size="100KB", cache_dir=str(tmp_path / "caches"))))

    old = build()
    shutil.copy(second, data / second.name)
    new = build()
    old_files, new_files = (open_cache(path).manifest["files"] for path in (old, new))
    shared = {f["digest"] for f in old_files} & {f["digest"] for f in new_files}
    assert old != new and len(shared) == len(old_files) < len(new_files)

    out = tmp_path / "out"
    before = export_cache(old, target, out, shard_bytes=20_000)
    inodes = {f["name"]: (out / f["name"]).stat().st_ino for f in before["files"]}
    after = export_cache(new, target, out, shard_bytes=20_000)
    chunks = [f["name"] for f in after["files"] if f["name"] != "index.json"]
    kept = [name for name in chunks if inodes.get(name) == (out / name).stat().st_ino]
    assert len(kept) == after["files_reused"] == len(chunks) - (after["files_written"] - 2) > 3
    assert all(any(d in name for d in shared) for name in kept)
    assert after["files_written"] == 2 + sum(1 for name in chunks if not any(d in name for d in shared))

    opened = open_cache(new)
    if target == "litdata":
        litdata = pytest.importorskip("litdata", reason="litdata: make test installs it")
        dataset = litdata.StreamingDataset(str(out))
        assert len(dataset) == len(opened)
        for i in range(len(opened)):
            assert np.array_equal(dataset[i]["input_ids"], opened[i]["input_ids"]), i
            assert np.array_equal(dataset[i]["loss_mask"], opened[i]["loss_mask"]), i
    else:
        assert_rows(new, read_with_streaming(str(out), tmp_path / "theirs", 20_000))
    assert export_cache(old, target, tmp_path / "elsewhere", shard_bytes=30_000)["files_reused"] == 0
    # data files smaller than a chunk are taken together: one chunk of all the new version's rows
    whole = export_cache(new, target, tmp_path / "whole", shard_bytes=1 << 27)
    assert len(whole["files"]) == 2 and not any(d in whole["files"][0]["name"] for d in shared)
    if target == "litdata":
        dataset = litdata.StreamingDataset(str(tmp_path / "whole"))
        assert len(dataset) == len(opened)
        assert all(np.array_equal(dataset[i]["loss_mask"], opened[i]["loss_mask"]) for i in range(len(opened)))
