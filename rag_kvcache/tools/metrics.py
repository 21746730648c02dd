"""Answer-quality and fidelity metrics: whether the gold answer is in the output (accuracy)
and how many of prefill's right answers a strategy keeps, each with a bootstrap interval;
SQuAD-style F1 / exact match (only beside accuracy: F1 over sentences hides losses); and how
far a linked cache's next-token distributions drift from the fully recomputed one (KL, top-1)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """Best token-overlap F1 of the prediction against any reference answer."""
    return max(_f1(prediction, answer) for answer in answers)


def _f1(prediction: str, answer: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def contains_answer(prediction: str, answers: Sequence[str]) -> bool:
    """Whether a normalised reference answer appears inside the normalised prediction (the
    fairer test for a chatty small model that answers in a full sentence)."""
    pred = f" {normalize_answer(prediction)} "
    return any(f" {normalize_answer(a)} " in pred for a in answers if normalize_answer(a))


def kl_per_step(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) at each step, from logits [steps, vocab] (computed in float64)."""
    p = torch.log_softmax(reference.double(), dim=-1)
    q = torch.log_softmax(other.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).clamp(min=0)


def top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Share of steps where both logits [steps, vocab] pick the same most likely token."""
    return float((reference.argmax(-1) == other.argmax(-1)).double().mean())


# ----------------------------------------------------------------------------- answers kept


@dataclass(frozen=True)
class Estimate:
    """A share in percent with its 95% bootstrap interval (percentile method, over items)."""

    value: float
    low: float
    high: float
    n: int  # items it is measured on

    def __str__(self) -> str:
        if self.n == 0:  # no item to measure it on (a baseline that got none right)
            return "n/a (n=0: no right answer to keep)"
        return f"{self.value:.1f}% [{self.low:.1f}, {self.high:.1f}] (n={self.n})"


def accuracy(right: Sequence[bool], samples: int = 2000, seed: int = 0) -> Estimate:
    """Share of items answered right (gold answer in the output), with its interval."""
    return kept([True] * len(right), right, samples, seed)


def kept(
    baseline: Sequence[bool], right: Sequence[bool], samples: int = 2000, seed: int = 0
) -> Estimate:
    """Of the items the baseline (prefill) answers right, the share also answered right, with
    a 95% interval from resampling the items (the same resamples for every caller with one
    seed, so intervals of strategies compared on one item set are comparable)."""
    if len(baseline) != len(right):
        raise ValueError(f"{len(baseline)} baseline results for {len(right)} items")
    base = np.asarray(baseline, dtype=bool)
    return _share_of_baseline(
        base, (np.asarray(right, dtype=bool) & base).astype(int), samples, seed
    )


def kept_difference(
    baseline: Sequence[bool],
    right: Sequence[bool],
    floor: Sequence[bool],
    samples: int = 2000,
    seed: int = 0,
) -> Estimate:
    """How many more of the baseline's right answers `right` keeps than `floor` does, in
    percentage points of them, with a paired 95% interval (both counted on the same resamples
    of the items). `floor` is the noise floor: the same prefill with its chunks in another
    order. An interval that holds 0 says the cache loses no more than reordering does, as far
    as these items can tell."""
    if not len(baseline) == len(right) == len(floor):
        raise ValueError(f"{len(baseline)}, {len(right)} and {len(floor)} results do not pair up")
    base = np.asarray(baseline, dtype=bool)
    gap = (np.asarray(right, dtype=bool) & base).astype(int) - (
        np.asarray(floor, dtype=bool) & base
    ).astype(int)  # +1 kept by the cache only, -1 by the floor only
    return _share_of_baseline(base, gap, samples, seed)


def _share_of_baseline(base: np.ndarray, counts: np.ndarray, samples: int, seed: int) -> Estimate:
    """sum(counts) per item the baseline gets right (`base`), in percent, with a 95% interval
    from resampling the items: the same resamples for every caller with one seed, so the
    estimates of strategies compared on one item set are comparable."""
    n = int(base.sum())
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(base), size=(samples, len(base)))  # [samples, items]
    counted, summed = base[picks].sum(axis=1), counts[picks].sum(axis=1)
    shares = summed[counted > 0] / counted[counted > 0]
    low, high = np.percentile(100 * shares, [2.5, 97.5])
    return Estimate(100 * counts.sum() / n, float(low), float(high), n)
