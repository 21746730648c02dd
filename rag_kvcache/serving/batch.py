"""Batched generation over shared linked prefixes (ChunkAttention-style).

Requests are linked against the prefix tree: the longest linked prefix already there is reused
as is, only the remaining chunks are linked (given it) and added to the tree, and the request
keeps just its question and generated tokens privately. All active requests then decode
together: one forward per step for the whole batch, where each layer's attention runs in two
phases (`cascade_attention`): every tree node once for all requests passing through it, then
each request's own tokens, merged by log-sum-exp. A node only one active request uses is
kept in that request's row of the batch's KV instead (`BatchKV`), and a short shared one
(the system prompt) is copied into each row that uses it, so a batch that shares nothing
longer attends in one call per layer.

The decoder has the shape a server drives (vLLM's, SGLang's): `add_request` queues a request,
`step` runs one batched forward and then lets waiting requests join, `abort` drops one. A
request leaves the batch when done; its row is a slot that a joining request takes (only the
rows that change are written), so a step's bookkeeping is proportional to the batch, not to
the tree, and a join or leave copies one row's KV, not the batch's.

Admission is in arrival order while the KV fits one budget (the tree's nodes and every batch's
rows, see `make_room`); a request that does not fit waits first in line until one leaves. A
request whose whole context is already in the tree only needs its question computed: those of
one step go through the model together (`questions.prefill_questions`), one forward for a
burst of questions over popular chunks instead of one each.

APE's scale (`+ape:T,S`) rides along with the KV: a node's stale keys are tempered already
(as linked), and the log S added to their scores is the node's `bias`, which both phases of
attention add where they read the node (a request's row carries its inlined nodes' bias).

A `prefill` request (a plain prompt, or chunks computed afresh) links nothing: its whole
prompt is prefilled alone and kept in its row, outside the tree, and it decodes in the same
batch as the linked ones.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from rag_kvcache.config import GenerationConfig, whole_number
from rag_kvcache.errors import KVBudgetError, RagKVCacheError, StrategyError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.checks import check_chunks
from rag_kvcache.link.linker import LinkedPrefix, link, linked_layers
from rag_kvcache.model.adapter import (
    forward,
    hook_cache,
    key_bias,
    release_buffers,
    unpack_cache,
)
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.serving.batch_kv import BatchKV, layouts
from rag_kvcache.serving.cascade import PrivateKV, SharedKV, cascade_attention
from rag_kvcache.serving.decoding import (
    check_window,
    finished,
    next_token,
    prefill,
    sampling_generator,
)
from rag_kvcache.serving.prefix_tree import PrefixTree, TreeNode, nodes_bias, path_to
from rag_kvcache.serving.questions import fit_together, prefill_questions
from rag_kvcache.serving.text import TextPieces
from rag_kvcache.strategy import Strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchRequest:
    query: str
    cache_ids: tuple[str, ...]
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class BatchStats:
    steps: int  # batched decode forwards
    decode_tokens: int  # tokens produced by them
    decode_s: float
    peak_kv_bytes: int  # prefix tree + private question / answer KV, at the fullest


@dataclass(frozen=True)
class BatchLoad:
    """The decoder after a step: requests decoding, requests waiting, KV bytes held under the
    budget (the tree's nodes and the batches' rows)."""

    decoding: int = 0
    waiting: int = 0
    kv_bytes: int = 0


@dataclass(frozen=True)
class Finished:
    """A request's final numbers, what the answer layer turns into an `Answer`."""

    tokens: tuple[int, ...]  # as chosen, end-of-sequence included
    text: str  # the answer's text, end-of-sequence dropped, stripped (as streamed)
    strategy: Strategy
    prompt_tokens: int
    context_tokens: int
    reused: int  # context tokens taken already linked from the tree
    recomputed: int
    ttft_s: float  # from add_request to its first token
    total_s: float  # from add_request to its last token


