"""Masks on current chat templates (the modern/ reference templates): reasoning, tool calls, history rewriting.

Every template gets the same conversations as data arrives in JSONL (through `to_example`): a system
message with three assistant turns, reasoning in a field and inline, tool calls with object and string
arguments and null content, tool replies, OpenAI-style content parts, and empty replies with and without
reasoning, in history and last. Each row, trained on every assistant turn and on the last one, either
succeeds and equals the definition computed independently (tests/support/mask_oracle.py `turn_oracle`), or
is a row error that the template itself causes. For eight families the trained text is also written out below.
"""

from __future__ import annotations

import pytest
from support.data import COLUMNS, ROWS, tool_chat
from support.families import MODERN_FAMILIES, qwen3_with_generation_blocks
from support.mask_oracle import oracle, trained_runs, turn_oracle

from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder, Encoded
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.errors import BadRow
from sft_tokenize.sources.conversations import Conversation, to_example

# Empty replies: an empty turn trains what the template renders for it, its end-of-turn token at least, also
# where the template drops its reasoning (every one in history; most also in the last turn).
ROWS = {**ROWS, "empty_turns": {"messages": [
    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
    {"role": "user", "content": "Again"}, {"role": "assistant", "content": ""}]},
    "empty_turns_reasoning": {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "reasoning_content": "Say nothing."},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "", "reasoning_content": "Still nothing."}]}}

# Each family's trained text, row by row (the decoded runs of 1s in loss_mask).
_QWEN_TOOL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
_R1_TOOL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
            '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
_GPT_OSS_TOOL = ' to=functions.get_time<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
_LLAMA_TOOL = '{"name": "get_time", "parameters": {"city": "Oslo"}}<|eot_id|>'
_MISTRAL_TOOL = '[TOOL_CALLS] [{"name": "get_time", "arguments": {"city": "Oslo"}, "id": "abc123xyz"}]</s>'
_GLM_TOOL = ("\n<think></think>\n<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
             "</tool_call><|observation|>")
