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
- `cacheblend:r`: CacheBlend's selective recompute (Yao et al., EuroSys 2025; a baseline): the
  first two layers recompute every document token, then the set is filtered layer by layer,
  keeping those whose values deviate most from their cached copies, down to a share r of the
  document tokens, which every later layer recomputes (`link.selection.GradualFilter`).
- `positions`: Prompt Cache's mode for markup prompts: each cached unit at its schema
  position, the prompt's own tokens computed at theirs, nothing recomputed.

Placement is a part of any strategy that links or prefills chunks, spelled after a `+`:
- `+reversed`: the document chunks in the reverse of the order given. Cache IDs are given best
  first (as retrieval returns them), so this puts the most relevant chunk nearest the question.
- `+rotated`: the first chunk moved to the end (the order given, rotated by one).
- `+ends`: LlamaIndex's LongContextReorder, the best-ranked chunks at both ends and the least
  relevant in the middle: the best last (nearest the question), the second first, the third
  second to last, the fourth second, and so on.
Prefill with another order is how the noise floor of "kept" answers is measured: a cache that
changes answers no more than reordering the chunks does is as good as prefill for a user.

Query-aware recompute is a part of any link strategy that leaves tokens stale, spelled last:
- `+top:N`: the N best-ranked document chunks (the first N cache IDs given) are recomputed
  whole, wherever the order places them; the rest as the strategy says. Where linking goes
  wrong, a distractor's stale KV usually outvotes the chunk that holds the answer; recomputing
  the chunks the question needs most takes that vote away. `+top:0` is the strategy alone, and
  `top` past the number of chunks recomputes every document chunk (equal to `full`).

APE's attention temperature and scale are a part of the same strategies, spelled last:
- `+ape:T,S`: every new token (recomputed, question, answer) attends to the context tokens
  left stale with its scores divided by T and their weight multiplied by S (APE, Yang et
  al. 2025: parallel-encoded context is attended too flatly and too much). Done by dividing
  the stale keys by T once when the chunks are placed and adding log S to their columns of
  every attention mask, so decoding pays nothing for T. `ape:1,1` is plain linking.
  Not with `cacheblend`, which leaves a different set of tokens stale in each layer.

A learned per-model calibration (`rag-kvcache calibrate`) is a part of the same strategies,
spelled last:
- `+calibrated`: after every document chunk, the calibration's few trained link tokens (soft
  embeddings; KVLink's link tokens, KV Packet's) are computed with the question, attending to
  everything before them, so the question can read the independently encoded chunks through
  them. The calibration for the loaded model comes from the store (`link.calibration`); a
  calibration of zero link tokens is the strategy alone. Not with `cacheblend`.

The question is always computed. A fidelity technique joins as a field of this record (with
its spelling in `parse` / `__str__`), not as a new string grammar.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from rag_kvcache.errors import StrategyError

KINDS = ("prefill", "full", "naive", "legolink", "legolink0", "cacheblend", "positions")
_PLAIN = ("prefill", "full", "naive", "legolink0", "positions")
_STALE = ("naive", "legolink", "legolink0", "cacheblend")  # kinds that leave tokens stale
ORDERS = ("given", "reversed", "rotated", "ends")
SPELLINGS = (
    "prefill, full, naive, legolink:K (K >= 0), legolink0, cacheblend:R (0 <= R <= 1), "
    "each optionally +reversed, +rotated or +ends, then (not prefill or full) +top:N, "
    "then +window:W, then +ape:T,S, then +calibrated; or positions (markup prompts)"
)
_NUMBER = r"([0-9.e+-]+)"
MAX_COUNT = 2**31 - 1  # a strategy's token or chunk count, at most (past it, torch overflows)
# APE divides the stale keys by its temperature: far below 1 they overflow (1e-45 made every
# float32 logit NaN; float16's keys overflow near 1e-4), and the sweeps never went below 0.5
APE_MIN_TEMPERATURE = 0.01
T = TypeVar("T")


