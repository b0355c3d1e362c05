"""A real S3 API on 127.0.0.1 (moto's server, in a thread of the test process) that counts what it is asked:
GETs' bytes by object path, and requests by method and path. Processes a test starts (CLI runs, Dask workers)
reach it through `environment`, as a user's do through AWS_* variables."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from support.file_server import serving


@dataclass
class S3Server:
    endpoint: str
    served: Counter = field(default_factory=Counter)  # object path → bytes of its GETs' bodies
    requests: Counter = field(default_factory=Counter)  # (method, path) → requests

    @property
    def environment(self) -> dict[str, str]:
        """What a process needs to reach this server with s3fs or boto3."""
        return {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint}

    def filesystem(self):
        """A new s3fs filesystem on this server (no instance or listings cache: a test sees the objects as they
        are now, however often it looks)."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key="test", secret="test", skip_instance_cache=True,
                                 use_listings_cache=False)

    def puts(self, prefix: str = "") -> int:
        """PUT requests (single uploads and multipart parts) to paths under `/prefix`."""
        return sum(n for (method, path), n in self.requests.items()
                   if method == "PUT" and path.startswith(f"/{prefix}"))

    def clear(self) -> None:
        self.served.clear()
        self.requests.clear()


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port; stop it on leaving."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    state = S3Server(endpoint="")

    def counting(environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ["PATH_INFO"]
        state.requests[method, path] += 1
        body = app(environ, start_response)
        for chunk in body:
            if method == "GET":
                state.served[path] += len(chunk)
            yield chunk

    server = make_server("127.0.0.1", 0, counting, threaded=True)
    state.endpoint = f"http://127.0.0.1:{server.server_port}"
    with serving(server):
        yield state


@contextmanager
def bucket_in_environment(bucket: str) -> Iterator[S3Server]:
    """A server holding `bucket`, which this process (and every process it starts) reaches through AWS_* variables
    while it runs. fsspec keeps s3fs instances by their options, not by the endpoint the environment names, so its
    cache is cleared on both sides: none made for another module's server serves this one, nor one made here the
    next module's."""
    import logging

    import pytest
    from s3fs import S3FileSystem

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    S3FileSystem.clear_instance_cache()
    with s3_server() as server, pytest.MonkeyPatch.context() as env:
        for name, value in server.environment.items():
            env.setenv(name, value)
        server.filesystem().mkdir(bucket)
        yield server
    S3FileSystem.clear_instance_cache()
