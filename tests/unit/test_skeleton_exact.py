"""Skeleton fills are exact by construction (docs/masks.md, "Skeletons"): each premise is enforced, and a custom
template that breaks it gets the full render; a fill caught differing from its full render is never published."""

from __future__ import annotations

import copy
import json
import math
from datetime import datetime

import numpy as np
import pytest
from support.data import COLUMNS, TOOL, call, write_jsonl

from sft_tokenize.chat import facts, pairs, skeleton, turns
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.chat.skeleton import Skeletons, shape_of
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.sources.conversations import to_example


def examples_of(rows: list[dict]) -> list:
    return [to_example(row, COLUMNS) for row in rows]


def assert_same(want, got) -> None:
    assert [str(o) for o in want.outcomes] == [str(o) for o in got.outcomes]
    assert np.array_equal(want.offsets, got.offsets)
    assert np.array_equal(want.input_ids, got.input_ids)
    assert np.array_equal(want.loss_mask, got.loss_mask)


def unsampled(monkeypatch) -> None:
    """Only a skeleton's first fill is checked: what a later fill gives is what the skeleton gives."""
    monkeypatch.setattr(skeleton, "SAMPLE_EVERY", 10**9)


def full_and_filled(tokenizer, examples, **options):
    """(the rows rendered in full, the rows with skeletons, the encoder that filled them)."""
    want = ChatEncoder(tokenizer, MaskSettings(skeletons=False, **options)).encode_batch(examples)
    encoder = ChatEncoder(tokenizer, MaskSettings(**options))
    return want, encoder.encode_batch(examples), encoder


def plain_pair(first: str, second: str) -> dict:
    return {"messages": [{"role": "user", "content": first}, {"role": "assistant", "content": second}]}


# -- (c) equal keys mean equal values outside the fields -------------------------------------------------------

def _tool_row(arguments: str) -> dict:
    return {"tools": [TOOL], "messages": [
        {"role": "user", "content": "How long?"},
        {"role": "assistant", "content": None, "tool_calls": [call(arguments)]},
        {"role": "tool", "tool_call_id": "abc123xyz", "name": "get_time", "content": "done"},
        {"role": "assistant", "content": "It is done."}]}


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_non_finite_tool_arguments_are_not_filled_as_null(modern_tokenizers, family, monkeypatch):
    """Qwen2.5/Qwen3 render tool-call arguments with tojson, which writes NaN and Infinity as such: a row whose
    arguments differ from a learned row's only by NaN where it had null is its own shape."""
    unsampled(monkeypatch)
    arguments = ['{"days": null}', '{"days": null}', '{"days": NaN}', '{"days": Infinity}', '{"days": -Infinity}',
                 '{"days": 0.0}', '{"days": -0.0}', '{"days": 1}', '{"days": 1.0}', '{"days": true}']
    want, got, encoder = full_and_filled(modern_tokenizers(family), examples_of([_tool_row(a) for a in arguments]))
    assert encoder.turns.skeletons.filled >= 1  # the second row is filled in
    assert_same(want, got)


def test_keys_tell_apart_every_value_a_template_can():
    values = [None, math.nan, math.inf, -math.inf, 0.0, -0.0, 1, 1.0, True, False, 0, "1", [1], (1,), {"a": 1}]
    keys = []
    for value in values:
        messages = [{"role": "user", "content": "hi", "meta": value},
                    {"role": "assistant", "content": None, "tool_calls": [call({"x": value})]}]
        shape = shape_of(messages, [{"x": value}], frozenset({"content"}), ())
        assert shape is not None
        keys.append(shape.key)
    assert len(set(keys)) == len(values)
    ordered = [shape_of([{"role": "user", "content": "hi"}], [mapping], frozenset({"content"}), ()).key
               for mapping in ({"a": 1, "b": 2}, {"b": 2, "a": 1})]
    assert ordered[0] != ordered[1]  # a template that iterates a mapping writes its keys in order


# -- (a) the render is a function of the key and the recorded facts ---------------------------------------------

DATED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'user' %}Today is "
         "{{ strftime_now('%d %B %Y') }}. {% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _Clock:
    """A clock the test sets: transformers' strftime_now (the plain render's, before the clock was injectable)
    and facts.clock read it."""

    now = datetime(2026, 12, 6, 23, 59, 59)

    @classmethod
    def read(cls, tz=None) -> datetime:
        return cls.now


