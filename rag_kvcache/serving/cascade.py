"""Two-phase (cascade) attention: attend to KV split into parts, then merge the partial results.

Attention over keys split into parts A and B equals a merge of attention over A and over B, if
each part also returns the log-sum-exp (LSE) of its scores: `merge_state` (FlashInfer's
signature and semantics, LSE in natural log). That lets requests that share a prefix attend to
its one copy together, as one matrix-matrix product (ChunkAttention's first phase), and to
their own tokens separately (second phase), with exactly the result of plain attention.

Shapes follow FlashInfer: queries `[n, heads, dim]`, keys / values `[tokens, kv_heads, dim]`,
outputs `[n, heads, dim]`, LSE `[n, heads]`. A part with no keys has LSE -inf and output 0 and
leaves the other part unchanged.

Every function takes an optional additive `bias` on the keys' scores: APE's scale on stale
context tokens (`Strategy.scale`, log S on each stale key), which linked KV in the prefix tree
carries per token (`TreeNode.bias`), so that batched decoding attends as decoding alone does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class SharedKV(NamedTuple):
    """Keys / values [tokens, kv_heads, dim] that the queries in `rows` attend to, with an
    optional additive bias [tokens] on their scores."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: list[int]
    bias: torch.Tensor | None = None


class PrivateKV(NamedTuple):
    """Each query row's own keys / values [n, tokens, kv_heads, dim], of which row i uses the
    first lengths[i], with an optional additive bias [n, tokens] on their scores."""

    keys: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    bias: torch.Tensor | None = None


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention outputs v [n, heads, dim] with their LSEs s [n, heads] of two key parts.

    Computed in at least float32; returns v in v_a's dtype and the merged LSE."""
    acc = accumulator(v_a.dtype)
    s_a, s_b = s_a.to(acc), s_b.to(acc)
    s = torch.logaddexp(s_a, s_b)
    empty = torch.isneginf(s)  # neither part had keys
    safe = torch.where(empty, torch.zeros_like(s), s)
    w_a = torch.exp(s_a - safe).masked_fill(empty, 0)
    w_b = torch.exp(s_b - safe).masked_fill(empty, 0)
    v = v_a.to(acc) * w_a[..., None] + v_b.to(acc) * w_b[..., None]
    return v.to(v_a.dtype), s


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; half types accumulate in float32."""
    return torch.promote_types(dtype, torch.float32)


def merge_states(
    vs: list[torch.Tensor], ss: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of parts, left to right (merging is associative)."""
    v, s = vs[0], ss[0]
    for v_b, s_b in zip(vs[1:], ss[1:]):
        v, s = merge_state(v, s, v_b, s_b)
    return v, s


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of every query to every key, with its LSE (no mask: decode queries
    see their whole path; `bias` [tokens] is added to every query's scores). GQA: kv_heads
    divides heads; each KV head serves a group."""
    n, heads, dim = q.shape
    tokens, kv_heads, _ = k.shape
    if tokens == 0:
        return q.new_zeros(n, heads, v.shape[-1]), q.new_full((n, heads), float("-inf"))
    group = heads // kv_heads
    qg = q.reshape(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, n * group, dim)
    scores = (qg @ k.permute(1, 2, 0)).to(accumulator(q.dtype)) * scale  # [kv, n*g, tokens]
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    lse = torch.logsumexp(scores, dim=-1)  # [kv_heads, n*group]
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    out = probs @ v.permute(1, 0, 2)  # [kv_heads, n*group, dim]
    out = out.reshape(kv_heads, n, group, -1).permute(1, 0, 2, 3).reshape(n, heads, -1)
    return out, lse.reshape(kv_heads, n, group).permute(1, 0, 2).reshape(n, heads)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` (the shared phase) on the fastest kernel where q lives, chosen
    here and nowhere else: our Triton kernel on a CUDA GPU (`cascade_triton.py`; off with
    RAG_KVCACHE_TRITON=0), torch's fused flash-attention kernel on the CPU, which also
    returns the LSE (natural log). Either lays the query's head groups out as extra query
    rows of their KV head, so grouped KV is read once, never repeated (`bias`, if any, as the
    kernel's additive mask). The reference in float64, with no keys, or without a kernel."""
    if q.dtype == torch.float64 or not len(k):
        return attention_with_lse(q, k, v, scale, bias)
    if q.device.type == "cuda" and (kernel := triton_kernel()) is not None:
        return kernel(q, k, v, scale, bias)
    if q.device.type != "cpu" or _FLASH_CPU is None:
        return attention_with_lse(q, k, v, scale, bias)
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.reshape(n, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, n * group, dim)
    mask = None if bias is None else bias.to(q.dtype)[None, None, None, :]
    out, lse = _FLASH_CPU(
        qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )
    out = out[0].reshape(kv_heads, n, group, -1).transpose(0, 1).reshape(n, heads, -1)
    return out, lse[0].reshape(kv_heads, n, group).transpose(0, 1).reshape(n, heads)


@functools.cache
def triton_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The Triton shared-phase kernel, or None where Triton is not installed (it comes with
    torch's CUDA builds) or RAG_KVCACHE_TRITON=0 turns it off."""
    if os.environ.get("RAG_KVCACHE_TRITON", "1") == "0":
        return None
    try:
        from rag_kvcache.serving.cascade_triton import triton_attention_with_lse
    except ImportError:
        return None
    return triton_attention_with_lse


def padded_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row over its own keys: q [n, heads, dim], k / v [n, tokens, kv_heads, dim]
    of which row i uses the first lengths[i], `bias` [n, >= tokens] added to row i's scores.
    One batched product for every row's private part (decode's second phase), instead of one
    small product per row."""
    n, heads, dim = q.shape
    _, tokens, kv_heads, _ = k.shape
    group = heads // kv_heads
    qg = q.reshape(n, kv_heads, group, dim)  # [n, kv, g, d]
    scores = torch.einsum("nkgd,ntkd->nkgt", qg, k).to(accumulator(q.dtype)) * scale
    if bias is not None:
        scores = scores + bias[:, None, None, :tokens].to(scores.dtype)
    unused = torch.arange(tokens, device=q.device)[None, :] >= lengths[:, None]  # [n, t]
    scores = scores.masked_fill(unused[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n, kv, g]; -inf for a row with no keys
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None]).to(v.dtype)
    out = torch.einsum("nkgt,ntkd->nkgd", probs, v)
    return out.reshape(n, heads, -1), lse.reshape(n, heads)


def fused_padded_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`padded_attention_with_lse` through torch's fused CPU flash-attention kernel (rows as
    the batch, an additive mask for each row's length and bias). Falls back to the reference
    off the CPU, in float64, without the kernel, or when a row has no keys."""
    if _FLASH_CPU is None or q.device.type != "cpu" or q.dtype == torch.float64:
        return padded_attention_with_lse(q, k, v, lengths, scale, bias)
    shortest = int(lengths.min())
    if shortest < 1:
        return padded_attention_with_lse(q, k, v, lengths, scale, bias)
    n, heads, _ = q.shape
    qg, keys, values, mask = rows_as_batch(q, k, v, lengths, bias)
    out, lse = _FLASH_CPU(qg, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(n, heads, -1), lse.reshape(n, heads)


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`padded_attention_with_lse` without the LSE, for a batch that attends no shared part:
    one call of torch's fused attention on any device (rows as the batch, an additive mask
    for each row's length and bias), as a plain padded batch decodes. Every row has a key."""
    n, heads, _ = q.shape
    qg, keys, values, mask = rows_as_batch(q, k, v, lengths, bias)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(n, heads, -1)


def rows_as_batch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Padded rows as a fused kernel's batch: queries [n, kv_heads, group, dim] (a KV head's
    query heads as its rows), keys / values [n, kv_heads, tokens, dim], and the additive
    mask [n, 1, 1, tokens] (row i's bias on its first lengths[i] keys, -inf past them; None
    where every row uses every key unbiased, asked on the CPU only: on a GPU the question
    would wait for the queued kernels)."""
    n, heads, dim = q.shape
    _, tokens, kv_heads, _ = k.shape
    qg = q.reshape(n, kv_heads, heads // kv_heads, dim)
    keys, values = k.transpose(1, 2), v.transpose(1, 2)
    if bias is None and lengths.device.type == "cpu" and int(lengths.min()) >= tokens:
        return qg, keys, values, None  # no mask to build or read
    mask = torch.zeros(n, 1, 1, tokens, dtype=q.dtype, device=lengths.device)
    if bias is not None:
        mask[:, 0, 0] = bias[:, :tokens]
    unused = torch.arange(tokens, device=lengths.device)[None, :] >= lengths[:, None]  # [n, t]
    return qg, keys, values, mask.masked_fill_(unused[:, None, None, :], float("-inf"))


def cascade_attention(
    q: torch.Tensor,
    parts: list[SharedKV] | list[tuple[torch.Tensor, torch.Tensor, list[int]]],
    scale: float,
    private: PrivateKV | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of queries q [n, heads, dim] over shared parts and private KV.

    Each part (`SharedKV`: keys, values, rows, bias) is KV [tokens, kv_heads, dim] that the
    queries in `rows` attend to; a part shared by several requests is attended once for all
    its rows (phase one). `private` (`PrivateKV`: keys, values, lengths, bias) as in
    `padded_attention_with_lse`: each row's own tokens, all rows in one product (phase two).
    Everything is merged by LSE. Equals softmax attention of each row over the concatenation
    of its parts and private tokens, each key's bias added to its scores. With no part, the
    private rows alone by one fused call (`padded_attention`): every row must have a key.
    """
    if not parts and private is not None:  # nothing shared: no LSE, no merge
        own = PrivateKV(*private)
        return padded_attention(q, own.keys, own.values, own.lengths, scale, own.bias)
    n, heads, _ = q.shape
    acc = accumulator(q.dtype)
    dim_v = parts[0][1].shape[-1] if parts else q.shape[-1]
    if private is not None:
        own = PrivateKV(*private)
        out, lse = fused_padded_attention_with_lse(
            q, own.keys, own.values, own.lengths, scale, own.bias
        )
        out = out.to(acc)
    else:
        out = q.new_zeros(n, heads, dim_v, dtype=acc)
        lse = q.new_full((n, heads), float("-inf"), dtype=acc)
    solo: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # row -> its own parts
    for part in parts:
        keys, values, rows, bias = SharedKV(*part)
        if len(rows) == n:  # the whole batch: no gather / scatter
            v_part, s_part = fused_attention_with_lse(q, keys, values, scale, bias)
            out, lse = merge_state(out, lse, v_part.to(acc), s_part)
            continue
        if len(rows) == 1:  # merged below, all rows' at once
            one = q[rows[0] : rows[0] + 1]
            v_part, s_part = fused_attention_with_lse(one, keys, values, scale, bias)
            solo.setdefault(rows[0], []).append((v_part.to(acc), s_part))
            continue
        index: slice | torch.Tensor = slice(rows[0], rows[-1] + 1)  # a run of rows: views
        if rows != list(range(rows[0], rows[-1] + 1)):
            index = torch.tensor(rows, device=q.device)
        v_part, s_part = fused_attention_with_lse(q[index], keys, values, scale, bias)
        merged_v, merged_s = merge_state(out[index], lse[index], v_part.to(acc), s_part)
        out[index], lse[index] = merged_v, merged_s
    if solo:  # parts of one row each (nothing shared): one merge for all of them
        merged = [merge_states([v for v, _ in p], [s for _, s in p]) for p in solo.values()]
        index = torch.tensor(list(solo), device=q.device)
        merged_v, merged_s = merge_state(
            out[index],
            lse[index],
            torch.cat([v for v, _ in merged]),
            torch.cat([s for _, s in merged]),
        )
        out[index], lse[index] = merged_v, merged_s
    return out.to(q.dtype)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain softmax attention over all keys, `bias` [tokens] added to every score (the
    oracle for the functions above)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,thd->nht", q, k) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return torch.einsum("nht,thd->nhd", torch.softmax(scores, dim=-1), v)
