"""The suite's lanes hold by construction: what would start a Prefect server, a cluster or a CLI run refuses to
in the fast lane (`pytest --fast`, `make test-fast`). That the lane selects no test using a fixture that starts
one is checked on the suite as a clone collects it: test_collection.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from support import lanes
from support.paths import ROOT

# What starts a server, a cluster or a CLI subprocess: the lanes' table must keep saying so.
STARTERS = {"prefect_harness": "server", "api_url": "server", "server": "server", "server_home": "server",
            "dask_cluster": "cluster", "migrated_prefect_home": "cli", "prefect_home": "cli", "cli_home": "cli",
            "cli_homes": "cli", "launch": "cli", "bench": "server"}


def pytest_run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_table_names_every_fixture_that_starts_something_and_the_fast_lane_excludes_them():
    assert {name: marker for name, marker in STARTERS.items() if marker in lanes.FIXTURE_MARKERS[name]} == STARTERS
    for marker in ("server", "cluster", "cli", "slow", "trainers"):
        assert lanes.excluded_by(lanes.FAST_LANE, marker), marker
    assert not lanes.excluded_by(lanes.FAST_LANE, "unmarked")
    assert lanes.markers_for(["tmp_path", "prefect_home", "dask_cluster"]) == {"cli", "cluster"}


GUARDED = textwrap.dedent('''
    from support.cli import cli


    def test_harness(request):  # asked for at run time: no marker at collection
        request.getfixturevalue("prefect_harness")


    def test_cli_without_its_fixture(tmp_path):
        cli("--help", home=tmp_path / "home")
''')


def test_in_the_fast_lane_the_harness_and_the_cli_refuse_to_start(tmp_path):
    (tmp_path / "test_guarded.py").write_text(GUARDED)
    done = pytest_run("--fast", "-p", "conftest", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
                      "--basetemp", str(tmp_path / "base"), str(tmp_path / "test_guarded.py"))
    assert done.returncode == 1, done.stdout[-3000:]
    assert "2 failed" in done.stdout
    assert "the Prefect test harness: this session's lane (-m 'not server and not cluster and not cli and not " \
           "slow and not trainers') excludes 'server' tests" in done.stdout
    assert "`sft-tokenize --help` in a subprocess: this session's lane" in done.stdout
    assert not list((tmp_path / "base").rglob("prefect.db"))  # no server made its database


def test_outside_the_fast_lane_a_cli_run_needs_a_fixture_that_says_so(tmp_path):
    (tmp_path / "test_guarded.py").write_text(GUARDED)
    done = pytest_run("-p", "conftest", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), "--basetemp",
                      str(tmp_path / "base"), f"{tmp_path / 'test_guarded.py'}::test_cli_without_its_fixture")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "`sft-tokenize --help` in a subprocess in a test without the 'cli' marker: use one of the fixtures " \
           "that give it (" in done.stdout


def test_modules_that_share_a_server_share_a_worker_and_go_first():
    """Under pytest-xdist: the modules on the session's PostgreSQL are one group, any other module is a group of its
    own (one that uses api_url or the harness too: that server is one for the whole run, whichever worker asks),
    and the shared group is handed out first."""
    from types import SimpleNamespace

    def item(module: str, *fixtures: str):
        return SimpleNamespace(nodeid=f"{module}::t", fixturenames=["tmp_path", *fixtures],
                               get_closest_marker=lambda name: None)

    items = [item("a.py", "postgres_cluster"), item("b.py", "api_url"), item("c.py", "cli_home"),
             item("d.py"), item("e.py", "api_url", "postgres_cluster"), item("a.py"), item("h.py", "prefect_harness"),
             item("i.py", "prefect_harness")]
    groups = lanes.worker_groups(items)
    assert groups["a.py"] == groups["e.py"] == "postgres_cluster" and groups["b.py"] == "b.py"
    assert groups["c.py"] == "c.py" and groups["d.py"] == "d.py"
    assert (groups["h.py"], groups["i.py"]) == ("h.py", "i.py")
    assert lanes.distribution_order(items, groups) == {groups["a.py"]: 0, "b.py": 1, "c.py": 1, "d.py": 2,
                                                       "h.py": 1, "i.py": 1}
    # a module's rank is its most demanding test's: sorting by it never splits the module
    mixed = [item("f.py"), item("f.py", "cli_home"), item("g.py")]
    assert lanes.distribution_order(mixed, lanes.worker_groups(mixed)) == {"f.py": 1, "g.py": 2}
