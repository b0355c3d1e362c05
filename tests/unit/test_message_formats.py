"""Rows as other tools write them: OpenAI fine-tuning `weight`s and `developer` messages, legacy `function_call`s,
LLaMA-Factory's alpaca `system`/`history` and ShareGPT `function_call`/`observation` turns. Each is read as its
format defines it and masked on real templates, or refused in one line naming the message."""

from __future__ import annotations

import json

import pytest
from support.data import COLUMNS
from support.families import MODERN_FAMILIES
from support.mask_oracle import trained_runs

from sft_tokenize.build.keys import file_digest
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder, Encoded
from sft_tokenize.errors import BadRow
from sft_tokenize.flows.report import fingerprint_inputs
from sft_tokenize.sources.conversations import resolve_columns, to_example

ALPACA = resolve_columns("alpaca", {}, ["instruction", "input", "output", "system", "history"], "f")
SHAREGPT = resolve_columns("auto", {}, ["conversations", "tools"], "f")


@pytest.fixture(scope="module")
def tokenizers(modern_tokenizers):
    return modern_tokenizers


def encode(tokenizer, row, train_on="all_assistant", columns=COLUMNS):
    [got] = ChatEncoder(tokenizer, MaskSettings(train_on)).encode_batch([to_example(row, columns)]).results()
    return got


# -- OpenAI's per-message weight -------------------------------------------------------------------------------

WEIGHTED = {"messages": [
    {"role": "user", "content": "One?"}, {"role": "assistant", "content": "Uno.", "weight": 1},
    {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "Dos.", "weight": 0},
    {"role": "user", "content": "Three?"}, {"role": "assistant", "content": "Tres."}]}


@pytest.mark.parametrize(("train_on", "trained"), [
    ("all_assistant", ["Uno.<|im_end|>", "Tres.<|im_end|>"]),  # weight 0 leaves Dos. out
    ("last_assistant", ["Uno.<|im_end|>", "Tres.<|im_end|>"]),  # weight 1 trains Uno. too
])
def test_a_message_weight_overrides_train_on_for_that_message(tokenizers, train_on, trained):
    tokenizer = tokenizers("qwen2.5")
    got = encode(tokenizer, WEIGHTED, train_on)
    assert isinstance(got, Encoded), got
    assert trained_runs(tokenizer, got) == trained
    # The weight is not the template's to see: the text is the one without it.
    plain = {"messages": [{k: v for k, v in m.items() if k != "weight"} for m in WEIGHTED["messages"]]}
    assert got.input_ids.tolist() == encode(tokenizer, plain, train_on).input_ids.tolist()
    # Rows of one shape share a learned render: the weights still decide each row's mask.
    batch = [to_example(row, COLUMNS) for row in (plain, WEIGHTED) * 3]
    results = ChatEncoder(tokenizer, MaskSettings(train_on)).encode_batch(batch).results()
    assert all(trained_runs(tokenizer, r) == trained for r in results[1::2])
    assert all(r.loss_mask.tolist() == results[0].loss_mask.tolist() for r in results[2::2])
    assert results[0].loss_mask.tolist() != got.loss_mask.tolist()


def test_a_last_turn_its_author_excluded_is_never_trained(tokenizers):
    row = {"messages": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "Uno."},
                        {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "Dos."},
                        {"role": "user", "content": "Three?"}, {"role": "assistant", "content": "Tres.", "weight": 0}]}
    assert encode(tokenizers("qwen2.5"), row, "last_assistant") == "no_assistant_turn"  # a counted drop
    # Where the mode cannot leave one message out, the row says so rather than train it.
    for train_on, reason in (("all", "weight_in_train_all"), ("completion", "weight_in_completion")):
        got = encode(tokenizers("qwen2.5"), row, train_on)
        assert isinstance(got, BadRow) and got.reason == reason
        assert str(got).startswith("messages[5].weight is 0, which --train-on")


@pytest.mark.parametrize(("weight", "shown"), [(2, "2"), ("x", "'x'"), (0.5, "0.5"), (True, "True")])
def test_a_weight_other_than_0_or_1_is_a_bad_row_naming_the_message(weight, shown):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": weight}]}
    with pytest.raises(BadRow) as error:
        to_example(row, COLUMNS)
    assert error.value.reason == "bad_weight"
    assert str(error.value) == f"messages[1].weight must be 0 (not trained) or 1 (trained), got {shown}"


def test_a_weight_of_1_on_a_user_message_cannot_be_honoured():
    row = {"messages": [{"role": "user", "content": "hi", "weight": 1}, {"role": "assistant", "content": "yo"}]}
    with pytest.raises(BadRow, match=r"messages\[0\].weight is 1 on a user message"):
        to_example(row, COLUMNS)
    row["messages"][0]["weight"] = 0  # true anyway: accepted
    assert to_example(row, COLUMNS).trained == ()


