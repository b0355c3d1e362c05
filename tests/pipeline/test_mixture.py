"""Mixture indexes over three real caches in three formats: token shares, prefixes, epochs, determinism, and
that re-weighting re-tokenizes nothing."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.caches import published_inodes
from support.data import tool_chat, write_jsonl
from support.families import build_modern_tokenizer

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import BadInput
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.mixed_rows import open_mixture
from sft_tokenize.read.mixture_index import mix_caches
from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSource
from sft_tokenize.read.mixture_selection import trained_lengths
from sft_tokenize.read.trainers import mixture_dataset

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _text(rng: np.random.Generator, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(low, high))))


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, str]:
    """Three sources: chat JSONL with a tools column, alpaca Parquet, ShareGPT JSON; one cache each."""
    root = tmp_path_factory.mktemp("mixture")
    tokenizer = build_modern_tokenizer("qwen2.5", root / "tokenizer")  # a template that renders tools
    rng = np.random.default_rng(7)
    chat = [tool_chat('{"city": "Oslo"}', "Oslo", f"{h}:00") if h % 3 == 0 else
            {"messages": [{"role": "user", "content": _text(rng, 3, 30)},
                          {"role": "assistant", "content": _text(rng, 5, 80)}]} for h in range(300)]
    write_jsonl(root / "chat.jsonl", chat)
    alpaca = pa.table({"instruction": [_text(rng, 3, 20) for _ in range(200)],
                       "input": ["" if i % 2 else _text(rng, 2, 10) for i in range(200)],
                       "output": [_text(rng, 10, 120) for _ in range(200)]})
    pq.write_table(alpaca, root / "alpaca.parquet")
    sharegpt = [{"conversations": [{"from": "human", "value": _text(rng, 3, 15)},
                                   {"from": "gpt", "value": _text(rng, 20, 60)}]} for _ in range(40)]
    (root / "gold.json").write_text(json.dumps(sharegpt))
    out = {}
    for name, source, fmt in [("chat", "chat.jsonl", "chat"), ("alpaca", "alpaca.parquet", "alpaca"),
                              ("gold", "gold.json", "chat")]:
        options = TokenizeOptions(sources=[str(root / source)], tokenizer=str(tokenizer),
                                  cache_dir=str(root / "caches"), name=name, format=fmt)
        out[name] = str(run_locally(options))
    return out


def _mixture(caches, unit="trained_tokens", budget=None, seed=0, order="interleave", **amounts):
    return MixtureOptions(sources=[MixtureSource(cache=caches[name], **amount) for name, amount in amounts.items()],
                          unit=unit, budget=budget, seed=seed, order=order)


def _units(caches, index, unit):
    per_source = [trained_lengths(open_cache(caches[n])) if unit == "trained_tokens" else
                  open_cache(caches[n]).lengths.astype(np.int64) for n in ("chat", "alpaca", "gold")]
    return np.array([per_source[s][r] for s, r in zip(index.sources, index.rows, strict=True)])


def test_token_weights_are_met_within_a_row_and_every_percent_prefix_keeps_them(caches):
    total = sum(int(trained_lengths(open_cache(c)).sum()) for c in caches.values())
    budget = 50 * total  # enough rows that 1 % of the index is a few hundred rows
    options = _mixture(caches, budget=budget, chat={"weight": 0.5}, alpaca={"weight": 0.3}, gold={"weight": 0.2})
    index = mix_caches(options)
    units = _units(caches, index, "trained_tokens")
    longest = max(int(trained_lengths(open_cache(c)).max()) for c in caches.values())
    weights = np.array([0.5, 0.3, 0.2])
    achieved = np.array([units[index.sources == s].sum() for s in range(3)])
    assert np.all(np.abs(achieved - weights * budget) <= longest)
    assert [s["trained_tokens"] for s in index.meta["sources"]] == achieved.tolist()
    per_source = np.stack([np.cumsum(np.where(index.sources == s, units, 0)) for s in range(3)])
    for percent in range(1, 101):
        k = len(units) * percent // 100 - 1
        shares = per_source[:, k] / per_source[:, k].sum()
        assert np.abs(shares - weights).max() <= 0.01, (percent, shares)


def test_two_and_a_half_epochs_see_every_row_two_or_three_times_half_of_them_three(caches):
    index = mix_caches(_mixture(caches, unit="rows", gold={"epochs": 2.5}))
    counts = np.bincount(np.asarray(index.rows), minlength=40)
    assert set(counts.tolist()) == {2, 3}
    assert (counts == 3).sum() == 20
    assert index.meta["sources"][0]["times_seen"] == {"min": 2, "max": 3}


def test_the_same_mixture_gives_the_same_bytes_and_another_seed_another_order(caches, tmp_path):
    amounts = {"chat": {"weight": 0.6}, "alpaca": {"weight": 0.4}}
    first = mix_caches(_mixture(caches, unit="tokens", budget=40_000, **amounts))
    again = mix_caches(_mixture(caches, unit="tokens", budget=40_000, **amounts).model_copy(
        update={"index_dir": str(tmp_path)}))
    assert not first.built_now or again.built_now
    for name in ("sources.npy", "rows.npy"):
        assert (first.path / name).read_bytes() == (again.path / name).read_bytes()
    other = mix_caches(_mixture(caches, unit="tokens", budget=40_000, seed=1, **amounts))
    assert other.path != first.path
    assert not np.array_equal(other.rows, first.rows)
    counted = {"chat": {"epochs": 1.5}, "gold": {"rows": 100}}  # counts that no seed changes
    a, b = mix_caches(_mixture(caches, unit="rows", **counted)), mix_caches(_mixture(caches, unit="rows", seed=5,
                                                                                    **counted))
    assert not np.array_equal(a.rows, b.rows)
    for s in (0, 1):  # the same number of rows seen once, twice ... per source; other rows
        assert sorted(np.bincount(a.rows[a.sources == s])) == sorted(np.bincount(b.rows[b.sources == s]))
        assert (a.sources == s).sum() == (b.sources == s).sum()


def test_a_shuffled_order_holds_the_interleaved_rows(caches):
    amounts = {"chat": {"weight": 0.5}, "alpaca": {"weight": 0.5}}
    interleaved = mix_caches(_mixture(caches, budget=20_000, **amounts))
    shuffled = mix_caches(_mixture(caches, budget=20_000, order="shuffle", **amounts))
    pairs = lambda i: sorted(zip(i.sources.tolist(), i.rows.tolist(), strict=True))  # noqa: E731
    assert pairs(interleaved) == pairs(shuffled)
    assert not np.array_equal(interleaved.sources, shuffled.sources)


def test_reweighting_rebuilds_the_index_and_leaves_the_caches_alone(caches):
    before = {name: published_inodes(open_cache(path).path) for name, path in caches.items()}
    a = mix_caches(_mixture(caches, budget=30_000, chat={"weight": 0.7}, alpaca={"weight": 0.3}))
    b = mix_caches(_mixture(caches, budget=30_000, chat={"weight": 0.2}, alpaca={"weight": 0.8}))
    assert a.path != b.path and b.built_now
    assert {name: published_inodes(open_cache(path).path) for name, path in caches.items()} == before


def test_mixed_rows_are_the_sources_rows_and_pickle_as_a_path(caches):
    index = mix_caches(_mixture(caches, budget=10_000, chat={"weight": 0.5}, gold={"weight": 0.5}))
    mixed = open_mixture(index.path)
    names = ["chat", "gold"]
    for i in (0, 1, len(mixed) // 2, len(mixed) - 1):
        expected = open_cache(caches[names[int(index.sources[i])]])[int(index.rows[i])]
        assert {k: v.tolist() for k, v in mixed[i].items()} == {k: v.tolist() for k, v in expected.items()}
    assert len(pickle.dumps(mixed)) < 1000
    assert pickle.loads(pickle.dumps(mixed))[3]["input_ids"].tolist() == mixed[3]["input_ids"].tolist()
    dataset = mixture_dataset(index.path)
    assert len(dataset) == len(mixed)
    assert dataset[len(mixed) // 2]["input_ids"] == mixed[len(mixed) // 2]["input_ids"].tolist()


def test_bad_mixtures_name_the_key(caches):
    with pytest.raises(ValueError, match="add up to 1.1"):
        _mixture(caches, budget=100, chat={"weight": 0.6}, alpaca={"weight": 0.5})
    with pytest.raises(ValueError, match="budget: a source has a weight"):
        _mixture(caches, chat={"weight": 1.0})
    with pytest.raises(ValueError, match="exactly one of"):
        MixtureSource(cache=caches["chat"], weight=0.5, epochs=2)
    with pytest.raises(BadInput, match="nothing is left for the weighted sources"):
        mix_caches(_mixture(caches, budget=10, chat={"weight": 1.0}, gold={"epochs": 1}))


def test_trained_lengths_count_each_rows_trained_tokens(caches):
    cache = open_cache(caches["chat"])
    assert trained_lengths(cache).tolist() == [int(cache[i]["loss_mask"].sum()) for i in range(len(cache))]


def test_a_mixture_packs_like_a_cache_over_its_mixed_rows(caches, tmp_path):
    from sft_tokenize.read.packing_index import PackOptions, pack_cache

    index = mix_caches(_mixture(caches, budget=20_000, chat={"weight": 0.5}, alpaca={"weight": 0.5}))
    mixed = open_mixture(index.path)
    packing = pack_cache(index.path, PackOptions(length=512))
    assert packing.path.parent.parent == index.path.parent / ".packing"
    assert sorted(np.asarray(packing.rows).tolist()) == list(range(len(mixed)))  # every mixed row, once
    packed = mixed.packed(512)
    for i in (0, len(packed) // 2, len(packed) - 1):
        item, rows = packed[i], packing.bin(i).tolist()
        expected = np.concatenate([mixed[r]["input_ids"][:512] for r in rows])
        assert item["input_ids"].tolist() == expected.tolist() and len(expected) <= 512
        assert item["row_ids"].tolist() == rows
    assert pickle.loads(pickle.dumps(packed))[0]["input_ids"].tolist() == packed[0]["input_ids"].tolist()


@pytest.mark.parametrize("amounts, unit, budget, expected", [
    ({"gold": {"epochs": 1000}}, "rows", None, r"source gold-\w+ \(epochs 1000\) would make a mixture index of "
                                               r"about 40,000 rows \(640 kB on disk, 3.8 MB of memory to build it\)"),
    ({"chat": {"rows": 10}, "gold": {"tokens": 10**7}}, "tokens", None,
     r"source gold-\w+ \(tokens 10,000,000\) would make a mixture index of about [\d,]+ rows \(.*, [\d,]+ of them "
     r"its own\)"),
    ({"chat": {"weight": 0.5}, "alpaca": {"weight": 0.5}}, "rows", 50_000,
     r"source chat-\w+ \(weight 0.5\) would make a mixture index of about 50,000 rows \(.*, 25,000 of them its own\)"),
])
def test_an_amount_too_large_for_the_index_is_refused_before_it_is_built(caches, tmp_path, amounts, unit, budget,
                                                                        expected):
    options = _mixture(caches, unit=unit, budget=budget, **amounts).model_copy(
        update={"max_index_rows": 10_000, "index_dir": str(tmp_path / "indexes")})
    with pytest.raises(BadInput, match=f"^{expected}, over the bound of 10,000 rows \\(the mixture's max_index_rows"):
        mix_caches(options)
    assert not (tmp_path / "indexes").exists()  # nothing written, not even a lock


def test_epochs_that_are_not_finite_are_refused_by_name():
    with pytest.raises(ValueError, match="epochs\n  Input should be a finite number"):
        MixtureSource(cache="a", name="gold", epochs=float("inf"))


def test_shares_far_from_the_weights_are_warned_about_in_the_index_and_its_summary(caches, caplog):
    from sft_tokenize.flows.report import mixture_summary
    from sft_tokenize.read.mixture_selection import SHARE_TOLERANCE

    amounts = {"chat": {"weight": 0.5}, "gold": {"weight": 0.5}}
    small = mix_caches(_mixture(caches, budget=60, **amounts))  # a row or two each: far from 50/50
    warnings = small.meta["warnings"]
    shares = [s["share"] for s in small.meta["sources"]]
    assert abs(shares[0] - 0.5) > SHARE_TOLERANCE and len(warnings) == 2
    names = [s["name"] for s in small.meta["sources"]]
    for name, share, warning in zip(names, shares, warnings, strict=True):
        assert warning.startswith(f"source {name}: asked weight 0.5, achieved {share:.1%} of the weighted sources' "
                                  "trained_tokens")
        assert "the budget (60 trained_tokens) is small against whole rows" in warning
    assert [text for key, text in mixture_summary(small.meta) if key == "warning"] == warnings
    caplog.clear()
    with caplog.at_level("WARNING", logger="sft_tokenize"):
        again = mix_caches(_mixture(caches, budget=60, **amounts))  # found, not built: still said
    assert not again.built_now and [r.getMessage() for r in caplog.records] == [
        f"mixture {again.meta['key']}: {warning}" for warning in warnings]
    assert mix_caches(_mixture(caches, budget=20_000, **amounts)).meta["warnings"] == []


def _trained_total(caches, name) -> int:
    return int(trained_lengths(open_cache(caches[name])).sum())


def test_max_epochs_caps_a_weight_and_the_other_weighted_source_fills_the_budget(caches):
    """gold's weight would repeat it 10 times; max_epochs 3 gives it 3 epochs, and chat takes the rest."""
    from sft_tokenize.flows.report import mixture_summary

    budget = 20 * _trained_total(caches, "gold")
    index = mix_caches(_mixture(caches, budget=budget, chat={"weight": 0.5},
                                gold={"weight": 0.5, "max_epochs": 3}))
    chat, gold = index.meta["sources"]
    assert gold["epochs"] == 3 and gold["times_seen"] == {"min": 3, "max": 3}
    assert gold["caps"] == {"max_epochs": 3, "capped_by": "max_epochs",
                            "planned_share": round(3 * _trained_total(caches, "gold") / budget, 6)}
    assert "caps" not in chat
    achieved = chat["trained_tokens"] + gold["trained_tokens"]
    assert budget <= achieved < budget + int(trained_lengths(open_cache(caches["chat"])).max())
    assert chat["share"] > 0.8  # 17 of the 20 parts went to chat
    assert index.meta["warnings"] == []
    (text,) = [text for key, text in mixture_summary(index.meta) if key == gold["name"]]
    assert text.startswith("asked weight 0.5 (max_epochs 3: capped by max_epochs, planned share 15.0%); "
                           "achieved 120 rows")


