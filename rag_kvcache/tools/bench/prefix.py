"""`rag-kvcache bench prefix`: decode throughput and KV memory with a shared prefix.

For each shared-prefix length and batch size, `generate_batch` (prefix tree + two-phase
attention) against the same batch decoded the usual way: every sequence carries its own copy
of the prefix in a transformers `DynamicCache` (batched forward per step, greedy). Questions
have equal token counts, so the baseline needs no padding. Also measured: a batch whose
requests share nothing (each its own chunks), where the tree can only add overhead. Decode
throughput counts batched decode steps only (after the first token); peak KV bytes are the
tree plus private KV for ours, the whole cache for the baseline. Writes JSON and a plot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from rag_kvcache.config import EngineConfig, GenerationConfig, ModelConfig
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import ConfigError
from rag_kvcache.model.adapter import build_cache, forward, unpack_cache
from rag_kvcache.model.loading import LoadedModel, load_model
from rag_kvcache.serving.batch import BatchRequest
from rag_kvcache.tools.bench import CHUNK_TOKENS, check_whole_chunks
from rag_kvcache.tools.bench.profile import write_profile
from rag_kvcache.tools.bench.report import cache_chunks, corpus_tokens, save_report


@dataclass(frozen=True)
class PrefixRow:
    prefix_tokens: int
    batch: int
    shared: bool  # requests share the prefix (else each has its own chunks)
    method: str  # "prefix tree" or "duplicated"
    decode_tokens_per_s: float
    peak_kv_bytes: int


def questions(n: int) -> list[str]:
    """n different questions with the same token count (digits are single tokens)."""
    return [f"What does passage number {1000 + i} say?" for i in range(n)]


def duplicated_decode(
    lm: LoadedModel, prompts: list[list[int]], new_tokens: int
) -> tuple[float, int]:
    """Baseline: batched greedy decode where each sequence holds a full copy of its KV.

    The prompts' common prefix is prefilled once and copied per sequence (only the decode is
    timed); then the rest of each prompt, then `new_tokens - 1` batched steps."""
    common = 0
    while all(len(p) > common + 1 and p[common] == prompts[0][common] for p in prompts):
        common += 1
    batch, device = len(prompts), lm.device
    _, cache = forward(lm, torch.tensor([prompts[0][:common]], device=device), logits_to_keep=1)
    copies = [(k.repeat(batch, 1, 1, 1), v.repeat(batch, 1, 1, 1)) for k, v in unpack_cache(cache)]
    rest = torch.tensor([p[common:] for p in prompts], device=device)
    positions = torch.arange(common, len(prompts[0]), device=device).expand(batch, -1)
    logits, cache = forward(
        lm, rest, positions=positions, cache=build_cache(copies, lm), logits_to_keep=1
    )
    token, position = logits[:, -1].argmax(-1, keepdim=True), len(prompts[0])
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        pos = torch.full((batch, 1), position, device=device)
        logits, cache = forward(lm, token, positions=pos, cache=cache, logits_to_keep=1)
        token, position = logits[:, -1].argmax(-1, keepdim=True), position + 1
        token.tolist()  # a decode loop reads each step's tokens (stopping rules), as ours does
    seconds = time.perf_counter() - start
    kv = sum(2 * k.numel() * k.element_size() for k, _ in unpack_cache(cache))
    return batch * (new_tokens - 1) / seconds, kv


def bench_case(
    engine: RagKVCache,
    chunks: list[list[int]],
    batch: int,
    shared: bool,
    new_tokens: int,
    repeats: int = 1,
    profile_dir: Path | None = None,
) -> list[PrefixRow]:
    """Ours and the baseline for one (prefix, batch, shared) case, `repeats` times each,
    alternating (so a slow spell of a shared machine hits both); the best run counts. With
    `profile_dir`, one more run of each under torch's profiler (`write_profile`)."""
    per_request = len(chunks) // (1 if shared else batch)
    ids = cache_chunks(engine, chunks)  # exact token counts
    groups = [
        ids[:per_request] if shared else ids[i * per_request : (i + 1) * per_request]
        for i in range(batch)
    ]
    asked = questions(batch)
    requests = [BatchRequest(q, tuple(g), new_tokens) for q, g in zip(asked, groups)]
    prompts = [engine.prompt_ids(q, list(g)) for q, g in zip(asked, groups)]
    ours = theirs = 0.0
    for _ in range(repeats):
        engine.clear_prefix_tree()  # linking is not what is timed, but start from nothing
        result = engine.generate_batch(requests, strategy="legolink:2", max_batch=batch)
        ours = max(ours, result.stats.decode_tokens / result.stats.decode_s)
        speed, kv = duplicated_decode(engine.lm, prompts, new_tokens)
        theirs = max(theirs, speed)
    prefix = len(prompts[0]) - len(engine.template.question_ids(engine.lm.tokenizer, asked[0]))
    if profile_dir is not None:
        case = f"{prefix}-{batch}-{'shared' if shared else 'unshared'}"
        device = engine.lm.device
        engine.clear_prefix_tree()
        write_profile(
            lambda: engine.generate_batch(requests, strategy="legolink:2", max_batch=batch),
            profile_dir / f"{case}-prefix_tree.txt",
            device,
        )
        write_profile(
            lambda: duplicated_decode(engine.lm, prompts, new_tokens),
            profile_dir / f"{case}-duplicated.txt",
            device,
        )
    return [
        PrefixRow(prefix, batch, shared, "prefix tree", ours, result.stats.peak_kv_bytes),
        PrefixRow(prefix, batch, shared, "duplicated", theirs, kv),
    ]


