"""Requests to object storage and http(s) servers bounded in time: a remote source, a cache root, a version read
back. Each request waits at most the timeout (--request-timeout) to connect and for each answer, is tried once
more, and a refused or unanswered one is named in one line with its endpoint.

The timeouts themselves are set in the filesystem's options (files.with_timeouts); what a failed request was is
read from its exception's chain (files.network_failure).
"""

from __future__ import annotations

from typing import Any

from sft_tokenize.files import network_failure, with_timeouts


def bounded_filesystem(url: str, storage_options: dict | None, timeout: float | None,
                       **fixed: Any) -> tuple[Any, str]:
    """fsspec's filesystem of `url` and the path on it, each of its requests bounded by `timeout` seconds to
    connect and for each answer (with_timeouts, bounded): a remote source, a cache version read from a bucket."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **with_timeouts(url, storage_options, timeout), **fixed)
    return bounded(fs), path


def bounded(fs: Any) -> Any:
    """An S3 filesystem whose requests the timeouts bound (with_timeouts sets botocore's), as every S3 filesystem
    of this process is from now on (bound_s3_requests)."""
    if hasattr(fs, "call_s3"):
        bound_s3_requests()
        fs.retries = 1
    return fs


def bound_s3_requests() -> None:
    """Bound the S3 requests of this process, ours and Prefect's (its result records on a bucket root):
    - no `Expect: 100-continue` header on uploads from clients made from now on: aiohttp's wait for the server's
      go-ahead is bounded by no timeout, so an endpoint that accepts connections and never answers would hang an
      upload for good (the body is sent at once instead: that costs bytes only when the server refuses it);
    - s3fs does not try a timed-out request 5 times over botocore's own retry (with_timeouts: one more attempt):
      a silent endpoint would hold each request for 10 timeouts."""
    import s3fs
    from botocore import handlers

    handlers.BUILTIN_HANDLERS[:] = [spec for spec in handlers.BUILTIN_HANDLERS
                                    if spec[1] is not handlers.add_expect_header]
    s3fs.S3FileSystem.retries = 1


def endpoint(fs: Any, url: str) -> str:
    """The URL and, where the store's client names one, its endpoint: what a failed request names."""
    client = getattr(fs, "s3", None)
    where = getattr(getattr(client, "meta", None), "endpoint_url", None)
    return f"{url} (endpoint {where})" if where else url


def unanswered(error: BaseException, fs: Any, url: str, timeout: float | None) -> str | None:
    """`URL (endpoint E): no answer within N s (--request-timeout)` or `...: connection refused` where that is
    why a request failed, else None."""
    reason = network_failure(error)
    if reason is None:
        return None
    waited = f" within {timeout:g} s (--request-timeout)" if reason == "no answer" and timeout else ""
    return f"{endpoint(fs, url) if fs is not None else url}: {reason}{waited}"
