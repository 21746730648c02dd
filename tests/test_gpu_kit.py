"""The GPU kit (demos/gpu/run.sh) dry-runs on the CPU: it installs this tree's wheel, runs the
benchmark stages from that install (not from the source tree) on a tiny random model, and
packs each stage's results into one archive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def kit(
    tmp_path: Path, *stages: str, timeout: int = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """demos/gpu/run.sh STAGES with results under tmp_path/out."""
    return subprocess.run(
        ["bash", "demos/gpu/run.sh", *stages],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path / "out"), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # random:tiny borrows SmolLM2's tokenizer
def test_the_kit_runs_every_bench_stage_from_the_installed_wheel(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stages = ["install", "bench8b", "store8b", "prefix8b"]
    dry = {"DEVICE": "cpu", "MODEL": "random:tiny", "SMALL": "1", "PYTHON": sys.executable}
    dry["REPEATS"] = "2"  # a size given wins over the dry run's (1)
    run = kit(tmp_path, *stages, timeout=900, **dry)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    installed = (out / "install" / "installed.txt").read_text()
    assert installed.startswith(str(out / "site")), installed  # the wheel, not ./rag_kvcache
    expected = {
        "bench8b": {"ttft.json", "ttft.png", "ttft_stages.png"},
        "store8b": {"store.json", "store.png"},
        "prefix8b": {"prefix.json", "prefix.png", "torch-attention/prefix.json"},
    }
    for stage, files in expected.items():
        with tarfile.open(out / f"{stage}.tar.gz") as archive:
            names = {n.removeprefix(f"{stage}/") for n in archive.getnames()}
        assert files <= names, (stage, names)
        if stage in ("bench8b", "prefix8b"):  # operator profiles, one per cell
            assert any(n.startswith("profiles/") and n.endswith(".txt") for n in names), names
    ttft = json.loads((out / "bench8b" / "ttft.json").read_text())
    assert ttft["repeats"] == 2 and all(len(r["ttft_runs"]) == 2 for r in ttft["rows"])
    strategies = {r["strategy"] for r in ttft["rows"]}
    assert {"prefill", "legolink:2"} <= strategies and all(r["ttft_s"] > 0 for r in ttft["rows"])
    assert all(r["decode_tokens_per_s"] > 0 for r in ttft["rows"])  # each request decoded too


def test_a_stage_that_fails_still_packs_what_it_wrote(tmp_path: Path) -> None:
    run = kit(tmp_path, "install", "test", PYTHON="false")  # its first command fails
    assert run.returncode != 0 and "stage install stopped early" in run.stdout
    assert (tmp_path / "out" / "install.tar.gz").exists()
    assert not (tmp_path / "out" / "test").exists()  # the stages after it never ran


def test_an_unknown_stage_is_refused_before_any_stage_runs(tmp_path: Path) -> None:
    run = kit(tmp_path, "install", "bench9b")
    assert run.returncode == 2 and "unknown stage bench9b" in run.stdout
    assert not (tmp_path / "out").exists()
