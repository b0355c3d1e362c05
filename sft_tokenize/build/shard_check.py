"""A stored shard checked before it is reused: its sidecar names the slice's key, and its file still has
the size and digest the sidecar records."""

from __future__ import annotations

import json
from pathlib import Path

from sft_tokenize.build.job import Job
from sft_tokenize.build.keys import Digests
from sft_tokenize.format.layout import SIDECAR_SUFFIX
from sft_tokenize.sources.images import changed_file
from sft_tokenize.sources.records import Slice


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(SIDECAR_SUFFIX)


# Drop reasons that are not bad rows: the same under on_bad_row="raise" and "skip".
NOT_BAD_ROWS = frozenset({"no_assistant_turn", "too_long", "truncated_away", "no_trained_tokens",
                          "image_truncated"})


# Digests of the store's shards this process has read (or written), under each shard's stat: a shard checked
# once is not read again in this process until its stat changes (a write, a truncation or a rename does).
SHARD_DIGESTS = Digests()


def sidecar_verdict(job: Job, slice_: Slice, meta: object, where: str) -> tuple[bool, str | None]:
    """Whether a sidecar (local or remote) may stand for this slice's shard, before its bytes are checked:
    (True, None), or (False, why not: None when quietly tokenized again, a message when it is damaged)."""
    if not isinstance(meta, dict) or meta.get("key") != slice_.key:
        return False, f"{where}: the sidecar is not this shard's (it names another key)"
    if "digest" not in meta or "bytes" not in meta:
        return False, None  # written before shards were digested: not trusted, quietly tokenized again
    if job.on_bad_row == "raise" and set(meta.get("dropped", {})) - NOT_BAD_ROWS:
        return False, None  # written by a run that skipped bad rows: this run must stop at them instead
    files = meta.get("image_files")
    if files and (changed := changed_file(files, job.storage_options, job.image_timeout)):
        return False, f"{changed}: the image changed since slice {slice_.index}'s shard was written"
    return True, None


def checked_shard(job: Job, slice_: Slice) -> tuple[dict | None, str | None]:
    """(the sidecar of a complete shard of this slice's key, None), or (None, why a stored shard is not one:
    None when there is nothing to trust, a message when what is there is damaged)."""
    shard = job.shard_path(slice_)
    sidecar = sidecar_path(shard)
    try:
        meta = json.loads(sidecar.read_text())
        size = shard.stat().st_size
    except FileNotFoundError:  # not written yet, or a run was killed before the sidecar
        return None, None
    except (OSError, ValueError) as error:
        return None, f"{sidecar}: unreadable sidecar ({getattr(error, 'strerror', None) or error})"
    trusted, problem = sidecar_verdict(job, slice_, meta, str(sidecar))
    if not trusted:
        return None, problem
    if meta["bytes"] != size:
        return None, f"{shard}: {size:,} bytes, its sidecar says {meta['bytes']:,}: the stored shard is corrupt"
    try:
        digest = SHARD_DIGESTS.local(str(shard))
    except OSError as error:
        return None, f"{shard}: cannot read the stored shard ({error.strerror})"
    if digest != meta["digest"]:
        return None, f"{shard}: its bytes do not match its sidecar's digest: the stored shard is corrupt"
    return meta, None


def finished_shard(job: Job, slice_: Slice) -> dict | None:
    """The sidecar of a complete shard of this slice's key, its size and digest checked against the file; None
    if it must be (re)written."""
    return checked_shard(job, slice_)[0]