def with_template(modern_tokenizer, source: str):
    tokenizer = load_tokenizer(modern_tokenizer("qwen2.5"))
    tokenizer.chat_template = source
    return tokenizer


def test_a_run_across_midnight_writes_each_rows_own_date(modern_tokenizer, monkeypatch):
    import transformers.utils.chat_template_utils as hf

    unsampled(monkeypatch)
    monkeypatch.setattr(facts, "clock", _Clock.read)
    monkeypatch.setattr(hf, "datetime", type("FakeDatetime", (), {"now": staticmethod(_Clock.read)}))
    tokenizer = with_template(modern_tokenizer, DATED)
    examples = examples_of([plain_pair(f"question {k}", f"answer {k}") for k in range(4)])
    full, encoder = ChatEncoder(tokenizer, MaskSettings(skeletons=False)), ChatEncoder(tokenizer)
    _Clock.now = datetime(2026, 12, 6, 23, 59, 59)
    assert_same(full.encode_batch(examples), encoder.encode_batch(examples))
    assert encoder.turns.skeletons.filled >= 2
    _Clock.now = datetime(2026, 12, 7, 0, 0, 1)  # midnight passed between two batches of one run
    want, got = full.encode_batch(examples), encoder.encode_batch(examples)
    assert "7 December" in tokenizer.decode(want.input_ids)
    assert_same(want, got)
    assert got.skeleton_mismatches == 0


@pytest.mark.parametrize("call_", ["{{ [1, 2, 3] | random }}", "{{ lipsum(1) | length }}"])
def test_randomness_is_not_learned(modern_tokenizer, call_):
    source = DATED.replace("Today is {{ strftime_now('%d %B %Y') }}. ", call_)
    tokenizer = with_template(modern_tokenizer, source)
    encoder = ChatEncoder(tokenizer)
    encoder.encode_batch(examples_of([plain_pair(f"q {k}", f"a {k}") for k in range(6)]))
    assert encoder.turns.skeletons.filled == 0


# -- (b) every read and transform of a field is a recorded fact with a replay ----------------------------------

CHAT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ BODY }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Each read or transform the tracer records (pairs._observe, pairs._then), in a template, with user texts that
# give it one result (the first two) and another (the third): the third row must not be filled as the first two.
OPERATIONS = {
    "bool": ("{{ 'Y' if m.content else 'N' }}{{ m.content }}", "a", "b", " "),
    "len": ("{{ 'L' if m.content | length > 3 else '' }}{{ m.content }}", "a", "b", "cccc"),
    "eq": ("{{ 'X' if m.content == 'x' else '' }}{{ m.content }}", "a", "b", "x"),
    "ne": ("{{ 'X' if m.content != 'x' else '' }}{{ m.content }}", "a", "b", "x"),
    # (a comparison the markers' characters do not turn: the template's probes begin with capitals)
    "lt": ("{{ 'L' if m.content < 'A' else '' }}{{ m.content }}", "a", "b", "0"),
    "le": ("{{ 'L' if m.content <= 'A' else '' }}{{ m.content }}", "a", "b", "0"),
    "gt": ("{{ 'G' if m.content > 'A' else '' }}{{ m.content }}", "a", "b", "0"),
    "ge": ("{{ 'G' if m.content >= 'A' else '' }}{{ m.content }}", "a", "b", "0"),
    "contains": ("{{ 'Q' if '?' in m.content else '' }}{{ m.content }}", "a", "b", "c?"),
    "startswith": ("{{ 'S' if m.content.startswith('x') else '' }}{{ m.content }}", "a", "b", "xa"),
    "endswith": ("{{ 'E' if m.content.endswith('x') else '' }}{{ m.content }}", "a", "b", "ax"),
    "strip": ("{{ m.content.strip('x') }}", "a", "b", "xax"),
    "lstrip": ("{{ m.content.lstrip('x') }}", "a", "b", "xa"),
    "rstrip": ("{{ m.content.rstrip('x') }}", "a", "b", "ax"),
    "split": ("{{ m.content.split(',')[0] }}", "a", "b", "a,b"),
    "rsplit": ("{{ m.content.rsplit(',')[-1] }}", "a", "b", "a,b"),
    "count": ("{{ m.content.replace('x', 'y') }}", "a", "b", "ax"),
    "slice": ("{{ m.content[0:40] }}", "ab", "cd", "e" * 60),
    "add": ("{{ (m.content + '!') if (m.content + '!') | length > 3 else m.content }}", "a", "b", "abc"),
    "radd": ("{{ ('!' + m.content) if ('!' + m.content).endswith('!z') else m.content }}", "a", "b", "z"),
    "replace": ("{{ m.content.replace('x', '') if m.content.replace('x', '') else 'E' }}", "a", "b", "xx"),
    "agree": ("{{ m.content }}", "a", "b", "c"),
    "strftime_now": ("{{ strftime_now('%Y') }}{{ m.content }}", "a", "b", "c"),
}


