"""File mechanisms the build and read sides share, each written once: an advisory lock across processes and
its probe, a directory's write probe, a file replaced in one rename, a directory built aside and renamed into place,
which image locations a run (and the image collator) may read, the timeouts of their remote reads, and a file's
digest (xxh3-128: the shard store's sidecars, the inputs' content keys, `inspect --verify`).

Neutral ground: it imports nothing of the project, so the read side (the packing index, the trainers' work
view) can use them without loading the build side.

Names. A file being written is `<name>.tmp-<32 hex digits>` beside its final name (the shard store's gc and
the interrupt handler find a shard's leftovers by that pattern, FORMAT.md lists it); a directory being built
is `<what the caller names>-<8 hex digits>`, and an existing one it replaces is renamed aside the same way.

Durability, one policy. A durable write fsyncs the file before the rename (the new name never points at
bytes that a crash could lose) and the directory after it (the rename itself survives a crash). A built
directory is always durable: each of its files, the directory, then its parent after the rename. A write that
is only a cache of something recomputable (a lease that dies with its process, a digest book, a prepared
tokenizer, a trainer's work view) passes `durable=False` and says why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import xxhash

logger = logging.getLogger("sft_tokenize")

HASH_CHUNK_BYTES = 1 << 20
HOME_ENV = "SFT_TOKENIZE_HOME"


def user_cache() -> Path:
    """This user's sft-tokenize directory, for what any process of this user may reuse (prepared tokenizers,
    local copies of remote caches): $SFT_TOKENIZE_HOME, else $XDG_CACHE_HOME/sft-tokenize, else
    ~/.cache/sft-tokenize."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "sft-tokenize"


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_remote(location: str | Path) -> bool:
    """Whether `location` is a URL of object storage (any fsspec URL but file://), not a local path."""
    scheme = _SCHEME.match(str(location))
    return bool(scheme) and scheme.group(1).lower() not in ("file", "local")


def local_path(location: str | Path) -> str | Path:
    """A local location as a path: `file://PATH` is PATH; anything else is returned as it is."""
    text = str(location)
    return text[len("file://"):] if text.lower().startswith("file://") else location


@contextlib.contextmanager
def locked(lock_file: Path, waiting: str | None = None, shared: bool = False, remove: bool = False) -> Iterator[None]:
    """An advisory lock (flock) across processes, exclusive or shared; says `waiting` if it has to wait.

    `remove`: delete the lock file on release unless another process holds it (a lock per cache version would
    otherwise leave an empty file behind each). Race-free because every holder keeps one
    invariant: a file is unlinked only by a process holding it exclusively, and a locker that got the lock
    checks that its path still names the file it locked (else a remover got there first: it locks the path
    anew). So a lock held is always the file at its path, and `is_locked` keeps seeing it. Every process
    that locks such a file must do so through this function (a raw flock would not re-check)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    said = False
    while True:
        handle = open(lock_file, "a")  # noqa: SIM115 - closed on release, or below when the file was removed
        try:
            try:
                fcntl.flock(handle, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting and not said:
                    logger.warning(waiting)
                    said = True
                fcntl.flock(handle, mode)
            if _names(lock_file, handle):
                break
        except BaseException:
            handle.close()
            raise
        handle.close()  # locked a file its holder removed on release: lock the one at the path now
    with handle:
        try:
            yield
        finally:
            if remove:
                _remove_if_alone(lock_file, handle, shared)
            fcntl.flock(handle, fcntl.LOCK_UN)


def _names(path: Path, handle) -> bool:
    """`path` still names the open file `handle` (not removed, nor replaced by a newer lock file)."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)


def _remove_if_alone(path: Path, handle, shared: bool) -> None:
    """Unlink the lock file `handle` holds if this process can hold it exclusively at once (no other holder:
    a waiter is woken on the removed file and locks the path anew). A shared holder tries to convert; if that
    fails another process holds it, and the file stays."""
    if shared:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
    # Held exclusively, so no other process can remove or replace the file: this check stays true to the unlink.
    if _names(path, handle):
        with contextlib.suppress(OSError):  # a lock file left behind is harmless: the next holder removes it
            path.unlink()


