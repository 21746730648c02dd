"""What the commands share: list-valued flags, the store and model options, and opening an
engine or a store from them (heavy imports inside, so `--help` stays light)."""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from rag_kvcache.config import EngineConfig, ModelConfig
    from rag_kvcache.engine import RagKVCache
    from rag_kvcache.storage.store import TieredStore

MODEL_HELP = "HF folder, .gguf, or random:llama-3-8b (random weights) (default SmolLM2)"


def csv_list(text: str) -> list[str]:
    """A comma-separated flag value as a list ("a, b," -> ["a", "b"])."""
    return [t.strip() for t in text.split(",") if t.strip()]


def whole(least: int, most: int | None = None, *, step: int = 1) -> Callable[[str], int]:
    """A flag's whole number of at least `least` (and at most `most`; a multiple of `step`):
    argparse names the flag in the error (a zero count hung `bench serve`, and others failed
    with a traceback after loading the model; a context of 300 tokens was cut to one chunk)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number, not {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"at least {least}, not {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"at most {most}, not {value}")
        if value % step:
            raise argparse.ArgumentTypeError(f"a multiple of {step} (its chunks), not {value}")
        return value

    return parse


def wholes(least: int, *, step: int = 1) -> Callable[[str], list[int]]:
    """Comma-separated whole numbers of at least `least` (multiples of `step`), each once."""
    one = whole(least, step=step)
    return lambda text: _distinct(text, [one(t) for t in csv_list(text)])


def dtype_list(text: str) -> list[str]:
    """Comma-separated compute dtypes, each once, at least one."""
    return _distinct(text, csv_list(text))


def fractions(text: str) -> list[float]:
    """Comma-separated numbers from 0 to 1 (needle depths), each once, and apart in the six
    significant digits that name a needle's item (`needle-LENGTH-DEPTH`)."""
    values = _distinct(text, [_number(t, 0.0, 1.0) for t in csv_list(text)])
    if len({f"{v:g}" for v in values}) < len(values):  # two items of one name: a bad report
        raise argparse.ArgumentTypeError(f"two values of {text!r} agree to six digits")
    return values


def sizes(least: float) -> Callable[[str], list[float]]:
    """Comma-separated finite numbers from `least` (file sizes in MB), each once."""

    def parse(text: str) -> list[float]:
        return _distinct(text, [_number(t, least, math.inf) for t in csv_list(text)])

    return parse


def _number(text: str, low: float, high: float, above: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, not {text!r}") from None
    if not math.isfinite(value) or value < low or (above and value == low) or value > high:
        bound = f"above {low:g}" if above else f"from {low:g}"
        raise argparse.ArgumentTypeError(
            f"{bound}" + (f" to {high:g}" if high < math.inf else " and finite") + f", not {text}"
        )
    return value


def _distinct(text: str, values: list[Any]) -> list[Any]:
    if not values:
        raise argparse.ArgumentTypeError(f"no values in {text!r}")
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"a value is given twice in {text!r}")
    return values


def output_folder(folder: Path) -> None:
    """Check --out before any work (made by the command, when it has something to write): a
    file in its place or above it, or a folder where none can be made, is one error line, not
    a traceback after the model has loaded and answered."""
    from rag_kvcache.errors import ConfigError

    for place in (folder, *folder.parents):
        if place.exists():
            if not place.is_dir():
                raise ConfigError(f"cannot make the --out folder {folder}: {place} is a file")
            if not os.access(place, os.W_OK | os.X_OK):  # (a read-only file system too)
                raise ConfigError(
                    f"cannot write the --out folder {folder}: {place} is not writable"
                )
            if place != folder:  # a folder made there and taken back: /proc says writable
                try:  # to root, and refuses anything (a name of its own: runs may race)
                    os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=place))
                except OSError as e:
                    reason = e.strerror or str(e)
                    raise ConfigError(f"cannot make the --out folder {folder}: {reason}") from None
            return


