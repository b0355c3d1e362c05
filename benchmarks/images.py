"""Image-row benchmark (issue 27): this project's `sft-tokenize run --processor` against SkyRL's path as it runs.

    python benchmarks/images.py                         # the full run: SkyRL 1x, the project 1x and 4x, collate
    python benchmarks/images.py --smoke                 # 40-row units, to benchmarks/work/images-smoke/results
    python benchmarks/images.py --rows 200 --sizes 1,2 --out /tmp/images

Inputs (image_inputs.py, under benchmarks/data/): a Qwen2.5-VL processor (Qwen's real 151k tokenizer, the
Qwen-VL chat template, the published image limits) and a seeded corpus of image-chat rows naming JPEGs drawn
from a pool. Pipelines, each a subprocess whose process tree's peak anonymous RAM is sampled (measure.py):

    skyrl    SkyRL PR #1971's path: per row, processor.apply_chat_template(tokenize=True, return_dict=True) on the
             prompt (all but the last assistant turn, add_generation_prompt=True) and on the whole conversation;
             the last assistant turn trained (loss_mask 1 after the prompt's length); rows over --max-length
             dropped; input_ids, loss_mask, float32 pixel_values and image_grid_thw written through ArrowWriter
             and saved with save_to_disk. One process: the processor does not pickle into a worker pool.
    project  `sft-tokenize run UNITS --processor DIR --train-on last_assistant --max-length N --truncation drop
             --image-access local --workers W` (its inputs name their images by absolute path), cold (its embedded
             Prefect server starts in the run): images stored as their encoded bytes and grids, no pixels.

SkyRL's per-row cost does not depend on the corpus size, so it runs at the smallest size only. Checks (the run
fails if one does not hold): on a sample of rows, the project's input_ids and image_grid_thw equal SkyRL's,
and its loss_mask too but for what the template writes after the final <|im_end|> (SkyRL trains everything
after the prompt); the ImageCollator's pixel_values for a batch equal SkyRL's stored ones. Collate cost:
ms per batch of --batch rows for the project's ImageCollator (decode + image processor) and for reading
SkyRL's stored rows into tensors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(ROOT))  # sft_tokenize without an install; after PYTHONPATH (--project-src)

from image_inputs import ImageCorpusSpec, build_corpus, load_processor, processor_dir  # noqa: E402
from measure import measure  # noqa: E402
from run import ENV, ad_hoc_environment, machine, mib, prefect_env  # noqa: E402

DEFAULT_ROWS = 300
WRITE_ROWS = 8  # rows per ArrowWriter table: SkyRL's memory stays bounded by a batch
IM_END = "<|im_end|>"


# -- SkyRL's path ------------------------------------------------------------------------------------------------


def read_rows(files: list[Path]):
    """The rows of the JSONL files, image paths made absolute (relative ones resolve against the file's
    directory, as the project resolves them). Read with json: load_dataset("json") would unify the parts into
    one struct whose `image` key every text part then holds, and the Qwen-VL template takes any such part for
    an image."""
    for path in files:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line)
                for message in row["messages"]:
                    if isinstance(message["content"], list):
                        message["content"] = [{**part, "image": str(path.parent / part["image"])} if
                                              part.get("type") == "image" else part for part in message["content"]]
                yield row


def skyrl_table(batch: list[dict]):
    """Rows (numpy) as one Arrow table of SkyRL's columns, built from flat arrays (no per-value Python objects)."""
    import numpy as np
    import pyarrow as pa

    def lists(arrays: list, dtype) -> pa.ListArray:
        offsets = np.cumsum([0] + [len(a) for a in arrays]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays).astype(dtype, copy=False)))

    def nested(arrays: list, dtype) -> pa.ListArray:  # 2D arrays -> list<list<dtype>>
        width = arrays[0].shape[1]
        values = np.concatenate(arrays).reshape(-1).astype(dtype, copy=False)
        inner = pa.ListArray.from_arrays(pa.array(np.arange(0, len(values) + 1, width, dtype=np.int32)),
                                         pa.array(values))
        outer = np.cumsum([0] + [len(a) for a in arrays]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(outer), inner)

    return pa.table({"input_ids": lists([r["input_ids"] for r in batch], np.int32),
                     "loss_mask": lists([r["loss_mask"] for r in batch], np.int8),
                     "pixel_values": nested([r["pixel_values"] for r in batch], np.float32),
                     "image_grid_thw": nested([r["image_grid_thw"] for r in batch], np.int32)})


