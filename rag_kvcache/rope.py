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
