"""The documentation stays whole: every CLI flag is on the command-line page, every page is reachable from the
README and from the site's nav, the architecture page names every module, and every repository path the docs
name exists. Building the site itself (broken links, anchors, the included FORMAT.md) is `make docs`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sft_tokenize.cli.arguments import build_parser

# The repository root: the nearest folder above this file that holds pyproject.toml, wherever the file sits.
ROOT = next(parent for parent in Path(__file__).resolve().parents if (parent / "pyproject.toml").is_file())
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# The folders whose modules docs/architecture.md maps.
MAPPED = ("sft_tokenize", "flows", "tasks", "deployments")
# Backticked text that starts with one of these is a path in the repository.
REPOSITORY_DIRS = (*MAPPED, "benchmarks", "examples", "tests", "docs")


def pages() -> list[str]:
    return sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                                            argparse.Action | None]]:
    """Every (subcommand path, option) of the parser, and (path, None) for each subcommand itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), None
                yield from commands(sub, path + (name,))
        elif action.option_strings:
            yield path, action


def mentions(text: str, flag: str) -> bool:
    """`flag` written as a whole word: `--keep` is not found inside `--keep-versions`."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def sections(text: str) -> dict[str, str]:
    """The page's second-level sections by heading, each with its subsections."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_flag_of_every_subcommand_is_on_the_command_line_page():
    page = (DOCS / "cli.md").read_text()
    by_heading = sections(page)
    missing = []
    found = list(commands(build_parser()))
    assert {path[0] for path, _ in found if path} >= {"run", "inspect", "pack", "gc", "server"}
    for path, action in found:
        if action is None:
            if not mentions(page, " ".join(("sft-tokenize", *path))):
                missing.append(" ".join(path))
            continue
        if isinstance(action, argparse._HelpAction) or not path:
            # -h / --help is every command's: the page says so once.
            missing += [flag for flag in action.option_strings if not mentions(page, flag)]
            continue
        # A flag is documented under its own command: --tokenizer of run and of inspect are two entries.
        own = [body for heading, body in by_heading.items() if mentions(heading, f"sft-tokenize {path[0]}")]
        assert len(own) == 1, f"docs/cli.md: expected one section headed `sft-tokenize {path[0]}`, found {len(own)}"
        missing += [f"{' '.join(path)} {flag}" for flag in action.option_strings if not mentions(own[0], flag)]
    assert missing == [], f"not in docs/cli.md: {missing}"


def test_the_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([^)#\s]+\.md)(?:#[^)]*)?\)", README.read_text()))
    assert pages(), "no page under docs/"
    assert [page for page in pages() if page not in linked] == []


def test_every_docs_page_is_in_the_site_nav_and_every_nav_entry_is_a_page():
    class Loader(yaml.SafeLoader):
        """mkdocs.yml's own tags (`!relative`, `!ENV`) are values for mkdocs; their content does not matter here."""

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)

    def entries(nav) -> Iterator[str]:
        if isinstance(nav, str):
            yield nav
        elif isinstance(nav, list):
            for item in nav:
                yield from entries(item)
        elif isinstance(nav, dict):
            for value in nav.values():
                yield from entries(value)

    assert config["docs_dir"] == "docs"
    nav = list(entries(config["nav"]))
    assert sorted(nav) == pages()
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def test_the_architecture_page_names_every_module():
    named = set(re.findall(r"`([^`\s]+)`", (DOCS / "architecture.md").read_text()))
    modules = sorted(path.relative_to(ROOT).as_posix() for folder in MAPPED for path in (ROOT / folder).rglob("*")
                     if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".md", ".yaml"))
    assert len(modules) > 40
    assert [module for module in modules if module not in named] == []


@pytest.mark.parametrize("document", ["README.md", *(f"docs/{page}" for page in pages())])
def test_every_repository_path_the_docs_name_exists(document):
    text = (ROOT / document).read_text()
    # Written as code, a path is the repository's; as a link, it is relative to the document, as on GitHub.
    paths = {name for name in re.findall(r"`([^`\s]+)`", text) if "/" in name and name.split("/")[0] in REPOSITORY_DIRS}
    links = set(re.findall(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", text))
    assert paths | links, f"{document} names no path"
    missing = sorted(name for name in paths if not (ROOT / name).exists())
    missing += sorted(name for name in links if not ((ROOT / document).parent / name).exists())
    assert missing == [], f"{document} names paths that do not exist: {missing}"


def test_the_module_paths_in_format_md_exist():
    """FORMAT.md, shown as the site's on-disk format page, names modules relative to sft_tokenize/."""
    text = (ROOT / "sft_tokenize" / "format" / "FORMAT.md").read_text()
    modules = set(re.findall(r"`([a-z_]+/[a-z_/]+\.py)`", text))
    assert modules, "FORMAT.md names no module"
    assert [module for module in sorted(modules) if not (ROOT / "sft_tokenize" / module).is_file()] == []
