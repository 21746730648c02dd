"""The Streamlit app against a running server (`$RAG_KVCACHE_APP_SERVER`): it loads no model,
and its answers are the server's, streamed, equal to the engine's own."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import app_module
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


class Misbehaving(BaseHTTPRequestHandler):
    """A server that answers the chat endpoint wrongly, in the way its path names."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        kind = self.path.split("/")[1]
        if kind == "huge":  # a proxy's error page of 50 MB
            self.send_response(500)
            self.send_header("Content-Length", str(50 << 20))
            self.end_headers()
            for _ in range(50):
                try:
                    self.wfile.write(b"x" * (1 << 20))
                except OSError:  # the client read what it wanted and left
                    return
            return
        if kind == "silent":
            time.sleep(3)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if kind == "trickle":  # keep-alive comments, never an answer
            for _ in range(30):
                try:
                    self.wfile.write(b": keepalive\n\n")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)
            return
        events = {"string": b'"just a string"', "list": b"[1, 2]"}
        events["delta"] = b'{"choices": [{"delta": "Hello"}]}'
        self.wfile.write(b"data: " + events[kind] + b"\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def misbehaving() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_misbehaving_server_is_a_clear_error_never_a_hang(misbehaving, monkeypatch) -> None:
    """Events of another shape were an AttributeError ("Something unexpected went wrong"), a
    silent server held the page for 10 minutes and a trickling one for ever, a huge error page
    was read whole to show 200 characters, and a bad URL or key was a raw exception."""
    app = app_module()
    monkeypatch.setattr(app, "REMOTE_WAIT_S", 1)
    monkeypatch.setattr(app, "REMOTE_ANSWER_S", 1)

    def error(url: str, key: str | None = None) -> str:
        with pytest.raises(app.RemoteError) as raised:
            list(app.Server(url, key).stream(QUESTION, "naive", 2, 8, [], []))
        return str(raised.value)

    for kind in ("string", "list", "delta"):
        assert "answered something else" in error(f"{misbehaving}/{kind}")
    assert "no answer from the server" in error(f"{misbehaving}/silent")  # after 1 s
    assert "did not finish its answer in 1 s" in error(f"{misbehaving}/trickle")
    tracemalloc.start()
    try:
        assert error(f"{misbehaving}/huge") == "HTTP 500: " + "x" * 200
        assert tracemalloc.get_traced_memory()[1] < 8 << 20  # not the page's 50 MB
    finally:
        tracemalloc.stop()
    assert "RAG_KVCACHE_APP_SERVER is not a URL" in error("http://[::1")
    for key in ("cl\u00e9", "key ", "\tkey"):  # the server's rule: a key it could match
        assert "RAG_KVCACHE_APP_API_KEY: an API key must be printable ASCII" in error(
            misbehaving, key
        )
