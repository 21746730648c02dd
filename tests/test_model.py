import pytest
import torch
from helpers import build_tiny, tiny_config
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from rag_kvcache.config import ModelConfig
from rag_kvcache.errors import ConfigError, UnsupportedModelError
from rag_kvcache.model.loading import (
    check_supported,
    convert_gguf,
    default_model_path,
    load_model,
    model_fingerprint,
    native_on_cpu,
    warn_if_emulated,
)
from rag_kvcache.strategy import Strategy


def _refusal(model) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        check_supported(model.config, model)
    return str(info.value)


def test_length_dependent_rope_is_refused() -> None:
    config = tiny_config(
        vocab_size=64,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    assert "'dynamic' depends on sequence length" in _refusal(LlamaForCausalLM(config))


def test_sliding_window_is_refused() -> None:
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=16,
    )
    assert "sliding-window" in _refusal(MistralForCausalLM(config))


def test_model_without_rope_is_refused() -> None:
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    assert "only RoPE models" in _refusal(GPT2LMHeadModel(config))


def test_what_is_not_a_model_is_one_clear_error(tmp_path) -> None:
    """A missing path, a folder of something else, a file that only says it is GGUF: one line
    each, not transformers' or gguf's page of traceback."""
    with pytest.raises(ConfigError, match="no model at .*missing: give a model folder"):
        load_model(ModelConfig(path=str(tmp_path / "missing")))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a model")
    with pytest.raises(UnsupportedModelError, match="notes is not a model this can load"):
        load_model(ModelConfig(path=str(tmp_path / "notes")))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"\x7fELF" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="fake.gguf is not a model this can load"):
        load_model(ModelConfig(path=str(fake), cache_dir=tmp_path / "cache"))


@pytest.mark.parametrize("bad", ["missing", "notes", "fake.gguf", "random:huge"])
def test_a_model_that_cannot_load_leaves_no_store_behind(bad: str, tmp_path, capsys) -> None:
    """`ingest --model <typo>` made the store folder (catalog, marker) before the model
    failed. The model is checked first: one error line, and no folder."""
    from rag_kvcache.tools.cli import main

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a model")
    (tmp_path / "fake.gguf").write_bytes(b"\x7fELF" + bytes(64))
    (tmp_path / "doc.md").write_text("The ferry leaves at dawn.")
    model = bad if bad.startswith("random:") else str(tmp_path / bad)
    store = tmp_path / "kv"
    assert main(["ingest", str(tmp_path / "doc.md"), "--store", str(store), "--model", model]) == 1
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert out.startswith("error:") and "Traceback" not in out, out
    assert not store.exists()


def test_static_rope_variants_are_accepted() -> None:
    for rope in ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, None):
        config = tiny_config(vocab_size=64, **({"rope_parameters": rope} if rope else {}))
        check_supported(config, LlamaForCausalLM(config))


def test_fingerprint_tells_weights_and_dtype_apart(tiny64) -> None:
    same = build_tiny(torch.float64)
    assert same.fingerprint == tiny64.fingerprint
    assert build_tiny(torch.float32).fingerprint != tiny64.fingerprint
    assert build_tiny(torch.float64, seed=1).fingerprint != tiny64.fingerprint
    nudged = build_tiny(torch.float64)
    nudged.model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    assert model_fingerprint(nudged.model, torch.float64) != tiny64.fingerprint


def test_default_model_facts(smol) -> None:
    assert smol.num_layers == 30 and smol.num_kv_heads == 3 and smol.head_dim == 64
    assert smol.max_context == 8192 and smol.dtype == torch.float32
    assert smol.tokenizer.convert_ids_to_tokens(list(smol.eos_ids)) == ["<|im_end|>"]


@pytest.mark.slow  # converts SmolLM2's GGUF
def test_gguf_is_converted_once_and_reused() -> None:
    cache_dir = ModelConfig().cache_dir
    folder = convert_gguf(default_model_path(), cache_dir)  # converted by the smol fixture
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(default_model_path(), cache_dir) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(folder.parent.glob(".converting-*"))  # no half-written folder left


