"""A cache root on object storage (`s3://bucket/prefix`, `gs://…`): told from a local one, reached, and probed.

`--cache-dir` is an fsspec URL or a path. A path, or `file://PATH`, is a local root. Any other protocol is a
*remote root* (FORMAT.md, "A remote cache root"): its shards, leases and versions are objects under the URL,
and each process that tokenizes keeps a local working directory of its own for it, under this user's cache
($SFT_TOKENIZE_HOME, see files.py) and named from the URL, derived where it runs: the flow's
machine holds its run lock there, a worker its shard until it is uploaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from sft_tokenize.errors import BadInput, one_line
from sft_tokenize.files import REQUEST_TIMEOUT, is_remote, local_path, user_cache, with_timeouts
from sft_tokenize.format.layout import REMOTE_BUILDS, STAGING
from sft_tokenize.remote_requests import bounded, unanswered

# In-memory filesystems live in one process: workers would each see their own.
UNSUPPORTED = frozenset({"memory"})


def split_url(cache_dir: str) -> tuple[str | None, str]:
    """(the protocol of a remote root, its URL without a trailing slash), or (None, the local path)."""
    if not is_remote(cache_dir):
        return None, str(local_path(cache_dir))
    protocol, rest = cache_dir.split("://", 1)
    return protocol, f"{protocol}://{rest.rstrip('/')}" if rest.strip("/") else cache_dir  # `s3://` stays a URL


def remote_url(cache_dir: str) -> str | None:
    """The URL of a remote cache root, or None for a local one (a path or file://PATH)."""
    protocol, url = split_url(cache_dir)
    return url if protocol else None


def working_dir(url: str) -> Path:
    """This process's local working directory for the remote root `url` (its run locks, its shards before they
    are uploaded): under this user's cache, named from the URL (readable, and a hash against collisions)."""
    readable = "".join(c if c.isalnum() or c in "._-" else "-" for c in url.split("://", 1)[-1])[:80].strip("-.")
    return user_cache() / REMOTE_BUILDS / f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


# One filesystem per protocol and options in a process: a new S3 client costs a few hundred ms of set-up, per call.
_filesystems: dict[str, Any] = {}
_making = threading.Lock()
CLIENT_ENVIRONMENT = ("AWS_", "GOOGLE_", "GCS", "AZURE_", "FSSPEC_")


def root_filesystem(url: str, storage_options: dict | None = None,
                    timeout: float = REQUEST_TIMEOUT) -> tuple[Any, str]:
    """The fsspec filesystem of a remote root and the root's path on it, made once per process for these options;
    it caches no listing (a build must see the objects as they are now), and each of its requests waits at most
    `timeout` seconds to connect and for each answer (bounded())."""
    import fsspec

    protocol = url.split("://", 1)[0]
    if protocol in UNSUPPORTED:
        raise BadInput(f"cache dir {url}: a {protocol}:// root lives in one process; use a bucket or a local path")
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise BadInput(f"cache dir {url}: unknown protocol {protocol!r}") from None
    except ImportError as error:
        raise BadInput(f"cache dir {url}: the {protocol}:// filesystem is not installed ({one_line(error)})") from None
    # The environment configures a client too (endpoint, keys, profile): another one gets another filesystem.
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith(CLIENT_ENVIRONMENT))
    key = hashlib.sha256(json.dumps([protocol, storage_options or {}, environment, timeout], sort_keys=True,
                                    default=str).encode()).hexdigest()
    with _making:
        fs = _filesystems.get(key)
        if fs is None:
            options = with_timeouts(url, storage_options, timeout)
            fs = _filesystems[key] = bounded(cls(**{"skip_instance_cache": True, "use_listings_cache": False,
                                                    **options}))
    path = fs._strip_protocol(url).rstrip("/")
    if not path or path.startswith("/"):
        raise BadInput(f"cache dir {url}: no bucket in the URL: write {url.split('://', 1)[0]}://BUCKET/PREFIX")
    return fs, path


def reach_problem(url: str, error: BaseException, fs: Any = None, timeout: float | None = None) -> str:
    """What a failed request to the root says, in one line."""
    if reason := unanswered(error, fs, url, timeout):
        return f"cache dir {reason}; check that the endpoint is up and reachable from here"
    if isinstance(error, FileNotFoundError):
        return f"cache dir {url}: the bucket does not exist or is not visible ({one_line(error)})"
    if isinstance(error, PermissionError):
        return f"cache dir {url}: access denied: check the credentials (--storage-options, AWS_* variables) " \
               f"({one_line(error)})"
    return f"cache dir {url}: cannot write, read back and delete an object there ({type(error).__name__}: " \
           f"{one_line(error)})"


def probe_root(url: str, storage_options: dict | None = None, timeout: float = REQUEST_TIMEOUT) -> None:
    """Write, read back and delete one small object under URL/.staging/: a bad URL, a missing bucket or denied
    credentials fail here, in one line naming the URL, before any slice runs."""
    fs, path = root_filesystem(url, storage_options, timeout)
    probe = f"{path}/{STAGING}/probe-{uuid.uuid4().hex}"
    token = os.urandom(8).hex().encode()
    try:
        fs.pipe_file(probe, token)
        if fs.cat_file(probe) != token:
            raise OSError("the object read back differs from the one written")
        fs.rm_file(probe)
    except Exception as error:  # noqa: BLE001 - botocore, gcsfs and aiohttp each raise their own
        raise BadInput(reach_problem(url, error, fs, timeout)) from None
