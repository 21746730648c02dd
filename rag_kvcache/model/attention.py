"""Masked attention on plain tensors: blocks of query rows planned once per forward, each over
only the keys it may see; grouped KV heads read as they are.

Nothing here knows transformers: `rag_kvcache.model.adapter` registers the attention function
that calls these, and tests them, exact, against transformers' own sdpa through
`reference_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from rag_kvcache.model import cpu_attention

QUERY_BLOCK = 32  # masks of up to this many query rows are attended in one call
BLOCK_ROWS = (16, 32, 64, 128, 256)  # the sizes query_blocks cuts a masked query into
# what one attention call costs beyond its rows' work, in rows of it (CPU flash attention:
# reading the keys once per call): a bfloat16 call of 32 rows over 4K keys took 0.89 ms and
# one of 64 rows 1.25 ms on a Xeon with AMX, float32 1.77 and 3.11 ms
CALL_ROWS = {torch.float32: 8, torch.float64: 8}  # other dtypes: CALL_ROWS_NARROW
CALL_ROWS_NARROW = 20
MIN_RUN = 16  # fewer rows than this sharing a window are not worth calls of their own
GATHER_BELOW = 0.75  # a block's keys are gathered when they are under this share of a prefix
MATH_ROWS = 256  # grouped_sdpa: up to this many stacked query rows, plain matmul attention


def grouped_sdpa(
    query: torch.Tensor,  # [B, heads, Q, d]
    key: torch.Tensor,  # [B, kv_heads, K, d]
    value: torch.Tensor,
    mask: torch.Tensor,  # [B, 1, Q, K] additive or boolean
    scale: float | None,
) -> torch.Tensor:
    """Masked attention with grouped KV heads, [B, heads, Q, d_v], K/V read as they are.

    Each KV head's query heads are stacked as rows of one query (the mask repeated for them),
    so no kernel needs GQA support: transformers' sdpa copies K/V for every query head
    whenever a mask is given (4x the KV read for Llama-3-8B, per layer per step), and torch's
    own `enable_gqa` falls back to the math kernel with a mask on CUDA.

    A few rows (a decode step: one per query head) attend by two matmuls: the fused kernels
    split their work by query rows and KV heads, 8 blocks for Llama-3-8B's decode step on a
    GPU of 132 cores, where a matmul splits the keys too."""
    b, heads, q, d = query.shape
    groups = heads // key.shape[1]
    rows = query.reshape(b, key.shape[1], groups * q, d)
    stacked = mask.repeat(1, 1, groups, 1) if groups > 1 else mask
    if groups * q > MATH_ROWS:
        out = F.scaled_dot_product_attention(rows, key, value, attn_mask=stacked, scale=scale)
    else:
        # scaled first, as the fused kernels do: float16 scores could overflow otherwise
        scores = torch.matmul(rows * (scale or d**-0.5), key.transpose(-1, -2))
        if stacked.dtype == torch.bool:
            scores.masked_fill_(~stacked, torch.finfo(scores.dtype).min)
        else:
            scores.add_(stacked)
        wide = torch.promote_types(scores.dtype, torch.float32)  # bfloat16 scores in float32
        probs = scores.softmax(dim=-1, dtype=wide).to(value.dtype)
        # the keys split in `parts` for the second matmul, each part's sum added after: a
        # matmul over 16K keys with 4 rows would otherwise be 8 blocks again
        keys = key.shape[2]
        parts = next(p for p in (16, 8, 4, 2, 1) if keys % p == 0)
        probs = probs.reshape(b, key.shape[1], groups * q, parts, keys // parts).transpose(2, 3)
        split = value.reshape(b, key.shape[1], parts, keys // parts, value.shape[-1])
        out = torch.matmul(probs, split).sum(dim=2)
    return out.reshape(b, heads, q, value.shape[-1])


def with_key_bias(
    mask: torch.Tensor | None, bias: torch.Tensor, queries: int, keys: int
) -> torch.Tensor:
    """An additive mask [B, 1, Q, K] with `bias` [>= K or fewer: zeros past it] added to every
    row: what the cache's key bias (`set_key_bias`) does to each attention. A missing mask is
    the causal one of Q new tokens after K - Q cached."""
    if len(bias) < keys:  # the buffer grew past the bias: new tokens are unbiased
        bias = F.pad(bias, (0, keys - len(bias)))
    if mask is None:
        rows = torch.arange(keys - queries, keys, device=bias.device)
        allowed = torch.arange(keys, device=bias.device)[None, :] <= rows[:, None]
        mask = additive_mask(allowed, bias.dtype)
    elif mask.dtype == torch.bool:
        mask = additive_mask(mask, bias.dtype)
    return mask + bias[:keys]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean `allowed` [Q, K] (or already 4D, [B, 1, Q, K]) -> additive 4D mask [1, 1, Q, K]
    (or [B, 1, Q, K]) in the model's dtype."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask if mask.dim() == 4 else mask[None, None]


def allowed_by(mask: torch.Tensor) -> torch.Tensor:
    """`additive_mask` undone: True where a boolean or additive mask lets a row see a key (an
    additive one's masked entries are near the dtype's minimum, a bias or two added)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


@dataclass(frozen=True)
class QueryBlock:
    """Query rows attended together and the keys they read: `keys[:count]` (sorted key
    positions), or the first `count` keys when `keys` is None. Blocks that read nested sets of
    scattered keys (the rows of one chunk reading a window, each block a little further) share
    one `keys` object, so attention gathers those keys once per layer. `mask` is the rows'
    additive mask over the keys read, cut once per forward and used by every layer."""

    rows: slice | torch.Tensor  # query rows: a range, or scattered row indices [r]
    keys: torch.Tensor | None
    count: int
    mask: torch.Tensor  # [1, 1, r, count]


