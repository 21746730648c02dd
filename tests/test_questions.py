"""Questions prefilled together over their paths in the prefix tree equal each question linked
alone over its whole context."""

from __future__ import annotations

import pytest
import torch
from helpers import SERVING_DOCS, linked_span

from rag_kvcache import EngineConfig, RagKVCache
from rag_kvcache.link.linker import link
from rag_kvcache.model.adapter import key_bias
from rag_kvcache.serving.prefix_tree import PrefixTree, TreeNode, path_to
from rag_kvcache.serving.questions import prefill_questions
from rag_kvcache.strategy import Strategy

DOCS = SERVING_DOCS[:4]


@pytest.mark.parametrize(
    "model, tolerance, strategy",
    [
        ("tiny64", 1e-10, "legolink:2"),
        ("tiny32", 2e-4, "legolink:2"),
        ("tiny64", 1e-10, "legolink:2+ape:0.7,0.5"),
        ("tiny32", 2e-4, "naive+ape:1,0.5"),
    ],
)
def test_questions_together_equal_each_linked_alone(model, tolerance, strategy, request) -> None:
    """Paths that share nodes, a path that is another's prefix, a separate root; questions of
    different lengths, two on one path. Each question's KV and next-token logits equal
    `link` of its whole context and question at once (float64: to rounding; float32: through
    the fused CPU kernels), APE's scale included (each node keeps its score bias)."""
    lm = request.getfixturevalue(model)
    STRATEGY = Strategy.parse(strategy)
    engine = RagKVCache(EngineConfig(), lm=lm)
    ids = engine.generate_context_cache(DOCS)
    chunk_of = dict(zip([engine.prefix_id, *ids], engine.store.get([engine.prefix_id, *ids])))
    tree = PrefixTree(1 << 30)

    def extend(parent: TreeNode | None, key: str, cache_ids: list[str]) -> TreeNode:
        """The node after `parent` for the last chunk of `cache_ids`, linked after the rest."""
        linked = link(lm, [chunk_of[c] for c in cache_ids], [1], STRATEGY)
        start = parent.end if parent is not None else 0
        keys, values = linked_span(linked, start, linked.context_tokens)
        size = [chunk_of[cache_ids[-1]].num_tokens] if parent else [linked.context_tokens]
        bias = key_bias(linked.cache)
        assert (bias is not None) == (STRATEGY.scale != 1)
        if bias is not None:
            bias = bias[start : linked.context_tokens]
        return tree.insert(parent, [key], size, list(keys), list(values), bias)

    system = extend(None, "a", [engine.prefix_id])
    first = extend(system, ids[0], [engine.prefix_id, ids[0]])
    second = extend(first, ids[1], [engine.prefix_id, ids[0], ids[1]])
    third = extend(first, ids[2], [engine.prefix_id, ids[0], ids[2]])
    apart = extend(None, "b", [engine.prefix_id, ids[3]])
    context = {
        first: [ids[0]],
        second: [ids[0], ids[1]],
        third: [ids[0], ids[2]],
        apart: [ids[3]],
    }
    asked = [
        (second, "Who designed the lighthouse?"),
        (third, "How deep is it?"),
        (second, "When was the lighthouse first lit, and what did it burn?"),
        (first, "Who?"),
        (apart, "When is the kite festival held?"),
    ]
    questions = [engine.template.question_ids(lm.tokenizer, q) for _, q in asked]
    together = prefill_questions(lm, [path_to(leaf) for leaf, _ in asked], questions)
    for (leaf, _), question, got in zip(asked, questions, together, strict=True):
        chunks = [chunk_of[c] for c in [engine.prefix_id, *context[leaf]]]
        alone = link(lm, chunks, question, STRATEGY)
        assert alone.context_tokens == leaf.end
        keys, values = linked_span(alone, alone.context_tokens, alone.length)
        torch.testing.assert_close(torch.stack(got.keys), keys, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(torch.stack(got.values), values, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(got.logits, alone.next_logits, rtol=tolerance, atol=tolerance)
