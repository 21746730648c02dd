"""The catalog's database: engines with the settings it relies on, migrations, transactions.

SQLite file by default (WAL, busy timeout, foreign keys on every connection), PostgreSQL by URL
(`postgresql+psycopg://...`, optionally inside one schema, created if missing). The schema is
owned by the Alembic migrations shipped next to this module (`migrations/`, whose `env.py`
builds its engine here too) and upgraded to head whenever a `CatalogDatabase` is opened,
serialized across processes (SQLite `BEGIN IMMEDIATE`, PostgreSQL advisory lock).

`CatalogDatabase` is the opened, migrated database with its one-transaction read and write
contexts; `Catalog` (`catalog.py`) adds the operations on rows.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from rag_kvcache.errors import StoreFullError, StoreNotFoundError
from rag_kvcache.extras import require
from rag_kvcache.storage.records import CatalogError, CatalogUnavailableError

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_SQLITE_BUSY_MS = 30_000
PG_CONNECT_TIMEOUT_S = 10  # libpq waits 130 s for a host that accepts and never answers
# One advisory-lock key for "someone is changing the catalog schema" on a PostgreSQL server.
_PG_LOCK_KEY = zlib.crc32(b"rag_kvcache.storage.catalog")
_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def create_catalog_engine(url: str | URL, schema: str | None = None) -> Engine:
    """An engine with the per-connection settings the catalog relies on.

    SQLite: WAL (readers never block the writer), a 30 s busy timeout (writers queue instead of
    failing), foreign keys (cascades), synchronous=NORMAL (durable at checkpoints, fast), and
    SQLAlchemy-emitted BEGIN so that DDL is transactional and writers can ask for
    `BEGIN IMMEDIATE` (execution option `sqlite_begin`). PostgreSQL: `search_path` = `schema`,
    and a connection given up after PG_CONNECT_TIMEOUT_S (unless the URL says otherwise).
    """
    url = make_url(url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        if schema is not None:
            raise CatalogError(f"schema={schema!r} is only for PostgreSQL; SQLite has none")
        if url.database in (None, "", ":memory:"):
            raise CatalogError(
                f"SQLite catalog URL {url!s} names no file; give a file path "
                "(an in-memory catalog would vanish with its connection)"
            )
        engine = create_engine(url, connect_args={"timeout": _SQLITE_BUSY_MS / 1000})
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    if backend == "postgresql":
        if url.get_driver_name() == "psycopg":  # the `postgres` extra
            require("psycopg", extra="postgres", purpose="a PostgreSQL catalog")
        engine = create_engine(url, pool_pre_ping=True, connect_args=_pg_connect_args(url))
        if schema is not None:
            _check_schema_name(schema)
            event.listen(engine, "connect", functools.partial(_pg_set_search_path, schema))
        return engine
    raise CatalogError(
        f"catalog URL backend {backend!r} is not supported; use sqlite:///path or "
        "postgresql+psycopg://user@host/db"
    )


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # no implicit BEGIN; _sqlite_on_begin emits it
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_MS}")  # first: WAL switch may wait
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    conn.exec_driver_sql(conn.get_execution_options().get("sqlite_begin", "BEGIN"))


def _pg_set_search_path(schema: str, dbapi_connection: Any, _record: Any) -> None:
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True  # SET SESSION outside any transaction, so it sticks
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f'SET SESSION search_path TO "{schema}"')
    finally:
        cursor.close()
        dbapi_connection.autocommit = autocommit


def _check_schema_name(schema: str) -> None:
    if not _SCHEMA_NAME.fullmatch(schema):
        raise CatalogError(
            f"schema name {schema!r} is not allowed; use letters, digits and '_' "
            "(not starting with a digit, at most 63 characters)"
        )


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic config for the shipped migrations; `connection` is the one env.py migrates."""
    config = Config()
    # ConfigParser interpolates '%': escape it in the folder path.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.set_main_option("path_separator", "os")
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def head_revision() -> str:
    """Revision id of the newest shipped migration."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, f"no migrations found in {MIGRATIONS_DIR}"
    return head


@functools.cache
def known_revisions() -> frozenset[str]:
    """Revision ids of every shipped migration."""
    scripts = ScriptDirectory.from_config(alembic_config())
    return frozenset(script.revision for script in scripts.walk_revisions())


def _pg_connect_args(url: URL) -> dict[str, int]:
    """A connection attempt's time limit, unless the URL sets its own (`?connect_timeout=`)."""
    return {} if "connect_timeout" in url.query else {"connect_timeout": PG_CONNECT_TIMEOUT_S}


def _ensure_pg_schema(url: URL, schema: str) -> None:
    """Create `schema` if missing, before the catalog engine first connects.

    The engine learns its default schema on first connect, so the schema must exist by then.
    A session advisory lock serializes concurrent creators.
    """
    engine = create_engine(url, poolclass=NullPool, connect_args=_pg_connect_args(url))
    try:
        with engine.connect() as conn:
            if conn.scalar(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}):
                return
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            conn.commit()
    finally:
        engine.dispose()


