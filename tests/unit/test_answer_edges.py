"""The token that straddles an edge of an answer: a token holding any trained character is trained.

Byte-level BPE merges a template's separator with the first characters of an answer (" Hello", " 中", " ...",
ChatML's newline with an answer's own "\\n"). Whichever way a row is encoded (filled from a skeleton, rendered in
full, by HF or the fast encoder, by prefix renders, with images), and whether or not the template marks its turns
with `{% generation %}`, that token is trained, and counted."""

from __future__ import annotations

import numpy as np
import pytest
from support.edge_merges import build_edge_merging_tokenizer
from support.vision import QWEN_CONFIG, QWEN_VL_TEMPLATE

from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder, Encoded
from sft_tokenize.encoding.exact import choose_encoder
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.encoding.vision import load_family
from sft_tokenize.sources.conversations import Conversation


def _content(text_expression: str) -> str:
    """A message's content as a template writes it: a string, or its text parts (rows of parts take the exact,
    prefix-rendering path)."""
    return (f"{{% if m.content is string %}}{{{{ {text_expression}m.content }}}}{{% else %}}{{{{ {text_expression} }}}}"
            "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}")


def _template(user: str, assistant: str, end: str, tagged: bool) -> str:
    """A template rendering user turns as `user` + content + end and assistant turns as `assistant` + content +
    end (the turn's output inside {% generation %} when `tagged`), with `assistant` as its generation prompt."""
    content = "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}" \
              "{% endif %}"
    eot, newline = end.split("|>")[0] + "|>", "\\n"
    turn = (f"{{% generation %}}{content}{{{{ '{eot}' }}}}{{% endgeneration %}}{{{{ '{newline}' }}}}" if tagged
            else f"{content}{{{{ '{eot}{newline}' }}}}")
    return (f"{{% for m in messages %}}{{% if m.role == 'user' %}}{{{{ '{user}' }}}}{content}{{{{ '{eot}{newline}' }}}}"
            f"{{% else %}}{{{{ '{assistant}' }}}}{turn}{{% endif %}}{{% endfor %}}"
            f"{{% if add_generation_prompt %}}{{{{ '{assistant}' }}}}{{% endif %}}")


# name: (user header, assistant header: the generation prompt, end-of-turn token)
TEMPLATES = {
    "colon": ("User: ", "Assistant: ", "<|im_end|>"),  # a space before the answer, no separator token
    "chatml": ("<|im_start|>user\\n", "<|im_start|>assistant\\n", "<|im_end|>"),  # a newline before it
    "separator": ("<|im_start|>user\\n", "<|assistant|>", "<|end|>"),  # a control token right before it
}
# name: {answer: whether its first token holds the header's last character as well}
ANSWERS = {"colon": {"Hello there": True, "...": True, "中文回答": True},
           "chatml": {"\nHello": True, "\n...": True, "\n中文回答": True, "...": False, "中文回答": False},
           "separator": {"Hello there": False, "...": False, "中文回答": False}}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    made = {}

    def tokenizer(name: str, tagged: bool = False):
        if (name, tagged) not in made:
            user, assistant, end = TEMPLATES[name]
            folder = tmp_path_factory.mktemp(f"{name}-{'tagged' if tagged else 'plain'}")
            made[name, tagged] = load_tokenizer(build_edge_merging_tokenizer(
                folder, _template(user, assistant, end, tagged), eos_token=end))
        return made[name, tagged]

    return tokenizer


def _rows(answer: str, parts: bool = False) -> list[Conversation]:
    """Three rows of one shape (the first is learned, the others filled from its skeleton), two turns each."""
    def content(text: str):
        return [{"type": "text", "text": text}] if parts else text

    return [Conversation([{"role": "user", "content": content(f"Question {k}?")},
                          {"role": "assistant", "content": content(answer)},
                          {"role": "user", "content": content("And?")},
                          {"role": "assistant", "content": content(answer)}]) for k in range(3)]


def _encoded(encoder: ChatEncoder, rows: list[Conversation]) -> tuple[list[Encoded], object]:
    batch = encoder.encode_batch(rows)
    results = batch.results()
    assert all(isinstance(r, Encoded) for r in results), results
    return results, batch