def is_locked(lock_file: Path) -> bool:
    """Whether some process holds an flock on `lock_file`, shared or exclusive (a missing file is held by
    nobody). It only probes: the lock is released at once, and the file is never created."""
    try:
        handle = open(lock_file)  # noqa: SIM115 - closed below; opening read-only never creates it
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def write_problem(directory: Path) -> str | None:
    """Why nothing can be written in `directory` (created if missing), or None if a file can be. A real write,
    not os.access: modes do not stop root, and a read-only mount or an immutable directory stops everyone."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    return None


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path: what a rename publishes must be on disk first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: beside it, unique to this write."""
    return path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")


@contextlib.contextmanager
def atomic_path(path: Path, *, durable: bool = True) -> Iterator[Path]:
    """Yields a temporary path beside `path` for the block to write (a stream, a symlink, anything); when the
    block ends, that path replaces `path` in one rename. If the block raises, the temporary path is removed
    and `path` is left as it was. `durable`: see the module's docstring."""
    tmp = temp_path(path)
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes | str, *, durable: bool = True) -> None:
    """Replace `path` with `data` (text is written as UTF-8) in one rename: a reader sees the old file or the
    new one, never part of either."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def built_directory(final: Path, building: Path, displaced: Path) -> Iterator[Path]:
    """Yields a new empty directory, `<building>-<id>`, for the block to fill; when the block ends, its files
    and itself are fsynced and it is renamed to `final` in one step, so a reader sees the whole directory or
    none of it. A directory already at `final` (the caller has found it corrupt or stale) is first renamed to
    `<displaced>-<id>` and removed, never served. If the block raises, the new directory is removed and
    `final` is left as it was.

    `building` and `displaced` name paths on `final`'s filesystem; callers build under a lock, so no other
    process renames into `final` meanwhile. Should one have done so anyway (a filesystem without flock), its
    directory stays and this one is removed."""
    tag = uuid.uuid4().hex[:8]
    temp = building.with_name(f"{building.name}-{tag}")
    temp.mkdir()
    try:
        yield temp
        for path in temp.iterdir():
            fsync_path(path)
        fsync_path(temp)
        if final.exists():
            aside = displaced.with_name(f"{displaced.name}-{tag}")
            os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(temp, final)
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        fsync_path(final.parent)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


# -- image access ------------------------------------------------------------------------------------------------
# A dataset comes from strangers: its image locations may name any file or URL its reader can reach. By default
# (`root`) an image path must be relative and resolve, links followed, inside the image root (--image-root, or
# the directory of the file naming it); `local` also reads absolute paths, `~` and paths that leave the root;
# `+urls` also reads URLs (http, s3, gs, hf, ...). Inline bytes and data: URIs read nothing and are always taken.
IMAGE_ACCESS = ("root", "root+urls", "local", "local+urls")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _inside(path: str, root: str) -> bool:
    if _URL.match(root):
        return path.startswith(root.rstrip("/") + "/")
    real_root = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(path), real_root]) == real_root


# What `+urls` reads: protocols whose bytes come over the network. Any other URL form that fsspec resolves (local://,
# a chain such as zip://a::file:///x.zip, git://, reference://, ...) may read this machine's files: a local path.
NETWORK_PROTOCOLS = frozenset({"http", "https", "s3", "s3a", "gs", "gcs", "hf", "az", "abfs", "abfss", "adl",
                               "oci", "ftp", "sftp", "ssh", "webhdfs", "hdfs"})
# Links of a chain that read what the next link names (a cache, an archive): as far-reaching as that link.
WRAPPING_PROTOCOLS = frozenset({"simplecache", "filecache", "blockcache", "zip", "tar"})
_LINK = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)(?:://|$)")


def is_chained(location: str) -> bool:
    """An fsspec URL chain (`zip://a::file:///x.zip`, `simplecache::s3://...`), which fsspec opens link by link."""
    return "::" in location and bool(_LINK.match(location.split("::", 1)[0]))


def network_url(location: str) -> bool:
    """Every link of the URL (or chain) is a network protocol, or a wrapper of the links after it that ends in one:
    what fsspec reads of it comes over the network, never from this machine's files."""
    links = location.split("::") if is_chained(location) else [location]
    protocols = []
    for link in links:
        match = _LINK.match(link)
        if not match:
            return False  # a bare path in a chain: a local file
        protocols.append(match.group(1).lower())
    return protocols[-1] in NETWORK_PROTOCOLS and all(
        p in NETWORK_PROTOCOLS or p in WRAPPING_PROTOCOLS for p in protocols)


