"""Link calibration: the link tokens' exact limits, the training twin of the link's forward,
the file format's refusals, and a training run that lowers the KL to prefill and resumes."""

import math
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CALIBRATION_ITEMS as ITEMS
from helpers import random_chunks
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sqlalchemy import update

import rag_kvcache.tools.calibrate as calibration_module
from rag_kvcache.config import EngineConfig, GenerationConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import CalibrationError, StoreDamagedError, StrategyError
from rag_kvcache.kv import EncodeSettings
from rag_kvcache.link.calibration import Calibration
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import LinkedPrefix, link
from rag_kvcache.model.adapter import embed
from rag_kvcache.serving.batch import BatchRequest
from rag_kvcache.serving.decoding import prefill
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.storage.tables import LinkCalibration
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.calibrate import (
    CHECKPOINT,
    CalibrateConfig,
    calibrate,
    trainable_logits,
)

LENGTHS = [6, 11, 4, 9]  # prefix, then three document chunks
QUERY = [7, 8, 9, 10, 11]


def _chunks(lm, settings=EncodeSettings()):
    ids = random_chunks(LENGTHS, seed=5)
    return encode_chunks(lm, ids[:1]) + encode_chunks(lm, ids[1:], settings), ids


def _calibration(lm, vectors, encode="sinks="):
    return Calibration(vectors, lm.fingerprint, encode, "naive")


def test_zero_link_tokens_is_the_strategy_alone(tiny64) -> None:
    chunks, _ = _chunks(tiny64)
    empty = _calibration(tiny64, torch.zeros(0, 64, dtype=torch.float64))
    for spelling in ("naive", "legolink:2+reversed+top:1"):
        strategy = Strategy.parse(spelling)
        alone = link(tiny64, chunks, QUERY, strategy)
        calibrated = replace(strategy, calibrated=True)
        linked = link(tiny64, chunks, QUERY, calibrated, calibration=empty)
        torch.testing.assert_close(linked.next_logits, alone.next_logits, rtol=0, atol=0)
        assert (linked.length, linked.recomputed) == (alone.length, alone.recomputed)


def test_link_tokens_of_real_tokens_recomputed_everywhere_equal_prefill_with_them(tiny64) -> None:
    """With every document token recomputed and link vectors that are real tokens'
    embeddings, a calibrated link is a plain prefill of the prompt with those tokens written
    after every document: the slots sit where they should and attend as they should."""
    chunks, ids = _chunks(tiny64)
    link_ids = [40, 41, 42]
    vectors = embed(tiny64, torch.tensor([link_ids]))[0]
    strategy = Strategy.parse("legolink:100+calibrated")
    linked = link(tiny64, chunks, QUERY, strategy, calibration=_calibration(tiny64, vectors))
    prompt = ids[0] + [t for doc in ids[1:] for t in doc + link_ids] + QUERY
    _, logits = prefill(tiny64, prompt)
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-10, atol=1e-10)
    assert linked.length == len(prompt)
    assert linked.recomputed == sum(LENGTHS[1:]) + 3 * len(link_ids)


@pytest.mark.parametrize("spelling", ["naive", "legolink:2", "legolink:1+reversed+top:1"])
def test_the_training_forward_equals_the_link(tiny64, spelling: str) -> None:
    chunks, _ = _chunks(tiny64)
    vectors = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    strategy = Strategy.parse(spelling + "+calibrated")
    arranged = [chunks[0], *strategy.arrange(chunks[1:])]
    linked = link(tiny64, arranged, QUERY, strategy, calibration=_calibration(tiny64, vectors))
    trained = trainable_logits(tiny64, arranged, QUERY, strategy, vectors, keep=2)
    torch.testing.assert_close(trained[-1], linked.next_logits, rtol=1e-10, atol=1e-10)
    alone = link(tiny64, arranged, QUERY, replace(strategy, calibrated=False))
    assert not torch.allclose(alone.next_logits, linked.next_logits)  # the tokens act
    assert linked.length == alone.length + 3 * 4


