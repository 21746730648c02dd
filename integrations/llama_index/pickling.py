"""Components that pickle as their engine's configuration (KVCacheLLM, KVCacheRetriever).

An engine holds a model, a store, locks and threads, none of which can travel to another
process; its `EngineConfig` can. Unpickling opens an engine on that configuration (loading the
model there), so a component can go to a worker process (Ray, multiprocessing) and answer there
as it did here.
"""

from __future__ import annotations

from rag_kvcache.config import EngineConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError


def reopened_engine(config: EngineConfig, fingerprint: str, what: str) -> RagKVCache:
    """An engine on `config`, checked to run the model (`fingerprint`) the pickled `what`'s
    engine ran: an engine built around a loaded model (`RagKVCache(lm=...)`) whose
    configuration names another would answer with that other model."""
    engine = RagKVCache(config)
    if engine.lm.fingerprint != fingerprint:
        engine.close()
        raise ConfigError(
            f"the pickled {what}'s engine ran model {fingerprint}, but its configuration "
            f"loads {engine.lm.fingerprint}: an engine built around a loaded model "
            "(RagKVCache(lm=...)) pickles only if EngineConfig.model names that model"
        )
    return engine
