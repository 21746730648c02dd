"""Every tensor the answer path makes is made on the device of the tensors it meets.

On a CPU machine a CUDA mix-up cannot happen, but the same bug can be caught: with torch's
default device set to "meta", any tensor made without an explicit device (positions, angles,
indices, masks) lands on "meta" and the first op that meets the model's CPU tensors fails,
exactly where a CPU-made tensor would meet CUDA ones on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rag_kvcache import EncodeConfig, EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.serving.batch import BatchRequest
from rag_kvcache.storage.memory import MemoryStore

DOCS = ["The lighthouse was built in 1788 by Mara Quell.", "Six crews row in the league."]


@contextmanager
def stray_tensors_on_meta() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.fixture
def engine(tiny32) -> RagKVCache:
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=4))
    return RagKVCache(config, lm=tiny32, store=MemoryStore())


@pytest.mark.parametrize(
    "strategy",
    ["prefill", "full", "naive", "legolink:2", "legolink0", "cacheblend:0.5",
     "legolink:1+reversed+top:1+window:4"],
)  # fmt: skip
def test_generate_makes_every_tensor_on_the_models_device(engine, strategy: str) -> None:
    on = engine.with_encoding(EncodeConfig(sink_tokens=4)) if strategy == "legolink0" else engine
    ids = on.generate_context_cache(DOCS)
    expected = on.generate("Who built the lighthouse?", ids, strategy=strategy)
    with stray_tensors_on_meta():
        answer = on.generate("Who built the lighthouse?", ids, strategy=strategy)
    assert answer.token_ids == expected.token_ids


def test_batched_generation_makes_every_tensor_on_the_models_device(engine) -> None:
    ids = tuple(engine.generate_context_cache(DOCS))
    requests = [BatchRequest("Who built it?", ids), BatchRequest("Who rows?", ids[:1])]
    expected = engine.generate_batch(requests, strategy="legolink:2")
    engine.clear_prefix_tree()
    with stray_tensors_on_meta():
        result = engine.generate_batch(requests, strategy="legolink:2")
    assert [a.token_ids for a in result.answers] == [a.token_ids for a in expected.answers]


def test_the_check_itself_catches_a_tensor_made_off_device(engine) -> None:
    """Guards the check against a no-op: a tensor made without a device does fail under it."""
    with stray_tensors_on_meta(), pytest.raises((RuntimeError, NotImplementedError)):
        engine.lm.inv_freq * torch.tensor([3.0])
