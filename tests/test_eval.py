"""Evaluation: the metrics on hand-made cases, the evaluator's invariants on the tiny model, the
needle builder, and `rag-kvcache eval` end to end on SmolLM2."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rag_kvcache import EncodeConfig, EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.config import LEGOLINK0_SINKS
from rag_kvcache.errors import ConfigError, StrategyError
from rag_kvcache.model.loading import LoadedModel
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.cli import main
from rag_kvcache.tools.eval.dataset import EvalItem, in_retrieval_order, load_dataset
from rag_kvcache.tools.eval.evaluator import Evaluator, check_strategies, run_eval
from rag_kvcache.tools.eval.floor import against_floor, kept_against, other_run
from rag_kvcache.tools.eval.journal import Journal
from rag_kvcache.tools.eval.needle import NEEDLE, NEEDLES, needle_cells, needle_item
from rag_kvcache.tools.eval.report import comparisons, report_dict, save_eval
from rag_kvcache.tools.eval.results import ItemResult, markdown_table, summarize
from rag_kvcache.tools.eval.reuse import item_digests, reused_rows, same_model
from rag_kvcache.tools.metrics import (
    Estimate,
    accuracy,
    contains_answer,
    exact_match,
    f1_score,
    kept,
    kept_difference,
    kl_per_step,
    normalize_answer,
    top1_agreement,
)

DEV_SET = Path(__file__).resolve().parent / "data" / "dev_qa.jsonl"


# ----------------------------------------------------------------------------- metrics


def test_squad_normalisation() -> None:
    assert normalize_answer("  The Harbor-Reeve,  Mara   Quell! ") == "harborreeve mara quell"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_f1_and_exact_match() -> None:
    assert f1_score("Mara Quell", ["mara quell."]) == 1.0
    assert exact_match("Mara Quell", ["mara quell."]) == 1.0
    # "It is Mara Quell": 2 of 4 normalised tokens match ("it is mara quell" vs "mara quell")
    assert f1_score("It is Mara Quell", ["Mara Quell"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert exact_match("It is Mara Quell", ["Mara Quell"]) == 0.0
    assert f1_score("1788", ["1901", "in 1788"]) == pytest.approx(2 / 3)  # best reference wins
    assert f1_score("", ["1788"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to nothing


def test_contains_answer_matches_whole_words() -> None:
    assert contains_answer("It was founded in 1901.", ["1901"])
    assert not contains_answer("It was founded in 19011.", ["1901"])
    assert contains_answer("the Saltreach Oars crew", ["Saltreach Oars"])
    assert not contains_answer("anything", ["the"])  # an answer that normalises to nothing


def test_kl_and_top1() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kl_per_step(logits, logits), torch.zeros(5, dtype=torch.float64))
    assert top1_agreement(logits, logits) == 1.0
    other = logits.clone()
    other[0] = torch.zeros(50)  # uniform: KL(p || uniform) = log(50) - H(p)
    p = torch.softmax(logits[0].double(), -1)
    expected = torch.log(torch.tensor(50.0, dtype=torch.float64)) + (p * p.log()).sum()
    kl = kl_per_step(logits, other)
    assert kl[0] == pytest.approx(float(expected), rel=1e-9) and kl[1:].abs().max() == 0
    other[1, logits[1].argmax()] = -100
    assert logits[0].argmax() != 0  # so row 0 (uniform: argmax 0) disagrees too
    assert top1_agreement(logits, other) == pytest.approx(3 / 5)


def test_the_bootstrap_interval_of_a_constant_is_a_point() -> None:
    for right in ([True] * 40, [False] * 40):
        estimate = accuracy(right)
        assert estimate.low == estimate.value == estimate.high == 100.0 * right[0]
    assert kept([True] * 30, [True] * 30) == Estimate(100.0, 100.0, 100.0, 30)
    assert str(kept([True] * 30, [True] * 30)) == "100.0% [100.0, 100.0] (n=30)"
    assert str(kept([False] * 4, [True] * 4)) == "n/a (n=0: no right answer to keep)"  # was nan%


def test_kept_counts_only_the_items_the_baseline_gets_right() -> None:
    baseline = [True, True, True, True, False, False]
    right = [True, False, True, True, True, True]  # right where prefill was wrong: not counted
    estimate = kept(baseline, right)
    assert estimate.value == 75.0 and estimate.n == 4
    assert 0 <= estimate.low <= 75.0 <= estimate.high <= 100
    assert kept(baseline, right) == estimate  # seeded: the same resamples every time
    assert accuracy(right).value == pytest.approx(100 * 5 / 6)
    nothing = kept([False, False], [True, True])
    assert nothing.n == 0 and math.isnan(nothing.value)
    with pytest.raises(ValueError):
        kept([True], [True, False])


def test_kept_difference_pairs_the_items() -> None:
    """The cache against the noise floor, on the items the baseline gets right."""
    baseline = [True] * 4 + [False] * 2
    same = kept_difference(baseline, [True, True, False, False, True, True], baseline)
    assert same.n == 4 and same.value == -50.0  # the floor keeps all 4, the cache 2
    assert same.low <= -50.0 <= same.high <= 0
    cache = [True, False, True, True, False, False]
    floor = [False, True, True, True, True, False]  # each loses one: the difference is 0
    tie = kept_difference(baseline, cache, floor)
    assert tie.value == 0.0 and tie.low < 0 < tie.high  # paired, but which one differs varies
    assert kept_difference(baseline, baseline, baseline) == Estimate(0.0, 0.0, 0.0, 4)
    assert kept_difference([False], [True], [False]).n == 0
    with pytest.raises(ValueError, match="pair up"):
        kept_difference([True], [True], [True, False])


def test_interval_narrows_with_more_items() -> None:
    small, large = accuracy([True, False] * 10), accuracy([True, False] * 200)
    assert small.value == large.value == 50.0
    assert large.high - large.low < (small.high - small.low) / 3


# ----------------------------------------------------------------------------- datasets


def test_load_dataset_reports_the_bad_line(tmp_path: Path) -> None:
    good = {"id": "a", "documents": [{"id": "d", "text": "x"}], "question": "q", "answers": ["x"]}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "documents": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"set.jsonl:3: expected"):
        load_dataset(path)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"set.jsonl:2"):
        load_dataset(path)
    path.write_text(json.dumps({**good, "answers": []}) + "\n")
    with pytest.raises(ConfigError, match="non-empty"):
        load_dataset(path)
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")  # past Python's recursion limit:
    with pytest.raises(ConfigError, match=r"set.jsonl:1: expected"):  # was a traceback
        load_dataset(path)
    path.write_text(json.dumps(good) + "\n")
    assert load_dataset(path) == [EvalItem("a", ("x",), "q", ("x",))]


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ({"answers": "Anna"}, "answers must be a list"),  # was read as A, n, n, a
        ({"answers": ["The"]}, "empty once normalised"),  # could never be right
        ({"question": ["Who", "built"]}, "the question must be a string"),
        ({"documents": [{"id": "d", "text": None}]}, "a document's text must be a string"),
        ({"id": ["a"]}, "id must be a string or a number"),
        ({"documents": [{"id": "d", "text": " "}]}, "a document's text is empty"),  # mid-run
    ],
)
def test_load_dataset_refuses_values_of_the_wrong_kind(tmp_path: Path, change, phrase) -> None:
    """Values were passed through str(): a string of answers became its letters (an answer "4"
    then matched any output with a 4 in it), a list question its repr, a null text "None"."""
    good = {"id": "a", "documents": [{"id": "d", "text": "x"}], "question": "q", "answers": ["x"]}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({**good, **change}) + "\n")
    with pytest.raises(ConfigError, match=rf"set.jsonl:1: .*{phrase}"):
        load_dataset(path)


def test_load_dataset_refuses_an_id_twice_and_unreadable_files(tmp_path: Path) -> None:
    """Rows are matched by item id: a second item of one id silently took the first one's place
    in "kept" (and, resuming, its answers). Unreadable files were raw tracebacks."""
    good = {"id": "a", "documents": [{"id": "d", "text": "x"}], "question": "q", "answers": ["x"]}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "question": "q2"}) + "\n")
    with pytest.raises(ConfigError, match=r"set.jsonl:2: id 'a' is already line 1's"):
        load_dataset(path)
    path.write_bytes(b"\xff\xfe binary")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_dataset(path)
    with pytest.raises(ConfigError, match="cannot read .*missing.jsonl"):
        load_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="cannot read"):
        load_dataset(tmp_path)


def test_the_development_set_is_well_formed() -> None:
    items = load_dataset(DEV_SET)
    assert len(items) >= 30 and len({i.id for i in items}) == len(items)
    where = []
    for item in items:
        assert 3 <= len(item.documents) <= 5
        holding = [i for i, d in enumerate(item.documents) if item.answers[0] in d]
        assert len(holding) == 1, f"{item.id}: the answer must be in exactly one document"
        where.append(holding[0] / (len(item.documents) - 1))
    assert min(where) == 0 and max(where) == 1  # answers at the start, the end, and between
    assert any(0 < w < 1 for w in where)


# ----------------------------------------------------------------------------- the evaluator


def test_full_agrees_with_itself_and_recomputing_everything_is_full(tiny32) -> None:
    item = EvalItem(
        "t",
        ("The lighthouse was built in 1788.", "The bakery opens at five.", "Six crews row."),
        "When was the lighthouse built?",
        ("1788",),
    )
    evaluator = Evaluator(tiny32, max_new_tokens=6, teacher_tokens=4)
    strategies = check_strategies(["naive", "legolink:64", "legolink0", "full"])
    assert [str(s) for s in strategies] == ["full", "prefill", "naive", "legolink:64", "legolink0"]
    results = {r.strategy: r for r in evaluator.run_item(item, strategies)}
    full = results["full"]
    assert (full.kl, full.top1) == (0.0, 1.0)
    assert full.recomputed_tokens == full.context_tokens
    everything = results["legolink:64"]  # k beyond every chunk's length: all recomputed
    assert everything.kl == pytest.approx(0.0, abs=1e-9) and everything.top1 == 1.0
    assert everything.answer == full.answer
    assert results["naive"].recomputed_tokens == 0 and results["naive"].kl > 0
    summary = {s.strategy: s for s in summarize(list(results.values()), strategies)}
    assert summary["full"].recomputed_fraction == 1.0 and summary["naive"].items == 1
    prefill = summary["prefill"]  # prefill keeps all its own right answers, if it has any
    assert prefill.kept_of == int(results["prefill"].contains)
    assert prefill.kept == 100.0 or (prefill.kept_of == 0 and math.isnan(prefill.kept))


EVERY_STRATEGY = [
    "prefill",
    "naive",
    "legolink:2",
    "legolink0",
    "cacheblend:0.5",
    "legolink:2+reversed+top:1",
]


def test_eval_answers_are_the_engines_answers_token_for_token(tiny32) -> None:
    """`rag-kvcache eval` measures what users get: for every strategy its answers equal
    `RagKVCache.generate` on the same items, token for token."""
    items = [
        EvalItem("a", ("The lighthouse was built in 1788.", "Six crews row."), "When?", ("1788",)),
        EvalItem("b", ("The bakery opens at five.", "Bread.", "Eel."), "Who bakes?", ("x",)),
    ]
    results, _ = run_eval(tiny32, items, EVERY_STRATEGY, max_new_tokens=6, teacher_tokens=2)
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=6))
    engine = RagKVCache(config, lm=tiny32, store=MemoryStore())
    sinks = engine.with_encoding(EncodeConfig(sink_tokens=LEGOLINK0_SINKS))
    checked = set()
    for item in items:
        for result in (r for r in results if r.item == item.id):
            on = sinks if result.strategy == "legolink0" else engine
            ids = on.generate_context_cache(list(item.documents))
            answer = on.generate(item.question, ids, strategy=result.strategy)
            assert answer.token_ids == result.token_ids and answer.text == result.answer
            checked.add(result.strategy)
    assert checked == {"full", "prefill+reversed", *EVERY_STRATEGY}  # + the placement's baseline


def _result(item: str, strategy: str, right: bool) -> ItemResult:
    return ItemResult(item, strategy, "", (), 0.0, 0.0, right, math.nan, math.nan, 1.0, 2.0, 10, 0)


def test_kept_is_counted_against_prefill_with_the_same_placement() -> None:
    strategies = check_strategies(["naive+reversed", "naive"])
    assert [str(s) for s in strategies] == [
        "full", "prefill", "naive+reversed", "naive", "prefill+reversed"
    ]  # fmt: skip
    right = {  # item -> right answers
        "a": {"prefill", "prefill+reversed", "naive+reversed"},
        "b": {"prefill+reversed", "naive+reversed", "naive"},
        "c": {"prefill"},
    }
    results = [
        _result(item, str(s), str(s) in rights)
        for item, rights in right.items()
        for s in strategies
    ]
    summary = {s.strategy: s for s in summarize(results, strategies)}
    placed = summary["naive+reversed"]
    assert (placed.baseline, placed.kept_of, placed.kept) == ("prefill+reversed", 2, 100.0)
    plain = summary["naive"]
    assert (plain.baseline, plain.kept_of, plain.kept) == ("prefill", 2, 0.0)
    floor = summary["prefill+reversed"]  # the noise floor: against prefill as given
    assert (floor.baseline, floor.kept_of, floor.kept) == ("prefill", 2, 50.0)
    assert math.isnan(placed.kl)  # no teacher forcing asked for: no KL, not a zero
    # where the baseline answers nothing there is nothing to keep: a dash, not "nan%"
    wrong = summarize([r for r in results if r.item == "c"], strategies)
    table = markdown_table(wrong)
    assert "| – of 0 (prefill+reversed) |" in table and "nan" not in table


def test_the_cache_is_compared_with_every_floor_the_run_measured(tmp_path: Path) -> None:
    strategies = check_strategies(["prefill+rotated", "naive+reversed"], with_full=False)
    right = {  # item -> strategies right
        "a": {"prefill", "prefill+reversed", "prefill+rotated", "naive+reversed"},
        "b": {"prefill+reversed", "prefill+rotated"},
        "c": {"prefill+reversed", "naive+reversed"},
        "d": {"prefill", "naive+reversed"},  # the baseline is wrong: not counted
    }
    results = [_result(i, str(s), str(s) in r) for i, r in right.items() for s in strategies]
    rows = {r.floor: r for r in against_floor(results, strategies)}
    assert set(rows) == {"prefill", "prefill+rotated"}  # not its own baseline
    rotated = rows["prefill+rotated"]
    assert (rotated.baseline, rotated.of, rotated.kept, rotated.floor_kept) == (
        "prefill+reversed",
        3,
        2,
        2,
    )
    assert rotated.difference == 0.0
    assert rows["prefill"].floor_kept == 1 and rows["prefill"].difference == pytest.approx(100 / 3)
    text, facts = comparisons(results, strategies)
    assert "| naive+reversed | 3 (prefill+reversed) | 2 | prefill+rotated | 2 | +0.0 pts" in text
    assert facts["floor"] == [asdict(r) for r in against_floor(results, strategies)]
    partial = [r for r in results if not (r.strategy == "prefill+rotated" and r.item == "a")]
    assert {r.floor for r in against_floor(partial, strategies)} == {"prefill"}  # unpaired
    none_right = [r for r in results if r.item == "d"]  # prefill+reversed right on none
    (nothing,) = [r for r in against_floor(none_right, strategies) if r.floor != "prefill"]
    assert nothing.of == 0
    assert (
        "| naive+reversed | 0 (prefill+reversed) | 0 | prefill+rotated | 0 | – |"
        in (comparisons(none_right, strategies)[0])
    )  # no right answer to keep: no difference, not "nan"


def test_needle_cells_count_where_prefill_finds_every_needle() -> None:
    strategies = check_strategies(["naive+reversed"], with_full=False)
    found = {  # item -> strategies that find the needle
        "needle-1024-0": {"prefill", "prefill+reversed", "naive+reversed"},
        "needle-1024-0-1": {"prefill", "prefill+reversed"},
        "needle-1024-0.5": {"prefill+reversed", "naive+reversed"},
        "needle-1024-0.5-1": {"prefill", "prefill+reversed", "naive+reversed"},
        "needle-2048-1": {"naive+reversed"},
    }
    results = [_result(i, str(s), str(s) in f) for i, f in found.items() for s in strategies]
    rows = {r.against: r for r in needle_cells(results, strategies)}
    plain, placed = rows["prefill"], rows["prefill+reversed"]
    assert (plain.cells, plain.found, plain.tried, plain.worst) == (1, 1, 2, 0.5)
    assert (placed.cells, placed.found, placed.tried, placed.worst) == (2, 3, 4, 0.5)
    text, facts = comparisons(results, strategies, needle=True)
    assert "| naive+reversed | prefill+reversed | 2 | 3 of 4 (75%) | 50% |" in text
    assert len(facts["needle_cells"]) == 2


def test_reports_and_plots_take_every_spelling(tmp_path: Path) -> None:
    """A placed or top-up legolink (`legolink:16+reversed`) is drawn beside the legolink:K
    curve, not parsed as a point of it."""
    strategies = check_strategies(["legolink:2", "legolink:16+reversed", "naive+reversed+top:1"])
    results = [_result(i, str(s), i == "a") for i in "ab" for s in strategies]
    measured = [replace(r, kl=0.1, top1=0.9) for r in results]  # as with teacher forcing
    save_eval(tmp_path, "eval", {"items": []}, summarize(measured, strategies))
    for png in ("eval_pareto.png", "eval_kl_k.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert "| legolink:16+reversed |" in (tmp_path / "eval.md").read_text()
    # no KL measured (--teacher-tokens 0): no KL plot, and the earlier run's is not left
    save_eval(tmp_path, "eval", {"items": []}, summarize(results, strategies))
    assert (tmp_path / "eval_pareto.png").exists() and not (tmp_path / "eval_kl_k.png").exists()


def test_kept_against_another_runs_prefill(tmp_path: Path) -> None:
    """The dtype's noise floor: this run's answers against another run's prefill answers."""
    other = tmp_path / "float32.json"
    theirs = {"a": True, "b": True, "c": False, "d": True}
    rows = [{"item": i, "strategy": "prefill", "contains": r} for i, r in theirs.items()]
    other.write_text(json.dumps({"items": [*rows, {"item": "a", "strategy": "naive"}]}))
    ours = [_result("a", "prefill", True), _result("b", "prefill", False)]
    ours += [_result("c", "prefill", True), _result("d", "prefill", True)]
    theirs_run = other_run(other)
    estimate = kept_against(ours, theirs_run)["prefill"]
    assert (estimate.n, round(estimate.value, 1)) == (3, 66.7)  # a and d of a, b, d
    with pytest.raises(ConfigError, match="no prefill answer"):
        kept_against([*ours, _result("e", "prefill", True)], theirs_run)
    with pytest.raises(ConfigError, match="cannot read .*missing.json"):
        other_run(tmp_path / "missing.json")
    rows[1]["contains"] = "no"  # a hand-edited row: "no" counted as right
    other.write_text(json.dumps({"items": rows}))
    with pytest.raises(ConfigError, match="contains must be true or false, not 'no'"):
        other_run(other)
    other.write_text("[" * 100_000 + "]" * 100_000)  # a traceback, past the recursion limit
    with pytest.raises(ConfigError, match="not an eval report"):
        other_run(other)


