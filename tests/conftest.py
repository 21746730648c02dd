"""Shared fixtures: tiny random-weight Llamas (float64 and float32) with a small tokenizer built
here, the real SmolLM2, the databases; and the test tiers: a test that uses SmolLM2 is marked
`slow`, one that runs against PostgreSQL or Redis `services`, from the fixtures it asks for."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import TINY_VOCAB, build_tiny
from sqlalchemy import create_engine
from sqlalchemy import text as sql_text
from sqlalchemy.pool import NullPool
from tiny_tokenizer import build_tokenizer

from rag_kvcache.config import ModelConfig
from rag_kvcache.model import cpu_kernels
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
def tiny_tokenizer() -> object:
    """Byte-level BPE trained on the sample corpus, with SmolLM2's special tokens and chat
    template, its vocabulary padded to the tiny models' (tests/tiny_tokenizer.py)."""
    return build_tokenizer(TINY_VOCAB)


@pytest.fixture
def onednn_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN computes (where torch has it) whatever this CPU's maker: for the tests of its own
    path, which the library takes on AMD processors only (`cpu_kernels.CHOSEN`)."""
    monkeypatch.setattr(cpu_kernels, "CHOSEN", True)  # (computing only where AVAILABLE)


@pytest.fixture(scope="session")
def tiny64(tiny_tokenizer: object) -> LoadedModel:
    return build_tiny(torch.float64, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny32(tiny_tokenizer: object) -> LoadedModel:
    return build_tiny(torch.float32, tokenizer=tiny_tokenizer)


# ----------------------------------------------------------------------------- test tiers

SMOLLM2_FIXTURES = {"smol", "smol_tokenizer"}  # a test asking for one of these (even through
# another fixture) loads SmolLM2; tests that load it otherwise carry @pytest.mark.slow themselves
SERVICE_PARAMS = {"target": "postgresql", "durable": "redis"}  # fixture -> param needing a server


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SMOLLM2_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        if any(params.get(name) == value for name, value in SERVICE_PARAMS.items()):
            item.add_marker(pytest.mark.services)


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
