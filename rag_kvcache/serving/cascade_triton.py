"""The shared phase of cascade attention as a Triton kernel, for NVIDIA GPUs.

Phase one attends every query row of the requests passing through a tree node to the node's
keys: per KV head a [rows, tokens] score matrix, i.e. a matrix-matrix product, where plain
decoding does one matrix-vector product per request. The kernel runs one program per (KV head,
block of query rows, slice of the keys): the head's query group rows of each request are laid
out as rows of that KV head, so grouped KV is read once for all of them, and long prefixes are
split across programs (flash-decoding) so a few requests still fill the GPU. Each program keeps
an online softmax over its keys and writes its output and log-sum-exp; the slices are merged by
LSE like any two parts of the keys (`cascade.merge_state`'s rule).

`attention_with_lse` in `cascade.py` is the reference (the tests' oracle); `cascade.py` picks
this kernel for CUDA tensors when Triton is installed. Triton's interpreter
(TRITON_INTERPRET=1) runs the same kernel on the CPU, which is how it is tested where there is
no GPU; there its products are taken in float32, as the interpreter's bfloat16 dot is wrong
(the GPU path multiplies in the input dtype and is tested on the GPU, tests/test_gpu.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # query rows per program (tl.dot needs >= 16)
BLOCK_N = 64  # keys per inner step
TARGET_PROGRAMS = 264  # about two waves on an H100's 132 SMs


@triton.jit
def _load_block(ptr, t, stride_t, d, mask, UPCAST: tl.constexpr):
    """Keys or values [tokens t, dims d] of one KV head (ptr at the head), 0 where masked."""
    block = tl.load(ptr + t[:, None] * stride_t + d[None, :], mask=mask, other=0.0)
    if UPCAST:
        block = block.to(tl.float32)
    return block


@triton.jit
def _shared_phase_kernel(
    q_ptr,  # [n, heads, dim]
    k_ptr,  # [tokens, kv_heads, dim]
    v_ptr,
    bias_ptr,  # [tokens] float32 added to every score (HAS_BIAS), else unused
    out_ptr,  # [splits, kv_heads, rows, dim] float32, rows = n * group
    lse_ptr,  # [splits, kv_heads, rows] float32
    stride_qn,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    rows,
    tokens,
    keys_per_split,
    scale,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # products in float32 (the interpreter's bfloat16 dot is wrong)
    HAS_BIAS: tl.constexpr,
):
    kv_head = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)
    kv_heads = tl.num_programs(0)

    r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of this KV head
    d = tl.arange(0, BLOCK_D)
    row_ok = r < rows
    d_ok = d < DIM
    request, head = r // GROUP, kv_head * GROUP + r % GROUP
    q = tl.load(
        q_ptr + request[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    total = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, tokens)
    for block in range(start, stop, BLOCK_N):
        t = block + tl.arange(0, BLOCK_N)
        t_ok = t < stop
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = _load_block(k_ptr + kv_head * stride_kh, t, stride_kt, d, kv_mask, UPCAST)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_BIAS:
            scores += tl.load(bias_ptr + t, mask=t_ok, other=0.0)[None, :]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        correction = tl.exp(m - m_new)
        total = total * correction + tl.sum(p, axis=1)
        v = _load_block(v_ptr + kv_head * stride_vh, t, stride_vt, d, kv_mask, UPCAST)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    part = split * kv_heads + kv_head
    tl.store(
        out_ptr + (part * rows + r[:, None]) * DIM + d[None, :],
        acc / total[:, None],
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + part * rows + r, m + tl.log(total), mask=row_ok)


def triton_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cascade.attention_with_lse` (queries [n, heads, dim], keys / values [tokens, kv_heads,
    dim] with any token and head strides, at least one key, an optional score bias [tokens])
    on the Triton kernel. Returns the output in q's dtype and the LSE in float32."""
    n, heads, dim = q.shape
    tokens, kv_heads, _ = k.shape
    group = heads // kv_heads
    rows = n * group
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    row_blocks = triton.cdiv(rows, BLOCK_M)
    # slices of whole key blocks, as many as fill the GPU, none empty
    wanted = max(1, TARGET_PROGRAMS // (kv_heads * row_blocks))
    keys_per_split = triton.cdiv(triton.cdiv(tokens, wanted), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(tokens, keys_per_split)
    out = torch.empty(splits, kv_heads, rows, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, kv_heads, rows, dtype=torch.float32, device=q.device)
    _shared_phase_kernel[(kv_heads, row_blocks, splits)](
        q,
        k,
        v,
        q if bias is None else bias,  # any pointer when there is no bias: never read
        out,
        lse,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        rows,
        tokens,
        keys_per_split,
        scale,
        GROUP=group,
        DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        HAS_BIAS=bias is not None,
    )
    # merge the slices by LSE: weights exp(lse_s - lse), which sum to 1 over the slices
    total = torch.logsumexp(lse, dim=0)  # [kv_heads, rows]
    merged = (out * torch.exp(lse - total)[..., None]).sum(dim=0)  # [kv_heads, rows, dim]
    merged = merged.reshape(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim)
    total = total.reshape(kv_heads, n, group).transpose(0, 1).reshape(n, heads)
    return merged.to(q.dtype), total