def run_prefix_bench(
    out_dir: Path,
    prefixes: list[int],
    batches: list[int],
    new_tokens: int = 64,
    dtype: str = "float32",
    unshared: bool = True,
    model_path: str | None = None,
    device: str = "cpu",
    repeats: int = 1,
    profile: bool = False,
) -> dict[str, object]:
    """`bench prefix`: every (prefix, batch) case shared, then unshared at the first prefix,
    the report written after each; with `profile`, an operator table of each method per case
    under `out_dir/profiles/`."""
    check_whole_chunks("prefixes", prefixes)
    if new_tokens < 2:  # decoding speed counts the tokens after the first
        raise ConfigError(f"new_tokens must be at least 2, not {new_tokens}")
    out_dir.mkdir(parents=True, exist_ok=True)
    lm = load_model(ModelConfig(path=model_path, dtype=dtype, device=device))
    rows: list[PrefixRow] = []
    cases = [(p, b, True) for p in prefixes for b in batches]
    if unshared:
        cases += [(prefixes[0], b, False) for b in batches if b > 1]
    pool_tokens = max(p * (1 if s else b) for p, b, s in cases)
    # every request of a case decodes at once: a KV budget that holds the largest case twice
    # over (its prefixes, and rows as long as prefix + question + answer each)
    most = max(b * (p + CHUNK_TOKENS + new_tokens) for p, b, _ in cases) * lm.kv_bytes_per_token
    config = EngineConfig(
        generation=GenerationConfig(max_new_tokens=new_tokens), kv_cache_bytes=2 * most
    )
    engine = RagKVCache(config, lm=lm)
    pool = corpus_tokens(lm, pool_tokens + CHUNK_TOKENS)
    chunk_pool = [pool[i : i + CHUNK_TOKENS] for i in range(0, pool_tokens, CHUNK_TOKENS)]

    def save(complete: bool) -> dict[str, object]:
        return save_report(
            out_dir,
            "prefix",
            rows,
            lambda path: plot_prefix(rows, path),
            complete=complete,
            model=lm.name,
            dtype=dtype,
            new_tokens=new_tokens,
            strategy="legolink:2",
            repeats=repeats,
            kv_cache_bytes=2 * most,
        )

    report: dict[str, object] = {}
    with Progress() as progress:
        task = progress.add_task("prefix bench", total=len(cases))
        profile_dir = out_dir / "profiles" if profile else None
        for i, (prefix, batch, shared) in enumerate(cases, 1):
            n = prefix // CHUNK_TOKENS * (1 if shared else batch)
            rows += bench_case(
                engine, chunk_pool[:n], batch, shared, new_tokens, repeats, profile_dir
            )
            # after every case: a run stopped early keeps what it measured
            report = save(complete=i == len(cases))
            progress.advance(task)
    return report


def plot_prefix(rows: list[PrefixRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    shared = [r for r in rows if r.shared]
    for i, prefix in enumerate(sorted({r.prefix_tokens for r in shared})):
        for method, style in (("prefix tree", "-o"), ("duplicated", "--s")):
            pts = sorted(
                (r.batch, r) for r in shared if r.prefix_tokens == prefix and r.method == method
            )
            label = f"{method}, {prefix} shared"
            speed.plot(
                [b for b, _ in pts],
                [r.decode_tokens_per_s for _, r in pts],
                style,
                color=f"C{i}",
                label=label,
            )
            memory.plot(
                [b for b, _ in pts],
                [r.peak_kv_bytes / 2**20 for _, r in pts],
                style,
                color=f"C{i}",
                label=label,
            )
    unshared = [r for r in rows if not r.shared]
    for method, style in (("prefix tree", "-o"), ("duplicated", "--s")):
        pts = sorted((r.batch, r) for r in unshared if r.method == method)
        if not pts:
            continue
        label = f"{method}, nothing shared ({pts[0][1].prefix_tokens} each)"
        xs = [b for b, _ in pts]
        speed.plot(xs, [r.decode_tokens_per_s for _, r in pts], style, color="C7", label=label)
        memory.plot(xs, [r.peak_kv_bytes / 2**20 for _, r in pts], style, color="C7", label=label)
    for ax, title, unit in (
        (speed, "decode throughput", "tokens / s"),
        (memory, "peak KV memory", "MiB"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    memory.set_yscale("log")
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
