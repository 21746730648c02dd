"""Rotary position embedding math: move cached keys to new positions.

Keys are cached *after* RoPE. RoPE at position p rotates each frequency pair of a key by
`p * inv_freq`; rotations compose, so a key cached at position p moves to p + d by one more
rotation of `d * inv_freq`. We use the HF "rotate_half" pairing (dims i and i + rot/2), the
convention of every HF Llama-family model. Models with partial rotary embeddings rotate only the
first `2 * len(inv_freq)` dims; the rest pass through.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (any int or float) -> cos, sin [T, 2F], angles computed in float64."""
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]  # [T, F]
    angles = torch.cat((angles, angles), dim=-1)  # [T, 2F]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, D] token t by `positions[t] * inv_freq` (D >= 2F; extra dims unrotated).

    Applied to unrotated keys this *is* RoPE; applied to cached keys with position deltas it
    moves them. One function for both keeps the oracle and the fast path the same math.
    """
    rot = 2 * inv_freq.shape[-1]
    cos, sin = rope_cos_sin(positions.to(x.device), inv_freq.to(x.device), x.dtype)  # [T, rot]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = x_rot * cos + rotate_half(x_rot) * sin
    return rotated if x_pass.shape[-1] == 0 else torch.cat((rotated, x_pass), dim=-1)


def delta_angles(
    delta: int, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [F] of a rotation by `delta` positions, for `rotate_into`."""
    half = inv_freq.shape[-1]
    position = torch.tensor([delta], device=inv_freq.device)  # where inv_freq lives (CUDA too)
    cos, sin = rope_cos_sin(position, inv_freq, dtype)
    return cos[0, :half].to(device), sin[0, :half].to(device)


def rotate_into(
    out: torch.Tensor,
    x: torch.Tensor,
    delta: int,
    inv_freq: torch.Tensor,
    angles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """out[...] = apply_rope(x, delta for every token): the linker's fused fast path.

    One constant angle per frequency, written straight into `out` (a slice of the linked KV
    buffer) with no temporaries the size of x. `apply_rope` is its reference. `angles` =
    `delta_angles(...)` when the caller rotates by the same delta many times.
    """
    half = inv_freq.shape[-1]
    # angles in out's dtype: x may be narrower (bfloat16 KV placed into a float32 buffer)
    c, s = angles if angles is not None else delta_angles(delta, inv_freq, out.dtype, x.device)
    if x.dtype != out.dtype:  # widened once, contiguous: four mixed-dtype passes cost 25% more
        x = x.to(out.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    o1, o2 = out[..., :half], out[..., half : 2 * half]
    torch.mul(x1, c, out=o1)
    o1.addcmul_(x2, s, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, s)  # x2 cos + x1 sin
    if x.shape[-1] > 2 * half:
        out[..., 2 * half :] = x[..., 2 * half :]
