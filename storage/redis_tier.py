"""A durable blob tier in Redis, shared by every worker that reaches the server.

Same contract as the disk tier (bytes in, bytes out, validated cache IDs as keys), inside the
store's own key namespace. A SET is
atomic, so there are no temporaries to clean. An unreachable server is a clear
StoreUnavailableError; the catalog is only updated after a blob is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rag_kvcache.errors import ConfigError, StoreFullError, StoreUnavailableError
from rag_kvcache.extras import LazyModule
from rag_kvcache.storage.layout import checked_name, is_name

if TYPE_CHECKING:
    import redis
else:  # the `redis` extra, imported when a RedisTier is first made
    redis = LazyModule("redis", extra="redis", purpose="the Redis blob tier")

T = TypeVar("T")


def without_password(url: str) -> str:
    """A Redis URL as messages may show it: its password, in the user part or the query
    (`?password=`, which redis-py reads too), replaced by ***."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    query = [(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(query=urlencode(query, safe="*")))


class RedisTier:
    name = "redis"

    def __init__(self, url: str, *, prefix: str):
        """`prefix`: the store's own key namespace (`layout.redis_prefix(store_id)`); gc and
        `ids` see only keys under it."""
        self.url, self.prefix = url, prefix
        try:
            self._redis = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=3)
        except ValueError as err:  # the URL may hold a password: not repeated here
            raise ConfigError(
                f"the Redis URL cannot be parsed ({err}); use redis://host:port/db"
            ) from None
        self.where = without_password(url)  # how errors name the server
        try:
            self._call(self._redis.ping)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close its connections (a store opened and refused in a loop ran Redis out of them)."""
        self._redis.close()

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, Redis's errors as the store's (its URL named without a password)."""
        where = self.where
        try:
            return fn(*args)
        except redis.AuthenticationError as err:
            raise StoreUnavailableError(
                f"Redis at {where} refused the credentials ({err}); check the Redis URL"
            ) from err
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise StoreUnavailableError(
                f"Redis at {where} is unreachable ({err}); start it or use the disk tier"
            ) from err
        except redis.OutOfMemoryError as err:
            raise StoreFullError(
                f"Redis at {where} is full ({err}): raise its maxmemory, or use the disk tier"
            ) from err
        except redis.ResponseError as err:  # read-only replica, no permission, ...
            raise StoreUnavailableError(f"Redis at {where} refused the command ({err})") from err
        except redis.RedisError as err:  # e.g. InvalidResponse: an HTTP proxy's reply
            raise StoreUnavailableError(
                f"Redis at {where} did not answer as a Redis server ({type(err).__name__}: "
                f"{err}); check the Redis URL"
            ) from err

    def key(self, cache_id: str) -> str:
        return self.prefix + checked_name("cache ID", cache_id)

    def put(self, cache_id: str, data: bytes) -> None:
        self._call(self._redis.set, self.key(cache_id), data)

    def get(self, cache_id: str, nbytes: int | None = None) -> bytearray | None:
        """The blob's bytes, or None; empty where they are not `nbytes` long (damage)."""
        value = self._call(self._value, self.key(cache_id))
        if value is None:
            return None
        return bytearray(value) if nbytes is None or len(value) == nbytes else bytearray()

    def _value(self, key: str) -> bytes | None:
        try:
            return self._redis.get(key)  # type: ignore[return-value]
        except redis.ResponseError as err:
            if str(err).startswith("WRONGTYPE"):  # another kind of value under our key:
                return b""  # a corrupt blob, rebuilt like any other
            raise

    def contains(self, cache_id: str) -> bool:
        return bool(self._call(self._redis.exists, self.key(cache_id)))

    def remove(self, cache_id: str) -> bool:
        return bool(self._call(self._redis.delete, self.key(cache_id)))

    def ids(self) -> Iterator[str]:
        for key in self._call(lambda: list(self._redis.scan_iter(match=self.prefix + "*"))):
            cid = key.decode(errors="replace")[len(self.prefix) :]
            if is_name("cache ID", cid):
                yield cid

    def remove_temporaries(self, older_than_s: float = 600.0) -> int:
        return 0  # a SET is atomic: nothing half-written

    def nbytes(self) -> int:
        return sum(int(self._call(self._redis.strlen, self.prefix + c)) for c in self.ids())
