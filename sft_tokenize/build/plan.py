"""plan_slices: resolve and check every input up front, fingerprint the run, cut byte-balanced slices and
key each one by the content it reads, so the shard store can tell which are already tokenized.

Everything that can be wrong before tokenizing (a missing file, an unknown format, a missing column, a
tokenizer without a chat template, a max_length below the template's own overhead) fails here, before
any work is done.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from sft_tokenize.build.job import Job
from sft_tokenize.build.keys import Digests, slice_key
from sft_tokenize.build.options import TokenizeOptions, hashed_values, job_values, parse_size
from sft_tokenize.build.publish import changed_image, is_published
from sft_tokenize.build.remote_publish import is_published_remote, version_url
from sft_tokenize.build.remote_root import probe_root
from sft_tokenize.build.store import store_dir
from sft_tokenize.build.timeline import mark
from sft_tokenize.build.workers import process_encoding, ready_processes
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.chat.template_check import check_chat_template
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.cores import POOL_MIN_BYTES
from sft_tokenize.encoding.prepared import prepared_dir
from sft_tokenize.encoding.tokenizer import read_chat_template, read_processor_config, resolve_tokenizer
from sft_tokenize.encoding.vision import load_family
from sft_tokenize.errors import BadInput
from sft_tokenize.files import is_remote, write_problem
from sft_tokenize.fingerprint import fingerprint, hash_directory, hash_text, tokenization_inputs
from sft_tokenize.format import CACHE_FORMAT_VERSION
from sft_tokenize.format.layout import SHARD_STORE, STAGING
from sft_tokenize.sources.conversations import DEFAULT_COLUMNS, REQUIRED, ColumnMap, resolve_columns
from sft_tokenize.sources.readers import reader
from sft_tokenize.sources.records import Slice, SourceFile
from sft_tokenize.sources.resolve import resolve
from sft_tokenize.sources.slicing import cut_slices

logger = logging.getLogger("sft_tokenize")


@dataclass(frozen=True)
class Plan:
    job: Job
    slices: list[Slice]
    name: str
    cache_path: Path
    inputs: dict  # what the fingerprint hashes; recorded in the manifest
    cached: bool  # a valid cache with this fingerprint is already published
    url: str = ""  # with a remote root: the version's URL (cache_path is then unused)

    @property
    def location(self) -> str:
        """Where the cache is published: its URL on a remote root, else its directory."""
        return self.url or str(self.cache_path)

    @property
    def staging(self) -> Path:
        return Path(self.job.staging)

    @property
    def store(self) -> Path:
        return Path(self.job.store)


def default_name(spec: str) -> str:
    base = os.path.basename(spec.removeprefix("hub:").rstrip("/*")) or "dataset"
    stem = base.split(".")[0]
    # At most 100 characters, as --name: with "-<fingerprint>" and a ".deleting-…" prefix it fits a file name.
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in stem)[:100].strip(".-_") or "dataset"


def cache_root(options: TokenizeOptions, create: bool = True) -> Path:
    root = options.cache_root
    if root.exists() and not root.is_dir():
        raise BadInput(f"cache dir {root} exists and is not a directory")
    if not create:
        return root
    try:
        (root / STAGING).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BadInput(f"cache dir {root}: cannot create it ({error.strerror})") from None
    return root


def check_writable(root: Path) -> None:
    """A build writes under the cache root (its locks in .staging, its shards in .shards): refuse one that
    cannot, in one line, before any work."""
    for directory in (root / STAGING, store_dir(root)):
        problem = write_problem(directory)
        if problem is not None:
            raise BadInput(f"cache dir {root}: not writable ({problem}): a run that tokenizes writes its "
                           "shards there; choose a writable --cache-dir")


REMOTE_READS = 32  # remote files whose first rows a plan reads at once: each read waits on a request


def _read_columns(files: list[SourceFile], options: TokenizeOptions) -> list:
    """Each file's columns (from its schema or its first rows), its first bad row and whether it is schemaless, or
    the error reading it raised, in the files' order. Remote files are read REMOTE_READS at a time: a plan over
    thousands of objects waits on one request per object, not on the bytes."""
    def read(source: SourceFile) -> tuple | BaseException:
        try:
            source_reader = reader(source, options.storage_options, parse_size(options.max_row_bytes),
                                   options.request_timeout)
            available = source_reader.columns(skip_bad_rows=options.on_bad_row == "skip")
            return available, source_reader.first_bad, source_reader.schemaless
        except Exception as error:  # noqa: BLE001 - raised by _columns in the files' order, as if read one by one
            return error

    if len(files) < 2 or all(not is_remote(f.url) for f in files):
        return [read(f) for f in files]
    with ThreadPoolExecutor(REMOTE_READS) as pool:
        return list(pool.map(read, files))


def _columns(files: list[SourceFile], options: TokenizeOptions) -> ColumnMap:
    """One format and column mapping for all files: the required columns must agree (a file that does not fit
    is named); an optional one (system, tools) is read from the files that have it."""
    merged: ColumnMap | None = None
    first_bad = None
    for source, read in zip(files, _read_columns(files, options), strict=True):
        if isinstance(read, BaseException):
            raise read
        available, bad, schemaless = read
        if available is None:
            first_bad = first_bad or bad
            continue  # only bad rows, skipped: its rows are read with the columns the other files name
        found = resolve_columns(options.format if merged is None else merged.format, options.columns, available,
                                source.url, schemaless)
        if merged is None:
            merged, first_url = found, source.url
            continue
        required = {role: found.columns[role] for role in REQUIRED[found.format]}
        if required != {role: merged.columns[role] for role in REQUIRED[merged.format]}:
            raise BadInput(f"{source.url}: columns {found.columns} differ from {first_url}'s {merged.columns}")
        merged = ColumnMap(merged.format, {**found.columns, **merged.columns})
    if merged is None:  # every file holds only bad rows, skipped: the columns are the format's, as named
        if options.format == "auto":
            where, bad = first_bad
            raise BadInput(f"{where}: {bad.detail}; no row of the input can be read (every one is a bad row), so "
                           "its format cannot be told: pass --format to count them as skipped rows")
        named = [options.columns.get(role, DEFAULT_COLUMNS[role][0]) for role in REQUIRED[options.format]]
        merged = resolve_columns(options.format, options.columns, named, files[0].url, schemaless=True)
    return merged


def _check_tokenizer(tokenizer, columns: ColumnMap, options: TokenizeOptions) -> None:
    if columns.format == "text":
        if options.train_on != "all":
            raise BadInput("text data trains on every token: use --train-on all")
        return
    if not tokenizer.chat_template:
        raise BadInput(f"tokenizer {options.tokenizer} has no chat template, which {columns.format} data needs: "
                       "pass --chat-template FILE")
    if options.max_length is not None:
        try:
            masks = MaskSettings(template_kwargs=options.template_kwargs)
            overhead = ChatEncoder(tokenizer, masks).template_overhead()
        except Exception as error:  # the template raised, or the sandbox refused what it tried to do
            if options.chat_template is None:
                where = f"tokenizer {options.tokenizer}"
            else:  # a .jinja file, or the template's text itself
                where = "--chat-template" if "{" in options.chat_template else options.chat_template
            detail = (str(error).strip().splitlines() or [""])[0]
            raise BadInput(f"{where}: the chat template fails on an empty exchange, so --max-length cannot be "
                           f"checked ({type(error).__name__}: {detail})") from None
        if options.max_length <= overhead:
            raise BadInput(f"--max-length {options.max_length} leaves no room for content: the chat template "
                           f"alone takes {overhead} tokens for an empty exchange")


def plan_slices(options: TokenizeOptions, min_slices: int = 1, on_work: Callable[[], object] | None = None,
                content_keys: bool = True, dry: bool = False) -> Plan:
    """Check the inputs, fingerprint them, and cut slices of about `shard_size` bytes (at least
    `min_slices` of them, so every worker gets work), each keyed by the content it reads. A published cache
    returns before any tokenizer load; otherwise `on_work` is called as soon as the cache is known to be
    missing, so whatever it starts (the Prefect server) runs while the tokenizer is loaded and checked and
    the inputs are cut and hashed. `content_keys=False` skips hashing the inputs, for a check that does not
    tokenize (its slices have no key). `dry`: write nothing under the cache root (a dry run: no staging
    directory, no writability probe, the inputs' digests not saved)."""
    root = cache_root(options, create=not dry)
    tokenizer_dir = resolve_tokenizer(options.tokenizer, options.tokenizer_revision,
                                      storage_options=options.storage_options)
    processor_dir = resolve_tokenizer(options.processor, options.tokenizer_revision, "processor") \
        if options.processor else None
    processor_config = read_processor_config(processor_dir) if processor_dir else None
    template_override = read_chat_template(options.chat_template)
    ignored: list[str] = []
    files = resolve(options.sources, split=options.split, subset=options.subset, revision=options.revision,
                    storage_options=options.storage_options, cache_root=str(root), ignored=ignored,
                    timeout=options.request_timeout)
    columns = _columns(files, options)
    if processor_dir is None and "images" in columns.columns:  # read only by image rows
        columns = replace(columns, columns={k: v for k, v in columns.columns.items() if k != "images"})
    inputs = {
        "cache_format_version": CACHE_FORMAT_VERSION,
        "sources": [[f.url, f.kind, *f.identity] for f in files],
        "format": columns.format,
        "columns": columns.columns,
        # The tokenizer's own chat template is one of its files; an override is hashed on its own.
        "tokenizer_files": (tokenizer_files := hash_directory(tokenizer_dir)),
        "chat_template_override": hash_text(template_override),
        # Its configuration (the resize rule, the image tokens) decides every image row's tokens.
        **({"processor_files": hash_directory(processor_dir)} if processor_dir else {}),
        **hashed_values(options),  # the options that change the rows by their value (options.py)
        # Skeleton-built rows are meant to be the full render's: a cache built with every row rendered is
        # another cache (so --render full next to a default run rebuilds), and the default keeps its fingerprints.
        **({"render": "full"} if options.render == "full" else {}),
    }
    digest = fingerprint(inputs)
    inputs["ignored_files"] = ignored  # recorded, not hashed: they are never read
    name = options.name or default_name(options.sources[0])
    cache_path = root / f"{name}-{digest}"
    remote = options.remote_root
    url = version_url(remote, name, digest) if remote else ""
    job = Job(
        fingerprint=digest,
        staging=str(root / STAGING / digest),
        store=f"{remote}/{SHARD_STORE}" if remote else str(store_dir(root)),
        tokenization=fingerprint(tokenization_inputs(inputs)),
        tokenizer_dir=str(tokenizer_dir),
        tokenizer_url=options.tokenizer if is_remote(options.tokenizer) else "",
        chat_template=template_override,
        columns=columns,
        **job_values(options),  # the options the slices read (options.py)
        prepared=str(prepared_dir(tokenizer_files, options.trust_remote_code)),
        processor_config=json.dumps(processor_config, sort_keys=True) if processor_config else "",
        remote_root=remote or "",
        run=uuid.uuid4().hex,
    )
    mark("planned")
    if remote:
        if not dry:  # a bad URL, a missing bucket or denied credentials: said now, before any work
            probe_root(remote, options.storage_options, options.request_timeout)
        if is_published_remote(url, options.storage_options):
            return Plan(job, [], name, cache_path, inputs, cached=True, url=url)
    elif is_published(cache_path, options.storage_options, options.image_timeout):
        return Plan(job, [], name, cache_path, inputs, cached=True)  # read-only roots serve their caches
    elif (changed := changed_image(cache_path, options.storage_options, options.image_timeout)) is not None:
        logger.warning("%s: the image changed since %s was built; building it again", changed, cache_path)
    if not dry:
        check_writable(root)
    if on_work is not None:
        on_work()
    # Here, so that a bad tokenizer, a missing extra or a refusal shows up before any task (and the threads
    # runner's slices reuse what this process loaded and checked).
    tokenizer, fast = process_encoding(job.tokenizer_dir, template_override, options.trust_remote_code,
                                       options.encoder, job.prepared)
    mark("encoding")  # here rather than in process_encoding: a resident process may have it ready (cached)
    total = sum(f.size for f in files)
    if fast is not None and total < POOL_MIN_BYTES and not ready_processes(job):
        fast.warm()  # an input this small is encoded by this process: fastokens builds while the checks run
    check_chat_template(options.chat_template, tokenizer_dir, template_override, needed=columns.format != "text")
    _check_tokenizer(tokenizer, columns, options)
    if processor_config is not None:
        vision = load_family(processor_config, tokenizer)  # a processor it cannot serve, or tokens it lacks: said here
        if "pixel_values" in options.extra_columns and vision.pixel_rows(vision.probe_grid) is None:
            raise BadInput(f"--extra-column pixel_values: a {vision.name} processor's pixels are whole images, not the "
                           "patch rows SkyRL's reader stores; leave it out, the image collator makes the pixels "
                           "while training (docs/images.md)")
    # Halving (rather than total / min_slices) keeps the target, and so every cut point, the same while the
    # input grows, until it doubles.
    target = max(1, parse_size(options.shard_size))
    while min_slices > 1 and target > 1 and total < min_slices * target:
        target //= 2
    slices = cut_slices(files, target, options.storage_options)
    if content_keys:
        digests = Digests(book=job.digest_book)
        slices = [replace(s, key=slice_key(s, job.tokenization, options.storage_options, digests,
                                           options.request_timeout)) for s in slices]
        if not dry:
            digests.save()
    return Plan(job, slices, name, cache_path, inputs, cached=False, url=url)
