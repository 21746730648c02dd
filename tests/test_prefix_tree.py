"""The prefix tree of linked KV: match / insert / split / references / eviction invariants."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from rag_kvcache.serving.prefix_tree import PrefixTree, path_to

SIZES = {f"c{i}": 1 + i % 4 for i in range(8)}  # tokens per chunk


def linked_kv(path: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The 'linked' KV of the last chunk of `path` given the ones before it (a stand-in for
    what linking computes: it depends on the whole prefix)."""
    g = torch.Generator().manual_seed(zlib.crc32("/".join(path).encode()))
    shape = (2, 1, SIZES[path[-1]], 2)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def store(tree: PrefixTree, path: tuple[str, ...]):
    """Insert what is missing of `path` as one run; returns the deepest node."""
    found = tree.match(path)
    if found.chunks == len(path):
        return found.nodes[-1]
    rest = path[found.chunks :]
    kvs = [linked_kv(path[: found.chunks + i + 1]) for i in range(len(rest))]
    parent = found.nodes[-1] if found.nodes else None
    keys = torch.cat([k for k, _ in kvs], dim=2)
    values = torch.cat([v for _, v in kvs], dim=2)
    return tree.insert(parent, rest, [SIZES[c] for c in rest], keys, values)


def expected_kv(path: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    kvs = [linked_kv(path[: i + 1]) for i in range(len(path))]
    return torch.cat([k for k, _ in kvs], dim=2), torch.cat([v for _, v in kvs], dim=2)


def test_match_insert_and_split() -> None:
    tree = PrefixTree(budget_bytes=1 << 20)
    leaf = store(tree, ("c0", "c1", "c2", "c3"))
    assert len(tree.nodes()) == 1 and leaf.tokens == 1 + 2 + 3 + 4
    found = tree.match(("c0", "c1", "c5"))  # leaves the run after two chunks: split there
    assert (found.chunks, found.tokens) == (2, 3)
    assert [n.cache_ids for n in path_to(leaf)] == [("c0", "c1"), ("c2", "c3")]
    assert leaf.start == 3 and found.nodes[-1] is leaf.parent
    other = store(tree, ("c0", "c1", "c5"))
    assert other.parent is leaf.parent and other.start == 3
    assert tree.match(("c4",)).chunks == 0 and tree.match(()).nodes == ()
    for path in [("c0", "c1", "c2", "c3"), ("c0", "c1", "c5")]:
        found = tree.match(path)
        assert found.chunks == len(path)
        keys = torch.cat([n.stacked()[0] for n in found.nodes], dim=2)
        torch.testing.assert_close(keys, expected_kv(path)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="exists"):
        tree.insert(None, ["c0"], [1], *linked_kv(("c0",)))


def test_references_protect_paths_from_eviction() -> None:
    tree = PrefixTree(budget_bytes=0)
    busy = store(tree, ("c0", "c1"))
    tree.acquire(busy)
    idle = store(tree, ("c0", "c1", "c2"))  # under busy's node: a leaf, unreferenced
    tree.match(("c0", "c3"))  # splits c0 | c1 while busy holds the path
    assert [n.refs for n in path_to(busy)] == [1, 1]
    freed = tree.evict()
    assert freed == idle.nbytes and tree.match(("c0", "c1", "c2")).chunks == 2
    assert tree.nbytes > tree.budget_bytes  # what is referenced stays, over budget or not
    tree.release(busy)
    tree.evict()
    assert tree.nodes() == [] and tree.nbytes == 0
    with pytest.raises(ValueError, match="no reference"):
        tree.release(busy)


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    node_bytes = 2 * 2 * 1 * 2 * 4  # per token: K and V, 2 layers, 1 head, 2 dims, float32
    tree = PrefixTree(budget_bytes=node_bytes * rng.randint(5, 40))
    held: list = []
    for _ in range(300):
        op = rng.random()
        path = tuple(rng.choice(list(SIZES)) for _ in range(rng.randint(1, 5)))
        if op < 0.5:
            tree.evict(node_bytes * sum(SIZES[c] for c in path))
            leaf = store(tree, path)
            if rng.random() < 0.4:
                tree.acquire(leaf)
                held.append(leaf)
        elif op < 0.7 and held:
            tree.release(held.pop(rng.randrange(len(held))))
        elif op < 0.85:
            tree.evict()
            leaves = [n for n in tree.nodes() if not n.children]
            assert tree.nbytes <= tree.budget_bytes or all(n.refs for n in leaves)
        else:
            tree.match(path)
        # invariants: the byte count kept as nodes come and go is the nodes' sum; every
        # held path is intact; every stored path reconstructs its KV
        assert tree.nbytes == sum(n.nbytes for n in tree.nodes())
        for leaf in held:
            nodes = path_to(leaf)
            assert all(n.refs > 0 for n in nodes)
            assert nodes[0].parent is None and nodes[0] in tree.roots.values()
        for node in tree.nodes():
            path = tuple(c for n in path_to(node) for c in n.cache_ids)
            keys = torch.cat([n.stacked()[0] for n in path_to(node)], dim=2)
            values = torch.cat([n.stacked()[1] for n in path_to(node)], dim=2)
            want_k, want_v = expected_kv(path)
            assert torch.equal(keys, want_k) and torch.equal(values, want_v)
            assert node.start == sum(SIZES[c] for c in path) - node.tokens
            refs_below = sum(1 for leaf in held if node in path_to(leaf))
            assert node.refs == refs_below
