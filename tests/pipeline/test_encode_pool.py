"""The encode pool (the threads runner's batches encoded in processes): the same shards as encoding in the
slice's thread, bad rows located the same way, and processes that carry no torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from support.data import ROWS, example_rows, write_jsonl
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build import shard, workers
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.shard_check import sidecar_path
from sft_tokenize.encoding.pool import EncodePool
from sft_tokenize.errors import BadInput
from sft_tokenize.sources.conversations import ColumnMap, to_example
from sft_tokenize.sources.formats.format_reader import READ_BATCH_ROWS

INJECTED = {"messages": [{"role": "user", "content": "Say <|im_end|> please"},
                         {"role": "assistant", "content": "Here: <|im_end|>."}]}


def mixed_rows() -> list:
    """Ordinary chats, reasoning and tool calls, control-token text, rows that are dropped or bad."""
    rows = example_rows()[:120] + [ROWS[name] for name in ("reasoning_field", "tools_object", "tools_string")]
    rows += [INJECTED, {"messages": [{"role": "user", "content": "no reply"}]}, "{not json", {"text": "no messages"}]
    return rows + example_rows()[120:200]


def built_shards(job, slices) -> dict[str, tuple[bytes, dict]]:
    """Each slice's shard bytes and sidecar (less its timing, and how many rows were filled from skeletons and
    checked: each process of a pool learns its own, and checks are drawn at random), written into a fresh store."""
    for slice_ in slices:
        shard.tokenize_slice(job, slice_)
    out = {}
    for slice_ in slices:
        path = job.shard_path(slice_)
        meta = json.loads(sidecar_path(path).read_text())
        for key in ("seconds", "rows_filled", "rows_checked"):
            meta.pop(key)
        out[slice_.key] = (path.read_bytes(), meta)
        path.unlink()
        sidecar_path(path).unlink()
    return out


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_pool_writes_the_shards_the_thread_writes(tmp_path, modern_tokenizer, family):
    source = write_jsonl(tmp_path / "mixed.jsonl", mixed_rows())
    plan = plan_slices(TokenizeOptions(sources=[str(source)], tokenizer=str(modern_tokenizer(family)),
                                       cache_dir=str(tmp_path / "cache"), shard_size="40KB", on_bad_row="skip"))
    assert len(plan.slices) >= 3
    inline = built_shards(plan.job, plan.slices)
    with workers.encoding_processes(plan.job, 2):
        assert isinstance(workers.slice_encoding(plan.job)[0], EncodePool)
        pooled = built_shards(plan.job, plan.slices)
    assert pooled == inline
    dropped = sum((Counter(meta["dropped"]) for _, meta in inline.values()), start=Counter())
    assert dropped == {"bad_messages": 1, "malformed_json": 1, "no_assistant_turn": 1}
    assert sum(meta["rows_special_text"] for _, meta in inline.values()) == 1


def test_a_bad_row_found_in_a_pool_process_names_its_line(tmp_path):
    """Also when a later batch, read while this one was being encoded, holds a bad row too: the first is named."""
    rows = example_rows()[:40] + [INJECTED] + example_rows()[40:] + example_rows() + ["{not json"]
    assert len(rows) > READ_BATCH_ROWS
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    plan = plan_slices(TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path / "cache"), special_text="error"))
    with workers.encoding_processes(plan.job, 2), pytest.raises(BadInput) as raised:
        shard.tokenize_slice(plan.job, plan.slices[0])
    assert str(raised.value).startswith(f"{source}:41: messages[0].content holds the control token '<|im_end|>'")
    assert not list(Path(plan.job.store).glob("*.arrow*"))  # no shard, not even a temporary one


def _pool_processes(pool) -> list[int]:
    deadline = time.monotonic() + 60
    while len(pids := pool.pids()) < pool.processes:
        assert time.monotonic() < deadline, "the pool's processes did not start"
        time.sleep(0.05)
    return pids


def thirty_rows(tmp_path: Path):
    """A plan of 30 example rows, the rows as examples, and this process's encoding of them."""
    source = write_jsonl(tmp_path / "rows.jsonl", example_rows()[:30])
    plan = plan_slices(TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path / "cache")))
    examples = [to_example(row, ColumnMap("chat", {"messages": "messages"})) for row in example_rows()[:30]]
    return plan, examples, workers.encoder_for(plan.job).encode_batch(examples)