def test_kept_against_a_report_of_other_items_is_refused_before_the_run(
    tmp_path: Path, capsys
) -> None:
    """`--kept-against` matched rows by item id alone: a report that asked other questions
    under the same ids was counted against, and one missing items was found out only after
    every item was answered (hours at 4K)."""
    items = [
        EvalItem(i, (f"The {i} tower is 12 metres tall.",), "How tall?", ("12",)) for i in "ab"
    ]
    rows = [{"item": i, "strategy": "prefill", "contains": True} for i in "ab"]
    other = tmp_path / "other.json"
    facts = {"item_digests": item_digests(items), "document_order": "as in the dataset"}
    other.write_text(json.dumps({"items": rows, **facts}))
    ours = item_digests(items)
    assert other_run(other, ours, "as in the dataset").right == {
        ("prefill", "a"): True,
        ("prefill", "b"): True,
    }
    asked_otherwise = item_digests([replace(items[0], question="How old?"), items[1]])
    with pytest.raises(ConfigError, match=r"other questions or documents under 1 .*\(a\):"):
        other_run(other, asked_otherwise, "as in the dataset")
    with pytest.raises(ConfigError, match=r"has no prefill answer for items \['c'\]"):
        other_run(other, ours | {"c": "0" * 16}, "as in the dataset")
    with pytest.raises(ConfigError, match="read each item's documents in another order"):
        other_run(other, ours, "retrieval")
    for bad in ('{"items": "x"}', '{"items": [1, 2]}', '{"items": [], "n": 1' + "1" * 5000 + "}"):
        other.write_text(bad)  # an AttributeError, a TypeError, past Python's int digits
        with pytest.raises(ConfigError, match="not an eval report"):
            other_run(other, ours)
    # the command checks it before answering any item: no row measured
    dataset = tmp_path / "set.jsonl"
    lines = [
        {"id": i.id, "documents": [{"id": "d", "text": i.documents[0]}]}
        | {"question": i.question, "answers": list(i.answers)}
        for i in items
    ]
    dataset.write_text("\n".join(json.dumps(line) for line in lines))
    other.write_text(json.dumps({"items": rows, **facts, "item_digests": asked_otherwise}))
    out = tmp_path / "run"
    args = ["eval", str(dataset), "--strategies", "naive", "--teacher-tokens", "0"]
    assert main([*args, "--kept-against", str(other), "--out", str(out)]) == 1
    assert "other questions or documents" in " ".join(capsys.readouterr().out.split())
    assert not (out / "eval.partial.jsonl").exists() and not (out / "eval.json").exists()


