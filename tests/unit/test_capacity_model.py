"""docs/scale-out.md's capacity table is the model's (benchmarks/capacity.py), and the model says what it should
where the answer is known without it."""

from __future__ import annotations

import functools

from support.paths import ROOT, file_module


@functools.cache
def capacity():
    return file_module(ROOT / "benchmarks" / "capacity.py", "capacity_model")


def test_the_documented_table_is_the_models():
    assert capacity().table() in (ROOT / "docs" / "scale-out.md").read_text()


def test_the_model_scales_with_the_cores_and_names_what_limits_it():
    model = capacity()
    one, many = model.predict(1e12, 1), model.predict(1e12, 64)
    assert one["limit"] == many["limit"] == "tokenizing"
    assert 50 < one["wall_seconds"] / many["wall_seconds"] <= 64
    # 1B tokens in 256 MB slices: 14 slices, whatever the cores; smaller slices use them.
    few = model.predict(1e9, 8)
    assert few["slices"] == 14 and few["limit"] == "too few slices for the cores"
    assert model.predict(1e9, 8, model.recommended_slice(1e9, 8 * 16))["wall_seconds"] < few["wall_seconds"] / 3
    # Tiny slices, a task each, on one server: the server is the limit.
    assert model.predict(1e9, 64, 10**5)["limit"] == "the Prefect server"