def skyrl_path(rows, processor, out_dir: Path, max_length: int = 8192) -> dict:
    """SkyRL's image tokenization as it runs: the processor twice per row, sequentially; pixels stored."""
    import numpy as np
    from datasets import Dataset, Features, List, Value
    from datasets.arrow_writer import ArrowWriter

    features = Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
                         "pixel_values": List(List(Value("float32"))), "image_grid_thw": List(List(Value("int32")))})
    staging = out_dir.with_name(out_dir.name + ".staging.arrow")
    writer = ArrowWriter(path=str(staging), features=features, writer_batch_size=WRITE_ROWS)
    counts = {"rows": 0, "dropped": 0, "tokens": 0, "images": 0}
    batch: list[dict] = []
    for row in rows:
        messages = row["messages"]
        prompt = processor.apply_chat_template(messages[:-1], tokenize=True, return_dict=True,
                                               add_generation_prompt=True)
        full = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
        ids = np.asarray(full["input_ids"][0], dtype=np.int32)
        if len(ids) > max_length:
            counts["dropped"] += 1
            continue
        mask = np.zeros(len(ids), dtype=np.int8)
        mask[len(prompt["input_ids"][0]):] = 1
        batch.append({"input_ids": ids, "loss_mask": mask, "pixel_values": np.asarray(full["pixel_values"]),
                      "image_grid_thw": np.asarray(full["image_grid_thw"])})
        counts["rows"] += 1
        counts["tokens"] += len(ids)
        counts["images"] += len(batch[-1]["image_grid_thw"])
        if len(batch) == WRITE_ROWS:
            writer.write_table(skyrl_table(batch))
            batch = []
    if batch:
        writer.write_table(skyrl_table(batch))
    writer.finalize()
    Dataset.from_file(str(staging)).save_to_disk(str(out_dir))  # the cache: a copy, as SkyRL's save_to_disk
    staging.unlink()
    return counts


# -- checks and collate cost -------------------------------------------------------------------------------------


def skyrl_collate(rows: list[dict], pad_token_id: int) -> dict:
    """SkyRL's stored rows (numpy) as a padded batch of tensors: ids, attention, labels, pixels, grids."""
    import numpy as np
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    ids = np.full((len(rows), width), pad_token_id, dtype=np.int64)
    labels = np.full((len(rows), width), -100, dtype=np.int64)
    attention = np.zeros((len(rows), width), dtype=np.int64)
    for k, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[k, :n], attention[k, :n] = r["input_ids"], 1
        labels[k, :n] = np.where(r["loss_mask"] == 1, r["input_ids"], -100)
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attention),
            "labels": torch.from_numpy(labels),
            "pixel_values": torch.from_numpy(np.concatenate([r["pixel_values"] for r in rows])),
            "image_grid_thw": torch.from_numpy(np.concatenate([r["image_grid_thw"] for r in rows]).astype(np.int64))}


def check_rows(project, skyrl, sample: int, end_id: int) -> dict:
    """The project's rows against SkyRL's on `sample` seeded rows; raises AssertionError naming the first that
    differs."""
    import numpy as np

    assert len(project) == len(skyrl), f"the project kept {len(project)} rows, SkyRL's path {len(skyrl)}"
    picked = sorted(random.Random(0).sample(range(len(skyrl)), min(sample, len(skyrl))))
    tail_only = 0
    for i in picked:
        mine, theirs = project[i], skyrl[i]
        ids = np.asarray(mine["input_ids"])
        assert np.array_equal(ids, theirs["input_ids"]), f"row {i}: input_ids differ"
        assert np.array_equal(np.asarray(mine["image_grid_thw"]), theirs["image_grid_thw"]), f"row {i}: grids differ"
        differ = np.flatnonzero(np.asarray(mine["loss_mask"]) != theirs["loss_mask"])
        after_end = np.flatnonzero(ids == end_id)[-1] + 1
        assert differ.size == 0 or differ.min() >= after_end, f"row {i}: loss_mask differs at {differ[:5]}"
        tail_only += bool(differ.size)
    return {"rows_checked": len(picked), "rows_mask_differs_after_final_im_end": tail_only}


