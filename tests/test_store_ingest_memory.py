"""Ingestion streams (issue 19, item 8): a file is read and split a segment at a time and its
chunks are encoded and stored in bounded batches, so memory does not grow with its size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache import ingest as ingest_module
from rag_kvcache.config import StoreConfig
from rag_kvcache.ingest import find_files, plan_ingest, run_ingest

TESTS = Path(__file__).resolve().parent


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _paragraph(i: int) -> str:
    return f"Paragraph {i}: the harbor master logged ship number {i} at dawn, in fair weather."


def test_a_big_file_is_read_split_and_encoded_a_segment_and_a_batch_at_a_time(
    tiny32, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments of ~300 characters and batches of 3 chunks: every paragraph still becomes
    exactly one chunk, in order, and the plan's count is what is stored."""
    monkeypatch.setattr(ingest_module, "SEGMENT_CHARS", 300)
    monkeypatch.setattr(ingest_module, "BATCH_CHUNKS", 3)
    monkeypatch.setattr(ingest_module, "READ_BYTES", 64)
    texts = [_paragraph(i) for i in range(40)]
    path = tmp_path / "log.md"
    path.write_text("\ufeff" + "\n\n".join(texts) + "\n")
    config = EngineConfig(
        store=StoreConfig(root=tmp_path / "store", cpu_bytes=0),
        generation=GenerationConfig(max_new_tokens=2),
    )
    engine = RagKVCache(config, lm=tiny32)
    batches: list[int] = []
    plan = plan_ingest(engine, [path], paragraphs)
    assert plan.total_chunks == 40
    (done,) = run_ingest(engine, plan, batches.append)
    assert len(done.cache_ids) == 40 and done.encoded == 40
    assert max(batches) <= 3  # encoded a batch at a time
    rows = engine.store.catalog.chunks(done.cache_ids)  # type: ignore[union-attr]
    assert [rows[c].text for c in done.cache_ids] == texts
    again = plan_ingest(engine, [path], paragraphs)
    assert again.todo == [] and again.unchanged == [str(path.resolve())]


def test_batches_are_bounded_in_tokens_and_embedding_in_chunks(
    tiny32, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long chunks make smaller batches (BATCH_TOKENS), and a document's chunks are embedded
    for retrieval EMBED_CHUNKS at a time; every chunk is still stored, listed and indexed."""
    from rag_kvcache.retrieval import corpus as corpus_module

    monkeypatch.setattr(ingest_module, "BATCH_CHUNKS", 100)
    monkeypatch.setattr(ingest_module, "BATCH_TOKENS", 60)
    monkeypatch.setattr(corpus_module, "EMBED_CHUNKS", 4)
    texts = [" ".join(_paragraph(i) for _ in range(1 + i % 3)) for i in range(15)]
    path = tmp_path / "long.md"
    path.write_text("\n\n".join(texts) + "\n")
    engine = RagKVCache(
        EngineConfig(store=StoreConfig(root=tmp_path / "s", cpu_bytes=0)), lm=tiny32
    )
    batches: list[list[int]] = []
    cache_token_ids = engine.cache_token_ids

    def spy(tokens: list[list[int]], *args: object, **kwargs: object) -> tuple[list[str], int]:
        batches.append([len(t) for t in tokens])
        return cache_token_ids(tokens, *args, **kwargs)  # type: ignore[arg-type]

    embedded: list[int] = []
    embed = engine.corpus.embedder.embed
    monkeypatch.setattr(engine, "cache_token_ids", spy)
    monkeypatch.setattr(
        engine.corpus.embedder, "embed", lambda t: embedded.append(len(t)) or embed(t)
    )
    (done,) = run_ingest(engine, plan_ingest(engine, [path], paragraphs))
    assert len(batches) > 2 and sum(map(len, batches)) == 15
    assert all(sum(b[:-1]) < 60 <= sum(b) for b in batches[:-1])  # closed at the first over
    assert sum(batches[-1][:-1]) < 60
    assert embedded == [4, 4, 4, 3]
    rows = engine.store.catalog.chunks(done.cache_ids)  # type: ignore[union-attr]
    assert [rows[c].text for c in done.cache_ids] == texts
    assert engine.corpus.index.cache_ids() == set(done.cache_ids)
    assert engine.retrieve(texts[7], top_k=1)[0].cache_id == done.cache_ids[7]


def test_a_path_longer_than_the_file_system_allows_is_reported(tmp_path: Path) -> None:
    long = tmp_path / ("x" * 300)  # over NAME_MAX (255)
    files, skipped = find_files([long, tmp_path / "d"])
    assert files == []
    reasons = {Path(s.path).name: s.reason for s in skipped}
    assert reasons["x" * 300] == "cannot read: File name too long"


MEASURE = """
import json, resource, sys
from pathlib import Path
import torch
from helpers import TINY_VOCAB, describe, tiny_config
from tiny_tokenizer import build_tokenizer
from transformers import LlamaForCausalLM
from rag_kvcache import EngineConfig, RagKVCache
from rag_kvcache.config import StoreConfig
from rag_kvcache import ingest
from rag_kvcache.ingest import plan_ingest, run_ingest

ingest.BATCH_CHUNKS = 4  # 17 MiB of KV a batch here; both files are several batches

def paragraphs(text):
    return [p.strip() for p in text.split("\\n\\n") if p.strip()]

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

# 12 layers x 4 KV heads x 16 x (K, V) x 8 bytes: 12 KiB of KV per token
torch.manual_seed(0)
config = tiny_config(num_hidden_layers=12, num_key_value_heads=4)
model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
lm = describe(model.double().eval().requires_grad_(False), build_tokenizer(TINY_VOCAB), "deep")
store = StoreConfig(root=Path(sys.argv[1]), cpu_bytes=0)
engine = RagKVCache(EngineConfig(store=store), lm=lm)
engine.corpus.embedder.batch_size = 4  # its activations, too, a few chunks at a time
peaks = [peak_mb()]
for name in sys.argv[2:]:
    run_ingest(engine, plan_ingest(engine, [Path(name)], paragraphs, max_bytes=1 << 30))
    peaks.append(peak_mb())
print(json.dumps(peaks))
"""


@pytest.mark.stress
def test_ingesting_a_file_eight_times_bigger_needs_no_more_memory(tmp_path: Path) -> None:
    """Peak RSS of a fresh process (no hot copies) after an 8-chunk file, then after a
    64-chunk one: ~23K tokens, ~270 MiB of KV if the document's KV were held at once."""
    sizes = {"small.md": 8, "big.md": 64}
    for name, count in sizes.items():
        text = "\n\n".join(
            " ".join(_paragraph(i * 12 + j) for j in range(12)) for i in range(count)
        )
        (tmp_path / name).write_text(text + "\n")
    files = [str(tmp_path / name) for name in sizes]
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "store"), *files],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    base, after_small, after_big = json.loads(done.stdout.strip().splitlines()[-1])
    assert after_big - after_small < 100, (base, after_small, after_big)
