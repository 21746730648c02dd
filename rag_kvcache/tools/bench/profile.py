"""One measured call under torch's profiler, as a text table: `bench ttft --profile` and
`bench prefix --profile` write one per cell, so that a single run on a new machine says
where its time goes, stage by stage and operator by operator."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from rag_kvcache.timing import STAGES

PROFILE_ROWS = 40  # operators listed, the costliest first


def write_profile(call: Callable[[], object], path: Path, device: torch.device) -> None:
    """`call()` under torch's profiler, written to `path`: each request stage's time
    (`timing.STAGES`, profiler ranges), then the operators, the costliest first by their own
    time on the GPU (on a CPU, by their own CPU time)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    lines = ["stage: host ms, device ms (kernels it launched)"]
    lines += [
        f"{e.key}: {e.cpu_time_total / 1e3:.3f}, {e.device_time_total / 1e3:.3f}"
        for e in events
        if e.key in STAGES
    ]
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=key, row_limit=PROFILE_ROWS)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n\n" + table + "\n")


def file_name(label: str) -> str:
    """A label (a strategy, a case) as a file name: letters, digits, '.', '_' and '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")
