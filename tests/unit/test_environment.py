"""The fast sandbox (chat/environment.py) renders what transformers' own sandboxed environment renders: every
reference template on every test conversation, and each shortcut on the cases around it (a dict key named
like a dict method, a missing key, a loop that peeks ahead, a namespace, a str method on another type, the
sandbox's refusals), errors included."""

from __future__ import annotations

import pytest
from support.data import COLUMNS, CONVERSATIONS, ROWS
from support.families import FAMILIES, MODERN_FAMILIES
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

from sft_tokenize.chat import environment as sandbox
from sft_tokenize.chat import hf_jinja
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.sources.conversations import Conversation, to_example


def outcome(render):
    """What a render gives: its text, or the type and first line of the error it raises."""
    try:
        return render()
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return type(error).__name__, (str(error).splitlines() or [""])[0]


def compiled(source: str) -> dict:
    """transformers' compiled template, the same compiled from its source (chat/hf_jinja.py) and the two fast ones
    in the environment the encoder uses, by name."""
    stock, environment = _compile_jinja_template(source), hf_jinja.new_environment()
    return {"transformers": stock, "from_source": hf_jinja.compile_template(source),
            "fast": sandbox.compile_template(environment, source),
            "fast_for_twins": sandbox.compile_template(environment, source, for_twins=True)}


TREE = [{"name": "a", "children": [{"name": "b", "children": []}, {"name": "c"}]}, {"name": "d"}]
SNIPPETS = {
    "dict_keys": ("{{ m.role }}|{{ m.missing }}|{{ m.missing is defined }}|{{ m['role'] }}|{{ m['missing'] }}|"
                  "{{ m.items()|list|length }}|{{ m['items'] is defined }}|{{ m.get('role') }}", {}),
    "keys_named_like_methods": ("{{ k['items'] }}|{{ k.items is callable }}|{{ k['get'] }}|{{ k.role }}", {}),
    "missing_key_error": ("{{ m.missing.deeper }}", {}),
    "undefined_variable": ("{{ nothing.role }}|{{ nothing['role'] }}", {}),
    "loop_values": ("{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}"
                    "{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.previtem }}{{ loop.nextitem }}"
                    "{{ loop.depth }}{{ loop.depth0 }}{{ loop.cycle('a', 'b') }}{{ loop.changed(x > 1) }};"
                    "{% else %}empty{% endfor %}", {}),
    "loop_peeks_then_steps": ("{% for x in xs %}{% if loop.last %}L{% endif %}{{ x }}{{ loop.nextitem }}"
                              "{% if loop.index0 == 0 %}{{ loop.last }}{% endif %}{% endfor %}", {}),
    "loop_empty": ("{% for x in [] %}{{ x }}{% else %}empty{{ loop is defined }}{% endfor %}", {}),
    "loop_filtered_and_nested": ("{% for x in xs if x > 1 %}{% set outer = loop %}{% for y in xs %}"
                                 "{{ outer.index }}{{ loop.index }}{% endfor %}{% endfor %}", {}),
    "loop_over_iterator": ("{% for x in it %}{{ loop.index }}{{ loop.last }}{{ loop.length }}{% endfor %}", {}),
    "loop_controls": ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% if x == 3 %}{% break %}"
                      "{% endif %}{% endfor %}", {}),
    "recursive_loop": ("{% for item in tree recursive %}{{ item.name }}{{ loop.depth }}{% if item.children %}"
                       "[{{ loop(item.children) }}]{% endif %}{% endfor %}", {"tree": TREE}),
    "namespace": ("{% set ns = namespace(a=1, items=2) %}{% set ns.b = ns.a + 1 %}{{ ns.a }}{{ ns.b }}"
                  "{{ ns.c is defined }}{{ ns.items }}{{ ns.__class__ }}", {}),
    "namespace_refuses_underscores": ("{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}", {}),
    "str_methods": ("{{ s.startswith('a') }}|{{ s.split(',')|join('-') }}|{{ s.strip() }}|{{ s.upper() }}|"
                    "{{ s.replace('a', 'b', 1) }}|{{ s.count('a') }}|{{ s.split(sep=',', maxsplit=1) }}|"
                    "{{ s.rstrip(' ').endswith('a') }}|{{ s.format(1) }}|{{ '{0}!'.format(s) }}", {}),
    "str_method_on_other_types": ("{{ n.startswith('1') }}", {}),
    "str_method_on_undefined": ("{{ nothing.strip() }}", {}),
    "list_method_refused": ("{{ xs.append(4) }}", {}),
    "unsafe_attributes": ("{{ s.__class__ }}|{{ m.__class__ }}|{{ xs.__len__ }}", {}),
    "unsafe_chain": ("{{ s.__class__.__mro__ }}", {}),
    "string_test": ("{{ s is string }}{{ n is string }}{{ nothing is string }}{{ xs is string }}{{ m.role is string }}"
                    "{{ xs|select('string')|list }}", {}),
    "transformers_filters_and_globals": ("{{ m|tojson }}|{{ {'é': s}|tojson(indent=1, sort_keys=true) }}|"
                                         "{{ dict(a=1, b=xs) }}|{{ dict.fromkeys(xs) }}|{{ strftime_now('%Y')|length }}"
                                         "{% generation %}{{ s }}{% endgeneration %}", {}),
    "raise_exception": ("{{ raise_exception('no ' ~ s) }}", {}),
}
CONTEXT = {"m": {"role": "user", "content": "hi"}, "k": {"items": "x", "get": "y", "role": "r"}, "xs": [1, 2, 3],
           "s": "a,b,a ", "n": 12}