@dataclass(frozen=True)
class Strategy:
    """One way to compute the context (see the module docstring)."""

    kind: str
    k: int = 0  # legolink: boundary tokens recomputed per chunk
    ratio: float = 0.0  # cacheblend: share of document tokens recomputed in the last layers
    order: str = "given"  # placement of the document chunks (see the module docstring)
    top: int = 0  # best-ranked document chunks recomputed whole (query-aware recompute)
    window: int | None = None  # recomputed document tokens read the W tokens before their chunk
    temperature: float = 1.0  # APE: scores on stale context tokens divided by this
    scale: float = 1.0  # APE: attention weight of stale context tokens multiplied by this
    calibrated: bool = False  # the model's trained link tokens after every document chunk

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StrategyError(f"unknown strategy kind {self.kind!r}; one of {KINDS}")
        for name, count in (("legolink", self.k), ("top", self.top), ("window", self.window)):
            if count is not None and count > MAX_COUNT:  # tokens or chunks: past any window
                raise StrategyError(f"{name}:{count} is more than any context holds")
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
        if self.window is not None and (self.window < 0 or self.kind not in _STALE):
            raise StrategyError(
                f"window={self.window} is for {', '.join(_STALE)}, and must be >= 0"
            )
        if self.window is not None and self.kind == "cacheblend":
            raise StrategyError("window with cacheblend: it recomputes a different set per layer")
        if self.window is not None and self.calibrated:  # its link tokens read everything
            raise StrategyError("window with calibrated: the calibration was trained without one")
        if not (APE_MIN_TEMPERATURE <= self.temperature < math.inf and 0 < self.scale < math.inf):
            raise StrategyError(
                f"ape:{self.temperature},{self.scale}: the temperature must be at least "
                f"{APE_MIN_TEMPERATURE} and the scale above 0, both finite"
            )
        if self.uses_ape and self.kind not in _STALE:
            raise StrategyError(f"ape is for {', '.join(_STALE)}: {self.kind} leaves none stale")
        if self.uses_ape and self.kind == "cacheblend":  # APE tempers one set in every layer
            raise StrategyError("ape with cacheblend: it leaves a different set stale per layer")
        if self.calibrated and (self.kind not in _STALE or self.kind == "cacheblend"):
            raise StrategyError(f"calibrated is for naive, legolink, legolink0, not {self.kind}")

    @classmethod
    def parse(cls, spec: str | Strategy) -> Strategy:
        """A user's spelling (case and surrounding blanks ignored) -> Strategy."""
        if isinstance(spec, Strategy):
            return spec
        # (blanks around each "+" too; digits are ASCII: `\d` took "legolink:٢" for 2)
        text, *parts = (part.strip() for part in str(spec).strip().lower().split("+"))
        if parts:
            base, order, top, ape, calibrated = cls.parse(text), "given", 0, ("1", "1"), False
            window: int | None = None
            seen = 0  # parts come in this order, each at most once
            for part in parts:
                if part in ORDERS[1:] and seen < 1:
                    order, seen = part, 1
                elif (m := re.fullmatch(r"top:([0-9]+)", part)) and seen < 2:
                    top, seen = int(m.group(1)), 2
                elif (m := re.fullmatch(r"window:([0-9]+)", part)) and seen < 3:
                    window, seen = int(m.group(1)), 3
                elif (m := re.fullmatch(f"ape:{_NUMBER},{_NUMBER}", part)) and seen < 4:
                    ape, seen = (m.group(1), m.group(2)), 4
                elif part == "calibrated" and seen < 5:
                    calibrated, seen = True, 5
                else:
                    raise StrategyError(f"unknown link strategy {spec!r}; use {SPELLINGS}")
            try:
                temperature, scale = float(ape[0]), float(ape[1])
                return replace(
                    base,
                    order=order,
                    top=top,
                    window=window,
                    temperature=temperature,
                    scale=scale,
                    calibrated=calibrated,
                )
            except (StrategyError, ValueError) as e:
                raise StrategyError(f"{spec!r}: {e}; use {SPELLINGS}") from None
        if text in _PLAIN:
            return cls(text)
        if m := re.fullmatch(r"legolink:([0-9]+)", text):
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
            base = f"cacheblend:{_exact(self.ratio)}"
        if self.order != "given":
            base += f"+{self.order}"
        if self.top:
            base += f"+top:{self.top}"
        if self.window is not None:
            base += f"+window:{self.window}"
        if self.uses_ape:
            base += f"+ape:{_exact(self.temperature)},{_exact(self.scale)}"
        if self.calibrated:
            base += "+calibrated"
        return base

    def arrange(self, chunks: Sequence[T]) -> list[T]:
        """The document chunks (or their cache IDs) in this strategy's order."""
        if self.order == "reversed":
            return list(reversed(chunks))
        if self.order == "rotated":
            return [*chunks[1:], *chunks[:1]]
        if self.order == "ends":  # odd ranks from the front, even ranks back from the end
            return [*chunks[1::2], *reversed(chunks[0::2])]
        return list(chunks)

    def in_full(self, documents: int) -> list[bool]:
        """Per placed document chunk (after `arrange`): is it recomputed whole (`top`)?"""
        return [rank < self.top for rank in self.arrange(range(documents))]

    @property
    def baseline(self) -> Strategy:
        """A plain prefill of the very prompt this strategy answers (the same chunks in the
        same placement): what its speed and its answers are compared with."""
        return Strategy("prefill", order=self.order)

    @property
    def uses_cache(self) -> bool:
        """False for `prefill`, which computes the whole prompt afresh."""
        return self.kind != "prefill"

    @property
    def uses_ape(self) -> bool:
        """Attention on stale context tokens is tempered or scaled (`+ape:T,S`)."""
        return (self.temperature, self.scale) != (1.0, 1.0)

    @property
    def needs_sinks(self) -> bool:
        """The chunks must have been encoded after sink tokens."""
        return self.kind == "legolink0"


PREFILL = Strategy("prefill")
# EngineConfig's default, chosen from evidence (docs/evaluation-notes.md): the most accurate
# strategy at least 10x faster than prefill at 4K, on the dev split's QA items and the
# needles together. The best-ranked chunk, placed nearest the question, is recomputed reading
# the 1024 tokens before it; every other chunk's first two tokens are recomputed (LegoLink:
# what finds needles the plain cached chunks hide) and APE's weight on their stale tokens is
# halved (what keeps the QA answers the recomputed boundaries alone lose).
DEFAULT = Strategy("legolink", k=2, order="reversed", top=1, window=1024, scale=0.5)


def _exact(number: float) -> str:
    """A float's shortest spelling that parses back to it exactly."""
    return repr(float(number)).removesuffix(".0")
