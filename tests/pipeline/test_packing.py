"""The global packing index: exact BFD/FFD, every row once, no bin over N, the packed reader against the rows,
byte-for-byte determinism, data-parallel balance, read-only caches, concurrent packs, the CLI and the flow."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import datasets
import numpy as np
import pytest
from support.cli import cli
from support.paths import BIN, EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.errors import BadInput
from sft_tokenize.read.bin_packing import best_fit_decreasing, first_fit_decreasing
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.packed_sequences import PackedSampler
from sft_tokenize.read.packing_index import PackOptions, index_path, lower_bound_bins, pack_cache, plan


def row_by_row(lengths: list[int], capacity: int, best: bool) -> list[list[int]]:
    """The textbook loop: rows longest first (ties by id); best fit takes the bin with the least space left
    (ties: the one that reached that space first), first fit the first opened bin that fits."""
    bins, space, since = [], [], []
    for clock, row in enumerate(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))):
        fits = [b for b in range(len(bins)) if space[b] >= lengths[row]]
        if fits:
            b = min(fits, key=lambda b: (space[b], since[b])) if best else fits[0]
        else:
            bins.append([])
            space.append(capacity)
            since.append(-1)
            b = len(bins) - 1
        bins[b].append(row)
        space[b] -= lengths[row]
        since[b] = clock
    return bins


def as_lists(rows: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [rows[offsets[b]:offsets[b + 1]].tolist() for b in range(len(offsets) - 1)]


@pytest.mark.parametrize("best", [True, False], ids=["bfd", "ffd"])
def test_bin_packing_equals_the_row_by_row_loop(best):
    rng = np.random.default_rng(16)
    pack = best_fit_decreasing if best else first_fit_decreasing
    for _ in range(200):
        capacity = int(rng.integers(1, 80))
        lengths = rng.integers(1, capacity + 1, int(rng.integers(0, 120)))
        assert as_lists(*pack(lengths, capacity)) == row_by_row(lengths.tolist(), capacity, best)


@pytest.mark.usefixtures("trainers_extra")
def test_bfd_gives_trls_bins_on_one_batch():
    pa = pytest.importorskip("pyarrow")
    data_utils = pytest.importorskip("trl.data_utils")
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, 1000)
    table = pa.table({"input_ids": pa.array([[row] * int(n) for row, n in enumerate(lengths)])})
    packed = data_utils._pack_bfd(table, 300)
    trl_bins = [list(dict.fromkeys(seq)) for seq in packed["input_ids"].to_pylist()]
    assert as_lists(*best_fit_decreasing(lengths, 300)) == trl_bins


def test_the_lower_bound_is_martello_and_toths_l2_and_below_every_packing():
    rng = np.random.default_rng(2)
    for _ in range(100):
        capacity = int(rng.integers(2, 60))
        lengths = rng.integers(1, capacity + 1, int(rng.integers(1, 60)))
        bounds = [-(-lengths.sum() // capacity)]
        for a in range(capacity // 2 + 1):
            big = lengths > capacity - a
            middle = (lengths > capacity / 2) & ~big
            small = (lengths >= a) & (lengths <= capacity / 2)
            room = middle.sum() * capacity - lengths[middle].sum()
            bounds.append(big.sum() + middle.sum() + max(0, -(-(lengths[small].sum() - room) // capacity)))
        assert lower_bound_bins(lengths, capacity) == max(bounds)
        assert max(bounds) <= len(best_fit_decreasing(lengths, capacity)[1]) - 1


@pytest.fixture
def cache_path(example_cache) -> Path:
    """The bundled example (240 rows of 28 to 478 tokens) as a published cache of several data files."""
    return example_cache


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def reference_rows(cache_path: Path) -> list[dict[str, list[int]]]:
    """Every row as datasets reads it: an oracle that shares no code with the packed reader."""
    return datasets.load_from_disk(str(cache_path)).to_list()


@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])
@pytest.mark.parametrize("ranks", [1, 3, 8])
def test_every_row_once_no_bin_over_n_and_long_rows_counted(cache_path, tmp_path, algorithm, ranks):
    before = snapshot(cache_path)
    options = PackOptions(length=256, data_parallel=ranks, algorithm=algorithm, index_dir=str(tmp_path))
    index = pack_cache(cache_path, options)
    lengths = open_cache(cache_path).lengths
    assert sorted(index.rows.tolist()) == list(range(len(lengths)))  # truncation keeps every row
    tokens = np.array([np.minimum(lengths[index.bin(b)], 256).sum() for b in range(len(index))])
    assert tokens.max() <= 256 and len(index) % ranks == 0
    meta = index.meta
    assert meta["long_rows"] == {"policy": "truncate", "rows": int((lengths > 256).sum()),
                                 "tokens_cut": int((lengths[lengths > 256] - 256).sum())} and meta["long_rows"]["rows"]
    assert meta["bins"] == len(index) and meta["tokens"] == tokens.sum()
    assert meta["efficiency"] == round(tokens.sum() / (len(index) * 256), 6)
    assert meta["lower_bound_bins"] <= len(index)
    counts = np.diff(index.bins)
    assert meta["rows_per_bin"] == {"min": counts.min(), "mean": round(counts.mean(), 3), "max": counts.max()}
    assert snapshot(cache_path) == before  # the published cache is never touched


def test_packed_reader_equals_the_rows_concatenated_by_the_index(cache_path, tmp_path):
    reference = reference_rows(cache_path)
    packed = open_cache(cache_path).packed(300, data_parallel=2, index_dir=str(tmp_path))
    assert len(packed) == len(packed.index)
    for i in range(len(packed)):
        item = packed[i]
        rows = packed.index.bin(i).tolist()
        expected_ids = [token for row in rows for token in reference[row]["input_ids"][:300]]
        expected_mask = [bit for row in rows for bit in reference[row]["loss_mask"][:300]]
        lengths = [min(len(reference[row]["input_ids"]), 300) for row in rows]
        assert item["input_ids"].tolist() == expected_ids and item["input_ids"].dtype == np.int32
        assert item["loss_mask"].tolist() == expected_mask and len(expected_ids) <= 300
        assert item["labels"].tolist() == [t if m else -100 for t, m in zip(expected_ids, expected_mask, strict=True)]
        assert item["position_ids"].tolist() == [p for n in lengths for p in range(n)]
        assert item["seq_lengths"].tolist() == lengths
        assert item["cu_seqlens"].tolist() == np.concatenate(([0], np.cumsum(lengths))).tolist()
        assert item["row_ids"].tolist() == rows
    single = next(i for i in range(len(packed)) if len(packed.index.bin(i)) == 1)
    assert not packed[single]["input_ids"].flags.owndata  # one row: a view of the mapped Arrow buffer
    clone = pickle.loads(pickle.dumps(packed))
    assert len(pickle.dumps(packed)) < 1000 and clone[3]["input_ids"].tolist() == packed[3]["input_ids"].tolist()


def test_the_index_is_the_same_bytes_every_time(cache_path, tmp_path):
    options = {"length": 512, "data_parallel": 4}
    first = pack_cache(cache_path, PackOptions(**options, index_dir=str(tmp_path / "a")))
    second = pack_cache(cache_path, PackOptions(**options, index_dir=str(tmp_path / "b")))
    assert first.path != second.path
    for name in ("rows.npy", "bins.npy", "index.json"):
        assert (first.path / name).read_bytes() == (second.path / name).read_bytes()
    assert set(os.listdir(first.path)) == {"rows.npy", "bins.npy", "index.json", "build.json"}


def test_a_valid_index_is_reused_and_a_damaged_one_rebuilt(cache_path, tmp_path):
    options = PackOptions(length=512, index_dir=str(tmp_path))
    built = pack_cache(cache_path, options)
    assert built.built_now and not pack_cache(cache_path, options).built_now
    expected = built.rows.tolist()
    del built.rows  # the damage below rewrites the file this array maps
    rows_file = built.path / "rows.npy"
    rows_file.write_bytes(rows_file.read_bytes()[:-8])
    rebuilt = pack_cache(cache_path, options)
    assert rebuilt.built_now and rebuilt.rows.tolist() == expected
    assert sorted(p.name for p in built.path.parent.iterdir()) == [options.key, f"{options.key}.lock"]


def sft_lengths(rows: int, seed: int) -> np.ndarray:
    """Lengths shaped like chat SFT data: log-normal around 600 tokens, 20 to 16k."""
    return np.clip(np.random.default_rng(seed).lognormal(6.4, 0.9, rows), 20, 16_000).astype(np.int64)


@pytest.mark.parametrize("length", [4096, 8192])
def test_eight_ranks_get_as_many_bins_and_near_equal_tokens_each_step(length):
    lengths = sft_lengths(50_000, seed=length)
    rows, bins, stats = plan(lengths, PackOptions(length=length, data_parallel=8))
    tokens = np.array([np.minimum(lengths[rows[bins[b]:bins[b + 1]]], length).sum() for b in range(len(bins) - 1)])
    steps = tokens.reshape(-1, 8)  # bin s*8 + r is rank r's bin at step s
    assert ((steps.max(axis=1) - steps.min(axis=1)) / steps.max(axis=1)).max() <= 0.01
    assert stats["balance"]["step_spread_max"] <= 0.01 and stats["efficiency"] > 0.99


def test_the_sampler_gives_each_rank_one_bin_per_step(cache_path, tmp_path):
    packed = open_cache(cache_path).packed(512, data_parallel=4, index_dir=str(tmp_path))
    samplers = [PackedSampler(packed, rank=r, seed=7) for r in range(4)]
    epoch0 = [list(s) for s in samplers]
    assert all(len(order) == len(s) == packed.steps for order, s in zip(epoch0, samplers, strict=True))
    assert sorted(i for order in epoch0 for i in order) == list(range(len(packed)))
    assert all(i // 4 == j // 4 for i, j in zip(epoch0[0], epoch0[3], strict=True))  # same step on every rank
    assert packed.global_order(0, seed=7) == [order[s] for s in range(packed.steps) for order in epoch0]
    for sampler in samplers:
        sampler.set_epoch(1)
    assert [list(s) for s in samplers] != epoch0
    with pytest.raises(ValueError, match="rank 4 out of range"):
        PackedSampler(packed, rank=4)


@pytest.mark.usefixtures("trainers_extra")
def test_trls_padding_free_collator_reads_the_packed_sequences(cache_path, tmp_path):
    sft_trainer = pytest.importorskip("trl.trainer.sft_trainer")
    packed = open_cache(cache_path).packed(512, data_parallel=2, index_dir=str(tmp_path))
    stream = packed.iterable_dataset(epochs=1, seed=3)
    collate = sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    expected = packed.ordered(epochs=1, seed=3)
    for i, example in zip(range(4), stream, strict=False):
        batch = collate([example])
        ours = expected[i]
        assert batch["input_ids"][0].tolist() == ours["input_ids"].tolist()
        assert batch["position_ids"][0].tolist() == ours["position_ids"].tolist()
        assert batch["cu_seq_lens_q"].tolist() == ours["cu_seqlens"].tolist()
        trained = ours["labels"].copy()
        trained[ours["position_ids"] == 0] = -100  # TRL never trains a row's first token
        assert batch["labels"][0].tolist() == trained.tolist()


@contextmanager
def read_only(*directories: Path):
    """Directories this process cannot write into: mode 555, or for root (whom modes do not stop) the
    immutable attribute."""
    if os.geteuid() != 0:
        for directory in directories:
            directory.chmod(0o555)
        try:
            yield
        finally:
            for directory in directories:
                directory.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", *map(str, directories)]).returncode:
        pytest.skip("running as root on a filesystem without chattr +i: no way to make a read-only directory")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, directories)], check=True)


def test_pack_and_inspect_from_the_command_line(cache_path, tmp_path, cli_home):
    index_dir, home = str(tmp_path / "indexes"), cli_home
    result = cli("pack", str(cache_path), "--length", "512", "--data-parallel", "2", "--index-dir", index_dir,
                 home=home)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path == index_path(cache_path, PackOptions(length=512, data_parallel=2, index_dir=index_dir))
    meta = json.loads((path / "index.json").read_text())
    assert f"efficiency      {meta['efficiency']:.2%}" in result.stdout and "built           now" in result.stdout
    shown = cli("inspect", str(cache_path), "--index-dir", index_dir, home=home)
    assert shown.returncode == 0 and f"packing index   {path}" in shown.stdout
    assert f"{meta['bins']} ({meta['steps']} steps of 2)" in shown.stdout and "build time" in shown.stdout
    as_json = json.loads(cli("inspect", str(cache_path), "--json", "--index-dir", index_dir, home=home).stdout)
    assert as_json["rows"] == 240 and as_json["packing"][0]["bins"] == meta["bins"]
    missing = cli("pack", str(tmp_path / "nowhere"), "--length", "512", home=home)
    assert missing.returncode == 2 and missing.stderr.startswith("sft-tokenize: error: ")
    assert "not a published cache" in missing.stderr and "Traceback" not in missing.stderr


def test_a_read_only_cache_root_needs_an_index_dir(cache_path, tmp_path, cli_home):
    cache = Path(shutil.copytree(cache_path, tmp_path / "cache" / cache_path.name))
    before, home = snapshot(cache), cli_home
    with read_only(cache.parent, cache):
        refused = cli("pack", str(cache), "--length", "512", home=home)
        assert refused.returncode == 2, refused.stderr
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"sft-tokenize: error: {cache.parent / '.packing' / cache.name}: cannot write")
        assert "--index-dir" in last and "Traceback" not in refused.stderr
        written = cli("pack", str(cache), "--length", "512", "--index-dir", str(tmp_path / "indexes"), home=home)
        assert written.returncode == 0, written.stderr
        assert Path(written.stdout.strip().splitlines()[-1]).parent.parent == tmp_path / "indexes"
        assert open_cache(cache).packed(512, index_dir=str(tmp_path / "indexes")).index.built_now is False
    assert snapshot(cache) == before and not (cache.parent / ".packing").exists()
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(BadInput, match="choose a writable --index-dir"):
        pack_cache(cache_path, PackOptions(length=512, index_dir=str(tmp_path / "file" / "sub")))


@pytest.mark.usefixtures("cli_home")  # `sft-tokenize pack` in subprocesses
def test_concurrent_packs_publish_one_index(cache_path, tmp_path):
    args = [str(BIN / "sft-tokenize"), "pack", str(cache_path), "--length", "384", "--data-parallel", "2",
            "--index-dir", str(tmp_path)]
    runs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0] * 4, [err for _, err in outputs]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1
    assert sum("built           now" in out for out, _ in outputs) == 1
    (path,) = paths
    assert sorted(os.listdir(Path(path).parent)) == ["n384-r2-bfd", "n384-r2-bfd.lock"]


@pytest.mark.usefixtures("prefect_harness")
def test_the_flow_packs_after_publishing_and_reports_the_index(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from sft_tokenize.flows.tokenize_dataset import TokenizeRun, tokenize_dataset

    options = TokenizeRun(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path),
                          workers=1, pack={"length": 512, "data_parallel": 2})
    state = tokenize_dataset(options, return_state=True)
    assert state.is_completed()
    path = index_path(state.result(), options.pack)
    meta = json.loads((path / "index.json").read_text())
    artifact_filter = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        tables = [a.data for a in client.read_artifacts(artifact_filter=artifact_filter) if a.type == "markdown"]
    packing = next(table for table in tables if "Packing index n512-r2-bfd" in table)
    assert f"| efficiency | {meta['efficiency']:.2%}" in packing and str(path) in packing
    form = tokenize_dataset.parameters.definitions  # a typed form in the UI, with the packing options
    assert {"length", "data_parallel", "algorithm", "index_dir"} == set(form["PackOptions"]["properties"])
