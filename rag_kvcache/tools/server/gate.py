"""What every `/v1/` request passes before a route reads its body: the API key, then the body's
size.

A route's dependencies run only after FastAPI has read and parsed the body, so a key checked
there lets anyone without one learn how the server parses JSON (a malformed body got a 400
before the missing key's 401), and a size checked there comes after the whole body is in
memory. A plain ASGI middleware sees the headers first: no key, 401; a Content-Length over the
limit, 413 before a byte is read; a body without one (chunked) is counted as it arrives and
refused once past the limit.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rag_kvcache.tools.server.api_key import check_api_key
from rag_kvcache.tools.server.limits import DEFAULT_MAX_BODY_BYTES

Reject = Callable[[int, str, str | None], Response]  # status, message, code -> the error body


class Gate:
    """ASGI middleware: the API key (when the server has one) and the body-size limit of every
    request under `/v1/`; `/health` and `/metrics` stay open. `reject` builds the error
    response (OpenAI's shape) and counts it."""

    def __init__(
        self,
        app: ASGIApp,
        reject: Reject,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.app, self.reject = app, reject
        self.api_key = None if api_key is None else check_api_key(api_key)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if not self.authorized(headers.get(b"authorization", b"")):
            message = "missing or wrong API key (Authorization: Bearer KEY)"
            await self.reject(401, message, "invalid_api_key")(scope, receive, send)
            return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self.reject(413, self.too_large(), "request_too_large")(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:  # FastAPI passes an HTTPException on as is
                raise HTTPException(413, self.too_large())
            return message

        await self.app(scope, counted, send)

    def authorized(self, given: bytes) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = given.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    def too_large(self) -> str:
        return (
            f"the request body is larger than this server takes ({self.max_body_bytes} bytes; "
            "serve --max-body-mib)"
        )
