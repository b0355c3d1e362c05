"""Planning remote inputs reads what the plan needs of each object (its first rows, a little around each cut), never
the whole object: against a real S3-compatible server (moto) on 127.0.0.1 that counts the bytes it serves."""

from __future__ import annotations

import pytest
from support.data import example_rows
from support.paths import EXAMPLE_TOKENIZER
from support.s3 import s3_server

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices

pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
pytest.importorskip("s3fs", reason="s3fs is in the dev extra")


@pytest.mark.slow  # an S3 server (moto)
def test_a_plan_reads_a_small_part_of_each_large_remote_input(tmp_path, monkeypatch):
    import json

    lines = [json.dumps(row, ensure_ascii=False) for row in example_rows()]
    big = "\n".join(lines * 30) + "\n"  # ~10 MB
    with s3_server() as server:
        for name, value in server.environment.items():
            monkeypatch.setenv(name, value)
        fs = server.filesystem()
        fs.mkdir("planning")  # moto's state is this process's: a bucket of this module's own, removed after
        fs.pipe({"planning/in/big-0.jsonl": big.encode(), "planning/in/big-1.jsonl": big.encode()})
        server.clear()
        try:
            plan = plan_slices(TokenizeOptions(sources=["s3://planning/in/"], tokenizer=str(EXAMPLE_TOKENIZER),
                                               cache_dir=str(tmp_path / "cache"), shard_size="1MB",
                                               storage_options={"skip_instance_cache": True}))
            served = dict(server.served)
        finally:
            fs.rm("planning", recursive=True)
    size = len(big.encode())
    assert len(plan.slices) >= 18
    for name in ("big-0.jsonl", "big-1.jsonl"):
        read = sum(n for path, n in served.items() if path.endswith(name))
        # The first 1 MB (its columns), and a 64 KiB block around each of its ~9 cuts: well under its 10 MB.
        assert 0 < read < size / 4, (name, read, size)
