"""The diagnosis's figures (matplotlib, PNG): layer x head heatmaps of linked minus prefill,
the attention figures per layer and per placed chunk, the K/V deviation by position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rag_kvcache.tools.diagnosis.records import (
    FAILED,
    KEPT,
    POSITION_BINS,
    SINK_TOKENS,
    ItemDiagnosis,
)
from rag_kvcache.tools.diagnosis.summary import delta, mean_of, same_shape


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


HEATMAPS = {
    "sink": "chunk-start mass Δ",
    "answer": "answer-chunk mass Δ",
    "distractors": "distractor mass Δ",
    "entropy": "entropy Δ (nats)",
}


def plot_heatmaps(items: list[ItemDiagnosis], path: Path, title: str) -> None:
    """Layer x head maps of linked - prefill: mass on chunk starts, on the answer's chunk, on
    the distractors, entropy; and the total variation between the two attentions."""
    plt = _pyplot()
    panels = [(label, delta(items, name), True) for name, label in HEATMAPS.items()]
    panels.append(("departure (total variation)", mean_of(items, "departure"), False))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 7.5))
    for ax, (label, grid, diverging) in zip(axes, panels, strict=True):
        if diverging:
            bound = float(np.abs(grid).max()) or 1.0
            image = ax.imshow(grid, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        else:
            image = ax.imshow(grid, cmap="viridis", vmin=0, aspect="auto")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("head")
        ax.set_xticks(range(grid.shape[1]))
        fig.colorbar(image, ax=ax, shrink=0.6)
    axes[0].set_ylabel("layer")
    fig.suptitle(f"question-token attention, {title} (mean over question tokens and items)")
    _save(plt, fig, path)


TITLES = {
    "sink": "mass on chunk starts (first {sink} tokens)",
    "end": "mass on chunk ends (last token)",
    "prefix": "mass on the system prefix",
    "answer": "mass on the answer's chunk",
    "bridge": "mass on the two-hop bridge chunk",
    "distractors": "mass on distractor chunks",
    "question": "mass on the question",
    "entropy": "entropy (nats)",
    "answer_top": "top document token in the answer's chunk",
}


def plot_by_layer(
    items: list[ItemDiagnosis], path: Path, strategy: str, sink_tokens: int = SINK_TOKENS
) -> None:
    """Per layer (mean over heads and items): each figure of AttentionStats for prefill and
    the link, and their departure; failed items solid, kept ones (controls) dotted."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 5, figsize=(20, 7))
    groups = [(g, s, [d for d in items if d.group == g]) for g, s in ((FAILED, "-"), (KEPT, ":"))]
    for ax, name in zip(axes.flat, TITLES, strict=False):
        for group, style, chosen in groups:
            for side, color in (("prefill", "C0"), ("linked", "C3")):
                if chosen:
                    y = mean_of(chosen, f"{side}.{name}").mean(axis=1)
                    label = f"{side if side == 'prefill' else strategy} ({group}, {len(chosen)})"
                    ax.plot(y, style, color=color, label=label)
        ax.set_title(TITLES[name].format(sink=sink_tokens), fontsize=10)
    last = axes.flat[-1]
    for group, style, chosen in groups:
        if chosen:
            y = mean_of(chosen, "departure").mean(axis=1)
            last.plot(y, style, color="k", label=f"{group} ({len(chosen)})")
    last.set_title("departure: total variation linked vs prefill", fontsize=10)
    last.legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("question-token attention per layer (mean over heads, question tokens, items)")
    _save(plt, fig, path)


def plot_by_chunk(items: list[ItemDiagnosis], path: Path, strategy: str) -> None:
    """Per placed chunk (system prefix first): the question tokens' mass on it per layer
    (mean over heads and items), prefill and the link; failed items solid, kept dotted."""
    plt = _pyplot()
    same = same_shape(items)
    count = len(same[0].chunk_tokens)
    fig, axes = plt.subplots(1, count, figsize=(3.6 * count, 3.8), sharey=True)
    for chunk, ax in enumerate(axes):
        for group, style in ((FAILED, "-"), (KEPT, ":")):
            chosen = [d for d in same if d.group == group]
            for side, color in (("prefill", "C0"), ("linked", "C3")):
                if chosen:
                    y = mean_of(chosen, f"{side}.chunks")[chunk]
                    label = f"{side if side == 'prefill' else strategy} ({group}, {len(chosen)})"
                    ax.plot(y, style, color=color, label=label)
        ax.set_title("system prefix" if chunk == 0 else f"document chunk {chunk}", fontsize=10)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("question-token attention mass")
    axes[0].legend(fontsize=7)
    fig.suptitle("attention mass per placed chunk (mean over heads, question tokens, items)")
    _save(plt, fig, path)


def plot_kv(items: list[ItemDiagnosis], path: Path, strategy: str) -> None:
    """Relative K and V deviation from prefill against position in the chunk, one line per
    few layers (mean over the document chunks and items)."""
    plt = _pyplot()
    centers = np.array([(a + min(b, 1024) - 1) / 2 for a, b in POSITION_BINS])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, name in zip(axes, ("keys", "values"), strict=True):
        grid = mean_of(items, f"kv.{name}")  # [layers, bins]
        seen = np.isfinite(grid).any(axis=0)
        layers = len(grid)
        for layer in sorted({*range(0, layers, max(1, layers // 6)), layers - 1}):
            ax.plot(centers[seen], grid[layer, seen], "o-", ms=2, label=f"layer {layer}")
        ax.set_xscale("symlog", linthresh=16)
        ax.set_xlabel("position in the chunk (tokens; linear to 16, then log)")
        ax.set_ylabel(f"||{name} linked - prefill|| / ||prefill||")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"KV deviation of {strategy} from prefill, document chunks, {len(items)} items")
    _save(plt, fig, path)
