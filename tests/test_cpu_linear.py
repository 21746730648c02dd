"""Float32 CPU linear layers through oneDNN (`model.cpu_linear`): equal to `F.linear`, their
reference, to float32 rounding; taken where they serve and only there; and the models the
library loads use them."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import build_tiny, needs_onednn, onednn_calls, tiny_config
from torch import nn
from transformers import LlamaForCausalLM

from rag_kvcache.errors import ConfigError
from rag_kvcache.model import cpu_attention, cpu_kernels, cpu_linear
from rag_kvcache.model.cpu_linear import (
    AVAILABLE,
    OneDNNLinear,
    linear,
    onednn_serves,
    use_onednn_linears,
)

# oneDNN's path whatever this CPU's maker (the library takes it on AMD processors only)
pytestmark = pytest.mark.usefixtures("onednn_chosen")


@needs_onednn
@pytest.mark.parametrize(
    ("rows", "inner", "outer", "bias"),
    [(1, 576, 1536, False), (64, 576, 1536, True), (300, 64, 128, False), (7, 33, 5, True)],
)
def test_linear_equals_f_linear(rows: int, inner: int, outer: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, inner, generator=g)
    w = torch.randn(outer, inner, generator=g) / inner**0.5
    b = torch.randn(outer, generator=g) if bias else None
    assert onednn_serves(x, w, b)
    out = linear(x, w, b)
    assert out.shape == (2, rows, outer)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert onednn_calls(lambda: linear(x, w, b)) == 1


@needs_onednn
def test_linear_of_strided_views_equals_f_linear() -> None:
    """The last row of hidden states (what `logits_to_keep=1` hands the LM head) is a view;
    a bias may be one too (the op reads a bias as contiguous: it is made so)."""
    x = torch.randn(1, 9, 48)[:, -1:, :]
    xt = torch.randn(48, 1, 10).transpose(0, 2)  # [10, 1, 48], not contiguous
    w = torch.randn(20, 48)
    wt = torch.randn(48, 20).t()  # a transposed weight
    every_other = torch.randn(40)[::2]
    broadcast = torch.randn(1).expand(20)
    cases = [(x, w, None), (xt, w, None), (x, wt, None), (x, w, every_other), (xt, w, broadcast)]
    for inputs, weight, bias in cases:
        assert onednn_serves(inputs, weight, bias)
        got = linear(inputs, weight, bias)
        torch.testing.assert_close(got, F.linear(inputs, weight, bias), rtol=1e-5, atol=1e-5)
        assert onednn_calls(lambda i=inputs, w=weight, b=bias: linear(i, w, b)) == 1


def test_a_changed_or_missing_private_op_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op is private: a torch that removed it, changed its arguments or its meaning
    makes `AVAILABLE` false (F.linear everywhere), not every forward fail."""
    assert cpu_linear._works() == torch.backends.mkldnn.is_available()

    def changed(x, w, b, attr, scalars, algorithm, extra):  # type: ignore[no-untyped-def]
        return F.linear(x, w, b)  # takes one argument more: a call as ours raises TypeError

    def other_meaning(x, w, b, *args):  # type: ignore[no-untyped-def]
        return F.linear(x, w)  # drops the bias

    for fake in (changed, other_meaning):
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fake)
        assert not cpu_linear._works()
    monkeypatch.undo()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not cpu_linear._works()
    monkeypatch.undo()
    assert cpu_linear._works() == torch.backends.mkldnn.is_available()


def test_linear_falls_back_where_onednn_cannot_serve() -> None:
    w = torch.randn(8, 4)
    cases = {
        "bfloat16": (torch.randn(3, 4, dtype=torch.bfloat16), w.bfloat16()),
        "float64": (torch.randn(3, 4, dtype=torch.float64), w.double()),
        "one dimension": (torch.randn(4), w),
        "no rows": (torch.randn(0, 4), w),
    }
    for name, (x, weight) in cases.items():
        assert not onednn_serves(x, weight, None), name
        assert onednn_calls(lambda x=x, weight=weight: linear(x, weight)) == 0, name
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), msg=name)