def _expected_mask(tokenizer, messages: list[dict], end: str) -> tuple[list[int], list[int]]:
    """The definition, computed from transformers' own render and offsets: the tokens overlapping an answer's
    characters or its end-of-turn token."""
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
             for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False)
    spans, position = [], 0
    for m in plain:
        if m["role"] == "assistant":
            begin = text.index(m["content"] + end, position)
            position = begin + len(m["content"]) + len(end)
            spans.append((begin, position))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def _straddles(tokenizer, answer: str, header: str) -> bool:
    """Whether the header's last character and the answer's first share a token."""
    text = header.replace("\\n", "\n") + answer
    return any(s < len(text) - len(answer) < e for s, e in tokenizer.backend_tokenizer.encode(
        text, add_special_tokens=False).offsets)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_token_holding_an_answers_first_character_is_trained_on_every_path(tokenizers, name):
    tokenizer = tokenizers(name)
    user, assistant, end = TEMPLATES[name]
    fast = choose_encoder(tokenizer, "auto")
    assert fast is not None, "the fast encoder refused the tokenizer: the default path would not be tested"
    full = MaskSettings(skeletons=False)
    paths = {"default": ChatEncoder(tokenizer, fast=fast), "render full": ChatEncoder(tokenizer, full, fast=fast),
             "encoder hf": ChatEncoder(tokenizer), "hf, render full": ChatEncoder(tokenizer, full)}
    for answer, straddles in ANSWERS[name].items():
        assert _straddles(tokenizer, answer, assistant) == straddles, (name, answer)  # the tokenizer merges so
        want = [_expected_mask(tokenizer, row.messages, end) for row in _rows(answer)]
        for path, encoder in paths.items():
            results, batch = _encoded(encoder, _rows(answer))
            if path == "default":
                assert batch.rows_filled >= 2, (name, answer)
            assert [(r.input_ids.tolist(), r.loss_mask.tolist()) for r in results] == want, (name, answer, path)
            # Two answers a row, each with one token across its start: counted.
            assert batch.tokens_straddling == (6 if straddles else 0), (name, answer, path)
        parts, batch = _encoded(paths["default"], _rows(answer, parts=True))  # the prefix-rendering path
        assert batch.rows_exact == 3
        assert [(r.input_ids.tolist(), r.loss_mask.tolist()) for r in parts] == want, (name, answer)
        ids, mask = want[0]
        first = tokenizer.decode(ids[mask.index(1)])  # the first trained token, with the header's end if it straddles
        assert first.startswith(assistant.replace("\\n", "\n")[-1] if straddles else answer[0]), (name, answer, first)


@pytest.mark.parametrize("name", ["colon", "chatml"])
def test_generation_tags_train_what_the_same_template_without_them_trains(tokenizers, name):
    for answer, straddles in ANSWERS[name].items():
        plain, _ = _encoded(ChatEncoder(tokenizers(name), fast=choose_encoder(tokenizers(name), "auto")),
                            _rows(answer))
        tagged_tokenizer = tokenizers(name, tagged=True)
        for fast in (None, choose_encoder(tagged_tokenizer, "auto")):
            tagged, batch = _encoded(ChatEncoder(tagged_tokenizer, fast=fast), _rows(answer))
            assert [(r.input_ids.tolist(), r.loss_mask.tolist()) for r in tagged] == \
                [(r.input_ids.tolist(), r.loss_mask.tolist()) for r in plain], (name, answer, fast)
            assert batch.tokens_straddling == (6 if straddles else 0), (name, answer)


def test_an_image_rows_answer_straddling_its_header_is_trained(tmp_path):
    """Qwen2.5-VL's template on a tokenizer that merges newlines: the answer "\\nHello" after the image."""
    tokenizer = load_tokenizer(build_edge_merging_tokenizer(
        tmp_path, QWEN_VL_TEMPLATE, special=("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")))
    vision = load_family(QWEN_CONFIG, tokenizer)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "\nHello"}]
    grid = (1, 4, 4)
    row = Conversation(messages, image_grids=(grid,))
    got = {}
    for path, fast in (("default", choose_encoder(tokenizer, "auto")), ("encoder hf", None)):
        [result], batch = _encoded(ChatEncoder(tokenizer, fast=fast, vision=vision), [row])
        got[path] = (result.input_ids.tolist(), result.loss_mask.tolist(), batch.tokens_straddling)
    ids, mask, straddling = got["default"]
    trained = [k for k, m in enumerate(mask) if m]
    assert tokenizer.decode(ids[trained[0]:trained[-1] + 1]) == "\n\nHello<|im_end|>"
    assert tokenizer.convert_ids_to_tokens(ids[trained[0]]) == "ĊĊ"
    assert np.count_nonzero(np.asarray(ids) == tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4
    assert got["default"] == got["encoder hf"]
    assert straddling == 1


def test_a_straddling_token_cut_off_by_max_length_is_not_counted(tokenizers):
    tokenizer = tokenizers("colon")
    ids, mask = _expected_mask(tokenizer, _rows("Hello there")[0].messages, "<|im_end|>")
    cut = mask.index(1) + 1  # keeps the first answer's first token, not the second answer
    for fast in (choose_encoder(tokenizer, "auto"), None):
        results, batch = _encoded(ChatEncoder(tokenizer, MaskSettings(max_length=cut), fast=fast), _rows("Hello there"))
        assert [r.loss_mask.tolist() for r in results] == [mask[:cut]] * 3
        assert batch.tokens_straddling == 3
