"""`inspect --lengths` and `run --plan-only` from the command line, as a user runs them."""

from __future__ import annotations

import json
import re

from support.cli import assert_clean_error, cli, run_args
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.flows.length_report import cache_costs


def test_inspect_lengths_prints_the_histograms_and_the_table_and_the_same_as_json(tmp_path, cli_home):
    cache = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path / "cache")))
    text = cli("inspect", str(cache), "--lengths", "--at", "200", home=cli_home)
    assert text.returncode == 0, text.stderr
    histogram = text.stdout.split("tokens per row:\n")[1].split("\n\n")[0].splitlines()
    assert sum(int(line.rsplit(None, 1)[1].replace(",", "")) for line in histogram) == 240
    table = text.stdout.split("at each length")[1].splitlines()[2:]
    assert [re.split(r"\s+", line.strip())[0] for line in table] == ["200", "512"]
    as_json = cli("inspect", str(cache), "--lengths", "--at", "200", "--json", home=cli_home)
    assert json.loads(as_json.stdout) == json.loads(json.dumps(cache_costs(str(cache), [200])))
    bad = cli("inspect", str(cache), "--lengths", "--at", "0", home=cli_home)
    assert_clean_error(bad, 2, "--at")


def test_plan_only_writes_nothing_starts_no_prefect_and_says_what_a_run_would_do(tmp_path, cli_home, api_url):
    root, home = tmp_path / "cache", cli_home
    home.mkdir()
    dry = cli(*run_args([EXAMPLE_DATA], root, "--plan-only"), home=home)
    assert dry.returncode == 0, dry.stderr
    assert not root.exists() and list(home.iterdir()) == []  # no cache root, no Prefect database
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in dry.stdout.splitlines())
    assert fields["cache"].endswith(": not published") and fields["slices"].startswith("4 (340 kB")
    assert fields["stored"].startswith("0 slices")
    estimated = int(re.search(r"about [\d,]+ rows, ([\d,]+) tokens", fields["estimate"])[1].replace(",", ""))
    built = cli(*run_args([EXAMPLE_DATA], root), home=home, api_url=api_url)
    assert built.returncode == 0, built.stderr
    tokens = json.loads((root / built.stdout.split()[-1].rsplit("/", 1)[1] / "manifest.json").read_text())["tokens"]
    assert abs(estimated - tokens) <= 0.1 * tokens
    again = cli(*run_args([EXAMPLE_DATA], root, "--plan-only"), home=home)
    assert again.stdout.strip() == f"cache  {built.stdout.split()[-1]}: published, nothing to tokenize"
