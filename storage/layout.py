"""A store's folder: what lives where, and the one door by which a name becomes a path.

    <root>/store.json             the marker: format version, store ID, which catalog
    <root>/catalog.sqlite         the catalog (unless a catalog URL names another database)
    <root>/blobs/ab/<id>.safetensors   blobs of the disk tier (unless Redis keeps them)
    <root>/index.faiss, index.ids the vector index of retrieval (a cache of the catalog),
    <root>/index.faiss.sha256     and the checksums it is loaded against
    <root>/schemas/<name>.xml     Prompt Cache schemas added with `rag-kvcache schema add`

Every name or ID that comes from a caller (a cache ID, a schema name) becomes a path, or a
Redis key, only through `named_path` / `checked_name`, which accept nothing but a fixed form:
cache IDs are exactly 32 lowercase hex digits (what `rag_kvcache.kv.make_cache_id` makes),
schema names a short ASCII slug; a store's Redis keys carry its store ID (`redis_prefix`).
So no `..`, separator, NUL, look-alike letter or overlong
name can reach the file system.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rag_kvcache.errors import (
    InvalidNameError,
    StoreDamagedError,
    StoreError,
    StoreNotFoundError,
    shown_name,
)

MARKER_FILE = "store.json"
FORMAT_VERSION = 1  # of the folder's layout; the catalog's own schema has Alembic revisions
CATALOG_FILE = "catalog.sqlite"
BLOBS_FOLDER = "blobs"
# the vector index's temporary files while it is saved (`index.faiss.<pid>-<thread>.tmp`, ...)
INDEX_TEMPORARIES = re.compile(r"index\.(faiss|ids|faiss\.sha256)\.([0-9]+)-[0-9]+\.tmp")
SCHEMAS_FOLDER = "schemas"
CACHE_ID_LENGTH = 32


@dataclass(frozen=True)
class NameRule:
    pattern: re.Pattern[str]
    allowed: str  # the rule in words, for the error message
    relative_path: Callable[[str], Path] | None  # where a valid name lives under its folder


MAX_SOURCE_CHARS = 1024  # a document's source (its file's path) as the catalog keeps it

RULES = {
    "cache ID": NameRule(
        re.compile(f"[0-9a-f]{{{CACHE_ID_LENGTH}}}"),
        f"exactly {CACHE_ID_LENGTH} lowercase hex digits",
        lambda name: Path(name[:2], f"{name}.safetensors"),
    ),
    "schema name": NameRule(
        re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"),
        "1-64 ASCII letters, digits, '_', '.' or '-', not starting with '.' or '-'",
        lambda name: Path(f"{name}.xml"),
    ),
    "store ID": NameRule(re.compile("[0-9a-f]{32}"), "exactly 32 lowercase hex digits", None),
    # a catalog value, never a path: any text but NUL, which PostgreSQL's text cannot hold,
    # and lone surrogates, which no database encodes (they failed the catalog's write)
    "document source": NameRule(
        re.compile(f"[^\x00\ud800-\udfff]{{1,{MAX_SOURCE_CHARS}}}", re.DOTALL),
        f"1-{MAX_SOURCE_CHARS} characters, none of them NUL or a lone surrogate",
        None,
    ),
}


def checked_name(kind: str, value: object) -> str:
    """`value` if it is a valid `kind` ('cache ID', 'schema name'), else InvalidNameError."""
    if is_name(kind, value):
        return value  # type: ignore[return-value]  # is_name checked it is a str
    rule = RULES[kind]
    raise InvalidNameError(f"not a {kind}: {shown_name(value)} (expected {rule.allowed})")


def is_name(kind: str, value: object) -> bool:
    """Whether `value` is a valid `kind` (for listing what a folder or a Redis holds)."""
    return isinstance(value, str) and RULES[kind].pattern.fullmatch(value) is not None


def named_path(folder: Path, kind: str, value: object) -> Path:
    """The path of the thing called `value` under `folder`: the only way a caller's name
    becomes a path. The result is always strictly inside `folder`."""
    relative_path = RULES[kind].relative_path
    if relative_path is None:
        raise ValueError(f"a {kind} never names a file")
    return Path(folder) / relative_path(checked_name(kind, value))


def redis_prefix(store_id: str) -> str:
    """The Redis key prefix of a store's blobs: its own namespace, so stores sharing a Redis
    database never see (or gc) each other's keys."""
    return f"rag-kvcache:{checked_name('store ID', store_id)}:blob:"


def schema_path(root: Path, name: object) -> Path:
    """Where the schema `name` of the store at `root` is kept."""
    return named_path(Path(root) / SCHEMAS_FOLDER, "schema name", name)


def make_folder(folder: Path) -> None:
    """Make `folder` (and its parents) if missing; StoreError if it cannot be made or written."""
    if folder.exists() and not folder.is_dir():
        raise StoreError(f"{folder} is a file, not a store folder; name a folder with --store")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreError(f"cannot make the store folder {folder}: {err.strerror or err}") from None
    if not os.access(folder, os.W_OK | os.X_OK):  # EROFS too, even for root
        raise StoreError(
            f"the store folder {folder} is read-only: the catalog and the vector index are "
            "written there (SQLite even to read); mount or copy it read-write"
        )


def open_folder(root: Path, create: bool) -> None:
    """The store's folder, made if `create`; a reader (not `create`) never makes one, so a
    mistyped --store is a StoreNotFoundError, not a new empty store."""
    if not create and not root.exists():
        raise StoreNotFoundError(
            f"no store at {root}: check --store, or ingest documents there first"
        )
    make_folder(root)


# ----------------------------------------------------------------------------- the marker


@dataclass(frozen=True)
class StoreMarker:
    """What a store's folder says about itself: written when the store is first opened, so a
    store that lost its catalog is known to be damaged, never taken for a new empty one."""

    format: int  # FORMAT_VERSION of the writer
    store_id: str  # the catalog's store ID: the folder and the catalog belong together
    catalog: str  # where the catalog is (URL, password hidden), for people reading the file


def read_marker(root: Path) -> StoreMarker | None:
    """The marker of the store at `root`, None if it has none (new, or from before markers)."""
    path = Path(root) / MARKER_FILE
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        marker = StoreMarker(int(fields["format"]), str(fields["store_id"]), str(fields["catalog"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StoreDamagedError(f"the store marker {path} is unreadable ({err})") from None
    if marker.format > FORMAT_VERSION:
        raise StoreDamagedError(
            f"the store at {root} has format {marker.format}; this rag-kvcache reads up to "
            f"{FORMAT_VERSION}: upgrade rag-kvcache"
        )
    checked_name("store ID", marker.store_id)
    return marker


def write_marker(root: Path, marker: StoreMarker) -> None:
    """Write the marker atomically (a temporary file renamed over it)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-marker-", dir=root)
    os.fchmod(fd, 0o644)  # as the store's other files (mkstemp's 0600 hid it from other users)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(marker), f, indent=1)
        f.write("\n")
    os.replace(tmp, Path(root) / MARKER_FILE)
