"""ASGI middleware of the server: the API key, and the request body limit enforced on the bytes received
(chunked uploads too)."""

from __future__ import annotations

import json
from collections.abc import Callable


class Guard:
    """Before the app sees a request: 401 without the API key (every path but /health), then 413 for a body over
    `max_bytes`, counting the bytes as they arrive — a declared Content-Length over the limit is refused before
    any is read, and a body without one (chunked transfer encoding) is read at most up to the limit. Bodies
    under the limit are buffered and replayed to the app. on_reject(status) is called for each refusal."""

    def __init__(self, app, api_key: str | None, max_bytes: int, on_reject: Callable[[int], None] | None = None) -> None:
        self.app, self.api_key, self.max_bytes, self.on_reject = app, api_key, max_bytes, on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if (self.api_key and scope.get("path") != "/health"
                and headers.get(b"authorization", b"") != f"Bearer {self.api_key}".encode()):
            await self._reject(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "AuthenticationError")
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send, 413, f"request body of {int(length)} bytes is over the limit of "
                                          f"{self.max_bytes} (--max-body-bytes)")
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(send, 413, f"request body is over the limit of {self.max_bytes} bytes "
                                              "(--max-body-bytes)")
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()  # after the body: a disconnect, when it comes

        await self.app(scope, replayed, send)

    async def _reject(self, send, status: int, message: str, type_: str = "BadRequestError") -> None:
        if self.on_reject is not None:
            self.on_reject(status)
        body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
