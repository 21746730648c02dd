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
            peak = max(peak, self.tree.nbytes + sum(_nbytes(a) for a in active))
            if not active:
                continue
            tick = time.perf_counter()
            self.step(active)
            decode_s += time.perf_counter() - tick
            steps, decode_tokens = steps + 1, decode_tokens + len(active)
            still: list[_Active] = []
            for request in active:
                if self.choose(request):
                    still.append(request)
                else:
                    self.finish(request, done)
            active = still
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
        own_k, own_v = linked_span(linked, linked.context_tokens, linked.length)
        capacity = q + config.max_new_tokens
        # zeros, not empty: the batch reads past a request's length (masked, but 0 * NaN = NaN)
        keys = own_k.new_zeros(*own_k.shape[:2], capacity, own_k.shape[-1])
        values = torch.zeros_like(keys)
        keys[:, :, :q], values[:, :, :q] = own_k, own_v
        return _Active(
            index=index,
            leaf=leaf,
            keys=keys,
            values=values,
            length=q,
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

    def step(self, active: list[_Active]) -> None:
        """One batched forward: every active request's last token at its own position."""
        device = self.lm.device
        ids = torch.tensor([[a.tokens[-1]] for a in active], device=device)
        positions = torch.tensor([[a.position] for a in active], device=device)
        rows_of: dict[TreeNode, list[int]] = {}
        for row, request in enumerate(active):
            for node in path_to(request.leaf):
                rows_of.setdefault(node, []).append(row)

        def store_new(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            for row, request in enumerate(active):  # keys [B, kv_heads, 1, head_dim]
                request.keys[layer, :, request.length] = keys[row, :, 0]
                request.values[layer, :, request.length] = values[row, :, 0]

        lengths = torch.tensor([a.length + 1 for a in active], device=device)  # + new token
        longest = int(lengths.max())

        def attend(layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
            shared = [
                (node.keys[layer].transpose(0, 1), node.values[layer].transpose(0, 1), rows)
                for node, rows in rows_of.items()
            ]
            own_k = torch.stack([_padded(a.keys[layer], longest) for a in active]).transpose(1, 2)
            own_v = torch.stack([_padded(a.values[layer], longest) for a in active]).transpose(1, 2)
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


def _nbytes(request: _Active) -> int:
    return 2 * request.keys.numel() * request.keys.element_size()


def _padded(kv: torch.Tensor, tokens: int) -> torch.Tensor:
    """kv [kv_heads, capacity, head_dim] cut or zero-padded to `tokens` positions."""
    if kv.shape[1] >= tokens:
        return kv[:, :tokens]
    return torch.nn.functional.pad(kv, (0, 0, 0, tokens - kv.shape[1]))