@dataclass(frozen=True)
class StepOutput:
    """What one request produced in one `step`: a token (with the text it completes), or the
    error that failed it. `finished` is set on its last record, with `done` unless it failed."""

    request_id: int
    token_id: int | None  # None when the request failed before choosing a token
    text: str  # new text ("" while half a UTF-8 character is held back)
    finished: bool
    done: Finished | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class _Waiting:
    request_id: int
    path: tuple[str, ...]  # cache IDs: system prefix, then the chunks in linked order
    question: tuple[int, ...]
    config: GenerationConfig
    strategy: Strategy
    arrived: float


@dataclass(eq=False)
class _Active:
    """One request while it decodes: its tree path and its own tokens (question + answer),
    whose KV lives in its row of the batch (`BatchKV`) once it has one."""

    request_id: int
    strategy: Strategy
    leaf: TreeNode | None  # deepest node of its path in the tree; None: `prefill` (no path)
    own_keys: list[torch.Tensor]  # the question's KV per layer, until it has a row
    own_values: list[torch.Tensor]
    length: int  # own tokens with KV
    capacity: int  # its question + max_new_tokens
    position: int  # position of the next token
    prompt_tokens: int
    context_tokens: int
    reused: int
    recomputed: int
    config: GenerationConfig
    generator: torch.Generator
    logits: torch.Tensor
    text: TextPieces
    arrived: float
    question: tuple[int, ...] = ()  # not computed yet: prefilled with the step's others
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0  # from its arrival to its first token


def batchable(strategy: Strategy) -> bool:
    """Whether the batch decoder serves `strategy` (see `check_batchable`)."""
    return not (strategy.calibrated or strategy.kind == "cacheblend")


def check_batchable(strategy: Strategy) -> None:
    """Raise StrategyError for a strategy whose linked KV the prefix tree cannot share yet."""
    if strategy.calibrated:
        raise StrategyError(
            f"{strategy}: batched decoding shares linked prefixes through the prefix tree, "
            "which does not keep link tokens yet; answer these requests one at a time "
            "(generate)"
        )
    if strategy.kind == "cacheblend":
        raise StrategyError(
            f"{strategy}: cacheblend picks the tokens to recompute over the whole context, so "
            "it cannot extend a prefix shared in the prefix tree; answer these requests one at "
            "a time (generate)"
        )


def tree_path(strategy: Strategy, path: list[str] | tuple[str, ...]) -> list[str]:
    """A request's key in the prefix tree: its cache IDs, the first one (the system prefix)
    spelled with the strategy, since the same chunks linked by two strategies are different
    KV; a chunk recomputed whole (`+top:N`, by its rank in this request) is marked too, as it
    links to other KV than the same chunk left stale."""
    in_full = [False, *strategy.in_full(len(path) - 1)]
    keys = [f"{c}+whole" if full else c for c, full in zip(path, in_full, strict=True)]
    if keys:
        keys[0] = f"{strategy}/{keys[0]}"
    return keys


