"""The fast encoder (fastokens) against HF tokenizers: the same ids and masks, refused where it cannot be exact."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.data import COLUMNS, ROWS
from support.families import (
    MODERN_FAMILIES,
    build_modern_tokenizer,
    build_swallowing_sep_tokenizer,
    qwen3_with_generation_blocks,
)
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.exact import EncoderMismatch, choose_encoder
from sft_tokenize.encoding.token_mask import encoding_spans
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.errors import BadInput
from sft_tokenize.sources.conversations import ColumnMap, to_example

pytest.importorskip("fastokens")  # the `fast` extra; `make test` installs it


def both(tokenizer, **options) -> tuple[ChatEncoder, ChatEncoder]:
    fast = choose_encoder(tokenizer, "fastokens")
    assert fast is not None
    return ChatEncoder(tokenizer, MaskSettings(**options)), ChatEncoder(tokenizer, MaskSettings(**options), fast=fast)


def assert_same(hf: ChatEncoder, fast: ChatEncoder, examples) -> None:
    want, got = hf.encode_batch(examples), fast.encode_batch(examples)
    assert np.array_equal(want.input_ids, got.input_ids)
    assert np.array_equal(want.loss_mask, got.loss_mask)
    assert np.array_equal(want.offsets, got.offsets)
    assert [str(o) for o in want.outcomes] == [str(o) for o in got.outcomes]


@pytest.fixture(scope="module")
def modern(modern_tokenizers):
    return modern_tokenizers


@pytest.mark.parametrize("family", sorted(f for f in MODERN_FAMILIES if f != "llama3.3"))
@pytest.mark.parametrize("train_on", ["all_assistant", "last_assistant"])
def test_modern_templates_give_the_same_ids_and_masks(modern, family, train_on):
    hf, fast = both(modern(family), train_on=train_on)
    examples = [to_example(row, COLUMNS) for row in ROWS.values()]
    assert_same(hf, fast, examples)
    assert fast.fast is not None


def test_generation_blocks_overlap_rule_is_the_same(tmp_path):
    tokenizer = load_tokenizer(build_modern_tokenizer("qwen3", tmp_path, qwen3_with_generation_blocks()))
    hf, fast = both(tokenizer)
    assert fast.template.has_generation_blocks
    examples = [to_example(ROWS[name], COLUMNS) for name in ("system_three_turns", "reasoning_field", "tools_object")]
    assert_same(hf, fast, examples)


def test_example_data_is_identical_in_every_mask_mode():
    tokenizer = load_tokenizer(EXAMPLE_TOKENIZER)
    rows = [json.loads(line) for path in sorted(EXAMPLE_DATA.glob("*.jsonl")) for line in path.open()]
    columns = ColumnMap("chat", {"messages": "messages"})
    examples = [to_example(row, columns) for row in rows]
    for options in ({}, {"train_on": "last_assistant"}, {"train_on": "all"}, {"max_length": 64},
                    {"special_text": "keep"}):
        hf, fast = both(tokenizer, **options)
        assert_same(hf, fast, examples)
    text_hf, text_fast = both(tokenizer, train_on="all")
    assert_same(text_hf, text_fast, ["plain text row", "", "x" * 5000, "<|im_end|> inside text"])


CHARS = st.sampled_from(list("ab cé中😀\n\t 0123456789'sX") + ["<|im_start|>", "<|im_end|>", "  ", "\u0301"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(st.lists(CHARS, max_size=40).map("".join), min_size=2, max_size=6),
       special_text=st.sampled_from(["literal", "keep"]))
def test_generated_conversations_are_identical(family_tokenizer, contents, special_text):
    tokenizer = _chatml(family_tokenizer)
    messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    hf, fast = both(tokenizer, special_text=special_text)
    assert_same(hf, fast, [to_example({"messages": messages}, ColumnMap("chat", {"messages": "messages"}))])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8"), max_size=80) | st.lists(CHARS, max_size=60).map("".join))
def test_token_positions_from_byte_lengths_equal_hfs_rule_at_every_character(family_tokenizer, text):
    tokenizer = _chatml(family_tokenizer)
    placed = choose_encoder(tokenizer, "fastokens").encode([text], add_special_tokens=False)[0]
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    if placed is None:  # only text its tokens do not cover byte for byte may fall back
        return
    assert placed.ids == list(enc.ids)
    assert placed.offsets == [tuple(o) for o in enc.offsets]
    # The tokens trained for a span, from the token positions as from HF's Encoding: spans from every character.
    spans = [(a, b) for a in range(len(text)) for b in sorted({a + 1, a + 2, len(text)}) if b <= len(text)]
    assert [encoding_spans(placed, [span], len(text)) for span in spans] == [
        encoding_spans(enc, [span], len(text)) for span in spans]


_loaded = {}


def _chatml(family_tokenizer):
    if "chatml" not in _loaded:
        _loaded["chatml"] = load_tokenizer(family_tokenizer("chatml"))
    return _loaded["chatml"]


@pytest.mark.parametrize("requested", ["auto", "fastokens"])
def test_a_sentencepiece_style_tokenizer_is_refused_with_a_reason_and_gives_hfs_output(metaspace_tokenizer,
                                                                                      requested, caplog):
    with caplog.at_level(logging.INFO, logger="sft_tokenize"):
        assert choose_encoder(metaspace_tokenizer, requested) is None
    assert "not fastokens: its pre-tokenizer (Metaspace) is not byte-level" in caplog.text
    messages = ROWS["system_three_turns"]["messages"]
    row = ChatEncoder(metaspace_tokenizer, fast=None).encode_batch([to_example({"messages": messages}, COLUMNS)])
    want = metaspace_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert row.row(0).input_ids.tolist() == list(want)


def test_hf_is_never_replaced_and_unknown_names_are_refused(family_tokenizer):
    tokenizer = _chatml(family_tokenizer)
    assert choose_encoder(tokenizer, "hf") is None
    assert choose_encoder(tokenizer, "auto") is not None
    with pytest.raises(BadInput, match="--encoder must be one of auto, hf, fastokens"):
        choose_encoder(tokenizer, "tiktoken")


def test_a_fast_encoder_that_disagrees_on_a_slices_first_rows_fails_loudly(family_tokenizer, tmp_path):
    """fastokens built from another tokenizer (one more added token) stands in for an encoder gone wrong."""
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(family_tokenizer("chatml")))
    other.add_tokens(["Hello"])
    other.save_pretrained(str(tmp_path))
    wrong = choose_encoder(load_tokenizer(tmp_path), "fastokens")
    encoder = ChatEncoder(_chatml(family_tokenizer), fast=wrong)
    examples = [to_example(ROWS["system_three_turns"], COLUMNS)]
    with pytest.raises(EncoderMismatch, match="disagree on row 0"):
        encoder.encode_batch(examples)


def test_rows_whose_tokens_do_not_cover_their_bytes_are_encoded_by_hf(tmp_path):
    """An added token that swallows the spaces around it (lstrip/rstrip): ids cover fewer bytes than the text."""
    tokenizer = load_tokenizer(build_swallowing_sep_tokenizer(tmp_path))
    fast = choose_encoder(tokenizer, "fastokens")
    assert fast is not None
    assert fast.encode(["a  <sep>  b"], add_special_tokens=False) == [None]
    messages = [{"role": "user", "content": "x  <sep>  y"}, {"role": "assistant", "content": "ok <sep> done"}]
    hf, quick = ChatEncoder(tokenizer), ChatEncoder(tokenizer, fast=fast)
    assert_same(hf, quick, [to_example({"messages": messages}, ColumnMap("chat", {"messages": "messages"}))] * 20)


def test_encoder_is_not_in_the_fingerprint_and_shards_are_byte_identical(tmp_path):
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.plan import plan_slices
    from sft_tokenize.build.protocol import run_locally

    caches = {}
    for encoder in ("hf", "fastokens"):
        opts = TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                               cache_dir=str(tmp_path / encoder), shard_size="60KB", encoder=encoder)
        assert plan_slices(opts).job.encoder == encoder
        caches[encoder] = run_locally(opts)
    assert caches["hf"].name == caches["fastokens"].name  # one fingerprint
    shards = {k: sorted(p.glob("*.arrow")) for k, p in caches.items()}
    assert len(shards["hf"]) == len(shards["fastokens"]) >= 2
    for want, got in zip(shards["hf"], shards["fastokens"], strict=True):
        assert want.read_bytes() == got.read_bytes()
