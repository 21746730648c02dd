"""Batched generation over shared linked prefixes (ChunkAttention-style).

Requests are linked against the prefix tree: the longest linked prefix already there is reused
as is, only the remaining chunks are linked (given it) and added to the tree, and the request
keeps just its question and generated tokens privately. All active requests then decode
together: one forward per step for the whole batch, where each layer's attention runs in two
phases (`cascade_attention`): every tree node once for all requests passing through it, then
each request's own tokens, merged by log-sum-exp. A node only one active request uses is
kept in that request's row of the batch's KV instead (`BatchKV`), so a batch that shares
nothing attends in one call per layer. Requests leave the batch when done and waiting ones
join between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rag_kvcache.config import GenerationConfig
from rag_kvcache.errors import StrategyError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.link.linker import LinkedPrefix, link, linked_layers
from rag_kvcache.model.adapter import forward, hook_cache
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.serving.batch_kv import BatchKV
from rag_kvcache.serving.cascade import cascade_attention
from rag_kvcache.serving.decoding import finished, next_token
from rag_kvcache.serving.prefix_tree import PrefixTree, TreeNode, path_to
from rag_kvcache.strategy import Strategy


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


@dataclass(eq=False)
class _Active:
    """One request while it decodes: its tree path and its own tokens (question + answer),
    whose KV lives in its row of the batch (`BatchKV`) once it has one."""

    index: int
    leaf: TreeNode  # deepest node of its path in the tree
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
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0  # from the start of the run to its first token
    total_s: float = 0.0  # from the start of the run to its last token


class BatchDecoder:
    """Admits requests, shares their linked prefixes in `tree`, decodes them together."""

    def __init__(
        self,
        lm: LoadedModel,
        tree: PrefixTree,
        strategy: Strategy,
        fetch: Callable[[list[str]], list[ChunkKV]],
    ):
        if strategy.uses_ape:
            raise StrategyError(
                f"{strategy}: batched decoding attends through the prefix tree, which does not "
                "carry APE's scale yet; answer these requests one at a time (generate)"
            )
        if strategy.calibrated:
            raise StrategyError(
                f"{strategy}: batched decoding shares linked prefixes through the prefix tree, "
                "which does not keep link tokens yet; answer these requests one at a time "
                "(generate)"
            )
        self.lm, self.tree, self.strategy, self.fetch = lm, tree, strategy, fetch
        self.kv = BatchKV()  # the active requests' rows, laid out again when the batch changes
        self.started = 0.0  # when the current run began
        self.peak_bytes = 0  # prefix tree + rows, at the fullest (moves included)

    def run(
        self,
        requests: list[tuple[list[str], list[int], GenerationConfig]],
        max_batch: int = 32,
    ) -> tuple[list[_Active], BatchStats]:
        """requests: (path of cache IDs, question ids, generation config) each."""
        start = self.started = time.perf_counter()
        waiting = list(enumerate(requests))
        active: list[_Active] = []
        done: list[_Active] = []
        steps = decode_tokens = 0
        decode_s = 0.0
        while waiting or active:
            while waiting and len(active) < max_batch:
                index, (path, question, config) = waiting.pop(0)
                request = self.admit(index, path, question, config)
                request.ttft_s = time.perf_counter() - start
                if self.choose(request):
                    active.append(request)
                else:
                    self.finish(request, done)
            if not active:
                continue
            tick = time.perf_counter()
            self.step(active)
            decode_s += time.perf_counter() - tick
            self.peak_bytes = max(self.peak_bytes, self.tree_nbytes() + self.kv.nbytes)
            steps, decode_tokens = steps + 1, decode_tokens + len(active)
            still: list[_Active] = []
            for request in active:
                if self.choose(request):
                    still.append(request)
                else:
                    self.finish(request, done)
            active = still
        self.pack([])  # inlined nodes get their own copies back; the rows go
        done.sort(key=lambda a: a.index)
        return done, BatchStats(steps, decode_tokens, decode_s, self.peak_bytes)

    def admit(
        self, index: int, path: list[str], question: list[int], config: GenerationConfig
    ) -> _Active:
        """Link the request over the longest shared prefix; add its new chunks to the tree."""
        chunks = self.fetch(path)
        # a chunk recomputed whole (`+top:N`, by its rank in this request) links to other KV
        # than the same chunk left stale: the tree tells the two apart
        in_full = [False, *self.strategy.in_full(len(path) - 1)]
        path = [f"{c}+whole" if full else c for c, full in zip(path, in_full, strict=True)]
        found = self.tree.match(path)
        prefix = None
        if found.nodes:
            layers = range(len(found.nodes[0].keys))
            prefix = LinkedPrefix(
                torch.stack([torch.cat([n.keys[i] for n in found.nodes], dim=1) for i in layers]),
                torch.stack([torch.cat([n.values[i] for n in found.nodes], dim=1) for i in layers]),
                tuple(t for c in chunks[: found.chunks] for t in c.token_ids),
            )
        rest = chunks[found.chunks :]
        flags = in_full[found.chunks :] if prefix else in_full[1:]  # link's: after chunk 0
        linked = link(self.lm, rest, question, self.strategy, prefix=prefix, in_full=flags)
        leaf = found.nodes[-1] if found.nodes else None
        if rest:
            keys, values = linked_layers(linked, found.tokens, linked.context_tokens)
            if leaf is not None:
                self.tree.acquire(leaf)  # making room must not evict the path we extend
            self.tree.evict(2 * sum(k.numel() * k.element_size() for k in keys))
            sizes = [c.num_tokens for c in rest]
            parent, leaf = (
                leaf,
                self.tree.insert(leaf, path[found.chunks :], sizes, keys, values),
            )
            if parent is not None:
                self.tree.release(parent)
        assert leaf is not None
        self.tree.acquire(leaf)
        q = len(question)
        keys, values = linked_layers(linked, linked.context_tokens, linked.length)
        return _Active(
            index=index,
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
            generator=torch.Generator().manual_seed(config.seed),
            logits=linked.next_logits,
        )

    def choose(self, request: _Active) -> bool:
        """Pick the request's next token from its logits; False once it is finished (the
        stop rules of every decode loop, `decoding.finished`)."""
        token = next_token(request.logits, request.config, request.generator)
        request.tokens.append(token)
        return not finished(self.lm, token, len(request.tokens), request.position, request.config)

    def finish(self, request: _Active, done: list[_Active]) -> None:
        request.total_s = time.perf_counter() - self.started
        self.tree.release(request.leaf)
        request.own_keys = request.own_values = []
        done.append(request)

    def pack(self, active: list[_Active]) -> None:
        """Give the active requests their rows (if the batch changed), counting the move."""
        if not self.kv.changed(active):
            return
        outside = self.tree_nbytes()  # before the move: nodes may move in or out of rows
        self.peak_bytes = max(self.peak_bytes, outside + self.kv.pack(active))

    def tree_nbytes(self) -> int:
        """The tree's KV not held in the batch's rows."""
        return self.kv.outside_nbytes(self.tree.nodes())

    def step(self, active: list[_Active]) -> None:
        """One batched forward: every active request's last token at its own position."""
        device = self.lm.device
        self.pack(active)
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
        slot: tuple[slice | torch.Tensor, slice, int | torch.Tensor] = (
            slice(None),
            slice(None),
            ends[0],
        )
        if any(e != ends[0] for e in ends):
            slot = (torch.arange(len(active), device=device), slice(None), at)
        rows_k, rows_v = self.kv.keys, self.kv.values

        def store_new(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            rows_k[layer][slot] = keys[:, :, 0]  # keys [B, kv_heads, 1, dim]
            rows_v[layer][slot] = values[:, :, 0]

        lengths = at + 1  # + the new token
        longest = int(lengths.max())

        def attend(layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
            shared = [
                (node.keys[layer].transpose(0, 1), node.values[layer].transpose(0, 1), rows)
                for node, rows in rows_of.items()
            ]
            own_k = rows_k[layer][:, :, :longest].transpose(1, 2)  # [B, tokens, kv, dim]
            own_v = rows_v[layer][:, :, :longest].transpose(1, 2)
            out = cascade_attention(query[:, :, 0], shared, scale, (own_k, own_v, lengths))
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