def collate(project_cache: Path, skyrl_out: Path, batch: int, batches: int, sample: int) -> dict:
    """Checks, then ms per batch of the project's ImageCollator and of SkyRL's stored rows into tensors."""
    import numpy as np
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from sft_tokenize.read.image_collator import ImageCollator

    manifest = json.loads((project_cache / "manifest.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(manifest["tokenizer"])
    project = load_from_disk(str(project_cache))
    skyrl = load_from_disk(str(skyrl_out)).with_format("numpy")
    report = check_rows(project, skyrl, sample, tokenizer.convert_tokens_to_ids(IM_END))
    collator = ImageCollator(project_cache, pad_token_id=tokenizer.pad_token_id)
    rng = random.Random(1)
    plan = [rng.sample(range(len(skyrl)), batch) for _ in range(batches + 1)]  # the first one untimed (warm-up)
    times: dict[str, list[float]] = {"project": [], "skyrl": []}
    for b, indices in enumerate(plan):
        started = time.perf_counter()
        made = collator([project[i] for i in indices])
        middle = time.perf_counter()
        stored = skyrl_collate([skyrl[i] for i in indices], tokenizer.pad_token_id)
        ended = time.perf_counter()
        if b == 0:
            pixels_equal = bool(np.array_equal(made["pixel_values"].numpy(), stored["pixel_values"].numpy()))
            max_diff = float(np.abs(made["pixel_values"].numpy() - stored["pixel_values"].numpy()).max())
            assert np.allclose(made["pixel_values"].numpy(), stored["pixel_values"].numpy(), atol=1e-6), \
                f"the collator's pixel_values differ from SkyRL's stored ones by up to {max_diff}"
            for key in ("input_ids", "attention_mask", "image_grid_thw"):
                assert made[key].tolist() == stored[key].tolist(), f"collated {key} differ"
            report.update(pixels_exact=pixels_equal, pixels_max_abs_diff=max_diff,
                          pixel_mib_per_batch=round(made["pixel_values"].numpy().nbytes / 2**20, 1))
            continue
        times["project"].append(middle - started)
        times["skyrl"].append(ended - middle)
    for name, values in times.items():
        report[f"{name}_ms_per_batch"] = round(1000 * statistics.median(values), 1)
        report[f"{name}_ms_per_batch_mean"] = round(1000 * statistics.fmean(values), 1)
    report.update(batch_rows=batch, batches_timed=batches)
    return report


# -- the benchmark -----------------------------------------------------------------------------------------------


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_skyrl(files: list[Path], processor: Path, out: Path, max_length: int, work: Path, env: dict) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "skyrl", *map(str, files), "--processor", str(processor),
               "--to", str(out), "--max-length", str(max_length)]
    measured = measure(command, env={**env, "HF_DATASETS_CACHE": str(work / "hf-cache")}, cwd=ROOT,
                       log=work / "logs" / "skyrl.log")
    return {**json.loads(measured.stdout.strip().splitlines()[-1]), "seconds": measured.seconds,
            "peak_anon_mib": measured.peak_anon_mib, "cache_bytes": directory_bytes(out),
            "peak_processes": mib(measured.peak_processes)}


def project_command(files: list[Path], processor: Path, cache_dir: Path, workers: int, max_length: int,
                    extra: list[str]) -> list[str]:
    script = Path(sys.executable).with_name("sft-tokenize")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "sft_tokenize.cli.main"]
    return [*base, "run", *map(str, files), "--processor", str(processor), "--cache-dir", str(cache_dir),
            "--workers", str(workers), "--train-on", "last_assistant", "--max-length", str(max_length),
            "--truncation", "drop", "--image-access", "local", *extra]  # its own inputs name their images by path


def run_project(files: list[Path], processor: Path, cache_dir: Path, args, work: Path, env: dict, log: str) -> dict:
    command = project_command(files, processor, cache_dir, args.workers, args.max_length,
                              shlex.split(args.project_args))
    measured = measure(command, env=env, cwd=ROOT, log=work / "logs" / f"{log}.log")
    cache = Path(measured.stdout.strip().splitlines()[-1])
    manifest = json.loads((cache / "manifest.json").read_text())
    return {"rows": manifest["rows"], "dropped": sum(manifest["dropped"].values()), "tokens": manifest["tokens"],
            "images": manifest["images"]["images"], "seconds": measured.seconds,
            "peak_anon_mib": measured.peak_anon_mib, "cache_bytes": directory_bytes(cache),
            "image_bytes": manifest["images"]["image_bytes"], "slices": len(manifest["shards"]),
            "timings": manifest.get("timings"), "cache": str(cache), "peak_processes": mib(measured.peak_processes)}


