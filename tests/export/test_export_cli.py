"""`sft-tokenize export` as a user runs it: OUT on stdout, the digest on stderr, done once, bad input in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.cli import NOISE, cli


def test_export_prints_its_directory_and_is_done_once(example_cache, tmp_path, cli_home):
    cache = Path(shutil.copytree(example_cache.parent, tmp_path / "root", symlinks=True)) / example_cache.name
    first = cli("export", str(cache), "--to", "megatron", str(tmp_path / "out"), "--pack-length", "512",
                home=cli_home)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1] == str(tmp_path / "out")
    record = json.loads((tmp_path / "out" / "export.json").read_text())
    assert f"digest {record['digest']}" in first.stderr and record["packed"]["pack_length"] == 512
    again = cli("export", str(cache), "--to", "megatron", str(tmp_path / "out"), "--pack-length", "512",
                home=cli_home)
    assert again.returncode == 0 and "reused" in again.stderr

    wrong = cli("export", str(cache), "--to", "mds", str(tmp_path / "out2"), "--pack-length", "512", home=cli_home)
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1 and "--pack-length" in wrong.stderr
    uneven = cli("export", str(cache), "--to", "megatron", str(tmp_path / "out4"), "--pack-length", "500",
                 "--pad-to-multiple-of", "8", home=cli_home)
    assert uneven.returncode == 2 and len(uneven.stderr.strip().splitlines()) == 1 and "multiple" in uneven.stderr
    assert not (tmp_path / "out4").exists()
    missing = cli("export", str(tmp_path / "nothing"), "--to", "mds", str(tmp_path / "out3"), home=cli_home)
    assert missing.returncode == 2 and str(tmp_path / "nothing") in missing.stderr
    assert not any(noise in wrong.stderr + missing.stderr for noise in NOISE)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
