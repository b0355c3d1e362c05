"""The plan-time chat template check remembers the templates that compiled (chat/template_check.py): a later run
skips importing transformers for them, and a template that fails is compiled, and refused, every time."""

from __future__ import annotations

import pytest

from sft_tokenize.chat.template_check import check_chat_template, compiled_mark
from sft_tokenize.errors import BadInput
from sft_tokenize.format.layout import COMPILED_TEMPLATES

GOOD = "{% for m in messages %}{{ m.content }}{% endfor %}"
BROKEN = "{% for m in messages %}\n{{ m.content }}"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / COMPILED_TEMPLATES


def check(template: str, tmp_path) -> None:
    check_chat_template(template, tmp_path, template, needed=True)


def test_a_template_that_compiled_is_remembered_and_an_edited_one_compiled_again(home, tmp_path):
    check(GOOD, tmp_path)
    [first] = home.iterdir()
    assert first == compiled_mark(GOOD)
    assert first.read_bytes() == b""
    check(GOOD, tmp_path)
    assert list(home.iterdir()) == [first]
    check(GOOD + " ", tmp_path)
    assert len(list(home.iterdir())) == 2


def test_a_template_that_fails_is_never_remembered(home, tmp_path):
    for _ in range(2):
        with pytest.raises(BadInput, match=r"not valid Jinja \(line 2 of the template\): Unexpected end of template"):
            check(BROKEN, tmp_path)
    assert not home.exists()


def test_a_remembered_template_is_not_compiled_again(home, tmp_path):
    """The mark decides (so only a success may write it): one made by hand for a broken template lets it through."""
    mark = compiled_mark(BROKEN)
    mark.parent.mkdir(parents=True)
    mark.write_bytes(b"")
    check(BROKEN, tmp_path)