def test_pool_processes_carry_no_torch_and_a_killed_one_is_replaced(tmp_path):
    plan, examples, want = thirty_rows(tmp_path)
    with workers.encoding_processes(plan.job, 2):
        [(_, pool)] = [entry for entry in workers._pools if entry[0] == plan.job]
        assert pool.submit(examples, 0).result().input_ids.tolist() == want.input_ids.tolist()
        pids = _pool_processes(pool)
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtorch" not in maps and "fastokens" in maps, f"process {pid}"
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # batches in flight when it died fail; the next one submitted starts new processes
            try:
                got = pool.submit(examples, 0).result()
            except BrokenProcessPool:
                continue
            assert got.input_ids.tolist() == want.input_ids.tolist()
            if set(replaced := _pool_processes(pool)).isdisjoint(pids):
                break
            assert time.monotonic() < deadline, "the killed process was never replaced"
            time.sleep(0.05)
    time.sleep(0.5)
    assert [pid for pid in replaced if Path(f"/proc/{pid}").exists()] == []  # closed with the run


def _blocked_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)


def test_a_ctrl_c_reaches_no_pool_process_not_even_the_forkserver_as_it_starts(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group. Python's forkserver ignores SIGINT only once its imports
    are done: it is spawned with SIGINT blocked, so no traceback of it reaches the terminal, and this process gets
    the signal as ever."""
    import multiprocessing.forkserver

    plan, examples, want = thirty_rows(tmp_path)
    with workers.encoding_processes(plan.job, 2):
        [(_, pool)] = [entry for entry in workers._pools if entry[0] == plan.job]
        assert pool.submit(examples, 0).result().input_ids.tolist() == want.input_ids.tolist()
        forkserver = multiprocessing.forkserver._forkserver._forkserver_pid
        for pid in (forkserver, *_pool_processes(pool)):
            assert _blocked_signals(pid) & (1 << (signal.SIGINT - 1)), f"process {pid}"
    assert not _blocked_signals(os.getpid()) & (1 << (signal.SIGINT - 1))  # this one takes Ctrl-C


def _built_hf_tokenizer() -> bool:
    """In a pool process: whether its encoder has built HF's tokenizer."""
    from sft_tokenize.encoding import pool as encode_pool

    return encode_pool._encoder.tokenizer._backend is not None


def test_pool_processes_build_no_hf_tokenizer_and_their_first_rows_are_checked_here(tmp_path, monkeypatch):
    from sft_tokenize.encoding.chat_encoder import ChatEncoder
    from sft_tokenize.encoding.exact import EncoderMismatch, IdsEncoding

    plan, examples, want = thirty_rows(tmp_path)
    assert want.rows_verified == 16
    checked = []
    verify = ChatEncoder._verify
    monkeypatch.setattr(ChatEncoder, "_verify", lambda self, rendered, placed, special: checked.append(
        len(rendered)) or verify(self, rendered, placed, special))
    with workers.encoding_processes(plan.job, 2):
        [(_, pool)] = [entry for entry in workers._pools if entry[0] == plan.job]
        got = pool.submit(examples, 16).result()
        assert got.input_ids.tolist() == want.input_ids.tolist() and got.rows_verified == 16
        assert checked == [16] and got.unverified == ()  # checked in this process, by its HF tokenizer
        _pool_processes(pool)
        assert [pool.call(_built_hf_tokenizer).result() for _ in range(4)] == [False] * 4
        # A pool whose rows disagree with HF's fails in the thread that takes the batch.
        monkeypatch.setattr(ChatEncoder, "_token_spans",
                            lambda self, row, enc, n: [(0, 1 if isinstance(enc, IdsEncoding) else 2)])
        with pytest.raises(EncoderMismatch, match="disagree on row 0"):
            pool.submit(examples, 16).result()


def test_the_planner_keeps_no_fastokens_tables_while_its_pool_encodes(tmp_path):
    from sft_tokenize.encoding.exact import PendingNative

    source = write_jsonl(tmp_path / "rows.jsonl", example_rows()[:30])
    plan = plan_slices(TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path / "cache")))
    examples = [to_example(row, ColumnMap("chat", {"messages": "messages"})) for row in example_rows()[:30]]
    encoder = workers.encoder_for(plan.job)
    want = encoder.encode_batch(examples)  # this process encoded: its fastokens tables are built
    assert not isinstance(encoder.fast._native, PendingNative)
    with workers.encoding_processes(plan.job, 2):
        [(_, pool)] = [entry for entry in workers._pools if entry[0] == plan.job]
        assert isinstance(encoder.fast._native, PendingNative)  # dropped: the pool's processes encode
        assert pool.submit(examples, 16).result().input_ids.tolist() == want.input_ids.tolist()
        assert isinstance(encoder.fast._native, PendingNative)  # checking the processes' rows needs HF's only
    again = encoder.encode_batch(examples)  # built again when this process encodes after all
    assert again.input_ids.tolist() == want.input_ids.tolist() and again.rows_verified == want.rows_verified


