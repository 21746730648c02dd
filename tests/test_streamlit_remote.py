"""The Streamlit app against a running server (`$RAG_KVCACHE_APP_SERVER`): it loads no model,
and its answers are the server's, streamed, equal to the engine's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import StoreConfig
from rag_kvcache.tools.bench.serve import LocalServer

APP = Path(__file__).resolve().parents[1] / "demos" / "streamlit_app.py"
DOCS = [
    "The Hallam Point lighthouse was designed by Mara Quell.",
    "It was first lit in 1788 and burned whale oil until 1861.",
    "Velmora's harbor has three basins; the deepest is 14 meters deep.",
]
QUESTION = "Who designed the lighthouse?"


@pytest.fixture(scope="module")
def server_url(tiny32, tmp_path_factory) -> Iterator[tuple[str, RagKVCache]]:
    config = EngineConfig(
        store=StoreConfig(root=tmp_path_factory.mktemp("served")),
        generation=GenerationConfig(max_new_tokens=8),
    )
    engine = RagKVCache(config, lm=tiny32)
    engine.ingest_document("docs.md", DOCS)
    with LocalServer(engine) as url:
        yield url, engine
    engine.close()


def test_the_app_asks_a_server_and_shows_its_streamed_answer(server_url, monkeypatch) -> None:
    url, engine = server_url
    monkeypatch.setenv("RAG_KVCACHE_APP_SERVER", url)
    at = AppTest.from_file(str(APP), default_timeout=120).run()
    assert not at.exception and not at.error
    assert at.sidebar.radio(key="page").options == ["Ask"]  # no model, no store here
    at.slider(key="max_new_tokens").set_value(16)
    at.slider(key="top_k").set_value(2)
    at.toggle(key="compare").set_value(True)
    at = at.chat_input[0].set_value(QUESTION).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    _, assistant = at.chat_message
    ids = [hit.cache_id for hit in engine.retrieve(QUESTION, top_k=2)]
    default = engine.config.strategy
    texts = [m.value for m in assistant.markdown if not m.value.startswith("**")]
    cached = engine.generate(QUESTION, ids, max_new_tokens=16)
    full = engine.generate(QUESTION, ids, strategy=default.baseline, max_new_tokens=16)
    assert texts == [cached.text, full.text]
    captions = [c.value for c in assistant.caption if "TTFT" in c.value]
    assert len(captions) == 2 and f"strategy {default}" in captions[0]
    sources = [m.value for m in assistant.markdown if m.value.startswith("**Sources")]
    assert sources and all(f"`{c[:12]}`" in sources[0] for c in ids)


def test_a_server_error_is_a_friendly_message(server_url, monkeypatch) -> None:
    url, _ = server_url
    monkeypatch.setenv("RAG_KVCACHE_APP_SERVER", url)
    at = AppTest.from_file(str(APP), default_timeout=120).run()
    at.slider(key="max_new_tokens").set_value(16)
    at.selectbox(key="strategy").set_value("cacheblend:0.15")  # the batch refuses it
    at = at.chat_input[0].set_value(QUESTION).run()
    assert not at.exception
    (error,) = [e.value for e in at.error]
    assert error.startswith("That did not work:") and "cacheblend" in error


def test_a_server_that_cannot_be_reached_is_named_and_the_turn_stays(monkeypatch) -> None:
    """Nothing listens on port 9: the error names the server, not a raw ConnectError, and the
    question stays in the chat when the next one is asked."""
    monkeypatch.setenv("RAG_KVCACHE_APP_SERVER", "http://127.0.0.1:9")
    at = AppTest.from_file(str(APP), default_timeout=120).run()
    for question in (QUESTION, "And when was it lit?"):
        at = at.chat_input[0].set_value(question).run()
        assert not at.exception
    questions = [m.markdown[0].value for m in at.chat_message if m.name == "user"]
    assert questions == [QUESTION, "And when was it lit?"]
    errors = [e.value for e in at.error]
    assert errors and all("no answer from the server at http://127.0.0.1:9" in e for e in errors)
