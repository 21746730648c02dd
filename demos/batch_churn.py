"""Requests joining and leaving a running batch: what continuous batching costs in KV moves.

`clients` concurrent callers each ask `rounds` questions in turn through the engine loop
(`RagKVCache.agenerate`), over a context of their own (4 chunks of ~130 tokens) or one shared
by all (`--shared`), with answers of 8 to 32 tokens, so requests join and leave the batch at
most steps. One round warms up; the timed run prints one JSON line: wall seconds, decode
tokens/s, the seconds spent laying out the batch's rows (`BatchKV.pack`, timed around each
call), and the peak KV bytes (prefix tree + rows). Run: .venv/bin/python demos/batch_churn.py
--clients 16 --rounds 3 [--shared]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.serving import batch_kv

WORDS = [
    "harbor",
    "lighthouse",
    "festival",
    "basin",
    "kite",
    "oil",
    "lamp",
    "ship",
    "grain",
    "hill",
    "river",
    "bridge",
    "tower",
]


def timed_packs() -> list[float]:
    """Seconds of every BatchKV.pack call from now on (the method, wrapped)."""
    spent: list[float] = []
    pack = batch_kv.BatchKV.pack

    def timed(self: batch_kv.BatchKV, members: Any) -> int:
        start = time.perf_counter()
        most = pack(self, members)
        spent.append(time.perf_counter() - start)
        return most

    batch_kv.BatchKV.pack = timed  # type: ignore[method-assign]
    return spent


def main(clients: int, rounds: int, shared: bool) -> dict[str, Any]:
    spent = timed_packs()
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=32)))
    rng = random.Random(0)

    def text(i: int, j: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(110)) + f" Fact {i}-{j}."

    contexts = [
        engine.generate_context_cache([text(i, j) for j in range(4)])
        for i in range(1 if shared else clients)
    ]

    async def client(i: int) -> None:
        for k in range(rounds):
            await engine.agenerate(
                f"What is fact {i}-{k}?",
                contexts[0 if shared else i],
                max_new_tokens=8 + (i * 7 + k * 13) % 25,
                strategy="legolink:2",
            )

    async def everyone() -> None:
        await asyncio.gather(*(client(i) for i in range(clients)))

    asyncio.run(everyone())  # warm-up
    decoder = engine.serving_loop().decoder
    spent.clear()
    tokens, steps = decoder.decode_tokens, decoder.steps
    start = time.perf_counter()
    asyncio.run(everyone())
    wall = time.perf_counter() - start
    result = {
        "clients": clients,
        "rounds": rounds,
        "shared": shared,
        "wall_s": round(wall, 2),
        "steps": decoder.steps - steps,
        "decode_tokens": decoder.decode_tokens - tokens,
        "tokens_per_s": round((decoder.decode_tokens - tokens) / wall, 1),
        "pack_s": round(sum(spent), 3),
        "packs": len(spent),
        "peak_kv_bytes": decoder.peak_bytes,
    }
    engine.close()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shared", action="store_true", help="one context for every client")
    args = parser.parse_args()
    print(json.dumps(main(args.clients, args.rounds, args.shared)))
