import pytest
import torch

from rag_kvcache.errors import StrategyError
from rag_kvcache.strategy import LinkStrategy, parse_strategy, select_positions


@pytest.mark.parametrize(
    "name, expected",
    [
        ("full", LinkStrategy("full")),
        ("naive", LinkStrategy("naive")),
        ("legolink:4", LinkStrategy("legolink", k=4)),
        (" LegoLink:0 ", LinkStrategy("legolink", k=0)),
        ("legolink0", LinkStrategy("legolink0")),
        ("cacheblend:0.15", LinkStrategy("cacheblend", ratio=0.15)),
    ],
)
def test_parse(name: str, expected: LinkStrategy) -> None:
    assert parse_strategy(name) == expected
    assert parse_strategy(str(expected)) == expected


@pytest.mark.parametrize("bad", ["", "legolink", "legolink:-1", "cacheblend:2", "blend", "full:1"])
def test_parse_rejects_with_allowed_names(bad: str) -> None:
    with pytest.raises(StrategyError, match="legolink:K"):
        parse_strategy(bad)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("full", list(range(12))),
        ("naive", []),
        ("legolink0", []),
        ("legolink:2", [4, 5, 9, 10]),  # chunk 0 (prefix, 4 tokens) is never recomputed
        ("legolink:9", [4, 5, 6, 7, 8, 9, 10, 11]),  # k past a chunk's length takes it whole
    ],
)
def test_select_positions(name: str, expected: list[int]) -> None:
    assert select_positions(parse_strategy(name), [4, 5, 3]).tolist() == expected


def test_cacheblend_picks_the_largest_deviations_among_documents() -> None:
    deviation = torch.tensor([9.0, 9, 0, 0, 5, 1, 7, 0, 2, 0])  # prefix = first 2 tokens
    picked = select_positions(parse_strategy("cacheblend:0.25"), [2, 4, 4], deviation)
    assert picked.tolist() == [4, 6]  # 25% of 8 document tokens, prefix ignored
