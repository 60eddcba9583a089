"""An ASGI middleware that refuses HTTP bodies over a byte limit with 413 and an OpenAI error object.

A declared Content-Length over the limit is refused before a byte is read; a body that grows past the
limit while it streams in (chunked) is refused as soon as it does, so no request buffers more than the
limit."""

from __future__ import annotations

import json
from typing import Any


class BodyTooLarge(Exception):
    pass


def error_body(limit: int) -> bytes:
    return json.dumps({"error": {
        "message": f"the request body exceeds the limit of {limit} bytes",
        "type": "invalid_request_error", "param": None, "code": 413,
    }}).encode()


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = error_body(self.max_bytes)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
