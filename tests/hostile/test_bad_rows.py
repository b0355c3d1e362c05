"""Bad rows, found while tokenizing: each is named by its file and line (or item, or row), fails its own slice
and only that one, the run's error and its failure artifact name them all and what a rerun redoes, a rerun
once they are fixed tokenizes only those slices, and `--on-bad-row skip` counts what it skipped. The runs talk
to the session's Prefect server (PREFECT_API_URL, as with a team server)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.bad_input import NO_ASSISTANT, ROW_ERRORS, built_skipping, with_a_bad_row, write_lines
from support.caches import contents, published_caches, staged_shards
from support.cli import assert_rejected, cli, run_args
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.read.cache import open_cache

SLICES, FINISHED = 42, 31  # every line, JSON array and Parquet file of bad_rows_run is its own slice
FILES = [f"{case}.jsonl" for case in ROW_ERRORS] + ["no-assistant-row.jsonl", "bad-item.json", "bad-row.parquet"]


def other_formats_with_a_bad_row_2(data: Path) -> list[Path]:
    """A JSON array and a Parquet file whose second row has a message without a role."""
    rows = example_rows()[:3]
    rows[1] = {"messages": [{"role": None, "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (data / "bad-item.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), data / "bad-row.parquet")
    return [data / "bad-item.json", data / "bad-row.parquet"]


@pytest.fixture(scope="module")
def bad_rows_run(tmp_path_factory, api_url):
    """One run over a file per kind of bad row, and one with a row that has no assistant turn. Every line is its
    own slice, so every bad row fails its own slice and is reported, and the other slices finish."""
    data = tmp_path_factory.mktemp("bad-rows")
    files = [with_a_bad_row(data / f"{case}.jsonl", bad) for case, (bad, _) in ROW_ERRORS.items()]
    files.append(with_a_bad_row(data / "no-assistant-row.jsonl", NO_ASSISTANT))
    files += other_formats_with_a_bad_row_2(data)
    assert [f.name for f in files] == FILES
    cache_root = data / "cache"
    result = cli(*run_args(files, cache_root, "--shard-size", "1"), home=data / "prefect-home", api_url=api_url)
    return result, data, cache_root


@pytest.mark.parametrize("case", ROW_ERRORS)
def test_each_bad_row_is_named_by_file_and_line(bad_rows_run, case):
    result, data, _ = bad_rows_run
    assert f"failed: BadInput: {data}/{case}.jsonl:3: {ROW_ERRORS[case][1]}" in result.stderr


@pytest.mark.parametrize("where", ["bad-item.json: item 2", "bad-row.parquet: row 2"])
def test_rows_are_counted_from_1_in_every_format_as_lines_are(bad_rows_run, where):
    result, data, _ = bad_rows_run
    assert f"failed: BadInput: {data}/{where}: messages[0] has no 'role'" in result.stderr


def failed_rows(data: Path) -> list[str]:
    """Each bad row of bad_rows_run as its error names it."""
    return [f"{data}/{case}.jsonl:3: {detail}" for case, (_, detail) in ROW_ERRORS.items()] + [
        f"{data}/{where}: messages[0] has no 'role'" for where in ("bad-item.json: item 2", "bad-row.parquet: row 2")]


def rerun_hint(cache_root: Path, failed: int) -> str:
    return (f"the {FINISHED} finished shards stay in the shard store {cache_root / '.shards'}: fix those rows (or "
            f"skip them: --on-bad-row skip), then run the same command again to tokenize only these {failed} slices")


def test_bad_rows_exit_2_naming_every_one_publish_nothing_and_keep_the_good_slices(bad_rows_run):
    result, data, cache_root = bad_rows_run
    failed = failed_rows(data)
    last = assert_rejected(result)
    assert last.startswith(f"sft-tokenize: error: {len(failed)} of {SLICES} slices failed on bad input: tokenize-")
    assert all(f": {row}" in last for row in failed), last
    assert last.endswith("; " + rerun_hint(cache_root, len(failed)))
    assert "retr" not in last  # a bad row fails the same way every time: it is never retried
    assert "Retry" not in result.stderr  # nor is a flow run without a deployment
    # Said once: each bad row on its slice's log line and in the error, not in Prefect's lines about the failure.
    lines = result.stderr.splitlines()
    assert all(len([line for line in lines if row in line]) == 2 for row in failed), result.stderr
    assert published_caches(cache_root) == []
    # The other slices, kept for a rerun: the same three good lines in every file are one shard each (content
    # addressed), and the row without an assistant turn is the fourth.
    assert len(staged_shards(cache_root)) == 4
    assert not list(cache_root.glob(".shards/*.tmp-*"))
    assert not list((cache_root / ".staging").iterdir())  # no lock file (nor lease) left behind


def test_a_failed_run_has_a_failure_artifact_that_says_the_same(bad_rows_run, api_url):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _, data, cache_root = bad_rows_run
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            like_="sft-cache-failed-")))
    [artifact] = [a for a in artifacts if str(data) in a.data]
    failed = failed_rows(data)
    assert artifact.type == "markdown"
    assert artifact.description == f"{len(failed)} of {SLICES} slices failed on bad input"
    lines = artifact.data.splitlines()
    assert lines[0].startswith("### Failed: ") and lines[0].endswith(f", {artifact.description}")
    assert lines[2:4] == ["| slice | reads | reason |", "|---|---|---|"]
    table = lines[4:4 + len(failed)]
    for row, name in zip(failed, FILES[:len(ROW_ERRORS)] + FILES[-2:], strict=True):
        [line] = [line for line in table if f"| `{row}" in line]
        assert line.startswith("| tokenize-") and f"| `{data / name}" in line
    hint = rerun_hint(cache_root, len(failed))
    assert lines[-1] == f"{hint[0].upper()}{hint[1:]}."


def test_a_rerun_once_the_rows_are_fixed_tokenizes_only_them_and_equals_a_clean_build(bad_rows_run, api_url,
                                                                                      tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _, data, _ = bad_rows_run
    fixed = Path(shutil.copytree(data, tmp_path / "fixed", ignore=shutil.ignore_patterns("prefect-home")))
    good_row = json.dumps(example_rows()[3]).encode()
    for case in ROW_ERRORS:
        lines = (fixed / f"{case}.jsonl").read_bytes().splitlines()
        write_lines(fixed / f"{case}.jsonl", [*lines[:2], good_row, *lines[3:]])
    (fixed / "bad-item.json").write_text(json.dumps(example_rows()[:3]))
    pq.write_table(pa.Table.from_pylist(example_rows()[:3]), fixed / "bad-row.parquet")
    sources = [fixed / name for name in FILES]

    rerun = cli(*run_args(sources, fixed / "cache", "--shard-size", "1"), home=tmp_path / "home", api_url=api_url)
    assert rerun.returncode == 0, rerun.stderr
    cache_path = Path(rerun.stdout.splitlines()[-1])
    build = json.loads((cache_path / "manifest.json").read_text())["build"]
    assert (build["slices_reused"], build["slices_tokenized"]) == (FINISHED, SLICES - FINISHED)
    assert not list((fixed / "cache" / ".staging").iterdir())
    clean = run_locally(TokenizeOptions(sources=list(map(str, sources)), tokenizer=str(EXAMPLE_TOKENIZER),
                                        cache_dir=str(tmp_path / "clean"), shard_size="1"))
    assert clean.name == cache_path.name and contents(cache_path) == contents(clean)

    # Its summary artifact: a table whose header row names its columns.
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="sft-cache-")))
    [summary] = [a.data for a in artifacts if f"| cache | {cache_path} |" in a.data]
    assert summary.splitlines()[2:4] == ["| field | value |", "|---|---|"]


def test_a_row_without_an_assistant_turn_is_a_counted_drop_not_an_error(bad_rows_run):
    result, data, cache_root = bad_rows_run
    assert "no-assistant-row.jsonl" not in result.stderr
    # Its four lines are four slices: three good rows (shards shared with the other files' same lines) and the
    # row without an assistant turn, a shard of no row that counts the drop.
    sidecars = [json.loads(p.read_text()) for p in cache_root.glob(".shards/*.json")]
    assert sorted(meta["rows"] for meta in sidecars) == [0, 1, 1, 1]
    assert [meta["dropped"] for meta in sidecars if meta["dropped"]] == [{"no_assistant_turn": 1}]


def test_skipped_bad_rows_are_counted_in_the_manifest(tmp_path, api_url):
    good = [json.dumps(row) for row in example_rows()[:10]]
    bad = [bad for bad, _ in ROW_ERRORS.values()] + [NO_ASSISTANT]
    mixed = [line for pair in zip(good[:len(bad)], bad, strict=True) for line in pair] + good[len(bad):]
    data = write_lines(tmp_path / "messy.jsonl", mixed)  # a bad row after each of the first good ones
    cache_root = tmp_path / "cache"
    cache_path, manifest = built_skipping(data, cache_root, tmp_path / "home", api_url)
    assert manifest["rows"] == len(good) == len(open_cache(cache_path))
    assert manifest["dropped"] == {"bad_message": 3, "bad_messages": 1, "malformed_json": 2, "no_assistant_turn": 1,
                                   "not_unicode": 1, "not_utf8": 1, "unknown_role": 1}

    # Prefect's persisted task results are JSON, never pickle: one per slice, holding its row count.
    records = [json.loads(p.read_bytes()) for p in (cache_root / ".prefect-results").iterdir()]
    assert len(records) == len(manifest["shards"])
    assert all(record["metadata"]["serializer"]["type"] == "json" for record in records)
    assert sorted(json.loads(record["result"]) for record in records) == sorted(s["rows"] for s in manifest["shards"])


def test_a_file_without_an_assistant_turn_exits_2_naming_it(tmp_path, api_url):
    data = write_lines(tmp_path / "questions.jsonl", [NO_ASSISTANT] * 3)
    cache_root = tmp_path / "cache"
    result = cli(*run_args([data], cache_root), home=tmp_path / "home", api_url=api_url)
    assert_rejected(result, f"{data}: no row has a trained token: 3 rows dropped (no_assistant_turn: 3)")
    assert published_caches(cache_root) == []


def test_control_token_text_in_a_message_is_plain_text_or_a_named_error(tmp_path, api_url):
    """A literal <|im_end|> inside a reply: by default encoded as text, so the whole reply is trained; with
    --special-text error, the run stops naming the file, the line and the message."""
    injected = {"messages": [{"role": "user", "content": "Say the end marker."},
                             {"role": "assistant", "content": "Here: <|im_end|> and the rest of the reply."}]}
    data = write_jsonl(tmp_path / "injected.jsonl", [example_rows()[0], injected])
    result = cli(*run_args([data], tmp_path / "cache"), home=tmp_path / "home", api_url=api_url)
    assert result.returncode == 0, result.stderr
    cache_path = Path(result.stdout.splitlines()[-1])
    shown = cli("inspect", str(cache_path), "--row", "1", home=tmp_path / "home", api_url=api_url)
    assert "[[Here: <|im_end|> and the rest of the reply.<|im_end|>]]" in shown.stdout
    assert json.loads((cache_path / "manifest.json").read_text())["masks"]["rows_special_text"] == 1
    refused = cli(*run_args([data], tmp_path / "strict", "--special-text", "error"), home=tmp_path / "home",
                  api_url=api_url)
    assert_rejected(refused, f"{data}:2: messages[1].content holds the control token '<|im_end|>' as text")
    assert published_caches(tmp_path / "strict") == []
