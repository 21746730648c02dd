"""The Streamlit demo app, driven for real: headless with AppTest (the script runs in this
process, loading SmolLM2 and a temporary store), and end to end in a headless Chromium through
Selenium against `streamlit run` on a free port (skipped, with the reason, without Chromium)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from helpers import app_module
from streamlit.testing.v1 import AppTest

from rag_kvcache import RagKVCache
from rag_kvcache.config import EngineConfig, StoreConfig
from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.strategy import DEFAULT

pytestmark = pytest.mark.slow  # every test here loads the real SmolLM2

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "demos" / "streamlit_app.py"
SCREENSHOTS = REPO / "demos" / "screenshots"  # ask.png is the README's; ingest, insight too
STORE_ENV = "RAG_KVCACHE_APP_STORE"
QUESTION = "Who is the current Harbor Reeve of Velmora?"
TIMEOUT = 300  # seconds for one AppTest run (ingesting the sample corpus is the slowest)
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FERRY = (
    "The Quell Island ferry leaves Velmora at dawn and returns at dusk. Its captain, Ilse "
    "Varro, has sailed the route for nineteen years. Tickets cost four silver marks."
)


def check(at: AppTest, errors: bool = False) -> AppTest:
    """No traceback ever; no error message either unless the test provokes one."""
    assert not at.exception, at.exception
    if not errors:
        assert not at.error, values(at.error)
    return at


def open_app() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    return check(at.run())


def go_to(at: AppTest, page: str) -> AppTest:
    return check(at.sidebar.radio(key="page").set_value(page).run())


def ask(at: AppTest, question: str, compare: bool = False, errors: bool = False) -> AppTest:
    go_to(at, "Ask")
    at.slider(key="max_new_tokens").set_value(16)
    at.toggle(key="compare").set_value(compare)
    return check(at.chat_input[0].set_value(question).run(), errors)


def values(elements) -> list[str]:
    return [e.value for e in elements]


def charts(node) -> list:
    return list(node.get("vega_lite_chart"))


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, AppTest]]:
    """A store holding the sample corpus, ingested with the app's own button."""
    root = tmp_path_factory.mktemp("app-store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, str(root))
        at = open_app()
        assert at.sidebar.radio(key="page").value == "Ingest"  # an empty store starts there
        check(at.button(key="ingest_sample").click().run())
        yield root, at


def test_the_sample_corpus_is_ingested_with_progress_and_listed(sample_store) -> None:
    _, at = sample_store
    samples = sorted(p.name for p in (REPO / "demos" / "data").glob("*.md"))
    success = values(at.success)
    assert len(success) == 1 and f"Ingested {len(samples)} document(s)" in success[0]
    assert "chunks/s" in success[0]
    assert at.progress[0].value == 100 and "chunks/s" in at.progress[0].text
    documents = at.dataframe[0].value
    assert sorted(documents["document"]) == samples
    assert (documents["chunks"] > 0).all()
    chunks = next(m for m in at.metric if m.label == "Chunks cached")
    assert int(chunks.value) == documents["chunks"].sum() + 1  # + the system prompt
    tiers = at.dataframe[1].value
    assert "disk" in set(tiers["tier"]) and (tiers["bytes"] > 0).all()

    check(at.button(key="ingest_sample").click().run())  # again: nothing new to encode
    assert any("Nothing new" in v for v in values(at.info)), values(at.info)


def test_asking_streams_an_answer_with_sources_and_ttft(sample_store) -> None:
    root, _ = sample_store
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, str(root))
        at = ask(open_app(), QUESTION)
    user, assistant = at.chat_message
    assert user.name == "user" and values(user.markdown) == [QUESTION]
    assert assistant.name == "assistant"
    answer = assistant.markdown[0].value
    assert answer.strip() and not answer.startswith("**Sources")
    (caption,) = [c for c in values(assistant.caption) if "TTFT" in c]
    assert f"strategy {DEFAULT}" in caption  # the default
    assert "tokens/s" in caption
    ttft = float(caption.split("TTFT ")[1].split(" s")[0])
    assert 0 < ttft < 30
    sources = [e.label for e in assistant.expander]
    assert len(sources) == 8  # the default top-k, as `make demo` retrieves
    assert "01_harbor_town_of_velmora.md" in " ".join(sources)
    assert all(e.text[0].value.strip() for e in assistant.expander)  # the chunk texts

    # the chat is redrawn from history on the next run, and a second question adds to it
    check(at.chat_input[0].set_value("In what year was Hallam Point Light built?").run())
    assert len(at.chat_message) == 4
    assert values(at.chat_message[1].markdown)[0].strip() == answer.strip()
    check(at.chat_input[0].set_value("  \n ").run())  # a blank question: ignored, as an
    assert len(at.chat_message) == 4  # empty one is (it left an empty bubble and an error)


