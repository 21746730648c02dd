"""The one module that touches transformers internals.

Everything version-specific lives here: our attention function and its registration,
KV caches over preallocated buffers (build, unpack, write in place, per-layer hooks), the
forward call, and the forward that narrows its rows layer by layer (CacheBlend's). Other
modules see `LoadedModel`, plain tensors and an opaque `Cache`. The attention's planning
and kernels on plain tensors (query blocks, grouped sdpa, masks) are
`rag_kvcache.model.attention`'s.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rag_kvcache.errors import UnsupportedModelError
from rag_kvcache.model.arithmetic import active as counting_arithmetic
from rag_kvcache.model.arithmetic import count_attention
from rag_kvcache.model.attention import (
    QueryBlock,
    _sdpa,
    additive_mask,
    grouped_sdpa,
    query_blocks,
    with_key_bias,
)
from rag_kvcache.model.buffers import POOL
from rag_kvcache.model.graphs import ForwardGraphs, Replay, Slab, graphs_of, rows_bucket

if TYPE_CHECKING:
    from rag_kvcache.model.loading import LoadedModel

Cache = DynamicCache

# ----------------------------------------------------------------------------- attention

ATTENTION = "rag_kvcache_sdpa"


def gqa_sdpa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's sdpa, made cheaper on CPU for the linker's masked forward.

    On the CPU (multi-head models as well as grouped ones):
    - grouped KV heads are read as they are (`enable_gqa`); HF repeats K/V for every query
      head whenever a mask is given, and the linker always gives one;
    - a tall masked query is attended in blocks of rows (`query_blocks`, planned once per
      forward), each over only the keys its rows may see: recomputed tokens early in the
      context skip the keys after them, and tokens that read a window (`+window:W`) the keys
      outside it, which a mask alone would still multiply. Exact, since the keys skipped are
      masked for every row of the block.
    `reference_attention` is the plain version it is tested against.

    A forward given `attention_hook` (see `forward`) hands attention to it instead: batched
    decoding over shared prefixes attends to KV that lives outside the HF cache.
    """
    if _captured_queries is not None:  # `capture_queries` is active (diagnosis only)
        scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        captured = (module.layer_idx, query.detach().clone(), scaling, kwargs.get("key_bias"))
        _captured_queries.append(captured)
    hook = kwargs.get("kv_attention_hook")
    if hook is not None:
        return hook(module.layer_idx, query, kwargs.get("scaling")), None
    count_attention(query, key, value, attention_mask)  # for `arithmetic.counted` only
    bias = kwargs.pop("key_bias", None)
    if bias is not None and not kwargs.pop("mask_has_key_bias", False):
        attention_mask = with_key_bias(attention_mask, bias, query.shape[2], key.shape[2])
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if query.device.type != "cpu" and grouped and attention_mask is not None:
        out = grouped_sdpa(query, key, value, attention_mask, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scale = kwargs.get("scaling")
    blocks: list[QueryBlock] | None = kwargs.get("query_blocks")
    if blocks is None or attention_mask is None:
        out = _sdpa(query, key, value, attention_mask, scale)
    else:
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per shared index, once
        for block in blocks:
            n = block.count
            if block.keys is None:  # a prefix of the keys: views, no copy
                k, v = key[:, :, :n], value[:, :, :n]
            else:  # scattered (a window): gathered once for the blocks that share it
                if id(block.keys) not in gathered:
                    gathered[id(block.keys)] = (
                        key.index_select(2, block.keys),
                        value.index_select(2, block.keys),
                    )
                k, v = (t[:, :, :n] for t in gathered[id(block.keys)])
            rows = block.rows
            out[:, :, rows] = _sdpa(query[:, :, rows], k, v, block.mask, scale)
    return out.transpose(1, 2).contiguous(), None  # [B, Q, heads, d]


CapturedQuery = tuple[int, torch.Tensor, float, torch.Tensor | None]
_captured_queries: list[CapturedQuery] | None = None


@contextmanager
def capture_queries() -> Iterator[list[CapturedQuery]]:
    """While active, every call of our attention function appends (layer, query
    [B, heads, Q, head_dim] after RoPE, scale, key bias [>= keys] or None: see
    `set_key_bias`) to the list it yields.

    Queries are never cached, yet attention weights need them: the diagnosis tool
    (`rag_kvcache.tools.diagnosis`) recomputes the question tokens' attention from them and the
    cache's keys. Not thread-safe; off (the default) the attention function only checks it.
    """
    global _captured_queries
    captured: list[CapturedQuery] = []
    outer, _captured_queries = _captured_queries, captured
    try:
        yield captured
    finally:
        _captured_queries = outer


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


def register_attention() -> None:
    """Make ATTENTION a transformers attention implementation (idempotent). Called when a model
    is loaded or wrapped, so importing rag_kvcache changes nothing in transformers."""
    AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
    # the same masks as sdpa; without a mask registration multi-token queries get no causal mask
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


# ----------------------------------------------------------------------------- RoPE


def rope_frequencies(model: Any) -> dict[str, torch.Tensor]:
    """The inverse RoPE frequencies [rotary_dim / 2] of a HF causal LM, per layer type in use
    (`{"all": inv_freq}` for a model with one rotary embedding); empty without RoPE.

    Most models keep one `rotary_emb.inv_freq`. Models whose config gives RoPE settings per
    layer type (Gemma 3: `rope_parameters = {"full_attention": ..., "sliding_attention":
    ...}`) keep one `<layer type>_inv_freq` buffer per type instead.
    """
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return {}
    if isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return {"all": rotary.inv_freq}
    text = model.config.get_text_config(decoder=True)
    types = set(getattr(text, "layer_types", None) or [])
    found = {t: getattr(rotary, f"{t}_inv_freq", None) for t in types}
    if not found or any(not isinstance(f, torch.Tensor) for f in found.values()):
        return {}  # a layer type without RoPE: its keys must not be rotated
    return {t: f for t, f in sorted(found.items()) if isinstance(f, torch.Tensor)}


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
        self.key_bias: torch.Tensor | None = None  # [capacity] added to every attention score
        self.released = False  # its buffers handed back for reuse (`release_buffers`)
        self.slab: Slab | None = None  # layer 0 of a cache in a lent slab: the slab
        self.slab_graphs: ForwardGraphs | None = None  # ... and the graphs that lent it
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
    """Empty K and V buffers `[layers, batch, kv_heads, capacity, head_dim]` for one request:
    in a slab of the replayed forwards where they are on (`rag_kvcache.model.graphs`; CUDA),
    else on the CPU in buffers an earlier request released (`release_buffers`)."""
    graphs = graphs_of(lm.model, lm.device) if batch == 1 else None
    if graphs is not None:
        slab = graphs.lend((lm.num_layers, 1, lm.num_kv_heads, lm.head_dim), lm.dtype, capacity)
        if slab is not None:
            return slab.keys[:, :, :, :capacity], slab.values[:, :, :, :capacity]
    shape = (lm.num_layers, batch, lm.num_kv_heads, capacity, lm.head_dim)
    return (
        POOL.take(shape, lm.dtype, lm.device),
        POOL.take(shape, lm.dtype, lm.device),
    )


def release_buffers(cache: Cache) -> None:
    """Hand a buffered cache's K and V buffers (`new_buffers`) back for the next request to
    reuse: call it only when nothing will read or write this cache again."""
    layer = cache.layers[0] if cache.layers else None
    if isinstance(layer, BufferedLayer) and not layer.released:  # once: a second release
        layer.released = True  # would hand back a buffer another request may hold by then
        if layer.slab is not None and layer.slab_graphs is not None:  # the lender, even if
            layer.slab_graphs.give_back(layer.slab)  # replay was turned off since
            return
        POOL.release(layer.key_buffer, layer.value_buffer)


@contextmanager
def released_on_error(cache: Cache) -> Iterator[None]:
    """Hand the cache's buffers back (`release_buffers`) if the block raises: a request that
    fails halfway must not keep a lent slab."""
    try:
        yield
    except BaseException:
        release_buffers(cache)
        raise


def buffered_cache(lm: LoadedModel, keys: torch.Tensor, values: torch.Tensor, length: int) -> Cache:
    """An HF cache whose layer i appends into keys[i], values[i] (filled up to `length`)."""
    cache = DynamicCache(config=lm.model.config)
    layers = [BufferedLayer(k, v, length) for k, v in zip(keys, values, strict=True)]
    cache.layers = list(layers)
    graphs = graphs_of(lm.model, lm.device)
    slab = graphs.slab_at(keys) if graphs is not None else None
    if slab is not None:  # lent by new_buffers: replayable, and given back on release
        layers[0].slab, layers[0].slab_graphs = slab, graphs
    return cache


def before_layer_update(cache: Cache, calls: Sequence[Callable[[], None]]) -> None:
    """Run calls[i] when the next forward reaches layer i's cache (before its attention):
    lets the linker fill each layer's context KV just in time, overlapping the rest."""
    for layer, call in zip(cache.layers, calls, strict=True):
        assert isinstance(layer, BufferedLayer)
        layer.before_update = call


def set_key_bias(cache: Cache, bias: torch.Tensor | None) -> None:
    """Add bias[j] (additive, [capacity]) to every query's score on key j in every later
    forward over this buffered cache, decoding included (APE's scale on the context)."""
    for layer in cache.layers:
        assert isinstance(layer, BufferedLayer)
        layer.key_bias = bias


def key_bias(cache: Cache) -> torch.Tensor | None:
    """The bias `set_key_bias` gave this buffered cache ([capacity]), or None."""
    return getattr(cache.layers[0], "key_bias", None) if cache.layers else None


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


def embedding_width(lm: LoadedModel) -> int:
    """Width of the model's input embeddings (what a soft token must have)."""
    return int(lm.model.get_input_embeddings().weight.shape[1])


def embed(lm: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's input embeddings of `input_ids` [B, T] -> [B, T, width] (no gradient)."""
    with torch.no_grad():
        return lm.model.get_input_embeddings()(input_ids)


def forward(
    lm: LoadedModel,
    input_ids: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    cache: Cache | None = None,
    mask: torch.Tensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    attention_hook: Any = None,
    embeds: torch.Tensor | None = None,
    grad: bool = False,
) -> tuple[torch.Tensor, Cache]:
    """One forward pass. input_ids, positions: [B, T]. mask: 2D padding mask [B, T] or a 4D
    additive mask [B, 1, T, past + T] (used as-is). Returns (logits [B, T or keep, V], cache).
    logits_to_keep: the last N rows' logits (0: all), or a tensor of the rows to keep.

    attention_hook(layer, query [B, heads, T, head_dim], scale) -> [B, T, heads, head_dim]
    replaces every layer's attention (the query is already RoPE'd).
    embeds [B, T, width]: the input embeddings to use instead of input_ids' (soft tokens).
    grad: build the autograd graph (training a calibration; the model's weights stay frozen
    as the caller set them); otherwise nothing is recorded.

    A short forward (one request, last row's logits) over a cache in a lent slab is replayed
    as a captured graph where the model's replayed forwards are on (`replayed_forward`).
    """
    plain = attention_hook is None and embeds is None and not grad
    if plain and cache is not None and isinstance(logits_to_keep, int) and logits_to_keep == 1:
        logits = replayed_forward(lm, input_ids, positions, cache, mask)
        if logits is not None:
            return logits, cache
    extra: dict[str, Any] = {}
    layers = list(cache.layers) if cache is not None else []
    bias = getattr(layers[0], "key_bias", None) if layers else None
    if bias is not None:
        if attention_hook is not None:
            raise UnsupportedModelError("a key bias cannot reach attention handed to a hook")
        extra["key_bias"] = bias
        if mask is not None and mask.dim() == 4:  # added once here, not in every layer
            mask = with_key_bias(mask, bias, mask.shape[2], mask.shape[3])
            extra["mask_has_key_bias"] = True
    if attention_hook is not None:
        extra["kv_attention_hook"] = attention_hook
    elif mask is not None and mask.device.type == "cpu":
        extra["query_blocks"] = query_blocks(mask)
    keep: int | torch.Tensor = logits_to_keep
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        # as positions, not HF's slice: the slice of the last rows is a strided view, and for
        # it bfloat16 matmul on CPU copies the whole transposed vocab matrix (~65 ms for
        # SmolLM2's, per call); the gathered rows are compact
        length = input_ids.shape[1]
        keep = torch.arange(max(length - logits_to_keep, 0), length, device=input_ids.device)
    inputs: dict[str, Any] = (
        {"input_ids": input_ids} if embeds is None else {"inputs_embeds": embeds}
    )
    # not inference_mode: the linker edits the returned KV in place
    with torch.set_grad_enabled(grad):
        cache_arg = cache_argument(type(lm.model).forward)
        inputs[cache_arg] = cache if cache is not None else DynamicCache(config=lm.model.config)
        out = lm.model(
            **inputs,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **extra,
        )
    return out.logits, getattr(out, cache_arg)


@functools.cache
def cache_argument(forward: Callable[..., Any]) -> str:
    """The name a model's `forward` takes its KV cache by, and returns it under: `cache`
    since transformers 5.24, `past_key_values` before (deprecated there, gone in 5.40)."""
    names = inspect.signature(forward).parameters
    return "cache" if "cache" in names else "past_key_values"


class SlotLayer(DynamicLayer):
    """A cache layer for the replayed forward: writes the new K/V at `slots` (a tensor, so a
    captured graph writes wherever the next replay says) and hands attention the whole slab,
    which the mask limits to what each row may see."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
        super().__init__()
        self.slab_keys, self.slab_values, self.slots = keys, values, slots
        self.keys, self.values = keys, values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.slab_keys.index_copy_(2, self.slots, key_states)
        self.slab_values.index_copy_(2, self.slots, value_states)
        return self.slab_keys, self.slab_values


def replayed_forward(
    lm: LoadedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor | None,
    cache: Cache,
    mask: torch.Tensor | None,
) -> torch.Tensor | None:
    """`forward`'s result (the last row's logits [1, 1, vocab]) from the replayed forward of
    `rag_kvcache.model.graphs`, or None where it does not apply: the model's replayed forwards
    are off, the cache is not in a lent slab (or grew out of it), a layer waits for its KV
    (`before_layer_update`), or there are more new tokens than the largest rows bucket.

    The replay computes what the eager forward does: each row writes its K/V where the cache
    would (`write_at`, else appended) and attends under the same mask (the causal one when
    none is given), the cache's key bias added; the cache's length is then set as `update`
    would have."""
    first = cache.layers[0] if cache.layers else None
    if not isinstance(first, BufferedLayer) or first.slab is None or input_ids.shape[0] != 1:
        return None
    if first.released or _captured_queries is not None or counting_arithmetic():
        return None  # queries, or the arithmetic, are read in Python in the eager forward
    if first.write_at is not None and (positions is None or mask is None):
        return None  # not a link's forward: left to the eager path's own positions and mask
    graphs = graphs_of(lm.model, lm.device)
    slab, T = first.slab, input_ids.shape[1]
    bucket = rows_bucket(T)
    layers: list[Any] = list(cache.layers)
    if graphs is None or bucket is None or graphs.slab_at(first.key_buffer) is not slab:
        return None
    if any(layer.before_update is not None for layer in layers):
        return None
    length = first.length
    if first.write_at is None:
        slots, end = torch.arange(length, length + T, device=lm.device), length + T
    else:
        slots, end = first.write_at, max(length, first.write_end)
    if end > first.key_buffer.shape[-2] or (mask is not None and mask.shape[-2:] != (T, end)):
        return None
    if mask is None:  # appended tokens: causal
        mask = (torch.arange(end, device=lm.device) <= slots[:, None])[None, None]
    if mask.dtype == torch.bool:
        mask = additive_mask(mask, lm.dtype)
    if first.key_bias is not None:
        mask = with_key_bias(mask, first.key_bias, T, end)

    def fill(replay: Replay) -> None:
        replay.ids[:, :T] = input_ids
        replay.ids[:, T:] = 0
        if positions is None:
            replay.positions[0, :T] = slots
        else:
            replay.positions[:, :T] = positions
        replay.positions[:, T:] = 0
        replay.slots[:T] = slots
        replay.slots[T:] = slab.trash
        replay.mask.fill_(torch.finfo(lm.dtype).min)
        replay.mask[:, :, :T, :end] = mask
        replay.mask[:, :, T:, 0] = 0
        replay.keep.fill_(T - 1)

    def run(replay: Replay) -> torch.Tensor:
        slotted = DynamicCache(config=lm.model.config)
        slotted.layers = [
            SlotLayer(k, v, replay.slots) for k, v in zip(slab.keys, slab.values, strict=True)
        ]
        logits, _ = forward(
            lm,
            replay.ids,
            positions=replay.positions,
            cache=slotted,
            mask=replay.mask,
            logits_to_keep=replay.keep,
        )
        return logits

    logits = graphs.replay(slab, bucket, fill, run)
    if logits is None:
        return None
    for layer in layers:
        layer.set_length(end)
    return logits


@dataclass(frozen=True)
class LayerRows:
    """The token rows one decoder layer computes in `forward_by_layer`, and what they see."""

    keep: torch.Tensor | None  # [T'] indices of the rows the layer before computed; None: all
    mask: torch.Tensor  # additive [1, 1, T', K]: the keys each kept row attends to


def forward_by_layer(
    lm: LoadedModel,
    input_ids: torch.Tensor,
    *,
    positions: torch.Tensor,
    cache: Cache,
    mask: torch.Tensor,
    rows: Callable[[int], LayerRows | None],
) -> torch.Tensor:
    """A forward whose decoder layers may each compute fewer token rows than the layer before,
    each with its own mask (CacheBlend's gradual filtering). Returns the last row's logits
    [vocab]; the last row must go on through every layer.

    input_ids, positions: [1, T]; mask: additive [1, 1, T, K]. Before decoder layer i runs,
    `rows(i)` may narrow the rows (indices into those layer i - 1 computed) and give their
    mask; None keeps both. A dropped row is simply not computed any further: its K/V from the
    layers it went through stay where the cache wrote them (`write_at`, set by the caller).

    The model's own forward runs, with a pre-hook on each decoder layer indexing its hidden
    states, positions and position embeddings by the rows kept (plain tensor indexing), so
    embedding, final norm and head stay the model's; a pre-hook on the head gives it the
    last row only. The hooks act in the calling thread only: a forward another thread runs
    on the same model meanwhile (the demo app's sessions) passes through them untouched.
    """
    if key_bias(cache) is not None:  # the layers' own masks would go without it
        raise UnsupportedModelError("a forward narrowed by layer takes no key bias")
    state: dict[str, Any] = {"index": None, "mask": mask, "narrowed": {}}
    caller = threading.get_ident()

    def narrow(layer: int, _module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        if threading.get_ident() != caller:
            return None
        step = rows(layer)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if step is not None:
            if step.keep is not None:
                hidden = hidden[:, step.keep]
                index = state["index"]
                state["index"] = step.keep if index is None else index[step.keep]
                state["narrowed"] = {}
            state["mask"] = step.mask
            if step.mask.device.type == "cpu":
                state["narrowed"]["query_blocks"] = query_blocks(step.mask)
        if state["index"] is not None and "position_ids" not in state["narrowed"]:
            state["narrowed"].update(_rows_of(kwargs, state["index"]))
        kwargs.update(state["narrowed"], attention_mask=state["mask"])
        return (hidden, *args[1:]), kwargs

    def last_row(_module: Any, args: tuple) -> tuple | None:
        if threading.get_ident() != caller:
            return None
        return (args[0][:, -1:].contiguous(), *args[1:])

    layers = list(lm.model.model.layers)
    handles = [
        layer.register_forward_pre_hook(partial(narrow, i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    handles.append(lm.model.get_output_embeddings().register_forward_pre_hook(last_row))
    try:
        logits, _ = forward(lm, input_ids, positions=positions, cache=cache, mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return logits[0, -1]


def _rows_of(kwargs: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """The per-row inputs a decoder layer is given (positions [1, T], position embeddings
    ([1, T, d], ...)), narrowed to rows `index`: the model hands every layer the full ones."""
    narrowed: dict[str, Any] = {"position_ids": kwargs["position_ids"][:, index]}
    if kwargs.get("position_embeddings") is not None:
        narrowed["position_embeddings"] = tuple(t[:, index] for t in kwargs["position_embeddings"])
    return narrowed
