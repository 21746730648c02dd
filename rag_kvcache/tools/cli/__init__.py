"""The `rag-kvcache` command line: `main.py` parses and dispatches; one module per group of
commands (documents, markup, store, measure), each adding its parsers; `common.py` holds what
they share. Heavy imports (torch, the model) happen inside the commands."""

from rag_kvcache.tools.cli.main import main

__all__ = ["main"]
