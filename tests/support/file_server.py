"""A real HTTP server on 127.0.0.1, in a thread of the test process, that serves fixed files by path and counts the
requests it gets: a stand-in for the Hugging Face hub (`HF_ENDPOINT`) or any other plain file host."""

from __future__ import annotations

import ssl
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer


@contextmanager
def serving(server: HTTPServer) -> Iterator[None]:
    """`server` answers from a daemon thread while the block runs; then it stops and its socket is closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class FileServer:
    endpoint: str
    files: dict[str, bytes]  # URL path ("/owner/repo/resolve/rev/file") → body
    requests: Counter = field(default_factory=Counter)  # URL path → GETs


@contextmanager
def file_server(files: dict[str, bytes], tls: ssl.SSLContext | None = None) -> Iterator[FileServer]:
    """Serve `files` on 127.0.0.1, over HTTPS with `tls` (a server context) if given."""
    served: FileServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            served.requests[self.path] += 1
            body = served.files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args) -> None:  # quiet: pytest shows what a test asserts
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    served = FileServer(f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}", files)
    with serving(server):
        yield served
