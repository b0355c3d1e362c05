"""Every script of benchmarks/ runs at this commit: each on a tiny input (the bundled tokenizer, a few dozen
generated conversations), as a subprocess, and writes its results with the keys its readers expect.

The benchmarks are not timed tests; this keeps them from rotting between the runs that are (a mended encoder
signature broke `stages.py` once without any test noticing). Inputs are built under a scratch directory
(SFT_TOKENIZE_BENCH_DATA), never in the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import BIN, EXAMPLE_DATA, EXAMPLE_TOKENIZER, ROOT, file_module
from support.reference_templates import template

from sft_tokenize.read.cache import open_cache

BENCH = ROOT / "benchmarks"
TINY = ["--scale", "0.002", "--tokenizer", "example"]  # 22 long or 64 short conversations a unit



@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    """The scratch directories and environment every script of this module shares: inputs are built once, and
    the scripts that keep Prefect's embedded server up (`--prefect warm`) leave it to the next one."""
    root = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "SFT_TOKENIZE_BENCH_DATA": str(root / "data"), "HF_HUB_OFFLINE": "1",
           "SFT_TOKENIZE_BENCH_SAMPLE_SECONDS": "0.5"}  # the peaks are not judged here: a sample now and then
    yield {"root": root, "work": root / "work", "env": env}
    # A warm server of the shared work directory's Prefect home, if one is still up.
    subprocess.run([str(BIN / "sft-tokenize"), "server", "stop"], capture_output=True, timeout=120,
                   env={**env, "PREFECT_HOME": str(root / "work" / "prefect-home")})


def script(bench: dict, name: str, *args: str, **env: str) -> str:
    """Run benchmarks/NAME with ARGS to completion; its stdout. Fails with the end of its stderr if it fails."""
    done = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**bench["env"], **env}, timeout=600)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n" + "\n".join(done.stderr.splitlines()[-25:])
    return done.stdout


def committed(record: dict) -> None:
    """A results file names the commit it measured and whether the tree differed from it."""
    assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool), record


def test_build_inputs_prints_the_corpus_it_built(bench):
    out = script(bench, "build_inputs.py", "--shape", "short", "--scale", "0.002", "--tokenizer", "example",
                 "--stats", "10")
    files = [Path(line) for line in out.splitlines() if line.endswith(".jsonl")]
    assert files and all(f.is_file() and f.is_relative_to(bench["root"] / "data") for f in files)
    assert json.loads(out.strip().splitlines()[-1])["rows"] == 10


def test_run_every_pipeline_gives_the_same_tokens(bench):
    out = bench["root"] / "run"
    # Every pipeline but project-hf: the project's own branch with `--encoder hf` added, one more cold boot
    pipelines = "ceiling,hf,hf-fastokens,spawn,project,limits,stages"
    script(bench, "run.py", *TINY, "--shape", "short", "--sizes", "1", "--only", pipelines, "--out", str(out),
           "--work", str(bench["work"]))
    report = json.loads((out / "results.json").read_text())
    committed(report["machine"]["git"])
    runs = report["results"][0]["runs"]
    assert set(runs) == set(pipelines.split(","))
    for name in ("hf-fastokens", "spawn", "project"):
        assert runs[name]["identical"] is True, name
        assert runs[name]["rows"] == 64 and runs[name]["peak_pss_mib"] > 0, name
    assert runs["project"]["events"]["first_slice"] > 0 and runs["project"]["cache_hit_seconds"] > 0
    assert runs["project"]["back_to_back_seconds"] > 0 and runs["project"]["back_to_back_first_slice"] > 0
    assert runs["stages"]["details"]["seconds"].keys() == {"read", "render", "encode", "mask", "write"}
    assert runs["limits"]["details"]["identical_ids"] is True
    targets = {t["name"]: t["ok"] for t in report["targets"]}
    assert targets["identical input_ids and loss_mask in every run"] is True
    assert "Measured at commit" in (out / "results.md").read_text()


def test_from_the_big_size_on_only_the_project_and_the_strongest_peer_run():
    # The one thing a big size changes in run.py is which pipelines run (the smaller sizes' test above runs them
    # all at size 1): a big size's run would take the project's and the peer's fixed costs again for nothing more.
    run = file_module(BENCH / "run.py", "benchmark_run")
    every = list(run.DEFAULT_PIPELINES)
    assert run.pipelines_at(run.BIG - 1, every) == every
    assert run.pipelines_at(run.BIG, every) == run.pipelines_at(64, every) == ["hf-fastokens", "project", "project-hf"]


def test_pipelines_floor(bench):
    # whichever short corpus this module's scripts built first (they build several sizes): all of its rows
    corpus = sorted((bench["root"] / "data").glob("corpus-short-*/chat-00000.jsonl"))[0]
    result = json.loads(script(bench, "pipelines.py", "floor", str(corpus), "--tokenizer",
                               str(EXAMPLE_TOKENIZER)).strip().splitlines()[-1])
    assert result["rows"] == sum(1 for _ in corpus.open()) > 0 and result["encode_seconds"] > 0


