"""Float32 attention on the CPU by two oneDNN matmuls per KV head instead of torch's fused kernel.

torch's CPU flash attention computes its float32 blocks with MKL's sgemm, which takes a slow
code path on AMD processors (as `F.linear` does: see `cpu_linear`). Here each KV head's query
heads are stacked as the rows of one matrix and attend by `scores = rows @ keys.T` (the cached
keys are the matmul's weight, read where they lie), an additive mask, a softmax and
`probs @ values` (the values' transposed view as the weight). On an AMD EPYC with AVX-512
(2 cores), SmolLM2-135M's shapes: 64 query tokens over 4160 cached keys took 2.7 ms a layer
against torch's 4.6, and a causal prefill of 4160 tokens 77 ms a layer against 125.

`F.scaled_dot_product_attention` is the reference (the two agree to float32 rounding) and
serves everything `serves` refuses: other dtypes or devices, a batch, a gradient wanted,
boolean masks, and small attentions, where the fused kernel's single call is cheaper than a
few matmuls (a decode step's row over a few thousand keys).
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from rag_kvcache.model import cpu_linear

CAUSAL_BLOCK = 128  # a causal prefill attends in blocks of this many query tokens
MIN_SCORES = 65_536  # fewer scores than this per KV head (stacked rows x keys): the fused kernel
KEPT_MASKS = 16  # masks whose `_tail` is remembered (a forward's query blocks: a few)


def serves(
    query: torch.Tensor,  # [B, heads, Q, d]
    key: torch.Tensor,  # [B, kv_heads, K, d]
    value: torch.Tensor,
    mask: torch.Tensor | None,  # [B, 1, Q, K] additive, or None: causal with Q == K
) -> bool:
    """Can `attention` compute this (else `F.scaled_dot_product_attention` does)."""
    if not cpu_linear.AVAILABLE or not torch.backends.mkldnn.enabled:
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
    if heads // kv_heads * q * n < MIN_SCORES or torch.is_autocast_enabled("cpu"):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def attention(
    query: torch.Tensor,  # [1, heads, Q, d]
    key: torch.Tensor,  # [1, kv_heads, K, d]
    value: torch.Tensor,  # [1, kv_heads, K, d_v]
    mask: torch.Tensor | None,  # [1, 1, Q, K] additive, or None: causal (Q == K)
    scale: float | None = None,
) -> torch.Tensor:
    """Attention [1, heads, Q, d_v] for the cases `serves` accepts.

    With a mask the rows attend in one block (the linker plans its query blocks before:
    `attention.query_blocks`); a causal prefill attends in blocks of CAUSAL_BLOCK tokens, each
    over the keys up to its last token, its diagonal masked."""
    heads, q, d = query.shape[1:]
    kv_heads, n = key.shape[1:3]
    groups = heads // kv_heads
    out = query.new_empty(1, heads, q, value.shape[-1])
    scaled = query[0] * (d**-0.5 if scale is None else scale)  # [heads, Q, d]
    if mask is not None:
        blocks = [(0, q, n, _tail(mask))]
    else:
        blocks = []
        for start in range(0, q, CAUSAL_BLOCK):
            stop = min(start + CAUSAL_BLOCK, q)
            blocks.append((start, stop, stop, (start, _diagonal(stop - start))))
    for start, stop, keys, (masked_from, tail) in blocks:
        rows = stop - start
        for h in range(kv_heads):
            group = slice(h * groups, (h + 1) * groups)
            stacked = scaled[group, start:stop].reshape(groups * rows, d)
            scores = cpu_linear.onednn_linear(stacked, key[0, h, :keys])  # [groups*rows, keys]
            if tail is not None:  # the mask's columns that are not all zero
                scores.view(groups, rows, keys)[:, :, masked_from:].add_(tail)
            probs = scores.softmax(dim=-1)
            mixed = cpu_linear.onednn_linear(probs, value[0, h, :keys].t())
            out[0, group, start:stop] = mixed.view(groups, rows, -1)
    return out


def _tail(mask: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """For an additive mask [1, 1, Q, K]: (the first column not zero in every row, the mask's
    rows [Q, K - first] from there on; None where it is all zero). Adding only that part
    spares a pass over the scores for the context the question's tokens all see whole. A
    forward hands every layer the same masks (one per query block), so where the last few
    masks start is kept: for the same tensor (a weak reference: it lives no longer) not
    written since (its version)."""
    rows = mask[0, 0]
    kept = _firsts.get(id(mask))
    if kept is not None and kept[0]() is mask and kept[1] == mask._version:
        first = kept[2]
    else:
        live = rows.ne(0).any(dim=0)
        first = int(live.to(torch.uint8).argmax()) if bool(live.any()) else rows.shape[1]
        with _firsts_lock:  # requests in threads share it
            while len(_firsts) >= KEPT_MASKS:
                del _firsts[next(iter(_firsts))]  # the oldest
            _firsts[id(mask)] = (weakref.ref(mask), mask._version, first)
    return first, rows[:, first:] if first < rows.shape[1] else None


_firsts: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
_firsts_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _diagonal(size: int) -> torch.Tensor:
    """The additive causal mask of a block of `size` tokens over its own keys (read only)."""
    return torch.full((size, size), float("-inf")).triu_(1)