def test_the_weight_is_in_the_bytes_the_slice_keys_hash(tmp_path):
    """Shards are keyed by the bytes they read: a changed weight is a changed key, never a reused shard."""
    path = tmp_path / "rows.jsonl"
    digests = []
    for weight in (0, 1):
        row = {"messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "yo", "weight": weight}]}
        path.write_text(json.dumps(row) + "\n")
        digests.append(file_digest(str(path)))
        assert to_example(row, COLUMNS).trained == (None, bool(weight))
    assert digests[0] != digests[1]


def test_inspect_says_that_a_weight_overrides_train_on():
    manifest = {"fingerprint": "f" * 16, "name": "x", "fingerprint_inputs": {"train_on": "last_assistant"}}
    shown = ("train on", "last_assistant (a message's \"weight\" of 0 or 1 overrides it)")
    assert shown in fingerprint_inputs(manifest)


# -- OpenAI's developer role, legacy function calls; function and ipython replies ---------------------------------

def test_developer_is_system_where_the_template_has_no_developer_role(tokenizers):
    dev = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo"}]}
    system = {"messages": [{**dev["messages"][0], "role": "system"}, *dev["messages"][1:]]}
    for family in ("qwen3", "llama3.1", "kimi-k2"):  # llama3.1 and kimi-k2 would write any role's name as a header
        tokenizer = tokenizers(family)
        got, want = encode(tokenizer, dev), encode(tokenizer, system)
        assert isinstance(got, Encoded), (family, got)
        assert got.input_ids.tolist() == want.input_ids.tolist(), family
        assert got.loss_mask.tolist() == want.loss_mask.tolist(), family
    # gpt-oss has a developer role of its own: the message is given as it is.
    tokenizer = tokenizers("gpt-oss")
    got = encode(tokenizer, dev)
    assert got.input_ids.tolist() == tokenizer(tokenizer.apply_chat_template(dev["messages"], tokenize=False),
                                               add_special_tokens=False)["input_ids"]
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in tokenizer.decode(got.input_ids.tolist())


def legacy_call(result_role: str) -> dict:
    return {"messages": [
        {"role": "user", "content": "Time in Oslo?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_time", "arguments": '{"city": "Oslo"}'}},
        {"role": result_role, "name": "get_time", "content": "10:00"},
        {"role": "assistant", "content": "It is 10:00."}]}


def test_a_legacy_function_call_is_a_tool_call_and_its_reply_a_tool_reply(tokenizers):
    tokenizer = tokenizers("qwen3")
    modern = legacy_call("tool")
    modern["messages"][1] = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]}
    want = encode(tokenizer, modern)
    for role in ("function", "ipython"):
        got = encode(tokenizer, legacy_call(role))
        assert isinstance(got, Encoded), got
        assert got.input_ids.tolist() == want.input_ids.tolist() and got.loss_mask.tolist() == want.loss_mask.tolist()
    assert trained_runs(tokenizer, want)[0] == ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n'
                                                "</tool_call><|im_end|>")


def test_ipython_is_llamas_own_role_and_a_template_without_tool_replies_refuses_them(tokenizers):
    tokenizer = tokenizers("llama3.1")
    got = encode(tokenizer, legacy_call("ipython"))
    text = tokenizer.decode(got.input_ids.tolist())
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"10:00"<|eot_id|>' in text
    for family in ("phi-4", "gemma3"):  # neither renders a tool reply
        got = encode(tokenizers(family), legacy_call("function"))
        assert isinstance(got, BadRow) and got.reason == "role_not_rendered", (family, got)
        assert str(got) == ("messages[2] has role 'function', which this chat template renders neither as a role "
                            "of its own nor as a tool reply")


def test_a_message_without_content_says_what_it_has():
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "name": "bot"}]}
    with pytest.raises(BadRow) as error:
        to_example(row, COLUMNS)
    assert str(error.value) == ("messages[1] has no 'content' (and no tool_calls or function_call), which an "
                                "assistant message needs: it has only 'name'")


# -- LLaMA-Factory's alpaca: system and history ------------------------------------------------------------------

HISTORY_ROW = {"system": "Be brief.", "history": [["One?", "Uno."], ["Two?", "Dos."]],
               "instruction": "Three?", "input": "", "output": "Tres."}


@pytest.mark.parametrize(("train_on", "trained"), [
    ("all_assistant", ["Uno.<|im_end|>", "Dos.<|im_end|>", "Tres.<|im_end|>"]),
    ("last_assistant", ["Tres.<|im_end|>"]),
    ("completion", ["Tres.<|im_end|>"]),
])
def test_alpaca_system_and_history_are_the_turns_before_the_instruction(tokenizers, train_on, trained):
    tokenizer = tokenizers("qwen2.5")
    conv = to_example(HISTORY_ROW, ALPACA)
    assert [m["content"] for m in conv.messages] == ["Be brief.", "One?", "Uno.", "Two?", "Dos.", "Three?", "Tres."]
    assert [m["role"] for m in conv.messages] == ["system", *["user", "assistant"] * 3]
    got = encode(tokenizer, HISTORY_ROW, train_on, ALPACA)
    assert trained_runs(tokenizer, got) == trained
    as_json_text = {**HISTORY_ROW, "history": json.dumps(HISTORY_ROW["history"])}  # a CSV cell
    assert to_example(as_json_text, ALPACA).messages == conv.messages