def _first_preparation(tmp_path, monkeypatch):
    """A tokenizer this machine has never prepared: its fast encoder's check is still to run."""
    from sft_tokenize.encoding.chat_encoder import ChatEncoder
    from sft_tokenize.encoding.prepared import prepared_dir, prepared_encoding
    from sft_tokenize.encoding.tokenizer import load_tokenizer
    from sft_tokenize.fingerprint import hash_directory

    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))
    directory = prepared_dir(hash_directory(EXAMPLE_TOKENIZER), False)
    tokenizer, fast = prepared_encoding(directory, lambda: load_tokenizer(EXAMPLE_TOKENIZER), "auto")
    assert fast.cases is not None and not (directory / "prepared.json").exists()
    examples = [to_example(row, ColumnMap("chat", {"messages": "messages"})) for row in example_rows()[:30]]
    return directory, ChatEncoder(tokenizer, fast=fast), examples, ChatEncoder(tokenizer).encode_batch(examples)


def _settled(directory: Path) -> dict:
    """The verdict the prepared entry keeps, once written (by a callback of the pool's ready future)."""
    deadline = time.monotonic() + 60
    while not (directory / "prepared.json").exists():
        assert time.monotonic() < deadline, "the pool's verdict never reached the prepared entry"
        time.sleep(0.01)
    return json.loads((directory / "prepared.json").read_text())["encoder"]


def test_a_first_runs_pool_checks_the_fast_encoder_and_the_planner_builds_no_tables(tmp_path, monkeypatch):
    """On a first run the tables are built once, by the pool that encodes, where the check against HF's answers
    runs; its verdict is the one the prepared entry keeps."""
    from sft_tokenize.encoding.exact import PendingNative

    directory, encoder, examples, want = _first_preparation(tmp_path, monkeypatch)
    pool = EncodePool(encoder, 1)
    try:
        assert pool.ready.result(timeout=120) == ""  # the pool ran the check: accepted
        assert _settled(directory) == {"accepted": True, "nfc": False}
        assert encoder.fast.cases is None and encoder.fast.refused == ""
        got = pool.submit(examples, 16).result()
        assert (got.input_ids.tobytes(), got.loss_mask.tobytes()) == (want.input_ids.tobytes(),
                                                                       want.loss_mask.tobytes())
        assert got.rows_verified == 16
        native = encoder.fast._native
        assert isinstance(native, PendingNative) and native._built is None  # never built in this process
    finally:
        pool.close()


def test_a_fast_encoder_wrong_on_purpose_is_refused_by_its_pools_check_and_hf_encodes(tmp_path, monkeypatch):
    """HF's answers altered for one check string stand in for a fastokens that gets it wrong: the pool refuses
    it, encodes every row with HF, and the entry keeps the refusal."""
    directory, encoder, examples, want = _first_preparation(tmp_path, monkeypatch)
    cases = encoder.fast.cases
    plain = list(cases.ids[0])
    plain[5] = [*plain[5], 0]
    encoder.fast.cases = replace(cases, ids=(tuple(plain), cases.ids[1]))
    pool = EncodePool(encoder, 1)
    try:
        refusal = pool.ready.result(timeout=120)
        assert refusal == f"fastokens gives other ids than tokenizers for {cases.strings[5]!r}"
        assert _settled(directory) == {"accepted": False, "refusal": refusal}
        assert encoder.fast.refused == refusal
        got = pool.submit(examples, 16).result()
        assert (got.input_ids.tobytes(), got.loss_mask.tobytes()) == (want.input_ids.tobytes(),
                                                                       want.loss_mask.tobytes())
        assert got.rows_verified == 0  # HF encoded every row: nothing of fastokens' to check
    finally:
        pool.close()


def _memory() -> tuple[int, int]:
    """In a pool process: its unique and resident bytes."""
    import psutil

    info = psutil.Process().memory_full_info()
    return info.uss, info.rss


def test_pool_processes_share_the_encoder_built_once_before_they_fork(tmp_path):
    plan, examples, want = thirty_rows(tmp_path)
    with workers.encoding_processes(plan.job, 2):
        [(_, pool)] = [entry for entry in workers._pools if entry[0] == plan.job]
        for _ in range(4):
            assert pool.submit(examples, 0).result().input_ids.tolist() == want.input_ids.tolist()
        pids = _pool_processes(pool)
        assert len({psutil.Process(pid).ppid() for pid in pids}) == 1  # forked by one process
        # Their modules, the encoder and fastokens' tables are the forking process's pages, shared: what each holds
        # of its own is a small part of what it maps (processes that each build their own: 58 %, here 34 %).
        for unique, resident in [pool.call(_memory).result() for _ in range(8)]:
            assert unique < 0.45 * resident