@pytest.mark.parametrize("snippet", sorted(SNIPPETS))
def test_each_shortcut_renders_what_the_sandbox_renders(snippet):
    source, extra = SNIPPETS[snippet]
    renders = {name: outcome(lambda t=template: t.render(**CONTEXT, it=iter([5, 6, 7]), **extra))
               for name, template in compiled(source).items()}
    assert renders["from_source"] == renders["fast"] == renders["fast_for_twins"] == renders["transformers"], snippet


def test_the_namespace_and_loop_shortcuts_are_taken():
    """A message's fields, a loop's counters and a namespace's values are read without the environment."""
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{{ m.role }}{{ m['content'] }}{{ loop.index0 }}"
              "{{ ns.n }}{% endfor %}")
    template = sandbox.compile_template(_compile_jinja_template(source).environment, source)
    calls = []
    environment_getattr = template.environment.getattr
    template.environment.getattr = lambda *args: calls.append(args) or environment_getattr(*args)
    assert template.render(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == (
        "usera00assistantb10")
    assert calls == []


def test_code_the_generator_writes_badly_falls_back_to_jinjas_and_says_so(monkeypatch, caplog):
    source = "{% for m in messages %}{{ m.role }}{% endfor %}"
    monkeypatch.setattr(sandbox.FastCodeGenerator, "visit_Getattr", lambda self, node, frame: self.write("(]"))
    template = sandbox.compile_template(_compile_jinja_template(source).environment, source)
    assert template.render(messages=[{"role": "user"}]) == "user"
    assert "jinja's own compiled code" in caplog.text


@pytest.mark.parametrize("family", sorted(MODERN_FAMILIES))
def test_every_modern_template_compiles_to_the_fast_code(modern_tokenizers, family, caplog):
    ChatEncoder(modern_tokenizers(family))
    assert "jinja's own compiled code" not in caplog.text


def _same_text_as_transformers(tokenizer, template, conversation: Conversation) -> int:
    """Renders through the project and through transformers' renderer (the one apply_chat_template calls, given
    the messages as they are: apply_chat_template would drop `content: None`), with and without a generation
    prompt; returns how many renders succeeded (0 where the template refuses the conversation, as both must)."""
    prepared = template.prepare(conversation)
    succeeded = 0
    for prompt in (False, True):
        want = outcome(lambda p=prompt: render_jinja_template(
            [prepared.messages], tools=prepared.tools, chat_template=tokenizer.chat_template,
            add_generation_prompt=p, **tokenizer.special_tokens_map)[0][0])
        got = outcome(lambda p=prompt: template.render(prepared.messages, prepared.tools, add_generation_prompt=p))
        if isinstance(want, str):
            assert got == want
            succeeded += 1
        else:
            assert not isinstance(got, str) and got[1] == want[1]
    return succeeded


@pytest.mark.parametrize("family", sorted(MODERN_FAMILIES))
def test_every_modern_template_renders_as_transformers_renders_it(modern_tokenizers, family):
    tokenizer = modern_tokenizers(family)
    template = ChatEncoder(tokenizer).template
    rendered = sum(_same_text_as_transformers(tokenizer, template, to_example(row, COLUMNS))
                   for row in ROWS.values())
    assert rendered >= 6


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_older_template_renders_as_transformers_renders_it(family_tokenizer, family):
    tokenizer = load_tokenizer(family_tokenizer(family))
    template = ChatEncoder(tokenizer).template
    rendered = sum(_same_text_as_transformers(tokenizer, template, Conversation(messages))
                   for messages in CONVERSATIONS)
    assert rendered >= 2
