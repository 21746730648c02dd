"""Many requests' questions prefilled in one forward, each over its own linked prefix in the tree.

A request whose whole context is already in the prefix tree (a popular set of chunks, a burst
of questions over the same documents) needs only its question computed. One at a time that is
a forward of a few tokens per request, each over a copy of its prefix (`link`'s buffer); here
all of them go through the model together, and attention runs in the batch decoder's two
phases (`cascade_attention`): every tree node once for all the question tokens whose path
passes through it, read in place, then each question's own tokens, causally.

Questions are left-padded to the longest, so every question's last token is the batch's last
column (one logits row each); a pad is never attended to. A forward takes as many questions
as `fit_together` allows (short questions: a whole burst; long ones, e.g. with chat history,
a few at a time). The result equals linking each
question alone over its prefix (`link(lm, [], question, strategy, prefix=...)`), APE's scale
included: a node's score bias (`TreeNode.bias`) is added wherever it is attended.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_kvcache.model.adapter import forward, hook_cache
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.serving.cascade import SharedKV, cascade_attention
from rag_kvcache.serving.prefix_tree import TreeNode

# Each question token reads its own question's keys from a [tokens, longest question] copy, so
# one forward holds (question tokens x longest question) keys and values per layer: bounded.
MAX_TOKEN_PAIRS = 1 << 15


def fit_together(lengths: list[int]) -> bool:
    """Whether questions of these lengths go in one forward (`MAX_TOKEN_PAIRS`)."""
    return sum(lengths) * max(lengths, default=0) <= MAX_TOKEN_PAIRS


@dataclass(frozen=True)
class QuestionKV:
    """A question's KV per layer ([kv_heads, its tokens, head_dim]) and the logits after it."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor  # [vocab]


def prefill_questions(
    lm: LoadedModel, paths: list[list[TreeNode]], questions: list[list[int]]
) -> list[QuestionKV]:
    """Each question after its path of tree nodes (root first; its first token at the path's
    end position), all in one forward."""
    device, n = lm.device, len(questions)
    lengths = torch.tensor([len(q) for q in questions], device=device)
    width = int(lengths.max())
    pads = width - lengths  # [n]
    ids = torch.zeros(n, width, dtype=torch.long, device=device)
    for i, (question, pad) in enumerate(zip(questions, pads.tolist(), strict=True)):
        ids[i, pad:] = torch.tensor(question, device=device)
    columns = torch.arange(width, device=device)
    starts = torch.tensor([path[-1].end for path in paths], device=device)
    positions = (starts[:, None] - pads[:, None] + columns[None, :]).clamp(min=0)  # pads: any
    real = columns[None, :] >= pads[:, None]  # [n, width]
    request = real.nonzero()[:, 0]  # each real token's request, request by request
    seen = columns[None, :].expand(n, -1)[real] - pads[request] + 1  # own tokens each one sees
    aligned = (columns[None, :] + pads[:, None]).clamp(max=width - 1)  # own tokens from column 0
    first = torch.cumsum(lengths, 0) - lengths
    rows_of: dict[TreeNode, list[int]] = {}  # a node: the real tokens that attend to it
    for path, start, length in zip(paths, first.tolist(), lengths.tolist(), strict=True):
        rows = list(range(start, start + length))
        for node in path:
            rows_of.setdefault(node, []).extend(rows)
    new_keys: dict[int, torch.Tensor] = {}  # by layer: [n, kv_heads, width, head_dim]
    new_values: dict[int, torch.Tensor] = {}

    def store_new(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        new_keys[layer], new_values[layer] = keys, values

    def own(kv: torch.Tensor) -> torch.Tensor:
        """[n, kv_heads, width, dim] -> each real token's own question [rows, width, kv, dim]."""
        kv = kv.transpose(1, 2)
        index = aligned[:, :, None, None].expand(-1, -1, kv.shape[2], kv.shape[3])
        return kv.gather(1, index)[request]

    def attend(layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        tokens = query.transpose(1, 2)[real]  # [rows, heads, head_dim]
        shared = [
            SharedKV(
                node.keys[layer].transpose(0, 1),
                node.values[layer].transpose(0, 1),
                rows,
                node.bias,
            )
            for node, rows in rows_of.items()
        ]
        private = (own(new_keys[layer]), own(new_values[layer]), seen)
        out = query.new_zeros(n, width, *tokens.shape[1:])
        out[real] = cascade_attention(tokens, shared, scale, private)
        return out

    logits, _ = forward(
        lm,
        ids,
        positions=positions,
        cache=hook_cache(lm, store_new),
        logits_to_keep=1,
        attention_hook=attend,
    )
    layers = range(lm.num_layers)
    return [
        QuestionKV(
            [new_keys[layer][i, :, pad:] for layer in layers],
            [new_values[layer][i, :, pad:] for layer in layers],
            logits[i, -1],
        )
        for i, pad in enumerate(pads.tolist())  # one read of pads, not one per layer
    ]
