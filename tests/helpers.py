"""Test helpers: a tiny random-weight Llama built here (no download), random chunks."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.profiler import profile
from transformers import LlamaConfig, LlamaForCausalLM

from rag_kvcache.link.linker import LinkedContext, linked_layers
from rag_kvcache.model.cpu_linear import AVAILABLE as ONEDNN_AVAILABLE
from rag_kvcache.model.loading import LoadedModel, describe
from rag_kvcache.serving.batch_kv import BatchKV
from rag_kvcache.serving.prefix_tree import TreeNode

# five short documents of invented facts: the serving tests' corpus
SERVING_DOCS = [
    "The Hallam Point lighthouse was designed by Mara Quell.",
    "It was first lit in 1788 and burned whale oil until 1861.",
    "Velmora's harbor has three basins; the deepest is 14 meters deep.",
    "The kite festival is held every April on Brindle Hill.",
    "The rowing league has six crews; the oldest was founded in 1901.",
]

TINY_VOCAB = 49152  # SmolLM2's vocabulary, so the tiny model can share its tokenizer


needs_onednn = pytest.mark.skipif(not ONEDNN_AVAILABLE, reason="this torch is built without oneDNN")
ONEDNN_OP = "mkldnn::_linear_pointwise"


def onednn_calls(fn) -> int:  # type: ignore[no-untyped-def]
    """How many times `fn()` calls the oneDNN op (`model.cpu_linear`), counted by torch's
    profiler."""
    with profile() as p:
        fn()
    return sum(e.count for e in p.key_averages() if e.key == ONEDNN_OP)


def tiny_config(**overrides: object) -> LlamaConfig:
    settings: dict = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.3,  # peaky attention, so a wrong mask shows in the logits
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def build_tiny(dtype: torch.dtype, seed: int = 0, tokenizer: object = None) -> LoadedModel:
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(tiny_config(), attn_implementation="sdpa")
    model = model.to(dtype).eval().requires_grad_(False)
    return describe(model, tokenizer, name=f"tiny-llama-{seed}")


def random_chunks(lengths: list[int], seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def linked_span(linked: LinkedContext, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions start..end-1 of a linked context, stacked:
    [layers, kv_heads, end - start, head_dim]."""
    keys, values = linked_layers(linked, start, end)
    return torch.stack(keys), torch.stack(values)


def moved_nodes(batch: BatchKV) -> set[TreeNode]:
    """Tree nodes whose KV has moved into a batch's rows (not those copied into them)."""
    return {node for layout in batch.layouts for node in layout.moved}


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of one buffer (what the tests check the records by)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# questions over three short documents: what calibration runs train on in the tests
CALIBRATION_ITEMS = [
    {
        "question": f"Who founded {town}?",
        "documents": [
            {"text": f"{town} was founded by {founder} in {year}. It sits on a river."},
            {"text": f"{other} was founded by Mara Quill in 1650. Its mayor is Ivo Stark."},
            {"text": f"The festival of {town} is held in spring. {founder} built a bridge."},
        ],
    }
    for town, founder, year, other in [
        ("Ashford", "Tomas Vell", 1712, "Brindle"),
        ("Corvale", "Anna Pike", 1801, "Dunmore"),
        ("Elmstead", "Rudi Kahn", 1599, "Fenwick"),
    ]
]


@functools.cache
def app_module() -> ModuleType:
    """The Streamlit demo's script as a module (its UI runs only as __main__), for its plain
    functions."""
    app = Path(__file__).resolve().parents[1] / "demos" / "streamlit_app.py"
    spec = importlib.util.spec_from_file_location("streamlit_app", app)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module