def test_dataset_lines_end_at_newlines_only_and_bad_ids_are_refused_at_load(
    tmp_path: Path,
) -> None:
    """U+2028 / U+2029 / U+0085 are legal in a JSON string as they are, but splitlines() cut
    lines there and refused the file; an id of 5000 digits or with a lone surrogate was a
    traceback (the second only when the item was printed, after it was answered)."""
    item = {"id": "a", "documents": [{"id": "d", "text": "The tower\u2028is 12 m."}]}
    item |= {"question": "How tall\u0085is it?", "answers": ["12"]}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(item, ensure_ascii=False) + "\n" + json.dumps(item | {"id": "b"}))
    assert "\u2028" in path.read_text() and "\u0085" in path.read_text()
    loaded = load_dataset(path)
    assert [i.id for i in loaded] == ["a", "b"] and loaded[0].question == "How tall\u0085is it?"
    for bad_id in ('"x\\ud800"', "1" * 5000):
        line = json.dumps(item).replace('"id": "a"', f'"id": {bad_id}')
        path.write_text(line + "\n")
        with pytest.raises(ConfigError, match=f"{path.name}:1: expected"):
            load_dataset(path)
    for field in ("question", "answers"):  # a lone surrogate in any text: at load, not mid-run
        line = json.dumps(item | {field: "x\ud800" if field == "question" else ["x\ud800"]})
        path.write_text(line + "\n")
        with pytest.raises(ConfigError, match=f"{path.name}:1: expected"):
            load_dataset(path)


