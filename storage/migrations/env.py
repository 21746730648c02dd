"""Alembic environment of the catalog.

A catalog (`CatalogDatabase` in database.py) runs the upgrade itself, passing its open
connection (inside the transaction that holds the migration lock) as
`config.attributes["connection"]`; the tables (tables.py) go wherever that connection's
search_path points (PostgreSQL schema) and the caller commits. Without one (the
`alembic` command line), the URL in `sqlalchemy.url` is used.
"""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection, TypeDecorator

from rag_kvcache.storage.database import create_catalog_engine
from rag_kvcache.storage.tables import Base

config = context.config
target_metadata = Base.metadata


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    """Render the catalog's column types as their plain SQL types, so revisions stay standalone."""
    if type_ == "type" and isinstance(obj, TypeDecorator):
        impl = obj.impl_instance
        return f"sa.{impl!r}"
    return False


def _configure(**options: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        render_item=render_item,
        **options,
    )


def _migrate(connection: Connection) -> None:
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emit the SQL instead of running it (`alembic upgrade --sql`)."""
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("set sqlalchemy.url, or pass a connection in config.attributes")
    engine = create_catalog_engine(url)
    try:
        with engine.connect() as connection:
            _migrate(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
