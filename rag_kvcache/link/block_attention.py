"""A naive link as one forward over the whole prompt with a block mask: the student a LoRA
link calibration (`model.lora`) trains.

The linker computes a naive link from KV encoded chunk by chunk, in place, which autograd
cannot follow through the encoding. Block-wise attention computes the same thing in one
differentiable forward: each document chunk's tokens attend only within their chunk, at
their final positions (RoPE is relative: a chunk computed there equals one encoded at its own
positions and rotated), and the question attends to everything. A test holds it equal to
`link`, so what an adapter is trained on is what the linker computes with it merged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rag_kvcache.errors import StrategyError
from rag_kvcache.kv import ChunkKV
from rag_kvcache.model.adapter import forward
from rag_kvcache.model.attention import additive_mask
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.strategy import Strategy


def check_trainable(strategy: Strategy) -> None:
    """The strategies whose link `block_logits` computes: naive, any placement, `+top:N`
    and `+window:W` (no boundary tokens, link tokens, APE or sinks to model)."""
    if strategy.kind != "naive" or strategy.calibrated or strategy.uses_ape:
        raise StrategyError(
            f"a LoRA adapter trains for naive linking (any placement, +top:N, +window:W), "
            f"not {strategy}"
        )


def block_logits(
    lm: LoadedModel, chunks: list[ChunkKV], new_ids: list[int], strategy: Strategy, keep: int
) -> torch.Tensor:
    """What a naive link of `chunks` (chunk 0 the system prefix, the documents placed) computes
    for the last `keep` of `new_ids`, as ONE forward over the whole prompt with a block mask
    [keep, vocab], differentiable in whatever of the model trains.

    A document chunk's tokens see only their own chunk (and its sink tokens, given their own
    copy before it): what encoding it alone computed, rotated to its place. Chunks recomputed
    whole (`+top:N`) see everything before them (`+window:W`: the system prefix and W tokens
    before their chunk); the system prefix and the new tokens see everything. RoPE is relative,
    so a chunk computed at its final positions equals one encoded at its own and rotated."""
    check_trainable(strategy)
    full = [False, *strategy.in_full(len(chunks) - 1)]
    ids: list[int] = []
    pos: list[int] = []
    block: list[int] = []
    sink: list[bool] = []
    sees_all: list[bool] = []
    reach: list[int] = []  # first position past the system prefix a token may see

    def span(
        tokens: Sequence[int], start: int, of: int, is_sink: bool, sees: bool, first: int
    ) -> None:
        """Lay out `tokens` from position `start` in block `of`: sinks or not, seeing past
        their block or not, and from which position past the system prefix."""
        n = len(tokens)
        ids.extend(tokens)
        pos.extend(range(start, start + n))
        block.extend([of] * n)
        sink.extend([is_sink] * n)
        sees_all.extend([sees] * n)
        reach.extend([first] * n)

    system, at = chunks[0].num_tokens, 0
    for i, c in enumerate(chunks):
        if i > 0 and not full[i]:  # its sinks, seen by it alone
            span(c.sink_ids, at - len(c.sink_ids), i, True, False, 0)
        window = strategy.window if i > 0 and full[i] and strategy.window is not None else None
        first = 0 if window is None else max(at - window, system)
        span(c.token_ids, at, i, False, i == 0 or full[i], first)
        at += c.num_tokens
    span(new_ids, at, len(chunks), False, True, 0)
    device = lm.device
    p, b, s_, a, r = (torch.tensor(x, device=device) for x in (pos, block, sink, sees_all, reach))
    causal = p[None, :] <= p[:, None]
    same = b[None, :] == b[:, None]
    reached = (p[None, :] < system) | (p[None, :] >= r[:, None])
    allowed = causal & (same | (a[:, None] & ~s_[None, :] & reached))
    logits, _ = forward(
        lm,
        torch.tensor([ids], device=device),
        positions=p[None],
        mask=additive_mask(allowed, lm.dtype),
        logits_to_keep=keep,
        grad=torch.is_grad_enabled(),
    )
    return logits[0]