def query_blocks(mask: torch.Tensor) -> list[QueryBlock] | None:
    """Plan the attention of a tall additive mask [1, 1, Q, K] (Q > QUERY_BLOCK) as blocks of
    rows, once per forward. Rows that share a window (a recomputed chunk's, with `+window:W`)
    go in blocks of their own that gather the window's keys; every other row (the question,
    the scattered chunk boundaries a strategy recomputes, short runs) goes, in order, in
    blocks that read a prefix of the keys up to their last row's (or gather them when far
    from a prefix). Rows reading the whole context thus share as few blocks as they fill,
    instead of each block that a fixed split makes straddle a window's edge reading every
    key. Where each group of rows is cut is `cut_rows`' choice: the cheapest split, each
    call costing its rows' keys and a fixed overhead (CALL_ROWS)."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[2] <= QUERY_BLOCK:
        return None
    visible = allowed_by(mask[0, 0])  # [Q, K]
    Q, K = visible.shape
    at = torch.arange(K, dtype=torch.int32, device=visible.device)
    rises = visible & ~F.pad(visible, (1, 0))[:, :-1]  # where each run of visible keys starts
    reach_of = torch.where(rises, at, 0).amax(dim=1).tolist()  # [Q] where a row's last run starts
    windowed = [r > 0 for r in reach_of]  # rows with a gap (the linker's see key 0): a window

    runs: list[range] = []  # windowed rows sharing one window, in order
    wide: list[int] = []  # every other row
    i = 0
    while i < Q:
        j = i + 1
        while j < Q and windowed[i] and windowed[j] and reach_of[j] == reach_of[i]:
            j += 1
        if windowed[i] and j - i >= MIN_RUN:
            runs.append(range(i, j))
        else:
            wide.extend(range(i, j))
        i = j

    def seen(rows: slice | torch.Tensor) -> torch.Tensor:
        return visible[rows].any(dim=0).nonzero().flatten()  # [k] sorted key positions

    def block(
        rows: slice | torch.Tensor, keys: torch.Tensor, shared: torch.Tensor | None
    ) -> QueryBlock:
        cut = mask[:, :, rows]
        end = int(keys[-1]) + 1 if len(keys) else 0
        if len(keys) >= GATHER_BELOW * end:  # nearly a prefix: views, no gather
            return QueryBlock(rows, None, end, cut[..., :end].contiguous())
        index = keys if shared is None else shared
        return QueryBlock(rows, index, len(keys), cut.index_select(3, keys))

    overhead = CALL_ROWS.get(mask.dtype, CALL_ROWS_NARROW)
    counts = visible.sum(dim=1).tolist()  # [Q] keys each row sees (a window's rows: nested)
    ends = torch.where(visible, at + 1, 0).amax(dim=1).tolist()  # [Q] 1 + its last key
    blocks = []
    for run in runs:  # blocks of one window share the gather of its widest set
        union = seen(slice(run.start, run.stop))
        for a, b in cut_rows(counts[run.start : run.stop], overhead):
            span = slice(run.start + a, run.start + b)
            keys = seen(span)
            nested = torch.equal(union[: len(keys)], keys)
            blocks.append(block(span, keys, union if nested else None))
    for a, b in cut_rows([ends[r] for r in wide], overhead):
        part = wide[a:b]
        if part[-1] - part[0] == len(part) - 1:  # contiguous: a range of rows
            rows: slice | torch.Tensor = slice(part[0], part[-1] + 1)
        else:
            rows = torch.tensor(part, device=mask.device)
        blocks.append(block(rows, seen(rows), None))
    return blocks


def cut_rows(keys: list[int], overhead: int) -> list[tuple[int, int]]:
    """The cheapest cut of rows in order into blocks of BLOCK_ROWS sizes (the last may be
    shorter), as (start, stop) pairs: `keys[i]` is what row i reads, a block reads what its
    widest row does (rows read nested or growing sets), and a call costs `overhead` rows
    more than its own. A few rows per call waste the call; many, the keys their widest row
    reads and the others need not. Blocks start at multiples of the smallest size, as the
    fused kernel's own row blocks do: rows recomputed from the context's start (`full`) are
    then attended in the same groups, and to the same bits, as a plain prefill's."""
    n = len(keys)
    widest = list(accumulate(keys, max))  # rows in order read growing sets: the last's
    best = [0.0] + [math.inf] * n  # best[j]: the cheapest cut of the first j rows
    came = [0] * (n + 1)
    for i in range(0, n, BLOCK_ROWS[0]):  # where a block may start
        for size in BLOCK_ROWS:  # ties: the smaller block
            j = min(i + size, n)
            cost = best[i] + (overhead + j - i) * widest[j - 1]
            if cost < best[j]:
                best[j], came[j] = cost, i
    cuts, j = [], n
    while j > 0:
        cuts.append((came[j], j))
        j = came[j]
    return cuts[::-1]


def _sdpa(
    query: torch.Tensor,  # [B, heads, Q, d]
    key: torch.Tensor,  # [B, kv_heads, K, d]
    value: torch.Tensor,
    mask: torch.Tensor | None,  # [B, 1, Q, K] additive or boolean, or None (causal)
    scale: float | None,
) -> torch.Tensor:
    """The CPU's attention: float32 by oneDNN matmuls where they serve (`cpu_attention`),
    otherwise torch's fused kernel, their reference."""
    if cpu_attention.serves(query, key, value, mask):
        return cpu_attention.attention(query, key, value, mask, scale)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        scale=scale,
        is_causal=query.shape[2] > 1 and mask is None,
        enable_gqa=True,
    )