def _recorded_operations(source: str, tokenizer, examples) -> set[str]:
    """Every fact and step name in the traces of the learned skeletons."""
    encoder = ChatEncoder(tokenizer)
    encoder.encode_batch(examples)
    seen = set()
    for known in encoder.turns.skeletons._by_key.values():
        for learned in known:
            for origin, fact, _, _ in learned.facts:
                seen.add(fact)
                seen.update(step[0] for step in (origin[1] if origin else ()))
    return seen


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_every_recorded_operation_replays(modern_tokenizer, operation, monkeypatch):
    unsampled(monkeypatch)
    body, first, second, other = OPERATIONS[operation]
    tokenizer = with_template(modern_tokenizer, CHAT.replace("{{ BODY }}", body))
    rows = [plain_pair(first, "ok"), plain_pair(second, "ok"), plain_pair(other, "ok"), plain_pair(first, "ok")]
    want, got, encoder = full_and_filled(tokenizer, examples_of(rows))
    assert_same(want, got)
    assert got.skeleton_mismatches == 0
    if operation != "agree":
        assert operation in _recorded_operations(body, tokenizer, examples_of(rows[:1]))


def test_the_operations_above_are_every_one_the_tracer_records():
    """The replays (facts.FACTS, facts.STEPS, facts.WORLD) are the vocabulary the test above
    covers: an operation added to the tracer without a replay, or without a test here, fails."""
    assert set(facts.FACTS) | facts.WORLD | facts.STEPS == set(OPERATIONS)


@pytest.mark.parametrize(("name", "body", "texts"), [
    ("namespace key", "{% set ns = namespace(a='AAA', b='BBB') %}[{{ ns[m.content] }}]{{ m.content }}",
     ["x", "y", "a"]),
    ("mapping key", "[{{ {'a': 'AAA'}[m.content] }}]{{ m.content }}", ["x", "y", "a"]),
    ("markup concatenation", "{{ m.content + ('!' | safe) }}", ["hi", "yo", "a<b"]),
    ("rendered twice in a searched gap", None, ["hi", "yo", "say <|im_start|>assistant\nX"]),
    ("rendered twice", "{{ m.content }}{{ m.content }}", ["hi", "yo", "ab"]),
])
def test_reads_the_trace_cannot_replay_are_not_learned(modern_tokenizer, name, body, texts, monkeypatch):
    unsampled(monkeypatch)
    if body is None:  # the first user text again after each assistant turn's header, before its content
        source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
                  "[{{ messages[0].content }}]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    else:
        source = CHAT.replace("{{ BODY }}", body)
    tokenizer = with_template(modern_tokenizer, source)
    rows = [plain_pair(text, f"reply {k}") for k, text in enumerate(texts)]
    want, got, _ = full_and_filled(tokenizer, examples_of(rows), special_text="keep")
    assert_same(want, got)


# -- a fill caught differing is never published ----------------------------------------------------------------

def _ignoring_facts(monkeypatch) -> None:
    monkeypatch.setattr(facts, "compiled", lambda recorded: lambda values: True)


def _thinking_rows() -> list[dict]:
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}
    thinking = copy.deepcopy(plain)
    thinking["messages"][1]["content"] = "Wave.</think>\n\nHello."  # in history, Qwen3 keeps what follows
    return [plain, thinking, plain, plain]


def test_a_mismatch_renders_the_batch_in_full_and_drops_the_skeletons(modern_tokenizers, monkeypatch):
    tokenizer = modern_tokenizers("qwen3")
    examples = examples_of(_thinking_rows())
    want = ChatEncoder(tokenizer, MaskSettings(skeletons=False)).encode_batch(examples)
    _ignoring_facts(monkeypatch)
    encoder = ChatEncoder(tokenizer)
    got = encoder.encode_batch(examples)
    assert_same(want, got)
    assert (got.skeleton_mismatches, got.rows_filled, got.skeletons_dropped) == (1, 0, True)
    assert_same(want, encoder.encode_batch(examples))  # and no skeleton is used or learned again
    assert not encoder.turns.skeletons._by_key