def test_a_journal_that_measured_nothing_does_not_block_the_next_run(tmp_path: Path) -> None:
    """A run refused after it wrote its journal's header (a strategy needing a schema, a bad
    question) left a journal of no rows, which refused the corrected command as "an
    unfinished run with other settings". With rows in it, it still does."""
    items = [EvalItem("a", ("The tower is 12 metres tall.",), "How tall?", ("12",))]
    path = tmp_path / "eval.partial.jsonl"
    Journal(path, {"strategies": ["positions"]}, item_digests(items))  # the refused run's
    fixed = Journal(path, {"strategies": ["naive"]}, item_digests(items))
    assert fixed.results() == {}
    assert json.loads(path.read_text().splitlines()[0]) == {"settings": {"strategies": ["naive"]}}
    fixed.append([_result("a", "naive", True)])
    with pytest.raises(ConfigError, match="unfinished run with other settings"):
        Journal(path, {"strategies": ["legolink:2"]}, item_digests(items))


def test_a_report_whose_items_are_not_rows_is_one_line(tmp_path: Path) -> None:
    """`"items": "x"` in a report to --reuse or --combine was an AttributeError traceback."""
    items = [EvalItem("a", ("The tower is 12 metres tall.",), "How tall?", ("12",))]
    report = tmp_path / "eval.json"
    for bad in ("x", {"a": 1}, [1], ["x"]):
        report.write_text(json.dumps({"items": bad, "teacher_tokens": 0}))
        with pytest.raises(ConfigError, match="not an eval report"):
            reused_rows(report, {"teacher_tokens": 0}, items)


def test_kept_against_another_runs_prefill_in_the_same_placement(tmp_path: Path) -> None:
    """A LoRA-adapted model's links against the base model's prefill with their placement."""
    other = tmp_path / "base.json"
    rows = [{"item": i, "strategy": "prefill", "contains": True} for i in "ab"]
    rows += [{"item": "a", "strategy": "prefill+reversed", "contains": False}]
    rows += [{"item": "b", "strategy": "prefill+reversed", "contains": True}]
    other.write_text(json.dumps({"items": rows}))
    ours = [_result("a", "naive+reversed", True), _result("b", "naive+reversed", False)]
    base = other_run(other)
    assert kept_against(ours, base)["naive+reversed"].n == 2  # against prefill: a and b
    placed = kept_against(ours, base, same_placement=True)["naive+reversed"]
    assert (placed.n, placed.value) == (1, 0.0)  # against prefill+reversed: b alone, lost
    mine = [_result("a", "prefill+reversed", True), _result("b", "prefill+reversed", True)]
    prefills = kept_against(mine, base, same_placement=True)["prefill+reversed"]
    assert (prefills.n, prefills.value) == (1, 100.0)  # a prefill against its own placement
    rotated = [_result("a", "naive+rotated", True), *ours]
    assert set(kept_against(rotated, base, same_placement=True)) == {"naive+reversed"}
    with pytest.raises(ConfigError, match=r"no prefill\+reversed answer for items \['c'\]"):
        kept_against([*ours, _result("c", "naive+reversed", True)], base, same_placement=True)


def test_without_teacher_forcing_full_is_not_run(tiny32) -> None:
    strategies = check_strategies(["naive+top:1"], with_full=False)
    assert [str(s) for s in strategies] == ["prefill", "naive+top:1"]
    item = EvalItem(
        "a", ("The lighthouse was built in 1788.", "Six crews row."), "When?", ("1788",)
    )
    rows = Evaluator(tiny32, max_new_tokens=3, teacher_tokens=0).run_item(item, strategies)
    assert [r.strategy for r in rows] == ["prefill", "naive+top:1"]
    assert all(math.isnan(r.kl) and math.isnan(r.top1) for r in rows)
    assert rows[1].prefill_ttft_s == rows[0].ttft_s


