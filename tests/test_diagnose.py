"""The attention diagnosis on the tiny models: captured queries reproduce the model's own
attention, `full` attends exactly like prefill, `naive`'s KV departs off chunk 0, and a run
(`rag-kvcache diagnose`) writes its JSON and plots."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from helpers import random_chunks

from rag_kvcache import EngineConfig, GenerationConfig, RagKVCache
from rag_kvcache.errors import ConfigError
from rag_kvcache.model import loading
from rag_kvcache.model.adapter import (
    buffered_cache,
    capture_queries,
    forward,
    new_buffers,
    unpack_cache,
)
from rag_kvcache.storage.memory import MemoryStore
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools import diagnosis
from rag_kvcache.tools.cli import main
from rag_kvcache.tools.diagnosis import (
    FAILED,
    KEPT,
    POSITION_BINS,
    SINK_TOKENS,
    Gold,
    diagnose,
    diagnose_item,
    kv_deviation,
    load,
    load_gold,
    placed_index,
    prepare_traced,
    question_attention,
)
from rag_kvcache.tools.eval.dataset import EvalItem

DOCS = (
    "The lighthouse at Hallam Point was built in 1788 by the harbor guild.",
    "Velmora has three harbor basins and a fish market on the east quay.",
    "The ferry to Saltreach leaves at dawn and returns before the evening tide.",
)
QUESTION = "When was the lighthouse built?"


def _engine(lm) -> RagKVCache:
    config = EngineConfig(generation=GenerationConfig(max_new_tokens=6))
    return RagKVCache(config, lm=lm, store=MemoryStore())


def _traced(engine: RagKVCache, strategy: str):
    ids = engine.generate_context_cache(list(DOCS))
    chunks = engine.store.get([engine.prefix_id, *ids])
    question = engine.template.question_ids(engine.lm.tokenizer, QUESTION)
    prepared, queries = prepare_traced(engine.lm, chunks, question, Strategy.parse(strategy))
    weights = question_attention(engine.lm, prepared, queries)
    return prepared, weights, [c.num_tokens for c in chunks], len(question)


@pytest.mark.parametrize("model", ["tiny64", "tiny32"])
def test_captured_queries_reproduce_the_models_attention(model, request) -> None:
    """softmax(q k^T * scale) V from the captured queries and the cache equals what each
    layer's attention handed to its output projection; capture changes no logits."""
    lm = request.getfixturevalue(model)
    ids = torch.tensor([random_chunks([37], seed=3)[0]])
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args, i=i: outputs.__setitem__(i, args[0][0])  # [T, heads * d]
        )
        for i, layer in enumerate(lm.model.model.layers)
    ]
    try:
        plain, _ = forward(lm, ids, cache=buffered_cache(lm, *new_buffers(lm, 37), 0))
        with capture_queries() as captured:
            logits, cache = forward(lm, ids, cache=buffered_cache(lm, *new_buffers(lm, 37), 0))
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(plain, logits)
    assert [c[0] for c in captured] == list(range(lm.num_layers))
    tol = 1e-10 if lm.dtype == torch.float64 else 1e-4
    for (layer, query, scale, bias), (keys, values) in zip(
        captured, unpack_cache(cache), strict=True
    ):
        assert bias is None
        heads = query.shape[1]
        assert query.shape == (1, heads, 37, lm.head_dim)
        groups = heads // lm.num_kv_heads
        k = keys[0].repeat_interleave(groups, 0)
        v = values[0].repeat_interleave(groups, 0)
        scores = query[0] @ k.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(37, -1)
        torch.testing.assert_close(attended, outputs[layer], rtol=tol, atol=tol)
    with capture_queries() as unused:
        pass
    forward(lm, ids)
    assert unused == []  # nothing recorded once the context is left