def warm_up(files: list[Path], processor: Path, work: Path, env: dict) -> None:
    """Untimed, as on a machine where Prefect and this processor are in use: the Prefect database, and the
    tokenizer prepared in the work directory's user cache, by a run on a few rows."""
    print("warming up: the Prefect database and the tokenizer (untimed) ...", flush=True)
    Path(env["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    few = work / "warm-up" / "rows.jsonl"
    few.parent.mkdir(parents=True, exist_ok=True)
    rows = itertools.islice(read_rows(files[:1]), 4)  # elsewhere than the corpus: its image paths absolute
    few.write_text("".join(json.dumps(row) + "\n" for row in rows))
    measure(project_command([few], processor, work / "warm-up" / "cache", 1, 1 << 20, []), env=env, cwd=ROOT,
            log=work / "logs" / "warm-up.log")
    shutil.rmtree(work / "warm-up", ignore_errors=True)


def project_source(spec: str, work: Path) -> tuple[dict, str]:
    """The environment that makes the project's processes (the CLI, the collator's) import `spec`: `tree`, the
    working tree (the editable install); else a commit, extracted once under the work directory with the
    installed package's layout (a commit from before the flows moved into the package gets its top flows/ and tasks/
    moved there)."""
    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *words], check=True, capture_output=True, text=True).stdout

    if spec == "tree":
        dirty = " with uncommitted changes" if git("status", "--porcelain", "--", "sft_tokenize", "flows",
                                                    "tasks").strip() else ""
        return {}, f"the working tree at {git('rev-parse', 'HEAD')[:12]}{dirty}"
    sha = git("rev-parse", "--verify", f"{spec}^{{commit}}").strip()
    out = work / f"src-{sha[:12]}"
    if not (out / "sft_tokenize" / "flows").is_dir():
        tmp = work / f".src-{sha[:12]}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha, "sft_tokenize", "flows", "tasks"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        for name in ("flows", "tasks"):
            if not (tmp / "sft_tokenize" / name).is_dir():
                (tmp / name).rename(tmp / "sft_tokenize" / name)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return {"PYTHONPATH": str(out)}, f"commit {sha[:12]} (extracted to {out.relative_to(ROOT)})"


def per_second(run: dict) -> dict:
    return {f"{k}_per_second": run[k] / run["seconds"] for k in ("rows", "tokens", "images")}


