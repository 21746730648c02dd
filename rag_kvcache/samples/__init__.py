"""Data that ships inside the package, so commands work from any install (a wheel too).

`corpus/`: eight short articles about an invented harbor town, written for this project (the
model cannot answer from memory). `make demo` ingests it, the benchmarks build their contexts
from it; `demos/data` points here.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def sample_corpus_dir() -> Path:
    """The folder of the sample corpus' Markdown files."""
    return Path(str(files(__name__) / "corpus"))
