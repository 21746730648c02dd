"""`Strategy`: how an answer's context is computed, parsed once where a user names it.

The spellings a user writes (CLI flags, configs, HTTP bodies) map one to one onto values of
this type, and `str()` gives the spelling back, so a strategy round-trips through any text
channel. Everything past the edge takes a `Strategy`, never a string.

- `prefill`: no cache: a plain prefill of the whole prompt (the baseline).
- `full`: link the cached chunks, recompute every context token: equals `prefill` (tested).
- `naive`: link the chunks, recompute nothing: the rotated chunk KV used as is.
- `legolink:k`: recompute the first k tokens of every chunk after the system prefix (Epic).
- `legolink0`: recompute nothing, but the chunks must have been encoded after sink tokens
  (`EncodeConfig(sink_tokens=N)`; Epic's LegoLink-0).
- `cacheblend:r`: recompute a ratio r of document tokens, those whose layer-1 values deviate
  most from a fresh prefill (CacheBlend's selection; a baseline).
- `positions`: Prompt Cache's mode for markup prompts: each cached unit at its schema
  position, the prompt's own tokens computed at theirs, nothing recomputed.

Placement is a part of any strategy that links or prefills chunks, spelled after a `+`:
- `+reversed`: the document chunks in the reverse of the order given. Cache IDs are given best
  first (as retrieval returns them), so this puts the most relevant chunk nearest the question.
- `+rotated`: the first chunk moved to the end (the order given, rotated by one).
Prefill with another order is how the noise floor of "kept" answers is measured: a cache that
changes answers no more than reordering the chunks does is as good as prefill for a user.

Query-aware recompute is a part of any link strategy that leaves tokens stale, spelled last:
- `+top:N`: the N best-ranked document chunks (the first N cache IDs given) are recomputed
  whole, wherever the order places them; the rest as the strategy says. Where linking goes
  wrong, a distractor's stale KV usually outvotes the chunk that holds the answer; recomputing
  the chunks the question needs most takes that vote away. `+top:0` is the strategy alone, and
  `top` past the number of chunks recomputes every document chunk (equal to `full`).

The question is always computed. A fidelity technique joins as a field of this record (with
its spelling in `parse` / `__str__`), not as a new string grammar.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from rag_kvcache.errors import StrategyError

KINDS = ("prefill", "full", "naive", "legolink", "legolink0", "cacheblend", "positions")
_PLAIN = ("prefill", "full", "naive", "legolink0", "positions")
_STALE = ("naive", "legolink", "legolink0", "cacheblend")  # kinds that leave tokens stale
ORDERS = ("given", "reversed", "rotated")
SPELLINGS = (
    "prefill, full, naive, legolink:K (K >= 0), legolink0, cacheblend:R (0 <= R <= 1), "
    "each optionally +reversed or +rotated, then (not prefill or full) +top:N"
)
T = TypeVar("T")


@dataclass(frozen=True)
class Strategy:
    """One way to compute the context (see the module docstring)."""

    kind: str
    k: int = 0  # legolink: boundary tokens recomputed per chunk
    ratio: float = 0.0  # cacheblend: share of document tokens recomputed
    order: str = "given"  # placement of the document chunks (see the module docstring)
    top: int = 0  # best-ranked document chunks recomputed whole (query-aware recompute)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StrategyError(f"unknown strategy kind {self.kind!r}; one of {KINDS}")
        if self.k < 0 or (self.k and self.kind != "legolink"):
            raise StrategyError(f"k={self.k} is only for legolink, and must be >= 0")
        if not 0 <= self.ratio <= 1 or (self.ratio and self.kind != "cacheblend"):
            raise StrategyError(f"ratio={self.ratio} is only for cacheblend, in 0..1")
        if self.order not in ORDERS:
            raise StrategyError(f"unknown order {self.order!r}; one of {ORDERS}")
        if self.order != "given" and self.kind == "positions":
            raise StrategyError("`positions` places units at their schema positions: no order")
        if self.top < 0 or (self.top and self.kind not in _STALE):
            raise StrategyError(f"top={self.top} is for {', '.join(_STALE)}, and must be >= 0")

    @classmethod
    def parse(cls, spec: str | Strategy) -> Strategy:
        """A user's spelling (case and surrounding blanks ignored) -> Strategy."""
        if isinstance(spec, Strategy):
            return spec
        text, *parts = str(spec).strip().lower().split("+")
        if parts:
            top = re.fullmatch(r"top:(\d+)", parts[-1])
            order = parts[0] if parts[0] in ORDERS[1:] else "given"
            if parts != [p for p in (order, top and parts[-1]) if p and p != "given"]:
                raise StrategyError(f"unknown link strategy {spec!r}; use {SPELLINGS}")
            base = cls.parse(text)
            try:
                return cls(base.kind, base.k, base.ratio, order, int(top.group(1)) if top else 0)
            except StrategyError as e:
                raise StrategyError(f"{spec!r}: {e}; use {SPELLINGS}") from None
        if text in _PLAIN:
            return cls(text)
        if m := re.fullmatch(r"legolink:(\d+)", text):
            return cls("legolink", k=int(m.group(1)))
        if m := re.fullmatch(r"cacheblend:([0-9.e+-]+)", text):
            try:
                ratio = float(m.group(1))
            except ValueError:
                ratio = -1.0
            if 0 <= ratio <= 1:
                return cls("cacheblend", ratio=ratio)
        raise StrategyError(f"unknown link strategy {spec!r}; use {SPELLINGS}")

    def __str__(self) -> str:
        base = self.kind
        if self.kind == "legolink":
            base = f"legolink:{self.k}"
        elif self.kind == "cacheblend":
            base = f"cacheblend:{repr(self.ratio).removesuffix('.0')}"  # exact: parses back
        if self.order != "given":
            base += f"+{self.order}"
        return f"{base}+top:{self.top}" if self.top else base

    def arrange(self, chunks: Sequence[T]) -> list[T]:
        """The document chunks (or their cache IDs) in this strategy's order."""
        if self.order == "reversed":
            return list(reversed(chunks))
        if self.order == "rotated":
            return [*chunks[1:], *chunks[:1]]
        return list(chunks)

    def in_full(self, documents: int) -> list[bool]:
        """Per placed document chunk (after `arrange`): is it recomputed whole (`top`)?"""
        return [rank < self.top for rank in self.arrange(range(documents))]

    @property
    def uses_cache(self) -> bool:
        """False for `prefill`, which computes the whole prompt afresh."""
        return self.kind != "prefill"

    @property
    def needs_sinks(self) -> bool:
        """The chunks must have been encoded after sink tokens."""
        return self.kind == "legolink0"


PREFILL = Strategy("prefill")
DEFAULT = Strategy("legolink", k=2)  # EngineConfig's default
