"""Fixtures shared by the suite: the bundled example, tokenizers for real chat-template families, a migrated
Prefect home for the CLI's subprocesses, the Prefect test harness, a Prefect server, runs in the background.
Their helpers live in tests/support.

Each test's lane comes from the fixtures it uses (tests/support/lanes.py): `pytest --fast` (`make test-fast`) runs
the data plane's lane, which starts no Prefect server, no cluster and no CLI subprocess."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import faults, lanes
from support.caches import EXAMPLE_SLICES
from support.families import (
    build_family_tokenizer,
    build_large_vocab_tokenizer,
    build_metaspace_tokenizer,
    build_modern_tokenizer,
)
from support.postgres import INSTALL, Postgres, bindir, postgres
from support.reference_templates import HOW_TO_GET, SKIP_PREFIX, USERS_OFFLINE
from support.remote_caches import RemoteCache, publish_remote
from support.runs import Background
from support.servers import shared_prefect_server, stop_shared_server

from sft_tokenize.startup_gc import pause_collector, resume_collector

# Each pytest process collects the suite (importing Prefect, datasets, transformers, torch) as a run's process
# starts (sft_tokenize/startup_gc.py): the collector paused until the tests are collected, what they imported then
# frozen. After each module its survivors (session fixtures, caches) are frozen too: the collector's full
# collections, which walk every object it tracks, walked them again and again otherwise (a quarter of a worker's
# CPU in some modules).
pause_collector()

# The project's own hub access is offline in every test and every process a test starts; whether the reference
# templates may be downloaded is the user's HF_HUB_OFFLINE, kept first (workers inherit both).
os.environ.setdefault(USERS_OFFLINE, os.environ.get("HF_HUB_OFFLINE", ""))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The CLI's runs stop their embedded server as they leave (`--server-idle 0`): none outlives its test, nor the suite.
# The tests of the warm server pass --server-idle themselves, and stop what they start.
os.environ["SFT_TOKENIZE_SERVER_IDLE"] = "0"
# Prepared tokenizers (sft_tokenize/encoding/prepared.py) in one directory of this test run, not in the user's cache.
if "SFT_TOKENIZE_HOME" not in os.environ:
    os.environ["SFT_TOKENIZE_HOME"] = tempfile.mkdtemp(prefix="sft-tokenize-home-")
    atexit.register(shutil.rmtree, os.environ["SFT_TOKENIZE_HOME"], True)
# Slice faults (support/faults) in this process and, through sitecustomize on PYTHONPATH, in every process a test
# starts: CLI runs, Dask and Ray workers, served flows. They act only where a test sets their variable.
faults.install()
os.environ["PYTHONPATH"] = os.pathsep.join([str(faults.SITE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    resume_collector()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help=f"only the data plane's lane: -m '{lanes.FAST_LANE}' (no Prefect server, cluster or CLI run)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("fast"):
        markexpr = config.getoption("markexpr")
        config.option.markexpr = f"({markexpr}) and {lanes.FAST_LANE}" if markexpr else lanes.FAST_LANE


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets the markers of the fixtures it uses, before `-m` selects (the marker plugin's hook runs
    after this one). Under pytest-xdist (`make test`: -n 3 --dist loadgroup) each module also gets its worker
    group (lanes.worker_groups), and the long groups are handed out first."""
    for item in items:
        for marker in sorted(lanes.markers_for(item.fixturenames)):
            if item.get_closest_marker(marker) is None:
                item.add_marker(marker)
    # A worker collects with dist "no" and loadgroup set (xdist's remote.py); the controller collects nothing
    if getattr(config.option, "loadgroup", False):
        groups = lanes.worker_groups(items)
        for item in items:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid.split("::")[0]]))
        rank = lanes.distribution_order(items, groups)
        items.sort(key=lambda item: rank[groups[item.nodeid.split("::")[0]]])


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line for the tests skipped for want of a reference chat template, naming the templates and how to get
    them (support/reference_templates.py)."""
    skipped: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if SKIP_PREFIX in reason:
            skipped[reason.split(SKIP_PREFIX, 1)[1].split(":", 1)[0].strip()] += 1
    if skipped:
        terminalreporter.write_line(
            f"{sum(skipped.values())} tests skipped for want of {len(skipped)} reference chat templates "
            f"({', '.join(sorted(skipped))}): {HOW_TO_GET}", yellow=True, bold=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """xdist groups a test by the `@group` its worker appends to the test's id; where that append has no effect
    (pytest 9.2, pytest-xdist#1386) every test is scheduled alone, each worker starts its own servers and a
    module's fixtures run on several workers. Stop before any test runs rather than run slow and flaky."""
    if node.config.getoption("dist") == "loadgroup" and (ungrouped := [i for i in ids if "@" not in i]):
        pytest.exit(f"pytest-xdist left {len(ungrouped)} tests ungrouped (first: {ungrouped[0]}) under pytest "
                    f"{pytest.__version__}: see pytest-xdist#1386", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    lanes.current = item  # what the lane guards (lanes.require) check
    try:
        return (yield)
    finally:
        lanes.current = None
        if nextitem is None or nextitem.module is not item.module:  # its module's fixtures are torn down
            gc.collect()
            gc.freeze()


@pytest.fixture(autouse=True)
def torch_kept_out_only_for_its_test() -> Iterator[None]:
    """`main(["run", ...])` in this process keeps torch out of it (cli.keep_torch_out: None in sys.modules); a test
    after it, on the same worker, must not inherit that (datasets' pickling then fails to import torch)."""
    before = sys.modules.get("torch", "absent")
    yield
    if before == "absent" and "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]


def shared_directory(tmp_path_factory) -> Path:
    """The directory this run's pytest-xdist workers keep their temporary directories in (a run without workers:
    its own): what they build once for the whole run goes there."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def migrated_prefect_home(tmp_path_factory) -> Path:
    """A PREFECT_HOME whose database Prefect's own `prefect server database upgrade` made: the shared server's
    (`api_url`), and the reference the shipped schema is checked against. Made once for the whole run:
    pytest-xdist's workers share the directory their temporary directories are in, and the first to get there
    migrates it."""
    from sft_tokenize.files import locked

    shared = shared_directory(tmp_path_factory)
    home, done = shared / "prefect-home-template", shared / "prefect-home-template.done"
    with locked(shared / "prefect-home-template.lock"):
        if not done.exists():
            home.mkdir(exist_ok=True)
            environ = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"],
                           env={**environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                           check=True, capture_output=True, timeout=300)
            done.touch()
    return home


@pytest.fixture
def prefect_home(tmp_path) -> Path:
    """A new, empty PREFECT_HOME, as a user's first run has: its embedded server makes the database from the shipped
    schema (a database Prefect made boots in full, ~1.3 s more a run: tests/workflow/test_database_template.py)."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    return home


def _built_once(tmp_path_factory, build):
    """family name → directory of a tokenizer made by build(family, directory), built once per session."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="session")
def example_cache(tmp_path_factory) -> Path:
    """The bundled example built once for the session by the plain pipeline, cut as most runs cut it (four data
    files), in a cache root of its own. Shared by modules: tests read it or copy it, never write into it."""
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally

    root = tmp_path_factory.mktemp("example") / "cache"
    return Path(run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(root))))


@pytest.fixture(scope="module")
def remote_example(example_cache) -> Iterator[RemoteCache]:
    """The example cache published on a real S3 API (moto, support/s3.py) as a run to `s3://BUCKET/sft` lays it
    out (support/remote_caches.py): one server per module, whose AWS_* variables this process has meanwhile."""
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    pytest.importorskip("s3fs", reason="s3fs is in the dev extra")
    from s3fs import S3FileSystem
    from support.s3 import s3_server

    # fsspec keeps s3fs instances by their options, not by the endpoint the environment names: none made for
    # another module's server may serve this one, nor one made here the next module's
    S3FileSystem.clear_instance_cache()
    with s3_server() as server, pytest.MonkeyPatch.context() as patch:
        for name, value in server.environment.items():
            patch.setenv(name, value)
        fs = server.filesystem()
        bucket = f"caches-{uuid.uuid4().hex[:8]}"  # moto's buckets outlive its server: one of this module's own
        fs.mkdir(bucket)
        yield RemoteCache(server, fs, "s3://" + publish_remote(fs, example_cache, f"{bucket}/sft"), bucket)
    S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def image_files(tmp_path_factory) -> dict[str, Path]:
    """Every sample image (support/images.py) but the 12-megapixel one, each in a file, by name."""
    from support.images import sample_images

    folder = tmp_path_factory.mktemp("images")
    paths = {}
    for name, data in sample_images().items():
        if name != "huge":
            paths[name] = folder / f"{name}.img"
            paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="session")
def image_chats(tmp_path_factory) -> tuple[dict, dict[str, bytes]]:
    """Image chats, a processor and the options that tokenize them; and the data files a local run writes from
    them: what every runner must match byte for byte (support.flows.assert_image_run_writes)."""
    from support.images import write_image_chats
    from support.vision import qwen_vl

    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally

    base = tmp_path_factory.mktemp("image-chats")
    processor = base / "processor"
    processor.mkdir()
    qwen_vl(processor)
    inputs = [str(p) for p in write_image_chats(base / "data")]
    options = {"sources": inputs, "processor": str(processor), "shard_size": "2KB"}
    local = run_locally(TokenizeOptions(**options, cache_dir=str(base / "local")))
    want = {p.name: p.read_bytes() for p in sorted(local.glob("data-*.arrow"))}
    assert len(want) >= 3 and json.loads((local / "manifest.json").read_text())["images"]["images"] > 20
    return options, want


@pytest.fixture(scope="session", params=["gemma3", "qwen2.5-vl"])
def vision_family(request, tmp_path_factory):
    """(name, tokenizer, processor, its vision family) for each vision-language family the project supports,
    built offline (support/vision.py)."""
    from support.vision import gemma3, qwen_vl

    from sft_tokenize.encoding.vision import load_family

    builder = {"gemma3": gemma3, "qwen2.5-vl": qwen_vl}[request.param]
    tokenizer, processor, config = builder(tmp_path_factory.mktemp(request.param))
    return request.param, tokenizer, processor, load_family(config, tokenizer)


@pytest.fixture(scope="session")
def family_tokenizer(tmp_path_factory):
    """family name → directory of a tokenizer with that family's template (built once per session)."""
    return _built_once(tmp_path_factory, build_family_tokenizer)


@pytest.fixture(scope="session")
def prefect_harness(request, tmp_path_factory):
    """The Prefect API of the flows that tests run in this process: the run's shared server (`api_url`), with a
    PREFECT_HOME of this worker's own (the flows' settings and result storage).

    Requested by those tests only: the rest of the suite never starts a server, and the fast lane refuses it.
    Prefect's `prefect_test_harness` would start a second server for the same flows, on a database it migrates
    first: about 15 s of CPU, and a server idling beside the shared one until the run ends."""
    lanes.require("server", "the Prefect test harness")
    from prefect.context import refresh_global_settings_context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    url = request.getfixturevalue("api_url")  # after the lane's check: it starts the shared server
    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_HOME", str(home))
        env.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        # Every context reads these settings, a thread's that copied its context before this fixture included:
        # one that fell back to Prefect's default would start an embedded server of its own. The API URL goes into
        # Prefect's settings only, not into the environment the rest of this worker's tests start processes with
        # (a benchmark's or a CLI run's own server would otherwise be this one).
        with pytest.MonkeyPatch.context() as api:
            api.setenv("PREFECT_API_URL", url)
            refresh_global_settings_context()
        try:
            yield home
        finally:
            # The flows' logs and events still queued go now, while the server is sure to be up (it stops when
            # the run ends, before this process's exit would flush them).
            APILogWorker.drain_all()
            EventsWorker.drain_all()
            env.undo()
            refresh_global_settings_context()


@pytest.fixture(scope="session")
def modern_tokenizer(tmp_path_factory):
    """family name → directory of a tokenizer with that family's current template (built once per session)."""
    return _built_once(tmp_path_factory, build_modern_tokenizer)


@pytest.fixture(scope="session")
def modern_tokenizers(modern_tokenizer):
    """family name → that family's tokenizer, loaded (once per session)."""
    from sft_tokenize.encoding.tokenizer import load_tokenizer

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_tokenizer(modern_tokenizer(family))
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def large_vocab_tokenizer(tmp_path_factory) -> Path:
    """The directory of a tokenizer with a 150k vocabulary: its fast encoder takes seconds to build."""
    return build_large_vocab_tokenizer(tmp_path_factory.mktemp("large-vocab"))


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory):
    """A SentencePiece-style tokenizer, loaded: no byte-level positions, so no fast exact encoder."""
    from sft_tokenize.encoding.tokenizer import load_tokenizer

    return load_tokenizer(build_metaspace_tokenizer(tmp_path_factory.mktemp("metaspace")))


@pytest.fixture(scope="session")
def api_url(tmp_path_factory, migrated_prefect_home) -> Iterator[str]:
    """One Prefect server for the run's CLI runs that talk to a server (PREFECT_API_URL, as with a team server),
    shared by every pytest-xdist worker as a team's server is by its users: it saves the embedded server's
    start-up, seconds a run. Yields its API URL; stopped when the run ends (pytest_sessionfinish)."""
    with shared_prefect_server(shared_directory(tmp_path_factory), migrated_prefect_home) as url:
        yield url


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without workers): the run has ended
        stop_shared_server(shared_directory(session.config._tmp_path_factory))


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Postgres]:
    """One PostgreSQL cluster for the session (support/postgres.py): each Prefect server on it gets its own
    database. Skipped where PostgreSQL is not installed, unless SFT_TOKENIZE_TEST_POSTGRES=required (.ci/run,
    which installs it)."""
    if bindir() is None:
        if os.environ.get("SFT_TOKENIZE_TEST_POSTGRES") == "required":
            pytest.fail(f"SFT_TOKENIZE_TEST_POSTGRES=required, but there is no PostgreSQL: {INSTALL}")
        pytest.skip(f"no PostgreSQL here: {INSTALL}")
    with postgres(fast=True) as cluster:
        yield cluster


