"""Components that pickle as their engine's configuration (KVCacheLLM, KVCacheRetriever).

An engine holds a model, a store, locks and threads, none of which can travel to another
process; its `EngineConfig` can. Unpickling opens an engine on that configuration (loading the
model there), so a component can go to a worker process (Ray, multiprocessing) and answer there
as it did here. Components over one engine pickle the same `PickledEngine`, and pickle writes
an object it meets twice once: pickled together (a query engine's LLM and retriever), they
come back over one engine, not one model loaded per component.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from rag_kvcache.config import EngineConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError


class PickledEngine:
    """What a component pickles in its engine's place: unpickled, it is the reopened engine."""

    def __init__(self, engine: RagKVCache):
        self.config, self.fingerprint = engine.config, engine.lm.fingerprint

    def __reduce__(self) -> tuple[Any, ...]:
        return (reopened_engine, (self.config, self.fingerprint))


def pickled(engine: RagKVCache) -> PickledEngine:
    """The one `PickledEngine` of `engine` (for as long as the engine lives)."""
    with _lock:
        found = _pickled.get(engine)
        if found is None:
            found = _pickled[engine] = PickledEngine(engine)
        return found


_pickled: weakref.WeakKeyDictionary[RagKVCache, PickledEngine] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def reopened_engine(config: EngineConfig, fingerprint: str) -> RagKVCache:
    """An engine on `config`, checked to run the model (`fingerprint`) the pickled engine ran:
    an engine built around a loaded model (`RagKVCache(lm=...)`) whose configuration names
    another would answer with that other model."""
    engine = RagKVCache(config)
    if engine.lm.fingerprint != fingerprint:
        engine.close()
        raise ConfigError(
            f"the pickled component's engine ran model {fingerprint}, but its configuration "
            f"loads {engine.lm.fingerprint}: an engine built around a loaded model "
            "(RagKVCache(lm=...)) pickles only if EngineConfig.model names that model"
        )
    return engine
