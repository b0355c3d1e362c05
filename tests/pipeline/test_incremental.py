"""Incremental rebuilds: a grown or edited dataset tokenizes only the slices whose bytes changed, new
versions share the unchanged shards (hard links into the shard store), and gc is safe beside a build.

Mostly the data plane (run_locally); one flow scenario on Prefect's test harness for the retry semantics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import datasets
import pytest
from support.cli import cli
from support.data import example_rows, write_jsonl
from support.faults import FAULT_FILE_ENV
from support.paths import EXAMPLE_TOKENIZER, ROOT

from sft_tokenize.build import keys as content
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.publish import building, publish_cache
from sft_tokenize.build.shard import tokenize_slice
from sft_tokenize.build.store import collect_garbage, lease_path, leased, store_dir
from sft_tokenize.errors import BadInput
from sft_tokenize.format.layout import DIGEST_BOOK
from sft_tokenize.read.cache import open_cache, read_manifest

ROWS_PER_FILE = 20  # ~28 kB a file: three slices of 12 kB each
SHARD_SIZE = "12KB"


def write_files(data: Path, count: int, first: int = 0) -> list[Path]:
    rows = example_rows()
    return [write_jsonl(data / f"part-{i:03d}.jsonl", rows[i * ROWS_PER_FILE:(i + 1) * ROWS_PER_FILE])
            for i in range(first, first + count)]


def options(data: Path, cache: Path, **overrides) -> TokenizeOptions:
    return TokenizeOptions(**{"sources": [str(data)], "tokenizer": str(EXAMPLE_TOKENIZER), "cache_dir": str(cache),
                              "name": "mix", "shard_size": SHARD_SIZE, **overrides})


def store_shards(cache: Path) -> dict[str, tuple[int, int]]:
    """Every shard in the store by key: (inode, mtime_ns) tells whether a build rewrote it."""
    return {p.stem: (p.stat().st_ino, p.stat().st_mtime_ns) for p in store_dir(cache).glob("*.arrow")}


def rows_of(cache_path: Path) -> list[tuple[list[int], list[int]]]:
    table = datasets.load_from_disk(str(cache_path))
    return list(zip(table["input_ids"], table["loss_mask"], strict=True))


def from_scratch(data: Path, tmp_path: Path, **overrides) -> list:
    """The same sources built into an empty cache root: every slice tokenized."""
    return rows_of(run_locally(options(data, tmp_path / f"scratch-{len(list(tmp_path.glob('scratch-*')))}",
                                       **overrides)))


def build(data: Path, cache: Path, **overrides) -> tuple[Path, dict, set[str]]:
    """Build a version; returns its path, its manifest and the keys of the shards this build wrote."""
    before = store_shards(cache) if store_dir(cache).exists() else {}
    path = run_locally(options(data, cache, **overrides))
    after = store_shards(cache)
    changed = {key for key, stamp in after.items() if before.get(key) != stamp}
    assert all(before[key] == after[key] for key in before if key in after)  # nothing rewritten in place
    return path, read_manifest(path), changed


def keys_of(manifest: dict) -> list[str]:
    return [shard["key"] for shard in manifest["shards"]]


def slices_of(manifest: dict, file: Path) -> list[dict]:
    return [shard for shard in manifest["shards"] if shard["slice"][0][0] == str(file)]


@pytest.fixture
def grown(tmp_path):
    """Ten files built into version A, under cache root tmp_path/cache."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    write_files(data, 10)
    path, manifest, written = build(data, cache)
    assert manifest["build"] == {**manifest["build"], "slices_reused": 0, "slices_tokenized": len(written)}
    return data, cache, path, manifest


def test_an_added_file_tokenizes_only_its_own_slices(grown, tmp_path):
    data, cache, path_a, manifest_a = grown
    before = store_shards(cache)
    (new_file,) = write_files(data, 1, first=10)
    path_b, manifest_b, written = build(data, cache)

    assert path_b != path_a
    new_slices = slices_of(manifest_b, new_file)
    assert len(new_slices) >= 2 and written == {s["key"] for s in new_slices}
    assert manifest_b["build"]["slices_tokenized"] == len(new_slices)
    assert manifest_b["build"]["slices_reused"] == len(manifest_a["shards"])
    assert keys_of(manifest_b)[:len(manifest_a["shards"])] == keys_of(manifest_a)
    # The unchanged shards are the same files on disk in both versions and the store: hard links, untouched.
    for key in keys_of(manifest_a):
        assert store_shards(cache)[key] == before[key]
    inodes_a = {p.stat().st_ino for p in path_a.glob("data-*.arrow")}
    inodes_b = {p.stat().st_ino for p in path_b.glob("data-*.arrow")}
    assert inodes_a < inodes_b and len(inodes_b - inodes_a) == len(new_slices)
    # Row for row what a build from scratch gives, in source order; and version A is still there to read.
    rows_b = rows_of(path_b)
    assert rows_b == from_scratch(data, tmp_path)
    assert rows_b[:len(open_cache(path_a))] == rows_of(path_a) and len(rows_b) == 11 * ROWS_PER_FILE


