"""Moving cached keys by d positions equals RoPE applied at the new positions (float64 oracle)."""

import pytest
import torch
from helpers import random_chunks

from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.model.rope import apply_rope, rotate_into

INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))


@pytest.mark.parametrize("delta", [0, 1, 7, 255, 4096, -3])
@pytest.mark.parametrize("rotary_pairs", [32, 16])  # full and partial rotary embedding
def test_rotation_by_delta_equals_rope_at_new_positions(delta: int, rotary_pairs: int) -> None:
    g = torch.Generator().manual_seed(delta + 10)
    raw = torch.randn(2, 3, 40, 64, generator=g, dtype=torch.float64)  # [layers, h, T, D]
    inv_freq = INV_FREQ[:rotary_pairs]
    positions = torch.arange(40) + 5
    cached = apply_rope(raw, positions, inv_freq)
    moved = apply_rope(cached, torch.full((40,), delta), inv_freq)
    direct = apply_rope(raw, positions + delta, inv_freq)
    torch.testing.assert_close(moved, direct, rtol=0, atol=1e-12)
    if rotary_pairs < 32:  # the non-rotary tail is untouched
        assert torch.equal(moved[..., 2 * rotary_pairs :], raw[..., 2 * rotary_pairs :])


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_the_fused_rotation_into_a_wider_buffer_equals_rope(stored: torch.dtype) -> None:
    """The linker's `rotate_into` (keys kept in bfloat16 placed into a float32 buffer are
    widened first) moves keys as `apply_rope` does, to float32 rounding, writes the same bits
    whatever the keys' dtype, and leaves the rest of the buffer alone."""
    keys = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(1)).to(stored)
    inv_freq = INV_FREQ.float()
    out, wide = torch.zeros(2, 3, 50, 64), torch.zeros(2, 3, 50, 64)
    rotate_into(out[:, :, 5:45], keys, 300, inv_freq)
    rotate_into(wide[:, :, 5:45], keys.float(), 300, inv_freq)
    assert torch.equal(out, wide)
    exact = apply_rope(keys.double(), torch.full((40,), 300), inv_freq.double())
    torch.testing.assert_close(out[:, :, 5:45], exact.float(), rtol=0, atol=1e-5)
    assert not out[:, :, :5].any() and not out[:, :, 45:].any()


def test_round_trip_is_exact_in_float64() -> None:
    keys = torch.randn(3, 2, 50, 64, dtype=torch.float64)
    deltas = torch.randint(-1000, 1000, (50,))
    back = apply_rope(apply_rope(keys, deltas, INV_FREQ), -deltas, INV_FREQ)
    torch.testing.assert_close(back, keys, rtol=0, atol=1e-12)


def test_rotation_is_norm_preserving() -> None:
    keys = torch.randn(1, 1, 10, 64, dtype=torch.float64)
    moved = apply_rope(keys, torch.full((10,), 123), INV_FREQ)
    torch.testing.assert_close(moved.norm(dim=-1), keys.norm(dim=-1), rtol=0, atol=1e-12)


def test_rotated_chunk_keys_match_the_models_own_rope(tiny64) -> None:
    """Layer-0 keys depend only on token and position, so a chunk encoded alone and moved by d
    must equal the same tokens prefilled at offset d by the model itself."""
    filler, chunk = random_chunks([13, 21], seed=3)
    alone = encode_chunks(tiny64, [chunk])[0]
    in_place = encode_chunks(tiny64, [filler + chunk])[0]
    moved = apply_rope(alone.keys, torch.full((21,), 13), tiny64.inv_freq)
    # HF computes RoPE angles in float32 even for a float64 model, hence the tolerance.
    torch.testing.assert_close(moved[0], in_place.keys[0, :, 13:], rtol=1e-4, atol=1e-4)
