"""The suite's lanes, known from the fixtures a test uses rather than from markers set by hand.

A fixture that starts something costly says so here: a test that uses it (directly or through another fixture)
gets its markers at collection (tests/conftest.py), so a new test lands in its lane by what it asks for. The
helpers that start those things (`support.cli.cli`, `support.runs.Background`, `support.servers.prefect_server`,
the Prefect test harness) call `require`, so a test that reaches one without the fixture fails instead of
slipping into the fast lane. A hand marker is left only where no fixture can say it (a pure-CPU test that is
slow, a test that starts a cluster of its own)."""

from __future__ import annotations

import pytest

# fixture name → the markers of every test that uses it
FIXTURE_MARKERS: dict[str, tuple[str, ...]] = {
    "prefect_harness": ("server",),  # Prefect's test server, in this process
    "api_url": ("server", "cli"),  # a real `prefect server start`, for the CLI runs that talk to one
    "server": ("server",),  # tests/workflow/test_server.py's own server, whose scheduler loops every second
    "postgres_cluster": ("server",),  # PostgreSQL, for Prefect servers on it
    "server_home": ("server",),  # the embedded servers a test starts itself
    "migrated_prefect_home": ("cli",),  # a Prefect home migrated by Prefect itself (the shared server's)
    "prefect_home": ("cli",),
    "cli_home": ("cli",),  # a home for a test's `sft-tokenize` subprocesses
    "cli_homes": ("cli",),  # homes for a module's `sft-tokenize` subprocesses
    "launch": ("cli",),  # `sft-tokenize` in the background
    "dask_cluster": ("cluster",),
    "bucket_dask_cluster": ("cluster",),  # Dask processes that share only an S3 bucket with the flow
    "s3_root": ("slow",),  # moto's S3 server, for a cache root on object storage
    "bench": ("cli", "server", "slow"),  # benchmarks/ scripts: CLI runs on embedded servers
    "wheel": ("slow",),  # builds the project's wheel
    "remote_example": ("slow",),  # an S3 server (moto) holding the example cache
    "trainers_extra": ("trainers",),  # CPU torch, trl (every test under tests/trainers/ uses it)
}
LANES = {
    "server": "starts a Prefect server or runs flows on one (the test harness)",
    "cluster": "starts a Dask or Ray cluster",
    "cli": "runs `sft-tokenize` (or another command of the project) in a subprocess",
    "slow": "takes more than a few seconds of CPU without any of the above",
    "trainers": "needs the trainers extra (CPU torch, trl) and axolotl (make test installs them)",
}
# The data plane's lane (`make test-fast`, `pytest --fast`): nothing above.
FAST_LANE = " and ".join(f"not {marker}" for marker in LANES)

# The fixtures that start one server for the worker's session (PostgreSQL): under pytest-xdist every module that
# uses one runs on the same worker, so the run still starts it once. The CLI runs' server (`api_url`), which is
# also the API of the flows tests run in their own process (`prefect_harness`), is one for the whole run whichever
# worker asks (support/servers.shared_prefect_server), so their modules spread over the workers.
SHARED_SERVERS = frozenset({"postgres_cluster"})

# The test being run (set by tests/conftest.py around each test's setup, call and teardown).
current: pytest.Item | None = None


def markers_for(fixturenames: list[str]) -> set[str]:
    return {marker for name in fixturenames for marker in FIXTURE_MARKERS.get(name, ())}


def excluded_by(markexpr: str, marker: str) -> bool:
    """Whether `-m markexpr` leaves out a test that has only `marker`."""
    from _pytest.mark.expression import Expression

    return bool(markexpr) and not Expression.compile(markexpr).evaluate(lambda name, **_: name == marker)


def require(marker: str, what: str) -> None:
    """Fail the running test unless it is in `marker`'s lane (one of its fixtures gives it the marker) and the
    session's `-m` selects that lane: `what` would otherwise run where the lanes promise it does not."""
    if current is None:
        return
    markexpr = current.config.getoption("markexpr", "")
    if excluded_by(markexpr, marker):
        pytest.fail(f"{what}: this session's lane (-m {markexpr!r}) excludes {marker!r} tests, which are the only "
                    f"ones allowed to start it", pytrace=False)
    if current.get_closest_marker(marker) is None:
        givers = sorted(name for name, markers in FIXTURE_MARKERS.items() if marker in markers)
        pytest.fail(f"{what} in a test without the {marker!r} marker: use one of the fixtures that give it "
                    f"({', '.join(givers)}; tests/support/lanes.py)", pytrace=False)


def worker_groups(items: list[pytest.Item]) -> dict[str, str]:
    """module → the pytest-xdist group its tests run in: the module itself, joined with every other module that
    uses one of the same shared servers (SHARED_SERVERS). A module stays on one worker, so its module fixtures
    are made once."""
    group: dict[str, str] = {}  # module or server fixture → a member of its group (union-find)

    def find(name: str) -> str:
        while group.setdefault(name, name) != name:
            name = group[name]
        return name

    for item in items:
        module = item.nodeid.split("::")[0]
        for server in SHARED_SERVERS & set(item.fixturenames):
            group[find(module)] = find(server)
    return {module: find(module) for module in {item.nodeid.split("::")[0] for item in items}}


def distribution_order(items: list[pytest.Item], groups: dict[str, str]) -> dict[str, int]:
    """group → when it is handed out: long groups first, so that no long group starts last. Those that share a
    server, then those with a test that runs the CLI, a cluster or slow work, then the data plane's. One rank per
    group, so that sorting by it keeps each module's tests together (a module fixture is made once)."""
    rank: dict[str, int] = {}
    for item in items:
        group = groups[item.nodeid.split("::")[0]]
        if group in SHARED_SERVERS:
            mine = 0
        else:
            mine = 1 if markers_for(item.fixturenames) - {"trainers"} or item.get_closest_marker("slow") else 2
        rank[group] = min(rank.get(group, 2), mine)
    return rank