def test_the_training_forward_carries_gradients_to_the_vectors_only(tiny32) -> None:
    chunks, _ = _chunks(tiny32)
    vectors = torch.zeros(2, 64, requires_grad=True)
    logits = trainable_logits(tiny32, chunks, QUERY, Strategy.parse("naive"), vectors, keep=3)
    logits.logsumexp(-1).sum().backward()
    assert vectors.grad is not None and vectors.grad.abs().sum() > 0
    assert all(p.grad is None for p in tiny32.model.parameters())


def test_calibration_file_round_trips_and_refuses_damage(tiny32, tmp_path) -> None:
    vectors = torch.randn(3, 64)
    calibration = Calibration(vectors, tiny32.fingerprint, "sinks=", "naive+reversed", 7, 0.25)
    checksum = calibration.save(tmp_path / "c.safetensors")
    back = Calibration.load(tmp_path / "c.safetensors", checksum)
    torch.testing.assert_close(back.vectors, vectors)
    assert (back.fingerprint, back.encode, back.trained_with, back.steps, back.loss) == (
        tiny32.fingerprint, "sinks=", "naive+reversed", 7, 0.25
    )  # fmt: skip
    with pytest.raises(CalibrationError, match="checksum"):
        Calibration.load(tmp_path / "c.safetensors", "0" * 64)
    (tmp_path / "bad").write_bytes(b"\x00" * 3 + b"not a file")
    with pytest.raises(CalibrationError, match="not a calibration"):
        Calibration.load(tmp_path / "bad")
    with pytest.raises(CalibrationError, match="cannot read"):
        Calibration.load(tmp_path / "missing")


def test_calibrated_links_refuse_what_does_not_fit(tiny32, tiny64) -> None:
    chunks, _ = _chunks(tiny32)
    strategy = Strategy.parse("naive+calibrated")
    with pytest.raises(CalibrationError, match="rag-kvcache calibrate"):
        link(tiny32, chunks, QUERY, strategy)
    other = Calibration(torch.zeros(2, 64), tiny64.fingerprint, "sinks=", "naive")
    with pytest.raises(CalibrationError, match="trained on model"):
        link(tiny32, chunks, QUERY, strategy, calibration=other)
    wide = _calibration(tiny32, torch.zeros(2, 65))
    with pytest.raises(CalibrationError, match="width"):
        link(tiny32, chunks, QUERY, strategy, calibration=wide)
    sinks = _calibration(tiny32, torch.zeros(2, 64), EncodeSettings((1, 2)).key())
    with pytest.raises(CalibrationError, match="encoded with"):
        link(tiny32, chunks, QUERY, strategy, calibration=sinks)
    fits = _calibration(tiny32, torch.zeros(2, 64))
    with pytest.raises(StrategyError, match="not \\+calibrated"):
        link(tiny32, chunks, QUERY, Strategy.parse("naive"), calibration=fits)
    prefix = LinkedPrefix(chunks[0].keys, chunks[0].values, chunks[0].token_ids)
    with pytest.raises(StrategyError, match="prefix"):
        link(tiny32, chunks[1:], QUERY, strategy, prefix=prefix, calibration=fits)


