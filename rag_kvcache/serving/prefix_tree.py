"""Prefix tree of linked KV, shared by requests whose prompts start with the same chunks.

A path is a sequence of cache IDs (system prompt, then chunks in order). A node holds the
*linked* KV of a run of chunks given everything before it: keys at their final positions,
boundary tokens already recomputed (LegoLink's recomputation depends on what precedes a chunk,
so the same chunk after different prefixes is a different node). Edges carry runs of chunks
(a radix tree): inserting a path that leaves a run in its middle splits the node there.

A request holds a reference to its path (by its deepest node: `acquire(leaf)` counts every node
up to the root) while it decodes; eviction removes only unreferenced leaves, least recently used
first, until the tree fits its byte budget. Splitting keeps the lower part as the same object,
so a request's deepest node stays valid and `path_to(leaf)` always gives its current nodes.

A node keeps one tensor per layer, so that its KV can move layer by layer (the batch decoder
lays a node used by one request inside that request's row of the batch buffer, see
`batch_kv.py`) without ever holding two copies of every layer at once. Where a node's KV lives
is recorded, not inferred: `held_by` names the batch whose rows hold it (None: its own
tensors). The tree's byte count is kept as nodes come and go, never summed by a walk.
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(eq=False)
class TreeNode:
    """A run of chunks' linked KV: keys / values per layer, each [kv_heads, tokens, head_dim]."""

    cache_ids: tuple[str, ...]
    sizes: tuple[int, ...]  # tokens of each chunk in the run
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int  # position of the run's first token
    parent: TreeNode | None
    children: dict[str, TreeNode] = field(default_factory=dict)  # by first cache ID
    refs: int = 0
    last_used: int = 0
    held_by: object | None = None  # the BatchKV whose rows hold this KV; None: its own tensors
    # added to every score on each of its tokens [tokens] (APE's scale: log S on the tokens
    # its strategy left stale, 0 on the rest); None: no bias
    bias: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return sum(self.sizes)

    @property
    def end(self) -> int:
        return self.start + self.tokens

    @property
    def nbytes(self) -> int:
        return 2 * sum(k.numel() * k.element_size() for k in self.keys)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as [layers, kv_heads, tokens, head_dim] (a copy)."""
        return torch.stack(self.keys), torch.stack(self.values)


@dataclass(frozen=True)
class Match:
    """The longest stored prefix of a path: its nodes (root side first) and coverage."""

    nodes: tuple[TreeNode, ...]
    chunks: int  # how many of the path's cache IDs are covered
    tokens: int  # how many tokens they hold


class Rows(Protocol):
    """A batch's rows of KV (`BatchKV`), counted under the tree's budget."""

    @property
    def nbytes(self) -> int: ...

    @property
    def inlined_nbytes(self) -> int: ...


class PrefixTree:
    """Linked prefixes, and the rows of the batches decoding over them, under one byte budget
    (`budget_bytes`: all the KV of the serving path). Not thread-safe: one scheduler owns it."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.roots: dict[str, TreeNode] = {}
        self.batches: weakref.WeakSet[Rows] = weakref.WeakSet()  # whose rows share the budget
        self._clock = itertools.count(1)
        self._nbytes = 0  # every node's KV, kept as nodes are added and dropped

    # ------------------------------------------------------------------ lookups

    def match(self, path: Sequence[str]) -> Match:
        """The longest prefix of `path` stored, splitting a node where the path leaves it
        mid-run so that the match ends on a node boundary."""
        nodes: list[TreeNode] = []
        children, i = self.roots, 0
        while i < len(path) and path[i] in children:
            node = children[path[i]]
            run = len(node.cache_ids)
            same = 0
            while same < run and i + same < len(path) and node.cache_ids[same] == path[i + same]:
                same += 1
            if same < run:
                node = self.split(node, same)
            node.last_used = next(self._clock)
            nodes.append(node)
            i += same
            if same < run:
                break
            children = node.children
        tokens = nodes[-1].end if nodes else 0
        return Match(tuple(nodes), i, tokens)

    def nodes(self) -> list[TreeNode]:
        out, todo = [], list(self.roots.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def idle_nbytes(self) -> int:
        """Bytes `evict` could free: every node no request holds (a node's references count
        its whole subtree's, so an unreferenced node heads an unreferenced subtree). A walk:
        for admission under pressure, not for every step."""
        return sum(node.nbytes for node in self.nodes() if node.refs == 0)

    def rows_nbytes(self, besides: Rows | None = None) -> int:
        """Bytes of the batches' rows (all but `besides`) that are not the tree's nodes
        (inlined nodes count once, as nodes)."""
        return sum(b.nbytes - b.inlined_nbytes for b in self.batches if b is not besides)

    def in_use(self) -> int:
        """All the KV under the budget: the nodes, and the batches' rows beyond them."""
        return self._nbytes + self.rows_nbytes()

    # ------------------------------------------------------------------ changes

    def insert(
        self,
        parent: TreeNode | None,
        cache_ids: Sequence[str],
        sizes: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
    ) -> TreeNode:
        """Add a run of chunks (their linked KV per layer, [kv_heads, tokens, head_dim] each,
        or one [layers, ...] tensor; the score bias on its tokens, if any) under `parent`
        (None: a root). The node keeps the tensors given, not copies."""
        siblings = self.roots if parent is None else parent.children
        if cache_ids[0] in siblings:
            raise ValueError(f"a child starting with {cache_ids[0]} exists: match() first")
        if keys[0].shape[1] != sum(sizes):
            raise ValueError(f"{keys[0].shape[1]} tokens of KV for chunks of {sum(sizes)} tokens")
        start = parent.end if parent is not None else 0
        if bias is not None and len(bias) != sum(sizes):
            raise ValueError(f"a bias on {len(bias)} tokens for chunks of {sum(sizes)} tokens")
        node = TreeNode(tuple(cache_ids), tuple(sizes), list(keys), list(values), start, parent)
        node.bias = bias
        node.last_used = next(self._clock)
        siblings[cache_ids[0]] = node
        self._nbytes += node.nbytes
        return node

    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut a node's run after `at` chunks; returns the upper part (same references)."""
        if not 0 < at < len(node.cache_ids):
            raise ValueError(f"cannot split a run of {len(node.cache_ids)} chunks at {at}")
        cut = sum(node.sizes[:at])
        upper = TreeNode(
            node.cache_ids[:at],
            node.sizes[:at],
            [k[:, :cut].clone() for k in node.keys],
            [v[:, :cut].clone() for v in node.values],
            node.start,
            node.parent,
            refs=node.refs,
            last_used=node.last_used,
            bias=None if node.bias is None else node.bias[:cut].clone(),
        )
        siblings = self.roots if node.parent is None else node.parent.children
        siblings[upper.cache_ids[0]] = upper
        node.cache_ids, node.sizes = node.cache_ids[at:], node.sizes[at:]
        node.keys = [k[:, cut:].clone() for k in node.keys]
        node.values = [v[:, cut:].clone() for v in node.values]
        node.bias = None if node.bias is None else node.bias[cut:].clone()
        node.start, node.parent = node.start + cut, upper
        node.held_by = None  # both parts are copies of their own now, wherever it lived
        upper.children = {node.cache_ids[0]: node}
        return upper

    def acquire(self, leaf: TreeNode) -> None:
        """A request now uses the path ending at `leaf` (every node up to a root)."""
        for node in path_to(leaf):
            node.refs += 1
            node.last_used = next(self._clock)

    def release(self, leaf: TreeNode) -> None:
        for node in path_to(leaf):
            if node.refs <= 0:
                raise ValueError("released a node that holds no reference")
            node.refs -= 1

    def evict(self, need_bytes: int = 0) -> int:
        """Drop unreferenced leaves, least recently used first, until the tree plus
        `need_bytes` fits the budget (or nothing more can go). Returns bytes freed.

        One walk finds the leaves, a heap orders them; a parent left childless and
        unreferenced joins the heap: O(n log n), not a walk per victim."""
        if self._nbytes + need_bytes <= self.budget_bytes:
            return 0
        order = itertools.count()  # ties never compare nodes
        heap = [(n.last_used, next(order), n) for n in self.nodes() if _evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while self._nbytes + need_bytes > self.budget_bytes and heap:
            victim = heapq.heappop(heap)[2]
            siblings = self.roots if victim.parent is None else victim.parent.children
            del siblings[victim.cache_ids[0]]
            victim.held_by = None  # nobody's: a batch's rows that held it need not copy it out
            freed += victim.nbytes
            self._nbytes -= victim.nbytes
            parent = victim.parent
            if parent is not None and _evictable(parent):
                heapq.heappush(heap, (parent.last_used, next(order), parent))
        return freed

    def clear(self) -> int:
        """Drop every node no request holds; returns bytes freed."""
        return self.evict(self.budget_bytes + 1)  # more than the budget: nothing fits


def _evictable(node: TreeNode) -> bool:
    return not node.children and node.refs == 0


def nodes_bias(nodes: Sequence[TreeNode]) -> torch.Tensor | None:
    """The score bias on the keys of a run of nodes, end to end (0 where a node has none);
    None if none has one."""
    biased = [n.bias for n in nodes if n.bias is not None]
    if not biased:
        return None
    return torch.cat([biased[0].new_zeros(n.tokens) if n.bias is None else n.bias for n in nodes])


def path_to(leaf: TreeNode | None) -> list[TreeNode]:
    """The nodes from a root down to `leaf`."""
    path = []
    while leaf is not None:
        path.append(leaf)
        leaf = leaf.parent
    return path[::-1]
