"""Strategy: parsed once from a user's spelling, printed back to the same spelling; the
positions each link strategy recomputes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rag_kvcache.config import EngineConfig
from rag_kvcache.errors import StrategyError
from rag_kvcache.link.selection import select_positions
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
        "naive+ape:1,1+top:1",
        "full+ape:0.5,1",
        "prefill+ape:1,2",
    ],
)
def test_parse_rejects_with_allowed_names(bad: str) -> None:
    with pytest.raises(StrategyError, match="legolink:K"):
        Strategy.parse(bad)


@pytest.mark.parametrize(
    "fields", [dict(kind="nope"), dict(kind="naive", k=2), dict(kind="legolink", k=-1),
               dict(kind="full", ratio=0.5), dict(kind="cacheblend", ratio=1.5),
               dict(kind="full", top=1), dict(kind="prefill", top=1), dict(kind="naive", top=-1)]
)  # fmt: skip
def test_fields_are_checked_when_built(fields: dict) -> None:
    with pytest.raises(StrategyError):
        Strategy(**fields)


def test_orders_arrange_the_document_chunks() -> None:
    chunks = ["a", "b", "c"]
    assert Strategy.parse("naive").arrange(chunks) == ["a", "b", "c"]
    assert Strategy.parse("naive+reversed").arrange(chunks) == ["c", "b", "a"]
    assert Strategy.parse("naive+rotated").arrange(chunks) == ["b", "c", "a"]
    assert Strategy.parse("naive+rotated").arrange([]) == []


def test_top_ranks_follow_the_given_order_wherever_placed() -> None:
    assert Strategy.parse("naive+top:1").in_full(3) == [True, False, False]
    assert Strategy.parse("naive+reversed+top:1").in_full(3) == [False, False, True]
    assert Strategy.parse("naive+rotated+top:2").in_full(3) == [True, False, True]
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
    assert EngineConfig().strategy == Strategy("legolink", k=16, order="reversed")
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


def test_cacheblend_picks_the_largest_deviations_among_documents() -> None:
    deviation = torch.tensor([9.0, 9, 0, 0, 5, 1, 7, 0, 2, 0])  # prefix = first 2 tokens
    picked = select_positions(Strategy.parse("cacheblend:0.25"), [2, 4, 4], deviation)
    assert picked.tolist() == [4, 6]  # 25% of 8 document tokens, prefix ignored


def test_positions_are_made_on_the_device_asked_for() -> None:
    meta = select_positions(Strategy.parse("legolink:2"), [4, 5, 3], device="meta")
    assert meta.device.type == "meta" and meta.shape == (4,)
