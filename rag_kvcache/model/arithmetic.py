"""The arithmetic of a forward pass, counted as it runs: the floating-point operations of its
matrix products (two per multiply-add).

Why: at equal FLOP rates a link strategy cannot be faster than a full prefill by more than the
ratio of their arithmetic. `bench ttft` reports that ratio, the arithmetic ceiling, beside each
measured speedup, so a target past it shows as past it, and a speedup far below it shows how
much is overhead rather than arithmetic.

Counted: every `nn.Linear` a forward calls (the decoder layers' maps, and the output head's
logits rows apart), and attention's scores and weighted values, 2 * (d_k + d_v) per head for
each (query row, key) pair its mask lets the row see. Not counted: norms, activations, RoPE
and softmax (a few operations per element, as in the usual 2 x parameters x tokens estimate),
nor attention handed to a hook (batched decoding over shared prefixes). Counting reads each
attention mask once, so a counted forward is a little slower: count an extra, untimed request.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from rag_kvcache.model.attention import allowed_by


@dataclass
class Arithmetic:
    """FLOPs of the forwards run while `counted` was active."""

    linear: int = 0  # the layers' linear maps (the output head apart)
    attention: int = 0  # scores and weighted values over the keys each row may see
    head: int = 0  # the output head's logits

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.head


_counting: Arithmetic | None = None


@contextmanager
def counted(model: nn.Module) -> Iterator[Arithmetic]:
    """While active, the forwards of `model` add their arithmetic to the record yielded
    (attention through `count_attention`, which the model's attention function calls; forwards
    are not replayed as captured graphs meanwhile, see `adapter.replayed_forward`); a count
    nested in it takes the forwards run inside it. Count one request at a time, with no other
    model running: forwards on other threads meanwhile are counted too."""
    global _counting
    record = Arithmetic()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None

    def on_linear(module: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        if _counting is not record:  # a nested count is active: the forward is its
            return
        assert isinstance(module, nn.Linear)
        flops = 2 * output.numel() * module.in_features  # rows x out x in multiply-adds
        if module is head:
            record.head += flops
        else:
            record.linear += flops

    hooks = [
        m.register_forward_hook(on_linear) for m in model.modules() if isinstance(m, nn.Linear)
    ]
    outer, _counting = _counting, record
    try:
        yield record
    finally:
        _counting = outer
        for hook in hooks:
            hook.remove()


def count_attention(
    query: torch.Tensor,  # [B, heads, Q, d_k]
    key: torch.Tensor,  # [B, kv_heads, K, d_k]
    value: torch.Tensor,  # [B, kv_heads, K, d_v]
    mask: torch.Tensor | None,  # boolean or additive, broadcast to [B, heads, Q, K]
) -> None:
    """Add one attention call's arithmetic to the active count (nothing when none is). No
    mask is read as the causal one, as this library's attention reads it (the new rows after
    the cached keys)."""
    record = _counting  # read once: another thread may end its count meanwhile
    if record is None:
        return
    batch, heads, rows, _ = query.shape
    keys = key.shape[2]
    if mask is None:
        pairs = batch * heads * visible_causal(rows, keys)
    else:
        visible = allowed_by(mask)
        full = torch.broadcast_shapes(visible.shape, (batch, heads, rows, keys))
        pairs = int(visible.sum()) * (math.prod(full) // visible.numel())  # broadcast dims
    record.attention += 2 * pairs * (query.shape[-1] + value.shape[-1])


def active() -> bool:
    """Is a count running (a replayed forward, whose layers run no Python, would miss it)."""
    return _counting is not None


def visible_causal(rows: int, keys: int) -> int:
    """(row, key) pairs a causal mask lets `rows` new tokens after `keys - rows` cached see."""
    return rows * (keys - rows) + rows * (rows + 1) // 2
