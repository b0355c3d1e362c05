"""The chat template, checked at plan time from the tokenizer's files, before any server starts or any row is
read: a syntax error is blamed on the template's file with its line, and named templates are refused there,
instead of failing every row of the first slice."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sft_tokenize.errors import BadInput, one_line

NAMED_TEMPLATES_DIR = "additional_chat_templates"  # where transformers saves templates beside the default one


def _tokenizer_templates(tokenizer_dir: Path) -> tuple[str | dict[str, str] | None, str]:
    """The tokenizer's own template (a dict when it has named ones) and the file it is in, as transformers finds it."""
    jinja, config_file = tokenizer_dir / "chat_template.jinja", tokenizer_dir / "tokenizer_config.json"
    if jinja.is_file():
        named = sorted((tokenizer_dir / NAMED_TEMPLATES_DIR).glob("*.jinja"))
        template = jinja.read_text(encoding="utf-8", errors="replace")
        return ({"default": template, **{p.stem: p.read_text(errors="replace") for p in named}} if named
                else template), str(jinja)
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, str(config_file)  # loading the tokenizer says what is wrong with it
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        template = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
    return template, str(config_file)


def check_chat_template(chat_template: str | None, tokenizer_dir: Path, override: str | None, needed: bool) -> None:
    """Compile the template in use as transformers does; raise a BadInput naming its file and line if it cannot.
    `chat_template` is what the run's --chat-template says (inline text or a file), `override` the text it gives."""
    if not needed:  # text data renders no template
        return
    if override is not None:
        template = override
        where = "--chat-template" if "{" in (chat_template or "") else \
            os.path.abspath(os.path.expanduser(chat_template))
    else:
        template, where = _tokenizer_templates(tokenizer_dir)
    if isinstance(template, dict):
        # transformers picks a named template per call (by name, or "tool_use" when tools are given); a cache
        # has one template for every row, so the user picks it.
        raise BadInput(f"{where}: the tokenizer has named chat templates ({', '.join(map(str, template))}), and one "
                       "template is used for every row: save the one you want to a .jinja file and pass "
                       "--chat-template FILE")
    if not isinstance(template, str):
        return  # none: the tokenizer check says it is missing
    from jinja2 import TemplateSyntaxError

    try:
        _compile(template)
    except TemplateSyntaxError as error:
        line = f" (line {error.lineno} of the template)" if error.lineno else ""
        raise BadInput(f"{where}: the chat template is not valid Jinja{line}: {one_line(error.message or error)}") \
            from None


def compiled_mark(template: str) -> Path:
    """The empty file that says `template` compiled under these versions of transformers and jinja2."""
    from importlib.metadata import version

    from sft_tokenize.files import user_cache
    from sft_tokenize.fingerprint import fingerprint
    from sft_tokenize.format.layout import COMPILED_TEMPLATES

    versions = {"transformers": version("transformers"), "jinja2": version("jinja2")}
    return user_cache() / COMPILED_TEMPLATES / fingerprint({"template": template, **versions}, digits=32)


def _compile(template: str) -> None:
    """Compile `template` as transformers does, unless it compiled before (compiled_mark): a long template takes
    tens of milliseconds to compile, here and again in the encoder. Only a success is remembered."""
    from sft_tokenize.files import atomic_write

    mark = compiled_mark(template)
    if mark.is_file():
        return
    from sft_tokenize.chat import hf_jinja

    hf_jinja.compile_template(template)
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(mark, "", durable=False)
    except OSError:  # a read-only home: the next run compiles it again
        pass
