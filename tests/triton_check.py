"""Child process for test_cascade_triton.py: run the Triton shared-phase kernel under Triton's
CPU interpreter (TRITON_INTERPRET=1 must be set before Triton is imported, hence a process of
its own) against the reference, and print the largest errors per case as JSON."""

import json
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

import rag_kvcache.serving.cascade as cascade  # noqa: E402
from rag_kvcache.serving.cascade import (  # noqa: E402
    SharedKV,
    attention_with_lse,
    cascade_attention,
)
from rag_kvcache.serving.cascade_triton import triton_attention_with_lse  # noqa: E402

# (requests, heads, kv_heads, tokens, head_dim, dtype, biased): one key; fewer keys than a
# block; many key slices for few rows; many row blocks; no grouping; an odd head size;
# bfloat16; a score bias (APE's scale on stale keys) over several slices
CASES = [
    (1, 9, 3, 1, 64, torch.float32, False),
    (2, 9, 3, 37, 64, torch.float32, False),
    (1, 32, 8, 3000, 128, torch.float32, False),
    (40, 9, 3, 130, 64, torch.float32, False),
    (3, 4, 4, 70, 48, torch.float32, False),
    (6, 32, 8, 500, 128, torch.bfloat16, False),
    (2, 9, 3, 1000, 64, torch.float32, True),
]

if __name__ == "__main__":
    g = torch.Generator().manual_seed(3)
    results = []
    for n, heads, kv_heads, tokens, dim, dtype, biased in CASES:
        q = torch.randn(n, heads, dim, generator=g).to(dtype)
        # [kv_heads, tokens, dim] storage seen as [tokens, kv_heads, dim], as tree nodes are
        k = torch.randn(kv_heads, tokens, dim, generator=g).to(dtype).transpose(0, 1)
        v = torch.randn(kv_heads, tokens, dim, generator=g).to(dtype).transpose(0, 1)
        bias = None
        if biased:  # log 0.5 on every other run of 100 keys, as stale chunks get
            bias = torch.zeros(tokens)
            bias[(torch.arange(tokens) // 100) % 2 == 1] = -0.6931
        out, lse = triton_attention_with_lse(q, k, v, 0.125, bias)
        want_out, want_lse = attention_with_lse(q.double(), k.double(), v.double(), 0.125, bias)
        results.append(
            {
                "case": [n, heads, kv_heads, tokens, dim, str(dtype), biased],
                "dtype": str(out.dtype),
                "out": (out.double() - want_out).abs().max().item(),
                "lse": (lse.double() - want_lse).abs().max().item(),
            }
        )
    # two-phase attention with the kernel as phase one (what `fused_attention_with_lse`
    # picks on a GPU; here it is put in by hand, these being CPU tensors): a part for all
    # rows, a part for some, private tokens, against attention over each row's keys
    cascade.fused_attention_with_lse = triton_attention_with_lse
    q = torch.randn(4, 9, 64, generator=g)
    ka, va = torch.randn(2, 90, 3, 64, generator=g)
    kb, vb = torch.randn(2, 20, 3, 64, generator=g)
    own_k, own_v = torch.randn(2, 4, 7, 3, 64, generator=g)
    lengths = torch.tensor([7, 1, 4, 2])
    stale = torch.zeros(90)
    stale[2:] = -0.6931  # the shared part's stale keys (APE's scale 0.5), biased
    got = cascade_attention(
        q,
        [SharedKV(ka, va, [0, 1, 2, 3], stale), SharedKV(kb, vb, [1, 3])],
        0.125,
        (own_k, own_v, lengths),
    )
    worst = 0.0
    for row in range(4):
        keys = [ka] + ([kb] if row in (1, 3) else []) + [own_k[row, : lengths[row]]]
        values = [va] + ([vb] if row in (1, 3) else []) + [own_v[row, : lengths[row]]]
        bias = torch.cat([stale, torch.zeros(sum(len(k) for k in keys) - 90)])
        want, _ = attention_with_lse(
            q[row : row + 1].double(),
            torch.cat(keys).double(),
            torch.cat(values).double(),
            0.125,
            bias,
        )
        worst = max(worst, (got[row].double() - want[0]).abs().max().item())
    results.append({"case": "cascade", "out": worst, "lse": 0.0, "dtype": str(got.dtype)})
    print(json.dumps(results))
