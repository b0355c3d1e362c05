"""A batch's loss mask found in bytes, all rows at once, equals the one HF's character offsets give row by row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.families import build_swallowing_sep_tokenizer

from sft_tokenize.encoding.exact import choose_encoder
from sft_tokenize.encoding.token_mask import encoding_spans, flat_mask, joined_regions, trained_regions
from sft_tokenize.encoding.tokenizer import load_tokenizer

pytest.importorskip("fastokens")  # the `fast` extra; `make test` installs it


@pytest.fixture(scope="module")
def tokenizer_and_fast(tmp_path_factory):
    """The example tokenizer with an added token that swallows the spaces around it: a row holding it is one
    the fast encoder cannot place (its ids cover fewer bytes than the text), so batches mix placed rows and not."""
    tokenizer = load_tokenizer(build_swallowing_sep_tokenizer(tmp_path_factory.mktemp("sep-tokenizer")))
    fast = choose_encoder(tokenizer, "fastokens")
    assert fast is not None
    return tokenizer, fast


# ASCII (words the vocabulary holds whole), two-, three- and four-byte characters, a combining mark, whitespace
PIECES = st.sampled_from(["a", "b ", " ", "é", "中", "😀", "e\u0301", "\u0301", "\n", "  ", "ñ", " the", " world", "'s",
                          "<sep>", " <sep> "])
TEXTS = st.lists(PIECES, max_size=25).map("".join)


def _row(text: str):
    spans = st.tuples(st.integers(0, len(text)), st.integers(0, len(text)))
    return st.tuples(st.just(text), st.lists(spans, max_size=5))  # any order, overlapping, empty


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(TEXTS.flatmap(_row), min_size=1, max_size=8))
@example(rows=[(" the world", [(1, 2), (3, 4), (6, 7)]), ("x <sep> y", [(0, 1)]), ("中 the", [(0, 1), (3, 4)])])
def test_a_batchs_mask_in_bytes_is_hfs_row_by_row(tokenizer_and_fast, rows):
    """The example: two spans in one token (\" the\"), a row not placed between two that are."""
    tokenizer, fast = tokenizer_and_fast
    placement = fast.encode_flat([text for text, _ in rows], add_special_tokens=False)
    placed = np.flatnonzero(placement.placed).tolist()
    mask, straddling = flat_mask([rows[k][1] for k in placed], placement.kept())
    want_ids, want_mask, want_straddling, position = [], [], [], 0
    for k, (text, regions) in enumerate(rows):
        enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        row = placement.row(k)
        if k not in placed:
            assert row is None
            continue
        assert row.ids == list(enc.ids)
        assert row.offsets == [tuple(o) for o in enc.offsets]
        spans, across = encoding_spans(enc, regions, len(text))
        trained = np.zeros(len(enc.ids), dtype=np.int8)
        for first, stop in spans:
            trained[first:stop] = 1
        want_ids += enc.ids
        want_mask += trained.tolist()
        want_straddling += [position + token for token in across]
        position += len(enc.ids)
    assert placement.kept().ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    assert straddling.tolist() == want_straddling
    assert [r.offsets if r else None for r in placement.rows()] == [
        r.offsets if r else None for r in (placement.row(k) for k in range(len(rows)))]


@settings(max_examples=300, deadline=None)
@given(row_regions=st.lists(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=6), max_size=6))
def test_every_rows_spans_are_joined_as_one_rows_are(row_regions):
    rows, begins, ends = joined_regions(row_regions)
    assert [[(b, e) for r, b, e in zip(rows.tolist(), begins.tolist(), ends.tolist(), strict=True) if r == k]
            for k in range(len(row_regions))] == [trained_regions(regions) for regions in row_regions]
