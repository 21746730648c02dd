"""How the package installs and imports: `import rag_kvcache` pulls in no framework, plain
`pytest` and `python -m pytest` collect the same tests, a new module is picked up without
reinstalling, no module is loaded under two names, the bench runs from a built wheel outside
the source tree, and the LlamaIndex-namespace packages (integrations/llama-index-*) install
beside llama-index-core. Each check runs in a fresh interpreter, so nothing this test process
already imported can hide a problem."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import uuid
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rag_kvcache"
# frameworks that only the extras bring in; the engine must not need any of them
EXTRAS_ONLY = ("llama_index", "streamlit", "fastapi", "uvicorn", "redis", "psycopg")


def python(code: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run `code` in a fresh interpreter (-I: no PYTHONPATH, no user site, no cwd on sys.path
    unless env asks for them) and return its stdout; fail with its stderr."""
    flags = ["-I"] if env is None else []
    done = subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_importing_the_engine_imports_no_framework(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "import rag_kvcache, rag_kvcache.engine, rag_kvcache.storage.store\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    modules = json.loads(python(code, cwd=tmp_path))
    assert "rag_kvcache.engine" in modules
    leaked = [m for m in modules if m.split(".")[0] in EXTRAS_ONLY]
    assert leaked == []
    assert not [m for m in modules if m.startswith(("rag_kvcache.tools", "rag_kvcache.integ"))]


def test_the_command_runs_without_the_extras(tmp_path: Path) -> None:
    """`pip install rag-kvcache` with no extra: every command parses (the bench and store
    commands are what a GPU machine runs), and `serve` says which extra to install. The
    extras' frameworks are made unimportable, as on a machine that never installed them."""
    hidden = (*EXTRAS_ONLY, "starlette", "prometheus_client")
    code = (
        "import importlib.abc, sys\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {hidden!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "from rag_kvcache.tools.cli.main import build_parser, main\n"
        "args = build_parser().parse_args(['bench', 'ttft', '--contexts', '512'])\n"
        "print('bench parsed', args.contexts)\n"
        f"print('serve exit', main(['serve', '--store', {str(tmp_path / 'store')!r}]))\n"
    )
    out = python(code, cwd=tmp_path)
    assert "bench parsed" in out
    assert "serve exit 1" in out
    assert 'pip install "rag-kvcache[serve]"' in " ".join(out.split())


def test_a_missing_extra_says_what_to_install() -> None:
    from rag_kvcache.extras import LazyModule, MissingExtraError, require

    missing = f"no_such_module_{uuid.uuid4().hex[:8]}"
    with pytest.raises(MissingExtraError, match=r'pip install "rag-kvcache\[redis\]"') as err:
        require(missing, extra="redis", purpose="the Redis blob tier")
    assert isinstance(err.value, ImportError) and "the Redis blob tier" in str(err.value)
    lazy = LazyModule(missing, extra="llama-index", purpose="the adapters")  # nothing imported yet
    with pytest.raises(MissingExtraError, match=r"rag-kvcache\[llama-index\]"):
        lazy.anything  # noqa: B018


def collected(*command: str) -> list[str]:
    done = subprocess.run(
        [*command, "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_python_m_pytest_collects_exactly_what_pytest_does() -> None:
    plain = collected(str(Path(sys.executable).parent / "pytest"))
    as_module = collected(sys.executable, "-m", "pytest")
    assert len(plain) > 100 and as_module == plain


def test_a_new_module_is_importable_without_reinstalling(tmp_path: Path) -> None:
    name = f"_probe_{uuid.uuid4().hex[:12]}"
    probe = PACKAGE / f"{name}.py"
    probe.write_text("VALUE = 42\n")
    try:
        out = python(f"import rag_kvcache.{name} as m; print(m.VALUE, m.__file__)", tmp_path)
    finally:
        probe.unlink()
    value, file = out.split()
    assert value == "42" and Path(file).resolve() == probe.resolve()


def test_no_module_is_loaded_twice_under_two_names(tmp_path: Path) -> None:
    """Import every module of the package, then look for one file behind two module names (the
    links rag_kvcache/storage and rag_kvcache/integrations make that easy to get wrong)."""
    code = """
import importlib, json, os, pkgutil, sys
import rag_kvcache
failed = {}
for info in pkgutil.walk_packages(rag_kvcache.__path__, "rag_kvcache."):
    if info.name.endswith((".migrations.env", ".__main__")):  # scripts: Alembic's, `python -m`
        continue
    try:
        importlib.import_module(info.name)
    except Exception as err:
        failed[info.name] = repr(err)
files = {}
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and name.split(".")[0] in ("rag_kvcache", "storage", "integrations"):
        files.setdefault(os.path.realpath(path), []).append(name)
print(json.dumps({"failed": failed, "files": files}))
"""
    report = json.loads(python(code, cwd=tmp_path))
    assert report["failed"] == {}
    assert len(report["files"]) > 50  # every module was found through the links too
    assert {f: n for f, n in report["files"].items() if len(n) > 1} == {}


@pytest.mark.parametrize("folder", ["storage", "integrations"])
def test_the_linked_folders_refuse_their_own_name(folder: str) -> None:
    """From the root, where `storage/` is on sys.path, it still has only its package name."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {folder}"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode != 0 and f"rag_kvcache.{folder}" in done.stderr


def build_wheel(tmp_path: Path) -> Path:
    """The project's wheel, built from a copy of the sources (nothing written into the repo)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "rag_kvcache", "storage", "integrations"):
        path = REPO / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(path, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    wheels = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(wheels), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (wheel,) = wheels.glob("rag_kvcache-*.whl")
    return wheel


def test_the_library_wheel_leaves_the_llama_index_packages_out(tmp_path: Path) -> None:
    """integrations/llama-index-* sit inside rag_kvcache/integrations (the link): each is its own
    distribution, never a part of rag-kvcache's wheel."""
    with zipfile.ZipFile(build_wheel(tmp_path)) as wheel:
        names = wheel.namelist()
    assert any(n.startswith("rag_kvcache/integrations/llama_index/") for n in names)
    assert [n for n in names if "llama-index-" in n or n.startswith("llama_index/")] == []


@pytest.mark.slow  # random:tiny carries SmolLM2's tokenizer
def test_the_bench_runs_from_a_built_wheel_outside_the_source_tree(tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(build_wheel(tmp_path)) as wheel:
        names = wheel.namelist()
        wheel.extractall(site)
    assert any(n.startswith("rag_kvcache/samples/corpus/") and n.endswith(".md") for n in names)
    assert any(n.startswith("rag_kvcache/storage/") for n in names)
    assert not any(n.startswith(("tests/", "demos/", "storage/")) for n in names)
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = python("import rag_kvcache; print(rag_kvcache.__file__)", cwd=run, env=env)
    assert Path(where.strip()).is_relative_to(site)  # the wheel's copy, not the editable one
    args = ["bench", "ttft", "--model", "random:tiny", "--dtypes", "float32", "--contexts", "512"]
    args += ["--strategies", "naive,legolink:2", "--repeats", "1", "--out", str(tmp_path / "out")]
    code = f"import sys; from rag_kvcache.tools.cli import main; sys.exit(main({args!r}))"
    python(code, cwd=run, env=env)
    rows = json.loads((tmp_path / "out" / "ttft.json").read_text())["rows"]
    assert [r["strategy"] for r in rows[:3]] == ["prefill", "naive", "legolink:2"]
    assert all(r["context_tokens"] > 0 and r["ttft_s"] > 0 for r in rows)


# The LlamaIndex-namespace packages, by LlamaIndex's kinds: (distribution, module, a name the
# module must re-export), as LlamaIndex names its own (llama-index-llms-openai-like,
# llama_index.llms.openai_like)
KINDS = {"llms": "KVCacheLLM", "embeddings": "MiniLMEmbedding", "retrievers": "KVCacheRetriever"}
LLAMA_INDEX_PACKAGES = [
    (f"llama-index-{kind}-rag-kvcache", f"llama_index.{kind}.rag_kvcache", name)
    for kind, name in KINDS.items()
]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def llama_index_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each integrations/llama-index-* package's wheel, built from a copy of its folder."""
    tmp = tmp_path_factory.mktemp("llama_index_wheels")
    folders = sorted(p for p in (REPO / "integrations").glob("llama-index-*") if p.is_dir())
    assert sorted(p.name for p in folders) == sorted(d for d, _, _ in LLAMA_INDEX_PACKAGES)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    copies = [shutil.copytree(f, tmp / "source" / f.name, ignore=ignore) for f in folders]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp / "wheels"), *map(str, copies)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    wheels = {}
    for distribution, _, _ in LLAMA_INDEX_PACKAGES:
        (wheels[distribution],) = (tmp / "wheels").glob(f"{distribution.replace('-', '_')}-*.whl")
    return wheels


@pytest.mark.parametrize(("distribution", "module", "name"), LLAMA_INDEX_PACKAGES)
def test_a_llama_index_package_ships_only_its_module(
    llama_index_wheels: dict[str, Path], distribution: str, module: str, name: str
) -> None:
    """One `__init__.py` in the namespace, nothing of `llama_index/` or `llama_index/llms/`
    themselves (an `__init__.py` there would hide llama-index-core); rag-kvcache's version,
    requiring the same release with its llama-index extra."""
    with zipfile.ZipFile(llama_index_wheels[distribution]) as wheel:
        names = wheel.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(wheel.read(info).decode())
    modules = [n for n in names if ".dist-info/" not in n]
    assert modules == [module.replace(".", "/") + "/__init__.py"]
    assert (metadata["Name"], metadata["Version"]) == (distribution, VERSION)
    assert metadata.get_all("Requires-Dist") == [f"rag-kvcache[llama-index]=={VERSION}"]


def test_the_llama_index_packages_install_beside_llama_index_core(
    tmp_path: Path, llama_index_wheels: dict[str, Path]
) -> None:
    """Installed into a fresh folder (put first on the path): each module comes from there and
    re-exports the plugin's own objects; llama-index-core and another package of the
    `llama_index.llms` namespace (llama-index-llms-openai-like) still import."""
    target = tmp_path / "target"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
        + [str(w) for w in llama_index_wheels.values()],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    code = f"""
import importlib, json
import rag_kvcache.integrations.llama_index as plugin
report = {{}}
for module in {[m for _, m, _ in LLAMA_INDEX_PACKAGES]!r}:
    m = importlib.import_module(module)
    report[module] = {{
        "file": m.__file__,
        "same": {{n: getattr(m, n) is getattr(plugin, n) for n in m.__all__}},
    }}
from llama_index.llms.rag_kvcache import KVCacheLLM
from llama_index.core import VectorStoreIndex
from llama_index.llms.openai_like import OpenAILike
report["KVCacheLLM"] = KVCacheLLM is plugin.KVCacheLLM
print(json.dumps(report))
"""
    env = {**os.environ, "PYTHONPATH": str(target)}
    report = json.loads(python(code, cwd=tmp_path, env=env))
    assert report.pop("KVCacheLLM") is True
    for _, module, name in LLAMA_INDEX_PACKAGES:
        assert Path(report[module]["file"]).is_relative_to(target)  # the wheel's copy
        assert name in report[module]["same"]
        assert all(report[module]["same"].values()), report[module]["same"]


def test_make_install_puts_the_llama_index_packages_in_the_environment(tmp_path: Path) -> None:
    """What the README tells a LlamaIndex user to import works in the dev environment too."""
    code = f"""
import importlib, json
from importlib import metadata
import rag_kvcache.integrations.llama_index as plugin
print(json.dumps({{
    dist: [metadata.version(dist), getattr(importlib.import_module(m), n) is getattr(plugin, n)]
    for dist, m, n in {LLAMA_INDEX_PACKAGES!r}
}}))
"""
    report = json.loads(python(code, cwd=tmp_path))
    assert report == {d: [VERSION, True] for d, _, _ in LLAMA_INDEX_PACKAGES}