TEMPLATE_REFUSES = "template refuses"  # a row error the template raises itself
DROPS_TOOL_CALLS = "template drops tool calls"  # the template renders no tool calls: a row error, not a bare EOS
EXPECTED: dict[str, dict[str, list[str] | str]] = {
    "qwen3": {
        # Reasoning of earlier turns is dropped from history; the final turn renders a (possibly empty) think block.
        "system_three_turns": ["Hello!<|im_end|>", "Apple.<|im_end|>", "<think>\n\n</think>\n\nPear.<|im_end|>"],
        "reasoning_field": ["Four.<|im_end|>", "<think>\nAdd three and three.\n</think>\n\nSix.<|im_end|>"],
        "reasoning_inline": ["Four.<|im_end|>", "<think>\nAdd three.\n</think>\n\nSix.<|im_end|>"],
        "tools_object": [_QWEN_TOOL, "<think>\n\n</think>\n\nIt is 10:00 in Oslo.<|im_end|>"],
        "tools_string": [_QWEN_TOOL, "<think>\n\n</think>\n\nIt is 10:00 in Oslo.<|im_end|>"],
        "content_parts": ["<think>\n\n</think>\n\nYes.<|im_end|>"],
        # An empty turn in history is its end-of-turn token, its reasoning dropped as any other turn's.
        "empty_turns": ["<|im_end|>", "<think>\n\n</think>\n\n<|im_end|>"],
        "empty_turns_reasoning": ["<|im_end|>", "<think>\nStill nothing.\n</think>\n\n<|im_end|>"],
    },
    "deepseek-r1": {
        "system_three_turns": ["Hello!<｜end▁of▁sentence｜>", "Apple.<｜end▁of▁sentence｜>",
                               "Pear.<｜end▁of▁sentence｜>"],
        "reasoning_field": ["Four.<｜end▁of▁sentence｜>", "Six.<｜end▁of▁sentence｜>"],
        "reasoning_inline": ["\n\nFour.<｜end▁of▁sentence｜>", "\n\nSix.<｜end▁of▁sentence｜>"],
        "tools_object": [_R1_TOOL, "It is 10:00 in Oslo.<｜end▁of▁sentence｜>"],
        "tools_string": [_R1_TOOL, "It is 10:00 in Oslo.<｜end▁of▁sentence｜>"],
        "content_parts": ["Yes.<｜end▁of▁sentence｜>"],
        "empty_turns": ["<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        "empty_turns_reasoning": ["<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
    },
    "gpt-oss": {
        # Harmony: the channel header is the model's own output; the analysis channel renders in the last turn.
        "system_three_turns": ["<|channel|>final<|message|>Hello!<|end|>", "<|channel|>final<|message|>Apple.<|end|>",
                               "<|channel|>final<|message|>Pear.<|return|>"],
        "reasoning_field": ["<|channel|>final<|message|>Four.<|end|>",
                            "<|channel|>analysis<|message|>Add three and three.<|end|><|start|>assistant"
                            "<|channel|>final<|message|>Six.<|return|>"],
        "reasoning_inline": ["<|channel|>final<|message|>Four.<|end|>",
                             "<|channel|>analysis<|message|>Add three.<|end|><|start|>assistant"
                             "<|channel|>final<|message|>Six.<|return|>"],
        "tools_object": [_GPT_OSS_TOOL, "<|channel|>final<|message|>It is 10:00 in Oslo.<|return|>"],
        "tools_string": [_GPT_OSS_TOOL, "<|channel|>final<|message|>It is 10:00 in Oslo.<|return|>"],
        "content_parts": ["<|channel|>final<|message|>Yes.<|return|>"],
        "empty_turns": ["<|channel|>final<|message|><|end|>", "<|channel|>final<|message|><|return|>"],
        "empty_turns_reasoning": ["<|channel|>final<|message|><|end|>",
                                  "<|channel|>analysis<|message|>Still nothing.<|end|><|start|>assistant"
                                  "<|channel|>final<|message|><|return|>"],
    },
    "llama3.1": {
        "system_three_turns": ["Hello!<|eot_id|>", "Apple.<|eot_id|>", "Pear.<|eot_id|>"],
        "reasoning_field": ["Four.<|eot_id|>", "Six.<|eot_id|>"],
        "reasoning_inline": ["<think>\nAdd two.\n</think>\n\nFour.<|eot_id|>",
                             "<think>\nAdd three.\n</think>\n\nSix.<|eot_id|>"],
        "tools_object": [_LLAMA_TOOL, "It is 10:00 in Oslo.<|eot_id|>"],
        "tools_string": [_LLAMA_TOOL, "It is 10:00 in Oslo.<|eot_id|>"],
        "content_parts": ["Yes.<|eot_id|>"],
        "empty_turns": ["<|eot_id|>", "<|eot_id|>"], "empty_turns_reasoning": ["<|eot_id|>", "<|eot_id|>"],
    },
    "mistral-small-3.1-v7": {
        "system_three_turns": ["Hello!</s>", "Apple.</s>", "Pear.</s>"],
        "reasoning_field": ["Four.</s>", "Six.</s>"],
        "reasoning_inline": ["<think>\nAdd two.\n</think>\n\nFour.</s>", "<think>\nAdd three.\n</think>\n\nSix.</s>"],
        "tools_object": [_MISTRAL_TOOL, "It is 10:00 in Oslo.</s>"],
        "tools_string": [_MISTRAL_TOOL, "It is 10:00 in Oslo.</s>"],
        "content_parts": ["Yes.</s>"],
        "empty_turns": ["</s>", "</s>"], "empty_turns_reasoning": ["</s>", "</s>"],
    },
    "gemma3": {
        "system_three_turns": ["Hello!<end_of_turn>", "Apple.<end_of_turn>", "Pear.<end_of_turn>"],
        "reasoning_field": ["Four.<end_of_turn>", "Six.<end_of_turn>"],
        "reasoning_inline": ["<think>\nAdd two.\n</think>\n\nFour.<end_of_turn>",
                             "<think>\nAdd three.\n</think>\n\nSix.<end_of_turn>"],
        "tools_object": TEMPLATE_REFUSES, "tools_string": TEMPLATE_REFUSES,
        "content_parts": ["Yes.<end_of_turn>"],
        "empty_turns": ["<end_of_turn>", "<end_of_turn>"], "empty_turns_reasoning": ["<end_of_turn>", "<end_of_turn>"],
    },
    "glm-4.5": {
        # Nothing follows an assistant turn: the next role token ends it; after the last turn, EOS is appended.
        "system_three_turns": ["\n<think></think>\nHello!<|user|>", "\n<think></think>\nApple.<|user|>",
                               "\n<think></think>\nPear.<|endoftext|>"],
        "reasoning_field": ["\n<think></think>\nFour.<|user|>",
                            "\n<think>Add three and three.</think>\nSix.<|endoftext|>"],
        "reasoning_inline": ["\n<think></think>\nFour.<|user|>", "\n<think>Add three.</think>\nSix.<|endoftext|>"],
        "tools_object": [_GLM_TOOL, "\n<think></think>\nIt is 10:00 in Oslo.<|endoftext|>"],
        "tools_string": [_GLM_TOOL, "\n<think></think>\nIt is 10:00 in Oslo.<|endoftext|>"],
        "content_parts": ["\n<think></think>\nYes.<|endoftext|>"],
        # GLM-4.5 writes nothing for an empty content: the turn is its think block and what ends it.
        "empty_turns": ["\n<think></think><|user|>", "\n<think></think><|endoftext|>"],
        "empty_turns_reasoning": ["\n<think></think><|user|>", "\n<think>Still nothing.</think><|endoftext|>"],
    },
    "phi-4": {
        "system_three_turns": ["Hello!<|im_end|>", "Apple.<|im_end|>", "Pear.<|im_end|>"],
        "reasoning_field": ["Four.<|im_end|>", "Six.<|im_end|>"],
        "reasoning_inline": ["<think>\nAdd two.\n</think>\n\nFour.<|im_end|>",
                             "<think>\nAdd three.\n</think>\n\nSix.<|im_end|>"],
        "tools_object": DROPS_TOOL_CALLS, "tools_string": DROPS_TOOL_CALLS,
        "content_parts": ["Yes.<|im_end|>"],
        "empty_turns": ["<|im_end|>", "<|im_end|>"], "empty_turns_reasoning": ["<|im_end|>", "<|im_end|>"],
    },
}


@pytest.fixture(scope="module")
def tokenizers(modern_tokenizers):
    return modern_tokenizers


def raw_render(tokenizer, conversation: Conversation):
    """apply_chat_template on the conversation, or the exception it raises."""
    try:
        return tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=False)
    except Exception as error:  # noqa: BLE001 - the template's own refusal is what the test compares with
        return error