def test_a_mismatch_in_a_run_is_counted_and_never_published(modern_tokenizer, tmp_path, monkeypatch):
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.read.cache import open_cache

    data = write_jsonl(tmp_path / "data.jsonl", _thinking_rows())
    tokenizer = str(modern_tokenizer("qwen3"))
    full = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=tokenizer, cache_dir=str(tmp_path / "full"),
                                       render="full"))
    _ignoring_facts(monkeypatch)
    built = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=tokenizer, cache_dir=str(tmp_path / "sk")))
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["build"]["skeletons"]["skeleton_mismatches"] == 1
    assert manifest["render"] == "skeleton"
    from sft_tokenize.flows.report import summary  # the run's summary and `inspect` show it

    assert "their slices were rendered in full" in dict(summary(manifest, built))["skeleton mismatches"]
    want, got = open_cache(full), open_cache(built)
    assert len(want) == len(got) == 4
    for k in range(4):
        assert all(np.array_equal(want[k][name], got[k][name]) for name in ("input_ids", "loss_mask"))


def test_learned_skeletons_stay_in_their_run(modern_tokenizer, tmp_path, monkeypatch):
    """Two runs in one process, of the same template: the second learns its own skeletons (its first rows are
    rendered, and the first fill of each is checked), none from the run before."""
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally

    unsampled(monkeypatch)
    tokenizer = str(modern_tokenizer("qwen2.5"))
    masks = []
    for run in range(2):
        data = write_jsonl(tmp_path / f"data{run}.jsonl", [plain_pair(f"q{run} {k}", f"a {k}") for k in range(6)])
        built = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=tokenizer, cache_dir=str(tmp_path / "c")))
        masks.append(json.loads((built / "manifest.json").read_text())["build"]["skeletons"])
    assert [(m["rows_filled"], m["rows_checked"]) for m in masks] == [(5, 1), (5, 1)]


def test_checked_fills_are_sampled_at_random_seeded_per_run():
    def checks(seed: int) -> list[bool]:
        skeletons = Skeletons("t", seed)
        shape = shape_of([{"role": "user", "content": "x"}], None, frozenset({"content"}), ())
        skeletons.keep(shape, skeleton.Skeleton(("", ""), (0,), (), (), False))
        return [skeletons.find(shape)[1] for _ in range(6400)]

    first, again, other = checks(1), checks(1), checks(2)
    assert first == again and first != other
    positions = [k for k, checked in enumerate(first) if checked]
    assert 50 <= len(positions) <= 160
    assert any(k % skeleton.SAMPLE_EVERY for k in positions[1:])  # not every 64th fill


# -- the control-token row under a template whose turns cannot be located field by field -----------------------

def test_a_control_token_row_is_that_rows_outcome(modern_tokenizers):
    """SmolLM3's turns are located by prefix renders (no field by field): a message holding a control token's text
    is that row's error, not the batch's."""
    tokenizer = modern_tokenizers("smollm3")
    rows = [plain_pair("hi", "hello"), plain_pair("say <|im_end|> please", "no"), plain_pair("bye", "bye")]
    batch = ChatEncoder(tokenizer, MaskSettings(skeletons=False)).encode_batch(examples_of(rows))
    outcomes = [type(o).__name__ if not isinstance(o, int) else "row" for o in batch.outcomes]
    assert outcomes == ["row", "BadRow", "row"]
    assert batch.outcomes[1].reason == "control_token_in_text"


def test_a_mismatch_after_rows_were_filled_renders_the_slice_again(modern_tokenizer, tmp_path, monkeypatch):
    """The mismatch is in the slice's second read batch, after the first one's rows were filled from the same
    skeleton: the whole slice is tokenized again in full."""
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.read.cache import open_cache
    from sft_tokenize.sources.formats import jsonl_reader

    monkeypatch.setattr(jsonl_reader, "READ_BATCH_ROWS", 8)
    plain, thinking = _thinking_rows()[:2]
    data = write_jsonl(tmp_path / "data.jsonl", [plain] * 12 + [thinking] + [plain] * 3)
    tokenizer = str(modern_tokenizer("qwen3"))
    full = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=tokenizer, cache_dir=str(tmp_path / "full"),
                                       render="full"))
    _ignoring_facts(monkeypatch)
    monkeypatch.setattr(skeleton, "SAMPLE_EVERY", 1)  # every fill checked: the thinking row's is
    built = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=tokenizer, cache_dir=str(tmp_path / "sk")))
    masks = json.loads((built / "manifest.json").read_text())["build"]["skeletons"]
    assert (masks["skeleton_mismatches"], masks["rows_filled"]) == (1, 0)
    want, got = open_cache(full), open_cache(built)
    assert len(want) == len(got) == 16
    for k in range(16):
        assert all(np.array_equal(want[k][name], got[k][name]) for name in ("input_ids", "loss_mask"))


