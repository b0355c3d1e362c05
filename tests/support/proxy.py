"""A TCP proxy on 127.0.0.1 in front of a server (the test's S3 server), in threads of the test process, that a test
turns into the endpoints users meet: one that stops answering (the kernel accepts, nothing answers), one that
refuses connections, and one that delays a single request.

    with tcp_proxy(server.endpoint) as proxy:    # proxy.endpoint: http://127.0.0.1:PORT
        proxy.silent()       # every connection, open or new, is accepted and read; nothing is answered
        proxy.refuse()       # the port is closed: connecting is refused, open connections are reset
        proxy.delay(5.0)     # the next request waits 5 s before it is passed on; then as before
        proxy.answer()       # back to passing everything on
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class TcpProxy:
    target: tuple[str, int]
    port: int = 0
    mode: str = "answer"  # answer, silent, refuse
    delays: list[float] = field(default_factory=list)  # for the next requests, one each
    requests: int = 0  # requests passed on (chunks from a client that start a new exchange)
    _listener: socket.socket | None = None
    _connections: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def answer(self) -> None:
        with self._lock:
            self.mode = "answer"
        self._listen()

    def silent(self) -> None:
        with self._lock:
            self.mode = "silent"
        self._listen()

    def refuse(self) -> None:
        with self._lock:
            self.mode = "refuse"
            listener, self._listener = self._listener, None
            connections = list(self._connections)
        if listener is not None:
            listener.close()
        for sock in connections:  # dropped, as a stopped server's are
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def delay(self, seconds: float) -> None:
        with self._lock:
            self.delays.append(seconds)

    def _listen(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self.port = listener.getsockname()[1]
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: refused from now on
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._connections.add(client)
        upstream = None
        try:
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()
            while chunk := client.recv(65536):
                with self._lock:
                    mode = self.mode
                    wait = self.delays.pop(0) if self.delays and mode == "answer" else 0.0
                if mode == "refuse":
                    break  # the connection is dropped, as a stopped server's are
                if mode == "silent":
                    continue  # read and dropped: the server never hears of it, the client never hears back
                if wait:
                    time.sleep(wait)
                self.requests += 1
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                self._connections.discard(client)
            for sock in (client, upstream):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()

    def _answers(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while chunk := upstream.recv(65536):
                if self.mode != "answer":
                    continue
                client.sendall(chunk)
        except OSError:
            pass

    def close(self) -> None:
        self.refuse()


@contextlib.contextmanager
def tcp_proxy(endpoint: str) -> Iterator[TcpProxy]:
    """A proxy in front of `endpoint` (http://HOST:PORT), answering; closed on leaving."""
    parts = urlsplit(endpoint)
    proxy = TcpProxy(target=(parts.hostname or "127.0.0.1", parts.port or 80))
    proxy.answer()
    try:
        yield proxy
    finally:
        proxy.close()