def test_appended_rows_tokenize_only_the_slices_past_the_old_end(grown, tmp_path):
    data, cache, _, manifest_a = grown
    victim = data / "part-003.jsonl"
    old = slices_of(manifest_a, victim)
    with victim.open("a") as out:
        for row in example_rows()[230:236]:
            out.write(json.dumps(row) + "\n")
    _, manifest_b, written = build(data, cache)

    new = slices_of(manifest_b, victim)
    last_start = old[-1]["slice"][0][2]
    # The cuts before the old last slice did not move; from it on, the slices were cut (and tokenized) anew.
    assert [(s["slice"], s["key"]) for s in new if s["slice"][0][2] < last_start] == [
        (s["slice"], s["key"]) for s in old[:-1]]
    assert written == {s["key"] for s in new if s["slice"][0][2] >= last_start}
    assert manifest_b["build"]["slices_tokenized"] == len(written) >= 1
    assert rows_of(cache / f"mix-{manifest_b['fingerprint']}") == from_scratch(data, tmp_path)


def test_an_edited_row_retokenizes_only_its_slice_and_a_touch_nothing(grown, tmp_path):
    data, cache, _, manifest_a = grown
    victim = data / "part-005.jsonl"
    middle = slices_of(manifest_a, victim)[1]
    start, stop = middle["slice"][0][2:4]
    text = victim.read_bytes()
    line_start = text.index(b"\n", start + (stop - start) // 2) + 1  # a row inside the middle slice
    line_end = text.index(b"\n", line_start)
    row = json.loads(text[line_start:line_end])
    row["messages"][-1]["content"] += " (corrected)"
    victim.write_bytes(text[:line_start] + json.dumps(row, ensure_ascii=False).encode() + text[line_end:])
    path_b, manifest_b, written = build(data, cache)

    assert len(written) == 1 and manifest_b["build"] == {**manifest_b["build"], "slices_tokenized": 1,
                                                         "slices_reused": len(manifest_a["shards"]) - 1}
    (edited,) = [s for s in manifest_b["shards"] if s["key"] in written]
    assert edited["slice"][0][:3] == [str(victim), "jsonl", start]
    assert rows_of(path_b) == from_scratch(data, tmp_path)

    # A new mtime with the same bytes: a new version (its fingerprint has the mtime), nothing tokenized.
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
    path_c, manifest_c, written = build(data, cache)
    assert path_c != path_b and written == set()
    assert manifest_c["build"]["slices_tokenized"] == 0 and keys_of(manifest_c) == keys_of(manifest_b)
    assert {p.stat().st_ino for p in path_c.glob("data-*")} == {p.stat().st_ino for p in path_b.glob("data-*")}


def test_a_changed_tokenizer_or_template_retokenizes_everything(grown, tmp_path):
    data, cache, _, manifest_a = grown
    template = tmp_path / "template.jinja"
    template.write_text((EXAMPLE_TOKENIZER / "chat_template.jinja").read_text() + "{{ '\\n' }}")
    _, manifest_t, written = build(data, cache, chat_template=str(template))
    assert manifest_t["build"]["slices_reused"] == 0 and written == set(keys_of(manifest_t))
    assert not set(keys_of(manifest_t)) & set(keys_of(manifest_a))

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(EXAMPLE_TOKENIZER, tokenizer)
    config = tokenizer / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "padding_side": "left"}', 1))
    _, manifest_k, written = build(data, cache, tokenizer=str(tokenizer))
    assert manifest_k["build"]["slices_reused"] == 0 and written == set(keys_of(manifest_k))
    assert not set(keys_of(manifest_k)) & (set(keys_of(manifest_a)) | set(keys_of(manifest_t)))