def test_eval_through_a_durable_store_answers_from_the_kv_it_reads_back(
    tiny32, tmp_path: Path
) -> None:
    """`eval --store-compress`: the chunks go through a tiered store, so the answers are those
    of the KV its durable tier gives back: as computed (none) equals the in-memory run; bfloat16
    moves the cached strategies' distributions, never prefill's."""
    from rag_kvcache.config import StoreConfig

    items = [
        EvalItem("a", ("The lighthouse was built in 1788.", "Six crews row."), "When?", ("1788",)),
        EvalItem("b", ("The bakery opens at five.", "Bread.", "Eel."), "Who bakes?", ("x",)),
    ]
    run = {"max_new_tokens": 4, "teacher_tokens": 3}
    memory, _ = run_eval(tiny32, items, ["naive"], **run)
    plain, _ = run_eval(
        tiny32, items, ["naive"], **run, store=StoreConfig(tmp_path / "f32", compress=None)
    )
    half, _ = run_eval(
        tiny32, items, ["naive"], **run, store=StoreConfig(tmp_path / "bf16", compress="bfloat16")
    )
    assert [(r.strategy, r.token_ids, r.kl) for r in plain] == [
        (r.strategy, r.token_ids, r.kl) for r in memory
    ]
    for ours, theirs in zip(half, memory, strict=True):
        if ours.strategy == "naive":
            assert ours.kl != theirs.kl  # the bfloat16 KV was what answered
        else:  # full and prefill recompute everything: the store's KV is not read
            assert (ours.token_ids, ours.kl) == (theirs.token_ids, theirs.kl)
    assert len(list((tmp_path / "bf16" / "blobs").glob("*/*.safetensors"))) > 0


def report_settings(lm: LoadedModel) -> dict[str, Any]:
    """The settings of a tiny run's report, as `eval` records them (what --reuse checks)."""
    return {
        "model": lm.name,
        "dtype": "float32",
        "max_new_tokens": 3,
        "teacher_tokens": 0,
        "document_order": "as in the dataset",
    }


def test_only_prefill_rows_are_reused_across_durable_encodings(tiny32, tmp_path: Path) -> None:
    items = [EvalItem("a", ("The tower is 12 metres tall.", "Gulls."), "How tall?", ("12",))]
    settings = report_settings(tiny32)
    rows, summary = run_eval(tiny32, items, ["naive"], max_new_tokens=3, teacher_tokens=0)
    report = tmp_path / "eval.json"
    report.write_text(json.dumps(report_dict("eval", rows, summary, **settings)))
    same = reused_rows(report, {**settings, "store_compress": None}, items)  # as computed
    assert set(same["a"]) == {"prefill", "naive"}
    other = reused_rows(report, {**settings, "store_compress": "bfloat16"}, items)
    assert set(other["a"]) == {"prefill"}  # naive answered from float32 KV: run again


