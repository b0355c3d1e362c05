"""Digests of what a published cache holds, to show that a code change left its bytes alone.

    python benchmarks/digest.py CACHE_DIR [CACHE_DIR ...]

Prints, per cache: SHA-256 of every row's `input_ids`, of every `loss_mask`, of the row offsets, of each
packing index file beside the cache (`.packing/<cache>/`), and the manifest's fingerprints. Two builds of
the same inputs by two commits print the same lines, whatever their shard boundaries or file names.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pyarrow as pa


def cache_digests(path: Path) -> dict[str, str]:
    """Column digests over the whole cache, in row order, independent of how rows are split into files."""
    manifest = json.loads((path / "manifest.json").read_text())
    hashes = {name: hashlib.sha256() for name in ("input_ids", "loss_mask", "offsets")}
    start = 0
    for entry in manifest["files"]:
        with pa.memory_map(str(path / entry["name"])) as source:
            table = pa.ipc.open_stream(source).read_all()
        for name in ("input_ids", "loss_mask"):
            column = table.column(name).combine_chunks()
            hashes[name].update(column.flatten().to_numpy(zero_copy_only=False).tobytes())
        offsets = table.column("input_ids").combine_chunks().offsets.to_numpy()
        hashes["offsets"].update((offsets[1:] - offsets[0] + start).tobytes())
        start += int(offsets[-1] - offsets[0])
    out = {name: digest.hexdigest() for name, digest in hashes.items()}
    out["fingerprint"] = manifest["fingerprint"]
    out["tokenization_fingerprint"] = manifest["tokenization_fingerprint"]
    packing = path.parent / ".packing" / path.name
    for file in sorted(packing.rglob("*")) if packing.is_dir() else ():
        if file.is_file():
            out[f"packing/{file.relative_to(packing)}"] = hashlib.sha256(file.read_bytes()).hexdigest()
    return out


def main() -> None:
    for arg in sys.argv[1:]:
        print(f"# {Path(arg).name}")
        for name, value in cache_digests(Path(arg)).items():
            print(f"{name:40} {value}")


if __name__ == "__main__":
    main()