def shown_url(url: str) -> str:
    """A database URL as a catalog shows it (`CatalogDatabase.url`, a store's marker): its
    password hidden; as given if it cannot be parsed."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def sqlite_path(url: str) -> Path | None:
    """The file an SQLite catalog URL names (as written: maybe relative); None for another
    database, an in-memory one, or a URL that cannot be parsed."""
    try:
        database = _sqlite_file(make_url(url))
    except sa.exc.ArgumentError:
        return None
    return Path(database) if database and database != ":memory:" else None


def same_catalog(url: str, other: str) -> bool:
    """Do two catalog URLs name one database (an SQLite file however spelled; others as
    shown, passwords hidden)?"""
    path, other_path = sqlite_path(url), sqlite_path(other)
    if path is None or other_path is None:
        return shown_url(url) == shown_url(other)
    return path.resolve() == other_path.resolve()


def _open_error(url: str, err: sa.exc.DBAPIError, database: str | None = None) -> CatalogError:
    """What went wrong opening the catalog at `url`, in one line (the driver's first). SQLite
    says "disk I/O error" when it cannot even write its journal: a full disk is named."""
    reason = _reason(err)
    if database and _no_space(Path(database).parent):
        return CatalogError(
            f"cannot open the catalog at {url}: {reason}; the disk holding it is full: free "
            "space there"
        )
    if database and "not a database" in reason:  # SQLite's word for a file of other bytes
        return CatalogError(
            f"cannot open the catalog at {url}: {reason}; the file is damaged or not a "
            "catalog: restore it from a backup, or give another --store"
        )
    check = "that its folder is writable" if database else "the host, database and user"
    return CatalogError(f"cannot open the catalog at {url}: {reason}; check {check}")


def _no_such(err: sa.exc.OperationalError) -> bool:
    """SQLite's word for a table or column that is not there (PostgreSQL raises a
    ProgrammingError)."""
    return any(f"no such {thing}" in str(err.orig) for thing in ("table", "column"))


def _mismatched(url: str, err: sa.exc.DBAPIError) -> CatalogError:
    """A catalog whose tables are not those its revision says (a column dropped or renamed by
    hand or by another program): PostgreSQL's UndefinedColumn, SQLite's "no such column", in
    one line."""
    return CatalogError(
        f"the catalog at {url} does not have the tables this rag-kvcache expects "
        f"({_reason(err)}): it was changed by hand or by another program; restore it from a "
        "backup, or start a new store"
    )


def _failed(url: str, err: sa.exc.OperationalError) -> CatalogUnavailableError:
    """A call to an open catalog that the database could not answer (the server went away,
    the connection was cut, a lock was not granted), in one line: its transaction was rolled
    back, so nothing is half-recorded."""
    return CatalogUnavailableError(
        f"the catalog at {url} did not answer ({_reason(err)}); nothing was half-recorded: check "
        "that the database is up, then try again"
    )


def _refused(url: str, err: sa.exc.DataError) -> CatalogError:
    """A value the database cannot hold (PostgreSQL: a NUL character in text), in one line,
    not the driver's error with the SQL statement."""
    return CatalogError(
        f"the catalog at {url} refused a value ({_reason(err)}); nothing was recorded"
    )


def _reason(err: sa.exc.DBAPIError) -> str:
    """The driver's reason for an error, its first line (or its type, when it says nothing)."""
    text = str(err.orig).strip()
    return text.splitlines()[0] if text else str(type(err.orig))


def _sqlite_file(url: URL) -> str | None:
    return url.database if url.get_backend_name() == "sqlite" else None


