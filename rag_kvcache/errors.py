"""Exceptions raised by rag-kvcache. Each message names the bad value and what is allowed."""

from collections.abc import Sequence


def shown_name(value: object) -> str:
    """A caller's value as an error quotes it: a megabyte of it says no more than 80 chars."""
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


class RagKVCacheError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(RagKVCacheError, ValueError):
    """A configuration value is out of range or of the wrong kind."""


class UnsupportedModelError(RagKVCacheError):
    """The model cannot be linked exactly (no RoPE, length-dependent RoPE, sliding windows...)."""


class UnknownCacheIdError(RagKVCacheError, KeyError):
    """A cache ID is not in the store (never ingested, expired or removed)."""

    def __init__(self, cache_ids: Sequence[object]):
        self.cache_ids = list(cache_ids)  # as given (not every one need be a string)
        # each quoted alike (an ID may be '' or hold a comma), a megabyte of one cut short
        shown = ", ".join(map(shown_name, self.cache_ids[:5]))
        shown += " ..." if len(self.cache_ids) > 5 else ""
        super().__init__(
            f"unknown cache ID(s): {shown}; ingest the text first "
            "(RagKVCache.generate_context_cache) or check it was not expired"
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class EngineClosedError(RagKVCacheError):
    """The engine was closed: its loop takes no more requests and fails those in flight."""


class FingerprintMismatchError(RagKVCacheError):
    """Cached KV was produced by a different model, dtype or RoPE setting."""


class DtypeMismatchError(RagKVCacheError, TypeError):
    """Cached KV tensors are not in the model's dtype."""


class ContextTooLongError(RagKVCacheError):
    """Prompt (plus tokens to generate) does not fit the model's context window."""


class KVBudgetError(ContextTooLongError):
    """A request's KV (context plus room for its answer) does not fit the serving path's KV
    budget (`EngineConfig.kv_cache_bytes`), even with nothing else decoding."""


class EmptyChunkError(RagKVCacheError, ValueError):
    """A chunk has no tokens; there is nothing to encode."""


class StrategyError(RagKVCacheError, ValueError):
    """A link strategy name cannot be parsed or cannot be applied to these chunks."""


class CalibrationError(RagKVCacheError, ValueError):
    """A link calibration is missing, damaged, or was trained for another model or encoding."""


class InvalidNameError(RagKVCacheError, ValueError):
    """A name or ID given by a caller (cache ID, schema name) is not of the allowed form, so it
    can never become a path or a key."""


class StoreError(RagKVCacheError):
    """A store cannot be opened or used as asked (its folder, catalog or blob tier); the message
    says which and what to do."""


class StoreNotFoundError(StoreError):
    """No store where one was named, and the caller only reads stores (never makes one)."""


class StoreUnavailableError(StoreError, ConnectionError):
    """A part of the store that answers over a connection (the Redis tier, the catalog's
    database) cannot be reached or did not answer; nothing was half-recorded: try again."""


class StoreFullError(StoreError, OSError):
    """The disk (of the blobs or of the catalog) is full: the chunk was not recorded."""


class StoreDamagedError(StoreError):
    """A store's parts disagree (its catalog is lost, or belongs to another store; blobs and
    catalog differ wholesale): refused rather than read as an empty store."""
