"""The Triton shared-phase kernel equals the reference, run by Triton's CPU interpreter (the
same kernel runs compiled on an NVIDIA GPU: tests/test_gpu.py checks it there)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is installed with the dev extra on Linux x86-64")

TOLERANCE = {"torch.float32": 1e-5, "torch.bfloat16": 2e-2}


def test_the_triton_kernel_equals_the_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, str(here / "triton_check.py")],
        env={**env, "PYTHONPATH": str(here)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 8  # every case ran
    for r in results:
        tol = TOLERANCE[r["dtype"]]
        assert r["out"] <= tol, r
        assert r["lse"] <= 1e-4, r  # the LSE is always float32
