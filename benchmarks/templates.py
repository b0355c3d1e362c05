"""A history-rewriting template against ChatML: the same corpus and tokenizer, masked by each, side by side.

    python benchmarks/templates.py                    # 1x (~27M tokens), 2 workers, ChatML vs Qwen3, twice each
    python benchmarks/templates.py --units 8 --repeats 1     # the sweep's 8x (~219M tokens)
    python benchmarks/templates.py --scale 0.1 --repeats 1     # a quick check

The benchmark tokenizer (build_inputs.py, ChatML template) is copied with another template, by default
Qwen3's from the reference templates beside the project (../shared/chat_templates/modern/qwen3.jinja), and
the control tokens that template writes added. Each template's `sft-tokenize run` is run cold, in turn
(ChatML, other, ChatML, other, ...), so both see the same machine; the report gives each one's median wall
time and throughput, their ratio, how many rows took the exact path and the share filled from skeletons. Results:
--out/templates.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from build_inputs import CorpusSpec, add_tokenizer_argument, build, tokenizer_for  # noqa: E402
from measure import measure  # noqa: E402
from run import machine, project_command, warm_up_prefect  # noqa: E402

DEFAULT_TEMPLATE = ROOT.parent / "shared" / "chat_templates" / "modern" / "qwen3.jinja"
# Tokens the Qwen family's templates write besides ChatML's, added as ordinary tokens (as Qwen's tokenizer has them).
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def with_template(tokenizer_dir: Path, template: Path, out: Path) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_tokens(QWEN_ADDED)
    tokenizer.chat_template = template.read_text()
    shutil.rmtree(out, ignore_errors=True)
    tokenizer.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="corpus unit size (1 = ~27M tokens)")
    parser.add_argument("--units", type=int, default=1, help="corpus units, as the sweep's sizes (default 1)")
    parser.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE, help="the template set against ChatML")
    parser.add_argument("--repeats", type=int, default=2, help="cold runs of each template (default 2)")
    parser.add_argument("--workers", type=int, default=2)
    add_tokenizer_argument(parser)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--project-args", default="", metavar="ARGS",
                        help="extra flags for both `sft-tokenize run`s, e.g. '--encoder hf'")
    args = parser.parse_args(argv)
    if not args.template.is_file():
        parser.error(f"template not found: {args.template} (pass --template FILE)")

    spec = CorpusSpec(scale=args.scale)
    _, units = build(spec, args.units, tokenizer=args.tokenizer == "bench")
    chatml = tokenizer_for(args.tokenizer, spec)
    other = with_template(chatml, args.template, args.work / f"tokenizer-{args.template.stem}")
    env = {"PREFECT_HOME": str(args.work / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "HF_HUB_OFFLINE": "1"}
    warm_up_prefect(env, args.work)
    runs: dict[str, list[dict]] = {"chatml": [], args.template.stem: []}
    for repeat in range(args.repeats):
        for name, tokenizer in (("chatml", chatml), (args.template.stem, other)):
            cache_dir = args.work / f"templates-{name}"
            shutil.rmtree(cache_dir, ignore_errors=True)
            measured = measure(project_command(units, tokenizer, cache_dir, args.workers,
                                               ["-q", *shlex.split(args.project_args)]), env=env, cwd=ROOT,
                               log=args.work / "logs" / f"templates-{name}-{repeat}.log")
            manifest = json.loads((Path(measured.stdout.strip().splitlines()[-1]) / "manifest.json").read_text())
            run = {"seconds": round(measured.seconds, 2), "tokens": manifest["tokens"],
                   "trained_tokens": manifest["trained_tokens"], "rows": manifest["rows"],
                   "rows_exact": manifest["masks"]["rows_exact"],
                   # rows filled from a skeleton rather than rendered (docs/masks.md, "Skeletons")
                   "rows_filled": manifest["build"].get("skeletons", {}).get("rows_filled", 0),
                   "peak_anon_mib": round(measured.peak_anon_mib)}
            runs[name].append(run)
            rate = run["tokens"] / run["seconds"]
            print(f"{name:>8} run {repeat + 1}: {run['seconds']:.1f} s, {rate:,.0f} tokens/s, "
                  f"{run['rows_exact']} rows on the exact path, {run['rows_filled'] / max(run['rows'], 1):.0%} "
                  "filled from skeletons", flush=True)
            shutil.rmtree(cache_dir, ignore_errors=True)
    summary = {}
    for name, measured_runs in runs.items():
        seconds = statistics.median(r["seconds"] for r in measured_runs)
        summary[name] = {"median_seconds": seconds, "tokens_per_second": round(measured_runs[0]["tokens"] / seconds),
                         "runs": measured_runs}
    ratio = summary[args.template.stem]["tokens_per_second"] / summary["chatml"]["tokens_per_second"]
    report = {"machine": machine(), "tokenizer": str(chatml),
              "scale": args.scale, "units": args.units, "workers": args.workers, "template": args.template.name,
              "project_args": args.project_args, "runs": summary,
              "throughput_ratio": round(ratio, 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    flags = "".join(c if c.isalnum() else "-" for c in args.project_args).strip("-")
    name = "templates" + (f"-{args.units}x" if args.units != 1 else "") + (f"-{flags}" if flags else "")
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    verdict = "PASS" if ratio >= 0.9 else "MISS"
    print(f"{verdict}: {args.template.stem} at {ratio:.2f}x ChatML's throughput (target >= 0.90x)")


if __name__ == "__main__":
    main()
