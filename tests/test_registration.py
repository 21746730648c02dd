"""Importing rag_kvcache changes nothing in transformers; loading (or wrapping) a model
registers our attention function and its mask, which multi-token queries need."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
import rag_kvcache, rag_kvcache.engine, rag_kvcache.model.loading, rag_kvcache.answer
from rag_kvcache.model.adapter import ATTENTION
registered = lambda: (  # noqa: E731
    ATTENTION in AttentionInterface._global_mapping,
    ATTENTION in AttentionMaskInterface._global_mapping,
)
print(*registered())
import sys; sys.path.insert(0, "tests")
from helpers import build_tiny
import torch
lm = build_tiny(torch.float32)
print(*registered())
print(lm.model.config._attn_implementation == ATTENTION)
"""


def test_import_registers_nothing_and_loading_registers_both() -> None:
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "False", "True", "True", "True"]