def test_autocast_and_onednn_switched_off_are_obeyed() -> None:
    """CPU autocast computes F.linear in bfloat16 (the op would ignore it); switching oneDNN
    off (`torch.backends.mkldnn.enabled`) leaves the linear to torch's default."""
    x, w = torch.randn(6, 16), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not onednn_serves(x, w, None)
        assert linear(x, w).dtype == F.linear(x, w).dtype == torch.bfloat16
    torch.backends.mkldnn.enabled = False
    try:
        assert not onednn_serves(x, w, None)
        assert onednn_calls(lambda: linear(x, w)) == 0
    finally:
        torch.backends.mkldnn.enabled = True
    assert onednn_serves(x, w, None) == AVAILABLE


def test_shapes_that_do_not_fit_raise_f_linears_error() -> None:
    x, w = torch.randn(3, 5), torch.randn(4, 6)
    for bias in (None, torch.randn(3)):
        with pytest.raises(RuntimeError, match="shape|size"):
            linear(x, w if bias is None else torch.randn(4, 5), bias)


def test_another_device_is_left_to_torch() -> None:
    """Off the CPU (here the meta device stands in for a GPU) nothing is swapped, and a
    swapped layer whose model moved there computes by F.linear."""
    layer = nn.Linear(4, 5).to("meta")
    assert use_onednn_linears(nn.Sequential(layer)) == 0 and type(layer) is nn.Linear
    x, w = torch.randn(3, 4, device="meta"), torch.randn(5, 4, device="meta")
    assert not onednn_serves(x, w, None)
    out = linear(x, w)
    assert out.device.type == "meta" and out.shape == (3, 5)
    if AVAILABLE:
        moved = nn.Sequential(nn.Linear(4, 5))
        assert use_onednn_linears(moved) == 1
        moved.to("meta")
        assert type(moved[0]) is OneDNNLinear and moved(x).device.type == "meta"


def test_gradients_flow_through_the_fallback() -> None:
    """Calibration trains through the model's linears: where a gradient is wanted, autograd's
    F.linear computes it (oneDNN's op has none)."""
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(3, 4)
    assert not onednn_serves(x, w, None)
    linear(x, w).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, w.sum(dim=0).expand(5, 4))
    with torch.no_grad():
        assert onednn_serves(x, w, None) == AVAILABLE


@needs_onednn
def test_only_plain_linears_are_swapped() -> None:
    class Quantized(nn.Linear):  # stands in for bitsandbytes' and adapters' subclasses
        pass

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), Quantized(6, 2), nn.Linear(2, 3))
    assert use_onednn_linears(model) == 2
    assert [type(m) for m in model] == [OneDNNLinear, nn.ReLU, Quantized, OneDNNLinear]
    assert use_onednn_linears(model) == 0  # already swapped


@needs_onednn
def test_a_swapped_model_computes_what_the_plain_one_does() -> None:
    torch.manual_seed(0)
    plain = LlamaForCausalLM._from_config(tiny_config(), attn_implementation="sdpa").eval()
    swapped = copy.deepcopy(plain)
    assert use_onednn_linears(swapped) == 3 * 7 + 1  # q k v o, gate up down; the LM head
    assert swapped.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(3, 1000, (1, 40))
    with torch.no_grad():
        expected = plain(ids).logits
        got = swapped(ids).logits
        assert onednn_calls(lambda: swapped(ids)) == 3 * 7 + 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@needs_onednn