@pytest.fixture
def cli_home(tmp_path) -> Path:
    """A PREFECT_HOME (not made) for `sft-tokenize` subprocesses; its CLI runs put the test in the `cli` lane."""
    return tmp_path / "home"


@pytest.fixture
def server_home(tmp_path) -> Iterator[Path]:
    """A PREFECT_HOME for the embedded servers a test starts itself (sft_tokenize.server.embedded_server), in this
    process, where it is the current setting while the test runs, or in subprocesses it names it to."""
    from prefect.settings import PREFECT_HOME, temporary_settings

    home = tmp_path / "prefect-home"
    with temporary_settings(updates={PREFECT_HOME: home}):
        yield home


@pytest.fixture(scope="session")
def cli_homes(tmp_path_factory) -> Callable[[str], Path]:
    """name → a new directory for a module's CLI runs (a PREFECT_HOME and their files); puts its tests in the
    `cli` lane, as cli_home does."""
    return tmp_path_factory.mktemp


@pytest.fixture
def trainers_extra() -> None:
    """The trainers extra (CPU torch, trl): a test that needs it is skipped without it, and is in the `trainers`
    lane."""
    pytest.importorskip("torch", reason="needs the trainers extra: pip install -e '.[trainers]'")
    pytest.importorskip("trl", reason="needs the trainers extra: pip install -e '.[trainers]'")


@pytest.fixture
def launch(tmp_path) -> Iterator[Callable[..., Background]]:
    """Start `sft-tokenize ARGS` in the background (logs under tmp_path/logs/NAME); whatever a test leaves running,
    stopped or not, is killed when it ends."""
    runs: list[Background] = []

    def start(args: list[str], home: Path, name: str, api_url: str | None = None, **env) -> Background:
        runs.append(Background(args, home, tmp_path / "logs" / name, api_url, **env))
        return runs[-1]

    yield start
    for run in runs:
        if run.process.poll() is None:
            run.kill()
