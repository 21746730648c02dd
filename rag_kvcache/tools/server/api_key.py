"""The API key's rule, shared by the server (`--api-key`) and its clients (the demo app's
remote mode): light, so a client need not import the server's web stack to check a key."""

from __future__ import annotations

from rag_kvcache.errors import ConfigError


def check_api_key(key: str) -> str:
    """An API key a client can send: printable ASCII, not empty, no space at either end. A
    header's bytes reach the server as Latin-1, and its ends are trimmed: any other key would
    match no request, and the server would refuse every client with no sign why."""
    if not key or not (key.isascii() and key.isprintable()) or key.strip() != key:
        raise ConfigError(
            "an API key must be printable ASCII, not empty, with no space at either end (it "
            "travels in an HTTP header)"
        )
    return key
