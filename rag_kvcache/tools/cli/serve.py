"""`rag-kvcache serve`: the OpenAI-compatible HTTP server over an existing store."""

from __future__ import annotations

import argparse
import contextlib
from types import FrameType

from rich.console import Console

from rag_kvcache.config import EngineConfig
from rag_kvcache.errors import ConfigError
from rag_kvcache.tools.cli.common import engine_config, engine_options, open_engine, whole
from rag_kvcache.tools.server.api_key import check_api_key
from rag_kvcache.tools.server.limits import DEFAULT_MAX_BODY_BYTES

LINK_BUDGET_S = EngineConfig.link_budget_s  # the engine's default, in seconds
# bounded: a stream asking for the whole window would otherwise hold a stop for hours on a CPU
# (and a supervisor's own grace period, often 30 s, would end it with SIGKILL)
SHUTDOWN_TIMEOUT_S = 20


def add_parsers(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP API: chat and completions, RAG over the store"
    )
    serve.add_argument("--host", default="127.0.0.1", help="(default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=whole(0, 65535), default=8000, help="(default 8000)")
    serve.add_argument(
        "--api-key",
        type=api_key,
        default=None,
        help="clients must send Authorization: Bearer KEY (printable ASCII)",
    )
    serve.add_argument(
        "--model-name", default=None, help="what clients call the model (default: its file name)"
    )
    serve.add_argument(
        "--max-body-mib",
        type=body_limit,
        default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
        help="larger request bodies get a 413 before they are read (default %(default)g)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=whole(0),
        default=SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM or Ctrl-C, seconds the answers in flight may take to finish; one "
        "still running a second before is ended with a 503 (a stream: an error event) "
        "(default %(default)s)",
    )
    serve.add_argument("--strategy", default=None, help="link strategy of RAG requests")
    serve.add_argument("--max-new-tokens", type=int, default=256, help="when a request says none")
    serve.add_argument(
        "--kv-cache-mib",
        type=whole(1),
        default=None,
        help="KV of requests decoding and of shared prefixes; more requests wait (default: a "
        "quarter of the machine's memory, half the GPU memory free once the model is loaded)",
    )
    serve.add_argument(
        "--link-budget-ms",
        type=link_budget,
        default=None if LINK_BUDGET_S is None else round(LINK_BUDGET_S * 1000),
        help="while requests stream, link new arrivals for at most this long between two "
        "decode steps (at least one); 'none': link every arrival first (sooner first tokens, "
        "streams held for a whole burst)",
    )
    engine_options(serve)
    serve.set_defaults(run=serve_command)


def body_limit(text: str) -> float:
    """--max-body-mib: a size in MiB, > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("a body limit is > 0 MiB")
    return value


def api_key(text: str) -> str:
    """--api-key: one a client can send (`api_key.check_api_key`)."""
    try:
        return check_api_key(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def link_budget(text: str) -> int | None:
    """--link-budget-ms: milliseconds (>= 0), or 'none'."""
    if text.strip().lower() == "none":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("a link budget is >= 0 ms, or 'none'")
    return value


def serve_command(args: argparse.Namespace, console: Console) -> int:
    from rag_kvcache.extras import require

    for needed in ("fastapi", "uvicorn", "prometheus_client"):  # one line naming the extra
        require(needed, extra="serve", purpose="rag-kvcache serve")
    import uvicorn

    from rag_kvcache.model.loading import check_model_source
    from rag_kvcache.tools.cli.common import open_store
    from rag_kvcache.tools.server import create_app

    # bad flags, a mistyped --model or --store and a device this torch cannot reach fail now,
    # in one line, not later as a /health that answers 503 for ever from a server that started
    check_model_source(engine_config(args).model)
    open_store(args).close()
    app = create_app(
        lambda: open_engine(args, console, existing=True),
        api_key=args.api_key,
        model_name=args.model_name,
        max_body_bytes=int(args.max_body_mib * (1 << 20)),
    )
    console.print(f"serving on http://{args.host}:{args.port} (the model loads in the background)")
    grace_s = args.shutdown_timeout

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            """As the stop signal comes: the answers still running are ended, with an
            error event, before uvicorn cuts them at the end of the grace period."""
            app.state.draining.begin(grace_s)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=grace_s
    )
    # the stop signal, raised again once uvicorn has stopped, is a clean stop (exit 0), as
    # `uvicorn.run` takes it
    server = Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3  # (3: never served, as `uvicorn.run` exits)
