"""A run that fails ends with its one line and its exit code every time: nothing it started is still inside native
code when the interpreter shuts down. A daemon thread in a PyO3 call (fastokens building its tables) is cancelled
by the shutdown as it takes the GIL back, and PyO3's panic guard turns that into an abort (glibc's `FATAL:
exception not rethrown`, exit 134). The first test puts a process in that window on purpose, every time; the
second repeats the real failing run a few times, as the window's width depends on timing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support.cli import assert_rejected, cli, run_args

pytest.importorskip("fastokens")

BAD_ROW = '{"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
REPEATS = 2  # the window itself is hit every time by the first test

# A process that warmed its fast encoder (as a run's planner does) and fails before encoding anything (as a run
# whose first row is bad does), then ends. Its teardown lasts until the build thread is gone, as a run's longer
# teardown (Prefect, transformers, pyarrow) outlasts a real build: the build ends while the interpreter shuts down.
ENDS_WHILE_BUILDING = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    from sft_tokenize.encoding.exact import rebuilt_encoder

    class Teardown:
        # Deleted as the interpreter is finalized, after the threads it waits for; it holds what it uses, as
        # module globals may be gone by then.
        def __init__(self, tasks, exists=os.path.exists, sleep=time.sleep, clock=time.monotonic):
            self.tasks, self.exists, self.sleep, self.clock = tasks, exists, sleep, clock

        def __del__(self):
            deadline = self.clock() + 60
            while any(map(self.exists, self.tasks)) and self.clock() < deadline:
                self.sleep(0.01)

    rebuilt_encoder(open(sys.argv[1], encoding="utf-8").read(), np.zeros(1, dtype=np.int64), False).warm()
    builds = [t for t in threading.enumerate() if t.name == "fastokens-build"]
    assert builds
    def in_call():  # the thread runs build() with fastokens imported: it is in fastokens' call, without the GIL
        frame = sys._current_frames().get(builds[0].ident)
        return "fastokens" in sys.modules and frame is not None and frame.f_code.co_name == "build"

    while builds[0].is_alive() and not in_call():
        time.sleep(0.01)
    time.sleep(0.1)
    teardown = Teardown([f"/proc/self/task/{t.native_id}" for t in builds])
    print("bad input", file=sys.stderr)
    sys.exit(2)
""")


def test_a_process_that_ends_while_its_fast_encoder_builds_exits_with_its_own_code(large_vocab_tokenizer):
    ended = subprocess.run([sys.executable, "-c", ENDS_WHILE_BUILDING, str(large_vocab_tokenizer / "tokenizer.json")],
                           capture_output=True, text=True, timeout=300)
    assert (ended.returncode, ended.stderr) == (2, "bad input\n")


def test_a_run_failing_on_its_first_row_ends_with_its_line_and_exit_2_every_time(tmp_path, prefect_home,
                                                                                large_vocab_tokenizer):
    """The smallest failing run (one bad row, one slice) on a warm embedded server, with a tokenizer whose fast
    encoder is still building when the slice fails."""
    data = tmp_path / "bad.jsonl"
    data.write_text(BAD_ROW)
    args = run_args([data], tmp_path / "cache", "--tokenizer", str(large_vocab_tokenizer), "--server-idle", "600")
    expected = f"{data}:1: messages[0] has unknown role 'narrator'"
    try:
        assert_rejected(cli(*args, home=prefect_home), expected)  # prepares the tokenizer for the runs below
        for _ in range(REPEATS):
            assert_rejected(cli(*args, home=prefect_home), expected)
    finally:
        stopped = cli("server", "stop", home=prefect_home)
        assert stopped.returncode == 0, stopped.stderr