def test_a_pool_started_early_is_the_one_the_run_takes(tmp_path):
    """start_early's pool is taken by the run of that job (its processes are not started twice), a pool no run
    took is closed by close_early, and a run that wants another number of processes starts its own."""
    source = write_jsonl(tmp_path / "rows.jsonl", example_rows()[:40])
    plan = plan_slices(TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path / "cache")))
    workers.start_early(plan.job, 1)
    early = next(iter(workers._early.values()))
    with workers.encoding_processes(plan.job, 1):
        taken = workers.slice_encoding(plan.job)[0]
        assert taken is early and not workers._early
        assert shard.tokenize_slice(plan.job, plan.slices[0]) == 40
    workers.start_early(plan.job, 1)
    unused = next(iter(workers._early.values()))
    with workers.encoding_processes(plan.job, 2):
        assert workers.slice_encoding(plan.job)[0] is not unused
    workers.close_early()
    assert not workers._early and not unused._current.forking.is_alive()  # its processes ended with it


def test_a_ready_pool_is_its_jobs_only_and_a_resident_is_told_it_without_credentials(tmp_path, monkeypatch):
    """ready_processes finds a pool started early for the job's encoder and not for another's; starting one for
    another job closes it (a resident's pool would otherwise hold its memory through a run that cannot use it).
    next_pools gives a resident the last run's job without its storage options, and none for a remote tokenizer."""
    source = write_jsonl(tmp_path / "rows.jsonl", example_rows()[:8])
    options = TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path / "c"))
    job = plan_slices(options).job
    other = plan_slices(options.model_copy(update={"max_length": 64})).job
    assert workers.ready_processes(job) == 0
    workers.start_early(job, 1)
    first = workers._early[next(iter(workers._early))]
    assert (workers.ready_processes(job), workers.ready_processes(other)) == (1, 0)
    workers.start_early(other, 1)
    assert (workers.ready_processes(job), workers.ready_processes(other)) == (0, 1)
    first._current.forking.join(30)
    assert not first._current.forking.is_alive()
    workers.close_early()

    monkeypatch.setattr(workers, "_next_pool", None)
    assert workers.next_pools() is None  # no run here said: a resident passes on the pool it was given
    workers.keep_pool_ready(replace(job, storage_options={"key": "secret"}), 2)
    assert workers.next_pools() == [(job, 2)]
    workers.keep_pool_ready(replace(job, tokenizer_url="s3://bucket/tokenizer"), 2)
    assert workers.next_pools() == []
    workers.keep_pool_ready(job, 0)
    assert workers.next_pools() == []


STARTS_A_POOL = """
import json, sys, time
from sft_tokenize.build import workers
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
plan = plan_slices(TokenizeOptions(sources=[sys.argv[1]], tokenizer=sys.argv[2], cache_dir=sys.argv[3]))
workers.start_early(plan.job, 2)
pool = next(iter(workers._early.values()))
deadline = time.monotonic() + 120
while len(pool.pids()) < 2 and time.monotonic() < deadline:  # both forked
    time.sleep(0.05)
print(json.dumps([pool._current.forking.pid, *pool.pids()]), flush=True)
if sys.argv[4] == "killed":
    time.sleep(600)
sys.stdin.readline()  # exits once the test has seen its pool's processes, the pool still open
"""


@pytest.mark.parametrize("end", ["killed", "exits"])
def test_a_pool_ends_with_the_process_that_started_it_even_killed(tmp_path, end):
    """A process that started a pool and never closed it leaves no encoding process behind, nor the forkserver
    that started them, whether it is killed outright (SIGKILL: no close, no atexit) or exits (a resident whose
    command was a cache hit: it must not wait for ever on the pool at exit)."""
    source = write_jsonl(tmp_path / "rows.jsonl", example_rows()[:8])
    starter = subprocess.Popen([sys.executable, "-c", STARTS_A_POOL, str(source), str(EXAMPLE_TOKENIZER),
                                str(tmp_path / "cache"), end], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(starter.stdout.readline())
        forkserver = psutil.Process(pids[0]).ppid()
        assert len(pids) == 3 and all(psutil.pid_exists(pid) for pid in [forkserver, *pids])
        if end == "exits":
            starter.stdin.close()  # its cue to exit, now that its processes are known
            assert starter.wait(timeout=30) == 0
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 30
    while alive := [pid for pid in [forkserver, *pids] if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"still running after their starter was killed: {alive}"
        time.sleep(0.05)
