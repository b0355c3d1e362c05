"""Faults injected into slices, for the tests of failing, retried and resumed runs.

When the environment variable SFT_TOKENIZE_FAULT_FILE names a file that exists, every attempt at a slice
whose index is listed in it (whitespace-separated integers) raises a RuntimeError before touching the data.
Delete the file and the next attempt succeeds. A word `exit:N` instead kills the process (`os._exit(1)`, no
exception, no cleanup) on the first attempt at slice N only, leaving a partial temporary shard as a worker
dying mid-shard does; the marker file `<fault file>.exited-N`, created atomically, makes it once across
processes and machines. A word `exit-upload:N` (a remote cache root) lets slice N be tokenized, then kills the
process after the first part of its shard's multipart upload, once across processes (`<fault file>.exited-upload-N`).
A word `hold:N` makes an attempt at slice N wait, as a long slice does, until the word
is gone from the file or the run asks its slices to stop (then it stops as a slice does between batches).

The fault sits in front of `sft_tokenize.build.shard.tokenize_slice`, which the Prefect task calls for every
attempt. This module imports nothing of the project, so that sitecustomize.py beside it can install it in
every Python process of a test session (CLI, Dask and Ray workers, served flows) before the project loads.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path

FAULT_FILE_ENV = "SFT_TOKENIZE_FAULT_FILE"
SHARD_MODULE = "sft_tokenize.build.shard"


def raise_injected_fault(job, slice_) -> None:
    """Fail or kill this attempt at `slice_` if the fault file says so; otherwise return."""
    index = slice_.index
    fault_file = os.environ.get(FAULT_FILE_ENV)
    if not fault_file:
        return
    try:
        words = Path(fault_file).read_text().split()
    except FileNotFoundError:
        return
    while f"hold:{index}" in words:
        stopping = sys.modules.get("sft_tokenize.build.stopping")  # loaded by then: the shard module imports it
        if stopping is not None:
            stopping.raise_if_stopping()
        time.sleep(0.05)
        try:
            words = Path(fault_file).read_text().split()
        except FileNotFoundError:
            return
    if f"exit:{index}" in words:
        try:
            os.close(os.open(f"{fault_file}.exited-{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # this slice's worker already died once
        shard_file = job.shard_path(slice_)
        shard_file.parent.mkdir(parents=True, exist_ok=True)
        shard_file.with_name(f"{shard_file.name}.tmp-{os.getpid()}").write_bytes(b"partial shard")
        os._exit(1)
    if f"exit-upload:{index}" in words:
        _die_mid_upload(job, slice_, fault_file)
    if str(index) in words:
        raise RuntimeError(f"injected fault in slice {index} ({FAULT_FILE_ENV}={fault_file})")


def _die_mid_upload(job, slice_, fault_file: str) -> None:
    """On a remote root, the first attempt at the slice (across processes) tokenizes it, then starts its shard's
    multipart upload, sends one part and dies (`os._exit(1)`): what a worker killed mid-upload leaves."""
    try:
        os.close(os.open(f"{fault_file}.exited-upload-{slice_.index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    shard_module = sys.modules[SHARD_MODULE]
    root_module = sys.modules["sft_tokenize.build.remote_root"]
    upload, index = shard_module.upload_shard, slice_.index

    def dying_upload(job, slice_):
        if slice_.index != index:  # another slice's thread, uploading meanwhile
            return upload(job, slice_)
        fs, root = root_module.root_filesystem(job.remote_root, job.storage_options)
        bucket, _, key = f"{root}/.shards/{slice_.key}.arrow".partition("/")
        started = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=started["UploadId"], PartNumber=1,
                   Body=job.shard_path(slice_).read_bytes())
        os._exit(1)

    shard_module.upload_shard = dying_upload  # this process dies in it: nothing to put back


def wrap(shard_module) -> None:
    """Put the fault in front of the module's tokenize_slice (once)."""
    original = shard_module.tokenize_slice
    if getattr(original, "injects_faults", False):
        return

    @functools.wraps(original)
    def tokenize_slice(job, slice_):
        raise_injected_fault(job, slice_)
        return original(job, slice_)

    tokenize_slice.injects_faults = True
    shard_module.tokenize_slice = tokenize_slice


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it hands out the real spec of the shard module with a loader that wraps the
    module once it has run, so the project's import order and timing stay as they are."""

    def find_spec(self, name, path, target=None):
        if name != SHARD_MODULE:
            return None
        sys.meta_path.remove(self)  # the real finders, without this one
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            wrap(module)

        loader.exec_module = exec_and_wrap
        return spec


def install() -> None:
    """Wrap the shard module's tokenize_slice now if it is loaded, else as soon as it is imported."""
    if SHARD_MODULE in sys.modules:
        wrap(sys.modules[SHARD_MODULE])
    elif not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())