def strategy_list(text: str) -> list[str]:
    """Comma-separated strategies. A strategy starts with a letter, so a comma followed by a
    number is inside one (`+ape:T,S`): "naive+ape:1,0.8,legolink:2" is two strategies."""
    pieces = (t.strip(", \t\r\n") for t in re.split(r",(?=\s*[A-Za-z])", text))
    if not (strategies := [t for t in pieces if t]):  # (not "the defaults": none were named)
        raise argparse.ArgumentTypeError(f"no strategies in {text!r}")
    return strategies


def store_options(parser: argparse.ArgumentParser) -> None:
    from rag_kvcache.config import default_cache_dir

    parser.add_argument("--store", type=Path, default=default_cache_dir() / "store")
    parser.add_argument("--catalog-url", default=None, help="e.g. postgresql+psycopg://...")
    parser.add_argument("--redis-url", default=None, help="durable blobs in Redis")


def engine_options(parser: argparse.ArgumentParser) -> None:
    store_options(parser)
    parser.add_argument(
        "--store-compress",
        default="bfloat16",
        choices=["bfloat16", "none", "int8"],
        help="how blobs this command writes keep KV in the durable tier: float32 KV as "
        "bfloat16 (16-bit KV as computed), as computed (none), or 8-bit; blobs already stored "
        "are read whatever they hold",
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument(
        "--quantization", default=None, choices=["8bit", "4bit"], help="bitsandbytes weights"
    )
    parser.add_argument(
        "--lora",
        default=None,
        metavar="LORA.safetensors|store",
        help="a LoRA link calibration (calibrate --kind lora), its file or `store` for the one "
        "the store keeps for the model, merged into the model; its chunks are its own, "
        "encoded anew",
    )


def open_engine(
    args: argparse.Namespace,
    console: Console,
    existing: bool = False,
    keep_hot: bool = True,
    in_memory: bool = False,
) -> RagKVCache:
    """The engine on --store; `existing`: the command only reads the store, so a store that is
    not there is a StoreNotFoundError (checked before the model loads), never a new one.
    `keep_hot=False`: no hot copies in memory (ingesting reads nothing back; its memory then
    stays bounded whatever it writes). `in_memory`: the command needs the model, not the
    store: the engine's store is a scratch one in memory, and --store is left untouched."""
    from rag_kvcache.engine import RagKVCache
    from rag_kvcache.storage.memory import MemoryStore

    if existing:
        open_store(args).close()
    config = engine_config(args, keep_hot)
    with console.status("loading the model"):
        engine = RagKVCache(config, store=MemoryStore() if in_memory else None)
    vars(args).setdefault("opened_engines", []).append(engine)  # for `close_opened`
    return engine


def close_opened(args: argparse.Namespace) -> None:
    """Stop the engines the command opened and close their stores, so that their reader
    threads end with the command, not at the interpreter's exit (where a Ctrl-C met them
    with a traceback). A Ctrl-C meanwhile is held until they are closed (`ctrl_c_held`)."""
    from rag_kvcache.storage.store import TieredStore

    engines = vars(args).pop("opened_engines", [])
    with ctrl_c_held():
        while engines:
            engine = engines.pop()
            engine.close()
            if isinstance(engine.store, TieredStore):  # (a store in memory holds no threads)
                engine.store.close()


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C back until the block ends, then hand it to the handler there was before
    (Python's raises KeyboardInterrupt; an ignored SIGINT stays ignored); a second Ctrl-C
    raises at once.

    Closing is short, and a KeyboardInterrupt inside it cut SQLite's close in two: SQLAlchemy
    logged its traceback above `interrupted`. Only the main thread receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[bool] = []

    def hold(signum: int, frame: object) -> None:
        pressed.append(True)
        if len(pressed) > 1:  # pressed again: the user will not wait
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:  # (None: a handler set outside Python; Python's own is the one to restore)
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        if len(pressed) == 1:  # held: delivered now, to that handler
            signal.raise_signal(signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """A SIGTERM, taken as a Ctrl-C (`terminate_as_ctrl_c`) that ends the command: the chat
    stops the answer under way on a Ctrl-C and goes on, but not on this."""


@contextmanager
def terminate_as_ctrl_c() -> Iterator[None]:
    """Take a SIGTERM (`kill`, `timeout`, a process manager stopping the command) as a
    Ctrl-C (`Terminated`), so what was stored is kept, temporary files are removed and the
    command exits with "interrupted" (130); where `ctrl_c_held` holds a Ctrl-C back, it is
    held too. Python's default for SIGTERM ends the process at once, leaving a bench's
    multi-gigabyte temporary store behind. `serve` sets its own while it runs (uvicorn's
    graceful shutdown, which exits 0, as on a Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def as_ctrl_c(signum: int, frame: Any) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)  # a section holding Ctrl-C back (`ctrl_c_held`)
        else:  # (and where SIGINT is ignored, a job started in the background: still stops)
            raise Terminated

    previous = signal.signal(signal.SIGTERM, as_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def engine_config(args: argparse.Namespace, keep_hot: bool = True) -> EngineConfig:
    """The engine's config from a command's flags (`engine_options`, and a command's own
    --max-new-tokens, --strategy, --kv-cache-mib where it has them)."""
    from rag_kvcache.config import EngineConfig, GenerationConfig, StoreConfig
    from rag_kvcache.strategy import DEFAULT as DEFAULT_STRATEGY

    kv_mib = getattr(args, "kv_cache_mib", None)
    link = EngineConfig.link_budget_s
    if hasattr(args, "link_budget_ms"):  # serve: milliseconds, or None
        link = None if args.link_budget_ms is None else args.link_budget_ms / 1000
    return EngineConfig(
        model=model_config(args),
        store=StoreConfig(
            args.store,
            catalog_url=args.catalog_url,
            redis_url=args.redis_url,
            cpu_bytes=StoreConfig.cpu_bytes if keep_hot else 0,
            compress=store_compress(args),
        ),
        generation=GenerationConfig(max_new_tokens=getattr(args, "max_new_tokens", 64)),
        strategy=getattr(args, "strategy", None) or DEFAULT_STRATEGY,
        kv_cache_bytes=None if kv_mib is None else kv_mib << 20,
        link_budget_s=link,
    )


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The model a command's flags name (`engine_options`)."""
    from rag_kvcache.config import ModelConfig

    return ModelConfig(
        path=args.model,
        dtype=args.dtype,
        device=getattr(args, "device", "cpu"),
        quantization=args.quantization,
        lora=args.lora,
    )


def open_store(args: argparse.Namespace, with_model: bool = False) -> TieredStore:
    """The existing store under --store (never a new one); `with_model`: able to re-encode bad
    blobs (loads the model)."""
    from rag_kvcache.config import StoreConfig
    from rag_kvcache.storage.store import TieredStore

    config = StoreConfig(
        args.store,
        catalog_url=args.catalog_url,
        redis_url=args.redis_url,
        compress=store_compress(args),  # how `verify --repair` writes the blobs it re-encodes
    )
    store = TieredStore(
        config.root or Path(),
        catalog_url=config.catalog_url,
        redis_url=config.redis_url,
        compress=config.compress,
        create=False,
    )
    if with_model:  # the model the command names (its flags: `engine_options`)
        from rag_kvcache.engine import reencoder
        from rag_kvcache.model.loading import load_model

        try:
            store.reencode = reencoder(load_model(model_config(args), stored_adapter=store.adapter))
        except BaseException:
            store.close()
            raise
    return store


def store_compress(args: argparse.Namespace) -> str | None:
    """--store-compress as StoreConfig.compress ("none" -> None; StoreConfig's default when the
    command has no such flag)."""
    from rag_kvcache.config import StoreConfig

    given = getattr(args, "store_compress", StoreConfig.compress)
    return None if given == "none" else given
