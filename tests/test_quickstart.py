"""`make demo` (demos/quickstart.py) on the real SmolLM2: wherever the full prefill of a prompt
answers a sample question right, the answer from the cached chunks (the default strategy) is
right too."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import StoreConfig
from rag_kvcache.ingest import plan_ingest, run_ingest
from rag_kvcache.integrations.llama_index.splitter import split_text

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[1] / "demos" / "quickstart.py"
GOLD = {  # the fact each sample question asks for, as the sample documents state it
    "Who is the current Harbor Reeve of Velmora?": "Morrow-Kade",
    "Which engineer led the team that designed the TK-7 tidal spectrometer?": "Ocquenne",
    "How long is the full Saltreach shipping route in nautical miles?": "640",
}


def quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_answers_from_the_cache_wherever_prefill_does(smol, tmp_path) -> None:
    demo = quickstart()
    assert set(demo.QUESTIONS) == set(GOLD)
    config = EngineConfig(
        store=StoreConfig(root=tmp_path), generation=GenerationConfig(max_new_tokens=40)
    )
    engine = RagKVCache(config, lm=smol)
    plan = plan_ingest(engine, [demo.DATA], split_text(smol.tokenizer, chunk_tokens=256))
    run_ingest(engine, plan)
    prefill_right = 0
    for question in demo.QUESTIONS:
        hits, cached, full = demo.ask(engine, question)
        assert len(hits) == demo.TOP_K and cached.strategy == engine.config.strategy
        assert cached.recomputed_tokens < cached.context_tokens  # really from the cache
        if GOLD[question] in full.text:
            prefill_right += 1
            assert GOLD[question] in cached.text, (question, cached.text, full.text)
    assert prefill_right == len(GOLD)  # the prefill answers all three: a real comparison
    engine.close()


def test_the_demo_says_slower_where_the_cache_was_slower() -> None:
    """A busy machine once timed the cache slower, and the demo printed "0.3x faster"."""
    sooner = quickstart().sooner
    assert sooner(4.0, 0.5) == "8.0x faster" and sooner(1.0, 1.0) == "1.0x faster"
    assert sooner(3.43, 10.94) == "3.2x slower (a busy machine?)"