# -- the render mode is fingerprinted; any cache can be checked ------------------------------------------------

def _unchecked(find):
    def unchecked(self, shape):
        found = find(self, shape)
        return None if found is None else (found[0], False)

    return unchecked


def test_verify_names_the_rows_a_wrong_skeleton_filled(modern_tokenizer, tmp_path, monkeypatch, capsys):
    """A cache built by skeletons made wrong and never checked: `verify` tokenizes it again in full and exits 2
    naming the first differing row's file and line; a cache built right verifies."""
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.build.verify import verify_cache
    from sft_tokenize.cli import main as cli

    data = write_jsonl(tmp_path / "data.jsonl", _thinking_rows())
    tokenizer = str(modern_tokenizer("qwen3"))
    right = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=tokenizer, cache_dir=str(tmp_path / "ok")))
    assert cli.main(["verify", str(right), "--all"]) == 0
    assert "rows checked: 4 " in capsys.readouterr().out
    with monkeypatch.context() as broken:
        _ignoring_facts(broken)
        broken.setattr(Skeletons, "find", _unchecked(Skeletons.find))
        wrong = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=tokenizer, cache_dir=str(tmp_path / "no")))
    result = verify_cache(wrong, sample=None)
    assert [(row, where) for row, where, _ in result.differences] == [(1, f"{data}:2")]
    assert cli.main(["verify", str(wrong), "--sample", "4"]) == 2
    assert f"row 1 ({data}:2): input_ids differs" in capsys.readouterr().err
    write_jsonl(data, _thinking_rows()[::-1])  # the source changed since: its rows cannot be compared
    assert cli.main(["verify", str(right), "--all"]) == 2
    assert "its inputs changed since it was built (sources)" in capsys.readouterr().err


def test_render_full_is_another_cache(modern_tokenizer, tmp_path):
    """--render full next to a skeleton-built cache builds its own (every row rendered) rather than returning it."""
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally

    data = write_jsonl(tmp_path / "data.jsonl", [plain_pair(f"q {k}", f"a {k}") for k in range(4)])
    options = {"sources": [str(data)], "tokenizer": str(modern_tokenizer("qwen2.5")),
               "cache_dir": str(tmp_path / "root")}
    default = run_locally(TokenizeOptions(**options))
    full = run_locally(TokenizeOptions(**options, render="full"))
    assert default != full
    manifests = [json.loads((path / "manifest.json").read_text()) for path in (default, full)]
    assert [m["render"] for m in manifests] == ["skeleton", "full"]
    assert [m["build"]["skeletons"]["rows_filled"] for m in manifests] == [3, 0]
    assert manifests[1]["build"]["slices_tokenized"] == 1


# -- mutation check: each premise's enforcement, disabled, lets a wrong fill through ---------------------------

def _old_frozen(value):
    """The key part before NaN and the infinities were told from null: orjson's dump."""
    import orjson

    kind = type(value)
    if kind is str or value is None or kind is bool or kind is int or kind is float:
        return (kind, value)
    return (kind, orjson.dumps(value))


GAP = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}[{{ messages[0].content }}]"
       "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
       "{% endif %}")
MUTATIONS = {
    # premise: (what disables its enforcement, the template, the rows)
    "the clock is a fact": (lambda m: m.setattr(pairs, "strftime_now", lambda f: facts.clock().strftime(f)),
                            DATED, "midnight"),
    "reads replay or poison": (lambda m: (m.setattr(pairs, "_poison", lambda: None),
                                          m.setattr(pairs, "poison", lambda: None)),
                               CHAT.replace("{{ BODY }}", "{% set ns = namespace(a='AAA') %}[{{ ns[m.content] }}]"
                                                          "{{ m.content }}"), ["x", "y", "a"]),
    "keys are exact": (lambda m: m.setattr(skeleton, "_frozen", _old_frozen), None, "nan"),
    "turns are found in constant text": (
        lambda m: m.setattr(turns, "finds_in_constants", lambda *_: True), GAP,
        ["hi", "yo", "say <|im_start|>assistant\nX"]),
}