def test_alpaca_system_and_history_columns_are_renamed_and_hashed():
    renamed = resolve_columns("alpaca", {"system": "sys", "history": "turns"},
                              ["instruction", "output", "sys", "turns"], "f")
    assert renamed.columns == {"instruction": "instruction", "output": "output", "system": "sys", "history": "turns"}
    row = {"instruction": "Three?", "output": "Tres.", "sys": "Be brief.", "turns": [["One?", "Uno."]]}
    assert [m["content"] for m in to_example(row, renamed).messages] == ["Be brief.", "One?", "Uno.", "Three?", "Tres."]
    # The fingerprint hashes the resolved columns: another mapping is another cache.
    plain = resolve_columns("alpaca", {}, ["instruction", "output", "sys", "turns"], "f")
    assert plain.columns != renamed.columns


@pytest.mark.parametrize(("history", "detail"), [
    ("no", "'history' is a string that is not the JSON of a list of [instruction, output] pairs"),
    ([["One?"]], "history[0] must be [instruction, output], two strings, got 1 items"),
    ([["One?", 1]], "history[0] must be [instruction, output], two strings, got 2 items"),
    ({"q": "a"}, "'history' must be a list of [instruction, output] pairs, got dict"),
])
def test_a_bad_history_is_a_bad_row_saying_what_is_wrong(history, detail):
    with pytest.raises(BadRow) as error:
        to_example({**HISTORY_ROW, "history": history}, ALPACA)
    assert str(error.value).startswith(detail)


# -- ShareGPT (LLaMA-Factory): function_call and observation turns ----------------------------------------------

def sharegpt_call(value) -> dict:
    return {"conversations": [
        {"from": "human", "value": "Time in Oslo?"}, {"from": "function_call", "value": value},
        {"from": "observation", "value": "10:00"}, {"from": "gpt", "value": "It is 10:00."}],
        "tools": json.dumps([{"name": "get_time", "description": "The time in a city.",
                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])}


@pytest.mark.parametrize("family", ["qwen3", "glm-4.5"])
def test_sharegpt_function_call_turns_are_tool_calls_the_template_renders(tokenizers, family):
    tokenizer = tokenizers(family)
    value = json.dumps({"name": "get_time", "arguments": {"city": "Oslo"}})
    conv = to_example(sharegpt_call(value), SHAREGPT)
    assert conv.messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]}
    assert conv.messages[2] == {"role": "tool", "content": "10:00"}
    got = encode(tokenizer, sharegpt_call(value), columns=SHAREGPT)
    assert isinstance(got, Encoded), got
    call = trained_runs(tokenizer, got)[0]
    assert "<tool_call>" in call and "get_time" in call and "Oslo" in call  # as the template writes calls
    # Several calls in one turn: a list of them.
    both = json.dumps([{"name": "get_time", "arguments": {"city": "Oslo"}},
                       {"name": "get_time", "arguments": {"city": "Rome"}}])
    assert len(to_example(sharegpt_call(both), SHAREGPT).messages[1]["tool_calls"]) == 2


@pytest.mark.parametrize(("value", "detail"), [
    ('{"name": "get_time", "arguments": ', "messages[1].value is not the JSON of a function call (Expecting value"),
    ('"get_time"', 'messages[1].value must be a function call {"name": ..., "arguments": ...} or a list of them, '
                   "got str"),
    ('{"name": "get_time", "arguments": 3}', "messages[1].value[0].function.arguments must be an object or a JSON "
                                             "string, got int"),
])
def test_a_malformed_function_call_is_a_bad_row_naming_the_turn(value, detail):
    with pytest.raises(BadRow) as error:
        to_example(sharegpt_call(value), SHAREGPT)
    assert error.value.reason == "bad_tool_call" and str(error.value).startswith(detail)


@pytest.mark.parametrize("family", sorted(MODERN_FAMILIES))
@pytest.mark.parametrize("result_role", ["function", "ipython"])
def test_no_template_leaves_out_a_developer_or_function_message_without_a_word(tokenizers, family, result_role):
    """Every current template either renders each message's text or refuses the row in one line."""
    tokenizer = tokenizers(family)
    row = legacy_call(result_role)
    row["messages"].insert(0, {"role": "developer", "content": "Be brief."})
    got = encode(tokenizer, row)
    if isinstance(got, BadRow):
        assert got.reason in ("role_not_rendered", "template_error", "template_dropped_field"), (family, got)
        return
    text = tokenizer.decode(got.input_ids.tolist())
    assert "Be brief." in text and "10:00" in text and "It is 10:00." in text, family
