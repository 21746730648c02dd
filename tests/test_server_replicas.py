"""Replicas share one store: two `rag-kvcache serve` processes on one PostgreSQL catalog and one
Redis durable tier, each with its own `--store` folder (what a second machine would have; the
ingesting process shares replica A's folder, as workers on one machine do).

- an `ingest` run by a third process is retrieved and answered from by both replicas, without
  a restart (the corpus version counter in the catalog);
- a replica SIGKILLed mid-stream loses nothing stored: the other gives the same answers to the
  same questions, and `rag-kvcache verify` finds the store (and each folder's index) clean;
- under load (6 clients over 2 replicas for 20 s, one SIGKILLed mid-answer midway; `make
  load-test` runs it at 16 clients for 60 s) every request is answered with the right answer or
  fails cleanly (a refused or dropped connection, an OpenAI-style JSON error), and no replica
  logs a traceback.

Every process is a real `python -m rag_kvcache.tools.cli` on random:tiny (SmolLM2's tokenizer:
`slow`). The catalog is a database of its own, dropped at the end, and the Redis keys carry its
store ID, deleted at the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import postgres_url
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from rag_kvcache.storage.catalog import Catalog
from rag_kvcache.storage.layout import read_marker, redis_prefix

pytestmark = [pytest.mark.services, pytest.mark.slow]

REDIS_URL = "redis://127.0.0.1:6379/0"
CLI = [sys.executable, "-m", "rag_kvcache.tools.cli"]
# one thread each: four processes share two cores here
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
MAX_TOKENS = 4
# the load test's size: small in the test suite, the full size by `make load-test`
LOAD_CLIENTS = int(os.environ.get("RAG_KVCACHE_LOAD_CLIENTS", "6"))
LOAD_SECONDS = float(os.environ.get("RAG_KVCACHE_LOAD_SECONDS", "20"))
FIRST = [
    "The Hallam Point lighthouse was designed by Mara Quell.",
    "It was first lit in 1788 and burned whale oil until 1861.",
    "Velmora's harbor has three basins; the deepest is 14 meters deep.",
]
QUESTIONS = [
    "Who designed the Hallam Point lighthouse?",
    "When was the lighthouse first lit?",
    "How deep is the deepest basin of Velmora's harbor?",
]
LATER = [
    "The Orrin Vale glass bridge was painted teal by Ivo Pendle in 1902.",
    "Ivo Pendle also built the bridge's copper railings.",
]
LATER_QUESTION = "Who painted the Orrin Vale glass bridge?"


@dataclass
class Replica:
    name: str
    folder: Path
    log: Path
    port: int = 0
    process: subprocess.Popen | None = None
    killed: bool = False  # SIGKILLed (set before the signal): its clients may see it drop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, store: list[str]) -> None:
        self.port, self.killed = _free_port(), False
        with self.log.open("a") as log:
            log.write(f"\n==== start on port {self.port}\n")
            self.process = subprocess.Popen(
                [*CLI, "serve", "--model", "random:tiny", "--port", str(self.port)]
                + ["--store", str(self.folder), *store],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=ENV,
            )

    def wait_ready(self, timeout_s: float = 120) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, f"{self.name} exited:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.process is not None
        self.killed = True
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(30) == -signal.SIGKILL

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Cluster:
    catalog_url: str
    tmp: Path
    replicas: list[Replica]

    @property
    def store(self) -> list[str]:
        return ["--catalog-url", self.catalog_url, "--redis-url", REDIS_URL]

    def cli(self, *args: str, folder: Path, timeout: float = 180) -> subprocess.CompletedProcess:
        command = [*CLI, *args, "--store", str(folder), *self.store]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)

    def ingest(self, name: str, paragraphs: list[str]) -> None:
        path = self.tmp / name
        path.write_text("\n\n".join(paragraphs), encoding="utf-8")
        done = self.cli(
            "ingest", str(path), "--chunk-tokens", "16", "--model", "random:tiny",
            folder=self.replicas[0].folder,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    def verify_clean(self) -> None:
        """`verify` on every replica's folder (in parallel): the blobs all check, and each
        folder's vector index matches the catalog."""
        runs = [
            subprocess.Popen(
                [*CLI, "verify", "--store", str(r.folder), *self.store],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=ENV,
            )
            for r in self.replicas
        ]
        for replica, run in zip(self.replicas, runs, strict=True):
            out, _ = run.communicate(timeout=180)
            assert run.returncode == 0, f"{replica.name}: {out}"
            assert "0 corrupt, 0 missing" in out and "0 orphan blobs" in out, out
            assert "index: matches the catalog" in out, out

    def documented(self) -> set[str]:
        catalog = Catalog(self.catalog_url)
        try:
            return catalog.documented_ids()
        finally:
            catalog.close()

    def restart(self, replica: Replica) -> None:
        if not replica.alive:
            replica.start(self.store)
            replica.wait_ready()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    url, reason = postgres_url()
    if url is None:
        pytest.skip(reason)
    import redis

    keys = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        keys.ping()
    except redis.RedisError as err:
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {err}")
    database = f"rkv_replicas_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{database}"')
    catalog_url = make_url(url).set(database=database).render_as_string(hide_password=False)
    tmp = tmp_path_factory.mktemp("replicas")
    replicas = [Replica(n, tmp / f"store-{n}", tmp / f"serve-{n}.log") for n in ("a", "b")]
    cluster = Cluster(catalog_url, tmp, replicas)
    try:
        cluster.ingest("lighthouse.md", FIRST)
        for replica in replicas:
            replica.start(cluster.store)
        for replica in replicas:
            replica.wait_ready()
        yield cluster
        for replica in replicas:  # no traceback in any replica's log, killed ones included
            assert "Traceback" not in replica.log.read_text(), replica.log.read_text()
    finally:
        for replica in replicas:
            replica.stop()
        marker = read_marker(replicas[0].folder)
        if marker is not None:
            for key in keys.scan_iter(match=redis_prefix(marker.store_id) + "*", count=500):
                keys.delete(key)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.dispose()


