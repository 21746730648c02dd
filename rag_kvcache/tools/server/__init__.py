"""`rag-kvcache serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over one engine.

`create_app(load)` builds the app; `load` returns the engine and runs in a thread after the
server starts, so `/health` can say 503 while the model loads. Imported when first named, so
that the command's parser can read `limits` without loading torch or the web stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rag_kvcache.tools.server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from rag_kvcache.tools.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
