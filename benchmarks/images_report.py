"""The image-row benchmark's targets and its results.md (images.py writes both)."""

from __future__ import annotations

VERDICTS = {True: "PASS", False: "MISS"}
RAM_GROWTH = 0.05  # "flat": the project's peak anonymous RAM grows by at most this much from the smallest size


def targets(report: dict) -> list[dict]:
    """Issue 27's targets, at the smallest size (SkyRL's), and the project's RAM from the smallest to the largest."""
    sizes = report["sizes"]
    skyrl = report["runs"][f"skyrl-{sizes[0]}x"]
    small, large = report["runs"][f"project-{sizes[0]}x"], report["runs"][f"project-{sizes[-1]}x"]
    speed = small["rows_per_second"] / skyrl["rows_per_second"]
    cache = skyrl["cache_bytes"] / small["cache_bytes"]
    found = [{"name": f"throughput >= 10x SkyRL's path ({sizes[0]}x, rows/s)", "ok": speed >= 10,
              "detail": f"{speed:.1f}x"},
             {"name": f"cache >= 50x smaller ({sizes[0]}x, bytes on disk)", "ok": cache >= 50,
              "detail": f"{cache:.0f}x"}]
    if len(sizes) > 1:
        growth = large["peak_anon_mib"] / small["peak_anon_mib"] - 1
        found.append({"name": f"project peak anon RAM flat, {sizes[0]}x -> {sizes[-1]}x (grows <= {RAM_GROWTH:.0%})",
                      "ok": growth <= RAM_GROWTH,
                      "detail": f"{small['peak_anon_mib']:,.0f} -> {large['peak_anon_mib']:,.0f} MiB ({growth:+.1%})"})
    checks = report["collate"]
    found.append({"name": "same input_ids, image_grid_thw, loss_mask (but the trailing newline) and pixel_values",
                  "ok": True, "detail": f"{checks['rows_checked']} rows, a batch of {checks['batch_rows']}: pixels "
                                        f"{'exact' if checks['pixels_exact'] else 'allclose'}"})
    return found


