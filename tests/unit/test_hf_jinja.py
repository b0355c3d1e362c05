"""transformers' chat-template functions run from its installed source (chat/hf_jinja.py): the environment is
transformers' own, no process that renders templates imports transformers, and a source that is not as expected
makes it import transformers instead (tests/unit/test_environment.py compares the renders)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import _compile_jinja_template

from sft_tokenize.chat import hf_jinja


def settings(environment) -> dict:
    """What configures a Jinja environment: its options, and the names of its filters, tests, globals and
    extensions (the functions behind them are compared by what they render, in test_environment.py)."""
    options = {k: v for k, v in vars(environment).items() if isinstance(v, (bool, str, int, type(None)))}
    return {"class": type(environment).__qualname__, "options": options, "filters": sorted(environment.filters),
            "tests": sorted(environment.tests), "globals": sorted(environment.globals),
            "extensions": sorted(environment.extensions)}


def test_the_environment_is_configured_as_transformers_configures_its_own():
    assert settings(hf_jinja.new_environment()) == settings(_compile_jinja_template("").environment)


def run(code: str, path: Path | None = None) -> list:
    """`code` in a fresh interpreter (with `path` first on sys.path); the JSON its last line prints."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(path or ""), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rendering_with_generation_spans_imports_no_transformers():
    text, spans, imported = run("""
        import json, sys
        from sft_tokenize.chat import hf_jinja
        template = hf_jinja.compile_template("{% for m in messages %}{{ m.role }}: "
                                             "{% generation %}{{ m.content }}{% endgeneration %}\\n{% endfor %}")
        text, spans = hf_jinja.render_with_generation_spans(template, [{"role": "a", "content": "hé"}], None)
        print(json.dumps([text, spans, sorted(m for m in sys.modules if m.split(".")[0] == "transformers")]))
    """)
    assert (text, spans, imported) == ("a: hé", [[3, 5]], [])


STANDALONE = """\
from contextlib import contextmanager

def _cached_compile_jinja_template(chat_template):
    return "from source: " + str(chat_template)

def _render_with_assistant_indices(compiled_template, messages, tools, documents, add_generation_prompt, **kwargs):
    return "", []
"""
IMPORTED = """
def _compile_jinja_template(chat_template):
    return "imported: " + chat_template
"""


@pytest.mark.parametrize(("source", "expected"), [
    (STANDALONE, ["from source: x", False]),
    (STANDALONE.replace("str(", "helper(").replace("\n\n", "\nfrom .helpers import helper\n\n", 1),
     ["imported: x", True]),
    (STANDALONE.replace("_cached_compile_jinja_template", "_compile_jinja_template_v2"), ["imported: x", True]),
], ids=["standalone", "reads-a-name-of-a-relative-import", "lacks-a-function"])
def test_a_source_not_as_expected_makes_it_import_transformers_instead(tmp_path, source, expected):
    utils = tmp_path / "transformers" / "utils"
    utils.mkdir(parents=True)
    (tmp_path / "transformers" / "__init__.py").write_text("")
    (utils / "__init__.py").write_text("")
    (utils / "helpers.py").write_text("helper = str.upper\n")
    (utils / "chat_template_utils.py").write_text(source + IMPORTED)
    assert run("""
        import json, sys
        from sft_tokenize.chat import hf_jinja
        print(json.dumps([hf_jinja.compile_template("x"), "transformers" in sys.modules]))
    """, tmp_path) == expected