def ask(replica: Replica, question: str, **rag: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "rag": rag or {"top_k": 2},
    }
    response = httpx.post(f"{replica.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def kill_mid_stream(replica: Replica) -> None:
    """SIGKILL `replica` while it streams a long answer (after its first few pieces)."""
    body = {
        "messages": [{"role": "user", "content": QUESTIONS[0]}],
        "max_tokens": 200,
        "stream": True,
        "rag": {"top_k": 2},
    }
    url = f"{replica.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        pieces = 0
        with pytest.raises(httpx.TransportError):  # the connection drops; nothing else
            for line in response.iter_lines():
                pieces += line.startswith("data: {")
                if pieces == 3 and not replica.killed:
                    replica.kill()
    assert replica.killed


def answer_of(reply: dict[str, Any]) -> tuple[str, list[str]]:
    return reply["choices"][0]["message"]["content"], reply["rag"]["cache_ids"]


def test_an_ingest_by_another_process_is_answered_from_by_both_replicas(cluster) -> None:
    a, b = cluster.replicas
    before = cluster.documented()
    for replica in (a, b):  # both have searched the corpus before the ingest
        assert set(ask(replica, LATER_QUESTION)["rag"]["cache_ids"]) <= before
    cluster.ingest("bridge.md", LATER)
    new = cluster.documented() - before
    assert new
    replies = [ask(replica, LATER_QUESTION) for replica in (a, b)]
    for reply in replies:
        assert reply["rag"]["cache_ids"][0] in new, reply["rag"]  # retrieved, no restart
    assert answer_of(replies[0]) == answer_of(replies[1])
    explicit = ask(b, LATER_QUESTION, cache_ids=replies[0]["rag"]["cache_ids"])
    assert answer_of(explicit) == answer_of(replies[0])  # answered from those chunks


def test_a_replica_killed_mid_stream_loses_nothing(cluster) -> None:
    a, b = cluster.replicas
    for replica in (a, b):
        cluster.restart(replica)
    stored = cluster.documented()
    answers = {q: answer_of(ask(a, q)) for q in QUESTIONS}
    assert {q: answer_of(ask(b, q)) for q in QUESTIONS} == answers

    kill_mid_stream(b)
    b.start(cluster.store)  # it loads while the checks below run
    assert {q: answer_of(ask(a, q)) for q in QUESTIONS} == answers
    assert cluster.documented() == stored
    cluster.verify_clean()
    b.wait_ready()
    assert {q: answer_of(ask(b, q)) for q in QUESTIONS} == answers  # restarted: the same


@dataclass
class Tally:
    answered: int = 0
    answered_after_kill: int = 0
    refused: int = 0  # connections to the killed replica refused
    cut: int = 0  # requests in flight on the killed replica when it died
    json_errors: list[dict[str, Any]] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _client(
    seed: int,
    replicas: list[Replica],
    answers: dict[str, tuple[str, list[str]]],
    until: float,
    killed_at: list[float],
    tally: Tally,
) -> None:
    """One client: questions to a replica picked at random (a balancer without health
    checks), half of them streamed, until `until`."""
    rng = random.Random(seed)
    with httpx.Client(timeout=60) as http:
        while time.monotonic() < until:
            replica = rng.choice(replicas)
            question = rng.choice(QUESTIONS)
            stream = rng.random() < 0.5
            body = {
                "messages": [{"role": "user", "content": question}],
                "max_tokens": MAX_TOKENS,
                "stream": stream,
                "rag": {"top_k": 2},
            }
            url = f"{replica.url}/v1/chat/completions"
            try:
                got = _streamed(http, url, body) if stream else _whole(http, url, body)
            except httpx.TransportError as err:
                with tally.lock:
                    if not replica.killed:
                        tally.wrong.append(f"{replica.name} alive, yet {err!r}")
                    elif isinstance(err, httpx.ConnectError):
                        tally.refused += 1
                    else:
                        tally.cut += 1
                time.sleep(0.05)  # as a balancer would, before it tries that replica again
                continue
            with tally.lock:
                if isinstance(got, dict):  # an OpenAI-style error body
                    tally.json_errors.append(got)
                elif got != answers[question]:
                    tally.wrong.append(f"{question!r}: {got} != {answers[question]}")
                else:
                    tally.answered += 1
                    tally.answered_after_kill += bool(killed_at)


def _whole(http: httpx.Client, url: str, body: dict) -> tuple[str, list[str]] | dict:
    response = http.post(url, json=body)
    reply = response.json()  # never HTML, never a traceback
    if response.status_code != 200:
        assert set(reply) == {"error"} and {"message", "type", "code"} <= set(reply["error"])
        return reply
    return answer_of(reply)


def _streamed(http: httpx.Client, url: str, body: dict) -> tuple[str, list[str]] | dict:
    with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            response.read()
            return _whole_error(response)
        text, cache_ids, done = "", None, False
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return event
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
            cache_ids = event.get("rag", {}).get("cache_ids", cache_ids)
        assert done and cache_ids is not None  # a stream that ended without [DONE] raised
        return text, cache_ids


def _whole_error(response: httpx.Response) -> dict:
    reply = response.json()
    assert set(reply) == {"error"} and {"message", "type", "code"} <= set(reply["error"])
    return reply


def test_load_on_two_replicas_with_one_killed_midway(cluster) -> None:
    a, b = cluster.replicas
    for replica in (a, b):
        cluster.restart(replica)
    answers = {q: answer_of(ask(a, q)) for q in QUESTIONS}
    clients, seconds = LOAD_CLIENTS, LOAD_SECONDS
    until, killed_at, tally = time.monotonic() + seconds, [], Tally()
    threads = [
        threading.Thread(target=_client, args=(i, [a, b], answers, until, killed_at, tally))
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    time.sleep(seconds / 2)
    killed_at.append(time.monotonic())
    kill_mid_stream(b)  # one request at least is cut off mid-answer
    for thread in threads:
        thread.join(90)
    assert not any(t.is_alive() for t in threads)
    print(
        f"\n{clients} clients x {seconds:.0f} s on 2 replicas: answered {tally.answered} "
        f"({tally.answered_after_kill} after the kill), refused {tally.refused}, "
        f"cut {tally.cut}, wrong {len(tally.wrong)}, JSON errors {len(tally.json_errors)}"
    )
    assert tally.wrong == [], tally.wrong
    assert tally.json_errors == [], tally.json_errors  # nothing here is a bad request
    assert tally.answered >= 2 * clients and tally.answered_after_kill >= clients
    assert tally.refused >= 1  # the clients of b saw it go
    cluster.verify_clean()
    assert {q: answer_of(ask(a, q)) for q in QUESTIONS} == answers
