"""The arithmetic count (`model.arithmetic`) against counts made by hand from the model's shapes."""

import torch
from helpers import random_chunks

from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.link.selection import select_positions
from rag_kvcache.model.arithmetic import Arithmetic, count_attention, counted, visible_causal
from rag_kvcache.serving.decoding import prefill
from rag_kvcache.strategy import Strategy

# the tiny Llama of `helpers.tiny_config`: width 64, MLP 128, 3 layers, 4 heads of 16, 2 KV heads
LAYERS, HEADS, HEAD_DIM = 3, 4, 16
LAYER_WEIGHTS = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)  # q, k and v, o, the MLP
PER_PAIR = 2 * (HEAD_DIM + HEAD_DIM) * HEADS * LAYERS  # a (row, key) pair in every head, layer


def _head(lm) -> int:  # one row of logits
    return 2 * 64 * lm.model.config.vocab_size


def test_a_prefill_counts_its_rows_causal_pairs_and_one_row_of_logits(tiny64) -> None:
    tokens = random_chunks([37])[0]
    with counted(tiny64.model) as work:
        prefill(tiny64, tokens)
    assert work == Arithmetic(
        linear=2 * 37 * LAYER_WEIGHTS * LAYERS,
        attention=PER_PAIR * 37 * 38 // 2,
        head=_head(tiny64),
    )
    assert work.total == work.linear + work.attention + work.head


def test_a_link_counts_only_its_new_rows_each_over_the_positions_it_sees(tiny64) -> None:
    lengths = [6, 11, 4, 9]  # the system prefix, then three documents
    chunks = encode_chunks(tiny64, random_chunks(lengths, seed=5))
    query = [7, 8, 9, 10, 11]
    strategy = Strategy.parse("legolink:2")
    recomputed = select_positions(strategy, lengths).tolist()  # each document's first two
    assert recomputed == [6, 7, 17, 18, 21, 22]
    new = recomputed + list(range(30, 35))  # the query after the 30 context tokens
    with counted(tiny64.model) as work:
        link(tiny64, chunks, query, strategy)
    # a new token at position p sees positions 0..p (its stale copy overwritten first)
    assert work == Arithmetic(
        linear=2 * len(new) * LAYER_WEIGHTS * LAYERS,
        attention=PER_PAIR * sum(p + 1 for p in new),
        head=_head(tiny64),
    )
    with counted(tiny64.model) as ape:  # APE's tempering biases scores, hides no key
        link(tiny64, chunks, query, Strategy.parse("legolink:2+ape:0.7,0.5"))
    assert ape == work
    with counted(tiny64.model) as naive:
        link(tiny64, chunks, query, Strategy.parse("naive"))
    assert naive.attention == PER_PAIR * sum(p + 1 for p in range(30, 35))
    with counted(tiny64.model) as full:  # every token recomputed: a prefill's arithmetic
        link(tiny64, chunks, query, Strategy.parse("full"))
    with counted(tiny64.model) as plain:
        prefill(tiny64, [t for c in chunks for t in c.token_ids] + query)
    assert full == plain


def test_masks_count_what_they_let_each_row_see_in_every_head_and_batch() -> None:
    query, key = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 5, 8)
    value = torch.zeros(2, 2, 5, 6)
    allowed = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    additive = torch.zeros(3, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with counted(torch.nn.Module()) as work:  # no linear maps: attention alone
        count_attention(query, key, value, allowed[None, None])  # broadcast over batch, heads
        assert work.attention == 2 * 4 * 9 * 2 * (8 + 6)
        count_attention(query, key, value, additive[None, None].expand(2, 1, 3, 5))
        assert work.attention == 2 * (2 * 4 * 9 * 2 * (8 + 6))
        count_attention(query, key, value, None)  # causal: 3 new rows after 2 cached keys
        assert visible_causal(3, 5) == 3 + 4 + 5
        assert work.attention == 2 * (2 * 4 * 9 * 2 * (8 + 6)) + 2 * 4 * 12 * 2 * (8 + 6)
        per_head = torch.zeros(1, 4, 3, 5, dtype=torch.bool)
        per_head[:, 1, 0, :2] = True  # one head's first row sees two keys
        count_attention(query, key, value, per_head)
        assert work.attention == 2 * (2 * 4 * 9 * 2 * (8 + 6)) + 2 * 4 * 12 * 2 * (8 + 6) + (
            2 * 2 * 2 * (8 + 6)
        )
        rows_alike = allowed[2:, :][None, None]  # [1, 1, 1, 5]: every row sees every key
        before = work.attention
        count_attention(query, key, value, rows_alike)
        assert work.attention - before == 2 * 4 * 3 * 5 * 2 * (8 + 6)
    count_attention(query, key, value, None)  # no count active: nothing to add to
    assert work.total == work.attention


def test_counting_leaves_nothing_behind(tiny64) -> None:
    linears = [m for m in tiny64.model.modules() if isinstance(m, torch.nn.Linear)]
    with counted(tiny64.model) as outer:
        with counted(tiny64.model) as inner:
            prefill(tiny64, [5, 6, 7])
        assert outer == Arithmetic()  # a nested count takes the forwards inside it
        prefill(tiny64, [5, 6, 7])
    assert outer == inner and inner.total > 0
    assert all(not m._forward_hooks for m in linears)
    prefill(tiny64, [5, 6, 7])  # counted by nothing
    assert outer == inner
