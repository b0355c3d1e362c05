"""The suite as pytest collects it in a clone that holds only the repository's files (no ../shared, no downloads,
no SFT_CHAT_TEMPLATES): both lanes collect with no error, the fast lane selects no test that uses a fixture
starting a Prefect server, a cluster or a CLI run, and a module that needs the older reference templates (none of
which a package ships) skips them with one summary line.

One collection of both lanes serves every test here: collecting the suite imports most of what the project
imports, tens of seconds of CPU on two cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import lanes
from support.paths import ROOT
from support.reference_templates import USERS_OFFLINE

pytestmark = pytest.mark.slow

LANE_END = "\n== lane collected ==\n"
# Both lanes in one interpreter: the second collection finds the modules the first imported. The fast lane is
# collected with pytest's own account of each selected test's fixtures (`--fixtures-per-test`, which collects
# without running).
COLLECT_BOTH_LANES = f"""
import sys, pytest
for lane in (["--collect-only", "-q"], ["--fast", "--fixtures-per-test", "-v"]):
    code = pytest.main(["-p", "no:cacheprovider", *lane])
    print({LANE_END!r}, flush=True)
    if code != 0:
        sys.exit(int(code))
"""


@dataclass
class Clone:
    path: Path
    env: dict[str, str]
    whole: str  # the whole suite's collection (-q)
    fast: str  # the fast lane's, with each selected test's fixtures

    def pytest(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=self.path,
                              env=self.env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Clone:
    """The files a commit of this tree holds, copied, and both lanes collected in them."""
    path = tmp_path_factory.mktemp("clone")
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, path / name)
    env = {key: value for key, value in os.environ.items() if key not in ("SFT_CHAT_TEMPLATES", "PYTEST_XDIST_WORKER")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH="")
    env.pop(USERS_OFFLINE, None)
    both = subprocess.run([sys.executable, "-c", COLLECT_BOTH_LANES], cwd=path, env=env, capture_output=True,
                          text=True, timeout=600)
    collected = both.stdout.split(LANE_END)
    assert both.returncode == 0 and len(collected) == 3, both.stdout[-3000:] + both.stderr[-3000:]
    return Clone(path, env, *collected[:2])


def test_a_clone_without_shared_collects_every_test_and_skips_with_one_summary_line(clone):
    for collected in (clone.whole, clone.fast):
        assert re.search(r"\bcollected \d+ items|\d+ tests collected", collected), collected[-2000:]
        assert "error" not in collected.strip().splitlines()[-1], collected[-2000:]
    run = clone.pytest("tests/unit/test_environment.py", "-k", "older_template", "-p", "no:xdist", "-q")
    assert run.returncode == 0, run.stdout[-3000:]
    summary = [line for line in run.stdout.splitlines() if "skipped for want of" in line]
    assert summary and "9 reference chat templates (chatml, gemma-it," in summary[0], run.stdout[-3000:]
    assert "9 skipped" in run.stdout.splitlines()[-1]


def test_the_fast_lane_selects_no_test_that_uses_a_server_a_cluster_or_a_cli_fixture(clone):
    # (modules skipped at collection, the trainers' without their extra, are named between)
    [(collected, deselected, _, selected)] = re.findall(
        r"collected (\d+) items / (\d+) deselected / (?:(\d+) skipped / )?(\d+) selected", clone.fast)
    blocks = re.split(r"^-+ fixtures used by (.+) -+$", clone.fast, flags=re.M)[1:]
    # (name, its location and fixtures), for each selected test that uses a fixture
    tests = list(zip(blocks[::2], blocks[1::2], strict=True))
    assert 500 < len(tests) <= int(selected) and int(deselected) > 100, clone.fast[-2000:]
    assert int(collected) == int(selected) + int(deselected)
    starters = {name for name, markers in lanes.FIXTURE_MARKERS.items() if {"server", "cluster", "cli"} & set(markers)}
    using = [(test, text.split("\n")[1], found) for test, text in tests
             if (found := starters & set(re.findall(r"^(\w+) -- ", text, flags=re.M)))]
    assert using == []
    assert not [test for test, text in tests if "trainers_extra -- " in text]