def test_training_lowers_the_kl_to_prefill_and_resumes_exactly(tiny32, tmp_path) -> None:
    config = CalibrateConfig(
        strategy="naive+reversed", link_tokens=2, items=2, held_out=1, steps=6, lr=0.05,
        answer_tokens=4, checkpoint_every=1,
    )  # fmt: skip
    whole = calibrate(tiny32, config, tmp_path / "whole", items=ITEMS)
    assert len(whole.losses) == 6 and whole.calibration.steps == 6
    assert whole.calibration.fingerprint == tiny32.fingerprint
    assert min(whole.losses[-2:]) < whole.losses[0]  # training moves the KL down
    assert (tmp_path / "whole" / CHECKPOINT).exists()
    assert len(list((tmp_path / "whole" / "teachers").glob("*.safetensors"))) == 3  # kept
    assert (tmp_path / "whole" / "calibration.png").stat().st_size > 10_000  # the plot
    saved = Calibration.load(tmp_path / "whole" / "calibration.safetensors")
    torch.testing.assert_close(saved.vectors, whole.calibration.vectors)
    # stopped after 3 steps, then resumed to 6 (its teachers read back from the first
    # part): the same vectors as the run never stopped
    first = calibrate(tiny32, replace(config, steps=3), tmp_path / "cut", items=ITEMS)
    resumed = calibrate(tiny32, config, tmp_path / "cut", resume=True, items=ITEMS)
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5)
    # the training minutes are those of both sessions, not the resumed one's alone
    with safe_open(str(tmp_path / "cut" / CHECKPOINT), "pt") as f:
        trained_s = float(f.metadata()["trained_s"])
    assert resumed.train_minutes == pytest.approx(trained_s / 60)
    assert resumed.train_minutes > first.train_minutes > 0
    torch.testing.assert_close(resumed.calibration.vectors, whole.calibration.vectors)
    with pytest.raises(CalibrationError, match=r"other settings \(lr: lr=0.05 there\)"):
        calibrate(tiny32, replace(config, lr=0.1), tmp_path / "cut", resume=True, items=ITEMS)
    # other items (an --items-file added, dropped or edited) trained on unnoticed
    edited = [{**ITEMS[0], "question": "Another question?"}, *ITEMS[1:]]
    for other in (edited, None):
        with pytest.raises(CalibrationError, match="trained on other items"):
            calibrate(tiny32, config, tmp_path / "cut", resume=True, items=other)
    with pytest.raises(CalibrationError, match="at step 6, past --steps 4"):  # said 4, took 6
        calibrate(tiny32, replace(config, steps=4), tmp_path / "cut", resume=True, items=ITEMS)
    # --resume forgotten: the run went on afresh over its own checkpoint, losing its steps
    more = replace(config, steps=8)
    with pytest.raises(CalibrationError, match="stopped at step 6 of 8: go on from it with"):
        calibrate(tiny32, more, tmp_path / "cut", items=ITEMS)
    # (a run as long as the checkpoint's, or shorter, trains afresh: there is nothing to resume)
    assert (
        len(calibrate(tiny32, replace(config, steps=2), tmp_path / "cut", items=ITEMS).losses) == 2
    )
    assert calibrate(tiny32, replace(config, lr=0.1), tmp_path / "cut", items=ITEMS).losses
    # (another run's checkpoint, here of another --lr: trained afresh, as documented)
    # --resume where no run was: it trained from step 0 (for a mistyped --out)
    with pytest.raises(CalibrationError, match="no checkpoint to resume in"):
        calibrate(tiny32, config, tmp_path / "typo", resume=True, items=ITEMS)
    assert not (tmp_path / "typo" / "teachers").exists()  # refused before the teacher pass


@pytest.mark.parametrize("field", ["link_tokens", "items", "held_out", "steps", "answer_tokens"])
def test_a_count_of_zero_is_refused_before_anything_runs(field: str) -> None:
    """`--held-out 0` trained for minutes, then reported a KL over no items."""
    with pytest.raises(CalibrationError, match="must be >= 1"):
        CalibrateConfig(strategy="naive", **{field: 0})


def test_more_items_than_the_train_split_holds_are_refused_at_once(tiny32, tmp_path) -> None:
    """`--items 100000` made the split for minutes, then would have trained for days."""
    config = CalibrateConfig(strategy="naive", items=100_000)
    with pytest.raises(CalibrationError, match="holds at most 1800 items of a context size"):
        calibrate(tiny32, config, tmp_path / "out")