def image_access_refusal(location: str, roots: Sequence[str], access: str,
                         written: str | None = None) -> tuple[str, str] | None:
    """(why, which policy would allow it) if the image access policy `access` (IMAGE_ACCESS) refuses to read the
    image at `location` (an absolute path or a URL), written in its row as `written` (None: a location stored
    already resolved, as a reference-mode cache holds it) and resolved against one of `roots`; None if allowed.
    A URL is classified by what fsspec reads it from: one that can reach this machine's files is a local path."""
    scheme = _URL.match(location)
    shown = written if written is not None else location
    if is_chained(location) or (scheme and scheme.group(1).lower() not in ("file", *NETWORK_PROTOCOLS)):
        if network_url(location):
            return None if access.endswith("+urls") else (
                f"{shown} is a URL, and URLs are read only where allowed", "root+urls or local+urls")
        if access.startswith("local"):
            return None
        return (f"{shown} is not a network URL: fsspec reads it from this machine's files (local://, file://, a path "
                "or a protocol other than http(s), s3, gs, hf, ... in it)", "local+urls" if access.endswith("+urls")
                else "local")
    local = not scheme or scheme.group(1).lower() == "file"
    path = location[len("file://"):] if scheme and local else location
    relative = written is None or not (_URL.match(written) or written.startswith("~") or os.path.isabs(written))
    if relative and any(_inside(path, root) for root in roots):
        return None
    if not local:
        if access.endswith("+urls"):
            return None
        return f"{shown} is a URL, and URLs are read only where allowed", "root+urls or local+urls"
    if access.startswith("local"):
        return None
    if not relative:
        what = "a path under ~" if written.startswith("~") else "an absolute path"
        return f"{shown} is {what}, and only paths relative to the image root are read", "local"
    return f"{shown} resolves outside the image root ({', '.join(roots) or 'none'})", "local"


REMOTE_TIMEOUT = 30.0  # seconds, the default of --image-timeout and of the collator's image_timeout
REQUEST_TIMEOUT = 90.0  # seconds, the default of --request-timeout: a cache root's connect and each answer


def with_timeouts(url: str, storage_options: dict | None, seconds: float | None) -> dict:
    """Storage options that bound how long the URL's backend waits for a connection and for each read (HTTP
    through aiohttp, S3 through botocore), so that a server that accepts and never answers cannot hang a
    run; what the caller's options already say wins."""
    options = dict(storage_options or {})
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if seconds is None:
        return options
    if scheme in ("http", "https"):
        import aiohttp

        client = dict(options.get("client_kwargs") or {})
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds))
        options["client_kwargs"] = client
    elif scheme in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", seconds)
        config.setdefault("read_timeout", seconds)
        # botocore's default tries a refused or silent endpoint 5 times with backoff: once more is enough
        config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
        options["config_kwargs"] = config
    return options


def network_failure(error: BaseException) -> str | None:
    """"connection refused" or "no answer" where that is why a remote read failed, else None. fsspec's HTTP
    backend reports both as a missing file: the cause is in the exception's chain."""
    for _ in range(10):
        if error is None:
            return None
        if isinstance(error, ConnectionRefusedError) or getattr(error, "errno", None) == errno.ECONNREFUSED:
            return "connection refused"
        if isinstance(error, TimeoutError) or type(error).__name__ in ("ServerTimeoutError", "ConnectTimeoutError",
                                                                        "ReadTimeoutError", "FSTimeoutError"):
            return "no answer"
        error = error.__cause__ or error.__context__
    return None


def file_digest(path: str, start: int = 0, stop: int | None = None) -> str:
    """xxh3-128 of bytes [start, stop) of a local file (to its end without stop), through one bounded buffer."""
    digest = xxhash.xxh3_128()
    buffer = memoryview(bytearray(HASH_CHUNK_BYTES))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        remaining = (os.fstat(f.fileno()).st_size if stop is None else stop) - start
        while remaining > 0:
            got = f.readinto(buffer[:min(remaining, HASH_CHUNK_BYTES)])
            if not got:
                break
            digest.update(buffer[:got])
            remaining -= got
    return digest.hexdigest()


def human_size(count: float) -> str:
    """A byte count as people read it: 1.6 GB, 340 kB, 12 bytes."""
    for scale, unit in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB")):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count / 10**3:,.0f} kB" if count >= 10**3 else f"{count:,.0f} bytes"
