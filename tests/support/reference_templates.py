"""The real chat templates the mask tests check against, found without keeping their text in the repository.

`reference_templates.json` beside this file names each template (`chatml`, `modern/qwen3`, …), its SHA-256, the
installed package that ships it (if any) and where to download it at a pinned revision. `template(name)` tries,
in order: the folder `SFT_CHAT_TEMPLATES` names; `../shared/chat_templates` beside the clone; the package; a
download (the hub's `resolve/<revision>/<path>` under `HF_ENDPOINT`, or a GitHub file at a commit), cached under
`.cache/reference-templates/`. Every source must give the pinned bytes: one that differs is passed over and said.
A template no source gives raises `Unavailable`, which the fixtures turn into a skip (`skip_unavailable`), and the
session ends with one line naming the families skipped and how to get them (tests/conftest.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sft_tokenize.files import atomic_write
from support.paths import ROOT

MANIFEST = Path(__file__).with_name("reference_templates.json")
CACHE = ROOT / ".cache" / "reference-templates"
GITHUB_RAW = "https://raw.githubusercontent.com"
# How long one download may take, and after a failure to reach an endpoint, no other request goes to it: an offline
# machine pays one timeout per endpoint, not one per template.
TIMEOUT_S = 10.0
# The words every skip for a missing template starts with: the session's summary (tests/conftest.py) counts them.
SKIP_PREFIX = "reference template unavailable:"
# The user's HF_HUB_OFFLINE as the suite was started with it (tests/conftest.py keeps it here before it makes the
# project's own hub access offline for every test).
USERS_OFFLINE = "SFT_TESTS_USERS_HF_HUB_OFFLINE"
HOW_TO_GET = ("set SFT_CHAT_TEMPLATES to a folder of them, install the `trainers` extra (trl ships ten), or allow "
              "downloads from the Hugging Face hub (HF_ENDPOINT) and GitHub; README, Quickstart")


class Unavailable(LookupError):
    """No source gave the template with its pinned hash; the message says what each source said."""


def manifest() -> dict[str, dict]:
    return json.loads(MANIFEST.read_text(encoding="utf-8"))


@dataclass
class Resolver:
    """The sources, in the order they are tried; each a folder, a flag or an endpoint a test can point elsewhere."""

    folders: list[Path]
    packages: bool = True
    downloads: bool = True
    hub: str = "https://huggingface.co"
    github: str = GITHUB_RAW
    cache: Path = CACHE
    entries: dict[str, dict] = field(default_factory=manifest)
    _found: dict[str, str] = field(default_factory=dict)
    _down: dict[str, str] = field(default_factory=dict)  # endpoint → why it was given up

    @classmethod
    def from_environment(cls) -> Resolver:
        folders = [Path(os.environ["SFT_CHAT_TEMPLATES"])] if os.environ.get("SFT_CHAT_TEMPLATES") else []
        offline = os.environ.get(USERS_OFFLINE, os.environ.get("HF_HUB_OFFLINE", "")).lower() in ("1", "true", "yes")
        return cls(folders=[*folders, ROOT.parent / "shared" / "chat_templates"], downloads=not offline,
                   hub=os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/"),
                   github=os.environ.get("SFT_GITHUB_RAW", GITHUB_RAW).rstrip("/"))

    def template(self, name: str) -> str:
        """The template's text, byte for byte as pinned; `Unavailable` naming what each source said."""
        if name in self._found:
            return self._found[name]
        if name not in self.entries:
            raise KeyError(f"{name} is not in {MANIFEST.name}")
        entry, said = self.entries[name], []
        for source, read in self._sources(name, entry):
            try:
                data = read()
            except (OSError, ValueError, KeyError) as error:
                said.append(f"{source}: {error}")
                continue
            if data is None:
                continue
            if (digest := hashlib.sha256(data).hexdigest()) != entry["sha256"]:
                said.append(f"{source}: SHA-256 {digest[:12]}…, not the pinned {entry['sha256'][:12]}…")
                continue
            if source.startswith("http"):
                self._keep(name, data)
            self._found[name] = text = data.decode("utf-8")
            return text
        raise Unavailable(f"{name}: " + ("; ".join(said) or "no source is configured for it"))

    def available(self, name: str) -> bool:
        try:
            self.template(name)
        except Unavailable:
            return False
        return True

    def _sources(self, name: str, entry: dict) -> list[tuple[str, Callable[[], bytes | None]]]:
        sources: list[tuple[str, Callable[[], bytes | None]]] = [
            (str(folder / f"{name}.jinja"), _file(folder / f"{name}.jinja")) for folder in self.folders]
        if self.packages and (package := entry.get("package")):
            sources.append((f"package {package['name']}", lambda: _packaged(package["name"], package["path"])))
        sources.append((str(self.cache / f"{name}.jinja"), _file(self.cache / f"{name}.jinja")))
        if (download := entry.get("download")) and not self.downloads:
            sources.append(("download", _off))
        elif download:
            url = (f"{self.hub}/{download['hub']}/resolve/{download['revision']}/{download['path']}"
                   if "hub" in download else
                   f"{self.github}/{download['github']}/{download['revision']}/{download['path']}")
            sources.append((url, lambda: _template_of(download["path"], self._get(url))))
        return sources

    def _get(self, url: str) -> bytes:
        endpoint = url.split("/", 3)[2]
        if endpoint in self._down:
            raise OSError(f"not tried: {endpoint} was not reached before ({self._down[endpoint]})")
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                return response.read()
        except urllib.error.HTTPError as error:  # the endpoint answered: only this file is missing
            raise OSError(f"HTTP {error.code}") from None
        except OSError as error:
            self._down[endpoint] = reason = str(getattr(error, "reason", error))
            raise OSError(reason) from None

    def _keep(self, name: str, data: bytes) -> None:
        """The downloaded bytes under .cache/, written whole or not at all (xdist workers may race here)."""
        path = self.cache / f"{name}.jinja"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, durable=False)  # a cache: a crash loses only a download