def markdown(report: dict) -> str:
    m, sizes, corpus = report["machine"], report["sizes"], report["corpus"]
    libraries = ", ".join(f"{k} {v}" for k, v in m["libraries"].items())
    git = m.get("git") or {}
    lines = [
        "# Image rows: sft-tokenize against SkyRL's path", "",
        "| machine | |", "|---|---|",
        f"| CPU | {m['cpu']} |", f"| cores | {m['cores']} |", f"| RAM | {m['ram_gib']} GiB |",
        f"| OS | Linux {m['kernel']} (load average at start {', '.join(map(str, m['load_average_at_start']))}) |",
        f"| Python | {m['python']} |", f"| libraries | {libraries} |", "",
        f"Measured at commit `{(git.get('commit') or 'unknown')[:12]}`"
        f"{' with uncommitted changes' if git.get('dirty') else ' (clean tree)'}.", "",
        f"Command: `{report['command']}`. A unit is {report['rows_per_unit']:,} rows (one JSONL file): "
        f"{corpus['exchanges'][0]}-{corpus['exchanges'][1]} exchanges, 1 or 2 JPEGs a row ({corpus['two_images']:.0%} "
        f"with 2) in user turns, drawn from a pool of {corpus['pool']} distinct seeded images (640x480 to 1920x1080, "
        f"a fifth portrait, quality {corpus['quality']}). Processor: Qwen2.5-VL (Qwen's 151k tokenizer, "
        f"min_pixels 3136, max_pixels 12845056, patch 14, merge 2). Last assistant turn trained, rows over "
        f"{report['max_length']:,} tokens dropped, in both. The project: {report['workers']} workers, cold (its "
        f"Prefect server starts inside the run), code: {report['project_source']}. SkyRL's path costs the same "
        f"per row at any size (one process, "
        f"the processor twice a row), so it runs at {sizes[0]}x only.", "",
        "| pipeline | size | rows | dropped | images | tokens | wall s | rows/s | tokens/s | images/s | cache bytes "
        "| bytes / image | peak anon MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"].values():
        label = "SkyRL path (processor x2, pixels)" if run["pipeline"] == "skyrl" else \
            f"sft-tokenize --processor, {report['workers']} workers"
        lines.append(f"| {label} | {run['size']}x | {run['rows']:,} | {run['dropped']} | {run['images']:,} | "
                     f"{run['tokens']:,} | {run['seconds']:.1f} | {run['rows_per_second']:,.2f} | "
                     f"{run['tokens_per_second']:,.0f} | {run['images_per_second']:,.2f} | "
                     f"{run['cache_bytes']:,} | {run['cache_bytes'] / run['images']:,.0f} | "
                     f"{run['peak_anon_mib']:,.0f} |")
    skyrl = report["runs"][f"skyrl-{sizes[0]}x"]
    small, large = report["runs"][f"project-{sizes[0]}x"], report["runs"][f"project-{sizes[-1]}x"]
    lines += ["", "| ratio | value |", "|---|---:|",
              f"| throughput, project / SkyRL ({sizes[0]}x, rows/s) | "
              f"{small['rows_per_second'] / skyrl['rows_per_second']:.1f}x |",
              f"| throughput, project {sizes[-1]}x / SkyRL {sizes[0]}x (rows/s) | "
              f"{large['rows_per_second'] / skyrl['rows_per_second']:.1f}x |",
              f"| cache, SkyRL / project ({sizes[0]}x) | {skyrl['cache_bytes'] / small['cache_bytes']:.0f}x |",
              f"| project peak anon RAM, {sizes[-1]}x / {sizes[0]}x | "
              f"{large['peak_anon_mib'] / small['peak_anon_mib']:.2f} |"]
    if all(run.get("peak_processes") for run in report["runs"].values()):  # recorded since the first run
        lines += ["", "Peak anonymous RAM by process, at each run's peak:", ""]
        for name, run in report["runs"].items():
            lines.append(f"- {name}: " + ", ".join(f"{mib:,.0f} MiB `{command[:60]}`"
                                                   for command, mib in run["peak_processes"]))
    c = report["collate"]
    lines += ["", f"Collate cost, {c['batch_rows']} random rows a batch, median (mean) of {c['batches_timed']} "
                  f"batches after one untimed; rows read from the {sizes[0]}x caches, the page cache warm "
                  f"({c['pixel_mib_per_batch']:,} MiB of float32 pixels a batch):", "",
              "| collate | ms / batch | mean |", "|---|---:|---:|",
              f"| project: `ImageCollator` (decode the JPEGs, run the image processor, pad) | "
              f"{c['project_ms_per_batch']:,.1f} | {c['project_ms_per_batch_mean']:,.1f} |",
              f"| SkyRL: read the stored rows (`with_format(\"numpy\")`), pixel_values into tensors, pad | "
              f"{c['skyrl_ms_per_batch']:,.1f} | {c['skyrl_ms_per_batch_mean']:,.1f} |"]
    project_timings = small.get("timings") or {}
    pixels = "exactly" if c["pixels_exact"] else f"max abs diff {c['pixels_max_abs_diff']}"
    lines += ["", f"Project {sizes[0]}x: {small['slices']} slices; manifest timings {project_timings}; image bytes "
                  f"stored {small['image_bytes']:,} of a cache of {small['cache_bytes']:,}.",
              f"Checks: {c['rows_checked']} sampled rows have the same input_ids and image_grid_thw in both caches, "
              f"and the same loss_mask but where SkyRL also trains what follows the final `<|im_end|>` (its "
              f"newline: {c['rows_mask_differs_after_final_im_end']} rows); the collator's pixel_values for a batch "
              f"equal SkyRL's stored ones ({pixels}).",
              "", "## Targets", ""]
    lines += [f"- {VERDICTS[t['ok']]}: {t['name']}: {t['detail']}" for t in report["targets"]]
    return "\n".join(lines) + "\n"