def _no_space(folder: Path) -> bool:
    """Whether the disk holding `folder` is full: nothing free on a disk of some size that may
    be written. A pseudo file system (/proc: of size 0) or a read-only one reports nothing
    free too; "free space there" would be the wrong advice."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return False
    return usage.total > 0 and usage.free == 0 and os.access(folder, os.W_OK)


def _disk_full(err: sa.exc.OperationalError) -> bool:
    """SQLite's SQLITE_FULL (13) or PostgreSQL's disk_full (53100)."""
    return (
        getattr(err.orig, "sqlite_errorcode", None) == 13
        or getattr(err.orig, "sqlstate", None) == "53100"
        or "database or disk is full" in str(err.orig)
    )


# ----------------------------------------------------------------------------- the opened database


class CatalogDatabase:
    """An opened catalog database, migrated to head (see module docstring).

    `url` is an SQLAlchemy URL; without one, an SQLite file at `path`. `schema` (PostgreSQL only)
    keeps the catalog in its own schema, created if missing. Each method is one transaction.
    Safe to use from several threads, and from several processes on the same database.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        path: Path | None = None,
        schema: str | None = None,
        create: bool = True,
    ) -> None:
        if url is None:
            if path is None:
                raise CatalogError("Catalog needs a database URL or an SQLite file path")
            path = Path(path)
            if not create and not path.is_file():
                raise StoreNotFoundError(f"no catalog at {path}: check --store, or ingest first")
            path.parent.mkdir(parents=True, exist_ok=True)
            sa_url = URL.create("sqlite+pysqlite", database=str(path))
        elif path is not None:
            raise CatalogError(f"give either url or path, not both (got {url!r} and {path!s})")
        else:
            try:
                sa_url = make_url(url)
            except sa.exc.ArgumentError:  # the URL may hold a password: not repeated here
                raise CatalogError(
                    "the catalog URL cannot be parsed; use sqlite:///path or "
                    "postgresql+psycopg://user@host:port/database"
                ) from None
            file = sqlite_path(url)
            if not create and file is not None and not file.is_file():  # (SQLite would make it)
                raise StoreNotFoundError(f"no catalog at {file}: check the catalog URL")
        shown = sa_url.render_as_string(hide_password=True)
        try:
            if schema is not None and sa_url.get_backend_name() == "postgresql":
                _check_schema_name(schema)
                if create:  # a reader finds no catalog in a missing schema; it makes none
                    _ensure_pg_schema(sa_url, schema)
            self._engine = create_catalog_engine(sa_url, schema)
        except sa.exc.DBAPIError as err:
            raise _open_error(shown, err, _sqlite_file(sa_url)) from None
        self._sqlite = self._engine.dialect.name == "sqlite"
        self._schema = schema
        # SQLite: writers take the write lock up front (waiting on busy_timeout) instead of
        # upgrading a read lock later, which fails at once with "database is locked".
        self._writer = (
            self._engine.execution_options(sqlite_begin="BEGIN IMMEDIATE")
            if self._sqlite
            else self._engine
        )
        try:
            self._upgrade_when_free(create)
        except sa.exc.DBAPIError as err:
            self._engine.dispose()
            raise _open_error(shown, err, _sqlite_file(sa_url)) from None
        except BaseException:
            self._engine.dispose()
            raise

    # -- lifecycle

    @property
    def url(self) -> str:
        """The database URL (password hidden)."""
        return self._engine.url.render_as_string(hide_password=True)

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self._engine.dialect.name

    @property
    def engine(self) -> Engine:
        """The underlying engine (for tooling and tests; the catalog API is the contract)."""
        return self._engine

    def close(self) -> None:
        """Close pooled connections (the catalog must not be used afterwards)."""
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        schema = f", schema={self._schema!r}" if self._schema else ""
        return f"{type(self).__name__}({self.url!r}{schema})"

    def _upgrade_when_free(self, create: bool) -> None:
        """`_upgrade`, tried again while SQLite answers "database is locked" at once: it does
        so without its busy timeout when several processes open a new catalog together (a
        reader's snapshot goes stale under a concurrent migration), and the second try then
        finds the work done. Bounded by the busy timeout."""
        deadline = time.monotonic() + _SQLITE_BUSY_MS / 1000
        pause = 0.01
        while True:
            try:
                return self._upgrade(create)
            except sa.exc.OperationalError as err:
                locked = self._sqlite and "database is locked" in str(err.orig)
                if not locked or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _upgrade(self, create: bool = True) -> None:
        """Bring the schema to the newest migration; a no-op (one read) when it is there.
        Without `create`, a database holding no catalog at all is a StoreNotFoundError.

        Serialized across processes: SQLite holds the write lock (BEGIN IMMEDIATE) and
        PostgreSQL an advisory lock for the whole upgrade transaction, and the version is read
        again under the lock, so a second opener finds the work done.
        """
        head = head_revision()
        with self._engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
        if current == head:
            return
        if current is None and not create:
            raise StoreNotFoundError(f"no catalog in {self.url}: check --catalog-url, or ingest")
        if current is not None and current not in known_revisions():  # alembic: a traceback
            raise CatalogError(
                f"the catalog at {self.url} is at schema revision {current!r}, which this "
                f"rag-kvcache does not know (it knows up to {head_revision()!r}): it was "
                "written by a newer version; upgrade rag-kvcache"
            )
        with self._writer.connect() as conn, conn.begin():
            if not self._sqlite:
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
            command.upgrade(alembic_config(conn), "head")

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        try:
            with self._writer.begin() as conn:
                yield conn
        except sa.exc.OperationalError as err:
            if _disk_full(err):
                raise StoreFullError(
                    f"the catalog's disk is full ({self.url}); nothing was recorded: free "
                    "space, or run `rag-kvcache gc`"
                ) from err
            raise _mismatched(self.url, err) if _no_such(err) else _failed(self.url, err) from err
        except sa.exc.ProgrammingError as err:
            raise _mismatched(self.url, err) from err
        except sa.exc.DataError as err:
            raise _refused(self.url, err) from err

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn:
                yield conn
        except sa.exc.OperationalError as err:
            raise _mismatched(self.url, err) if _no_such(err) else _failed(self.url, err) from err
        except sa.exc.ProgrammingError as err:
            raise _mismatched(self.url, err) from err
        except sa.exc.DataError as err:
            raise _refused(self.url, err) from err

    def _insert(self, table: Any) -> Any:
        """The dialect's INSERT, which has `on_conflict_do_nothing/update` on both backends."""
        return sqlite.insert(table) if self._sqlite else postgresql.insert(table)
