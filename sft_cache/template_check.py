"""The chat template, checked once at plan time: a syntax error or an unusable set of named templates is
blamed on the template file, before any row is read, instead of failing every row of the first slice."""

from __future__ import annotations

from pathlib import Path

from .errors import BadInput, one_line
from .options import TokenizeOptions


def template_source(options: TokenizeOptions, tokenizer_dir: Path) -> str:
    """Where the template in use comes from, as the user would look for it."""
    if options.chat_template is not None:
        if "{" in options.chat_template:
            return "--chat-template"
        return str(Path(options.chat_template).expanduser().absolute())
    jinja = tokenizer_dir / "chat_template.jinja"
    return str(jinja if jinja.is_file() else tokenizer_dir / "tokenizer_config.json")


def check_chat_template(tokenizer, where: str, needed: bool) -> None:
    """Compile the template as transformers does; raise a BadInput naming `where` and the line if it cannot."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        if not needed:
            return
        # transformers picks among named templates per call (by name, or "tool_use" when tools are given); a
        # cache must have one template for every row, so the user picks it.
        raise BadInput(f"{where}: the tokenizer has named chat templates ({', '.join(template)}), and one template "
                       "is used for every row: save the one you want to a .jinja file and pass --chat-template FILE")
    if not isinstance(template, str):
        return
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as error:
        line = f" (line {error.lineno} of the template)" if error.lineno else ""
        raise BadInput(f"{where}: the chat template is not valid Jinja{line}: {one_line(error.message or error)}") \
            from None
