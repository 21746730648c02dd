"""Optional dependencies, one per extra of the package: imported where they are used, never by
`import rag_kvcache`, and a missing one is an ImportError that says what to install.

    redis = LazyModule("redis", extra="redis", purpose="the Redis blob tier")  # at module level
    require("llama_index.core", extra="llama-index", purpose="the LlamaIndex adapters")
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from rag_kvcache.errors import RagKVCacheError


class MissingExtraError(RagKVCacheError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def missing_extra(err: ImportError, extra: str, purpose: str) -> MissingExtraError:
    """The error to raise (`from err`) when importing an optional dependency failed."""
    what = err.name or "an optional dependency"
    return MissingExtraError(
        f'{purpose} needs {what}, which is not installed: pip install "rag-kvcache[{extra}]"',
        name=err.name,
    )


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """`module`, imported now; if it (or its parent package) is missing, a MissingExtraError.
    Any other import failure inside an installed package is raised as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        parts = module.split(".")
        if err.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise
        raise missing_extra(err, extra, purpose) from err


class LazyModule:
    """A module imported on first attribute access (through `require`), for an optional
    dependency that a module uses throughout but only once it is actually asked for."""

    def __init__(self, module: str, extra: str, purpose: str):
        self._spec = (module, extra, purpose)
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy, pickle and friends probe dunders: not the module's
            raise AttributeError(attr)
        if self._module is None:
            self._module = require(*self._spec)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._spec[0]!r} (extra {self._spec[1]!r})>"
