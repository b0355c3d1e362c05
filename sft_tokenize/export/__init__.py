"""Exports of a published cache to the formats other trainers read, streamed from the mapped cache.

    export_cache("/data/cache/ultrachat-3f2a9c1d0b7e4f65", "megatron", "/data/megatron/ultrachat")
    export_cache(cache, "mds", "s3://bucket/mds/ultrachat")          # any fsspec URL
    export_cache(cache, "megatron", out, pack_length=[2048, 4096])   # + Megatron-Bridge's packed files

| target     | module        | what it writes (FORMAT.md beside this package)                          |
|------------|---------------|-------------------------------------------------------------------------|
| `megatron` | `megatron.py` | Megatron-Core IndexedDataset `.bin/.idx` of tokens and of the loss mask; |
|            |               | with `pack_length`, Megatron-Bridge's packed SFT `.npy` and its metadata |
| `mds`      | `mds.py`      | mosaicml-streaming MDS shards and `index.json`                          |
| `litdata`  | `litdata.py`  | a litdata optimized dataset: chunks and `index.json`                    |

An export reads only a published cache (base and read layers: it loads no build code, Prefect, Jinja or
tokenizers), one batch of rows at a time. It is published whole or not at all (output.py), and recorded both in
the export's own `export.json` and in the cache's `manifest.json` under `exports`, with its digest. Exporting
again to a place that holds the same cache's export with the same options reuses it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sft_tokenize.errors import BadInput
from sft_tokenize.export.output import EXPORT_RECORD, ExportOutput
from sft_tokenize.files import REQUEST_TIMEOUT, atomic_write
from sft_tokenize.format.layout import MANIFEST, is_mixture
from sft_tokenize.read.cache import TokenizedCache, open_cache
from sft_tokenize.read.mixed_rows import MixedRows, open_mixture
from sft_tokenize.read.row_batches import DEFAULT_BATCH_ROWS, Rows
from sft_tokenize.version import __version__

TARGETS = ("megatron", "mds", "litdata")
EXPORTS_KEY = "exports"  # the cache manifest's record of its exports: {location: {target, digest, ...}}


def _write(cache: Rows, target: str, out: ExportOutput, options: dict[str, Any]) -> dict[str, Any]:
    if target == "megatron":
        from sft_tokenize.export.megatron import write_indexed, write_packed

        written = write_indexed(cache, out, options["batch_rows"])
        packed = [write_packed(cache, out, length, options["pad_to_multiple_of"], options["pad_id"])
                  for length in options["pack_length"]]
        if packed:
            written["packed"] = packed[0] if len(packed) == 1 else packed
        return written
    if target == "mds":
        from sft_tokenize.export.mds import write_mds

        return write_mds(cache, out, options["batch_rows"], options["shard_bytes"])
    from sft_tokenize.export.litdata import write_litdata

    return write_litdata(cache, out, options["batch_rows"], options["shard_bytes"])


def export_cache(cache: str | Path | Rows, target: str, out: str | Path, *,
                 pack_length: int | list[int] | None = None, pad_to_multiple_of: int = 1, pad_id: int | None = None,
                 batch_rows: int = DEFAULT_BATCH_ROWS, shard_bytes: int = 1 << 27, storage_options: dict | None = None,
                 record: bool = True, request_timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """Export `cache` (a published cache's path or URL, a mixture index, or either opened) as `target`, in its row
    order (a mixture's: its own; with `pack_length`, the bins of its packing index), into `out` (a directory
    or an fsspec URL); returns the export's record (EXPORT_RECORD). `pad_to_multiple_of` (context parallelism: 2 ×
    its size): each packed row padded, as Megatron-Bridge's `pad_seq_to_mult` pads it, with `pad_id` (default: the
    EOS id of the tokenizer the cache was built with, which Megatron-Bridge's collator takes for padding).
    `request_timeout`: how long each request to a URL (the cache's, OUT's) may wait to connect and for each answer.
    `record`: also note it in the cache's manifest (skipped, with the reason in the returned record, where the
    cache cannot be written)."""
    if target not in TARGETS:
        raise BadInput(f"--to {target}: not a target; choose one of {', '.join(TARGETS)}")
    lengths = sorted(set([pack_length] if isinstance(pack_length, int) else pack_length or []))
    if lengths and (target != "megatron" or lengths[0] < 1):
        raise BadInput(f"--pack-length {lengths[0]}: a positive length, for --to megatron only")
    if pad_to_multiple_of < 1 or (pad_to_multiple_of > 1 and not lengths):
        raise BadInput(f"--pad-to-multiple-of {pad_to_multiple_of}: a positive multiple, for --pack-length only")
    for length in lengths:
        if length % pad_to_multiple_of:
            raise BadInput(f"--pack-length {length}: not a multiple of --pad-to-multiple-of {pad_to_multiple_of} "
                           "(context parallelism splits every packed sequence, padding included, into equal parts)")
    if isinstance(cache, (str, Path)) and is_mixture(cache):
        cache = open_mixture(cache)
    elif not isinstance(cache, (TokenizedCache, MixedRows)):
        cache = open_cache(cache, storage_options=storage_options, request_timeout=request_timeout)
    options = {"pack_length": lengths, "shard_bytes": shard_bytes if target != "megatron" else None}
    if pad_to_multiple_of > 1:
        from sft_tokenize.export.megatron import eos_id

        pad_id = eos_id(cache) if pad_id is None else pad_id
        options.update(pad_to_multiple_of=pad_to_multiple_of, pad_id=pad_id)
    identity = {"target": target, "cache": cache.path.name, "fingerprint": cache.fingerprint, "options": options}
    output = ExportOutput(out, storage_options, request_timeout)
    if not output.remote and (output.final == cache.path or cache.path in output.final.parents):
        raise BadInput(f"{output.final}: inside the cache {cache.path}, which is never written: export elsewhere")
    existing = output.existing_record()
    if existing is not None and {key: existing.get(key) for key in identity} == identity:
        return {**existing, "reused": True}
    # an earlier export at OUT of the same target and options (another version of the cache): its chunk files of
    # the data files both caches share are reused (chunks.py)
    output.reuse_previous = existing is not None and (existing.get("target"), existing.get("options")) == (
        target, options)
    started = time.perf_counter()
    with output:
        written = _write(cache, target, output, {"pad_to_multiple_of": 1, "pad_id": 0, **options,
                                                 "batch_rows": batch_rows})
        result = output.finish({**identity, **written, "tool_version": __version__,
                                "seconds": round(time.perf_counter() - started, 3)})
    if record and isinstance(cache, TokenizedCache):  # a mixture index has no manifest: its export.json says it all
        result = _record_in_manifest(cache, output.location, result)
    return result


def _record_in_manifest(cache: TokenizedCache, location: str, result: dict[str, Any]) -> dict[str, Any]:
    """The export noted in the cache's manifest.json (replaced in one rename): where, what, its digest."""
    manifest_path = cache.path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        manifest.setdefault(EXPORTS_KEY, {})[location] = {
            key: result[key] for key in ("target", "options", "digest", "rows", "tokens") if key in result}
        atomic_write(manifest_path, json.dumps(manifest, indent=2))
    except OSError as error:
        return {**result, "manifest_not_updated": f"{manifest_path}: {error.strerror or error}"}
    return result


__all__ = ["EXPORT_RECORD", "TARGETS", "export_cache"]
