"""Batched generation over shared linked prefixes (ChunkAttention-style).

Requests are linked against the prefix tree: the longest linked prefix already there is reused
as is, only the remaining chunks are linked (given it) and added to the tree, and the request
keeps just its question and generated tokens privately. All active requests then decode
together: one forward per step for the whole batch, where each layer's attention runs in two
phases (`cascade_attention`): every tree node once for all requests passing through it, then
each request's own tokens, merged by log-sum-exp. Requests leave the batch when done and
waiting ones join between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rag_kvcache.cascade import cascade_attention
from rag_kvcache.config import GenerationConfig
from rag_kvcache.decoding import next_token
from rag_kvcache.kv import ChunkKV
from rag_kvcache.linker import LinkedPrefix, link, linked_span
from rag_kvcache.model import LoadedModel, forward, hook_cache
from rag_kvcache.prefix_tree import PrefixTree, TreeNode, path_to


@dataclass(frozen=True)
class BatchRequest:
    query: str
    cache_ids: tuple[str, ...]
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class BatchAnswer:
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    reused_tokens: int  # context tokens taken from the prefix tree, already linked
    recomputed_tokens: int
    ttft_s: float  # from the start of generate_batch to this request's first token


@dataclass(frozen=True)
class BatchStats:
    steps: int  # batched decode forwards
    decode_tokens: int  # tokens produced by them
    decode_s: float
    peak_kv_bytes: int  # prefix tree + private question / answer KV, at the fullest


@dataclass(eq=False)
class _Active:
    """One request while it decodes: its tree path and its private KV (question + answer)."""

    index: int
    leaf: TreeNode  # deepest node of its path in the tree
    keys: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    values: torch.Tensor
    length: int  # filled part of keys / values
    capacity: int  # its question + max_new_tokens (its view of a packed buffer may be longer)
    position: int  # position of the next token
    prompt_tokens: int
    reused: int
    recomputed: int
    config: GenerationConfig
    generator: torch.Generator
    logits: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0


class BatchDecoder:
    """Admits requests, shares their linked prefixes in `tree`, decodes them together."""

    def __init__(
        self,
        lm: LoadedModel,
        tree: PrefixTree,
        strategy: str,
        fetch: Callable[[list[str]], list[ChunkKV]],
    ):
        self.lm, self.tree, self.strategy, self.fetch = lm, tree, strategy, fetch
        # the active requests' private KV side by side, [layers, B, kv_heads, capacity, dim]:
        # each request's keys / values are views of its row, so a step writes every row's new
        # token in one op and attends to the rows without stacking them; repacked only when
        # the batch changes
        self._packed: list[_Active] = []
        self._keys = self._values = torch.empty(0)

    def run(
        self,
        requests: list[tuple[list[str], list[int], GenerationConfig]],
        max_batch: int = 32,
    ) -> tuple[list[_Active], BatchStats]:
        """requests: (path of cache IDs, question ids, generation config) each."""
        start = time.perf_counter()
        waiting = list(enumerate(requests))
        active: list[_Active] = []
        done: list[_Active] = []
        steps = decode_tokens = peak = 0
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
            # the tree and the batch's packed private KV (one buffer for every active request)
            peak = max(peak, self.tree.nbytes + 2 * self._keys.numel() * self._keys.element_size())
            steps, decode_tokens = steps + 1, decode_tokens + len(active)
            still: list[_Active] = []
            for request in active:
                if self.choose(request):
                    still.append(request)
                else:
                    self.finish(request, done)
            active = still
        self._packed, self._keys, self._values = [], torch.empty(0), torch.empty(0)
        done.sort(key=lambda a: a.index)
        return done, BatchStats(steps, decode_tokens, decode_s, peak)

    def admit(
        self, index: int, path: list[str], question: list[int], config: GenerationConfig
    ) -> _Active:
        """Link the request over the longest shared prefix; add its new chunks to the tree."""
        chunks = self.fetch(path)
        found = self.tree.match(path)
        prefix = None
        if found.nodes:
            prefix = LinkedPrefix(
                torch.cat([n.keys for n in found.nodes], dim=2),
                torch.cat([n.values for n in found.nodes], dim=2),
                tuple(t for c in chunks[: found.chunks] for t in c.token_ids),
            )
        rest = chunks[found.chunks :]
        linked = link(self.lm, rest, question, self.strategy, prefix=prefix)
        leaf = found.nodes[-1] if found.nodes else None
        if rest:
            keys, values = linked_span(linked, found.tokens, linked.context_tokens)
            if leaf is not None:
                self.tree.acquire(leaf)  # making room must not evict the path we extend
            self.tree.evict(2 * keys.numel() * keys.element_size())
            sizes = [c.num_tokens for c in rest]
            parent, leaf = (
                leaf,
                self.tree.insert(leaf, [c.cache_id for c in rest], sizes, keys, values),
            )
            if parent is not None:
                self.tree.release(parent)
        assert leaf is not None
        self.tree.acquire(leaf)
        q = len(question)
        keys, values = linked_span(linked, linked.context_tokens, linked.length)  # a copy
        return _Active(
            index=index,
            leaf=leaf,
            keys=keys,  # the question's; `pack` gives it room for the answer
            values=values,
            length=q,
            capacity=q + config.max_new_tokens,
            position=linked.length,
            prompt_tokens=linked.length,
            reused=found.tokens,
            recomputed=linked.recomputed,
            config=config,
            generator=torch.Generator().manual_seed(config.seed),
            logits=linked.next_logits,
        )

    def choose(self, request: _Active) -> bool:
        """Pick the request's next token from its logits; False once it is finished (the
        same stopping rules as `decoding.decode`)."""
        token = next_token(request.logits, request.config, request.generator)
        request.tokens.append(token)
        return not (
            token in self.lm.eos_ids
            or len(request.tokens) >= request.config.max_new_tokens
            or request.position >= self.lm.max_context
        )

    def finish(self, request: _Active, done: list[_Active]) -> None:
        self.tree.release(request.leaf)
        request.keys = request.values = torch.empty(0)
        done.append(request)

    def pack(self, active: list[_Active]) -> None:
        """Lay the active requests' private KV side by side (see __init__), if the batch
        changed since the last step."""
        if len(active) == len(self._packed) and all(
            a is b for a, b in zip(active, self._packed, strict=True)
        ):
            return
        first = active[0].keys
        capacity = max(a.capacity for a in active)
        shape = (first.shape[0], len(active), first.shape[1], capacity, first.shape[3])
        # zeros, not empty: the batch reads past a request's length (masked, but 0 * NaN = NaN)
        keys = first.new_zeros(shape)
        values = torch.zeros_like(keys)
        for row, a in enumerate(active):
            keys[:, row, :, : a.length] = a.keys[:, :, : a.length]
            values[:, row, :, : a.length] = a.values[:, :, : a.length]
            a.keys, a.values = keys[:, row], values[:, row]
        self._packed, self._keys, self._values = list(active), keys, values

    def step(self, active: list[_Active]) -> None:
        """One batched forward: every active request's last token at its own position."""
        device = self.lm.device
        self.pack(active)
        ids = torch.tensor([[a.tokens[-1]] for a in active], device=device)
        positions = torch.tensor([[a.position] for a in active], device=device)
        rows_of: dict[TreeNode, list[int]] = {}
        for row, request in enumerate(active):
            for node in path_to(request.leaf):
                rows_of.setdefault(node, []).append(row)
        every_row = torch.arange(len(active), device=device)
        at = torch.tensor([a.length for a in active], device=device)  # each row's new slot

        def store_new(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            self._keys[layer, every_row, :, at] = keys[:, :, 0]  # keys [B, kv_heads, 1, dim]
            self._values[layer, every_row, :, at] = values[:, :, 0]

        lengths = at + 1  # + the new token
        longest = int(lengths.max())

        def attend(layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
            shared = [
                (node.keys[layer].transpose(0, 1), node.values[layer].transpose(0, 1), rows)
                for node, rows in rows_of.items()
            ]
            own_k = self._keys[layer, :, :, :longest].transpose(1, 2)  # [B, tokens, kv, dim]
            own_v = self._values[layer, :, :, :longest].transpose(1, 2)
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
