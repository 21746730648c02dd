"""Which float32 kernels the CPU computes with: oneDNN's (`cpu_linear`, `cpu_attention`) or
torch's own (MKL's sgemm for linears, the fused `scaled_dot_product_attention`).

MKL takes a slow code path on AMD processors, where oneDNN made prefill 1.3-1.6x faster
(`demos/results/cpu/ttft-onednn/`); on Intel's it takes its fast path, and torch's own kernels
were the faster ones: on a 2-core Xeon with AVX-512 (SmolLM2-135M, 4K tokens, alternated in
one process) a prefill took 6.6 s with them against 7.7 s by oneDNN, `legolink:16` 0.62 s
against 0.72 s, and decoding ran at 19.2 tokens/s against 14.1
(`demos/results/cpu/ttft-kernels-intel/`). So oneDNN computes where the CPU is AMD's
(`CHOSEN`), torch's kernels, the reference, everywhere else; `RAG_KVCACHE_CPU_KERNELS=onednn`
or `torch` chooses by hand, to measure another CPU both ways.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from rag_kvcache.errors import ConfigError

KERNELS_ENV = "RAG_KVCACHE_CPU_KERNELS"  # auto (the default), onednn or torch
KERNEL_CHOICES = ("auto", "onednn", "torch")


def cpu_vendor() -> str:
    """The processor's maker as the CPU names itself ("AuthenticAMD", "GenuineIntel"), or ""
    where it says neither (other architectures, or nothing to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux: Windows names the vendor in the processor string
        text = platform.processor()
    return next((v for v in ("AuthenticAMD", "GenuineIntel") if v in text), "")


def chooses_onednn(setting: str | None, vendor: str) -> bool:
    """Should float32 linears and attention compute by oneDNN, given `KERNELS_ENV`'s value
    (None: unset) and `cpu_vendor()`: by hand when set, else on AMD processors only, the CPUs
    where it was measured faster than torch's own kernels (see the module's docstring)."""
    choice = (setting or "").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"{KERNELS_ENV}={setting!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    return choice == "onednn" or (choice == "auto" and vendor == "AuthenticAMD")


# read once, as the library loads: set the variable before importing it
SETTING = os.environ.get(KERNELS_ENV)


def check_setting() -> None:
    """Raise ConfigError if `KERNELS_ENV` held no known choice as the library loaded (loading
    a model asks: importing the library is no place to fail)."""
    chooses_onednn(SETTING, "")


def _chosen_here() -> bool:
    try:
        return chooses_onednn(SETTING, cpu_vendor())
    except ConfigError:  # refused when a model loads (`check_setting`)
        return False


# oneDNN computes float32 here (where torch has it and it serves: `cpu_linear.onednn_enabled`);
# a model keeps the linears it was loaded with (`cpu_linear.use_onednn_linears`)
CHOSEN = _chosen_here()
