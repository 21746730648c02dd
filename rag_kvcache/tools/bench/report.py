"""What every benchmark shares: the machine it ran on, the sample corpus as tokens, and
writing NAME.json plus its plot."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rag_kvcache.config import LEGOLINK0_SINKS, EncodeConfig, EngineConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.kv import KVStore
from rag_kvcache.model import cpu_linear
from rag_kvcache.model.calibration_file import write_atomically
from rag_kvcache.model.loading import LoadedModel, native_on_cpu
from rag_kvcache.samples import sample_corpus_dir
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.tools import report_json


def machine_facts() -> dict[str, object]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cores": torch.get_num_threads(),
        # float32 CPU kernels: oneDNN's or torch's own (`model.cpu_linear`)
        "cpu_kernels": "onednn" if cpu_linear.computes_by_onednn() else "torch",
        # the vector instructions torch's CPU kernels use, bfloat16 in hardware (AVX-512 BF16
        # or AMX) and AMX itself (a bfloat16 prefill 3-4x a float32 one, not ~1.7x): what a
        # figure's machine could do, beyond its name
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bfloat16": native_on_cpu(torch.bfloat16),
        "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def corpus_tokens(lm: LoadedModel, needed: int) -> list[int]:
    """Token ids of the sample corpus (shipped inside the package), repeated until `needed`
    long."""
    text = "\n\n".join(p.read_text() for p in sorted(sample_corpus_dir().glob("*.md")))
    ids = list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    return (ids * (needed // len(ids) + 1))[:needed]


def bench_engines(lm: LoadedModel, store: KVStore | None = None) -> tuple[RagKVCache, RagKVCache]:
    """Two engines on one model and store: chunks encoded alone, and (for legolink0) after
    LEGOLINK0_SINKS sink tokens. The store is in memory unless given."""
    engine = RagKVCache(EngineConfig(), lm=lm, store=store if store is not None else MemoryStore())
    return engine, engine.with_encoding(EncodeConfig(sink_tokens=LEGOLINK0_SINKS))


def cache_chunks(engine: RagKVCache, chunks: list[list[int]]) -> list[str]:
    """Cache exact token chunks (as the benchmarks cut them) with the engine's encode settings."""
    texts = [engine.lm.tokenizer.decode(c) for c in chunks]
    return engine.cache_token_ids(chunks, engine.doc_settings, texts)[0]


def question_text(engine: RagKVCache, tokens: list[int], question_tokens: int) -> str:
    """A question (text from `tokens`) whose prompt part is about `question_tokens` tokens
    long, template included."""
    overhead = len(engine.template.question_ids(engine.lm.tokenizer, "x")) - 1
    keep = max(1, question_tokens - overhead)
    return str(engine.lm.tokenizer.decode(tokens[-keep:])).strip() or "What is it?"


def save_report(
    out_dir: Path,
    name: str,
    rows: Sequence[Any],
    plot: Callable[[Path], None],
    **facts: object,
) -> dict[str, object]:
    """Write NAME.json (the facts, the machine, one record per row) and, through `plot`,
    NAME.png into out_dir; returns the report."""
    report: dict[str, object] = {
        "benchmark": name,
        **facts,
        "machine": machine_facts(),
        "rows": [asdict(r) for r in rows],
    }
    # replaced whole: a kill mid-write keeps the previous report
    write_atomically(out_dir / f"{name}.json", report_json.dumps(report, indent=2).encode())
    plot(out_dir / f"{name}.png")
    return report