def test_the_digest_book_spares_rereading_unchanged_files_and_a_stale_digest_is_caught(grown, monkeypatch):
    """A plan keys a file whose stat is unchanged by the digest the book remembers, without reading it; a file
    written just before it was hashed is hashed again; and a remembered digest that is not the bytes' (here
    planted) makes its slice fail its check after tokenizing, and is forgotten, so the next run is right."""
    data, cache, _, manifest_a = grown
    book = store_dir(cache) / DIGEST_BOOK
    victim = str(data / "part-000.jsonl")

    def plant() -> None:
        entries = json.loads(book.read_text())
        assert set(entries) == {str(p) for p in data.glob("*.jsonl")}
        assert len(entries[victim]["spans"]) == len(slices_of(manifest_a, Path(victim)))
        entries[victim]["spans"] = dict.fromkeys(entries[victim]["spans"], "0" * 32)  # not these bytes' digests
        book.write_text(json.dumps(entries))

    # A file written within RACY_NS of its hashing (here: as if RACY_NS were long) is read again.
    plant()
    with monkeypatch.context() as patched:
        patched.setattr(content, "RACY_NS", 10**15)
        assert [s.key for s in plan_slices(options(data, cache, name="again")).slices] == keys_of(manifest_a)

    plant()
    monkeypatch.setattr(content, "RACY_NS", 0)  # written long before the first plan hashed them
    trusted = [s.key for s in plan_slices(options(data, cache, name="again")).slices]
    victim_keys = {s["key"] for s in slices_of(manifest_a, Path(victim))}
    changed = {a for a, b in zip(keys_of(manifest_a), trusted, strict=True) if a != b}
    assert changed == victim_keys  # only the planted file's keys moved: no other file was read

    with pytest.raises(BadInput, match="part-000.jsonl: changed while it was being tokenized"):
        run_locally(options(data, cache, name="again"))
    assert victim not in json.loads(book.read_text())
    _, manifest_b, written = build(data, cache, name="again")
    assert keys_of(manifest_b) == keys_of(manifest_a) and written == set()


