"""The reference chat templates' resolver (support/reference_templates.py): every source gives the pinned bytes or
is passed over, downloads go to the hub's `resolve/<revision>/<file>` paths and are kept, an unreachable endpoint
costs one attempt. (A clone with none of them skips their tests with one summary line: test_collection.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from support.file_server import file_server
from support.paths import ROOT
from support.reference_templates import (
    SKIP_PREFIX,
    USERS_OFFLINE,
    Resolver,
    Unavailable,
    manifest,
    mirror,
    resolver,
)

ENTRIES = manifest()


def test_the_manifest_pins_every_template_and_keeps_no_text():
    assert len(ENTRIES) == 34 and sum("/" in name for name in ENTRIES) == 25
    for name, entry in ENTRIES.items():
        assert len(entry["sha256"]) == 64 and set(entry) <= {"sha256", "package", "download"}, name
        download = entry["download"]
        assert download["revision"] and ("hub" in download) != ("github" in download), name
        if "github" in download:  # a commit or a release tag, never a branch
            assert len(download["revision"]) == 40 or download["revision"].startswith("v"), name
    assert max(len(line) for line in (ROOT / "tests/support/reference_templates.json").read_text().splitlines()) < 400


def _pinned(tmp_path: Path, text: str = "{{ messages[0]['content'] }}") -> tuple[dict[str, dict], str]:
    """A one-template manifest pinning `text`, downloadable from the hub's layout and shipped by a package."""
    return {"demo/t": {"sha256": hashlib.sha256(text.encode()).hexdigest(),
                       "package": {"name": "demo_templates", "path": "chat_templates/t.jinja"},
                       "download": {"hub": "org/model", "revision": "abc123", "path": "tokenizer_config.json"}}}, text


def test_a_folder_gives_the_template_and_one_changed_byte_is_refused(tmp_path):
    entries, text = _pinned(tmp_path)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "t.jinja").write_text(text)
    found = Resolver(folders=[tmp_path], packages=False, downloads=False, cache=tmp_path / "c", entries=entries)
    assert found.template("demo/t") == text
    (tmp_path / "demo" / "t.jinja").write_text(text[:-1] + "]")
    refused = Resolver(folders=[tmp_path], packages=False, downloads=False, cache=tmp_path / "c", entries=entries)
    with pytest.raises(Unavailable, match=r"t\.jinja: SHA-256 [0-9a-f]{12}…, not the pinned"):
        refused.template("demo/t")


def test_the_folders_come_first_then_shared_beside_the_clone_and_the_users_offline_word_holds(monkeypatch, tmp_path):
    monkeypatch.setenv("SFT_CHAT_TEMPLATES", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as tests/conftest.py sets it for the project's code
    monkeypatch.setenv(USERS_OFFLINE, "")  # the user's own: downloads allowed
    made = Resolver.from_environment()
    assert made.folders == [tmp_path, ROOT.parent / "shared" / "chat_templates"]
    assert made.downloads and made.hub == "http://127.0.0.1:9"
    monkeypatch.setenv(USERS_OFFLINE, "1")
    offline = Resolver.from_environment()
    offline.entries = {"demo/t": _pinned(tmp_path)[0]["demo/t"]}
    with pytest.raises(Unavailable, match=r"download: off \(HF_HUB_OFFLINE=1\)"):
        offline.template("demo/t")


def test_an_installed_package_gives_the_template(tmp_path, monkeypatch):
    entries, text = _pinned(tmp_path)
    package = tmp_path / "site" / "demo_templates"
    (package / "chat_templates").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "chat_templates" / "t.jinja").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = Resolver(folders=[tmp_path / "none"], downloads=False, cache=tmp_path / "c", entries=entries)
    assert found.template("demo/t") == text
    assert not Resolver(folders=[], packages=False, downloads=False, cache=tmp_path / "c",
                        entries=entries).available("demo/t")


def test_a_download_from_the_hub_layout_is_checked_and_kept(tmp_path):
    entries, text = _pinned(tmp_path)
    config = json.dumps({"chat_template": text, "eos_token": "</s>"}).encode()
    with file_server({"/org/model/resolve/abc123/tokenizer_config.json": config}) as hub:
        first = Resolver(folders=[], packages=False, hub=hub.endpoint, cache=tmp_path / "c", entries=entries)
        assert first.template("demo/t") == text
        assert (tmp_path / "c" / "demo" / "t.jinja").read_text() == text
        again = Resolver(folders=[], packages=False, hub=hub.endpoint, cache=tmp_path / "c", entries=entries)
        assert again.template("demo/t") == text
        assert hub.requests == {"/org/model/resolve/abc123/tokenizer_config.json": 1}  # the second from .cache/

        hub.files["/org/model/resolve/abc123/tokenizer_config.json"] = config.replace(b"content", b"contents")
        changed = Resolver(folders=[], packages=False, hub=hub.endpoint, cache=tmp_path / "d", entries=entries)
        with pytest.raises(Unavailable, match=r"resolve/abc123/tokenizer_config\.json: SHA-256 .*not the pinned"):
            changed.template("demo/t")
        assert not (tmp_path / "d").exists()


def test_an_unreachable_endpoint_is_tried_once_and_named(tmp_path):
    entries, _ = _pinned(tmp_path)
    entries["demo/u"] = {**entries["demo/t"]}
    with file_server({}) as gone:
        endpoint = gone.endpoint  # a port nothing listens on once the server is down
    offline = Resolver(folders=[], packages=False, hub=endpoint, cache=tmp_path / "c", entries=entries)
    with pytest.raises(Unavailable, match="refused"):
        offline.template("demo/t")
    with pytest.raises(Unavailable, match=f"not tried: {endpoint[7:]} was not reached before"):
        offline.template("demo/u")


def test_every_manifest_download_resolves_from_a_mirror_of_the_hub_and_github(tmp_path):
    """Each template's download entry (its URL, a tokenizer config's `chat_template`, Command R's named list)
    gives the pinned bytes: served from the texts this session found, by any source."""
    texts = {name: resolver().template(name) for name in ENTRIES if resolver().available(name)}
    if not texts:
        pytest.skip(f"{SKIP_PREFIX} every template: no source gave one")
    with file_server(mirror(texts)) as site:
        only_downloads = Resolver(folders=[], packages=False, hub=site.endpoint, github=site.endpoint,
                                  cache=tmp_path / "c", entries=ENTRIES)
        assert {name: only_downloads.template(name) for name in texts} == texts
        assert sum(site.requests.values()) == len(texts)
