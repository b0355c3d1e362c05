"""What a max_length or packing length costs: the table equals a direct count over the rows, and its packing
column equals the bins of a packing index built at that length."""

from __future__ import annotations

import numpy as np
import pytest
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.read import length_costs as length_costs_module
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.length_costs import candidate_lengths, length_costs, log_histogram
from sft_tokenize.read.packing_index import PackOptions, pack_cache

AT = (48, 100, 128, 256)


@pytest.fixture(scope="module", params=["skyrl", "trl"])
def cache(request, tmp_path_factory):
    """The bundled example (240 rows of 28 to 478 tokens), with a loss_mask (skyrl) or labels (trl)."""
    return open_cache(run_locally(TokenizeOptions(
        sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER), layout=request.param,
        cache_dir=str(tmp_path_factory.mktemp("cache")), shard_size="60KB")))


def direct_count(rows, length: int, truncation: str = "truncate") -> dict[str, int]:
    """Row by row, in plain Python: what training at `length` loses."""
    out = {"rows_truncated": 0, "rows_dropped": 0, "tokens_lost": 0, "trained_tokens_lost": 0}
    for i in range(len(rows)):
        row = rows[i]
        trained = row["loss_mask"] == 1 if "loss_mask" in row else row["labels"] != -100
        n, total = len(row["input_ids"]), int(trained.sum())
        if n <= length:
            continue
        if truncation == "drop" or not trained[:length].any():
            out["rows_dropped"] += 1
            out["tokens_lost"] += n
            out["trained_tokens_lost"] += total
        else:
            out["rows_truncated"] += 1
            out["tokens_lost"] += n - length
            out["trained_tokens_lost"] += total - int(trained[:length].sum())
    return out


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
@pytest.mark.parametrize("run_tokens", [length_costs_module.CHUNK_TOKENS, 100])
def test_the_table_equals_a_direct_count(cache, truncation, run_tokens, monkeypatch):
    """Whole record batches a pass, and runs of about 100 mask values: batches cut between rows, rows longer
    than a run alone in theirs."""
    monkeypatch.setattr(length_costs_module, "CHUNK_TOKENS", run_tokens)
    report = length_costs(cache.table, at=AT, truncation=truncation, pack=False)
    assert [c["length"] for c in report["candidates"]] == [*AT, 512]  # the longest row (478) fits in 512
    for candidate in report["candidates"]:
        expected = direct_count(cache, candidate["length"], truncation)
        assert {k: candidate[k] for k in expected} == expected, candidate["length"]
    assert report["candidates"][0]["trained_tokens_lost"] > 0  # the example has trained tokens past 48
    assert report["candidates"][-1]["tokens_lost"] == 0


def test_a_slice_of_the_table_counts_its_own_rows(cache, monkeypatch):
    """A table that starts inside a record batch (a slice's list offsets do not start at 0)."""
    monkeypatch.setattr(length_costs_module, "CHUNK_TOKENS", 100)
    whole = length_costs_module.row_tokens(cache.table, [128])
    part = length_costs_module.row_tokens(cache.table.slice(7, 150), [128])
    assert np.array_equal(part.lengths, whole.lengths[7:157]) and np.array_equal(part.trained, whole.trained[7:157])
    assert np.array_equal(part.within[128], whole.within[128][7:157])


def test_some_row_is_truncated_away_at_a_short_length(cache):
    """At 48 tokens, rows whose first trained token comes later lose all of it: dropped, not truncated."""
    at_48 = length_costs(cache.table, at=[48], pack=False)["candidates"][0]
    assert at_48["rows_dropped"] > 0 and at_48["rows_truncated"] > 0


def test_the_packing_column_equals_the_bins_of_a_packing_index(cache, tmp_path):
    report = length_costs(cache.table, at=[256])
    for candidate in report["candidates"]:
        index = pack_cache(cache, PackOptions(length=candidate["length"], index_dir=str(tmp_path)))
        assert candidate["pack_bins"] == len(index) == index.meta["bins"]
        assert candidate["pack_fill"] == index.meta["efficiency"]


def test_the_histograms_add_up_to_the_rows(cache):
    report = length_costs(cache.table, pack=False)
    for name in ("lengths_histogram", "trained_histogram"):
        bins = report[name]
        assert sum(count for _, _, count in bins) == len(cache) == report["rows"]
        assert all(low < high for low, high, _ in bins)
        assert all(bins[i][1] == bins[i + 1][0] for i in range(len(bins) - 1))  # contiguous
    lengths = cache.lengths
    assert report["lengths_histogram"][0][0] <= lengths.min() < report["lengths_histogram"][0][1]
    assert report["lengths_histogram"][-1][0] <= lengths.max() < report["lengths_histogram"][-1][1]


def test_log_bins_count_each_value_once_including_edges_and_zeros():
    values = np.array([0, 1, 2, 3, 4, 1000, 1024, 1448, 1449, 70000])
    bins = log_histogram(values)
    assert sum(c for _, _, c in bins) == len(values)
    for value in values:
        assert sum(1 for low, high, _ in bins if low <= value < high) == 1


def test_candidates_are_powers_of_two_from_512_to_the_longest_row_plus_those_asked():
    assert candidate_lengths(478) == [512]
    assert candidate_lengths(513) == [512, 1024]
    assert candidate_lengths(5000, extra=[3000]) == [512, 1024, 2048, 3000, 4096, 8192]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """The example's two files as two caches, mixed 50/50 with the second capped at 2 epochs."""
    from sft_tokenize.read.mixed_rows import open_mixture
    from sft_tokenize.read.mixture_index import mix_caches
    from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSource

    root = tmp_path_factory.mktemp("mixture")
    caches = [run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA / f"chat-0000{i}.jsonl")], name=f"part{i}",
                                          tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(root))) for i in (0, 1)]
    index = mix_caches(MixtureOptions(budget=60_000, sources=[MixtureSource(cache=str(caches[0]), weight=0.5),
                                                              MixtureSource(cache=str(caches[1]), weight=0.5,
                                                                            max_epochs=2)]))
    return open_mixture(index.path)


def test_a_mixtures_table_counts_its_rows_as_a_trainer_sees_them_and_each_source_apart(mixture, tmp_path):
    from sft_tokenize.read.length_costs import mixture_costs

    m = mixture
    report = mixture_costs([c.table for c in m.caches], m.index.sources, m.index.rows, m.index.meta, at=[128, 256])
    assert report["rows"] == len(m) and sum(c for *_, c in report["lengths_histogram"]) == len(m)
    for k, candidate in enumerate(report["candidates"]):
        n = candidate["length"]
        expected = direct_count(m, n)
        assert {key: candidate[key] for key in expected} == expected
        for s, source in enumerate(report["sources"]):
            rows = [m[i] for i in range(len(m)) if m.locate(i)[0] == s]
            mine = direct_count(rows, n)
            assert {key: source["candidates"][k][key] for key in mine} == mine
        index = pack_cache(m, PackOptions(length=n, index_dir=str(tmp_path)))
        assert candidate["pack_bins"] == len(index)
    part1 = report["sources"][1]
    assert part1["epochs"] == 2 and part1["caps"]["capped_by"] == "max_epochs"
    assert report["candidates"][0]["trained_tokens_lost"] == sum(
        s["candidates"][0]["trained_tokens_lost"] for s in report["sources"])
