"""Remote images that never come: a server on 127.0.0.1 that accepts and never answers (started and stopped by
each test) makes the row a bad row naming the URL once --image-timeout passes, a refused connection says so,
and Ctrl-C or SIGTERM stops a run waiting on such a server within seconds, its finished shards kept."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from support.cli import error_line
from support.images import sample_images
from support.servers import silent_server
from support.vision import qwen_vl

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.read.cache import TokenizedCache
from sft_tokenize.sources.images import ImageRef, load_images


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen-vl-processor")
    qwen_vl(directory)
    return directory


def _chat(image: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "What is it?"}]},
                         {"role": "assistant", "content": "A picture."}]}


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once the probe is closed


def test_a_server_that_never_answers_ends_in_the_timeout_naming_the_url():
    with silent_server() as server:
        started = time.monotonic()
        with pytest.raises(BadRow, match=rf"^image 1: {server.url('cat.png')}: no answer within 0.5 s "
                                         r"\(--image-timeout\)$") as raised:
            load_images([ImageRef(url=server.url("cat.png"))], timeout=0.5)
        assert time.monotonic() - started < 5 and server.accepted >= 1
    assert raised.value.reason == "image_unreadable"


def test_a_refused_connection_says_connection_refused():
    url = f"http://127.0.0.1:{_closed_port()}/cat.png"
    with pytest.raises(BadRow, match=rf"^image 1: {url}: connection refused$"):
        load_images([ImageRef(url=url)])


def test_a_run_names_the_file_row_and_url_or_counts_the_skip(tmp_path, processor):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cat.png").write_bytes(sample_images()["photo"])
    with silent_server() as server:
        data = _write(tmp_path / "data" / "rows.jsonl", [_chat("cat.png"), _chat(server.url("cat.png"))])
        options = TokenizeOptions(sources=[str(data)], processor=str(processor), cache_dir=str(tmp_path / "cache"),
                                  image_access="root+urls", image_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(BadInput, match=rf"^{data}:2: image 1: {server.url('cat.png')}: no answer within 0.5 s"):
            run_locally(options)
        skipped = TokenizedCache(run_locally(options.model_copy(update={"on_bad_row": "skip"})))
        assert time.monotonic() - started < 20
    assert len(skipped) == 1 and skipped.manifest["dropped"] == {"image_unreadable": 1}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_stops_a_run_waiting_on_a_silent_server_within_seconds(tmp_path, processor, prefect_home, launch,
                                                                        api_url, signum):
    """One slice finishes, the other waits on the server (a timeout of 10 minutes): the signal ends the run
    within seconds, with the finished shard kept and nothing half-written left. (On the shared Prefect server:
    signals on the embedded one are test_robust's.)"""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cat.png").write_bytes(sample_images()["photo"])
    cache = tmp_path / "cache"
    with silent_server() as server:
        good = _write(tmp_path / "data" / "good.jsonl", [_chat("cat.png")])
        hung = _write(tmp_path / "data" / "hung.jsonl", [_chat(server.url("cat.png"))])
        run = launch(["run", str(good), str(hung), "--processor", str(processor), "--cache-dir", str(cache),
                      "--image-access", "root+urls", "--image-timeout", "600", "--workers", "2"],
                     prefect_home, signum.name, api_url)
        run.wait_until(lambda: server.accepted and list((cache / ".shards").glob("*.json")),
                       "a finished shard and a connection waiting on the server")
        kept = sorted(p.name for p in (cache / ".shards").glob("*.arrow"))
        if signum == signal.SIGINT:
            os.killpg(run.group, signum)  # Ctrl-C: the terminal signals the whole group
        else:
            run.process.send_signal(signum)  # `kill PID`, or the terminal closing (SIGHUP)
        signalled = time.monotonic()
        try:
            code = run.process.wait(timeout=20)
        except Exception:
            pytest.fail(f"still running 20 s after {signum.name}:\n{run.stderr}")
        stopped_after = time.monotonic() - signalled
        print(f"{signum.name}: stopped {stopped_after:.1f} s after the signal")
    assert code == 128 + signum, run.stderr
    assert stopped_after < 10, f"{signum.name}: stopped {stopped_after:.1f} s after the signal"
    assert f"interrupted ({signum.name})" in error_line(run.stderr)
    assert sorted(p.name for p in (cache / ".shards").glob("*.arrow")) == kept and len(kept) == 1
    assert not list((cache / ".shards").glob("*.tmp-*"))


def test_the_collator_reads_a_referenced_image_with_the_same_timeout():
    from sft_tokenize.errors import CacheError
    from sft_tokenize.read.image_collator import image_bytes

    with silent_server() as server:
        cell = {"bytes": None, "path": server.url("cat.png"), "hash": None, "size": None}
        started = time.monotonic()
        with pytest.raises(CacheError, match=rf"^row 0 image 1: {server.url('cat.png')} cannot be read: no answer "
                                             r"within 0.5 s \(image_timeout\)$"):
            image_bytes(cell, "row 0 image 1", None, ("root+urls", []), timeout=0.5)
        assert time.monotonic() - started < 5