def test_loaded_models_use_onednn_in_float32_only() -> None:
    tiny32 = build_tiny(torch.float32)
    linears = [m for m in tiny32.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    ids = torch.randint(3, 1000, (1, 12))
    with torch.no_grad():
        assert onednn_calls(lambda: tiny32.model(ids)) == len(linears)
    tiny_bf16 = build_tiny(torch.bfloat16)  # bfloat16: torch's own linear (oneDNN already)
    with torch.no_grad():
        assert onednn_calls(lambda: tiny_bf16.model(ids)) == 0


@needs_onednn
def test_the_retrieval_encoder_uses_onednn_and_embeds_as_before() -> None:
    """The MiniLM encoder's linears compute by oneDNN too; its embeddings are those of the
    plain model, to float32 rounding."""
    from rag_kvcache.retrieval.embedding import Embedder

    embedder = Embedder()
    linears = [m for m in embedder.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDNNLinear for m in linears)
    texts = ["The harbor of Velmora has a lighthouse.", "Rowing crews train at dawn. " * 30]
    fast = embedder.embed(texts)
    for m in linears:
        m.__class__ = nn.Linear
    try:
        plain = embedder.embed(texts)
    finally:
        use_onednn_linears(embedder.model)
    torch.testing.assert_close(torch.from_numpy(fast), torch.from_numpy(plain), atol=1e-5, rtol=0)


def test_onednn_is_chosen_on_amd_processors_unless_set_by_hand() -> None:
    """Measured faster than torch's own kernels on AMD processors, slower on Intel's: `auto`
    takes it on AMD only; the environment variable chooses by hand, in any case."""
    amd, intel = "AuthenticAMD", "GenuineIntel"
    for setting in (None, "", "  ", "auto", " Auto "):
        assert cpu_kernels.chooses_onednn(setting, amd)
        assert not cpu_kernels.chooses_onednn(setting, intel)
        assert not cpu_kernels.chooses_onednn(setting, "")  # another architecture: unmeasured
    for vendor in (amd, intel, ""):
        assert cpu_kernels.chooses_onednn("onednn", vendor)
        assert cpu_kernels.chooses_onednn("ONEDNN", vendor)
        assert not cpu_kernels.chooses_onednn("torch", vendor)
    with pytest.raises(ConfigError, match="RAG_KVCACHE_CPU_KERNELS='mkl'.*auto, onednn, torch"):
        cpu_kernels.chooses_onednn("mkl", amd)


def test_the_cpu_vendor_is_the_one_the_cpu_names(monkeypatch: pytest.MonkeyPatch) -> None:
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.is_file() else ""
    named = [line for line in text.splitlines() if line.startswith("vendor_id")]
    if named:
        vendor = named[0].split(":", 1)[1].strip()
        expected = vendor if vendor in ("AuthenticAMD", "GenuineIntel") else ""
        assert cpu_kernels.cpu_vendor() == expected
    # without /proc/cpuinfo (Windows, macOS): the processor string, which Windows names it in

    def unreadable(self: Path, *args: object, **kwargs: object) -> str:
        raise FileNotFoundError(str(self))

    monkeypatch.setattr(Path, "read_text", unreadable)
    windows = "AMD64 Family 25 Model 33 Stepping 0, AuthenticAMD"
    for processor, vendor in ((windows, "AuthenticAMD"), ("arm", ""), ("i386", "")):
        monkeypatch.setattr(cpu_kernels.platform, "processor", lambda p=processor: p)
        assert cpu_kernels.cpu_vendor() == vendor


def test_where_onednn_is_not_chosen_torch_computes_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU that does not choose oneDNN a loaded model keeps plain linears, and neither
    they nor attention (served from one score up here) call the op; the answers are torch's."""
    ids = torch.randint(3, 1000, (1, 40))
    chosen = build_tiny(torch.float32)
    monkeypatch.setattr(cpu_kernels, "CHOSEN", False)
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 1)
    plain = build_tiny(torch.float32)
    assert all(type(m) is nn.Linear for m in plain.model.modules() if isinstance(m, nn.Linear))
    assert use_onednn_linears(plain.model) == 0
    with torch.no_grad():
        assert onednn_calls(lambda: plain.model(ids)) == 0
        assert onednn_calls(lambda: chosen.model(ids)) == 0  # swapped, yet not chosen: torch's
        torch.testing.assert_close(chosen.model(ids).logits, plain.model(ids).logits)


@pytest.mark.parametrize(("setting", "chosen"), [("torch", "False"), ("onednn", "True")])
def test_the_environment_variable_is_read_when_the_library_loads(setting: str, chosen: str) -> None:
    code = "from rag_kvcache.model import cpu_kernels as c; print(c.CHOSEN)"
    env = {**os.environ, cpu_kernels.KERNELS_ENV: setting}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [chosen]


def test_a_bad_setting_is_refused_when_a_model_loads_with_its_name(tmp_path: Path) -> None:
    """Not when the library is imported (a traceback from `import`), but as the CLI's one-line
    error when a model would load, before anything does."""
    env = {**os.environ, cpu_kernels.KERNELS_ENV: "fastest"}
    code = "from rag_kvcache import RagKVCache; from rag_kvcache.model import cpu_kernels as c; "
    code += "print(c.CHOSEN)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr
    cli = [sys.executable, "-m", "rag_kvcache.tools.cli", "bench", "ttft", "--dtypes", "float32"]
    cli += ["--contexts", "256", "--strategies", "naive", "--out", str(tmp_path)]
    out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    said = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in said, said
    assert "RAG_KVCACHE_CPU_KERNELS='fastest': expected one of auto, onednn, torch" in said
    assert not list(tmp_path.glob("*.json"))