def test_compare_mode_shows_both_answers_side_by_side(sample_store) -> None:
    root, _ = sample_store
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, str(root))
        at = open_app()
        go_to(at, "Ask")
        at.selectbox(key="strategy").set_value("naive+reversed+top:1")
        at = ask(at, QUESTION, compare=True)
    assistant = at.chat_message[-1]
    columns = assistant.columns
    assert len(columns) == 2
    cached, full = (c.markdown for c in columns)
    assert cached[0].value == "**Cached chunks linked (naive+reversed+top:1)**"
    assert full[0].value.startswith("**Full prefill")
    assert cached[1].value.strip() and full[1].value.strip()  # the two answers
    captions = [values(c.caption)[0] for c in columns]
    # the prefill of the very same prompt: the same chunks in the same placement
    assert "strategy naive+reversed+top:1" in captions[0]
    assert "strategy prefill+reversed" in captions[1]
    assert all("TTFT" in c for c in captions)
    # (on a busy machine the cache may be timed slower: then it says so)
    summary = [m for m in values(assistant.markdown) if re.search(r"x (sooner|later) from", m)]
    assert len(summary) == 1
    assert len(charts(assistant)) == 1  # the TTFT bar chart


def test_uploading_files_ingests_readable_ones_and_explains_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    at = open_app()
    assert [i for i in values(at.info) if i.startswith("The store is empty")]
    go_to(at, "Ask")
    assert any("No documents yet" in v for v in values(at.info))
    assert not at.chat_input  # nothing to ask about yet

    go_to(at, "Ingest")
    at.file_uploader(key="uploads").set_value(
        [
            ("ferry.md", FERRY.encode(), "text/markdown"),
            ("photo.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "text/plain"),
        ]
    )
    at.run()
    check(at.button(key="ingest_uploads").click().run())
    assert "Ingested 1 document(s)" in values(at.success)[0]
    (warning,) = values(at.warning)
    assert "photo.txt" in warning and "binary file" in warning
    assert list(at.dataframe[0].value["document"]) == ["ferry.md"]
    assert (tmp_path / "store" / "uploads" / "ferry.md").read_text() == FERRY

    ask(at, "Who is the captain of the Quell Island ferry?")
    assistant = at.chat_message[-1]
    assert assistant.markdown[0].value.strip()
    assert [e.label.split(" · ")[0] for e in assistant.expander] == ["1. ferry.md"]


def test_ingest_uploads_keeps_files_under_the_store_and_reports_bad_ones(
    smol, tmp_path: Path
) -> None:
    app = app_module()
    engine = RagKVCache(EngineConfig(store=StoreConfig(root=tmp_path)), lm=smol)
    progress: list[tuple[int, int, float]] = []
    files = [
        ("../../ferry.md", FERRY.encode()),  # a path in the name must not escape uploads/
        (".hidden.txt", b"The bakery opens at five in the morning."),
        ("broken.pdf", b"%PDF-1.4 not really a PDF"),
        ("empty.txt", b""),
        ("latin1.txt", "caf\xe9".encode("latin-1")),
    ]
    report = app.ingest_uploads(engine, files, lambda *p: progress.append(p))
    uploads = tmp_path / "uploads"
    hidden = app.upload_path(uploads, ".hidden.txt").name  # renamed: tagged with a hash
    assert hidden.startswith("hidden-") and hidden.endswith(".txt")
    # the skipped ones are not kept (a 17 MiB file stayed on the disk)
    assert sorted(p.name for p in uploads.iterdir()) == sorted(["ferry.md", hidden])
    assert sorted(Path(d.source).name for d in report.documents) == sorted(["ferry.md", hidden])
    assert report.encoded == report.chunks == 2 and report.chunks_per_s > 0
    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    assert reasons["empty.txt"] == "empty file"
    assert reasons["broken.pdf"].startswith("unreadable PDF")
    assert reasons["latin1.txt"].startswith("not UTF-8 text")
    assert progress[-1][:2] == (2, 2) and all(rate > 0 for *_, rate in progress)
    hits = engine.retrieve("Who captains the ferry?", 1)
    assert hits[0].source == str(uploads / "ferry.md")

    again = app.ingest_uploads(engine, files[:1])  # same bytes: unchanged, nothing encoded
    assert again.documents == [] and again.unchanged == [str(uploads / "ferry.md")]
    # a bad upload of a document's name is skipped, and the document's file is put back (it
    # was left holding the bad bytes)
    bad = app.ingest_uploads(engine, [("ferry.md", b""), ("notes.md", b"\x00\x01")])
    assert [Path(s.path).name for s in bad.skipped] == ["ferry.md", "notes.md"]
    assert (uploads / "ferry.md").read_bytes() == FERRY.encode()
    assert sorted(p.name for p in uploads.iterdir()) == sorted(["ferry.md", hidden])
    engine.store.close()


def test_uploads_named_alike_are_all_kept_and_one_that_cannot_be_saved_is_named(
    smol, tmp_path: Path
) -> None:
    """Names that come out the same once made safe (`a:b.md`, `a?b.md`) must not overwrite one
    another, in one batch or across batches, while the same name again updates its document;
    a name too long for the file system is shortened; an upload that cannot be written, or
    one replaced by a later upload of its name in the batch, is reported."""
    app = app_module()
    engine = RagKVCache(EngineConfig(store=StoreConfig(root=tmp_path)), lm=smol)
    uploads = tmp_path / "uploads"
    app.upload_path(uploads, "taken.md").mkdir(parents=True)  # where no file can be written
    files = [
        ("a:b.md", b"The red ferry leaves at six."),
        ("a?b.md", b"The blue ferry leaves at seven."),
        ("x" * 300 + ".md", b"The green ferry leaves at eight."),
        ("taken.md", b"The grey ferry leaves at nine."),
        ("twice.md", b"The first version."),
        ("twice.md", b"The white ferry leaves at ten."),
    ]
    report = app.ingest_uploads(engine, files)
    named = {Path(d.source).name for d in report.documents}
    assert len(named) == 4 and "twice.md" in named
    long = app.upload_path(uploads, "x" * 300 + ".md").name
    assert long in named and len(long) <= app.NAME_CHARS + 9
    assert sorted((s.path, s.reason.split(":")[0]) for s in report.skipped) == [
        ("taken.md", "cannot save it"),
        ("twice.md", "a later upload of this batch has its name"),
    ]
    # a later batch: `a_b.md` as itself is another document than `a:b.md`; `a?b.md` again
    # updates its own
    later = [("a_b.md", b"The mill grinds on Tuesdays."), ("a?b.md", b"The blue ferry is late.")]
    app.ingest_uploads(engine, later)
    sources = [Path(d.source).name for d in engine.corpus.catalog.documents()]
    assert len(sources) == 5 and "a_b.md" in sources
    texts = " ".join(h.text for h in engine.retrieve("ferry mill", 10))
    assert "red ferry" in texts and "blue ferry is late" in texts and "seven" not in texts
    engine.store.close()


def test_an_expired_cache_entry_is_a_friendly_message(
    smol, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = RagKVCache(EngineConfig(store=StoreConfig(root=tmp_path)), lm=smol)
    app_module().ingest_uploads(engine, [("ferry.md", FERRY.encode())])
    with Catalog(path=tmp_path / "catalog.sqlite") as catalog:  # as another process would
        for cache_id in catalog.documented_ids():
            catalog.set_expiry(cache_id, datetime.now(UTC) - timedelta(seconds=1))
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    engine.store.close()
    at = ask(open_app(), "Who is the captain of the Quell Island ferry?", errors=True)
    (error,) = values(at.chat_message[-1].error)  # retrieval skips expired chunks: none left
    assert "cache entries expired" in error and "Ingest" in error


def test_insight_page_plots_results_and_hit_rates(sample_store) -> None:
    root, _ = sample_store
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, str(root))
        at = ask(open_app(), QUESTION)  # at least one read of cached chunks
        go_to(at, "Insight")
    headers = values(at.subheader)
    assert headers == [
        "Time to first token vs context length",
        "Time to first token vs answer quality",
        "Cache hit rates per tier (this store)",
    ]
    assert len(charts(at)) == 3  # TTFT vs context, TTFT vs F1, hit rates
    assert any("sooner" in m for m in values(at.markdown))
    hit_rates = at.dataframe[0].value
    assert set(hit_rates["tier"]) <= {"gpu", "cpu", "disk", "redis"}
    assert hit_rates["chunk reads"].sum() > 0
    assert abs(hit_rates["hit rate (%)"].sum() - 100) < 0.5
    check(at.radio(key="ttft_dtype").set_value("float32").run())  # the dtypes ttft.json holds
    check(at.radio(key="quality").set_value("answer found (%)").run())
    assert len(charts(at)) == 3


# ----------------------------------------------------------------------------- real browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition, seconds: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise AssertionError(f"timed out after {seconds} s waiting for {what}\n{tail}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return r.read() == b"ok"
    except OSError:
        return False


@pytest.mark.browser
@pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (`make browser`, or apt-get install "
    "chromium chromium-driver)",
)
def test_in_a_real_browser_ingest_ask_and_screenshot() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    tmp = Path(tempfile.mkdtemp(prefix="rag-kvcache-app-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "streamlit.log"
    streamlit = Path(sys.executable).parent / "streamlit"
    command = [str(streamlit), "run", str(APP), "--server.address", "127.0.0.1"]
    command += ["--server.port", str(port), "--server.headless", "true"]
    command += ["--browser.gatherUsageStats", "false"]
    env = {**os.environ, STORE_ENV: str(tmp / "store")}
    server = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    driver = None
    try:
        wait_until(lambda: healthy(url), 60, "the Streamlit server", log)
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
            options.add_argument(arg)
        options.add_argument("--window-size=1400,1700")
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        driver.get(url)

        def find(xpath: str):
            return driver.find_elements(By.XPATH, xpath)

        def text_shown(text: str):
            return find(f"//*[contains(text(), {text!r})]")

        def shoot(name: str) -> None:
            time.sleep(1.5)  # let charts and opened expanders settle
            assert not text_shown("Traceback") and not find("//*[@data-testid='stException']")
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            assert driver.save_screenshot(str(SCREENSHOTS / name))

        button = "//button[.//p[text()='Ingest the sample corpus']]"
        wait_until(lambda: find(button), 120, "the Ingest page", log)[0].click()
        wait_until(lambda: text_shown("Ingested 8 document(s)"), 180, "ingestion", log)
        wait_until(lambda: find("//*[@data-testid='stDataFrame']"), 30, "the store table", log)
        shoot("ingest.png")

        find("//label[.//p[text()='Ask']]")[0].click()
        compare = "//label[.//p[text()='Compare with full prefill']]"
        wait_until(lambda: find(compare), 60, "the Ask page", log)[0].click()
        box = "//textarea[@data-testid='stChatInputTextArea']"
        wait_until(lambda: find(box), 60, "the chat input", log)[0].send_keys(QUESTION, Keys.ENTER)

        def both_answers():  # (a busy machine may time the cache slower: it then says so)
            return text_shown("sooner from the cache") or text_shown("later from the cache")

        wait_until(both_answers, 180, "both answers", log)
        sources = wait_until(
            lambda: find("//details//p[contains(text(), '01_harbor_town_of_velmora.md')]"),
            60,
            "the sources",
            log,
        )
        sources[0].click()  # open one source, so the screenshot shows a retrieved chunk
        captions = wait_until(lambda: text_shown("TTFT "), 30, "the TTFT captions", log)
        assert len(captions) == 2
        shoot("ask.png")

        driver.set_window_size(1400, 2000)  # the whole Insight page, hit rates included
        find("//label[.//p[text()='Insight']]")[0].click()
        wait_until(lambda: text_shown("Cache hit rates per tier"), 60, "the Insight page", log)
        wait_until(lambda: len(find("//canvas")) >= 3, 30, "three drawn charts", log)
        shoot("insight.png")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    from PIL import Image

    for name in ("ingest.png", "ask.png", "insight.png"):
        with Image.open(SCREENSHOTS / name) as image:
            assert image.size[0] >= 1000 and image.size[1] >= 1000
            colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 500  # a drawn page, not a blank one
        assert (SCREENSHOTS / name).stat().st_size > 50_000


def test_a_question_too_long_alone_is_told_to_be_shorter() -> None:
    """Fewer chunks cannot make room for a question that does not fit by itself."""
    from rag_kvcache.errors import ContextTooLongError

    app = app_module()
    alone = ContextTooLongError("a question of 9000 tokens ... : ask a shorter question")
    assert app.friendly(alone).startswith("The question is too long for the model")
    chunks = ContextTooLongError("9000 prompt tokens exceed the model's window of 8192")
    assert app.friendly(chunks).startswith("Too much text for the model: retrieve fewer")