FAMILIES = sorted(f for f in MODERN_FAMILIES if f != "llama3.3")  # byte-identical to llama3.1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train_on", ["all_assistant", "last_assistant"])
def test_every_conversation_is_masked_by_the_definition_or_refused_by_the_template(tokenizers, family, train_on):
    tokenizer = tokenizers(family)
    encoder = ChatEncoder(tokenizer, MaskSettings(train_on))
    examples = [to_example(row, COLUMNS) for row in ROWS.values()]
    batch = encoder.encode_batch(examples)
    results = batch.results()
    spec = MODERN_FAMILIES[family]
    for name, example, got in zip(ROWS, examples, results, strict=True):
        expected = EXPECTED.get(family, {}).get(name)
        if train_on == "last_assistant":  # the last turn alone; a row error of another turn may not be one here
            expected = expected[-1:] if isinstance(expected, list) else None
        prepared = encoder.template.prepare(example)
        if isinstance(got, BadRow):
            if got.reason == "template_error":  # the template raised: so does apply_chat_template, saying the same
                refusal = raw_render(tokenizer, prepared)
                assert isinstance(refusal, Exception), f"{family}/{name}: {got} but the template renders it"
                assert str(refusal).splitlines()[0] in str(got)
                assert expected in (None, TEMPLATE_REFUSES), f"{family}/{name}: {got}"
            else:
                assert got.reason == "template_dropped_field" and "tool_calls" in str(got), f"{family}/{name}: {got}"
                assert "get_time" not in raw_render(tokenizer, prepared).partition("Time in Oslo?")[2]
                assert expected in (None, DROPS_TOOL_CALLS), f"{family}/{name}: {got}"
            continue
        assert isinstance(got, Encoded), f"{family}/{name}: {got!r}"
        if family != "smollm3":  # {% generation %} blocks: transformers' own mask, tested below
            want_ids, want_mask = turn_oracle(tokenizer, prepared.messages, prepared.tools, spec["end_of_turn"],
                                              train_on)
            assert got.input_ids.tolist() == want_ids, f"{family}/{name}: input_ids differ from the template's text"
            assert got.loss_mask.tolist() == want_mask, (
                f"{family}/{name}/{train_on}: {trained_runs(tokenizer, got)} != definition")
        if expected is not None:
            assert trained_runs(tokenizer, got) == expected, f"{family}/{name}/{train_on}"
    assert batch.rows_exact == 0


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_expected_lists_cover_every_conversation(family):
    assert set(EXPECTED[family]) == set(ROWS)


