"""The embedded server's retry of requests that SQLite was too busy to answer (ASGI middleware).

Prefect's server answers 503 when SQLite reports the database busy (`is_client_retryable_exception`): with the
database in WAL mode, a transaction that read before another connection committed cannot then write, and fails at
once (no busy timeout applies). On an embedded server that happens when a run's first task runs acquire their
tag's concurrency slots while the server's own services record the flow's events: ~1 run in 8 on two cores. Prefect's
client retries after 2 s (then 4, 8...: `2 ** try`, no Retry-After sent), so that run's first slice waited 2 s for
a conflict that clears in milliseconds. Here the request is run again after 20 ms, then 50, 100, 200 and 400 ms,
before the client sees the 503 and backs off as before. The transaction of a 503 was rolled back, so running the
request again is what the client's retry would do, only sooner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]

BUSY = 503
DELAYS = (0.02, 0.05, 0.1, 0.2, 0.4)  # seconds before each new attempt: 0.77 s in all


class RetryBusy:
    """Run an HTTP request again, after a short wait, while the app answers it 503 (at most len(DELAYS) times)."""

    def __init__(self, app: ASGIApp, delays: tuple[float, ...] = DELAYS):
        self.app, self.delays = app, delays

    async def __call__(self, scope: MutableMapping[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request: list[Message] = []  # the request's messages, replayed to each attempt (Prefect's are small JSON)
        while not request or (request[-1]["type"] == "http.request" and request[-1].get("more_body")):
            request.append(await receive())
        for delay in self.delays:
            if not await self._attempt(scope, request, receive, send, retry=True):
                return
            await asyncio.sleep(delay)
        await self._attempt(scope, request, receive, send, retry=False)

    async def _attempt(self, scope, request: list[Message], receive, send, retry: bool) -> bool:
        """Run the request once; whether it was answered 503 and, `retry` being set, that answer dropped."""
        replay = iter(request)
        busy = False

        async def replayed() -> Message:
            return next(replay, None) or await receive()  # then what the client sends next (a disconnect)

        async def unless_busy(message: Message) -> None:
            nonlocal busy
            if retry and message["type"] == "http.response.start" and message["status"] == BUSY:
                busy = True
            if not busy:
                await send(message)

        try:
            await self.app(dict(scope), replayed, unless_busy)  # a copy: Starlette's Mount rewrites the scope
        except Exception:
            # Starlette raises the error again once its handler has answered (for the server's log): an answer
            # dropped here is the one error that is not the client's to see.
            if not busy:
                raise
        return busy


def create_app() -> ASGIApp:
    """Prefect's server app (server_state.SERVER_APP, made as uvicorn's factory mode makes it) behind RetryBusy."""
    from uvicorn.importer import import_from_string

    from sft_tokenize.server.server_state import SERVER_APP

    return RetryBusy(import_from_string(SERVER_APP)())