@pytest.mark.parametrize("model", ["tiny64", "tiny32"])
def test_full_attends_like_prefill_and_rows_sum_to_one(model, request) -> None:
    engine = _engine(request.getfixturevalue(model))
    base, base_w, tokens, n = _traced(engine, "prefill")
    full, full_w, _, _ = _traced(engine, "full")
    naive, naive_w, _, _ = _traced(engine, "naive")
    layers, heads = engine.lm.num_layers, engine.lm.model.config.num_attention_heads
    assert base_w.shape == (layers, heads, n, sum(tokens) + n)
    tol = 1e-10 if engine.lm.dtype == torch.float64 else 1e-5
    for weights in (base_w, full_w, naive_w):
        sums = weights.sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=tol, atol=tol)
        assert torch.all(weights[..., 0, sum(tokens) + 1 :] == 0)  # causal: the first row
    torch.testing.assert_close(full_w, base_w, rtol=tol, atol=tol)
    assert (naive_w - base_w).abs().max() > 100 * tol  # stale chunks do show


def test_kv_deviation_is_zero_for_full_and_not_for_naive_off_chunk_0(tiny64) -> None:
    engine = _engine(tiny64)
    base, _, tokens, n = _traced(engine, "prefill")
    full, _, _, _ = _traced(engine, "full")
    naive, _, _, _ = _traced(engine, "naive")
    for deviation in kv_deviation(full, base):
        assert deviation.shape == (tiny64.num_layers, sum(tokens) + n)
        assert deviation.max() < 1e-10
    keys, values = kv_deviation(naive, base)
    prefix = tokens[0]
    assert keys[:, :prefix].max() < 1e-10 and values[:, :prefix].max() < 1e-10  # same as prefill
    assert keys[0, :prefix].max() < 1e-10
    # layer 0's K/V depend on the token and its position only: exact but for re-rotation
    # (RoPE's frequencies are float32 values)
    assert values[0].max() < 1e-12 and keys[0].max() < 1e-5
    assert values[1:, prefix:-n].min() > 1e-6  # every document chunk: stale from layer 1 on
    assert keys[1:, prefix:-n].mean() > 1e-3


def test_placed_index_follows_the_order() -> None:
    assert placed_index(Strategy.parse("legolink:2"), 4, 0) == 1
    assert placed_index(Strategy.parse("legolink:2+reversed"), 4, 0) == 4
    assert placed_index(Strategy.parse("naive+rotated"), 4, 0) == 4
    assert placed_index(Strategy.parse("naive+rotated"), 4, 1) == 1


def test_diagnose_item_masses_add_up(tiny64) -> None:
    engine = _engine(tiny64)
    ids = engine.generate_context_cache(list(DOCS))
    item = EvalItem("x", DOCS, QUESTION, ("1788",))
    answers = tuple(engine.generate(QUESTION, ids, strategy=s) for s in ("prefill", "naive"))
    d = diagnose_item(
        engine, item, ids, Gold(0, bridge=2), Strategy.parse("naive"), answers, FAILED
    )
    assert d.answer_chunk == 1 and d.bridge_chunk == 3 and len(d.chunk_tokens) == 4
    for stats in (d.prefill, d.linked):
        parts = (stats.prefix, stats.question, stats.answer, stats.bridge, stats.distractors)
        total = torch.tensor(parts, dtype=torch.float64).sum(0)
        torch.testing.assert_close(total, torch.ones_like(total), rtol=1e-9, atol=1e-9)
        chunks = torch.tensor(stats.chunks, dtype=torch.float64).sum(0)  # [layers]
        rows = chunks + torch.tensor(stats.question, dtype=torch.float64).mean(1)
        torch.testing.assert_close(rows, torch.ones_like(rows), rtol=1e-9, atol=1e-9)
        for share in (stats.sink, stats.end, stats.answer_top):
            x = torch.tensor(share, dtype=torch.float64)
            assert (x >= 0).all() and (x <= 1 + 1e-12).all()
    assert len(d.kv.keys) == tiny64.num_layers and len(d.kv.keys[0]) == len(POSITION_BINS)
    assert min(d.kv.keys[1][:4]) > 0  # naive: stale keys from layer 1 on
    assert max(d.kv.values[0][:4]) < 1e-12 and max(d.kv.keys[0][:4]) < 1e-5  # layer 0: exact


