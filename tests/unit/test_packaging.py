"""What `pip install .` puts in site-packages: one top-level package, sft_tokenize, with its Prefect flows and
tasks inside it, a console script, and FORMAT.md; and the installed copy runs the quickstart."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER, ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools' build/ in the checkout could hold modules since removed.
    source = tmp_path_factory.mktemp("source") / "project"
    scratch = {".venv", ".git", ".cache", "build", "dist", "benchmarks"}
    shutil.copytree(ROOT, source, ignore=lambda folder, names: [
        n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (Path(folder) == ROOT and n in scratch)])
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                   check=True, capture_output=True)
    (built,) = out.glob("sft_tokenize-*.whl")
    return built


def test_the_wheel_installs_one_top_level_package_and_its_console_script(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"sft_tokenize"}
    for expected in ("sft_tokenize/flows/tokenize_dataset.py", "sft_tokenize/cli/main.py",
                     "sft_tokenize/tasks/tokenize_slice.py", "sft_tokenize/format/FORMAT.md",
                     "sft_tokenize/read/cache.py"):
        assert expected in names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    script = "sft-tokenize = sft_tokenize.cli.resident:console_main"
    assert script in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_copy_runs_the_quickstart_outside_the_checkout(wheel, tmp_path, prefect_home):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(target), "PREFECT_HOME": str(prefect_home),
           "SFT_TOKENIZE_SERVER_IDLE": "0"}
    env.pop("PREFECT_API_URL", None)
    code = "import sft_tokenize.cli.main as c, sys; print(c.__file__, file=sys.stderr); sys.exit(c.main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "run", str(EXAMPLE_DATA), "--tokenizer", str(EXAMPLE_TOKENIZER),
                           "--cache-dir", str(tmp_path / "cache")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(target / "sft_tokenize" / "cli" / "main.py") in done.stderr
    cache = Path(done.stdout.strip().splitlines()[-1])
    assert cache.parent == tmp_path / "cache" and (cache / "manifest.json").is_file()


def test_the_default_install_brings_fastokens_where_it_has_wheels(wheel):
    """The fast encoder is a dependency, not an extra, on the platforms fastokens has wheels for."""
    from packaging.requirements import Requirement

    names = zipfile.ZipFile(wheel).namelist()
    (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
    requirements = [Requirement(line.split(":", 1)[1].strip())
                    for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    (fast,) = [r for r in requirements if r.name == "fastokens" and "extra" not in str(r.marker)]
    for machine, system, wanted in (("x86_64", "linux", True), ("AMD64", "win32", True), ("arm64", "darwin", True),
                                    ("x86_64", "darwin", True), ("aarch64", "linux", False)):
        assert fast.marker.evaluate({"platform_machine": machine, "sys_platform": system, "extra": ""}) is wanted


def test_without_fastokens_auto_encodes_with_tokenizers_and_the_same_ids():
    """Where fastokens is not installed, `--encoder auto` falls back to tokenizers: the same ids and masks."""
    script = f"""
import sys
sys.modules["fastokens"] = None  # as if not installed
import json
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.exact import check_encoder
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.sources.conversations import to_example
from support.data import COLUMNS
tokenizer = load_tokenizer({str(EXAMPLE_TOKENIZER)!r})
encoder, reason = check_encoder(tokenizer, "auto")
rows = [json.loads(line) for line in open({str(next(EXAMPLE_DATA.glob('*.jsonl')))!r})][:40]
out = ChatEncoder(tokenizer).encode_batch([to_example(row, COLUMNS) for row in rows])
print(json.dumps([encoder is None, reason, out.input_ids.tolist(), out.loss_mask.tolist()]))
"""
    import json

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    assert done.returncode == 0, done.stderr
    absent, reason, ids, mask = json.loads(done.stdout)
    assert absent and "fastokens is not installed" in reason

    from support.data import COLUMNS

    from sft_tokenize.encoding.chat_encoder import ChatEncoder
    from sft_tokenize.encoding.exact import choose_encoder
    from sft_tokenize.encoding.tokenizer import load_tokenizer
    from sft_tokenize.sources.conversations import to_example

    pytest.importorskip("fastokens")
    tokenizer = load_tokenizer(EXAMPLE_TOKENIZER)
    rows = [json.loads(line) for line in next(EXAMPLE_DATA.glob("*.jsonl")).read_text().splitlines()][:40]
    fast = ChatEncoder(tokenizer, fast=choose_encoder(tokenizer, "fastokens"))
    assert fast.fast is not None
    out = fast.encode_batch([to_example(row, COLUMNS) for row in rows])
    assert (out.input_ids.tolist(), out.loss_mask.tolist()) == (ids, mask)