def test_a_small_file_added_disturbs_only_the_group_it_lands_in(tmp_path):
    """Files far below the target are grouped whole; a file added between them changes one group."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    rows = example_rows()
    for i in range(60):
        write_jsonl(data / f"day-{2 * i:03d}.jsonl", rows[2 * i:2 * i + 2])  # ~3 kB each
    target = "12KB"
    before = {s.key: s for s in plan_slices(options(data, cache, shard_size=target)).slices}
    assert len(before) >= 10 and max(len(s.parts) for s in before.values()) > 1
    for added in (61, 1, 117):  # in the middle, at the start, at the end (names sort by number)
        write_jsonl(data / f"day-{added:03d}.jsonl", rows[200:202])
        after = {s.key: s for s in plan_slices(options(data, cache, shard_size=target)).slices}
        gone, came = before.keys() - after.keys(), after.keys() - before.keys()
        assert len(gone) <= 1 and 1 <= len(came) <= 2, (added, len(gone), len(came))
        assert any(p.url.endswith(f"day-{added:03d}.jsonl") for key in came for p in after[key].parts)
        before = after


def gc_cli(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return cli("gc", str(cache), *args, home=cache.parent / "prefect-home", timeout=120)


@pytest.mark.usefixtures("cli_home")  # sft-tokenize in a subprocess
def test_gc_beside_a_running_build_keeps_the_newest_version_and_the_build(grown, tmp_path):
    data, cache, path_a, manifest_a = grown
    # Version B: file 0 edited (so one of A's shards is A's alone) and an 11th file.
    first = data / "part-000.jsonl"
    first.write_text(first.read_text().replace("\n", "\n\n", 1))
    write_files(data, 1, first=10)
    path_b, manifest_b, _ = build(data, cache)
    only_a = set(keys_of(manifest_a)) - set(keys_of(manifest_b))
    assert len(only_a) == 1

    # A third build, under way: leased, one of its new slices tokenized, not yet published.
    write_files(data, 1, first=11)
    plan = plan_slices(options(data, cache))
    with building(plan.job), leased(plan.job, plan.slices) as reused:
        todo = [s for s in plan.slices if s.index not in reused]
        assert len(todo) >= 2
        tokenize_slice(plan.job, todo[0])
        done = gc_cli(cache, "--keep", "1")
        assert done.returncode == 0, done.stderr
        assert f"removed {path_a}" in done.stdout and "1 running builds" in done.stdout
        assert not path_a.exists() and len(open_cache(path_b)) == 11 * ROWS_PER_FILE
        shards = store_shards(cache)
        assert set(keys_of(manifest_b)) <= shards.keys()  # A's shards that B uses stay
        assert not only_a & shards.keys()  # A's own shard went with it
        assert todo[0].key in shards  # the running build's shard stayed
        for slice_ in todo[1:]:
            tokenize_slice(plan.job, slice_)
        path_c = publish_cache(plan.job, plan.slices, plan.cache_path, plan.inputs, plan.name, reused=len(reused))
    assert read_manifest(path_c)["build"]["slices_tokenized"] == len(todo)
    assert rows_of(path_c) == from_scratch(data, tmp_path)

    again = gc_cli(cache, "--keep", "1")
    assert again.returncode == 0 and f"removed {path_b}" in again.stdout and "0 running builds" in again.stdout
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [path_c.name]
    assert set(store_shards(cache)) == set(keys_of(read_manifest(path_c)))
    assert rows_of(path_c) == from_scratch(data, tmp_path)


def test_gc_collects_what_a_killed_build_left(grown):
    data, cache, path_a, manifest_a = grown
    write_files(data, 1, first=10)
    plan = plan_slices(options(data, cache))
    new = [s for s in plan.slices if s.parts[0].url.endswith("part-010.jsonl")]
    # A lease whose run lock nobody holds: its build was killed after one shard and half of another.
    with leased(plan.job, plan.slices):
        tokenize_slice(plan.job, new[0])
        partial = plan.job.shard_path(new[1]).with_name(f"{new[1].key}.arrow.tmp-1234")
        partial.write_bytes(b"half a shard")
        done = collect_garbage(cache, keep=1)
        assert not lease_path(plan.job).exists()
    assert (done.live_builds, done.removed, done.shards_removed) == (0, [], 1)
    assert set(store_shards(cache)) == set(keys_of(manifest_a)) and not partial.exists()
    assert len(open_cache(path_a)) == 10 * ROWS_PER_FILE


@pytest.mark.usefixtures("cli_home")  # sft-tokenize in a subprocess
def test_gc_refuses_a_missing_directory(tmp_path):
    done = gc_cli(tmp_path / "nowhere")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"sft-tokenize: error: {tmp_path / 'nowhere'}: no such cache directory"


def test_a_failed_slice_of_an_incremental_flow_run_is_retried_alone(tmp_path, monkeypatch, prefect_harness):
    from support.flows import artifacts_of
    from support.flows import run_flow as flow_run

    from sft_tokenize.flows.tokenize_dataset import TokenizeRun

    def run_flow(**overrides):
        slices = len(plan_slices(options(data, cache), min_slices=2).slices)
        state, runs = flow_run(TokenizeRun(**options(data, cache).model_dump(), workers=2, retries=1, **overrides),
                               settled=slices)
        return state, {name: run for name, run in runs.items() if name.startswith("tokenize-")}, artifacts_of(state)

    data, cache = tmp_path / "data", tmp_path / "cache"
    write_files(data, 4)  # few slices: each is a task run on the test server
    state, runs, _ = run_flow()
    assert state.is_completed() and {r.state.name for r in runs.values()} == {"Completed"}
    old = sorted(runs)

    (added,) = write_files(data, 1, first=4)
    new = [f"tokenize-{s.index:05d}" for s in plan_slices(options(data, cache), min_slices=2).slices
           if s.parts[0].url == str(added)]
    assert len(new) >= 2
    fault_file = tmp_path / "faults"
    fault_file.write_text(str(int(new[0].removeprefix("tokenize-"))))
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault_file))
    state, runs, _ = run_flow()
    assert state.is_failed() and f"{new[0]}: RuntimeError: injected fault" in state.message
    assert f"1 of {len(old) + len(new)} slices failed" in state.message
    assert runs[new[0]].state.is_failed() and runs[new[0]].run_count == 2  # its attempt and its one retry
    assert {name: runs[name].state.name for name in new[1:]} == dict.fromkeys(new[1:], "Completed")
    assert {runs[name].state.name for name in old} == {"Cached"}  # the unchanged files: not even run

    fault_file.unlink()
    state, runs, artifacts = run_flow(keep_versions=1)  # and collect the older version once published
    assert state.is_completed()
    assert {name: run.state.name for name, run in runs.items()} == {**dict.fromkeys(old + new, "Cached"),
                                                                    new[0]: "Completed"}
    manifest = read_manifest(state.result())
    assert manifest["build"]["slices_tokenized"] == 1 and manifest["build"]["slices_reused"] == len(old + new) - 1
    assert f"| slices | {len(old + new)}: 1 tokenized, {len(old + new) - 1} reused from the shard store |" \
        in artifacts["markdown"]
    assert rows_of(Path(state.result())) == from_scratch(data, tmp_path)
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == [Path(state.result())]
    assert set(store_shards(cache)) == set(keys_of(manifest))


def test_the_nightly_deployment_is_incremental_and_keeps_two_versions():
    """Incremental is the default (nothing to turn on); the nightly must not force rebuilds, and it collects
    the versions older than the last two so that a growing dataset does not fill the disk."""
    import yaml

    from sft_tokenize.flows.tokenize_dataset import TokenizeRun

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    nightly = TokenizeRun(**deployments["nightly"]["parameters"]["options"])
    assert not nightly.force and nightly.keep_versions == 2
    assert deployments["nightly"]["schedules"][0]["active"]
