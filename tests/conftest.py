"""Shared fixtures: tiny random-weight Llamas (float64 and float32) and the real SmolLM2."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import build_tiny
from sqlalchemy import create_engine
from sqlalchemy import text as sql_text
from sqlalchemy.pool import NullPool

from rag_kvcache.config import ModelConfig
from rag_kvcache.model.loading import LoadedModel, load_model
from rag_kvcache.storage.catalog import Catalog


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """The real SmolLM2-135M-Instruct, float32 (converted from GGUF once, then cached)."""
    return load_model(ModelConfig(dtype="float32", threads=2))


@pytest.fixture(scope="session")
def smol_tokenizer(smol: LoadedModel) -> object:
    return smol.tokenizer


@pytest.fixture(scope="session")
def tiny64(smol_tokenizer: object) -> LoadedModel:
    return build_tiny(torch.float64, tokenizer=smol_tokenizer)


@pytest.fixture(scope="session")
def tiny32(smol_tokenizer: object) -> LoadedModel:
    return build_tiny(torch.float32, tokenizer=smol_tokenizer)


# ----------------------------------------------------------------------------- databases

PG_URL_ENV = "RAG_KVCACHE_TEST_PG_URL"
PG_CANDIDATES = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)


@functools.cache
def postgres_url() -> tuple[str | None, str]:
    """A reachable PostgreSQL URL, or None and why not."""
    candidates = [os.environ[PG_URL_ENV]] if os.environ.get(PG_URL_ENV) else list(PG_CANDIDATES)
    errors = []
    for url in candidates:
        engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 3})
        try:
            with engine.connect() as conn:
                conn.execute(sql_text("SELECT 1"))
            return url, ""
        except Exception as e:  # any failure means "not usable here"
            errors.append(f"{url}: {type(e).__name__}: {str(e).splitlines()[0]}")
        finally:
            engine.dispose()
    return None, "PostgreSQL not reachable (" + "; ".join(errors) + ")"


@dataclass(frozen=True)
class Target:
    """One database a test runs against; `open()` gives a new Catalog on it."""

    kind: str
    url: str | None
    path: Path | None
    schema: str | None

    def open(self) -> Catalog:
        return Catalog(self.url, path=self.path, schema=self.schema)


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    if request.param == "sqlite":
        yield Target("sqlite", None, tmp_path / "catalog.db", None)
        return
    url, reason = postgres_url()
    if url is None:
        pytest.skip(reason)
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(url, poolclass=NullPool)
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        yield Target("postgresql", url, None, schema)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()