def _dataset(lm, path: Path, max_new_tokens: int) -> Path:
    """A QA set of three items over DOCS whose gold answers are prefill's own outputs (the
    answer in document 1): prefill is right on all of them."""
    engine = _engine(lm)
    lines = []
    for i, question in enumerate(("Where is the ferry?", QUESTION, "How many basins?")):
        ids = engine.generate_context_cache(list(DOCS))
        answer = engine.generate(question, ids, strategy="prefill", max_new_tokens=max_new_tokens)
        lines.append(
            {
                "id": f"q{i}",
                "documents": [{"id": str(j), "text": t} for j, t in enumerate(DOCS)],
                "question": question,
                "answers": [answer.text],
                "meta": {"answer_document": 1, "bridge_document": None},
            }
        )
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_diagnose_selects_and_writes(tiny64, tmp_path: Path, monkeypatch) -> None:
    """Items whose gold answer is prefill's own output: prefill is right on all of them, and
    the command diagnoses those the strategy gets wrong, writes the JSON and the plots."""
    monkeypatch.setattr(loading, "load_model", lambda config: tiny64)  # imported when it runs
    dataset = _dataset(tiny64, tmp_path / "qa.jsonl", max_new_tokens=6)
    assert load_gold(dataset)["q0"] == Gold(1, None)
    out = tmp_path / "out"
    args = ["diagnose", str(dataset), "--strategy", "naive", "--out", str(out)]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    saved = json.loads((out / "diagnosis.json").read_text())
    assert saved["scanned"] == 3 and saved["prefill_right"] == 3
    assert [o["answer_chunk"] for o in saved["outcomes"]] == [2, 2, 2]
    assert saved["failed"] == 3 - saved["linked_right"] >= 1  # naive departs on this model
    assert {d["group"] for d in saved["items"]} <= {FAILED, KEPT}
    assert all(d["answer_chunk"] == 2 for d in saved["items"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diagnosed"][FAILED] == saved["failed"]
    assert summary["all"]["items"] == len(saved["items"])
    # a round trip through the JSON (rounded to 3 digits) summarises to nearly the same
    again = json.loads(json.dumps(diagnosis.summary(load(out / "diagnosis.json"))))
    assert again.keys() == summary.keys() and again["by_answer_chunk"] == summary["by_answer_chunk"]
    assert again["all"]["departure"] == pytest.approx(summary["all"]["departure"], rel=1e-2)
    assert summary["by_answer_chunk"]["2"]["prefill_right"] == 3
    for name in ("heatmaps", "by_layer", "by_chunk"):
        assert (out / f"attention_{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "kv_deviation.png").read_bytes()[:4] == b"\x89PNG"
    # a run in the same folder that diagnoses nothing leaves no earlier run's plots there
    assert main([*args, "--max-new-tokens", "6", "--max-items", "1", "--controls", "0",
                 "--limit", "1", "--strategy", "full"]) == 0  # fmt: skip
    assert json.loads((out / "diagnosis.json").read_text())["items"] == []
    assert not list(out.glob("*.png"))
    # a calibrated strategy is refused at once: diagnose's scratch store holds no calibration
    with pytest.raises(ConfigError, match="scratch store, with no link calibration"):
        diagnosis.diagnose(tiny64, [], "naive+calibrated", out)


def test_diagnose_command_loads_a_model_folder(tiny32, tmp_path: Path, capsys) -> None:
    """`rag-kvcache diagnose --model DIR` on the tiny model saved as an HF folder: it scans
    `--limit` items, reports each, and records the folder's model."""
    folder = tmp_path / "tiny-llama"
    tiny32.model.save_pretrained(folder)
    tiny32.tokenizer.save_pretrained(folder)
    dataset = _dataset(tiny32, tmp_path / "qa.jsonl", max_new_tokens=4)
    out = tmp_path / "out"
    args = ["diagnose", str(dataset), "--model", str(folder), "--strategy", "legolink:2"]
    assert main([*args, "--out", str(out), "--limit", "2", "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "q0: prefill right" in printed and "scanned 2: prefill right 2" in printed
    saved = json.loads((out / "diagnosis.json").read_text())
    assert saved["model"] == "tiny-llama" and saved["strategy"] == "legolink:2"
    assert saved["scanned"] == 2 and len(saved["items"]) == 2  # failed or kept: all diagnosed
    assert saved["sink_tokens"] == SINK_TOKENS == 4  # the default --sink-tokens' help names


def test_a_meta_naming_no_document_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A `meta.answer_document` of 7 among 4 documents was a raw ValueError after the model
    had loaded and answered; `true` was read as document 1; a negative --sink-tokens ran."""

    def loaded(config: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", loaded)
    line = {"id": "q", "question": "Who?", "answers": ["Anna"]}
    line |= {"documents": [{"id": str(j), "text": t} for j, t in enumerate(DOCS)]}
    dataset = tmp_path / "qa.jsonl"
    for meta, says in (
        ({"answer_document": 7}, "meta.answer_document must be the index of one of the item's"),
        ({"answer_document": True}, "not True"),
        ({"answer_document": "0"}, "not '0'"),
        ({"answer_document": None}, "not None"),
        ({"answer_document": 0, "bridge_document": -1}, "meta.bridge_document"),
        ("answer_document", "meta must be an object"),
    ):
        dataset.write_text(json.dumps(line | {"meta": meta}) + "\n")
        assert main(["diagnose", str(dataset), "--out", str(tmp_path / "out")]) == 1
        printed = " ".join(capsys.readouterr().out.split())
        assert says in printed and f"{dataset}:1" in printed and "Traceback" not in printed
    with pytest.raises(SystemExit):
        main(["diagnose", str(dataset), "--sink-tokens", "-3"])
    assert "--sink-tokens: at least 1, not -3" in capsys.readouterr().err


def test_python_m_runs_the_command(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["python -m rag_kvcache.tools.diagnosis", "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("rag_kvcache.tools.diagnosis", run_name="__main__")
    assert exited.value.code == 0
    assert "--max-items" in capsys.readouterr().out


def test_legolink0_is_diagnosed_over_sink_encoded_chunks(tiny64, tmp_path: Path) -> None:
    """legolink0 needs chunks encoded after sink tokens: the run encodes them so, and prefill
    over the same chunks' tokens is still the plain prompt."""
    engine = _engine(tiny64)
    ids = engine.generate_context_cache(list(DOCS))
    text = engine.generate(QUESTION, ids, strategy="prefill", max_new_tokens=4).text
    items = [EvalItem("s", DOCS, QUESTION, (text,))]  # prefill is right: diagnosed either way
    result = diagnose(tiny64, items, "legolink0", tmp_path, max_new_tokens=4, controls=1)
    assert result.prefill_right == 1 and len(result.items) == 1
    kv = result.items[0].kv
    assert max(kv.values[0][:16]) < 1e-12 and min(kv.values[1][:16]) > 1e-6
    assert json.loads((tmp_path / "diagnosis.json").read_text())["strategy"] == "legolink0"


def test_ape_scale_reaches_the_recomputed_attention(tiny64) -> None:
    """`+ape:1,S` adds log S to the scores on stale keys: at layer 0 (where the question's
    queries and the placed keys do not depend on the rest of the context) the question's
    weights are naive's with the stale columns multiplied by S, renormalised."""
    engine = _engine(tiny64)
    _, naive, tokens, _ = _traced(engine, "naive")
    _, ape, _, _ = _traced(engine, "naive+ape:1,3")
    stale = torch.zeros(naive.shape[-1], dtype=torch.bool)
    stale[tokens[0] : sum(tokens)] = True  # the document chunks; the prefix is exact
    expected = naive[0] * torch.where(stale, 3.0, 1.0).to(naive.dtype)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(ape[0], expected, rtol=1e-10, atol=1e-12)
    assert (ape[1:] - naive[1:]).abs().max() > 1e-3