def test_startup_traces_a_cold_run_and_a_hit(bench):
    out = bench["root"] / "startup"
    script(bench, "startup.py", "--repeats", "1", "--tokenizers", "example", "--data", "example", "--modes",
           "cold,hit", "--out", str(out), "--work", str(bench["root"] / "startup-work"))
    report = json.loads((out / "startup.json").read_text())
    committed(report["machine"]["git"])
    cold, hit = report["summary"]
    assert (cold["mode"], hit["mode"]) == ("cold", "hit") and cold["rows"] == 240
    assert cold["events"]["first_slice"] > 0 and cold["peak_pss_mib"] > 0


def test_incremental_grows(bench):
    out = bench["root"] / "incremental"
    script(bench, "incremental.py", *TINY, "--units", "1", "--growth", "0.1", "--prefect", "warm",
           "--out", str(out), "--work", str(bench["work"]))
    report = json.loads((out / "incremental-warm.json").read_text())
    committed(report["machine"]["git"])
    assert report["rows_added"] == 2 and report["runs"]["grown"]["rows"] == report["runs"]["cold"]["rows"] + 2
    assert report["runs"]["grown"]["build"]["slices_reused"] >= 1


def test_object_storage_compares_a_bucket_with_a_local_root(bench):
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    out = bench["root"] / "object-storage"
    script(bench, "object_storage.py", *TINY, "--units", "1", "--repeats", "1", "--out", str(out),
           "--work", str(bench["work"]))
    report = json.loads((out / "object_storage.json").read_text())
    committed(report["machine"]["git"])
    assert report["identical"] and [run["cache"][:5] for run in report["runs"]["bucket"]] == ["s3://"]
    assert report["bucket_vs_local"] > 0 and "Target:" in (out / "object_storage.md").read_text()


def test_planning_times_a_plan_locally_and_in_a_bucket(bench):
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    out = bench["root"] / "planning"
    script(bench, "planning.py", "--files", "30", "--out", str(out))
    report = json.loads((out / "planning.json").read_text())
    committed(report["machine"]["git"])
    assert set(report["runs"]) == {"local cold", "local warm", "bucket"}
    assert report["runs"]["bucket"]["object_gets"] == 30  # each small object's first rows, read once
    assert all(run["steps"]["resolve"] > 0 for run in report["runs"].values())


def test_templates_compares_qwen3_with_chatml(bench):
    qwen3 = bench["root"] / "qwen3.jinja"
    qwen3.write_text(template("modern/qwen3"), encoding="utf-8")
    out = bench["root"] / "templates"
    script(bench, "templates.py", *TINY, "--repeats", "1", "--out", str(out), "--work", str(bench["work"]),
           "--template", str(qwen3), SFT_TOKENIZE_SERVER_IDLE="60")
    report = json.loads((out / "templates.json").read_text())
    committed(report["machine"]["git"])
    assert set(report["runs"]) == {"chatml", "qwen3"} and report["throughput_ratio"] > 0


def test_images_against_skyrl(bench, tmp_path):
    pytest.importorskip("torch", reason="the image collator images.py times makes tensors (the trainers extra)")
    from support.vision import qwen_vl

    processor = tmp_path / "processor"
    qwen_vl(processor)
    out = bench["root"] / "images"
    script(bench, "images.py", "--rows", "4", "--pool", "2", "--sizes", "1", "--batch", "2", "--batches", "1",
           "--sample", "4", "--processor", str(processor), "--out", str(out), "--work", str(bench["work"]))
    report = json.loads((out / "results.json").read_text())
    committed(report["machine"]["git"])
    assert report["runs"]["project-1x"]["rows"] == report["runs"]["skyrl-1x"]["rows"] == 4
    assert report["collate"]["rows_checked"] == 4 and (out / "results.md").is_file()


def test_packing_against_trl(bench):
    pytest.importorskip("trl", reason="packing.py compares with TRL's pack_dataset (the trainers extra)")
    out, work = bench["root"] / "packing", bench["root"] / "packing-work"
    script(bench, "packing.py", *TINY, "--rows", "1000", "--out", str(out), "--work", str(work))
    report = json.loads((out / "packing.json").read_text())
    committed(report["git"])
    assert [row["length"] for row in report["corpus"]] == [4096, 8192] and report["build"]


def test_mixture_and_digest_on_a_cache(bench, example_cache):
    cache = example_cache
    out = bench["root"] / "mixture"
    script(bench, "mixture.py", str(cache), "--rows", "3000", "--out", str(out))
    mixture = json.loads((out / "mixture.json").read_text())
    committed(mixture["git"])
    assert mixture["index_rows"] > 0 and len(mixture["shares"]) == 3
    digests = script(bench, "digest.py", str(cache))
    assert digests.startswith(f"# {Path(cache).name}") and "loss_mask" in digests and "input_ids" in digests


def test_example_data_is_where_the_scripts_expect_it():
    # startup.py and run.py's warm-up read the bundled example; a move would break them before any timing.
    assert (EXAMPLE_DATA / "chat-00000.jsonl").is_file() and (EXAMPLE_TOKENIZER / "tokenizer.json").is_file()


def test_export_throughput_on_a_cache(bench, example_cache):
    out = bench["root"] / "export"
    script(bench, "export.py", str(example_cache), "--copies", "2", "--out", str(out))
    results = json.loads((out / "export.json").read_text())
    committed(results["git"])
    assert set(results["targets"]) == {"megatron", "mds", "litdata"}
    assert results["rows"] == 2 * len(open_cache(example_cache))
    for r in results["targets"].values():
        assert r["cache_mb_per_cpu_s"] > 0 and r["export_bytes"] > results["tokens"]
