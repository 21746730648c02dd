"""Float32 attention on the CPU by two oneDNN matmuls per KV head instead of torch's fused kernel.

torch's CPU flash attention computes its float32 blocks with MKL's sgemm, which takes a slow
code path on AMD processors (as `F.linear` does: see `cpu_linear`; `cpu_kernels` keeps both
paths to AMD processors; on Intel's the fused kernel is the faster). Here each KV head's query
heads are stacked as the rows of one matrix and attend by `scores = rows @ keys.T` (the cached
keys are the matmul's weight, read where they lie), an additive mask, a softmax and
`probs @ values` (the values' transposed view as the weight). On an AMD EPYC with AVX-512
(2 cores), SmolLM2-135M's shapes: 64 query tokens over 4160 cached keys took 2.6-2.7 ms a layer
against torch's 4.6, and a causal prefill of 4160 tokens 76-84 ms against 132-135
(`demos/results/cpu/ttft-onednn-attention/attention_layer.md`).

`F.scaled_dot_product_attention` is the reference (the two agree to float32 rounding) and
serves everything `serves` refuses: other dtypes or devices, a batch, a gradient wanted,
boolean masks or masks with -inf, and small attentions, where the fused kernel's single call
is cheaper than a few matmuls (such as a decode step's row over a few thousand keys).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import NamedTuple

import torch

from rag_kvcache.model import cpu_linear

ROW_BLOCK = 128  # query tokens attended together (a causal prefill's blocks; a tall mask's)
MIN_SCORES = 65_536  # fewer scores than this per KV head (stacked rows x keys): the fused kernel
KEPT_MASKS = 1024  # masks whose `MaskFacts` are remembered (a forward's query blocks: a few)


class MaskFacts(NamedTuple):
    """What `attention` needs to know of an additive mask [1, 1, Q, K], found in one scan."""

    masked_from: int  # the first column that is not zero in some row (K: none)
    finite: bool  # no -inf or NaN: a row masked whole by -inf would give NaN here, not in sdpa


def serves(
    query: torch.Tensor,  # [B, heads, Q, d]
    key: torch.Tensor,  # [B, kv_heads, K, d]
    value: torch.Tensor,
    mask: torch.Tensor | None,  # [B, 1, Q, K] additive, or None: causal with Q == K
) -> bool:
    """Can `attention` compute this (else `F.scaled_dot_product_attention` does)."""
    if not cpu_linear.onednn_enabled():
        return False
    tensors = (query, key, value) if mask is None else (query, key, value, mask)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 4 for t in tensors):
        return False
    (b, heads, q, _), (kb, kv_heads, n, _) = query.shape, key.shape
    if b != 1 or kb != 1 or value.shape[:3] != key.shape[:3] or heads % kv_heads:
        return False
    if mask is None and (q != n or q == 1):  # no mask: only the plain causal prefill
        return False
    if mask is not None and tuple(mask.shape) != (1, 1, q, n):
        return False
    if heads // kv_heads * q * n < MIN_SCORES or cpu_linear.wants_grad(*tensors):
        return False
    return mask is None or mask_facts(mask).finite


class _Rows(NamedTuple):
    """Query tokens start..stop-1, attending to the first `keys` keys; `mask` [stop - start,
    keys - masked_from] is added to their scores from column `masked_from` on (None: none)."""

    start: int
    stop: int
    keys: int
    masked_from: int
    mask: torch.Tensor | None


def attention(
    query: torch.Tensor,  # [1, heads, Q, d]
    key: torch.Tensor,  # [1, kv_heads, K, d]
    value: torch.Tensor,  # [1, kv_heads, K, d_v]
    mask: torch.Tensor | None,  # [1, 1, Q, K] additive, or None: causal (Q == K)
    scale: float | None = None,
) -> torch.Tensor:
    """Attention [1, heads, Q, d_v] for the cases `serves` accepts, ROW_BLOCK query tokens at a
    time (the scores of a block are what it holds in memory): a causal prefill's blocks each over
    the keys up to their last token, their diagonal masked; a masked query's over every key,
    the mask added from its first column that is not zero in some row on (the linker plans its
    blocks before, each over the keys its rows see: `attention.query_blocks`)."""
    heads, q, d = query.shape[1:]
    kv_heads, n = key.shape[1:3]
    groups = heads // kv_heads
    out = query.new_empty(1, heads, q, value.shape[-1])
    scaled = query[0] * (d**-0.5 if scale is None else scale)  # [heads, Q, d]
    for block in _row_blocks(q, n, mask):
        start, stop, keys = block.start, block.stop, block.keys
        rows = stop - start
        for h in range(kv_heads):
            group = slice(h * groups, (h + 1) * groups)
            stacked = scaled[group, start:stop].reshape(groups * rows, d)
            scores = cpu_linear.onednn_linear(stacked, key[0, h, :keys])  # [groups*rows, keys]
            if block.mask is not None:
                scores.view(groups, rows, keys)[:, :, block.masked_from :].add_(block.mask)
            probs = torch.softmax(scores, dim=-1, out=scores)  # in place: one buffer less
            mixed = cpu_linear.onednn_linear(probs, value[0, h, :keys].t())
            out[0, group, start:stop] = mixed.view(groups, rows, -1)
    return out


def _row_blocks(q: int, n: int, mask: torch.Tensor | None) -> list[_Rows]:
    """The ROW_BLOCK-token blocks of a query of q tokens over n keys, with what each adds."""
    spans = [(start, min(start + ROW_BLOCK, q)) for start in range(0, q, ROW_BLOCK)]
    if mask is None:  # causal, Q == K
        return [_Rows(a, b, b, a, _diagonal(b - a)) for a, b in spans]
    first = mask_facts(mask).masked_from
    if first == n:
        return [_Rows(a, b, n, n, None) for a, b in spans]
    return [_Rows(a, b, n, first, mask[0, 0, a:b, first:]) for a, b in spans]


def mask_facts(mask: torch.Tensor) -> MaskFacts:
    """`MaskFacts` of an additive mask [1, 1, Q, K]. A forward hands every layer the same masks
    (one per query block), so the facts of the last KEPT_MASKS are kept: for the same tensor (a
    weak reference: it lives no longer) not written since (its version). A mask made under
    `torch.inference_mode` has no version to check, and is scanned each time."""
    if mask.is_inference():
        return _scan(mask)
    kept = _facts.get(id(mask))
    if kept is not None and kept[0]() is mask and kept[1] == mask._version:
        return kept[2]
    facts = _scan(mask)
    with _facts_lock:  # requests in threads share it
        if len(_facts) >= KEPT_MASKS:  # the dead first, then the oldest
            for gone in [i for i, entry in _facts.items() if entry[0]() is None]:
                del _facts[gone]
            while len(_facts) >= KEPT_MASKS:
                del _facts[next(iter(_facts))]
        _facts[id(mask)] = (weakref.ref(mask), mask._version, facts)
    return facts


def _scan(mask: torch.Tensor) -> MaskFacts:
    rows = mask[0, 0]
    live = rows.ne(0).any(dim=0)
    first = int(live.to(torch.uint8).argmax()) if bool(live.any()) else rows.shape[1]
    return MaskFacts(first, bool(rows.isfinite().all()))


_facts: dict[int, tuple[weakref.ref[torch.Tensor], int, MaskFacts]] = {}
_facts_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _diagonal(size: int) -> torch.Tensor:
    """The additive causal mask of a block of `size` tokens over its own keys (read only)."""
    return torch.full((size, size), float("-inf"), dtype=torch.float32).triu_(1)
