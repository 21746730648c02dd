"""One layer's float32 attention, torch's fused kernel against `cpu_attention`'s oneDNN matmuls.

SmolLM2-135M's shapes (9 query heads over 3 KV heads of 64 dims): query tokens over cached keys
with the causal mask of the query's own tokens (what a link forward's last block attends), a
decode step, and causal prefills. Median of 20 calls each after 3 warm-up calls (which build
oneDNN's kernels for the shape). Prints a Markdown table; run it on a quiet machine:

    python demos/results/cpu/ttft-onednn-attention/attention_layer.py > attention_layer.md
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rag_kvcache.model import cpu_attention
from rag_kvcache.model.attention import additive_mask

HEADS, KV_HEADS, DIM = 9, 3, 64
# (query tokens, keys): keys == tokens is a causal prefill. The largest first, as in a serving
# process, where a prefill or a placement has made large allocations before any short forward:
# a fresh process that has not pays page faults on every call's multi-megabyte scores (glibc
# maps each one afresh until a larger block has been freed), ~2 ms a call for 32 tokens over
# 4160 keys, which the engine's requests do not (`bench ttft` measures those)
CASES = [(4160, 4160), (1088, 1088), (96, 4160), (64, 4160), (32, 4160), (64, 1088), (16, 1088)]
CASES += [(1, 4160)]


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    machine = platform.processor() or platform.machine()
    print(f"{machine}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| query tokens | keys | torch's fused kernel | oneDNN matmuls | served by matmuls |")
    print("|---:|---:|---:|---:|---|")
    for queries, keys in CASES:
        q = torch.randn(1, HEADS, queries, DIM)
        k, v = torch.randn(1, KV_HEADS, keys, DIM), torch.randn(1, KV_HEADS, keys, DIM)
        mask = None
        if queries != keys:  # the query's own tokens causal, the cached keys all seen
            seen = torch.ones(queries, keys).tril(keys - queries).bool()
            mask = additive_mask(seen, torch.float32)
        causal = mask is None and queries > 1

        def fused(q=q, k=k, v=v, mask=mask, causal=causal) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
            )

        def matmuls(q=q, k=k, v=v, mask=mask) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return cpu_attention.attention(q, k, v, mask)

        torch.testing.assert_close(matmuls(), fused(), rtol=1e-4, atol=1e-4)
        served = "yes" if cpu_attention.serves(q, k, v, mask) else "no (fused kernel)"
        print(
            f"| {queries} | {keys} | {median_ms(fused):.2f} ms | {median_ms(matmuls):.2f} ms "
            f"| {served} |"
        )


if __name__ == "__main__":
    main()