def test_random_weight_models_take_real_shapes_and_link_exactly(smol) -> None:
    """`random:NAME` builds a Llama of named shapes with random weights (for speed runs at
    real sizes): deterministic, SmolLM2's tokenizer, and linking stays exact on it."""
    from rag_kvcache.link.encoder import encode_chunks
    from rag_kvcache.link.linker import link
    from rag_kvcache.model.loading import RANDOM_SHAPES, load_model
    from rag_kvcache.serving.decoding import prefill

    lm = load_model(ModelConfig(path="random:tiny"))
    shapes = RANDOM_SHAPES["tiny"]
    assert (lm.num_layers, lm.num_kv_heads, lm.max_context) == (
        shapes["num_hidden_layers"],
        shapes["num_key_value_heads"],
        shapes["max_position_embeddings"],
    )
    assert lm.model.config.vocab_size == len(smol.tokenizer) and lm.name == "random-tiny"
    assert load_model(ModelConfig(path="random:tiny")).fingerprint == lm.fingerprint
    ids = [[5, 6, 7, 8], list(range(100, 140)), list(range(900, 930))]
    linked = link(lm, encode_chunks(lm, ids), [11, 12, 13], Strategy.parse("full"))
    _, logits = prefill(lm, [t for c in ids for t in c] + [11, 12, 13])
    torch.testing.assert_close(linked.next_logits, logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="unknown random model shapes 'llama-9'"):
        load_model(ModelConfig(path="random:llama-9"))


def test_random_smollm2_shapes_take_the_tokenizer_of_a_folder(smol, tmp_path, monkeypatch):
    """SmolLM2's architecture with random weights, its tokenizer from a folder holding only
    tokenizer files (RAG_KVCACHE_MODEL): SmolLM2's speed where its package is not installed."""
    from rag_kvcache.model.loading import load_model

    smol.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("RAG_KVCACHE_MODEL", str(tmp_path))
    lm = load_model(ModelConfig(path="random:smollm2-135m"))
    real = sum(p.numel() for p in smol.model.parameters())
    assert sum(p.numel() for p in lm.model.parameters()) == real  # the same architecture
    assert (lm.num_layers, lm.num_kv_heads, lm.head_dim) == (
        smol.num_layers,
        smol.num_kv_heads,
        smol.head_dim,
    )
    assert len(lm.tokenizer) == len(smol.tokenizer)


def _cpu_probes(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: present)


@pytest.mark.parametrize("present", [False, True])
def test_narrow_dtypes_are_native_only_where_the_cpu_computes_them(
    monkeypatch: pytest.MonkeyPatch, present: bool
) -> None:
    _cpu_probes(monkeypatch, present)
    assert native_on_cpu(torch.bfloat16) is present
    assert native_on_cpu(torch.float16) is present
    assert native_on_cpu(torch.float32)  # every CPU


def test_an_emulated_dtype_is_warned_of_at_load(
    tiny32, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "tiny"
    tiny32.model.save_pretrained(folder)
    tiny32.tokenizer.save_pretrained(folder)
    _cpu_probes(monkeypatch, False)
    with caplog.at_level("WARNING", logger="rag_kvcache.model.loading"):
        load_model(ModelConfig(path=str(folder), dtype="bfloat16"))
    assert "no bfloat16 arithmetic" in caplog.text and "use dtype float32" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rag_kvcache.model.loading"):
        load_model(ModelConfig(path=str(folder), dtype="float32"))  # always native
        _cpu_probes(monkeypatch, True)  # a CPU with AVX-512 BF16 or AMX
        load_model(ModelConfig(path=str(folder), dtype="bfloat16"))
        _cpu_probes(monkeypatch, False)
        warn_if_emulated(torch.bfloat16, torch.device("cuda"))  # GPUs: not this check's
    assert caplog.text == ""