def test_a_diverging_or_damaged_calibration_is_refused_never_kept(
    tiny32, tmp_path, monkeypatch
) -> None:
    """`--lr inf` trained NaN vectors, saved and installed them, and every calibrated answer
    was then empty with no error. Divergence stops the training (the checkpoint keeps the last
    finite step), non-finite vectors are no calibration, a non-finite or negative learning
    rate is refused before anything runs, and a damaged checkpoint is one clear error."""
    for lr in (math.inf, math.nan, -1.0, 0.0, 1e38):
        with pytest.raises(CalibrationError, match="learning rate must be above 0"):
            CalibrateConfig(strategy="naive", lr=lr)
    config = CalibrateConfig(
        strategy="naive+reversed", link_tokens=2, items=2, held_out=1, steps=3, lr=0.05,
        answer_tokens=4, checkpoint_every=1,
    )  # fmt: skip
    calibrate(tiny32, replace(config, steps=1), tmp_path / "nan", items=ITEMS)
    checkpoint = tmp_path / "nan" / CHECKPOINT
    with safe_open(str(checkpoint), "pt") as f:  # its vectors made NaN, as a diverged step's
        meta = f.metadata()
    tensors = load_file(str(checkpoint))
    save_file(
        {**tensors, "vectors": torch.full_like(tensors["vectors"], math.nan)}, checkpoint, meta
    )
    (tmp_path / "nan" / "calibration.safetensors").unlink()
    with pytest.raises(CalibrationError, match="holds values that are not finite"):
        calibrate(tiny32, config, tmp_path / "nan", resume=True, items=ITEMS)  # not the --lr's
    assert not (tmp_path / "nan" / "calibration.safetensors").exists()
    assert torch.isnan(load_file(str(checkpoint))["vectors"]).all()  # not overwritten by step 2
    # a step whose loss is not finite stops the run before the checkpoint keeps it
    real, steps = calibration_module.example_kl, iter(range(100))

    def nan_at_step_2(*args: Any) -> torch.Tensor:  # training steps, not the held-out KL's
        loss = real(*args)
        return loss * math.nan if torch.is_grad_enabled() and next(steps) == 1 else loss

    monkeypatch.setattr(calibration_module, "example_kl", nan_at_step_2)
    with pytest.raises(CalibrationError, match="training diverged at step 2"):
        calibrate(tiny32, config, tmp_path / "diverges", items=ITEMS)
    monkeypatch.undo()
    assert load_file(str(tmp_path / "diverges" / CHECKPOINT))["vectors"].isfinite().all()
    assert not (tmp_path / "diverges" / "calibration.safetensors").exists()
    with pytest.raises(CalibrationError, match="not finite"):
        Calibration(torch.full((2, 64), math.nan), tiny32.fingerprint, "sinks=", "naive")
    good = Calibration(torch.zeros(2, 64), tiny32.fingerprint, "sinks=", "naive")
    data = bytearray(good.to_bytes())
    at = bytes(data).rindex(bytes(4 * 64 * 2))  # the vectors' bytes, at the end
    data[at : at + 4] = struct.pack("<f", math.inf)
    with pytest.raises(CalibrationError, match="not finite"):
        Calibration.from_bytes(bytes(data))
    once = calibrate(tiny32, replace(config, steps=1), tmp_path / "t", items=ITEMS)
    for kept in (tmp_path / "t" / "teachers").glob("*.safetensors"):  # truncated: made again
        kept.write_bytes(kept.read_bytes()[:50])
    again = calibrate(tiny32, replace(config, steps=1), tmp_path / "t", items=ITEMS)
    assert again.losses == pytest.approx(once.losses)
    kept_files = sorted((tmp_path / "t" / "teachers").glob("*.safetensors"))
    narrow, short = kept_files[0], kept_files[1]  # readable, of the wrong form: made again
    saved = load_file(str(narrow))
    shape = saved["teacher"].shape
    save_file({**saved, "teacher": saved["teacher"][:, :7].contiguous()}, narrow)  # a RuntimeError
    saved = load_file(str(short))
    save_file({**saved, "new_ids": saved["new_ids"][:1].contiguous()}, short)
    again = calibrate(tiny32, replace(config, steps=1), tmp_path / "t", items=ITEMS)
    assert again.losses == pytest.approx(once.losses)
    assert load_file(str(narrow))["teacher"].shape == shape  # written anew
    # metadata of valid JSON but not of the form a run writes: no traceback either
    for edit in ({"config": "[1, 2]"}, {"losses": '{"a": 1}'}, {"losses": "[" * 100_000}):
        save_file(tensors, checkpoint, {**meta, **edit})
        with pytest.raises(CalibrationError, match="is damaged"):
            calibrate(tiny32, replace(config, steps=1), tmp_path / "nan", resume=True, items=ITEMS)
    checkpoint.write_bytes(b"\x08" + bytes(20))  # truncated
    with pytest.raises(CalibrationError, match="is damaged"):
        calibrate(tiny32, config, tmp_path / "nan", resume=True, items=ITEMS)