def test_reports_are_strict_json_and_read_back_what_was_not_measured_as_nan(
    tiny32, tmp_path: Path
) -> None:
    """Without teacher forcing a row has no KL, and a baseline with no right answer no
    "kept": they were written as bare NaN, which JSON forbids (jq and browsers refuse the
    file). Now null, read back by --reuse and the journal as NaN again."""
    items = [EvalItem("a", ("The tower is 12 metres tall.", "Gulls."), "How tall?", ("99",))]
    settings = report_settings(tiny32)
    rows, summary = run_eval(tiny32, items, ["naive"], max_new_tokens=3, teacher_tokens=0)
    assert math.isnan(rows[0].kl) and math.isnan(summary[0].kept)  # nothing right to keep
    report = report_dict("eval", rows, summary, **settings)
    save_eval(tmp_path, "eval", report, summary)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a report")

    written = json.loads((tmp_path / "eval.json").read_text(), parse_constant=refuse)
    assert {r["kl"] for r in written["items"]} == {None}
    assert {s["kept"] for s in written["summary"]} == {None}
    reused = reused_rows(tmp_path / "eval.json", settings, items)
    assert math.isnan(reused["a"]["naive"].kl) and math.isnan(reused["a"]["naive"].top1)
    assert {s: r.token_ids for s, r in reused["a"].items()} == {
        r.strategy: r.token_ids for r in rows
    }
    Journal(tmp_path / "run.jsonl", settings, item_digests(items)).append(rows)
    for line in (tmp_path / "run.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    again = Journal(tmp_path / "run.jsonl", settings, item_digests(items)).results()
    assert [(r.strategy, r.token_ids) for r in again["a"]] == [
        (r.strategy, r.token_ids) for r in rows
    ]
    assert all(math.isnan(r.kl) for r in again["a"])


def test_calibrated_rows_are_reused_only_under_the_same_calibration(tiny32, tmp_path: Path) -> None:
    """`--reuse` took a `+calibrated` strategy's rows from a report answered with another
    calibration (the setting was not compared), so its answers stood for this run's."""
    items = [EvalItem("a", ("The tower is 12 metres tall.", "Gulls."), "How tall?", ("12",))]
    settings = {**report_settings(tiny32), "calibration": "1" * 64}
    rows, summary = run_eval(tiny32, items, ["naive"], max_new_tokens=3, teacher_tokens=0)
    calibrated = [
        replace(r, strategy="naive+reversed+calibrated") for r in rows if r.strategy == "naive"
    ]
    report = tmp_path / "eval.json"
    report.write_text(json.dumps(report_dict("eval", [*rows, *calibrated], summary, **settings)))
    same = reused_rows(report, settings, items)
    assert "naive+reversed+calibrated" in same["a"]
    other = reused_rows(report, {**settings, "calibration": "2" * 64}, items)
    assert set(other["a"]) == {"prefill", "naive"}  # the calibrated rows: run again
    with pytest.raises(ConfigError, match="lora"):  # an adapter changes every answer
        reused_rows(report, {**settings, "lora": "3" * 64}, items)


def test_rows_of_a_strategy_spelled_as_an_older_version_did_are_run_again(
    tiny32, tmp_path: Path
) -> None:
    """A report holding a strategy spelling that no longer parses (parts in an older order)
    failed `--reuse` outright, prefill's rows too, with the strategy error."""
    items = [EvalItem("a", ("The tower is 12 metres tall.", "Gulls."), "How tall?", ("12",))]
    settings = report_settings(tiny32)
    rows, summary = run_eval(tiny32, items, ["naive"], max_new_tokens=3, teacher_tokens=0)
    old = [replace(r, strategy="naive+ape:1,0.5+reversed") for r in rows if r.strategy == "naive"]
    with pytest.raises(StrategyError):
        Strategy.parse(old[0].strategy)
    report = tmp_path / "eval.json"
    report.write_text(json.dumps(report_dict("eval", [*rows, *old], summary, **settings)))
    reused = reused_rows(report, settings, items)
    assert set(reused["a"]) == {"prefill", "naive"}


def test_a_killed_run_resumes_from_its_journal_and_loses_only_the_item_it_was_on(
    tiny32, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [
        EvalItem(name, (f"The {name} tower is {n} metres tall.", "Gulls."), "How tall?", (str(n),))
        for name, n in (("a", 12), ("b", 30), ("c", 45))
    ]
    settings = {"model": tiny32.name, "strategies": ["prefill", "naive"]}
    whole, _ = run_eval(tiny32, items, ["naive"], max_new_tokens=3, teacher_tokens=0)
    path = tmp_path / "eval.partial.jsonl"
    digests = item_digests(items)
    journal = Journal(path, settings, digests)
    run_eval(tiny32, items[:2], ["naive"], max_new_tokens=3, teacher_tokens=0, journal=journal)
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # killed while writing item b's line
    ran: list[str] = []
    original = Evaluator.run_item
    monkeypatch.setattr(
        Evaluator,
        "run_item",
        lambda self, item, s, known=None: ran.append(item.id) or original(self, item, s, known),
    )
    resumed = Journal(path, settings, digests)
    assert list(resumed.results()) == ["a"]
    results, summary = run_eval(
        tiny32, items, ["naive"], max_new_tokens=3, teacher_tokens=0, journal=resumed
    )
    assert ran == ["b", "c"]  # a was not run again; b, cut short, was
    assert [(r.item, r.strategy, r.token_ids) for r in results] == [
        (r.item, r.strategy, r.token_ids) for r in whole
    ]
    assert [s.items for s in summary] == [3, 3]
    assert len(path.read_text().splitlines()) == 4  # the settings and three whole items
    with pytest.raises(ConfigError, match="other settings"):
        Journal(path, {**settings, "model": "another"}, digests)  # never in another's report
    # the dataset file edited since (the settings name its path, not what it holds): item a
    # now asks something else, and its old row would have stood for the new question's
    edited = item_digests([replace(items[0], answers=("13",)), *items[1:]])
    with pytest.raises(ConfigError, match="measured item a as the dataset had it then"):
        Journal(path, settings, edited)
    resumed.close()
    assert not path.exists()


def test_a_run_reusing_an_earlier_runs_rows_equals_a_run_of_everything(
    tiny32, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strategy added to a long run costs its own answers only: the earlier run's prefill
    and naive rows are taken, the new strategy's equal a run of everything."""
    items = [
        EvalItem(name, (f"The {name} tower is {n} metres tall.", "Gulls."), "How tall?", (str(n),))
        for name, n in (("a", 12), ("b", 30))
    ]
    settings = report_settings(tiny32)
    earlier, summary = run_eval(tiny32, items, ["naive"], max_new_tokens=3, teacher_tokens=0)
    report = tmp_path / "eval.json"
    digests = item_digests(items)
    report.write_text(
        json.dumps(report_dict("eval", earlier, summary, **settings, item_digests=digests))
    )
    everything, _ = run_eval(
        tiny32, items, ["naive", "legolink:1"], max_new_tokens=3, teacher_tokens=0
    )
    ran: list[str] = []
    original = Evaluator.run_item

    def counting(self, item, strategies, known=None):  # type: ignore[no-untyped-def]
        ran.extend(str(s) for s in strategies if str(s) not in (known or {}))
        return original(self, item, strategies, known)

    monkeypatch.setattr(Evaluator, "run_item", counting)
    reuse = reused_rows(report, settings, items)
    results, _ = run_eval(
        tiny32, items, ["naive", "legolink:1"], max_new_tokens=3, teacher_tokens=0, reuse=reuse
    )
    assert ran == ["legolink:1", "legolink:1"]  # prefill and naive were not run again
    assert [(r.item, r.strategy, r.token_ids) for r in results] == [
        (r.item, r.strategy, r.token_ids) for r in everything
    ]
    taken = [
        (r.item, r.strategy, r.token_ids, r.ttft_s) for r in results if r.strategy != "legolink:1"
    ]
    assert taken == [(r.item, r.strategy, r.token_ids, r.ttft_s) for r in earlier]  # as they were
    assert all(r.prefill_ttft_s == reuse[r.item]["prefill"].ttft_s for r in results)
    with pytest.raises(ConfigError, match="max_new_tokens=3"):
        reused_rows(report, {**settings, "max_new_tokens": 8}, items)
    with pytest.raises(ConfigError, match="teacher-tokens 0"):
        reused_rows(report, {**settings, "teacher_tokens": 4}, items)
    with pytest.raises(ConfigError, match="cannot read .*missing.json"):
        reused_rows(tmp_path / "missing.json", settings, items)
    with pytest.raises(ConfigError, match="another model"):
        reused_rows(report, {**settings, "model": "another"}, items)
    # the same ids over other questions or documents: rows of another dataset, refused
    edited = [
        items[0],
        EvalItem("b", ("The b tower is 31 metres tall.", "Gulls."), "How tall?", ("31",)),
    ]
    with pytest.raises(
        ConfigError, match=r"other questions or documents under 1 of these ids, .* \(b\):"
    ):
        reused_rows(report, settings, edited)
    assert set(reused_rows(report, settings, items[:1])) == {"a"}  # fewer items: fine
    data = json.loads(report.read_text())
    combined = {k: v for k, v in data.items() if k != "item_digests"} | {"combined": ["x", "y"]}
    for tampered in ({**data, "item_digests": {}}, combined):  # no hash of its items
        report.write_text(json.dumps(tampered))
        with pytest.raises(ConfigError, match="keeps no hash of them"):
            reused_rows(report, settings, items)


def test_reports_name_the_same_model_by_fingerprint_or_untagged_name() -> None:
    a = {"model": "SmolLM2-135M-Instruct.Q4_1-ec7e678156"}  # converted on two machines
    b = {"model": "SmolLM2-135M-Instruct.Q4_1-0db9fd4227"}
    assert same_model(a, b) and not same_model(a, {"model": "gemma-3-270m-0db9fd4227"})
    assert same_model({**a, "model_fingerprint": "f1"}, {**a, "model_fingerprint": "f1"})
    assert not same_model({**a, "model_fingerprint": "f1"}, {**b, "model_fingerprint": "f2"})


def test_retrieval_order_puts_the_most_similar_document_first() -> None:
    from rag_kvcache.retrieval.embedding import Embedder

    item = EvalItem(
        "x",
        (
            "The bakery opens at five.",
            "Six crews row on the river.",
            "The lighthouse was lit in 1788.",
        ),
        "When was the lighthouse lit?",
        ("1788",),
    )
    (ranked,) = in_retrieval_order([item], Embedder())
    assert ranked.documents[0] == item.documents[2]
    assert sorted(ranked.documents) == sorted(item.documents)


def test_needle_item_places_the_needle_at_the_depth(smol) -> None:
    count = lambda s: len(smol.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    start = needle_item(smol, 1024, 0.0, 256)
    end = needle_item(smol, 1024, 1.0, 256)
    middle = needle_item(smol, 1024, 0.5, 256)
    assert start.documents[0].startswith(NEEDLE) and end.documents[-1].endswith(NEEDLE)
    holding = [i for i, d in enumerate(middle.documents) if NEEDLE in d]
    assert len(holding) == 1 and 0 < holding[0] < len(middle.documents) - 1
    for item in (start, end, middle):
        sizes = [count(d) for d in item.documents]
        assert max(sizes) <= 256 + 8 and 900 < sum(sizes) <= 1024 + 8  # joins add a few
    others = [needle_item(smol, 1024, 0.5, 256, k) for k in range(1, len(NEEDLES))]
    assert len({i.id for i in [middle, *others]}) == len(NEEDLES)  # `--reuse` keys
    for k, item in enumerate(others, start=1):
        fact = NEEDLES[k]
        assert (item.question, item.answers) == (fact.question, fact.answers)
        holding = [i for i, d in enumerate(item.documents) if fact.sentence in d]
        assert len(holding) == 1 and not any(NEEDLE in d for d in item.documents)
        assert all(a in fact.sentence for a in fact.answers)


@pytest.mark.slow
def test_eval_command_reuses_an_earlier_runs_rows(tmp_path: Path, smol, capsys) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    args = ["eval", str(DEV_SET), "--limit", "1", "--teacher-tokens", "0"]
    assert main([*args, "--strategies", "naive", "--out", str(first)]) == 0
    reuse = ["--reuse", str(first / "eval.json"), "--strategies", "naive,legolink:2"]
    assert main([*args, *reuse, "--out", str(second)]) == 0
    old, new = (json.loads((d / "eval.json").read_text()) for d in (first, second))
    assert new["reused"]["strategies"] == ["naive", "prefill"]
    assert [r["strategy"] for r in new["items"]] == ["prefill", "naive", "legolink:2"]
    assert new["items"][:2] == old["items"]  # taken as they were
    assert main([*args, *reuse, "--out", str(second), "--max-new-tokens", "5"]) != 0
    assert "max_new_tokens=32" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_command_writes_report_table_and_plots(tmp_path: Path, smol) -> None:
    out = tmp_path / "out"
    args = ["eval", str(DEV_SET), "--limit", "2", "--strategies", "legolink:2,naive"]
    assert main([*args, "--out", str(out), "--max-new-tokens", "12"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert [s["strategy"] for s in report["summary"]] == ["full", "prefill", "legolink:2", "naive"]
    assert len(report["items"]) == 8
    full = report["summary"][0]
    assert (full["kl"], full["top1"], full["recomputed_fraction"]) == (0.0, 1.0, 1.0)
    assert 0 < report["summary"][2]["recomputed_fraction"] < 0.1
    assert "| legolink:2 |" in (out / "eval.md").read_text()
    engine = RagKVCache(EngineConfig(generation=GenerationConfig(max_new_tokens=12)), lm=smol)
    for item in load_dataset(DEV_SET)[:2]:
        ids = engine.generate_context_cache(list(item.documents))
        for row in (r for r in report["items"] if r["item"] == item.id):
            answer = engine.generate(item.question, ids, strategy=row["strategy"])
            assert list(answer.token_ids) == row["token_ids"], (item.id, row["strategy"])
    for png in ("eval_pareto.png", "eval_kl_k.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert not (out / "eval.partial.jsonl").exists()  # finished: the next run starts afresh
    # kept against another run's prefill: here a copy of this run in which prefill got every
    # item right, so kept is this prefill's own accuracy
    other = tmp_path / "other.json"
    rows = [{**r, "contains": True} if r["strategy"] == "prefill" else r for r in report["items"]]
    other.write_text(json.dumps({**report, "items": rows}))
    again = tmp_path / "again"
    quick = ["--teacher-tokens", "0", "--max-new-tokens", "12", "--strategies", "naive"]
    assert main([*args[:4], *quick, "--kept-against", str(other), "--out", str(again)]) == 0
    floor = json.loads((again / "eval.json").read_text())["kept_against"]["strategies"]
    right = [r["contains"] for r in report["items"] if r["strategy"] == "prefill"]
    assert (floor["prefill"]["n"], floor["prefill"]["value"]) == (2, 50.0 * sum(right))
    assert main(["eval", "--out", str(out)]) == 2  # neither a dataset nor --needle


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
def test_eval_needle_mode_tries_several_needles_per_length_and_depth(tmp_path: Path) -> None:
    """`--needles N`: N different needles at each length and depth, each an item of its own
    (the first keeps its earlier ID); the heatmap counts them per cell."""
    out = tmp_path / "needle"
    args = ["eval", "--needle", "--model", "random:tiny", "--lengths", "128", "--depths", "0,1"]
    args += ["--teacher-tokens", "0", "--max-new-tokens", "2", "--strategies", "naive"]
    assert main([*args, "--needles", "2", "--out", str(out)]) == 0
    report = json.loads((out / "needle.json").read_text())
    tried = sorted({(r["item"], r["strategy"]) for r in report["items"]})
    ids = ["needle-128-0", "needle-128-0-1", "needle-128-1", "needle-128-1-1"]
    assert tried == sorted((i, s) for i in ids for s in ("prefill", "naive"))
    assert (out / "needle_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert main([*args, "--needles", str(len(NEEDLES) + 1), "--out", str(out)]) == 2
    # --limit counts here too (it was ignored: every needle ran)
    assert main([*args, "--needles", "2", "--limit", "3", "--out", str(tmp_path / "l")]) == 0
    report = json.loads((tmp_path / "l" / "needle.json").read_text())
    assert sorted({r["item"] for r in report["items"]}) == sorted(ids[:3])
    # depths that name one item (six digits) are refused: its rows were counted twice
    close = [*args, "--depths", "0.1,0.1000001", "--out", str(tmp_path / "c")]
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        main(close)
    assert not (tmp_path / "c").exists()


def _report(
    path: Path,
    right: dict[str, dict[str, bool]],
    tokens: int = 10,
    seconds: dict[str, float] | None = None,
    **settings: object,
) -> Path:
    """An eval report as `eval` writes it: `right[item][strategy]` says which answers hold the
    gold answer; every item `tokens` long, each strategy's TTFT `seconds[strategy]` (prefill's
    is the prefill TTFT)."""
    strategies = list(next(iter(right.values())))
    seconds = seconds or {}
    rows = [
        asdict(
            replace(
                _result(item, strategy, ok),
                ttft_s=seconds.get(strategy, 1.0),
                prefill_ttft_s=seconds.get("prefill", 2.0),
                context_tokens=tokens,
            )
        )
        for item, answers in right.items()
        for strategy, ok in answers.items()
    ]
    facts = {
        "benchmark": "eval", "dataset": path.stem, "model": "m", "model_fingerprint": "f",
        "dtype": "float32", "strategies": strategies, "max_new_tokens": 24, "teacher_tokens": 0,
        "document_order": "retrieval", **settings, "items": rows,
    }  # fmt: skip
    path.write_text(json.dumps(facts))
    return path


def test_reports_of_one_setup_are_combined_into_one_run(tmp_path: Path, capsys) -> None:
    """`eval --combine`: accuracy, kept and the noise floor over every report's items, with the
    strategies every report measured; reports of other settings or the same items refused."""
    P, R, O, C = "prefill", "prefill+reversed", "prefill+rotated", "naive+reversed"
    one = _report(
        tmp_path / "1k.json",
        {"a": {P: True, R: True, O: True, C: True}, "b": {P: False, R: True, O: False, C: True}},
    )
    two = _report(
        tmp_path / "2k.json",
        {"c": {P: True, R: True, O: True, C: False, "legolink:2": True},
         "d": {P: False, R: False, O: True, C: True, "legolink:2": True}},
    )  # fmt: skip
    # --out onto a combined report's own name replaced it (and its table and plots) unasked
    within = tmp_path / "1k-run"
    within.mkdir()
    (within / "eval.json").write_bytes(one.read_bytes())
    kept_bytes = one.read_bytes()
    assert (
        main(["eval", "--combine", str(within / "eval.json"), str(two), "--out", str(within)]) == 1
    )
    assert "would write over" in " ".join(capsys.readouterr().out.split())
    assert (within / "eval.json").read_bytes() == kept_bytes
    out = tmp_path / "both"
    assert main(["eval", "--combine", str(one), str(two), "--out", str(out)]) == 0
    assert "left out, not in every report: legolink:2" in capsys.readouterr().out
    report = json.loads((out / "eval.json").read_text())
    assert report["combined"] == [str(one), str(two)] and report["dtype"] == "float32"
    summary = {s["strategy"]: s for s in report["summary"]}
    assert list(summary) == [P, R, O, C]
    assert summary[C]["items"] == 4 and summary[C]["contains"] == 75.0
    # of the 3 items prefill+reversed gets right (a, b, c), the cache keeps a and b
    assert (summary[C]["kept_of"], round(summary[C]["kept"], 1)) == (3, 66.7)
    floor = {(f["strategy"], f["floor"]): f for f in report["floor"]}
    assert (floor[C, O]["kept"], floor[C, O]["floor_kept"], floor[C, O]["of"]) == (2, 2, 3)
    assert (out / "eval.md").read_text().startswith("| strategy |")
    # against another run's prefills on the same items (the dtype's floor): here one whose
    # prefill+reversed got every item right, so kept is this run's own accuracy
    other = {i: {P: True, R: True, O: True} for i in "abcd"}
    args = ["--kept-against", str(_report(tmp_path / "other.json", other, dtype="bfloat16"))]
    assert main(["eval", "--combine", str(one), str(two), *args, "--out", str(out)]) == 0
    placed = json.loads((out / "eval.json").read_text())["kept_against"]["same_placement"]
    assert (placed[R]["n"], placed[R]["value"]) == (4, 75.0) and placed[C]["value"] == 75.0
    # ... and its prefill+reversed is a floor beside this run's reorderings, paired by item
    floor = {f["floor"]: f for f in json.loads((out / "eval.json").read_text())["floor"]}
    dtype = floor[f"{R} (bfloat16, other run)"]
    assert (dtype["strategy"], dtype["of"], dtype["kept"], dtype["floor_kept"]) == (C, 3, 2, 3)
    assert round(dtype["difference"], 1) == -33.3
    assert f"| {R} (bfloat16, other run) |" in (out / "eval.md").read_text()
    bf16 = _report(tmp_path / "b.json", {"e": {P: True}}, dtype="bfloat16")
    needle = _report(tmp_path / "n.json", {"e": {P: True}}, benchmark="needle")

    def tampered(name: str, change) -> Path:  # type: ignore[no-untyped-def]
        data = json.loads(two.read_text())
        change(data["items"])
        (tmp_path / name).write_text(json.dumps(data))
        return tmp_path / name

    twice = tampered("twice.json", lambda rows: rows.append(dict(rows[0])))
    missing = tampered(
        "missing.json", lambda rows: rows.remove(next(r for r in rows if r["strategy"] == C))
    )
    word = tampered("word.json", lambda rows: rows[0].update(contains="no"))  # was "right"
    text = tampered("text.json", lambda rows: rows[0].update(ttft_s="fast"))
    # values no measurement gives: each would move a median or a mean without an error
    impossible = {
        "TTFTs must be finite and positive": dict(ttft_s=-1.0),
        "TTFTs must be": dict(prefill_ttft_s=float("nan")),
        "f1, exact_match and top1 are shares": dict(f1=7.0),
        "top1 are shares": dict(top1=1.5),
        "kl must be finite": dict(kl=-0.5),
        "recomputed_tokens 9 is not within": dict(recomputed_tokens=9, context_tokens=4),
    }
    ranges = {
        message: [one, tampered(f"range{i}.json", lambda rows, c=change: rows[0].update(c))]
        for i, (message, change) in enumerate(impossible.items())
    }
    refusals = {
        "has 2 prefill rows": [one, twice],
        "has no naive+reversed row": [one, missing],
        "contains must be bool": [one, word],
        "ttft_s must be a number": [one, text],
        "item a is in both": [one, one],
        "dtype='bfloat16'": [one, bf16],
        "not a QA eval report": [needle, one],
        "two reports or more": [one],
        **ranges,
    }
    for message, reports in refusals.items():
        assert main(["eval", "--combine", *map(str, reports), "--out", str(tmp_path / "no")]) != 0
        assert message in " ".join(capsys.readouterr().out.split())
        assert not (tmp_path / "no").exists()
    assert main(["eval", str(one), "--combine", str(two), "--out", str(out)]) == 2


def test_a_combined_report_times_each_length_apart(tmp_path: Path) -> None:
    """TTFT grows with the context, so a median over 1K and 4K items together describes
    neither: the combined table shows the longest report's speed, and each report's below."""
    P, R, C = "prefill", "prefill+reversed", "naive+reversed"
    short = _report(
        tmp_path / "1k.json",
        {i: {P: True, R: True, C: True} for i in "abc"},
        tokens=1000,
        seconds={P: 1.0, C: 0.5},
    )
    long = _report(
        tmp_path / "4k.json",
        {i: {P: True, R: True, C: False} for i in "de"},
        tokens=4000,
        seconds={P: 4.0, C: 0.4},
    )
    out = tmp_path / "both"
    assert main(["eval", "--combine", str(short), str(long), "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    cache = next(s for s in report["summary"] if s["strategy"] == C)
    assert (cache["speedup"], cache["ttft_s"], cache["timed_tokens"]) == (10.0, 0.4, 4000)
    assert (cache["items"], round(cache["contains"], 1)) == (5, 60.0)  # answers: every item
    assert report["timed_report"] == str(long)
    table = (out / "eval.md").read_text()
    assert "| strategy | 1k.json, 1000 tokens | 4k.json, 4000 tokens |" in table
    assert f"| {C} | 2.0x (0.500 s) | 10.0x (0.400 s) |" in table
