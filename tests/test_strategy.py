"""Strategy: parsed once from a user's spelling, printed back to the same spelling; the
positions each link strategy recomputes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rag_kvcache.config import EngineConfig
from rag_kvcache.errors import StrategyError
from rag_kvcache.link.selection import GradualFilter, filter_counts, select_positions
from rag_kvcache.strategy import PREFILL, Strategy


@pytest.mark.parametrize(
    "name, expected",
    [
        ("prefill", Strategy("prefill")),
        ("full", Strategy("full")),
        ("naive", Strategy("naive")),
        ("legolink:4", Strategy("legolink", k=4)),
        (" LegoLink:0 ", Strategy("legolink", k=0)),
        ("legolink0", Strategy("legolink0")),
        ("cacheblend:0.15", Strategy("cacheblend", ratio=0.15)),
        ("cacheblend:1", Strategy("cacheblend", ratio=1.0)),
        ("positions", Strategy("positions")),
        ("legolink:2+reversed", Strategy("legolink", k=2, order="reversed")),
        (" Prefill+Rotated", Strategy("prefill", order="rotated")),
        ("legolink:2+ends+top:1", Strategy("legolink", k=2, order="ends", top=1)),
        ("cacheblend:0.25+reversed", Strategy("cacheblend", ratio=0.25, order="reversed")),
        ("legolink:2+top:1", Strategy("legolink", k=2, top=1)),
        ("naive+reversed+top:3", Strategy("naive", order="reversed", top=3)),
        ("legolink0+top:2", Strategy("legolink0", top=2)),
        ("naive+ape:0.7,0.8", Strategy("naive", temperature=0.7, scale=0.8)),
        (
            "legolink:2+reversed+top:1+ape:0.5,2",
            Strategy("legolink", k=2, order="reversed", top=1, temperature=0.5, scale=2.0),
        ),
        ("legolink:2+ape:1,1", Strategy("legolink", k=2)),  # APE at 1, 1 is plain linking
        ("naive+reversed+top:1+window:256", Strategy("naive", order="reversed", top=1, window=256)),
        ("legolink:2+window:0", Strategy("legolink", k=2, window=0)),
        (
            "naive+top:1+window:64+ape:0.7,0.8",
            Strategy("naive", top=1, window=64, temperature=0.7, scale=0.8),
        ),
        ("naive+calibrated", Strategy("naive", calibrated=True)),
        (" LegoLink:2 + Reversed ", Strategy("legolink", k=2, order="reversed")),  # (refused)
        (
            "legolink:2+reversed+top:1+ape:0.5,2+calibrated",
            Strategy(
                "legolink",
                k=2,
                order="reversed",
                top=1,
                temperature=0.5,
                scale=2.0,
                calibrated=True,
            ),
        ),
    ],
)
def test_parse(name: str, expected: Strategy) -> None:
    assert Strategy.parse(name) == expected
    assert Strategy.parse(str(expected)) == expected
    assert Strategy.parse(expected) is expected  # already parsed: passed through


@given(st.integers(0, 10**6))
def test_legolink_round_trips(k: int) -> None:
    strategy = Strategy("legolink", k=k)
    assert str(strategy) == f"legolink:{k}" and Strategy.parse(str(strategy)) == strategy


@given(st.floats(0, 1, allow_nan=False))
def test_cacheblend_round_trips(ratio: float) -> None:
    strategy = Strategy("cacheblend", ratio=round(ratio, 6))
    assert Strategy.parse(str(strategy)) == strategy


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "legolink",
        "legolink:-1",
        "cacheblend:2",
        "blend",
        "full:1",
        "prefill:1",
        "full+backwards",
        "full+reversed+rotated",
        "positions+reversed",
        "+reversed",
        "naive+top:",
        "naive+top:1+reversed",
        "naive+top:1+top:2",
        "naive+given",
        "naive+",
        "naive+ape:1",
        "naive+ape:0,1",
        "naive+ape:1,x",
        "naive+ape:inf,1",
        "naive+ape:1e-45,1",  # keys divided by it overflowed: NaN logits, token 0 repeated
        "naive+ape:0.009,1",
        "naive+ape:1,1+top:1",
        "full+ape:0.5,1",
        "prefill+ape:1,2",
        "cacheblend:0.3+ape:0.5,1",  # its stale set changes from layer to layer
        "prefill+calibrated",
        "full+calibrated",
        "cacheblend:0.3+calibrated",
        "naive+calibrated+top:1",
        "naive+calibrated+calibrated",
        "naive+window:",
        "naive+window:-1",
        "naive+window:1+top:1",
        "naive+ape:0.5,1+window:1",
        "full+window:8",
        "prefill+window:8",
        "cacheblend:0.3+window:8",
        "naive+window:8+calibrated",
        "legolink:\u0662",  # an Arabic-Indic 2, taken for 2
        "naive+top:\u0663",
        "naive+window:\uff18",  # a fullwidth 8
    ],
)
def test_parse_rejects_with_allowed_names(bad: str) -> None:
    with pytest.raises(StrategyError, match="legolink:K"):
        Strategy.parse(bad)


@pytest.mark.parametrize(
    "fields", [dict(kind="nope"), dict(kind="naive", k=2), dict(kind="legolink", k=-1),
               dict(kind="full", ratio=0.5), dict(kind="cacheblend", ratio=1.5),
               dict(kind="full", top=1), dict(kind="prefill", top=1), dict(kind="naive", top=-1),
               dict(kind="naive", window=-1), dict(kind="full", window=4)]
)  # fmt: skip
def test_fields_are_checked_when_built(fields: dict) -> None:
    with pytest.raises(StrategyError):
        Strategy(**fields)


@pytest.mark.parametrize(
    "spelling",
    ["legolink:99999999999999999999", "naive+top:2147483648", "legolink:2+window:" + "9" * 20],
)
def test_counts_past_any_context_are_refused_not_overflowed(spelling: str) -> None:
    """A count no context can hold is a StrategyError when parsed, not an overflow inside a
    request (a server's request would fail the batch it was linked in)."""
    with pytest.raises(StrategyError, match="more than any context holds"):
        Strategy.parse(spelling)
    assert Strategy.parse("naive+top:2147483647+window:2147483647").window == 2**31 - 1


def test_orders_arrange_the_document_chunks() -> None:
    chunks = ["a", "b", "c"]
    assert Strategy.parse("naive").arrange(chunks) == ["a", "b", "c"]
    assert Strategy.parse("naive+reversed").arrange(chunks) == ["c", "b", "a"]
    assert Strategy.parse("naive+rotated").arrange(chunks) == ["b", "c", "a"]
    assert Strategy.parse("naive+rotated").arrange([]) == []
    assert Strategy.parse("naive+ends").arrange(chunks) == ["b", "c", "a"]
    assert Strategy.parse("naive+ends").arrange([]) == []


@pytest.mark.parametrize("n", range(1, 9))
def test_ends_is_llama_index_long_context_reorder_with_the_best_nearest_the_question(n) -> None:
    """`+ends` places chunks as LlamaIndex's LongContextReorder does (best-ranked at the ends,
    least relevant in the middle), mirrored where that puts the best first (an odd count),
    so that the best is always last, next to the question."""
    from llama_index.core.postprocessor import LongContextReorder
    from llama_index.core.schema import NodeWithScore, TextNode

    ranked = [f"c{i}" for i in range(n)]  # best first, as retrieval gives cache IDs
    nodes = [NodeWithScore(node=TextNode(text=c), score=1.0 - i / n) for i, c in enumerate(ranked)]
    theirs = [x.node.get_content() for x in LongContextReorder().postprocess_nodes(nodes)]
    ours = Strategy.parse("prefill+ends").arrange(ranked)
    assert ours == (theirs if theirs[-1] == "c0" else theirs[::-1])
    assert ours[-1] == "c0" and sorted(ours) == sorted(ranked)


def test_top_ranks_follow_the_given_order_wherever_placed() -> None:
    assert Strategy.parse("naive+top:1").in_full(3) == [True, False, False]
    assert Strategy.parse("naive+reversed+top:1").in_full(3) == [False, False, True]
    assert Strategy.parse("naive+rotated+top:2").in_full(3) == [True, False, True]
    assert Strategy.parse("naive+ends+top:2").in_full(4) == [True, False, False, True]
    assert Strategy.parse("naive+top:9").in_full(2) == [True, True]
    assert Strategy.parse("legolink:2+top:0") == Strategy.parse("legolink:2")


def test_the_baseline_is_a_prefill_of_the_same_prompt() -> None:
    assert Strategy.parse("legolink:2+reversed+top:1+ape:0.7,0.8").baseline == Strategy.parse(
        "prefill+reversed"
    )
    assert Strategy.parse("naive").baseline == PREFILL
    assert Strategy.parse("prefill+rotated").baseline == Strategy.parse("prefill+rotated")


def test_config_parses_a_spelling_once_and_keeps_a_strategy() -> None:
    assert EngineConfig(strategy="legolink:16").strategy == Strategy("legolink", k=16)  # type: ignore[arg-type]
    assert EngineConfig().strategy == Strategy.parse(
        "legolink:2+reversed+top:1+window:1024+ape:1,0.5"
    )
    assert not PREFILL.uses_cache and Strategy("legolink0").needs_sinks


@pytest.mark.parametrize(
    "name, expected",
    [
        ("full", list(range(12))),
        ("naive", []),
        ("legolink0", []),
        ("legolink:2", [4, 5, 9, 10]),  # chunk 0 (prefix, 4 tokens) is never recomputed
        ("legolink:9", [4, 5, 6, 7, 8, 9, 10, 11]),  # k past a chunk's length takes it whole
        ("legolink:2+top:1", [4, 5, 6, 7, 8, 9, 10]),  # the first-ranked chunk whole
        ("naive+reversed+top:1", [9, 10, 11]),  # ranked first, placed last
        ("legolink0+top:5", [4, 5, 6, 7, 8, 9, 10, 11]),
    ],
)
def test_select_positions(name: str, expected: list[int]) -> None:
    assert select_positions(Strategy.parse(name), [4, 5, 3]).tolist() == expected


@pytest.mark.parametrize(
    "pool, target, layers, expected",
    [
        (100, 15, 8, [100, 100, 30, 22, 19, 15, 15, 15]),  # 2 full layers, then 2x 1.5x 1.25x
        (100, 15, 4, [100, 100, 30, 15]),  # a shallow model: the first widths that fit
        (100, 15, 3, [100, 100, 15]),
        (100, 60, 6, [100, 100, 100, 90, 75, 60]),  # widths capped at the pool
        (100, 0, 5, [0, 0, 0, 0, 0]),  # nothing recomputed: naive
        (100, 100, 5, [100, 100, 100, 100, 100]),  # everything: full
        (100, 15, 2, [100, 100]),  # no layer to measure deviation on before the last
    ],
)
def test_cacheblend_schedule(pool: int, target: int, layers: int, expected: list[int]) -> None:
    assert filter_counts(pool, target, layers) == expected


def _moved(values: torch.Tensor, layer: int, deviation: dict[int, float]) -> None:
    """What a layer's forward does to the values buffer [layers, 1, L, 1]: writes fresh ones."""
    for position, amount in deviation.items():
        values[layer, 0, position, 0] += amount


def test_cacheblend_keeps_the_most_deviating_candidates_layer_by_layer() -> None:
    values = torch.zeros(4, 1, 10, 1)  # prefix = first 2 tokens, then two chunks of 4
    blend = GradualFilter(Strategy.parse("cacheblend:0.25"), [2, 4, 4], layers=4)
    assert blend.counts == [8, 8, 4, 2] and blend.rows.tolist() == list(range(2, 10))
    assert blend.next_rows(0, values) is None and blend.next_rows(1, values) is None
    _moved(values, 1, {2: 0.0, 3: 5, 4: 1, 5: 7, 6: 0, 7: 2, 8: 9, 9: 3})
    assert blend.next_rows(2, values).tolist() == [1, 3, 6, 7]  # rows 3, 5, 8, 9
    _moved(values, 2, {3: 1.0, 5: 4, 8: 2, 9: 0.5})
    assert blend.next_rows(3, values).tolist() == [1, 2]  # rows 5 and 8
    assert [s.tolist() for s in blend.sets] == [[*range(2, 10)]] * 2 + [[3, 5, 8, 9], [5, 8]]
    assert blend.recomputed == 6  # (8 + 8 + 4 + 2) / 4 layers


def test_cacheblend_never_ranks_the_chunks_recomputed_whole() -> None:
    values = torch.zeros(4, 1, 10, 1)
    blend = GradualFilter(Strategy.parse("cacheblend:0.25+top:1"), [2, 4, 4], layers=4)
    assert blend.counts == [4, 4, 4, 2]  # 2 of 8 document tokens, ranked among the other 4
    for layer in range(3):
        assert blend.next_rows(layer, values) is None
    _moved(values, 2, {2: 9.0, 3: 9, 6: 1, 7: 3, 8: 0, 9: 2})
    assert blend.next_rows(3, values).tolist() == [0, 1, 2, 3, 5, 7]
    assert blend.rows.tolist() == [2, 3, 4, 5, 7, 9]  # chunk 1 whole, then the 2 most moved
    with pytest.raises(StrategyError, match="layer by layer"):
        select_positions(Strategy.parse("cacheblend:0.25"), [2, 4, 4])


def test_positions_are_made_on_the_device_asked_for() -> None:
    meta = select_positions(Strategy.parse("legolink:2"), [4, 5, 3], device="meta")
    assert meta.device.type == "meta" and meta.shape == (4,)
