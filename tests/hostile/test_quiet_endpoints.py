"""Endpoints that stop answering or refuse, met where a cache root is not involved: a run reading its sources
from a bucket, a published version read back (pull, inspect), and gc. A real S3 API (moto's server,
support/s3.py) behind a TCP proxy (support/proxy.py) that goes silent or refuses; --request-timeout bounds each
request, and the run or command ends in one line naming the URL and its endpoint. A request answered late once is
tried again, and the command succeeds."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from support.caches import EXAMPLE_SLICES
from support.cli import run_args
from support.faults import FAULT_FILE_ENV
from support.paths import EXAMPLE_DATA
from support.proxy import tcp_proxy
from support.runs import Background
from support.s3 import bucket_in_environment

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.cli.main import main

pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
pytest.importorskip("s3fs", reason="s3fs is in the dev extra")

BUCKET = f"quiet-{uuid.uuid4().hex[:8]}"  # moto's buckets outlive its server: one of this module's own
REASONS = {"silent": "no answer within 1 s (--request-timeout)", "refuse": "connection refused"}


@pytest.fixture(scope="module")
def s3() -> Iterator:
    with bucket_in_environment(BUCKET) as server:
        yield server


@pytest.mark.parametrize("fault", ["silent", "refuse"])
def test_a_remote_source_whose_endpoint_goes_quiet_or_refuses_mid_run_fails_its_slice_naming_the_file(
        s3, api_url, cli_home, tmp_path, fault):
    source = f"s3://{BUCKET}/sources-{fault}/chat-00000.jsonl"  # two slices
    s3.filesystem().put_file(str(EXAMPLE_DATA / "chat-00000.jsonl"), source.removeprefix("s3://"))
    root = tmp_path / "root"  # a local cache root: only the source is on the bucket
    faults = tmp_path / "faults"
    faults.write_text("hold:1")  # slice 0 is written; slice 1 waits for the endpoint to go
    with tcp_proxy(s3.endpoint) as proxy:
        env = {**s3.environment, "AWS_ENDPOINT_URL": proxy.endpoint, FAULT_FILE_ENV: str(faults),
               "SFT_TOKENIZE_HOME": str(tmp_path / "home")}
        args = run_args([source], root, "--request-timeout", "1", "--retries", "0")  # type: ignore[arg-type]
        run = Background(args, cli_home, tmp_path / "logs", api_url, **env)
        run.wait_until(lambda: any((root / ".shards").glob("*.arrow")), "slice 0 is written")
        getattr(proxy, fault)()
        faults.write_text("")
        started = time.monotonic()
        # without a bound: 10 or more minutes (botocore's and s3fs's retries)
        code = run.ended_within(120, "the endpoint went")
        seconds = time.monotonic() - started
    last = run.stderr.strip().splitlines()[-1]
    assert code == 1, run.stderr
    assert "1 of 2 slices failed: tokenize-00001" in last, last
    assert f"{source} (endpoint {proxy.endpoint}): {REASONS[fault]}" in last, last
    assert seconds < 60, run.stderr  # a request waits 1 s and is tried once more


@pytest.fixture(scope="module")
def version(s3, tmp_path_factory) -> str:
    """A version published on the bucket, straight to the server."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SFT_TOKENIZE_HOME", str(home))
        return run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=f"s3://{BUCKET}/published"))


@pytest.mark.parametrize("fault", ["silent", "refuse"])
@pytest.mark.parametrize("command", ["pull", "inspect", "gc"])
def test_reading_a_version_or_collecting_a_bucket_through_a_quiet_or_refusing_endpoint_ends_in_one_line(
        s3, version, tmp_path, monkeypatch, capsys, command, fault):
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))
    args = {"pull": ["pull", version, str(tmp_path / "copy")], "inspect": ["inspect", version],
            "gc": ["gc", f"s3://{BUCKET}/published"]}[command]
    with tcp_proxy(s3.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        getattr(proxy, fault)()
        started = time.monotonic()
        code = main([*args, "--request-timeout", "1"])
        seconds = time.monotonic() - started
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    # gc probes the root before it removes anything: a URL it cannot reach is bad input, as a wrong one is
    assert code == (2 if command == "gc" else 1), err
    named = f"s3://{BUCKET}/published" if command == "gc" else version
    assert f"{named}" in err and f"(endpoint {proxy.endpoint}): {REASONS[fault]}" in err, err
    assert seconds < 30, err
    assert not (tmp_path / "copy" / version.rsplit("/", 1)[-1]).exists()  # nothing published


@pytest.mark.parametrize("fault", ["silent", "refuse"])
def test_a_source_on_a_quiet_or_refusing_http_server_is_named_in_one_line_before_any_slice(tmp_path, fault):
    from support.file_server import file_server

    from sft_tokenize.build.plan import plan_slices
    from sft_tokenize.errors import BadInput

    data = (EXAMPLE_DATA / "chat-00001.jsonl").read_bytes()
    with file_server({"/data/chat.jsonl": data}) as site, tcp_proxy(site.endpoint) as proxy:
        getattr(proxy, fault)()
        url = f"{proxy.endpoint}/data/chat.jsonl"
        options = TokenizeOptions(sources=[url], tokenizer=EXAMPLE_SLICES["tokenizer"],
                                  cache_dir=str(tmp_path / "c"), request_timeout=1)
        started = time.monotonic()
        with pytest.raises(BadInput) as raised:
            plan_slices(options, dry=True)
        seconds = time.monotonic() - started
    assert str(raised.value) == f"{url}: {REASONS[fault]}; check that the endpoint is up and reachable from here"
    assert seconds < 30  # aiohttp's own default waits 5 minutes for an answer


@pytest.mark.parametrize("command", ["pull", "inspect"])
def test_a_request_answered_late_once_is_tried_again_and_the_command_succeeds(s3, version, tmp_path, monkeypatch,
                                                                             capsys, command):
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))
    args = {"pull": ["pull", version, str(tmp_path / "copy")], "inspect": ["inspect", version]}[command]
    with tcp_proxy(s3.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.delay(30.0)  # the first request is answered 30 s late; the one tried again at once
        started = time.monotonic()
        code = main([*args, "--request-timeout", "2"])
        seconds = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 0, err
    assert not proxy.delays and seconds < 30  # the late request was given up after 2 s, not waited for
    assert command != "pull" or (tmp_path / "copy" / version.rsplit("/", 1)[-1] / "manifest.json").exists()
