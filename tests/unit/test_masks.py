"""Loss masks equal the prefix-rendering oracle, row by row, on real chat templates and every mode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.data import CONVERSATIONS, msg
from support.families import FAMILIES
from support.mask_oracle import oracle

from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder, Encoded
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.sources.conversations import Conversation

MODES = ["all_assistant", "last_assistant", "completion", "all"]


def check_against_oracle(tokenizer, conversations, mode, max_length=None, truncation="truncate"):
    batch = ChatEncoder(tokenizer, MaskSettings(mode, max_length, truncation)).encode_batch(conversations)
    results = batch.results()
    for row, (conv, got) in enumerate(zip(conversations, results, strict=True)):
        want = oracle(tokenizer, conv.messages, mode, conv.completion_start, max_length, truncation, conv.tools)
        if isinstance(want, str):
            assert got == want, f"row {row}: expected drop {want!r}, got {got!r}"
        else:
            assert isinstance(got, Encoded), f"row {row}: expected a row, got {got!r}"
            assert got.input_ids.tolist() == want[0], f"row {row}: input_ids differ"
            assert got.loss_mask.tolist() == want[1], f"row {row}: loss_mask differs"
    return batch


@pytest.fixture(scope="module")
def tokenizers(family_tokenizer):
    return lambda family: load_tokenizer(family_tokenizer(family))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_masks_equal_prefix_rendering(tokenizers, family, mode):
    tokenizer = tokenizers(family)
    batch = check_against_oracle(tokenizer, [Conversation(c) for c in CONVERSATIONS], mode)
    # The two-render path produced every row, not the exact (prefix-rendering) fallback.
    assert batch.rows_exact == 0, f"{family}: {batch.rows_exact} rows took the exact path"


@pytest.mark.parametrize("family", ["chatml", "llama-3-instruct", "mistral-instruct", "gemma-it", "phi-3"])
@pytest.mark.parametrize(("max_length", "truncation"), [(24, "truncate"), (40, "truncate"), (40, "drop")])
@pytest.mark.parametrize("mode", MODES)
def test_max_length(tokenizers, family, max_length, truncation, mode):
    check_against_oracle(tokenizers(family), [Conversation(c) for c in CONVERSATIONS], mode, max_length, truncation)


def test_truncation_can_drop_every_trained_token(tokenizers):
    tokenizer = tokenizers("chatml")
    long_prompt = [msg("user", "word " * 200), msg("assistant", "short")]
    encoder = ChatEncoder(tokenizer, MaskSettings("all_assistant", 50))
    [result] = encoder.encode_batch([Conversation(long_prompt)]).results()
    assert result == "truncated_away"


@pytest.mark.parametrize("family", ["chatml", "llama-3-instruct", "phi-3"])
def test_prompt_completion_rows(tokenizers, family):
    """A multi-message prompt and a completion: completion mode trains only the completion."""
    messages = [msg("user", "Translate: chat"), msg("assistant", "cat"), msg("user", "Translate: chien"),
                msg("assistant", "dog")]
    rows = [Conversation(messages, completion_start=3), Conversation(messages[:2], completion_start=1)]
    check_against_oracle(tokenizers(family), rows, "completion")
    check_against_oracle(tokenizers(family), rows, "all_assistant")


def test_tools_reach_the_template(tokenizers):
    tool = {"type": "function", "function": {"name": "lookup", "description": "Find a word.",
                                             "parameters": {"type": "object", "properties": {}}}}
    row = Conversation([msg("user", "Look up cat."), msg("assistant", "A small feline.")], tools=[tool])
    tokenizer = tokenizers("qwen2.5-instruct")
    check_against_oracle(tokenizer, [row], "all_assistant")
    [encoded] = ChatEncoder(tokenizer).encode_batch([row]).results()
    assert "lookup" in tokenizer.decode(encoded.input_ids)


REASONING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_under_any_of_its_names_renders_as_apply_chat_template(family_tokenizer, field):
    tokenizer = load_tokenizer(family_tokenizer("chatml"), chat_template=REASONING_TEMPLATE)
    row = Conversation([msg("user", "Why?"), {"role": "assistant", "content": "Because.", field: "Think first."},
                        msg("user", "And?"), msg("assistant", "Done.")])
    check_against_oracle(tokenizer, [row], "all_assistant")
    [encoded] = ChatEncoder(tokenizer).encode_batch([row]).results()
    assert "<think>Think first.</think>" in tokenizer.decode(encoded.input_ids)


def test_all_zero_mask_is_a_drop_not_a_row(tokenizers):
    tokenizer = tokenizers("chatml")
    rows = [Conversation([msg("user", "Only a question.")])]
    for mode in ("all_assistant", "last_assistant", "completion"):
        assert ChatEncoder(tokenizer, MaskSettings(mode)).encode_batch(rows).results() == ["no_assistant_turn"]


def test_text_rows_train_every_token_and_end_with_eos():
    tokenizer = load_tokenizer("examples/tokenizer")
    [encoded] = ChatEncoder(tokenizer, MaskSettings("all")).encode_batch(["Plain text for pretraining."]).results()
    assert encoded.input_ids[-1] == tokenizer.eos_token_id
    assert encoded.input_ids[:-1].tolist() == tokenizer("Plain text for pretraining.")["input_ids"]
    assert encoded.loss_mask.tolist() == [1] * len(encoded.input_ids)


# -- property test -----------------------------------------------------------------------------------------

contents = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["", " ", "\n", "  spaced  ", "日本語 🚀", "tab\there"])


@st.composite
def conversations(draw):
    messages = [msg("system", draw(contents))] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 4))):
        messages += [msg("user", draw(contents)), msg("assistant", draw(contents))]
    if draw(st.booleans()):
        messages.append(msg("user", draw(contents)))
    return messages


@pytest.mark.parametrize("family", ["chatml", "llama-3-instruct", "mistral-instruct", "gemma-it"])
def test_random_conversations_keep_the_invariants(tokenizers, family):
    tokenizer = tokenizers(family)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(conversation=conversations(), mode=st.sampled_from(MODES), max_length=st.none() | st.integers(20, 80))
    def check(conversation, mode, max_length):
        encoder = ChatEncoder(tokenizer, MaskSettings(mode, max_length))
        [got] = encoder.encode_batch([Conversation(conversation)]).results()
        want = oracle(tokenizer, conversation, mode, max_length=max_length)
        if isinstance(want, str):
            assert got == want
            return
        assert len(got.input_ids) == len(got.loss_mask) and set(got.loss_mask.tolist()) <= {0, 1}
        assert got.loss_mask.any()
        assert (got.input_ids.tolist(), got.loss_mask.tolist()) == want

    check()


def test_generation_prompt_that_differs_from_the_history(family_tokenizer, tmp_path):
    """The ChatML file as laid out for reading: its generation prompt ends in an extra newline that the
    history does not have. The trained text starts where the turn leaves the prompt (their common prefix)."""
    from support.reference_templates import template

    tokenizer = load_tokenizer(family_tokenizer("chatml"), chat_template=template("chatml"))
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0][:1], tokenize=False, add_generation_prompt=True)
    turn = tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert not turn.startswith(prompt)
    for mode in ("all_assistant", "last_assistant", "completion"):
        batch = check_against_oracle(tokenizer, [Conversation(c) for c in CONVERSATIONS], mode)
        assert batch.rows_exact == 0
    [row] = ChatEncoder(tokenizer).encode_batch([Conversation(CONVERSATIONS[0])]).results()
    assert tokenizer.decode(row.input_ids[row.loss_mask == 1]) == "Four.<|im_end|>"


def test_chat_templates_render_in_a_sandbox():
    """A template is code from the hub: it cannot reach Python internals."""
    from sft_tokenize.errors import BadRow

    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer = load_tokenizer("examples/tokenizer", chat_template=hostile)
    [result] = ChatEncoder(tokenizer, MaskSettings("all")).encode_batch([Conversation(CONVERSATIONS[0])]).results()
    assert isinstance(result, BadRow) and result.reason == "template_error"
    assert "unsafe" in result.detail


# -- control tokens' text inside messages (--special-text) ----------------------------------------------------

INJECTED = [msg("user", "Repeat after me: <|im_end|>"), msg("assistant", "Sure: <|im_end|> and then the rest.")]


def test_control_token_text_is_encoded_as_plain_text_by_default(tokenizers):
    tokenizer = tokenizers("chatml")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    batch = ChatEncoder(tokenizer).encode_batch([Conversation(INJECTED)])
    [row] = batch.results()
    ids = row.input_ids.tolist()
    assert ids.count(end) == 2  # the two turns' own ends: the text inside the messages is not the control token
    trained = row.input_ids[row.loss_mask == 1].tolist()
    assert tokenizer.decode(trained) == "Sure: <|im_end|> and then the rest.<|im_end|>"
    assert trained[-1] == end and trained.count(end) == 1
    assert batch.rows_special_text == 1
    # The rest of the row is tokenized as usual: the template's text is the same tokens as without injection.
    clean = Conversation([msg("user", "Repeat after me: x"), msg("assistant", "Sure: x and then the rest.")])
    [plain] = ChatEncoder(tokenizer).encode_batch([clean]).results()
    assert ids[:3] == plain.input_ids.tolist()[:3]


def test_control_token_text_kept_is_what_apply_chat_template_does(tokenizers):
    tokenizer = tokenizers("chatml")
    [row] = ChatEncoder(tokenizer, MaskSettings(special_text="keep")).encode_batch([Conversation(INJECTED)]).results()
    assert row.input_ids.tolist() == tokenizer.apply_chat_template(INJECTED, tokenize=True)["input_ids"]


def test_control_token_text_can_be_refused(tokenizers):
    encoder = ChatEncoder(tokenizers("chatml"), MaskSettings(special_text="error"))
    [row] = encoder.encode_batch([Conversation(INJECTED)]).results()
    assert row.reason == "control_token_in_text"
    assert str(row).startswith("messages[0].content holds the control token '<|im_end|>' as text")


def test_control_token_text_in_plain_text_rows(tokenizers):
    tokenizer = tokenizers("chatml")
    encoder = ChatEncoder(tokenizer, MaskSettings("all"))
    [row] = encoder.encode_batch(["A document that mentions <|im_end|> once."]).results()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert row.input_ids.tolist().count(end) == 1 and row.input_ids[-1] == tokenizer.eos_token_id
