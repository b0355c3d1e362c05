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
    for expected in ("sft_tokenize/flows/tokenize_dataset.py", "sft_tokenize/flows/cli.py",
                     "sft_tokenize/tasks/tokenize_slice.py", "sft_tokenize/format/FORMAT.md",
                     "sft_tokenize/read/cache.py"):
        assert expected in names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    script = "sft-tokenize = sft_tokenize.flows.resident:console_main"
    assert script in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_copy_runs_the_quickstart_outside_the_checkout(wheel, tmp_path, prefect_home):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(target), "PREFECT_HOME": str(prefect_home),
           "SFT_TOKENIZE_SERVER_IDLE": "0"}
    env.pop("PREFECT_API_URL", None)
    code = "import sft_tokenize.flows.cli as c, sys; print(c.__file__, file=sys.stderr); sys.exit(c.main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "run", str(EXAMPLE_DATA), "--tokenizer", str(EXAMPLE_TOKENIZER),
                           "--cache-dir", str(tmp_path / "cache")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(target / "sft_tokenize" / "flows" / "cli.py") in done.stderr
    cache = Path(done.stdout.strip().splitlines()[-1])
    assert cache.parent == tmp_path / "cache" and (cache / "manifest.json").is_file()
