"""The one answer path: cached chunks + new tokens + a Strategy -> an `Answer`.

Every caller that produces an answer comes through here: `RagKVCache.generate`, `complete` and
`chat`, Prompt Cache's markup prompts, the LlamaIndex LLM, `rag-kvcache eval` and every
benchmark. So what the evaluation measures is what users get, and a fidelity technique added
here reaches every caller at once.

Two steps, gpt-fast style:
1. `prepare`: compute the context by the strategy, up to the first answer token's logits:
   a plain prefill, a link of the cached chunks (`link`), or the chunks at given schema
   positions (Prompt Cache's `positions`).
2. `answer_steps`: decode with the one set of stop rules (`decoding.decode`), stream the text,
   and return the `Answer` with its timings. Time to first token counts from the start of the
   request, so store fetches made inside `context()` are in it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass

import torch

from rag_kvcache.config import GenerationConfig
from rag_kvcache.errors import RagKVCacheError, StrategyError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.calibration import Calibration
from rag_kvcache.link.linker import link
from rag_kvcache.model.adapter import (
    Cache,
    buffered_cache,
    forward,
    new_buffers,
    release_buffers,
)
from rag_kvcache.model.attention import additive_mask
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.model.rope import rotate_into
from rag_kvcache.serving.decoding import decode, prefill
from rag_kvcache.serving.text import TextPieces
from rag_kvcache.strategy import Strategy


@dataclass(frozen=True)
class Answer:
    """A generated answer and what it cost."""

    text: str
    token_ids: tuple[int, ...]  # the answer's tokens, end-of-sequence dropped
    strategy: Strategy
    prompt_tokens: int  # context + new tokens (the question)
    context_tokens: int  # tokens of the cached context (system prefix and chunks)
    # context tokens computed afresh (all of them for prefill; cacheblend: the average over
    # layers, since its set shrinks layer by layer)
    recomputed_tokens: int
    ttft_s: float  # request start -> first token chosen (store fetch + context + first forward)
    decode_tokens_per_s: float
    total_s: float
    reused_tokens: int = 0  # context tokens taken already linked (batched: the prefix tree)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens computed for this answer: the new ones and the recomputed context."""
        return self.prompt_tokens - self.context_tokens + self.recomputed_tokens


@dataclass(frozen=True)
class Placement:
    """Where each chunk and each new token sits, for `positions` (Prompt Cache's schemas):
    chunk i starts at `starts[i]`, new token j is at `new_positions[j]`. Positions may leave
    gaps (unimported union members); the buffer holds only real tokens."""

    starts: tuple[int, ...]
    new_positions: tuple[int, ...]


@dataclass
class Prepared:
    """The context computed by a strategy, ready to decode."""

    cache: Cache
    logits: torch.Tensor  # [vocab], for the first answer token
    position: int  # position of the next token
    context_tokens: int
    recomputed: int


def prepare(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    new_ids: list[int],
    strategy: Strategy,
    reserve: int = 0,
    placement: Placement | None = None,
    calibration: Calibration | None = None,
) -> Prepared:
    """Compute the context (chunks, system prefix first) and the new tokens by `strategy`.

    `reserve` cache slots are kept free for the answer. `placement` (schema positions) goes
    with `positions`, which needs it, and `prefill`, which then reads the tokens in position
    order; link strategies place chunks back to back. `calibration` goes with `+calibrated`
    strategies (the model's trained link tokens).
    """
    context = sum(c.num_tokens for c in chunks)
    # an answer stops at the window: slots past it would never be written (a reserve of 10^9
    # tokens asked for hundreds of GB)
    reserve = max(0, min(reserve, lm.max_context - context - len(new_ids)))
    if strategy.kind == "positions" and placement is None:
        raise StrategyError("`positions` needs schema positions: it serves markup prompts")
    if placement is not None and strategy.uses_cache and strategy.kind != "positions":
        raise StrategyError(
            f"{strategy} places chunks back to back; schema positions need `positions`"
        )
    if not strategy.uses_cache or placement is not None:  # only `link` reads KV as it arrives
        chunks = [c.whole() for c in chunks]
    if not strategy.uses_cache:
        ids = prompt_in_position_order(chunks, new_ids, placement)
        cache, logits = prefill(lm, ids, reserve=reserve)
        return Prepared(cache, logits, len(ids), context, context)
    if placement is not None:
        cache, logits, position = at_positions(lm, chunks, new_ids, placement, reserve)
        return Prepared(cache, logits, position, context, 0)
    linked = link(lm, chunks, new_ids, strategy, reserve=reserve, calibration=calibration)
    return Prepared(linked.cache, linked.next_logits, linked.length, context, linked.recomputed)


