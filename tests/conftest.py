"""Shared fixtures: tiny random-weight Llamas (float64 and float32) and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch
from helpers import build_tiny

from rag_kvcache.config import ModelConfig
from rag_kvcache.model import LoadedModel, load_model


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