def test_object_and_string_arguments_give_the_same_row(tokenizers):
    for family in ("qwen3", "deepseek-r1", "glm-4.5", "kimi-k2", "mistral-nemo-v3"):
        encoder = ChatEncoder(tokenizers(family))
        a, b = encoder.encode_batch([to_example(ROWS["tools_object"], COLUMNS),
                                     to_example(ROWS["tools_string"], COLUMNS)]).results()
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist(), family


def test_bad_string_arguments_name_the_field(tokenizers):
    row = tool_chat('{"city": "Oslo"', "Oslo", "10:00")
    [got] = ChatEncoder(tokenizers("qwen3")).encode_batch([to_example(row, COLUMNS)]).results()
    assert isinstance(got, BadRow) and got.reason == "bad_tool_call"
    assert str(got).startswith("messages[1].tool_calls[0].function.arguments is not valid JSON")


def test_a_row_does_not_depend_on_its_position_in_the_batch(tokenizers):
    """No row is trusted because an earlier one was checked: the 1st and the 1000th come out the same."""
    for family in ("qwq-32b", "qwen3", "gpt-oss"):
        encoder = ChatEncoder(tokenizers(family))
        rows = [to_example(row, COLUMNS) for row in ROWS.values()]
        batch = (rows * 167)[:1000]
        results = encoder.encode_batch(batch).results()
        last_copy = (len(batch) - len(rows)) // len(rows) * len(rows)  # where the batch's last whole copy starts
        for k in range(len(rows)):
            first, last = results[k], results[k + last_copy]
            assert first.input_ids.tolist() == last.input_ids.tolist(), family
            assert first.loss_mask.tolist() == last.loss_mask.tolist(), family


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "glm-4.5", "llama4", "kimi-k2"])
def test_last_assistant_and_completion_keep_their_meaning(tokenizers, family):
    """last_assistant trains the last turn alone; completion trains everything from the first assistant turn
    after the last user message through the end (tool replies between included), as for prompt-completion."""
    tokenizer = tokenizers(family)
    example = to_example(ROWS["tools_object"], COLUMNS)
    [whole] = ChatEncoder(tokenizer).encode_batch([example]).results()
    turns = trained_runs(tokenizer, whole)
    [last] = ChatEncoder(tokenizer, MaskSettings("last_assistant")).encode_batch([example]).results()
    assert last.input_ids.tolist() == whole.input_ids.tolist()
    assert trained_runs(tokenizer, last) == turns[-1:]
    [completion] = ChatEncoder(tokenizer, MaskSettings("completion")).encode_batch([example]).results()
    [run] = trained_runs(tokenizer, completion)
    assert run.startswith(turns[0]) and run.endswith(turns[-1]) and "10:00" in run.removeprefix(turns[0])


