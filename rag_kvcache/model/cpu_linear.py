"""Float32 linear layers on the CPU through oneDNN instead of MKL.

torch computes a float32 `F.linear` on the CPU with MKL's sgemm, which on AMD processors takes
a slower code path than the hardware allows. On an AMD EPYC with AVX-512 (2 cores) MKL ran
SmolLM2-135M's MLP matmul [64, 576] x [576, 1536] at 160 GFLOP/s and oneDNN at 295, the same
with 4096 rows at 212 and 441, and the 1-row LM head in 7.1 ms against 1.9 ms. torch already
computes bfloat16 linears with oneDNN; for float32 it is reached through the private op
`torch.ops.mkldnn._linear_pointwise`, and this file is the one place that calls it.

`linear` falls back to `F.linear`, its reference (the two agree to float32 rounding), wherever
the op cannot serve: other dtypes or devices, autograd needing a gradient (calibration
training), a torch built without oneDNN. Attention's two matmuls take the same op
(`cpu_attention`). Prefill, encoding and linking all go through the same
layers, so every path gains (prefill a little more than the cache's short forwards).

On Intel processors MKL takes its fast path and torch's own kernels are the faster ones, so
the op computes only where `cpu_kernels` chooses oneDNN (AMD processors, or by hand).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rag_kvcache.model import cpu_kernels


def _works() -> bool:
    """Is the private op there, taking the arguments it took when this was written, and
    computing a linear? Asked once, on a tiny case: a torch that renamed or changed it falls
    back to `F.linear` instead of failing every forward."""
    if not torch.backends.mkldnn.is_available():
        return False
    x = torch.arange(15.0).reshape(3, 5) / 7  # (no random numbers: the global RNG is the user's)
    w, b = torch.arange(20.0).reshape(4, 5).cos(), torch.arange(4.0)
    try:
        out = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except Exception:  # missing, renamed, other arguments: whatever it raises, not used
        return False
    return bool(torch.allclose(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4))


AVAILABLE = _works()


def computes_by_onednn() -> bool:
    """The op works here (`AVAILABLE`) and this CPU takes it (`cpu_kernels.CHOSEN`)."""
    return AVAILABLE and cpu_kernels.CHOSEN


def onednn_enabled() -> bool:
    """May the op compute here at all: it works (`AVAILABLE`), this CPU computes by it
    (`cpu_kernels.CHOSEN`), oneDNN is not switched off (`torch.backends.mkldnn.enabled`) and
    no CPU autocast is on (which torch's own ops obey and the op would not). The linears and
    attention (`cpu_attention`) both ask."""
    on = computes_by_onednn() and bool(torch.backends.mkldnn.enabled)
    return on and not torch.is_autocast_enabled("cpu")


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Would autograd track a result of these (the op has no backward)?"""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def onednn_serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Can oneDNN compute this linear: `onednn_enabled`, float32 on the CPU, shapes that fit,
    no gradient wanted. Anything else is F.linear's, errors included."""
    if not onednn_enabled() or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if x.dim() < 2 or x.numel() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != weight.shape[:1]):
        return False
    return not wants_grad(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by oneDNN where it serves (`onednn_serves`)."""
    if onednn_serves(x, weight, bias):
        if bias is not None:  # the op reads the bias as if contiguous: a strided view would
            bias = bias.contiguous()  # give wrong sums (weights and inputs may be strided)
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The op itself, `x @ weight.T (+ bias)`, for callers that checked `onednn_serves` (or
    its equivalent: `cpu_attention`'s matmuls, whose weights are the cached keys and the
    transposed values). Inputs and weights may be strided views; a bias must be contiguous."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` computed by `linear`: same parameters, state dict and module tree."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn_linears(model: Any) -> int:
    """Make every plain `nn.Linear` of a model on the CPU a `OneDNNLinear`, in place; returns
    how many. Subclasses (quantized layers, adapters' wrappers) keep their own forward; a model
    on a GPU, or on a CPU that computes by torch's kernels (`cpu_kernels.CHOSEN`, as it was
    when the model loaded), is left as it is (its linears would only pay the checks)."""
    if not computes_by_onednn() or any(p.device.type != "cpu" for p in model.parameters()):
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            swapped += 1
    return swapped