def answer_steps(
    lm: LoadedModel,
    context: Callable[[], Prepared],
    new_tokens: int,
    strategy: Strategy,
    generation: GenerationConfig,
    lead: Sequence[int] = (),
) -> Generator[str, None, Answer]:
    """Yield the answer's text as it grows; return the `Answer` (see `AnswerStream`).

    `lead`: the prompt's last tokens, for an answer kept as decoded (`TextPieces`).
    `context()` fetches and prepares the context (timed as part of the first token);
    `new_tokens` is how many prompt tokens came after the cached context.
    """
    start = time.perf_counter()
    prepared = context()
    tokens: list[int] = []
    text = TextPieces(lm, generation.strip, lead)  # the pieces the batch decoder streams, alike
    ttft = 0.0
    try:
        for token in decode(lm, prepared.cache, prepared.logits, prepared.position, generation):
            if not tokens:
                ttft = time.perf_counter() - start
            tokens.append(token)
            if token in lm.eos_ids:
                break
            yield text.add(token)
    finally:  # decoded, or the stream was closed: the next answer may reuse the buffers
        release_buffers(prepared.cache)
    total = time.perf_counter() - start
    if rest := text.finish():
        yield rest
    cached = prepared.context_tokens
    return make_answer(
        lm,
        tokens,
        text.text,
        strategy,
        cached + new_tokens,
        cached,
        prepared.recomputed,
        ttft,
        total,
    )


