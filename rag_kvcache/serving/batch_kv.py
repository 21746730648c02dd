"""The decoding batch's own KV: one row per active request, one buffer per layer.

Decode attention is fastest as one kernel call over a [rows, kv_heads, tokens, head_dim]
buffer: on the CPU a call per request costs about twice as much per row (measured: 148 us for
one row of 1K keys against 71 us a row in a batch of 32). So each active request gets a row
that holds, in order:

1. the prefix-tree nodes that only it uses (*inlined*): the node's KV moves into the row and
   the node keeps a view of it, so it is stored once and read in the same call as
2. the request's own tokens: its question, then the tokens generated so far.

Nodes that several requests use stay where they are and are attended once for all of them
(the first phase of `cascade_attention`), unless they are short: a node of fewer than
`COPIED_TOKENS` tokens (the system prompt every request starts with) is *copied* into each row
that uses it, since a part attended apart costs a kernel call and a merge in every layer and
step, more than reading a few dozen tokens in every row. With nothing else shared, a step is
then one attention call per layer, like a plain padded batch.

Rows are slots, as a serving engine's KV pool hands out slots: a request keeps its row while it
decodes, and when the batch changes (a request joins or leaves, or the tree splits a node on a
request's path) only the rows whose contents change are written. A joining request takes a
leaving one's row; the last row's request moves into a row left empty, so the active rows stay
0..n-1 and are read as one slice. A join or a leave therefore copies one row's KV, not the
batch's (as the first version did, and as transformers' DynamicCache does at every step). The
buffers are reallocated only to grow (by a quarter more rows when requests join one at a
time: spare rows are the price of not copying the batch at every join; tokens to the longest
row) or to shrink (once half the rows or half the tokens are unused), one layer at a time, so
at most one extra layer is held at once.

Who holds a node's KV is recorded on the node (`TreeNode.held_by`: this batch while its rows
hold it, None once it has its own tensors again, e.g. after the tree split it), so moving in
and out never has to tell tensors apart by their storage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rag_kvcache.serving.prefix_tree import TreeNode, nodes_bias, path_to


class Member(Protocol):
    """What the batch needs of a request."""

    leaf: TreeNode | None  # deepest node of its path; None: no path (a plain prefill)
    length: int  # own tokens written so far
    capacity: int  # own tokens it may reach (question + max_new_tokens)
    # own KV per layer ([kv_heads, length, head_dim]) until it has a row; then unused
    own_keys: list[torch.Tensor]
    own_values: list[torch.Tensor]


# a shared node shorter than this is copied into each row that uses it, not attended apart
COPIED_TOKENS = 64


@dataclass(frozen=True)
class Layout:
    """A row: the inlined nodes (path order), then the request's own tokens from `offset`.
    Of the inlined nodes, `copied` are shared ones the row holds a copy of (the node keeps
    its own tensors); the others have moved into the row."""

    inlined: tuple[TreeNode, ...]
    offset: int
    copied: frozenset[TreeNode] = frozenset()

    @property
    def moved(self) -> tuple[TreeNode, ...]:
        return tuple(node for node in self.inlined if node not in self.copied)


@dataclass(frozen=True)
class RowPlan:
    """What `pack` does, worked out before any KV moves: the new row order (each member's
    path and layout), where a staying member's row was, the buffers' shape, and which rows
    and nodes are written or moved."""

    rows: list[Member]
    paths: list[tuple[TreeNode, ...]]
    layouts: list[Layout]
    old_row: dict[int, int]  # new row -> its member's row before (staying members)
    shape: tuple[int, int]  # rows, tokens
    realloc: bool  # new buffers (every row written)
    written: list[int]  # rows whose contents change
    in_place: set[int]  # written rows whose member stays in the same row
    held: set[TreeNode]  # nodes the rows hold afterwards
    moving_in: set[TreeNode]  # of those, nodes that had their own tensors
    moving_out: set[TreeNode]  # nodes the rows held that get their own copy back


def layouts(paths: Sequence[Sequence[TreeNode]]) -> list[Layout]:
    """Each path's row: its nodes that no other path uses (moved in) and its shared nodes
    shorter than `COPIED_TOKENS` (copied), in path order."""
    users = Counter(node for path in paths for node in path)
    rows = []
    for path in paths:
        own = tuple(n for n in path if users[n] == 1 or n.tokens < COPIED_TOKENS)
        copied = frozenset(n for n in own if users[n] > 1)
        rows.append(Layout(own, sum(n.tokens for n in own), copied))
    return rows


class BatchKV:
    """Rows of the active requests' KV; `keys[layer]` / `values[layer]` are
    [rows, kv_heads, capacity, head_dim], zero past each row's end (read, masked)."""

    def __init__(self) -> None:
        self.members: list[Member] = []
        self.paths: list[tuple[TreeNode, ...]] = []  # each member's path when laid out
        self.layouts: list[Layout] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.bias: torch.Tensor | None = None  # `row_bias`, as the last layout left it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def inlined_nbytes(self) -> int:
        """Bytes of tree nodes whose KV lives in the rows (counted in `nbytes` already)."""
        return sum(
            node.nbytes for lay in self.layouts for node in lay.moved if node.held_by is self
        )

    @property
    def shape(self) -> tuple[int, int]:
        """Rows and tokens the buffers have room for."""
        return (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)

    def shape_for(self, rows: int, tokens: int) -> tuple[int, int]:
        """The buffers' rows and tokens once `rows` requests whose longest row is `tokens`
        long hold them: as now if they fit and at least half is used; grown (rows by a
        quarter when requests join one at a time, tokens to the longest row) or shrunk to
        what is used otherwise."""
        row_cap, token_cap = self.shape
        if not rows:
            return 0, 0
        if rows > row_cap or tokens > token_cap:  # grow
            if self.keys and rows > row_cap:
                return max(rows, -(-5 * row_cap // 4)), tokens
            return rows, tokens
        if 2 * rows <= row_cap or 2 * tokens < token_cap:  # shrink
            return rows, tokens
        return row_cap, token_cap

    def nbytes_for(self, rows: int, tokens: int, bytes_per_token: int) -> int:
        """The buffers' bytes once `rows` requests with a longest row of `tokens` hold them
        (`bytes_per_token`: one token's KV over every layer)."""
        row_cap, token_cap = self.shape_for(rows, tokens)
        return row_cap * token_cap * bytes_per_token

    def ends(self) -> list[int]:
        """Each row's filled length: its inlined tokens and its own."""
        return [lay.offset + m.length for lay, m in zip(self.layouts, self.members, strict=True)]

    def changed(self, members: Sequence[Member]) -> bool:
        """Whether the batch (as a set) or a member's path (a split) changed since the last
        layout."""
        if len(members) != len(self.members):
            return True
        row_of = {id(m): row for row, m in enumerate(self.members)}
        return any(
            id(m) not in row_of or tuple(path_to(m.leaf)) != self.paths[row_of[id(m)]]
            for m in members
        )

    def pack(self, members: Sequence[Member]) -> int:
        """Give `members` (in any order; `self.members` is their row order) their rows, if the
        batch or a member's path (a split) changed since the last call; `pack([])` hands
        every inlined node its own copy back and frees the rows. Returns the most bytes held
        at once, counting the rows (old and new) and the nodes moving in or out of them: with
        the bytes of the tree's nodes outside the rows before the call, the peak."""
        if not self.changed(members):
            return self.nbytes
        plan = self.plan(members)
        most = self.write(plan)
        for node in plan.moving_out:
            node.held_by = None
        for node in plan.held:
            node.held_by = self
        if not plan.rows:
            self.keys, self.values = [], []
        self.members, self.paths, self.layouts = plan.rows, plan.paths, plan.layouts
        self.bias = self.row_bias()
        for m in plan.rows:
            m.own_keys, m.own_values = [], []
        return most

    def row_bias(self) -> torch.Tensor | None:
        """The score bias on every row's keys [rows, tokens]: its inlined nodes' (`TreeNode.
        bias`, APE's scale on stale tokens), 0 on its own tokens and past its end. None when
        no inlined node has one (no bias to add)."""
        inlined = [nodes_bias(lay.inlined) for lay in self.layouts]  # each row's, from 0
        biased = [b for b in inlined if b is not None]
        if not biased:
            return None
        bias = biased[0].new_zeros(self.shape)
        for row, own in enumerate(inlined):
            if own is not None:
                bias[row, : len(own)] = own
        return bias

    def plan(self, members: Sequence[Member]) -> RowPlan:
        """Where each member goes and what must be written (nothing is moved yet).

        Rows are slots: a request keeps its row while it stays, a leaving request's row goes
        to a joining one or to the last row's request (so the rows stay 0..n-1), and only the
        rows whose contents change are written: all of them on a new buffer (`shape_for`),
        else those whose request is new to the row, or stays but whose path or layout
        changed."""
        paths = [tuple(path_to(m.leaf)) for m in members]
        layout_of = {id(m): lay for m, lay in zip(members, layouts(paths), strict=True)}
        path_of = {id(m): path for m, path in zip(members, paths, strict=True)}
        old_row = {id(m): row for row, m in enumerate(self.members)}
        n = len(members)
        order: list[Member | None] = [None] * n  # the new rows
        for m in members:  # a staying request keeps its row where it can
            row = old_row.get(id(m), n)
            if row < n:
                order[row] = m
        free = iter([row for row in range(n) if order[row] is None])
        for m in members:  # joining requests, and those whose row is past the new end
            if old_row.get(id(m), n) >= n:
                order[next(free)] = m
        rows: list[Member] = [m for m in order if m is not None]
        tokens = max((layout_of[id(m)].offset + m.capacity for m in rows), default=0)
        shape = self.shape_for(n, tokens)
        realloc = not rows or shape != self.shape
        same = {
            id(m)
            for row, m in enumerate(rows)
            if old_row.get(id(m)) == row
            and self.paths[row] == path_of[id(m)]
            and self.layouts[row] == layout_of[id(m)]
        }
        written = [row for row, m in enumerate(rows) if realloc or id(m) not in same]
        owner = {node: id(m) for m in rows for node in layout_of[id(m)].moved}
        # A node leaves its place in the rows unless its request keeps it moved in and its
        # old place stays readable until it is written anew (a new buffer, or a row past the
        # new end); the others get their own copy first (a node inlined again is copied back).
        in_place = {id(rows[row]) for row in written if old_row.get(id(rows[row])) == row}
        moving_out = {
            node
            for m, lay in zip(self.members, self.layouts, strict=True)
            for node in lay.moved
            if node.held_by is self
            and not (owner.get(node) == id(m) and (realloc or id(m) not in in_place))
        }
        return RowPlan(
            rows=rows,
            paths=[path_of[id(m)] for m in rows],
            layouts=[layout_of[id(m)] for m in rows],
            old_row={row: old_row[id(m)] for row, m in enumerate(rows) if id(m) in old_row},
            shape=shape,
            realloc=realloc,
            written=written,
            in_place={row for row in written if old_row.get(id(rows[row])) == row},
            held=set(owner),
            moving_in={node for node in owner if node.held_by is not self},
            moving_out=moving_out,
        )

    def write(self, plan: RowPlan) -> int:
        """Carry out `plan` a layer at a time (so at most one layer's buffer is held twice):
        nodes leaving the rows get their own copy, written rows get their inlined nodes and
        their own tokens. Returns the most bytes held at once."""
        rows, written = plan.rows, plan.written
        layers = len(self.keys) or (len(rows[0].own_keys) if rows else 0)
        held = most = self.nbytes
        for layer in range(layers):
            for side in ("keys", "values"):
                buffers: list[torch.Tensor] = getattr(self, side)
                old = buffers[layer] if layer < len(buffers) else None
                for node in plan.moving_out:
                    kv = getattr(node, side)
                    kv[layer] = kv[layer].clone()
                    held += kv[layer].numel() * kv[layer].element_size()
                most = max(most, held)
                if not rows:
                    if old is not None:
                        held -= old.numel() * old.element_size()
                        buffers[layer] = old.new_empty(0)
                    continue
                own = {}  # each written row's own tokens, read before any row is written
                for row in written:
                    m = rows[row]
                    if row in plan.old_row:
                        assert old is not None
                        was = plan.old_row[row]
                        at = self.layouts[was].offset
                        kv = old[was, :, at : at + m.length]
                        own[row] = kv.clone() if row in plan.in_place else kv
                    else:
                        own[row] = getattr(m, "own_" + side)[layer][:, : m.length]
                target = old
                if plan.realloc or old is None:
                    template = old if old is not None else getattr(rows[0], "own_" + side)[layer]
                    kv_heads, dim = template.shape[-3], template.shape[-1]
                    row_cap, token_cap = plan.shape
                    target = template.new_zeros(row_cap, kv_heads, token_cap, dim)
                    held += target.numel() * target.element_size()
                    most = max(most, held)
                assert target is not None
                for row in written:
                    m, at, lay = rows[row], 0, plan.layouts[row]
                    for node in lay.inlined:
                        kv = getattr(node, side)
                        target[row, :, at : at + node.tokens] = kv[layer]
                        if node not in lay.copied:  # moved: the node reads it in the row
                            if node in plan.moving_in or node in plan.moving_out:
                                held -= kv[layer].numel() * kv[layer].element_size()
                            kv[layer] = target[row, :, at : at + node.tokens]
                        at += node.tokens
                    target[row, :, at : at + m.length] = own[row]
                    target[row, :, at + m.length :] = 0
                most = max(most, held)
                if target is not old:
                    if old is not None:
                        held -= old.numel() * old.element_size()
                    if layer < len(buffers):
                        buffers[layer] = target
                    else:
                        buffers.append(target)
        return most
