"""One render for two (sft_tokenize/chat/pairs.py): the marked render of Twins equals the two renders it replaces, on
every reference template, and a template that reads a field in any other way falls back to two renders."""

from __future__ import annotations

import pytest
from support.data import COLUMNS, CONVERSATIONS, ROWS
from support.families import FAMILIES, MODERN_FAMILIES
from support.mask_oracle import oracle

from sft_tokenize.chat.markers import MARKS, mark
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.chat.pairs import Twin
from sft_tokenize.encoding.chat_encoder import ChatEncoder, Encoded
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.sources.conversations import Conversation, to_example


def renders(template, conversation: Conversation):
    """(one render of Twins, the plain render, the render of marked text), or None where the template refuses."""
    prepared = template.prepare(conversation)
    try:
        plain = template.render(prepared.messages, prepared.tools)
    except Exception:  # noqa: BLE001 - the template's own refusal: nothing to compare
        return None
    twins = mark(prepared.messages, template.markable, twin=Twin.of_field)
    marked = mark(prepared.messages, template.markable)
    return (template.render_marked(twins, prepared.tools), plain,
            template.render(marked.messages, prepared.tools))


@pytest.mark.parametrize("family", sorted(MODERN_FAMILIES))
def test_one_render_equals_the_two_renders_on_every_modern_template(modern_tokenizers, family):
    template = ChatEncoder(modern_tokenizers(family)).template
    compared = 0
    for name, row in ROWS.items():
        found = renders(template, to_example(row, COLUMNS))
        if found is None:
            continue
        one, plain, marked = found
        assert one is not None, f"{family}/{name}: the one render diverged"
        assert one == marked, f"{family}/{name}: the markers land elsewhere than in the marked render"
        assert MARKS.sub("", one) == plain, f"{family}/{name}"
        compared += 1
    assert compared >= 3


@pytest.mark.parametrize("family", FAMILIES)
def test_one_render_equals_the_two_renders_on_the_older_templates(family_tokenizer, family):
    template = ChatEncoder(load_tokenizer(family_tokenizer(family))).template
    for messages in CONVERSATIONS:
        found = renders(template, Conversation(messages))
        if found is not None:
            one, plain, marked = found
            assert one == marked and MARKS.sub("", one) == plain, f"{family}: {messages}"


CHATML_WITH = ("{{% for message in messages %}}<|im_start|>{{{{ message['role'] }}}}\n{body}<|im_end|>\n"
               "{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant\n{{% endif %}}")
# Ways of reading a field that a Twin does not follow: each makes the row render twice, and the mask is the same.
DIVERGING = {
    "index": "{{ message['content'][0] }}{{ message['content'][1:] }}",
    "iteration": "{% for c in message['content'] %}{{ c }}{% endfor %}",
    "upper": "{{ (message['content']|upper)|lower }}",
    "percent": "{{ '%s' % message['content'] }}",
    "format": "{{ '{}'.format(message['content']) }}",
    "int": "{{ message['content'] }}{% if message['content']|int > 0 %}!{% endif %}",
    "sort": "{{ message['content'] }}{{ [message['content'], 'b']|sort|length }}",
    "title_method": "{{ message['content'].title().lower() and message['content'] }}",
    "center": "{{ message['content']|center(3) }}",
}


@pytest.mark.parametrize("name", sorted(DIVERGING))
def test_other_readings_of_a_field_render_twice_with_the_same_mask(family_tokenizer, name):
    tokenizer = load_tokenizer(family_tokenizer("chatml"), chat_template=CHATML_WITH.format(body=DIVERGING[name]))
    encoder = ChatEncoder(tokenizer)
    conversation = Conversation(CONVERSATIONS[1])
    prepared = encoder.template.prepare(conversation)
    twins = mark(prepared.messages, encoder.template.markable, twin=Twin.of_field)
    assert encoder.template.render_marked(twins) is None
    [got] = encoder.encode_batch([conversation]).results()
    want = oracle(tokenizer, conversation.messages)
    assert isinstance(got, Encoded) and (got.input_ids.tolist(), got.loss_mask.tolist()) == want


def test_the_template_takes_the_branches_of_the_plain_text(family_tokenizer):
    """Marked text starts with a marker; the template must still see a field that starts with '<tool>'."""
    body = ("{% if message['content'].startswith('<tool>') and '</tool>' in message['content'] "
            "and message['content']|length > 6 and message['content'] != 'x' %}[T]{% endif %}"
            "{{ message['content']|trim }}")
    tokenizer = load_tokenizer(family_tokenizer("chatml"), chat_template=CHATML_WITH.format(body=body))
    template = ChatEncoder(tokenizer).template
    messages = [{"role": "user", "content": "<tool>q</tool>"}, {"role": "assistant", "content": " <tool>a</tool> "}]
    one = template.render_marked(mark(messages, template.markable, twin=Twin.of_field))
    assert MARKS.sub("", one) == template.render(messages)
    assert one.count("[T]") == 1 and len(MARKS.findall(one)) == 4  # " <tool>" does not start with "<tool>"


# Where a marker-range character can come from: the row's text, the template's source, a string literal that
# spells it as an escape (seen only while rendering, here on a row the probes do not make), written out or
# joined to a field, or a template argument.
CONTENT = "{{ message['content'] }}"
ICON_BODIES = {"content": CONTENT, "template": CONTENT + "\U000f1001",
               "escape": CONTENT + "{% if message['content'] == 'again' %}{{ '\\U000f1001' }}{% endif %}",
               "escape_joined": "{{ message['content'] + ('\\U000f1001' if message['content'] == 'fine' else '') }}",
               "argument": CONTENT + "{% if message['content'] == 'again' %}{{ icon }}{% endif %}"}


@pytest.mark.parametrize("where", sorted(ICON_BODIES))
def test_text_that_holds_marker_characters_is_rendered_twice(family_tokenizer, where):
    """U+F1001 and U+F1003 are the codes of the first markers (icon fonts use that range): a one render could not
    tell them from markers, so such a row, or every row of such a template, renders twice and stays exact."""
    icon = "\U000f1001"
    template = CHATML_WITH.format(body=ICON_BODIES[where])
    tokenizer = load_tokenizer(family_tokenizer("chatml"), chat_template=template)
    encoder = ChatEncoder(tokenizer, MaskSettings(template_kwargs={"icon": icon} if where == "argument" else None))
    messages = [{"role": "user", "content": f"icon {icon} here"},
                {"role": "assistant", "content": "ok \U000f1003 done"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "fine"}]
    if where != "content":
        messages = [{**m, "content": m["content"].replace(icon, "").replace("\U000f1003", "")} for m in messages]
    if where == "template":
        assert encoder.template.compiled_for_twins is None
    else:
        twins = mark(messages, encoder.template.markable, twin=Twin.of_field)
        assert twins.owners and twins.marker_text == (where == "content")
        assert encoder.template.render_marked(twins) is None
    # The oracle renders with apply_chat_template, which takes no template arguments: the icon goes in the source.
    reference = load_tokenizer(family_tokenizer("chatml"), chat_template=CHATML_WITH.format(
        body=ICON_BODIES["argument"].replace("{{ icon }}", icon))) if where == "argument" else tokenizer
    want = oracle(reference, messages)
    [got] = encoder.encode_batch([Conversation(messages)]).results()
    assert isinstance(got, Encoded) and (got.input_ids.tolist(), got.loss_mask.tolist()) == want