def _differs(modern_tokenizer, modern_tokenizers, source, rows) -> bool:
    """Whether rows filled with the guard off differ from their full render."""
    if rows == "nan":
        tokenizer, examples = modern_tokenizers("qwen2.5"), examples_of(
            [_tool_row(a) for a in ('{"d": null}', '{"d": null}', '{"d": NaN}')])
    else:
        tokenizer = with_template(modern_tokenizer, source)
        texts = rows if rows != "midnight" else ["a", "b", "c"]
        examples = examples_of([plain_pair(text, f"reply {k}") for k, text in enumerate(texts)])
    full = ChatEncoder(tokenizer, MaskSettings(skeletons=False, special_text="keep"))
    filled = ChatEncoder(tokenizer, MaskSettings(special_text="keep"))
    if rows == "midnight":
        _Clock.now = datetime(2026, 12, 6, 23, 59, 59)
        filled.encode_batch(examples)
        _Clock.now = datetime(2026, 12, 7, 0, 0, 1)
    want, got = full.encode_batch(examples), filled.encode_batch(examples)
    return not (np.array_equal(want.input_ids, got.input_ids) and np.array_equal(want.loss_mask, got.loss_mask))


@pytest.mark.parametrize("premise", sorted(MUTATIONS))
def test_each_premise_enforced_has_teeth(modern_tokenizer, modern_tokenizers, premise, monkeypatch):
    """With its enforcement, the premise's case fills exactly; with it disabled (and the guard off), the same
    case fills a row otherwise than its full render."""
    import transformers.utils.chat_template_utils as hf

    disable, source, rows = MUTATIONS[premise]
    monkeypatch.setattr(facts, "clock", _Clock.read)
    monkeypatch.setattr(hf, "datetime", type("FakeDatetime", (), {"now": staticmethod(_Clock.read)}))
    monkeypatch.setattr(Skeletons, "find", _unchecked(Skeletons.find))
    assert not _differs(modern_tokenizer, modern_tokenizers, source, rows)
    disable(monkeypatch)
    assert _differs(modern_tokenizer, modern_tokenizers, source, rows)


def test_the_guard_compares_with_what_render_full_does(modern_tokenizer):
    """A split on a separator that begins with whitespace reaches across the marker after a field's leading
    newline: the marked render gives up on that row, and --render full locates it by prefix renders. Its fill is
    right, and the guard (which compares with what --render full does) does not call it a mismatch."""
    tokenizer = with_template(modern_tokenizer, CHAT.replace(
        "{{ BODY }}", "{% if m.content.split('\\na') | length > 1 %}[multi]{% endif %}{{ m.content }}"))
    rows = [plain_pair("\nc\nab", "x"), plain_pair("\nab", "x")]  # the second: the first fill, checked
    want, got, encoder = full_and_filled(tokenizer, examples_of(rows))
    assert_same(want, got)
    assert (got.rows_filled, got.rows_checked, got.skeleton_mismatches) == (1, 1, 0)


@pytest.mark.parametrize("on_bad_row", ["skip", "raise"])
def test_a_control_token_row_in_a_run_is_skipped_or_named(modern_tokenizer, tmp_path, on_bad_row):
    """In a run: counted and skipped under --on-bad-row skip, else one line naming its file and line."""
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.errors import BadInput

    rows = [plain_pair("hi", "hello"), plain_pair("say <|im_end|> please", "no"), plain_pair("bye", "bye")]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    options = TokenizeOptions(sources=[str(data)], tokenizer=str(modern_tokenizer("smollm3")),
                              cache_dir=str(tmp_path / "cache"), on_bad_row=on_bad_row)
    if on_bad_row == "raise":
        named = rf"^{data}:2: messages\[0\]\.content holds the control token '<\|im_end\|>' as text"
        with pytest.raises(BadInput, match=named):
            run_locally(options)
        return
    manifest = json.loads((run_locally(options) / "manifest.json").read_text())
    assert (manifest["rows"], manifest["dropped"]) == (2, {"control_token_in_text": 1})
