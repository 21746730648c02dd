"""BatchKV: through random joins, leaves and node splits, each row holds exactly its request's
inlined nodes and own tokens, the tree's KV never changes, and nothing is stored twice but the
short shared nodes copied into each row that uses them."""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from helpers import moved_nodes, shares_storage

from rag_kvcache.serving import batch_kv
from rag_kvcache.serving.batch_kv import BatchKV
from rag_kvcache.serving.prefix_tree import PrefixTree, TreeNode, path_to

LAYERS, KV_HEADS, DIM = 3, 2, 4


@dataclass(eq=False)
class Request:
    leaf: TreeNode
    length: int
    capacity: int
    own_keys: list[torch.Tensor]
    own_values: list[torch.Tensor]
    want_keys: torch.Tensor  # [layers, kv_heads, capacity, dim]: what its own tokens hold
    want_values: torch.Tensor


def chunk_kv(path: tuple[str, ...], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The linked KV of the chunk ending `path`: a function of the whole path (as linking is)."""
    g = torch.Generator().manual_seed(zlib.crc32("/".join(path).encode()))
    kv = torch.randn(2, LAYERS, KV_HEADS, size, DIM, generator=g, dtype=torch.float64)
    return kv[0], kv[1]


def expected(node: TreeNode) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [c for n in path_to(node.parent) for c in n.cache_ids]
    parts = []
    for cid, size in zip(node.cache_ids, node.sizes, strict=True):
        ids.append(cid)
        parts.append(chunk_kv(tuple(ids), size))
    return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)


def build_tree(rng: random.Random) -> tuple[PrefixTree, list[list[str]]]:
    """Runs of 1-3 chunks: a system prompt, then branches."""
    tree = PrefixTree(budget_bytes=2**40)
    paths = [["sys"] + [f"c{rng.randrange(4)}" for _ in range(rng.randint(0, 4))] for _ in range(8)]
    for path in paths:
        found = tree.match(path)
        rest = path[found.chunks :]
        if not rest:
            continue
        parent = found.nodes[-1] if found.nodes else None
        sizes = [1 + len(c) % 3 + i % 2 for i, c in enumerate(rest)]
        prefix = tuple(path[: found.chunks])
        kvs = [chunk_kv(prefix + tuple(rest[: i + 1]), s) for i, s in enumerate(sizes)]
        keys = torch.cat([k for k, _ in kvs], dim=2)
        values = torch.cat([v for _, v in kvs], dim=2)
        tree.insert(parent, rest, sizes, [k.clone() for k in keys], [v.clone() for v in values])
    return tree, paths


def new_request(tree: PrefixTree, path: list[str], rng: random.Random) -> Request:
    leaf = tree.match(path).nodes[-1]
    question = rng.randint(1, 3)
    capacity = question + rng.randint(0, 3)
    want_k = torch.randn(LAYERS, KV_HEADS, capacity, DIM, dtype=torch.float64)
    want_v = torch.randn(LAYERS, KV_HEADS, capacity, DIM, dtype=torch.float64)
    own_k = [k[:, :question].clone() for k in want_k]
    own_v = [v[:, :question].clone() for v in want_v]
    return Request(leaf, question, capacity, own_k, own_v, want_k, want_v)


def outside(tree: PrefixTree, batch: BatchKV) -> int:
    """Bytes of the tree's nodes that do not live in the rows, by where their tensors are;
    the records (`held_by`, the tree's kept count) say the same."""
    in_rows = {
        n
        for n in tree.nodes()
        if batch.keys and all(shares_storage(k, r) for k, r in zip(n.keys, batch.keys))
    }
    for node in tree.nodes():
        assert (node.held_by is batch) == (node in in_rows), node.cache_ids
    outside = sum(n.nbytes for n in tree.nodes() if n not in in_rows)
    assert tree.nbytes - batch.inlined_nbytes == outside
    return outside


def check(batch: BatchKV, tree: PrefixTree, members: list[Request]) -> None:
    users: dict[TreeNode, int] = {}
    for m in members:
        for node in path_to(m.leaf):
            users[node] = users.get(node, 0) + 1
    for node in tree.nodes():  # the tree's KV is intact, wherever it lives
        want_k, want_v = expected(node)
        assert torch.equal(torch.stack(node.keys), want_k)
        assert torch.equal(torch.stack(node.values), want_v)
    assert sorted(map(id, batch.members)) == sorted(map(id, members))  # rows: any order
    rows = batch.members
    assert batch.ends() == [lay.offset + m.length for lay, m in zip(batch.layouts, rows)]
    short = batch_kv.COPIED_TOKENS
    for row, (m, layout) in enumerate(zip(rows, batch.layouts, strict=True)):
        # inlined: exactly the nodes of its path that no other active request uses (moved
        # in), and the short ones that others use too (copied)
        path = path_to(m.leaf)
        assert layout.inlined == tuple(n for n in path if users[n] == 1 or n.tokens < short)
        assert layout.copied == {n for n in layout.inlined if users[n] > 1}
        for layer in range(LAYERS):
            for rows, side, want in (
                (batch.keys, "keys", m.want_keys),
                (batch.values, "values", m.want_values),
            ):
                at = 0
                for node in layout.inlined:
                    kv = getattr(node, side)[layer]
                    # moved: stored once, in the row; copied: the node keeps its own
                    assert shares_storage(kv, rows[layer]) == (node not in layout.copied)
                    assert torch.equal(rows[layer][row, :, at : at + node.tokens], kv)
                    at += node.tokens
                assert at == layout.offset
                own = rows[layer][row, :, at : at + m.length]
                assert torch.equal(own, want[layer][:, : m.length])
                assert not rows[layer][row, :, at + m.length :].any()  # zero past its end
    moved = moved_nodes(batch)
    for node in tree.nodes():
        if node not in moved:
            assert all(not shares_storage(k, r) for k in node.keys for r in batch.keys)


# never copied (every shared node attended apart), and copied where shorter than 3 tokens
@pytest.fixture(params=[0, 3], ids=["none-copied", "short-copied"])
def copied_tokens(request, monkeypatch) -> int:
    monkeypatch.setattr(batch_kv, "COPIED_TOKENS", request.param)
    return request.param


def test_rows_follow_joins_leaves_and_splits(copied_tokens: int) -> None:
    rng = random.Random(7)
    copies = 0
    turned: Counter[tuple[bool, bool]] = Counter()  # (copied before, copied after) per node
    splits = split_held = 0
    for _ in range(5):
        tree, paths = build_tree(rng)
        batch = BatchKV()
        members: list[Request] = []
        for _ in range(12):
            members = [m for m in members if rng.random() > 0.3]  # some leave
            if rng.random() < 0.5:  # a path leaving a run midway splits its node
                # (often one of an active request's path: a node the rows may hold)
                active = [[c for n in path_to(m.leaf) for c in n.cache_ids] for m in members]
                victim = rng.choice(active if active and rng.random() < 0.7 else paths)
                held = {n for n in tree.nodes() if n.held_by is batch}
                before = len(tree.nodes())
                tree.match([*victim[: rng.randint(1, len(victim))], "elsewhere"])
                splits += len(tree.nodes()) - before
                split_held += sum(n.held_by is None for n in held)
            for _ in range(rng.randint(0, 3)):  # some join
                members.append(new_request(tree, rng.choice(paths), rng))
            if not members:
                continue
            was = {n: n in lay.copied for lay in batch.layouts for n in lay.inlined}
            before = outside(tree, batch) + batch.nbytes
            moved = outside(tree, batch) + batch.pack(members)  # the peak while moving
            now = {n: n in lay.copied for lay in batch.layouts for n in lay.inlined}
            for node in was.keys() & now.keys():  # moved -> copied, copied -> moved
                turned[was[node], now[node]] += 1
            assert moved >= max(before, outside(tree, batch) + batch.nbytes)
            rows = batch.keys
            assert batch.pack(members) == batch.nbytes  # the same batch: nothing moves
            assert batch.keys is rows
            check(batch, tree, members)
            copies += sum(len(lay.copied) for lay in batch.layouts)
            for row, m in enumerate(batch.members):  # a decode step writes one token each
                if m.length < m.capacity:
                    at = batch.ends()[row]
                    for layer in range(LAYERS):
                        batch.keys[layer][row, :, at] = m.want_keys[layer][:, m.length]
                        batch.values[layer][row, :, at] = m.want_values[layer][:, m.length]
                    m.length += 1
            check(batch, tree, members)
        batch.pack([])  # the end of a run: every node owns its KV again, the rows are gone
        assert batch.keys == [] and batch.nbytes == 0
        for node in tree.nodes():
            for k in (*node.keys, *node.values):
                assert k.untyped_storage().nbytes() == k.numel() * k.element_size()
            want_k, _ = expected(node)
            assert torch.equal(torch.stack(node.keys), want_k)
    assert splits > 0 and split_held > 0  # splits did happen, some to nodes held in rows
    assert (copies > 0) == (copied_tokens > 0)  # and short shared nodes were copied
    if copied_tokens:  # nodes went both ways: moved in, then shared (copied), and back
        assert turned[False, True] > 0 and turned[True, False] > 0, turned


def test_a_join_or_leave_writes_only_the_rows_that_change() -> None:
    """Rows are slots: a request that stays keeps its row and its row is not written again;
    a leaving request's row goes to a joining one, or to the last row's request (the rows stay
    0..n-1); the buffers are the same tensors until the batch outgrows them or shrinks to a
    quarter. A mark past a row's end shows whether the row was written (writing zeroes it)."""
    rng = random.Random(3)
    tree = PrefixTree(budget_bytes=2**40)
    paths = [["sys", f"d{i}"] for i in range(6)]  # nothing shared but the system prompt
    for path in paths:
        found = tree.match(path)
        rest, prefix = path[found.chunks :], tuple(path[: found.chunks])
        kvs = [chunk_kv(prefix + tuple(rest[: i + 1]), 2) for i in range(len(rest))]
        keys = torch.cat([k for k, _ in kvs], dim=2)
        values = torch.cat([v for _, v in kvs], dim=2)
        parent = found.nodes[-1] if found.nodes else None
        tree.insert(parent, rest, [2] * len(rest), list(keys.clone()), list(values.clone()))

    def roomy(path: list[str]) -> Request:  # room for a token past its end
        while (request := new_request(tree, path, rng)).capacity == request.length:
            pass
        return request

    batch = BatchKV()
    members = [roomy(paths[i]) for i in range(4)]
    batch.pack(members)
    check(batch, tree, members)
    buffers = list(batch.keys)

    def mark() -> None:
        for row, end in enumerate(batch.ends()):
            batch.keys[0][row, 0, end, 0] = 7.0

    def marked() -> list[bool]:
        flags = [bool(batch.keys[0][row, 0, end, 0] == 7.0) for row, end in enumerate(batch.ends())]
        for row, end in enumerate(batch.ends()):
            batch.keys[0][row, 0, end, 0] = 0.0
        return flags

    # the request in row 1 leaves, one joins: it takes row 1, the others are not written
    mark()
    joined = roomy(paths[4])
    members = [members[0], members[2], members[3], joined]
    batch.pack(members)
    assert [batch.members.index(m) for m in members] == [0, 2, 3, 1]
    assert marked() == [True, False, True, True]
    assert all(a is b for a, b in zip(batch.keys, buffers))  # no new buffer
    check(batch, tree, members)

    # the request in row 0 leaves: the last row's request moves into row 0
    mark()
    members = members[1:]
    last = batch.members[-1]
    batch.pack(members)
    assert batch.members[0] is last and len(batch.members) == 3
    assert marked() == [False, True, True]
    assert all(a is b for a, b in zip(batch.keys, buffers))
    check(batch, tree, members)

    # down to two rows: half of them unused, so the buffers shrink to what is used
    members = members[:2]
    batch.pack(members)
    assert batch.keys[0].shape[0] == 2 and batch.keys[0] is not buffers[0]
    check(batch, tree, members)
    # requests joining one at a time: a quarter more rows (at least one) when full
    for path, rows in [(paths[5], 3), (paths[0], 4), (paths[1], 5)]:
        members.append(roomy(path))
        batch.pack(members)
        assert batch.keys[0].shape[0] == rows
        check(batch, tree, members)