def make_answer(
    lm: LoadedModel,
    tokens: list[int],
    text: str,
    strategy: Strategy,
    prompt_tokens: int,
    context_tokens: int,
    recomputed: int,
    ttft_s: float,
    total_s: float,
    reused: int = 0,
) -> Answer:
    """The `Answer` record of a decoded request (every decode loop ends here): `tokens` as
    chosen (end-of-sequence included), `text` as streamed (`TextPieces`: stripped already,
    where the request asked for that), times from request start."""
    decode_s = total_s - ttft_s
    return Answer(
        text=text,
        token_ids=tuple(t for t in tokens if t not in lm.eos_ids),
        strategy=strategy,
        prompt_tokens=prompt_tokens,
        context_tokens=context_tokens,
        recomputed_tokens=recomputed,
        ttft_s=ttft_s,
        decode_tokens_per_s=(len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
        total_s=total_s,
        reused_tokens=reused,
    )


class AnswerStream:
    """Iterates over text pieces as they are generated; `.answer` is set once exhausted.

    A loop that stops early (`break`) pauses the answer: iterating again goes on from the next
    piece, and `finish` runs it to the end; once the answer is done, iterating yields nothing.
    (It used to end the answer, and `finish` then failed, clearing `.answer`.) `close` (or a
    `with` block) ends an answer that will not be read on, releasing its buffers at once:
    the pieces end there, as a closed generator's do (in a loop over them, in this thread or
    another: a stop button), `.answer` stays None and `finish` is an error."""

    def __init__(self, steps: Generator[str, None, Answer]):
        self._steps = steps
        self.answer: Answer | None = None
        self._failed: BaseException | None = None
        self._reading = threading.Lock()  # held while a piece is decoded
        self._closed = threading.Event()  # set by close()

    def __iter__(self) -> Iterator[str]:
        while self.answer is None and not self._closed.is_set():
            if self._failed is not None:
                raise RagKVCacheError(
                    f"this answer stopped with {type(self._failed).__name__}, raised when it "
                    "was read: there is no more of it"
                ) from self._failed
            if not self._reading.acquire(blocking=False):  # (next() would raise ValueError,
                # and this answer, fine in the thread that reads it, would be marked failed)
                if self._closed.is_set():  # (it is being closed: the pieces end)
                    return
                raise RagKVCacheError(
                    "another thread is reading this answer: read a stream from one thread"
                )
            try:
                if self._closed.is_set():  # (closed while this thread waited for the lock)
                    return
                piece = next(self._steps)
            except StopIteration as done:
                self.answer = done.value
                return
            except BaseException as e:  # (a generator that raised is over)
                self._failed = e
                raise
            finally:
                self._reading.release()
            yield piece

    def close(self) -> None:
        """End the answer where it is: nothing more is decoded, the pieces end. From another
        thread (a stop button), it waits for the piece being decoded."""
        self._closed.set()
        with self._reading:
            self._steps.close()

    def __enter__(self) -> AnswerStream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def finish(self) -> Answer:
        """Run to the end (if not yet) and return the answer; an error for a closed one."""
        for _ in self:
            pass
        if self.answer is None:  # (the loop ends only with it set, closed, or raises)
            raise RagKVCacheError("this answer was closed before its end: there is no Answer")
        return self.answer


def forced_logits(lm: LoadedModel, prepared: Prepared, tokens: list[int]) -> torch.Tensor:
    """Next-token logits [len(tokens), vocab] (float32) with `tokens` fed in one at a time
    after the prepared context: teacher forcing, for comparing strategies' distributions.
    The prepared cache is extended in place (prepare it anew for another call)."""
    cache, position, steps = prepared.cache, prepared.position, [prepared.logits]
    for token in tokens[:-1]:
        ids = torch.tensor([[token]], device=lm.device)
        pos = torch.tensor([[position]], device=lm.device)
        out, cache = forward(lm, ids, positions=pos, cache=cache, logits_to_keep=1)
        steps.append(out[0, -1])
        position += 1
    return torch.stack(steps).float()


def prompt_in_position_order(
    chunks: list[ChunkKV], new_ids: list[int], placement: Placement | None = None
) -> list[int]:
    """The plain prompt: chunk tokens then new tokens, or merged by their placed positions."""
    if placement is None:
        return [t for c in chunks for t in c.token_ids] + list(new_ids)
    pairs = [
        (start + i, t)
        for c, start in zip(chunks, placement.starts, strict=True)
        for i, t in enumerate(c.token_ids)
    ]
    pairs += list(zip(placement.new_positions, new_ids, strict=True))
    return [t for _, t in sorted(pairs)]


def at_positions(
    lm: LoadedModel,
    chunks: list[ChunkKV],
    new_ids: list[int],
    placement: Placement,
    reserve: int,
) -> tuple[Cache, torch.Tensor, int]:
    """Place cached chunks at their given positions and compute the new tokens at theirs.

    The buffer holds only real tokens, back to back; positions live in the keys' rotation and
    in the mask (a new token sees every token at an earlier or equal position), so empty
    positions cost nothing and are never read.
    """
    n = sum(c.num_tokens for c in chunks)
    keys, values = new_buffers(lm, n + len(new_ids) + reserve)
    index, cached_positions = 0, list[int]()
    for kv, start in zip(chunks, placement.starts, strict=True):
        span = slice(index, index + kv.num_tokens)
        rotate_into(keys[:, 0, :, span], kv.keys.to(lm.device), start - kv.start, lm.inv_freq)
        values[:, 0, :, span] = kv.values
        cached_positions += range(start, start + kv.num_tokens)
        index += kv.num_tokens
    new = torch.tensor(placement.new_positions, dtype=torch.long, device=lm.device)
    old = torch.tensor(cached_positions, dtype=torch.long, device=lm.device)
    allowed = torch.cat((old[None, :] <= new[:, None], new[None, :] <= new[:, None]), dim=1)
    ids = torch.tensor([new_ids], device=lm.device)
    cache = buffered_cache(lm, keys, values, n)
    logits, cache = forward(
        lm,
        ids,
        positions=new[None],
        cache=cache,
        mask=additive_mask(allowed, lm.dtype),
        logits_to_keep=1,
    )
    return cache, logits[0, -1], int(new.max()) + 1
