"""LoRA link calibration: the block-wise student equals the link, an adapter of zero updates
is the base model, a merged adapter links as it was trained, its file's refusals, and a
training run that lowers the KL to prefill, resumes, and leaves the model as it found it."""

from dataclasses import replace

import pytest
import torch
from helpers import CALIBRATION_ITEMS as ITEMS
from helpers import build_tiny, random_chunks
from sqlalchemy import update

from rag_kvcache.config import STORED_LORA, EngineConfig, GenerationConfig, ModelConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import CalibrationError, ConfigError, StoreDamagedError, StrategyError
from rag_kvcache.kv import EncodeSettings
from rag_kvcache.link.block_attention import block_logits
from rag_kvcache.link.calibration import Calibration
from rag_kvcache.link.encoder import encode_chunks
from rag_kvcache.link.linker import link
from rag_kvcache.model.adapter import forward
from rag_kvcache.model.loading import load_model
from rag_kvcache.model.lora import TARGETS, LinkLoRA, add_lora, lora_tensors, remove_lora
from rag_kvcache.storage.store import TieredStore
from rag_kvcache.storage.tables import LinkAdapter
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.calibrate import CHECKPOINT, LORA_RESULT, CalibrateConfig, calibrate

LENGTHS = [6, 11, 4, 9, 7]  # prefix, then four document chunks
QUERY = [7, 8, 9, 10, 11]


def _chunks(lm, settings=EncodeSettings()):
    ids = random_chunks(LENGTHS, seed=5)
    return encode_chunks(lm, ids[:1]) + encode_chunks(lm, ids[1:], settings)


def _saved_tiny(tokenizer, seed: int, folder):
    """A tiny model saved as an HF folder and loaded from it, as users load theirs."""
    built = build_tiny(torch.float64, seed=seed, tokenizer=tokenizer)
    built.model.save_pretrained(folder)
    built.tokenizer.save_pretrained(folder)
    return load_model(ModelConfig(path=str(folder), dtype="float64"))


def _adapter_tensors(lm, rank: int) -> dict:
    """A fresh adapter's tensors for `lm`, its model left as it was."""
    add_lora(lm.model, rank, 2 * rank)
    try:
        return lora_tensors(lm.model)
    finally:
        remove_lora(lm.model, merge=False)


def _has_lora(lm) -> bool:
    layers = any("lora_" in name for name, _ in lm.model.named_parameters())
    return layers or hasattr(lm.model, "peft_config")


@pytest.mark.parametrize(
    "spelling",
    [
        "naive",
        "naive+reversed",
        "naive+reversed+top:1",
        "naive+top:2+window:8",
        "naive+reversed+top:1+window:5",
        "naive+rotated",
    ],
)
@pytest.mark.parametrize("sinks", [(), (3, 4)])
def test_block_attention_equals_the_link(tiny64, spelling: str, sinks) -> None:
    """One forward with a block mask computes what linking chunks encoded alone does: a
    chunk's own sink copy, the chunks recomputed whole and their window included."""
    chunks = _chunks(tiny64, EncodeSettings(sinks))
    strategy = Strategy.parse(spelling)
    arranged = [chunks[0], *strategy.arrange(chunks[1:])]
    linked = link(tiny64, arranged, QUERY, strategy)
    student = block_logits(tiny64, arranged, QUERY, strategy, keep=3)
    assert student.shape[0] == 3
    # HF computes RoPE angles in float32 even for a float64 model (test_rope), and the block
    # mask's keys are RoPE'd where they sit, the link's moved there: hence the tolerance
    torch.testing.assert_close(student[-1], linked.next_logits, rtol=1e-5, atol=1e-5)


