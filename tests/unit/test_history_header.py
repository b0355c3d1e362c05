"""A template whose generation prompt heads an assistant turn otherwise than the turns in its history: what the
prompt leaves out is trained at the start of every turn, and the run's encoder says so once."""

from __future__ import annotations

import json
import logging

from support.data import example_rows
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build import workers
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices

TURNS = ("{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
         "{% else %}<|im_start|>assistant{{ SEPARATOR }}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")
# The generation prompt leaves out the newline a turn in history has after its role.
DIFFERS = TURNS.replace("{{ SEPARATOR }}", "\n") + "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
AGREES = TURNS.replace("{{ SEPARATOR }}", "\n") + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def _warnings(tmp_path, template: str, caplog) -> list[str]:
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in example_rows()[:4]))
    (tmp_path / "template.jinja").write_text(template)
    job = plan_slices(TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER),
                                      cache_dir=str(tmp_path / "cache"),
                                      chat_template=str(tmp_path / "template.jinja"))).job
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sft_tokenize"):
        workers.encoder_for(job)
        workers.encoder_for(job)  # the same job again: its encoder is made once, and says it once
    return [r.getMessage() for r in caplog.records if "assistant turn in history" in r.getMessage()]


def test_a_generation_prompt_without_the_role_separator_is_warned_about_once(tmp_path, caplog):
    [line] = _warnings(tmp_path, DIFFERS, caplog)
    assert "\n" not in line
    assert str(EXAMPLE_TOKENIZER) in line  # the template's tokenizer, named
    assert "'<|im_start|>assistant\\n'" in line and "'<|im_start|>assistant'" in line and "'\\n' is trained" in line
    # and what to do about it, if the model should not learn to write that text
    assert line.endswith("pass --chat-template a template whose generation prompt ends as its turns in history "
                         "start"), line


def test_a_generation_prompt_that_heads_turns_as_history_does_is_not_warned_about(tmp_path, caplog):
    assert _warnings(tmp_path, AGREES, caplog) == []
