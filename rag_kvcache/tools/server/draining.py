"""A stopping server ends its open streams with an error event before it cuts them.

On SIGTERM or Ctrl-C uvicorn stops taking requests and gives those in flight
`--shutdown-timeout` seconds, then cancels them: a stream cut there ends without `[DONE]` and
without a word, and its client sees a broken connection (or, reading the events itself, an
answer that just stops). `Draining.begin` (called by the `serve` command's server as the
signal arrives) sets a deadline shortly before that cut; `until_stopped` ends a stream still
open at the deadline with `ServerStopping`, which the app sends as a 503 error event, so the
client knows the answer is incomplete and why, and can ask again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from rag_kvcache.errors import RagKVCacheError

MARGIN_S = 1.0  # the streams end this long before the cut (at most half the grace period)
POLL_S = 0.25  # how often a stream waiting for its next piece looks at the deadline


class ServerStopping(RagKVCacheError):
    """The server is shutting down and this answer was ended before its end."""


class Draining:
    """When a stopping server's open streams must end; nothing while it runs on."""

    def __init__(self) -> None:
        self._deadline: float | None = None

    def begin(self, grace_s: float) -> None:
        """The server was asked to stop, and cuts what still runs in `grace_s` seconds (a
        second signal changes nothing: the first one's deadline stands)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + grace_s - min(MARGIN_S, grace_s / 2)

    def left_s(self) -> float | None:
        """Seconds until the streams must end (<= 0: now); None while the server runs on."""
        return None if self._deadline is None else self._deadline - time.monotonic()


async def until_stopped(pieces: AsyncIterator[str], draining: Draining) -> AsyncIterator[str]:
    """`pieces` as they come, until `draining`'s deadline: then ServerStopping (the piece
    being decoded is abandoned; the caller's stream is aborted by its own clean-up)."""
    while True:
        piece = asyncio.ensure_future(anext(pieces))
        try:
            while not piece.done():
                left = draining.left_s()
                if left is not None and left <= 0:
                    raise ServerStopping(
                        "the server is shutting down: this answer was ended before its end; "
                        "ask again"
                    )
                wait_s = POLL_S if left is None else min(left, POLL_S)
                await asyncio.wait({piece}, timeout=wait_s)
        finally:
            if not piece.done():
                piece.cancel()
                await asyncio.wait({piece})  # (never raises: a cancel of this task stays one)
        try:
            text = piece.result()
        except StopAsyncIteration:
            return
        yield text
