"""The decoding batch's own KV: one row per active request, one buffer per layer.

Decode attention is fastest as one kernel call over a [rows, kv_heads, tokens, head_dim]
buffer: on the CPU a call per request costs about twice as much per row (measured: 148 us for
one row of 1K keys against 71 us a row in a batch of 32). So each active request gets a row
that holds, in order:

1. the prefix-tree nodes that only it uses (*inlined*): the node's KV moves into the row and
   the node keeps a view of it, so it is stored once and read in the same call as
2. the request's own tokens: its question, then the tokens generated so far.

Nodes that several requests use stay where they are and are attended once for all of them
(the first phase of `cascade_attention`). With nothing shared, a step is one attention call
per layer, like a plain padded batch.

The rows are laid out again when the batch changes (a request joins or leaves), one layer at a
time: the layer's new buffer is filled from the old one and the nodes no longer inlined get
their own copy before the old buffer goes, so at most one extra layer is held at once. Laying
out copies the batch's KV once, what transformers' DynamicCache does at every step.

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

from rag_kvcache.serving.prefix_tree import TreeNode, path_to


class Member(Protocol):
    """What the batch needs of a request."""

    leaf: TreeNode | None  # deepest node of its path; None: no path (a plain prefill)
    length: int  # own tokens written so far
    capacity: int  # own tokens it may reach (question + max_new_tokens)
    # own KV per layer ([kv_heads, length, head_dim]) until it has a row; then unused
    own_keys: list[torch.Tensor]
    own_values: list[torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """A row: the inlined nodes (path order), then the request's own tokens from `offset`."""

    inlined: tuple[TreeNode, ...]
    offset: int


class BatchKV:
    """Rows of the active requests' KV; `keys[layer]` / `values[layer]` are
    [rows, kv_heads, capacity, head_dim], zero past each row's end (read, masked)."""

    def __init__(self) -> None:
        self.members: list[Member] = []
        self.paths: list[tuple[TreeNode, ...]] = []  # each member's path when laid out
        self.layouts: list[Layout] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def inlined_nbytes(self) -> int:
        """Bytes of tree nodes whose KV lives in the rows (counted in `nbytes` already)."""
        return sum(
            node.nbytes for lay in self.layouts for node in lay.inlined if node.held_by is self
        )

    def ends(self) -> list[int]:
        """Each row's filled length: its inlined tokens and its own."""
        return [lay.offset + m.length for lay, m in zip(self.layouts, self.members, strict=True)]

    def changed(self, members: Sequence[Member]) -> bool:
        """Whether the batch or a member's path (a split) changed since the last layout."""
        return len(members) != len(self.members) or any(
            a is not b or tuple(path_to(a.leaf)) != path
            for a, b, path in zip(members, self.members, self.paths)
        )

    def pack(self, members: Sequence[Member]) -> int:
        """Give `members` (row order) their rows, if the batch or a member's path (a split)
        changed since the last call; `pack([])` hands every inlined node its own copy back and
        frees the rows. Returns the most bytes held at once, counting the rows (old and new)
        and the nodes moving in or out of them: with the bytes of the tree's nodes outside
        the rows before the call, the peak."""
        if not self.changed(members):
            return self.nbytes
        paths = [tuple(path_to(m.leaf)) for m in members]
        users = Counter(node for path in paths for node in path)
        layouts = []
        for path in paths:
            inlined = tuple(n for n in path if users[n] == 1)
            layouts.append(Layout(inlined, sum(n.tokens for n in inlined)))
        capacity = max((lay.offset + m.capacity for lay, m in zip(layouts, members)), default=0)
        staying = {n for lay in layouts for n in lay.inlined}
        leaving = {n for lay in self.layouts for n in lay.inlined} - staying
        moving_in = {n for n in staying if n.held_by is not self}  # own tensors until now
        old_rows = {
            id(m): (row, lay.offset)
            for row, (m, lay) in enumerate(zip(self.members, self.layouts, strict=True))
        }
        # old rows, or (none yet: every member is new) the first member's own KV
        layers = len(self.keys) or (len(members[0].own_keys) if members else 0)
        held = most = self.nbytes  # the old rows, then the new ones as they fill
        new_keys: list[torch.Tensor] = []
        new_values: list[torch.Tensor] = []
        for layer in range(layers):
            for side, filled in (("keys", new_keys), ("values", new_values)):
                rows = getattr(self, side)
                old = rows[layer] if rows else None
                new, moved_in = self._lay_out(
                    side, layer, members, layouts, capacity, old, old_rows, moving_in
                )
                if new is not None:
                    filled.append(new)
                    held += new.numel() * new.element_size()
                most = max(most, held)
                held -= moved_in  # nodes' own tensors, now in the rows
                for node in leaving:  # their own copy, before the old layer goes
                    kv = getattr(node, side)
                    if node.held_by is self:  # (a node split since has its own already)
                        kv[layer] = kv[layer].clone()
                        held += kv[layer].numel() * kv[layer].element_size()
                most = max(most, held)
                if old is not None:
                    rows[layer] = old.new_empty(0)  # drop the old layer now, not at the end
                    held -= old.numel() * old.element_size()
        for node in leaving:
            if node.held_by is self:
                node.held_by = None
        for node in staying:
            node.held_by = self
        self.members, self.paths, self.layouts = list(members), paths, layouts
        self.keys, self.values = new_keys, new_values
        for m in members:
            m.own_keys, m.own_values = [], []
        return most

    @staticmethod
    def _lay_out(
        side: str,
        layer: int,
        members: Sequence[Member],
        layouts: list[Layout],
        capacity: int,
        old: torch.Tensor | None,
        old_rows: dict[int, tuple[int, int]],
        moving_in: set[TreeNode],
    ) -> tuple[torch.Tensor | None, int]:
        """One layer's new buffer for `side` ("keys" / "values"), with the bytes of node
        tensors it took in that were not in the old rows (the caller counts them freed, as
        the node now points at its place in the new rows)."""
        if not members:
            return None, 0
        moved_in = 0
        # [kv_heads, tokens, head_dim]: an old row, or a new member's own KV (no old rows)
        template = old[0] if old is not None else getattr(members[0], "own_" + side)[layer]
        kv_heads, dim = template.shape[0], template.shape[2]
        new = template.new_zeros(len(members), kv_heads, capacity, dim)
        for row, (m, lay) in enumerate(zip(members, layouts)):
            at = 0
            for node in lay.inlined:
                kv = getattr(node, side)
                new[row, :, at : at + node.tokens] = kv[layer]
                if node in moving_in:
                    moved_in += kv[layer].numel() * kv[layer].element_size()
                kv[layer] = new[row, :, at : at + node.tokens]
                at += node.tokens
            if id(m) in old_rows:
                assert old is not None
                old_row, old_offset = old_rows[id(m)]
                own = old[old_row, :, old_offset : old_offset + m.length]
            else:
                own = getattr(m, "own_" + side)[layer][:, : m.length]
            new[row, :, at : at + m.length] = own
        return new, moved_in