def test_max_share_caps_a_weight_at_its_share_of_the_budget(caches):
    budget = 20_000
    index = mix_caches(_mixture(caches, budget=budget, chat={"weight": 0.8, "max_share": 0.5},
                                alpaca={"weight": 0.2}))
    chat, alpaca = index.meta["sources"]
    assert chat["caps"]["capped_by"] == "max_share" and chat["caps"]["planned_share"] == 0.5
    assert abs(chat["share"] - 0.5) < 0.01 and abs(alpaca["share"] - 0.5) < 0.01
    unbounded = mix_caches(_mixture(caches, budget=budget, chat={"weight": 0.8, "max_share": 0.9},
                                    alpaca={"weight": 0.2}))
    assert unbounded.meta["sources"][0]["caps"]["capped_by"] is None
    assert abs(unbounded.meta["sources"][0]["share"] - 0.8) < 0.01  # a cap not reached changes nothing
    uncapped = mix_caches(_mixture(caches, budget=budget, chat={"weight": 0.8}, alpaca={"weight": 0.2}))
    assert np.array_equal(unbounded.rows, uncapped.rows) and np.array_equal(unbounded.sources, uncapped.sources)


def test_caps_that_cannot_fill_the_budget_say_so(caches):
    budget = 100 * _trained_total(caches, "gold")
    index = mix_caches(_mixture(caches, budget=budget, gold={"weight": 1.0, "max_epochs": 2}))
    (gold,) = index.meta["sources"]
    assert gold["epochs"] == 2
    (warning,) = index.meta["warnings"]
    assert warning.startswith(f"every weighted source is capped ({gold['name']} (max_epochs 2)): they take "
                              f"{2 * _trained_total(caches, 'gold'):,} of the {budget:,} trained_tokens")
    assert warning.endswith("the mixture is that much smaller")


def test_caps_belong_to_weights():
    with pytest.raises(ValueError, match="max_epochs limits what a weight takes; this source asks for epochs"):
        MixtureSource(cache="c", name="gold", epochs=2, max_epochs=3)
    with pytest.raises(ValueError, match="less than or equal to 1"):
        MixtureSource(cache="c", weight=0.5, max_share=1.5)


def test_a_recipe_passes_its_sources_caps_to_the_mixture(caches, tmp_path):
    from sft_tokenize.build.recipe import Recipe

    recipe = Recipe(tokenizer="t", cache_dir=str(tmp_path), mixture={"budget": 1000},
                    sources=[{"name": "chat", "sources": ["a.jsonl"], "weight": 0.5},
                             {"name": "gold", "sources": ["b.jsonl"], "weight": 0.5, "max_epochs": 3}])
    options = recipe.mixture_options([caches["chat"], caches["gold"]])
    assert [s.caps for s in options.sources] == [{}, {"max_epochs": 3}]
    assert recipe.runs()[1].name == "gold"  # a cap is not a run option
