"""The embedded server runs a request again while Prefect answers it 503 (SQLite busy), before the client backs off
for seconds (server/busy_retry.py)."""

from __future__ import annotations

import asyncio
import json

import httpx

from sft_tokenize.server.busy_retry import RetryBusy

PATH = "/api/v2/concurrency_limits/increment-with-lease"


class Busy:
    """An ASGI app that answers 503 the first `busy` times, then 200 with the request's body; it records each body."""

    def __init__(self, busy: int, status: int = 503, raise_after: bool = False):
        self.busy, self.status, self.raise_after, self.bodies = busy, status, raise_after, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"] != PATH:  # as a router would: 404
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        scope["path"] = scope["path"].removeprefix("/api")  # as Starlette's Mount rewrites it for the mounted app
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        status = self.status if len(self.bodies) <= self.busy else 200
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"busy" if status != 200 else body})
        if self.raise_after and status != 200:  # as Starlette's ServerErrorMiddleware does once its handler answered
            raise RuntimeError("database is locked")


def _post(app, content: bytes | list[bytes]) -> httpx.Response:
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            return await client.post(PATH, content=content)

    return asyncio.run(post())


def test_a_request_answered_503_is_run_again_with_its_whole_body_until_answered():
    app = Busy(busy=2)
    chunks = [json.dumps({"names": ["tag:sft-tokenize"]}).encode(), b" " * 70_000]  # streamed in two messages

    async def streamed():
        for chunk in chunks:
            yield chunk

    answer = _post(RetryBusy(app, delays=(0.001, 0.001, 0.001)), streamed())
    assert (answer.status_code, answer.content) == (200, b"".join(chunks))
    assert app.bodies == [b"".join(chunks)] * 3


def test_the_error_starlette_raises_again_after_answering_503_is_not_the_clients():
    app = Busy(busy=1, raise_after=True)
    answer = _post(RetryBusy(app, delays=(0.001,)), b"{}")
    assert (answer.status_code, answer.content) == (200, b"{}")
    assert len(app.bodies) == 2


def test_a_request_still_busy_after_every_retry_reaches_the_client_as_503():
    app = Busy(busy=10)
    answer = _post(RetryBusy(app, delays=(0.001, 0.002)), b"{}")
    assert (answer.status_code, answer.content) == (503, b"busy")
    assert len(app.bodies) == 3  # the first attempt and one after each delay


def test_other_errors_are_answered_at_once():
    app = Busy(busy=1, status=500)
    answer = _post(RetryBusy(app, delays=(0.001,)), b"{}")
    assert answer.status_code == 500 and len(app.bodies) == 1