def _off() -> bytes:
    raise OSError("off (HF_HUB_OFFLINE=1)")


def _file(path: Path) -> Callable[[], bytes | None]:
    return lambda: path.read_bytes() if path.is_file() else None


def _packaged(package: str, relative: str) -> bytes | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path.read_bytes() if path.is_file() else None


def _template_of(path: str, data: bytes) -> bytes:
    """A template file's bytes, or the `chat_template` a tokenizer config holds (its `default` one where the config
    holds several by name)."""
    if not path.endswith(".json"):
        return data
    template = json.loads(data)["chat_template"]
    if isinstance(template, list):
        template = next(t["template"] for t in template if t["name"] == "default")
    return template.encode("utf-8")


_resolver: Resolver | None = None


def resolver() -> Resolver:
    """The session's resolver (one per process), from the environment."""
    global _resolver
    if _resolver is None:
        _resolver = Resolver.from_environment()
    return _resolver


def template(name: str) -> str:
    """The reference template `name`, or the calling test skipped, naming it."""
    try:
        return resolver().template(name)
    except Unavailable as error:
        pytest.skip(f"{SKIP_PREFIX} {error}")


def mirror(texts: dict[str, str]) -> dict[str, bytes]:
    """URL path → body, as the hub and GitHub serve each manifest download of these templates (`name` → text), for a
    local server that both `HF_ENDPOINT` and `SFT_GITHUB_RAW` point at (their paths do not overlap)."""
    files = {}
    for name, text in texts.items():
        download = manifest()[name]["download"]
        if "hub" in download:
            path = f"/{download['hub']}/resolve/{download['revision']}/{download['path']}"
        else:
            path = f"/{download['github']}/{download['revision']}/{download['path']}"
        if download["path"].endswith(".json"):  # a tokenizer config: Command R's names several templates
            held = [{"name": "default", "template": text}, {"name": "rag", "template": "-"}]
            body = {"chat_template": held if name == "modern/command-r" else text, "model_max_length": 8192}
            files[path] = json.dumps(body).encode()
        else:
            files[path] = text.encode("utf-8")
    return files
