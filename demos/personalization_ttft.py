"""TTFT of Prompt Cache serving on the personalization schema (six unions) against a full
prefill of the same tokens, and against linking the modules with legolink:2.

Eight prompts pick one member of each union at random (seeded) and ask one question; the
first run warms up and is left out. Prints medians. Run: .venv/bin/python
demos/personalization_ttft.py
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.markup.prompt_cache import PromptCache
from rag_kvcache.strategy import PREFILL

SCHEMA = Path(__file__).resolve().parents[1] / "tests" / "data" / "schemas" / "personalization.xml"


def main(runs: int = 9) -> None:
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=1)))
    cache = PromptCache(engine)
    schema = cache.schemas[cache.add_schema(SCHEMA.read_text()).name]
    unions: dict[int | None, list[str]] = {}
    for module in schema.modules.values():
        unions.setdefault(module.union, []).append(module.name)
    rng = random.Random(0)
    rows = []
    for _ in range(runs):
        picks = "".join(f"<{rng.choice(members)}/>" for members in unions.values())
        prompt = f'<prompt schema="personalization">{picks}Explain what a fraction is.</prompt>'
        served = cache.serve(prompt)
        linked = cache.serve(prompt, "legolink:2")
        full = cache.serve(prompt, PREFILL)
        rows.append((served, linked, full))
    rows = rows[1:]
    served, linked, full = (statistics.median(r[i].ttft_s for r in rows) for i in range(3))
    print(
        f"prompt: {rows[0][2].prompt_tokens} tokens ({rows[0][0].context_tokens} cached, "
        f"{rows[0][0].computed_tokens} computed at schema positions)"
    )
    print(f"full prefill   {full * 1000:.1f} ms")
    print(f"positions      {served * 1000:.1f} ms  ({full / served:.1f}x)")
    print(f"legolink:2     {linked * 1000:.1f} ms  ({full / linked:.1f}x)")


if __name__ == "__main__":
    main()
