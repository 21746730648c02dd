"""Running the strategies: the `Evaluator` answers an item with every strategy through
the engine's public answer path, `run_eval` runs a QA set (resumable through a journal, with
rows reused from an earlier report), `check_strategies` orders and completes the list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from rag_kvcache.answer import Answer
from rag_kvcache.config import (
    DEFAULT_SYSTEM_PROMPT,
    LEGOLINK0_SINKS,
    EncodeConfig,
    EngineConfig,
    GenerationConfig,
    StoreConfig,
)
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError
from rag_kvcache.link.calibration import Calibration
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.strategy import PREFILL, Strategy
from rag_kvcache.tools.eval.dataset import EvalItem
from rag_kvcache.tools.eval.journal import Journal
from rag_kvcache.tools.eval.results import ItemResult, StrategySummary, baseline, summarize
from rag_kvcache.tools.metrics import (
    contains_answer,
    exact_match,
    f1_score,
    kl_per_step,
    top1_agreement,
)

FULL = Strategy("full")


DEFAULT_STRATEGIES = (
    "full",
    "prefill",
    "prefill+reversed",  # the noise floor: prefill's own answers with the chunks reordered
    "prefill+rotated",
    "naive",
    *(f"legolink:{k}" for k in (1, 2, 4, 8, 16, 32)),
    "legolink0",
    "cacheblend:0.15",
)


class Evaluator:
    """Runs items through every strategy on one model (greedy, so deterministic), through the
    engine's public answer path: what it measures is what `RagKVCache.generate` answers.

    The documents of an item are cached once as chunks of an in-memory store (LegoLink-0's
    again after `sink_tokens` sink tokens, in an engine configured for it); with `store` (a
    StoreConfig with a root), of that tiered store instead, so the answers read KV as its
    durable tier keeps it (`compress`: bfloat16, int8)."""

    def __init__(
        self,
        lm: LoadedModel,
        max_new_tokens: int = 32,
        teacher_tokens: int = 16,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        sink_tokens: int = LEGOLINK0_SINKS,
        calibration: Calibration | None = None,
        store: StoreConfig | None = None,
    ):
        config = EngineConfig(
            generation=GenerationConfig(max_new_tokens=max_new_tokens),
            store=store or StoreConfig(),
            system_prompt=system_prompt,
        )
        # in memory unless told: a root-less StoreConfig opens a MemoryStore
        self.engine = RagKVCache(config, lm=lm)
        self.sink_engine = self.engine.with_encoding(EncodeConfig(sink_tokens=sink_tokens))
        if calibration is not None:  # what `+calibrated` strategies link with
            self.engine.set_calibration(calibration)
        self.teacher_tokens = teacher_tokens
        self._warm = False

    def run_item(
        self,
        item: EvalItem,
        strategies: list[Strategy],
        known: Mapping[str, ItemResult] | None = None,
    ) -> list[ItemResult]:
        """The item's rows, one per strategy in order; the strategies in `known` (rows an
        earlier run measured under the same settings, `reused_rows`) are taken, not run:
        answers are greedy, so they would come out the same."""
        known = known or {}
        head = [FULL, PREFILL] if self.teacher_tokens else [PREFILL]
        if strategies[: len(head)] != head:
            raise ConfigError(
                f"{[str(s) for s in head]} (the KL reference when teacher-forcing, the accuracy "
                f"baseline) come first, got {[str(s) for s in strategies]}"
            )
        if all(str(s) in known for s in strategies):  # nothing to run: no documents to cache
            return [known[str(s)] for s in strategies]
        documents = list(item.documents)
        plain = self.engine.generate_context_cache(documents)
        sinks = None
        if any(s.needs_sinks for s in strategies):
            sinks = self.sink_engine.generate_context_cache(documents)
        if not self._warm:  # first calls in a process are slower; keep them out of timings
            self.engine.generate(item.question, plain, strategy="naive", max_new_tokens=1)
            self.engine.generate(item.question, plain, strategy=PREFILL, max_new_tokens=1)
            self._warm = True
        runs: list[tuple[Strategy, Answer, torch.Tensor]] = []
        forced: list[int] = []
        reference = torch.empty(0)
        for strategy in strategies:
            if str(strategy) in known:
                continue
            engine, ids = (
                (self.sink_engine, sinks) if strategy.needs_sinks else (self.engine, plain)
            )
            assert ids is not None
            answer = engine.generate(item.question, ids, strategy=strategy)
            assert isinstance(answer, Answer)
            if strategy == FULL and self.teacher_tokens:  # the reference for the others
                forced = list(answer.token_ids[: self.teacher_tokens])
                forced = forced or [int(self.engine.lm.eos_ids[0])]
                reference = self.engine.forced_logits(item.question, plain, forced, FULL)
            # full too, from a fresh context: its agreement with the reference checks determinism
            logits = (
                engine.forced_logits(item.question, ids, forced, strategy)
                if self.teacher_tokens
                else torch.empty(0)
            )
            runs.append((strategy, answer, logits))
        reused_prefill = known.get(str(PREFILL))
        prefill_ttft = (
            reused_prefill.ttft_s
            if reused_prefill
            else next(answer.ttft_s for s, answer, _ in runs if s == PREFILL)
        )
        measured = {
            str(strategy): ItemResult(
                item=item.id,
                strategy=str(strategy),
                answer=answer.text,
                token_ids=answer.token_ids,
                f1=f1_score(answer.text, item.answers),
                exact_match=exact_match(answer.text, item.answers),
                contains=contains_answer(answer.text, item.answers),
                kl=float(kl_per_step(reference, logits).mean()) if len(logits) else math.nan,
                top1=top1_agreement(reference, logits) if len(logits) else math.nan,
                ttft_s=answer.ttft_s,
                prefill_ttft_s=prefill_ttft,
                context_tokens=answer.context_tokens,
                recomputed_tokens=answer.recomputed_tokens,
            )
            for strategy, answer, logits in runs
        }
        return [known.get(str(s)) or measured[str(s)] for s in strategies]


def check_strategies(
    strategies: list[str] | list[Strategy], with_full: bool = True
) -> list[Strategy]:
    """Parsed strategies, each once, `full` (the KL reference; `with_full`) and `prefill` (the
    accuracy baseline) first, and the prefill of every placement used (each one's baseline)."""
    parsed = [Strategy.parse(s) for s in strategies]
    parsed += [baseline(s) for s in parsed]
    head = [FULL, PREFILL] if with_full else [PREFILL]
    return [*head, *[s for s in dict.fromkeys(parsed) if s not in head]]


def run_eval(
    lm: LoadedModel,
    items: list[EvalItem],
    strategies: list[str] | list[Strategy],
    max_new_tokens: int = 32,
    teacher_tokens: int = 16,
    on_item: Callable[[EvalItem], None] | None = None,
    journal: Journal | None = None,
    calibration: Calibration | None = None,
    reuse: Mapping[str, Mapping[str, ItemResult]] | None = None,
    store: StoreConfig | None = None,
) -> tuple[list[ItemResult], list[StrategySummary]]:
    """Every item through every strategy. With a `journal`, each item's results are appended
    as soon as they exist and the items it already holds are not run again: a killed run,
    restarted with the same settings, loses at most the item it was on. `reuse` (item ->
    strategy -> row, `reused_rows`) supplies rows an earlier run measured: a strategy added
    to a long run costs only its own answers, not prefill's again. `store`: the chunks are
    kept in that tiered store (see Evaluator), not in memory."""
    parsed = check_strategies(strategies, with_full=teacher_tokens > 0)
    evaluator = Evaluator(lm, max_new_tokens, teacher_tokens, calibration=calibration, store=store)
    done = journal.results() if journal else {}
    results: list[ItemResult] = []
    try:
        for item in items:
            rows = done.get(item.id)
            if rows is None:
                rows = evaluator.run_item(item, parsed, (reuse or {}).get(item.id))
                if journal:
                    journal.append(rows)
            results += rows
            if on_item:
                on_item(item)
    finally:
        if isinstance(evaluator.engine.store, TieredStore):
            evaluator.engine.store.close()
    return results, summarize(results, parsed)