def test_block_attention_is_not_a_prefill(tiny64) -> None:
    """The mask acts: the same prompt attended in full gives other logits."""
    chunks = _chunks(tiny64)
    student = block_logits(tiny64, chunks, QUERY, Strategy.parse("naive"), keep=1)
    prompt = [t for c in chunks for t in c.token_ids] + QUERY
    full, _ = forward(tiny64, torch.tensor([prompt]), logits_to_keep=1)
    assert (student[-1] - full[0, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("spelling", ["legolink:2", "naive+calibrated", "naive+ape:0.8,1"])
def test_block_attention_refuses_what_it_does_not_compute(tiny32, spelling: str) -> None:
    with pytest.raises(StrategyError, match="naive linking"):
        block_logits(tiny32, _chunks(tiny32), QUERY, Strategy.parse(spelling), keep=1)
    with pytest.raises(StrategyError, match="naive linking"):
        CalibrateConfig(kind="lora", strategy=spelling)


def test_a_zero_adapter_is_the_base_model(tiny_tokenizer, tmp_path) -> None:
    """Freshly injected (B = 0) the adapter changes no logit; merged, no weight: the same
    fingerprint, so the same cached KV."""
    folder, file = tmp_path / "tiny", tmp_path / "zero.safetensors"
    lm = _saved_tiny(tiny_tokenizer, 3, folder)
    prompt = torch.tensor([random_chunks([20], seed=1)[0]])
    before, _ = forward(lm, prompt)
    weights = {k: v.clone() for k, v in lm.model.state_dict().items()}
    params = add_lora(lm.model, rank=4, alpha=8)
    assert params and all(p.requires_grad for p in params.values())
    after, _ = forward(lm, prompt)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    zero = LinkLoRA(lora_tensors(lm.model), 4, 8, TARGETS, lm.fingerprint, "naive")
    remove_lora(lm.model, merge=False)
    assert not _has_lora(lm)
    zero.save(file)
    merged = load_model(ModelConfig(path=str(folder), dtype="float64", lora=str(file)))
    assert not _has_lora(merged)
    for name, weight in merged.model.state_dict().items():
        torch.testing.assert_close(weight, weights[name], rtol=0, atol=0)
    assert merged.fingerprint == lm.fingerprint


def test_a_merged_adapter_links_as_it_was_trained(tiny_tokenizer, tmp_path) -> None:
    """Training sees `block_logits` with the adapter's layers in; users link with it merged
    into the weights, from chunks the adapted model encoded: the same logits. The adapted
    model is another model to the store (its own fingerprint, its own cache IDs)."""
    folder, file = tmp_path / "tiny", tmp_path / "lora.safetensors"
    lm = _saved_tiny(tiny_tokenizer, 4, folder)
    base_chunks = _chunks(lm)
    params = add_lora(lm.model, rank=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    strategy = Strategy.parse("naive+reversed+top:1")
    arranged = [base_chunks[0], *strategy.arrange(base_chunks[1:])]  # token ids only
    trained = block_logits(lm, arranged, QUERY, strategy, keep=1)[-1]
    lora = LinkLoRA(lora_tensors(lm.model), 4, 8, TARGETS, lm.fingerprint, str(strategy))
    lora.save(file)
    merged = load_model(ModelConfig(path=str(folder), dtype="float64", lora=str(file)))
    assert "+lora-" in merged.name and merged.fingerprint != lm.fingerprint
    chunks = _chunks(merged)
    assert {c.cache_id for c in chunks}.isdisjoint(c.cache_id for c in base_chunks)
    linked = link(merged, [chunks[0], *strategy.arrange(chunks[1:])], QUERY, strategy)
    torch.testing.assert_close(linked.next_logits, trained, rtol=1e-5, atol=1e-5)
    remove_lora(lm.model, merge=False)
    unadapted = link(lm, arranged, QUERY, strategy)
    assert (unadapted.next_logits - trained).abs().max() > 1e-4  # the adapter acts


def test_adapter_files_and_models_that_do_not_fit_are_refused(tiny32, tmp_path) -> None:
    lora = LinkLoRA({"x": torch.zeros(1)}, 4, 8, TARGETS, "f" * 24, "naive", 3, 0.5)
    back = LinkLoRA.from_bytes(lora.to_bytes())
    assert (back.rank, back.alpha, back.targets, back.steps, back.loss) == (4, 8, TARGETS, 3, 0.5)
    with pytest.raises(CalibrationError, match="not a LoRA adapter"):
        LinkLoRA.from_bytes(b"\x00" * 3 + b"not a file")
    tokens = Calibration(torch.zeros(2, 64), tiny32.fingerprint, "sinks=", "naive")
    with pytest.raises(CalibrationError, match="not a LoRA adapter"):
        LinkLoRA.from_bytes(tokens.to_bytes())  # the other kind of calibration
    with pytest.raises(CalibrationError, match="not valid"):
        LinkLoRA.from_bytes(replace(lora, targets=("gate_proj",)).to_bytes())
    folder = tmp_path / "tiny"
    tiny32.model.save_pretrained(folder)
    tiny32.tokenizer.save_pretrained(folder)
    lora.save(tmp_path / "other.safetensors")
    with pytest.raises(CalibrationError, match="trained on model"):
        load_model(ModelConfig(path=str(folder), lora=str(tmp_path / "other.safetensors")))
    loaded = load_model(ModelConfig(path=str(folder)))
    fitted = replace(lora, base_fingerprint=loaded.fingerprint)  # its tensors fit nothing
    fitted.save(tmp_path / "misfit.safetensors")
    with pytest.raises(CalibrationError, match="does not fit"):
        load_model(ModelConfig(path=str(folder), lora=str(tmp_path / "misfit.safetensors")))
    rank4 = LinkLoRA(_adapter_tensors(loaded, rank=4), 4, 8, TARGETS, loaded.fingerprint, "n")
    replace(rank4, rank=2, alpha=4).save(tmp_path / "rank.safetensors")  # tensors of rank 4
    with pytest.raises(CalibrationError, match="does not fit"):
        load_model(ModelConfig(path=str(folder), lora=str(tmp_path / "rank.safetensors")))
    with pytest.raises(ConfigError, match="no LoRA adapter file"):
        load_model(ModelConfig(path=str(folder), lora=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="random-weight"):
        load_model(ModelConfig(path="random:tiny", lora=str(tmp_path / "other.safetensors")))
    with pytest.raises(ConfigError, match="quantization"):
        load_model(ModelConfig(quantization="8bit", lora=str(tmp_path / "other.safetensors")))


def test_an_adapter_kept_in_the_catalog_loads_as_its_file_does(
    tiny_tokenizer, target, tmp_path
) -> None:
    """Kept under the base model's fingerprint in the catalog (SQLite, PostgreSQL),
    `lora="store"` merges the adapter into every engine opened on it: the model its file
    gives, weight for weight, answering from its own chunks. None kept, or a damaged row:
    a clear error, the base model never used in its place."""
    folder, file = tmp_path / "tiny", tmp_path / "lora.safetensors"
    lm = _saved_tiny(tiny_tokenizer, 4, folder)
    tensors = _adapter_tensors(lm, rank=4)
    g = torch.Generator().manual_seed(1)
    tensors = {
        k: 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) if "lora_B" in k else v
        for k, v in tensors.items()
    }
    lora = LinkLoRA(tensors, 4, 8, TARGETS, lm.fingerprint, "naive")
    lora.save(file)
    from_file = load_model(ModelConfig(path=str(folder), dtype="float64", lora=str(file)))
    assert from_file.fingerprint != lm.fingerprint
    stored = EngineConfig(
        model=ModelConfig(path=str(folder), dtype="float64", lora=STORED_LORA),
        generation=GenerationConfig(max_new_tokens=3),
    )

    def store() -> TieredStore:
        return TieredStore(tmp_path / "kv", catalog=target.open())

    base = RagKVCache(EngineConfig(), lm=lm, store=store())  # registers the base model
    with pytest.raises(CalibrationError, match="calibrate --kind lora"):
        RagKVCache(stored, store=store())
    base.store.put_adapter(lm.fingerprint, lora.to_bytes())
    adapted = RagKVCache(stored, store=store())
    assert (adapted.lm.name, adapted.lm.fingerprint) == (from_file.name, from_file.fingerprint)
    weights = from_file.model.state_dict()
    for name, weight in adapted.lm.model.state_dict().items():
        torch.testing.assert_close(weight, weights[name], rtol=0, atol=0)
    ids = adapted.generate_context_cache(["The river is the Vell.", "Its mayor is Ivo Stark."])
    chunks = adapted.store.get(ids)
    assert {c.fingerprint for c in chunks} == {from_file.fingerprint}
    answer = adapted.generate("Who is the mayor?", ids, strategy="prefill")
    question = adapted.template.question_ids(from_file.tokenizer, "Who is the mayor?")
    prefix = adapted.store.get([adapted.prefix_id])
    full = link(from_file, prefix + chunks, question, Strategy.parse("full"))
    assert answer.token_ids[0] == int(full.next_logits.argmax())
    with pytest.raises(ConfigError, match="through RagKVCache"):  # no store to read it from
        load_model(ModelConfig(path=str(folder), dtype="float64", lora=STORED_LORA))
    catalog = adapted.store.catalog
    data, _ = catalog.adapter(lm.fingerprint)
    with catalog._write() as conn:  # damage the row behind the catalog's back
        conn.execute(update(LinkAdapter).values(data=data[:-1] + b"\x00"))
    with pytest.raises(StoreDamagedError, match="calibrate --kind lora"):
        RagKVCache(stored, store=store())


def test_lora_training_lowers_the_kl_to_prefill_and_resumes_exactly(
    tiny32, tiny64, tmp_path
) -> None:
    config = CalibrateConfig(
        strategy="naive+reversed", kind="lora", rank=2, items=2, held_out=1, steps=6, lr=0.02,
        answer_tokens=4, checkpoint_every=1,
    )  # fmt: skip
    whole = calibrate(tiny32, config, tmp_path / "whole", items=ITEMS)
    assert not _has_lora(tiny32)  # the caller's model is the base model again
    lora = whole.calibration
    assert isinstance(lora, LinkLoRA) and lora.steps == 6 and lora.rank == 2
    assert lora.base_fingerprint == tiny32.fingerprint
    assert len(whole.losses) == 6 and min(whole.losses[-2:]) < whole.losses[0]
    assert whole.kl_before == whole.kl_without  # a fresh adapter is the strategy alone
    assert (tmp_path / "whole" / CHECKPOINT).exists()
    saved = LinkLoRA.load(tmp_path / "whole" / LORA_RESULT)
    assert saved.tensors.keys() == lora.tensors.keys()
    assert any(float(t.abs().max()) > 0 for k, t in saved.tensors.items() if "lora_B" in k)
    # stopped after 3 steps, then resumed to 6: the adapter of the run never stopped
    calibrate(tiny32, replace(config, steps=3), tmp_path / "cut", items=ITEMS)
    resumed = calibrate(tiny32, config, tmp_path / "cut", resume=True, items=ITEMS)
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5)
    assert resumed.kl_without == pytest.approx(whole.kl_without)  # the model alone, still
    assert isinstance(resumed.calibration, LinkLoRA)
    for name, tensor in lora.tensors.items():
        torch.testing.assert_close(resumed.calibration.tensors[name], tensor)
    tokens = replace(config, kind="tokens", strategy="naive+reversed", link_tokens=2)
    with pytest.raises(CalibrationError, match="other settings"):
        calibrate(tiny32, tokens, tmp_path / "cut", resume=True, items=ITEMS)
    assert not _has_lora(tiny32)
    with pytest.raises(CalibrationError, match="trained on model"):  # another model's
        calibrate(tiny64, config, tmp_path / "cut", resume=True, items=ITEMS)
    assert not _has_lora(tiny64)
