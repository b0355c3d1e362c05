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
kwargs = {"remote": remote, "local": mine + "-local"} if remote != "-" else {"local": export}
dataset = StreamingDataset(shuffle=False, batch_size=1, **kwargs)
rows = [dataset[i] for i in range(len(dataset))]
with MDSWriter(out=mine, columns={"input_ids": "ndarray:int32", "loss_mask": "ndarray:int8"},
               size_limit=size_limit) as writer:
    for row in rows:
        writer.write(row)
print(json.dumps([[row["input_ids"].tolist(), row["loss_mask"].tolist(), str(row["input_ids"].dtype),
                   str(row["loss_mask"].dtype)] for row in rows]))
"""


def read_with_streaming(export: str, mine: Path, size_limit: int, remote: str = "-") -> list:
    if not (STREAMING / "streaming").is_dir():
        pytest.skip(f"mosaicml-streaming is not under {STREAMING} (make test installs it there)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STREAMING), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", READ_WITH_STREAMING, export, str(mine),
                             str(size_limit), remote], capture_output=True, text=True, env=env, timeout=300)
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
    rows = read_with_streaming(str(tmp_path / "mds"), tmp_path / "theirs", 50_000)
    assert_rows(cache, rows)
    ours = sorted(p.name for p in (tmp_path / "mds").glob("shard.*.mds"))
    assert ours == sorted(p.name for p in (tmp_path / "theirs").glob("shard.*.mds"))
    for name in ours:
        assert (tmp_path / "mds" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    assert index == json.loads((tmp_path / "theirs" / "index.json").read_text())


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