def test_expand_trains_every_turns_reasoning(tokenizers):
    """Qwen3 drops earlier turns' reasoning: expand adds a row per such turn, ending with it and training it."""
    tokenizer = tokenizers("qwen3")
    example = to_example(ROWS["reasoning_field"], COLUMNS)
    batch = ChatEncoder(tokenizer, MaskSettings(reasoning_turns="expand")).encode_batch([example])
    assert batch.rows == 2 and batch.origins == [0, 0] and batch.rows_expanded == 1
    first, main = batch.results()
    assert trained_runs(tokenizer, first) == ["<think>\nAdd two and two.\n</think>\n\nFour.<|im_end|>"]
    assert trained_runs(tokenizer, main) == ["<think>\nAdd three and three.\n</think>\n\nSix.<|im_end|>"]
    # A template that keeps every turn's reasoning, or has none, is not expanded.
    for family in ("deepseek-v3.1", "llama3.1"):
        other = ChatEncoder(tokenizers(family), MaskSettings(reasoning_turns="expand")).encode_batch([example])
        assert other.rows == 1 and other.rows_expanded == 0


def test_template_kwargs_reach_the_template(tokenizers):
    tokenizer = tokenizers("qwen3")
    example = to_example(ROWS["system_three_turns"], COLUMNS)
    [thinking] = ChatEncoder(tokenizer).encode_batch([example]).results()
    no_thinking = MaskSettings(template_kwargs={"enable_thinking": False})
    [plain] = ChatEncoder(tokenizer, no_thinking).encode_batch([example]).results()
    # Without thinking, the empty think block is part of the generation prompt: the model is given it, not taught it.
    assert trained_runs(tokenizer, thinking)[-1] == "<think>\n\n</think>\n\nPear.<|im_end|>"
    assert trained_runs(tokenizer, plain) == ["Hello!<|im_end|>", "Apple.<|im_end|>", "Pear.<|im_end|>"]
    llama = tokenizers("llama3.1")
    dated_settings = MaskSettings(template_kwargs={"date_string": "01 Jan 2030"})
    [dated] = ChatEncoder(llama, dated_settings).encode_batch([example]).results()
    assert "Today Date: 01 Jan 2030" in llama.decode(dated.input_ids)


# -- {% generation %} templates: exactly transformers' return_assistant_tokens_mask ---------------------------

@pytest.mark.parametrize("family", ["smollm3", "qwen3-generation"])
def test_generation_blocks_give_transformers_assistant_mask(modern_tokenizer, tmp_path, family):
    from support.families import build_modern_tokenizer

    if family == "smollm3":
        tokenizer = load_tokenizer(modern_tokenizer("smollm3"))
    else:
        tokenizer = load_tokenizer(build_modern_tokenizer("qwen3", tmp_path, qwen3_with_generation_blocks()))
    encoder = ChatEncoder(tokenizer)
    assert encoder.template.has_generation_blocks
    names = ["system_three_turns", "reasoning_field", "tools_object", "content_parts"]
    examples = [to_example(ROWS[name], COLUMNS) for name in names]
    for name, example, got in zip(names, examples, encoder.encode_batch(examples).results(), strict=True):
        prepared = encoder.template.prepare(example)
        want = tokenizer.apply_chat_template(prepared.messages, tools=prepared.tools, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        assert got.input_ids.tolist() == list(want["input_ids"]), name
        assert got.loss_mask.tolist() == list(want["assistant_masks"]), name
        assert any(want["assistant_masks"]), name


def test_prefix_consistent_modern_templates_equal_the_prefix_oracle(tokenizers):
    """Templates that render history as they rendered it live: the prefix-rendering oracle holds exactly."""
    conversations = [Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                   {"role": "user", "content": "  padded  "}, {"role": "assistant", "content": "Ok "}])]
    for family in ("qwen2.5", "llama3.1", "llama4", "phi-4", "olmo2", "granite-3.3", "mistral-nemo-v3"):
        tokenizer = tokenizers(family)
        [got] = ChatEncoder(tokenizer).encode_batch(conversations).results()
        want = oracle(tokenizer, conversations[0].messages)
        assert (got.input_ids.tolist(), got.loss_mask.tolist()) == want, family
