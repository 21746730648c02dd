"""`rag-kvcache serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over one engine.

`create_app(load)` builds the app; `load` returns the engine and runs in a thread after the
server starts, so `/health` can say 503 while the model loads.
"""

from rag_kvcache.tools.server.app import create_app

__all__ = ["create_app"]