# ----------------------------------------------------------------------------- in the store


def test_a_calibration_kept_in_the_catalog_reaches_every_engine_on_it(
    tiny32, target, tmp_path
) -> None:
    """Kept per model and encoding in the catalog (SQLite, PostgreSQL): a second engine on
    the same catalog answers with it; a damaged row is a clear error, never used."""

    def engine() -> RagKVCache:
        store = TieredStore(tmp_path / "kv", catalog=target.open())
        config = EngineConfig(generation=GenerationConfig(max_new_tokens=6))
        return RagKVCache(config, lm=tiny32, store=store)

    first = engine()
    ids = first.generate_context_cache(["The river is the Vell.", "Its mayor is Ivo Stark."])
    with pytest.raises(CalibrationError, match="rag-kvcache calibrate"):
        first.generate("Who is the mayor?", ids, strategy="naive+calibrated")
    vectors = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    calibration = Calibration(vectors, tiny32.fingerprint, first.doc_settings.key(), "naive")
    first.set_calibration(calibration)
    second = engine()
    answer = second.generate("Who is the mayor?", ids, strategy="naive+calibrated")
    chunks = second.store.get([second.prefix_id, *ids])
    question = second.template.question_ids(tiny32.tokenizer, "Who is the mayor?")
    linked = link(
        tiny32, chunks, question, Strategy.parse("naive+calibrated"), calibration=calibration
    )
    assert answer.token_ids[0] == int(linked.next_logits.argmax())
    assert answer.recomputed_tokens == 2 * 3  # the link tokens, nothing else
    with pytest.raises(CalibrationError, match="trained on model"):
        first.set_calibration(replace(calibration, fingerprint="0" * 16))
    with pytest.raises(StrategyError, match="one at a time"):
        second.generate_batch([BatchRequest("Who?", ids)], strategy="naive+calibrated")
    catalog = second.store.catalog
    data, _ = catalog.calibration(tiny32.fingerprint, first.doc_settings.key())
    with catalog._write() as conn:  # damage the row behind the catalog's back
        conn.execute(update(LinkCalibration).values(data=data[:-1] + b"\x00"))
    with pytest.raises(StoreDamagedError, match="calibrate"):
        second.generate("Who is the mayor?", ids, strategy="naive+calibrated")
    # verify finds it (it called the store clean) and --repair drops it, naming the retraining
    report = second.store.verify(repair=False)
    assert [(f.kind, f.fingerprint, f.intact) for f in report.damaged_files] == [
        ("calibration", tiny32.fingerprint, False)
    ]
    assert [f.intact for f in catalog.model_files()] == [False]
    assert second.store.verify(repair=True).damaged_files == report.damaged_files
    assert catalog.model_files() == [] and second.store.verify(repair=False).damaged_files == []
    with pytest.raises(CalibrationError, match="rag-kvcache calibrate"):  # none: train one
        second.generate("Who is the mayor?", ids, strategy="naive+calibrated")


def test_a_failed_atomic_write_names_its_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    """A folder where the file goes (a report's `ttft.json`): the error was the temporary's,
    `ttft.json.tmp`, which stayed beside it."""
    from rag_kvcache.model.calibration_file import write_atomically

    (tmp_path / "ttft.json").mkdir()
    with pytest.raises(IsADirectoryError) as failed:
        write_atomically(tmp_path / "ttft.json", b"{}")
    assert failed.value.filename == str(tmp_path / "ttft.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ttft.json"]
    assert (
        write_atomically(tmp_path / "ok.json", b"{}")
        and (tmp_path / "ok.json").read_bytes() == b"{}"
    )
    (tmp_path / "x.json").mkdir()  # a folder where the temporary goes: still the file's error
    (tmp_path / "x.json.tmp").mkdir()
    with pytest.raises(IsADirectoryError) as failed:
        write_atomically(tmp_path / "x.json", b"{}")
    assert failed.value.filename == str(tmp_path / "x.json")