def main(argv: list[str] | None = None) -> None:
    from images_report import markdown, targets

    args = parse_args(argv)
    ad_hoc_environment()
    work, out = args.work.absolute(), args.out.absolute()
    shutil.rmtree(work / "runs", ignore_errors=True)
    env = prefect_env({**ENV, "PREFECT_HOME": str(work / "prefect-home")}, "fresh", work)
    source_env, source = project_source(args.project_src, work)
    env.update(source_env)
    spec = ImageCorpusSpec(rows=args.rows, pool=args.pool)
    processor = args.processor.absolute() if args.processor else processor_dir()
    units = build_corpus(spec, max(args.sizes))
    warm_up(units, processor, work, env)
    report = {"command": shlex.join(["python", "benchmarks/images.py", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine(), "workers": args.workers, "sizes": args.sizes, "rows_per_unit": args.rows,
              "max_length": args.max_length, "corpus": {**spec.__dict__, "directory": str(spec.directory)},
              "processor": str(processor), "project_source": source, "runs": {}}
    first = min(args.sizes)
    skyrl_out = work / "runs" / "skyrl"
    print(f"{first}x skyrl ...", end=" ", flush=True)
    skyrl_out.parent.mkdir(parents=True, exist_ok=True)
    run = run_skyrl(units[:first], processor, skyrl_out, args.max_length, work, env)
    report["runs"][f"skyrl-{first}x"] = {**run, **per_second(run), "size": first, "pipeline": "skyrl"}
    print(f"{run['seconds']:.1f} s, {run['rows'] / run['seconds']:.2f} rows/s, peak {run['peak_anon_mib']:,.0f} MiB",
          flush=True)
    for size in args.sizes:
        print(f"{size}x project ...", end=" ", flush=True)
        run = run_project(units[:size], processor, work / "runs" / f"project-{size}x", args, work, env,
                          f"project-{size}x")
        report["runs"][f"project-{size}x"] = {**run, **per_second(run), "size": size, "pipeline": "project"}
        print(f"{run['seconds']:.1f} s, {run['rows'] / run['seconds']:.1f} rows/s, "
              f"peak {run['peak_anon_mib']:,.0f} MiB", flush=True)
    print("checks and collate cost ...", flush=True)
    command = [sys.executable, str(Path(__file__).resolve()), "collate", report["runs"][f"project-{first}x"]["cache"],
               str(skyrl_out), "--batch", str(args.batch), "--batches", str(args.batches), "--sample", str(args.sample)]
    measured = measure(command, env=env, cwd=ROOT, log=work / "logs" / "collate.log")
    report["collate"] = json.loads(measured.stdout.strip().splitlines()[-1])
    report["targets"] = targets(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(markdown(report))
    if not args.keep:
        shutil.rmtree(work / "runs", ignore_errors=True)
    print()
    print(markdown(report))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=None, help=f"rows per unit (default {DEFAULT_ROWS}; --smoke 40)")
    parser.add_argument("--sizes", default="1,4", help="the project's sizes in units; SkyRL runs the smallest "
                                                       "(default 1,4)")
    parser.add_argument("--workers", type=int, default=2, help="the project's --workers (default 2)")
    parser.add_argument("--pool", type=int, default=ImageCorpusSpec.pool,
                        help=f"distinct JPEGs the rows draw from (default {ImageCorpusSpec.pool}; a new pool is "
                             "drawn for another value)")
    parser.add_argument("--processor", type=Path, default=None,
                        help="a Qwen2.5-VL processor directory (tokenizer with the vision tokens, chat template, "
                             "preprocessor_config.json) instead of the one built on Qwen's real tokenizer")
    parser.add_argument("--max-length", type=int, default=8192, help="longer rows are dropped (default 8192)")
    parser.add_argument("--batch", type=int, default=8, help="rows per collated batch (default 8)")
    parser.add_argument("--batches", type=int, default=10, help="batches timed (default 10)")
    parser.add_argument("--sample", type=int, default=50, help="rows compared between the caches (default 50)")
    parser.add_argument("--smoke", action="store_true", help="a quick check: 40-row units, sizes 1,2, 3 batches, "
                                                             "results in the work directory")
    parser.add_argument("--out", type=Path, default=None, help="results.json and results.md (default "
                                                              "benchmarks/results/images)")
    parser.add_argument("--work", type=Path, default=None, help="scratch outputs, logs, Prefect's home (default "
                                                               "benchmarks/work/images)")
    parser.add_argument("--keep", action="store_true", help="keep the caches in the work directory")
    parser.add_argument("--project-args", default="", metavar="ARGS", help="extra flags for `sft-tokenize run`")
    parser.add_argument("--project-src", default="tree", metavar="tree|COMMIT",
                        help="the project's code the runs import: tree, the working tree (default), or a commit "
                             "(e.g. HEAD), extracted under the work directory")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.sizes, args.batches = args.rows or 40, "1,2" if args.sizes == "1,4" else args.sizes, 3
    args.rows = args.rows or DEFAULT_ROWS
    args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    args.work = args.work or HERE / "work" / ("images-smoke" if args.smoke else "images")
    args.out = args.out or (args.work / "results" if args.smoke else HERE / "results" / "images")
    if not args.sizes or min(args.sizes) < 1 or args.rows < args.batch or args.workers < 1 or args.pool < 1:
        parser.error("--sizes must be whole units >= 1, --rows at least --batch, --workers and --pool >= 1")
    return args


def subcommand(argv: list[str]) -> None:
    """`skyrl FILES --processor DIR --to OUT --max-length N` and `collate PROJECT SKYRL ...`: one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("skyrl", "collate"))
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--processor", type=Path)
    parser.add_argument("--to", type=Path)
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--sample", type=int, default=50)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.what == "skyrl":
        result = skyrl_path(read_rows(args.paths), load_processor(args.processor), args.to, args.max_length)
    else:
        result = collate(args.paths[0], args.paths[1], args.batch, args.batches, args.sample)
    print(json.dumps({**result, "inner_seconds": round(time.perf_counter() - started, 3)}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("skyrl", "collate"):
        subcommand(sys.argv[1:])
    else:
        main()
