import math

import pytest

from rag_kvcache.config import (
    EncodeConfig,
    EngineConfig,
    GenerationConfig,
    ModelConfig,
    StoreConfig,
)
from rag_kvcache.errors import ConfigError, StrategyError


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ModelConfig(dtype="float8"), "dtype 'float8' is not one of"),
        (lambda: ModelConfig(quantization="3bit"), "quantization '3bit'"),
        (lambda: ModelConfig(threads=0), "threads must be a whole number >= 1"),
        (lambda: EncodeConfig(batch_size=0), "batch_size must be a whole number >= 1"),
        (lambda: EncodeConfig(sink_tokens=-1), "sink_tokens must be a whole number >= 0"),
        (lambda: GenerationConfig(max_new_tokens=0), "max_new_tokens must be a whole number >= 1"),
        (
            lambda: GenerationConfig(max_new_tokens=2.5),
            "max_new_tokens must be a whole number >= 1, got 2.5",
        ),  # type: ignore[arg-type]
        (
            lambda: GenerationConfig(max_new_tokens=True),
            "max_new_tokens must be a whole number >= 1, got True",
        ),
        (lambda: GenerationConfig(temperature=-1), "temperature must be >= 0"),
        (lambda: GenerationConfig(top_p=0), "top_p must be a number in"),
        (lambda: GenerationConfig(seed=2**64), "seed must be a 64-bit integer"),
        (lambda: GenerationConfig(seed=-(2**63) - 1), "seed must be a 64-bit integer"),
        # these reached torch, which failed at answer time
        (lambda: GenerationConfig(temperature=math.nan), "temperature must be >= 0 and finite"),
        (lambda: GenerationConfig(temperature=math.inf), "temperature must be >= 0 and finite"),
        (lambda: GenerationConfig(temperature=10**400), "temperature must be >= 0 and finite"),
        (lambda: GenerationConfig(temperature="0.5"), "temperature must be >= 0 and finite"),  # type: ignore[arg-type]
        (lambda: GenerationConfig(temperature=True), "temperature must be >= 0 and finite"),
        (lambda: GenerationConfig(seed=1.5), "seed must be a 64-bit integer or None, got 1.5"),  # type: ignore[arg-type]
        (lambda: GenerationConfig(seed=True), "seed must be a 64-bit integer or None, got True"),
        (lambda: GenerationConfig(strip="no"), "strip must be True or False, got 'no'"),  # type: ignore[arg-type]
        # a path and whole byte counts: 5 was taken for a folder, 1.5 bytes for a budget, and
        # "1G" failed with a TypeError
        (lambda: StoreConfig(root=5), "root must be a folder's path, got int"),  # type: ignore[arg-type]
        (lambda: StoreConfig(cpu_bytes=1.5), "cpu_bytes must be >= 0, a whole number"),  # type: ignore[arg-type]
        (lambda: StoreConfig(cpu_bytes="1G"), "cpu_bytes must be >= 0, a whole number"),  # type: ignore[arg-type]
        (lambda: StoreConfig(gpu_bytes=-1), "gpu_bytes must be >= 0"),
        (lambda: EngineConfig(kv_cache_bytes=True), "kv_cache_bytes must be >= 1"),
        (lambda: EngineConfig(kv_cache_bytes=0), "kv_cache_bytes must be >= 1"),  # room for none
        # accepted, then failed later (inside torch, jinja or an attribute lookup) or never
        (lambda: EncodeConfig(batch_size=1.5), "batch_size must be a whole number >= 1, got 1.5"),  # type: ignore[arg-type]
        (lambda: EncodeConfig(batch_size=None), "batch_size must be a whole number"),  # type: ignore[arg-type]
        (lambda: EncodeConfig(sink_tokens=2.5), "sink_tokens must be a whole number >= 0"),  # type: ignore[arg-type]
        (lambda: EncodeConfig(sink_tokens=True), "sink_tokens must be a whole number >= 0"),
        (lambda: EncodeConfig(sink_tokens=65), "sink_tokens must be in 0..64"),
        (lambda: ModelConfig(threads=1.5), "threads must be a whole number >= 1, got 1.5"),  # type: ignore[arg-type]
        (lambda: ModelConfig(threads="2"), "threads must be a whole number >= 1, got '2'"),  # type: ignore[arg-type]
        (lambda: ModelConfig(path=""), "path must be a path \\(or None\\), got ''"),
        (lambda: ModelConfig(path=b"x"), "path must be a path \\(or None\\), got b'x'"),  # type: ignore[arg-type]
        (lambda: ModelConfig(lora=""), "lora must be a path"),
        (lambda: GenerationConfig(top_p="0.5"), "top_p must be a number in \\(0, 1\\], got '0.5'"),  # type: ignore[arg-type]
        (lambda: GenerationConfig(top_p=None), "top_p must be a number in"),  # type: ignore[arg-type]
        (lambda: GenerationConfig(top_p=math.nan), "top_p must be a number in"),
        (lambda: StoreConfig(root=""), 'root "" names no folder'),
        (lambda: EngineConfig(system_prompt=None), "system_prompt must be text, got None"),  # type: ignore[arg-type]
        (lambda: EngineConfig(model=None), "model must be a ModelConfig\\(...\\), got None"),  # type: ignore[arg-type]
        (lambda: EngineConfig(store="kv"), "store must be a StoreConfig\\(...\\), got 'kv'"),  # type: ignore[arg-type]
        (lambda: EngineConfig(encode={}), "encode must be a EncodeConfig"),  # type: ignore[arg-type]
        (lambda: EngineConfig(link_budget_s=math.nan), "link_budget_s must be a number of seconds"),
        (lambda: EngineConfig(link_budget_s=math.inf), "link_budget_s must be a number of seconds"),
        (lambda: EngineConfig(link_budget_s="1"), "link_budget_s must be a number of seconds"),  # type: ignore[arg-type]
        (lambda: EngineConfig(link_budget_s=-1), "link_budget_s must be a number of seconds"),
    ],
)
def test_bad_values_are_named(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_numpy_seed_is_a_python_integer() -> None:
    import numpy as np

    seed = GenerationConfig(seed=np.int64(7)).seed  # type: ignore[arg-type]
    assert seed == 7 and type(seed) is int


def test_bad_default_strategy_is_refused() -> None:
    with pytest.raises(StrategyError, match="unknown link strategy 'fast'"):
        EngineConfig(strategy="fast")


def test_the_extreme_seeds_a_generator_takes_are_accepted() -> None:
    for seed in (2**64 - 1, -(2**63)):
        assert GenerationConfig(seed=seed).seed == seed


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:-1", "gpu", "", "cpu:"])
def test_a_device_that_is_not_cpu_or_cuda_is_refused_when_built(device: str) -> None:
    with pytest.raises(ConfigError, match="is not one of cpu, cuda, cuda:N"):
        ModelConfig(device=device)
    assert ModelConfig(device="cuda:1").device == "cuda:1"  # whether it is there: at load


def test_a_cuda_device_this_torch_cannot_reach_is_one_clear_error(tmp_path) -> None:
    """On a torch without CUDA (or a GPU index past the machine's), `--device cuda` ended in
    torch's AssertionError deep in the first tensor moved there, after the engine had made
    its store; now it is a ConfigError, before anything is made."""
    import torch

    from rag_kvcache import RagKVCache
    from rag_kvcache.config import StoreConfig
    from rag_kvcache.model.loading import check_device

    assert check_device("cpu") == torch.device("cpu")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    said = "built without CUDA|finds no CUDA GPU|there are"
    with pytest.raises(ConfigError, match=said):
        check_device(missing)
    config = EngineConfig(
        model=ModelConfig(path="random:tiny", device=missing),
        store=StoreConfig(root=tmp_path / "store"),
    )
    with pytest.raises(ConfigError, match=said):
        RagKVCache(config)
    assert not (tmp_path / "store").exists()


def test_a_system_prompt_past_the_window_is_named(tiny32, tmp_path) -> None:
    from rag_kvcache import ContextTooLongError, RagKVCache
    from rag_kvcache.config import StoreConfig

    config = EngineConfig(system_prompt="harbor " * 600, store=StoreConfig(root=tmp_path))
    with pytest.raises(ContextTooLongError, match="the system prompt is .* give a shorter"):
        RagKVCache(config, lm=tiny32)