class BatchDecoder:
    """Continuous batching over shared linked prefixes: `add_request` queues a request,
    `step` admits waiting ones (up to `max_batch` active, and while their KV fits the tree's
    budget beside the tree and every batch's rows) and decodes every active one by one
    token in a single batched forward, `abort` drops one. Requests of different strategies
    share a batch (decoding does not depend on the strategy, only linking does; the tree
    keeps their prefixes apart). Not thread-safe: one owner drives it (`serving.loop`)."""

    def __init__(
        self,
        lm: LoadedModel,
        tree: PrefixTree,
        fetch: Callable[[list[str]], list[ChunkKV]],
        max_batch: int = 32,
        link_budget_s: float | None = None,
    ):
        # (0: none would be admitted, and `run` would spin for ever)
        self.lm, self.tree, self.fetch = lm, tree, fetch
        self.max_batch = whole_number("max_batch", max_batch)
        # a step stops linking new requests once it spent this long linking while requests
        # decode (None: it links every request that fits): a burst of arrivals then delays
        # the running requests' next token by about this much, not by the whole burst
        self.link_budget_s = link_budget_s
        self.kv = BatchKV()  # the active requests' rows: slots, written as requests come and go
        self.peak_bytes = 0  # prefix tree + rows, at the fullest (moves included)
        self.waiting: deque[_Waiting] = deque()
        self.waiting_ids: set[int] = set()  # an aborted waiting request leaves this set only
        self.active: dict[int, _Active] = {}  # by request ID, in row order
        self.full = False  # the first waiting request did not fit the KV budget: until one leaves
        self.load = BatchLoad()  # as the last step left it (read by other threads)
        tree.batches.add(self.kv)  # its rows count under the tree's budget
        self.steps = self.decode_tokens = 0  # batched forwards, and tokens they produced
        self.decode_s = 0.0
        self._ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting_ids or self.active)

    def add_request(
        self,
        path: list[str],
        question: list[int],
        config: GenerationConfig,
        strategy: Strategy,
    ) -> int:
        """Queue a request (cache IDs of its context in linked order, system prefix first; its
        question's token ids); returns its ID. Linking waits for a free place in the batch."""
        check_batchable(strategy)
        request_id = next(self._ids)
        arrived = time.perf_counter()
        request = _Waiting(request_id, tuple(path), tuple(question), config, strategy, arrived)
        self.waiting.append(request)
        self.waiting_ids.add(request_id)
        return request_id

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or active request, releasing its references into the tree (its
        nodes become evictable); False if it is not here (finished, or never was)."""
        if request_id in self.waiting_ids:
            self.waiting_ids.discard(request_id)  # skipped when it reaches the queue's front
            self.full = False  # it may have been the one that did not fit
            self.publish()
            return True
        request = self.active.pop(request_id, None)
        if request is None:
            return False
        self.full = False
        if request.leaf is not None:
            self.tree.release(request.leaf)
        request.own_keys = request.own_values = []
        if not self.active:
            self.pack([])  # inlined nodes get their own copies back; the rows go
        self.publish()
        return True

    def step(self, emit: Callable[[StepOutput], None] | None = None) -> list[StepOutput]:
        """One batched decode forward for the active requests, then admission of waiting ones
        (`admit_waiting`: each links its context and chooses its first token): at most one
        record a request.
        `emit` gets each record as soon as it exists, so a request's first token goes out
        when it is linked, not after every request admitted in the same step. `emit` must
        not call back into the decoder (`abort` after the step)."""
        outputs: list[StepOutput] = []

        def out(record: StepOutput) -> None:
            outputs.append(record)
            if emit is not None:
                emit(record)

        if self.active:
            active = list(self.active.values())
            tick = time.perf_counter()
            self.forward(active)
            self.decode_s += time.perf_counter() - tick
            self.steps, self.decode_tokens = self.steps + 1, self.decode_tokens + len(active)
            for request in active:
                out(self.choose(request))
        self.admit_waiting(out)
        if not self.active:
            self.pack([])
        self.publish()
        return outputs

    def admit_waiting(self, out: Callable[[StepOutput], None]) -> None:
        """Admit waiting requests in arrival order while they fit the KV budget
        (`make_room`) and `max_batch`, and, while others decode, until `link_budget_s` is
        spent linking. Each linked request's first token goes to `out` at once; requests
        whose context is all in the tree get theirs after one forward for all their
        questions (`answer_questions`)."""
        asking: list[_Active] = []  # whole context in the tree: questions prefilled together
        linked, linking = 0, 0.0  # requests this step linked, and the seconds it took
        while self.waiting and len(self.active) < self.max_batch and not self.full:
            waiting = self.waiting[0]
            if waiting.request_id not in self.waiting_ids:
                self.waiting.popleft()
                continue  # aborted while waiting
            budget = self.link_budget_s
            if self.active and linked and budget is not None and linking >= budget:
                break  # the others decode a token first (at least one link a step)
            tick = time.perf_counter()
            try:
                admitted = self.admit(waiting)
            except Exception as error:  # this request's alone: the others go on
                if not isinstance(error, RagKVCacheError):  # not a user's mistake: a bug
                    log.exception("linking request %d failed", waiting.request_id)
                self.waiting.popleft()
                self.waiting_ids.discard(waiting.request_id)
                out(StepOutput(waiting.request_id, None, "", True, error=error))
                continue
            if admitted is None:  # no room in the KV budget: first in line until one leaves
                self.full = True
                break
            self.waiting.popleft()
            self.waiting_ids.discard(waiting.request_id)
            self.active[admitted.request_id] = admitted
            # its chunks are in the tree now: a request that ends at its first token is never
            # packed into rows, and a peak counted at packing alone said 0 bytes
            self.peak_bytes = max(self.peak_bytes, self.tree_nbytes() + self.kv.nbytes)
            if admitted.question:  # nothing linked: its question is computed below
                if not fit_together([len(r.question) for r in (*asking, admitted)]):
                    self.answer_questions(asking, out)
                    asking = []
                asking.append(admitted)
                continue
            linked, linking = linked + 1, linking + time.perf_counter() - tick
            admitted.ttft_s = time.perf_counter() - admitted.arrived
            out(self.choose(admitted))
        self.answer_questions(asking, out)

    def publish(self) -> None:
        """Set `load` for readers on other threads (metrics), after a step or an abort."""
        self.load = BatchLoad(len(self.active), len(self.waiting_ids), self.tree.in_use())

    def run(
        self, requests: list[tuple[list[str], list[int], GenerationConfig, Strategy]]
    ) -> tuple[list[Finished], BatchStats]:
        """Answer a fixed list of requests (path of cache IDs, question ids, generation
        config, strategy each) and return in their order; the first request that fails
        raises its error (after the others are dropped)."""
        steps, tokens, decode_s = self.steps, self.decode_tokens, self.decode_s
        ids = [self.add_request(*r) for r in requests]
        done: dict[int, Finished] = {}
        while self.has_work:
            for out in self.step():
                if out.error is not None:
                    for request_id in ids:
                        self.abort(request_id)
                    raise out.error
                if out.done is not None:
                    done[out.request_id] = out.done
        stats = BatchStats(
            self.steps - steps,
            self.decode_tokens - tokens,
            self.decode_s - decode_s,
            self.peak_bytes,
        )
        return [done[i] for i in ids], stats

    def admit(self, waiting: _Waiting) -> _Active | None:
        """Link the request over the longest shared prefix; add its new chunks to the tree.
        None: its KV does not fit the budget until a request leaves (see `make_room`)."""
        strategy, question = waiting.strategy, list(waiting.question)
        chunks = self.fetch(list(waiting.path))
        context = sum(c.num_tokens for c in chunks)
        check_window(self.lm, context + len(question))  # before the budget: none would help
        # an answer stops at the window (`finished`; its last token is sampled, never
        # written), as `generate`'s does: room sized by a larger max_new_tokens would never
        # be written, and the budget refused the request
        window = self.lm.max_context - context - len(question) + 1
        config = replace(waiting.config, max_new_tokens=min(waiting.config.max_new_tokens, window))
        waiting = replace(waiting, config=config)
        room = len(question) + config.max_new_tokens  # its own tokens: question, answer
        if not strategy.uses_cache:
            return self.prefilled(waiting, chunks) if self.make_room((), context + room) else None
        in_full = [False, *strategy.in_full(len(chunks) - 1)]
        path = tree_path(strategy, waiting.path)
        found = self.tree.match(path)
        unlinked = sum(c.num_tokens for c in chunks[found.chunks :])
        if not self.make_room(found.nodes, unlinked + room):
            return None
        if found.chunks == len(path) and fit_together([len(question)]):
            # only its question to compute, with the step's others (a long one is linked);
            # link's checks (the model's window, an empty question, the KV's model) first
            check_chunks(self.lm, chunks, strategy, len(question))
            self.tree.acquire(found.nodes[-1])
            return self.active_request(waiting, found.nodes[-1], found.tokens, question)
        prefix = None
        if found.nodes:
            layers = range(len(found.nodes[0].keys))
            prefix = LinkedPrefix(
                torch.stack([torch.cat([n.keys[i] for n in found.nodes], dim=1) for i in layers]),
                torch.stack([torch.cat([n.values[i] for n in found.nodes], dim=1) for i in layers]),
                tuple(t for c in chunks[: found.chunks] for t in c.token_ids),
                system_tokens=chunks[0].num_tokens,
                key_bias=nodes_bias(found.nodes),
            )
        rest = chunks[found.chunks :]
        flags = in_full[found.chunks :] if prefix else in_full[1:]  # link's: after chunk 0
        linked = link(self.lm, rest, question, strategy, prefix=prefix, in_full=flags)
        leaf = found.nodes[-1] if found.nodes else None
        if rest:  # room was made for them: `make_room`
            keys, values = linked_layers(linked, found.tokens, linked.context_tokens)
            sizes = [c.num_tokens for c in rest]
            bias = key_bias(linked.cache)  # APE's scale on the stale tokens, kept with them
            if bias is not None:
                bias = bias[found.tokens : linked.context_tokens].clone()
            leaf = self.tree.insert(leaf, path[found.chunks :], sizes, keys, values, bias)
        assert leaf is not None
        self.tree.acquire(leaf)
        q = len(question)
        keys, values = linked_layers(linked, linked.context_tokens, linked.length)
        release_buffers(linked.cache)  # copied out: the next link may reuse its buffers
        return _Active(
            request_id=waiting.request_id,
            strategy=strategy,
            leaf=leaf,
            own_keys=keys,  # the question's; its row in the batch gives it room for the answer
            own_values=values,
            length=q,
            capacity=q + config.max_new_tokens,
            position=linked.length,
            prompt_tokens=linked.length,
            context_tokens=linked.context_tokens,
            reused=found.tokens,
            recomputed=linked.recomputed,
            config=config,
            generator=sampling_generator(config.seed),
            logits=linked.next_logits,
            text=TextPieces(self.lm, config.strip),
            arrived=waiting.arrived,
        )

    def active_request(
        self, waiting: _Waiting, leaf: TreeNode, context: int, question: list[int]
    ) -> _Active:
        """A request whose whole context is the path to `leaf`: its question is computed by
        `answer_questions`, with the others admitted in the same step."""
        q, config = len(question), waiting.config
        return _Active(
            request_id=waiting.request_id,
            strategy=waiting.strategy,
            leaf=leaf,
            own_keys=[],
            own_values=[],
            length=q,
            capacity=q + config.max_new_tokens,
            position=context + q,
            prompt_tokens=context + q,
            context_tokens=context,
            reused=context,
            recomputed=0,
            config=config,
            generator=sampling_generator(config.seed),
            logits=torch.empty(0),
            text=TextPieces(self.lm, config.strip),
            arrived=waiting.arrived,
            question=tuple(question),
        )

    def answer_questions(self, requests: list[_Active], out: Callable[[StepOutput], None]) -> None:
        """Compute the questions of requests whose context is all in the tree in one forward
        (`questions.prefill_questions`: their KV and first logits); hand out their first
        tokens."""
        if not requests:
            return
        paths = [path_to(r.leaf) for r in requests]
        done = prefill_questions(self.lm, paths, [list(r.question) for r in requests])
        for request, kv in zip(requests, done, strict=True):
            request.own_keys, request.own_values, request.logits = kv.keys, kv.values, kv.logits
            request.question = ()
            request.ttft_s = time.perf_counter() - request.arrived
            out(self.choose(request))

    def make_room(self, nodes: Sequence[TreeNode], tokens: int) -> bool:
        """Whether a request fits the KV budget beside everything held now, once it has its
        row (`kv_after`), evicting idle tree nodes (never `nodes`) if that makes it fit. Its
        path in the tree is `nodes`; `tokens` are the rest of its row: chunks not in the
        tree yet, its question, room for its answer. False: it waits until a request leaves
        (the idle nodes stay). Raises KVBudgetError if it cannot fit with nothing else
        decoding here."""
        need = self.kv_after(nodes, tokens) - self.tree.nbytes  # beyond the tree's nodes
        budget = self.tree.budget_bytes
        if self.tree.nbytes + need <= budget:
            return True
        if nodes:
            self.tree.acquire(nodes[-1])  # making room must not evict the path it extends
        fits = self.tree.nbytes - self.tree.idle_nbytes() + need <= budget
        if fits:  # evict only what makes it fit: a request that waits keeps the cache warm
            self.tree.evict(need)
        if nodes:
            self.tree.release(nodes[-1])
        if fits:
            return True
        if self.active:
            return False
        total = sum(n.tokens for n in nodes) + tokens
        others = self.tree.rows_nbytes(besides=self.kv)
        held = f" beside {others / 2**20:.1f} MiB another batch holds" if others else ""
        raise KVBudgetError(
            f"this request's KV is {total * self.lm.kv_bytes_per_token / 2**20:.1f} MiB "
            f"({total} tokens: its context, its question and room for its answer), more than "
            f"the KV budget of {self.tree.budget_bytes / 2**20:.1f} MiB "
            f"(EngineConfig.kv_cache_bytes, serve --kv-cache-mib) holds{held}: raise the "
            "budget, or shorten the context or max_new_tokens"
        )

    def kv_after(self, nodes: Sequence[TreeNode], tokens: int) -> int:
        """All the KV under the budget once a request (path `nodes`, `tokens` more in its
        row) has its row: the layout the next `pack` makes (`BatchKV.plan`: nodes one active
        request uses moved into its row, short shared ones copied into each row, the others in
        the tree; rows as long as the longest, `BatchKV.nbytes_for`), beside the other
        batches' rows. O(batch x path)."""
        paths = [path_to(r.leaf) for r in self.active.values()] + [list(nodes)]
        lays = layouts(paths)
        room = [r.capacity for r in self.active.values()] + [tokens]
        rows = [lay.offset + t for lay, t in zip(lays, room, strict=True)]
        rows_bytes = self.kv.nbytes_for(len(rows), max(rows), self.lm.kv_bytes_per_token)
        others = self.tree.rows_nbytes(besides=self.kv)
        moved = [n for lay in lays for n in lay.moved]  # nodes that will live in these rows
        # counted once, in the rows; but one that another batch's row holds stays there too
        twice = sum(n.nbytes for n in moved if n.held_by not in (None, self.kv))
        return self.tree.nbytes - sum(n.nbytes for n in moved) + twice + rows_bytes + others

    def prefilled(self, waiting: _Waiting, chunks: list[ChunkKV]) -> _Active:
        """A `prefill` request (a plain prompt: no chunks, the question is the whole prompt):
        its chunks' tokens and its question computed afresh by the one plain prefill
        (`decoding.prefill`, as `generate` and `complete` do), all of it kept in its own row.
        Nothing goes into the tree: a plain prefill has no linked KV to share."""
        context = sum(c.num_tokens for c in chunks)
        ids = [t for c in chunks for t in c.token_ids] + list(waiting.question)
        cache, logits = prefill(self.lm, ids)
        layers = unpack_cache(cache)
        n = len(ids)
        own_keys = [k[0, :, :n].clone() for k, _ in layers]  # [kv_heads, n, head_dim] each
        own_values = [v[0, :, :n].clone() for _, v in layers]
        release_buffers(cache)  # copied out: the next request may reuse its buffers
        return _Active(
            request_id=waiting.request_id,
            strategy=waiting.strategy,
            leaf=None,
            own_keys=own_keys,
            own_values=own_values,
            length=n,
            capacity=n + waiting.config.max_new_tokens,
            position=n,
            prompt_tokens=n,
            context_tokens=context,
            reused=0,
            recomputed=context,
            config=waiting.config,
            generator=sampling_generator(waiting.config.seed),
            logits=logits,
            text=TextPieces(self.lm, waiting.config.strip, lead=ids),
            arrived=waiting.arrived,
        )

    def choose(self, request: _Active) -> StepOutput:
        """Pick the request's next token from its logits; once it is finished (the stop rules
        of every decode loop, `decoding.finished`) it leaves the batch and the tree."""
        token = next_token(request.logits, request.config, request.generator)
        request.tokens.append(token)
        piece = request.text.add(token)
        if not finished(self.lm, token, len(request.tokens), request.position, request.config):
            return StepOutput(request.request_id, token, piece, False)
        total_s = time.perf_counter() - request.arrived
        del self.active[request.request_id]
        self.full = False
        if request.leaf is not None:
            self.tree.release(request.leaf)
        request.own_keys = request.own_values = []
        piece += request.text.finish()
        done = Finished(
            tuple(request.tokens),
            request.text.text,
            request.strategy,
            request.prompt_tokens,
            request.context_tokens,
            request.reused,
            request.recomputed,
            request.ttft_s,
            total_s,
        )
        return StepOutput(request.request_id, token, piece, True, done)

    def pack(self, active: list[_Active]) -> None:
        """Give the active requests their rows (if the batch changed), counting the move."""
        if not self.kv.changed(active):
            return
        outside = self.tree_nbytes()  # before the move: nodes may move in or out of rows
        self.peak_bytes = max(self.peak_bytes, outside + self.kv.pack(active))

    def tree_nbytes(self) -> int:
        """The tree's KV not held in the batch's rows."""
        return self.tree.nbytes - self.kv.inlined_nbytes

    def forward(self, active: list[_Active]) -> None:
        """One batched forward: every active request's last token at its own position."""
        device = self.lm.device
        self.pack(active)
        active = self.kv.members  # type: ignore[assignment]  # the same requests, in row order
        ids = torch.tensor([[a.tokens[-1]] for a in active], device=device)
        positions = torch.tensor([[a.position] for a in active], device=device)
        rows_of: dict[TreeNode, list[int]] = {}  # nodes outside the rows: attended as parts
        for row, (request, layout) in enumerate(zip(active, self.kv.layouts, strict=True)):
            for node in path_to(request.leaf):
                if node not in layout.inlined:
                    rows_of.setdefault(node, []).append(row)
        ends = self.kv.ends()
        at = torch.tensor(ends, device=device)  # each row's new slot
        # one slot for every row (the usual case): a plain slice, not an indexed write
        n = len(active)
        slot: tuple[slice | torch.Tensor, slice, int | torch.Tensor] = (
            slice(0, n),
            slice(None),
            ends[0],
        )
        if any(e != ends[0] for e in ends):
            slot = (torch.arange(n, device=device), slice(None), at)
        rows_k, rows_v = self.kv.keys, self.kv.values

        def store_new(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            rows_k[layer][slot] = keys[:, :, 0]  # keys [B, kv_heads, 1, dim]
            rows_v[layer][slot] = values[:, :, 0]

        lengths = at + 1  # + the new token
        longest = max(ends) + 1  # (from the host's list: no wait for the device)

        bias = None if self.kv.bias is None else self.kv.bias[:n, :longest]

        def attend(layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
            shared = [
                SharedKV(
                    node.keys[layer].transpose(0, 1),
                    node.values[layer].transpose(0, 1),
                    rows,
                    node.bias,
                )
                for node, rows in rows_of.items()
            ]
            own_k = rows_k[layer][:n, :, :longest].transpose(1, 2)  # [B, tokens, kv, dim]
            own_v = rows_v[layer][:n, :, :longest].transpose(1, 2)
            own = PrivateKV(own_k, own_v, lengths, bias)
            out = cascade_attention(query[:, :, 0], shared, scale, own)
            return out[:, None]  # [B, 1, heads, head_dim]

        logits, _ = forward(
            self.lm,
            ids,
            positions=positions,
            cache=hook_cache(self.lm, store_new),
            logits_to_keep=1,
            attention_hook=attend,
        )
        for row, request in enumerate(active):
            request.logits = logits[row, -1]
            request.length += 1
            request.position += 1
