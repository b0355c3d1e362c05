"""Where the time goes: the limit rows (rendering alone, the encoders alone) and the project's stages, in one process.

    python benchmarks/stages.py limits FILE... --tokenizer DIR    # render once; then HF, fastokens on that text
    python benchmarks/stages.py stages FILE... --tokenizer DIR [--encoder auto|hf|fastokens]

`limits` renders every conversation once with the project's template (timed: rendering alone) and times,
on the same rendered text, HF `encode_batch`, fastokens `encode_batch_flat` (ids only) and the project's
fast path (ids plus each token's character position, what the mask needs), all using every core, one after
the other in this process, a batch at a time (memory stays one batch), and checks that the two encoders'
ids are identical.

`stages` runs the project's data plane (sources.read_slice, formats.to_example, ChatEncoder, ShardWriter) over
the files in one process and one thread, timing read (JSON decoding and rows to examples), render (the
template renders and turn finding of `_render_rows`), encode (`_encode`: the tokenizer calls), mask (the
rest of `encode_batch`: ids to arrays, token ranges, max_length) and write (Arrow batches to a shard).
Each prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sft_tokenize.build.shard_writer import ShardWriter  # noqa: E402
from sft_tokenize.encoding.chat_encoder import ChatEncoder  # noqa: E402
from sft_tokenize.encoding.exact import VERIFY_ROWS, choose_encoder  # noqa: E402
from sft_tokenize.encoding.tokenizer import load_tokenizer  # noqa: E402
from sft_tokenize.sources.conversations import ColumnMap, to_example  # noqa: E402
from sft_tokenize.sources.readers import read_slice  # noqa: E402
from sft_tokenize.sources.resolve import resolve  # noqa: E402
from sft_tokenize.sources.slicing import cut_slices  # noqa: E402


def _timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


def limits(files: list[str], tokenizer_dir: str, batch_rows: int) -> dict:
    """Batch by batch, so memory stays one batch: render it (timed), then encode that text with each encoder
    (each timed) and compare their ids; the totals are the sums over batches."""
    from pipelines import jsonl_batches

    tokenizer = load_tokenizer(tokenizer_dir)
    template = ChatEncoder(tokenizer).template
    backend = tokenizer.backend_tokenizer
    fast = choose_encoder(tokenizer, "fastokens")
    if fast is None:
        raise SystemExit("fastokens refused this tokenizer (see the log above)")
    seconds = dict.fromkeys(("render", "hf", "fast", "placed"), 0.0)
    rows = tokens = unplaced = 0
    identical = True
    for batch in jsonl_batches(files, batch_rows):
        texts, took = _timed(lambda: [template.render(row["messages"]) for row in batch])  # noqa: B023
        seconds["render"] += took
        # ids as the project takes them from an Encoding
        want, took = _timed(lambda: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)])  # noqa: B023
        seconds["hf"] += took
        # one flat buffer of ids per batch: no per-token Python objects
        (ids, bounds), took = _timed(fast.native.encode_batch_flat, texts, add_special_tokens=False)
        seconds["fast"] += took
        placed, took = _timed(fast.encode, texts, add_special_tokens=False)
        seconds["placed"] += took
        lengths = np.diff(np.frombuffer(bounds, dtype=np.uint64))
        identical = identical and lengths.tolist() == list(map(len, want)) and np.array_equal(
            np.frombuffer(ids, dtype=np.uint32), np.fromiter((i for row in want for i in row), dtype=np.uint32))
        unplaced += sum(p is None for p in placed)
        rows += len(batch)
        tokens += int(lengths.sum())
    return {"rows": rows, "tokens": tokens, "identical_ids": identical, "rows_not_placed": unplaced,
            "render_seconds": round(seconds["render"], 3), "render_rows_per_second": round(rows / seconds["render"]),
            "render_tokens_per_second": round(tokens / seconds["render"]),
            "hf_encode_seconds": round(seconds["hf"], 3), "hf_tokens_per_second": round(tokens / seconds["hf"]),
            "fastokens_encode_seconds": round(seconds["fast"], 3),
            "fastokens_tokens_per_second": round(tokens / seconds["fast"]),
            "fastokens_placed_seconds": round(seconds["placed"], 3),
            "fastokens_placed_tokens_per_second": round(tokens / seconds["placed"]),
            "fastokens_vs_hf": round(seconds["hf"] / seconds["fast"], 2),
            "placed_vs_hf": round(seconds["hf"] / seconds["placed"], 2)}


class _TimedEncoder(ChatEncoder):
    """The project's encoder, with the time of its render and tokenizer steps added up."""

    render_seconds = encode_seconds = 0.0

    # Whatever the encoder's own signatures: the timing wraps the call, it does not restate it.
    def _render_rows(self, *args, **kwargs):
        result, seconds = _timed(super()._render_rows, *args, **kwargs)
        self.render_seconds += seconds
        return result

    def _encode(self, *args, **kwargs):
        result, seconds = _timed(super()._encode, *args, **kwargs)
        self.encode_seconds += seconds
        return result


def stages(files: list[str], tokenizer_dir: str, encoder_name: str) -> dict:
    tokenizer = load_tokenizer(tokenizer_dir)
    encoder = _TimedEncoder(tokenizer, fast=choose_encoder(tokenizer, encoder_name))
    columns = ColumnMap("chat", {"messages": "messages"})
    sources = resolve(files)
    slices = cut_slices(sources, sum(f.size for f in sources) + 1)
    read = batch_seconds = write = 0.0
    rows = tokens = 0
    with tempfile.TemporaryDirectory() as scratch, open(Path(scratch) / "shard.arrow", "wb") as stream:
        writer = ShardWriter(stream, (), 1000, 64_000_000, "skyrl")
        for slice_ in slices:
            batches = read_slice(slice_, columns.names)
            verified = 0  # HF checks each slice's first rows, as in the project
            while True:
                started = time.perf_counter()
                item = next(batches, None)
                if item is None:
                    read += time.perf_counter() - started
                    break
                examples = [to_example(row, columns) for row in item[0]]
                read += time.perf_counter() - started
                batch, seconds = _timed(encoder.encode_batch, examples, max(0, VERIFY_ROWS - verified))
                verified += batch.rows_verified
                batch_seconds += seconds
                _, seconds = _timed(writer.add, batch)
                write += seconds
                rows += batch.rows
                tokens += len(batch.input_ids)
        _, seconds = _timed(writer.close)
        write += seconds
    mask = batch_seconds - encoder.render_seconds - encoder.encode_seconds
    stage = {"read": read, "render": encoder.render_seconds, "encode": encoder.encode_seconds, "mask": mask,
             "write": write}
    return {"rows": rows, "tokens": tokens, "encoder": "fastokens" if encoder.fast else "hf",
            "seconds": {k: round(v, 3) for k, v in stage.items()}, "total_seconds": round(sum(stage.values()), 3)}


def main() -> None:
    from pipelines import encode_batch_rows

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["limits", "stages"])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--encoder", default="auto", choices=["auto", "hf", "fastokens"])
    parser.add_argument("--rows", type=int, help="the files' row count, if known")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if args.what == "limits":
        result = limits(args.files, args.tokenizer, encode_batch_rows(args.files, args.rows))
    else:
        result = stages(args.files, args.tokenizer, args.encoder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
