"""The eval's figures: speed against accuracy and "kept" (`plot_pareto`), KL against
the tokens recomputed (`plot_kl`) and the needles found per length and depth
(`plot_needle`). matplotlib is imported when one is drawn.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.eval.needle import needle_cell
from rag_kvcache.tools.eval.results import ItemResult, StrategySummary


def plot_pareto(summary: list[StrategySummary], path: Path) -> None:
    """Speedup over prefill against accuracy and against "kept", each with its 95% interval;
    the noise floor (prefill with its chunks reordered) as a band on the "kept" panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    floor = [s for s in summary if s.strategy.startswith("prefill+")]
    for ax, metric, label in (
        (axes[0], "contains", "accuracy: gold answer in the output (%)"),
        (axes[1], "kept", "kept: of prefill's right answers (same placement), % still right"),
    ):
        for s in summary:
            value = getattr(s, metric)
            low, high = getattr(s, f"{metric}_low"), getattr(s, f"{metric}_high")
            ax.errorbar(s.speedup, value, yerr=[[value - low], [high - value]], fmt="o", capsize=3)
            ax.annotate(s.strategy, (s.speedup, value), textcoords="offset points", xytext=(4, 4))
        if metric == "kept" and floor:
            ax.axhspan(
                min(s.kept for s in floor),
                max(s.kept for s in floor),
                color="grey",
                alpha=0.2,
                label="noise floor: prefill, chunks reordered",
            )
            ax.legend(loc="lower left", fontsize=8)
        ax.set_xscale("log")
        tokens = summary[0].timed_tokens if summary else 0
        ax.set_xlabel(f"TTFT speedup over prefill (median, items of ~{tokens} tokens, log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("speed vs answer quality per strategy (95% bootstrap intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl(summary: list[StrategySummary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parsed = [(Strategy.parse(s.strategy), s) for s in summary]
    # plain legolink:K only (a placement or top part is another curve, not a point of this one)
    lego = sorted(
        ((st.k, s) for st, s in parsed if st == Strategy("legolink", k=st.k)),
        key=lambda pair: pair[0],
    )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if lego:
        ax.plot([k for k, _ in lego], [s.kl for _, s in lego], "o-", label="legolink:k")
        ax.set_xscale("log", base=2)
    for s in summary:
        if s.strategy in ("naive", "legolink0") or s.strategy.startswith("cacheblend"):
            ax.axhline(s.kl, linestyle="--", alpha=0.6, label=s.strategy, color=f"C{len(ax.lines)}")
    ax.set_xlabel("k (tokens recomputed at the start of each chunk)")
    ax.set_ylabel("mean next-token KL vs full")
    ax.set_title("fidelity vs boundary tokens recomputed")
    if ax.lines:  # none of these strategies in the run: nothing to label
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_needle(results: list[ItemResult], strategies: list[Strategy], path: Path) -> None:
    """One heatmap per strategy: the share of needles found per context length and depth,
    each cell labelled found / tried."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({needle_cell(r.item)[0] for r in results})
    depths = sorted({needle_cell(r.item)[1] for r in results})
    fig, axes = plt.subplots(1, len(strategies), figsize=(3.2 * len(strategies), 3.4))
    axes = axes if len(strategies) > 1 else [axes]
    for ax, strategy in zip(axes, strategies):
        found = torch.zeros(len(lengths), len(depths))
        tried = torch.zeros(len(lengths), len(depths))
        for r in results:
            if r.strategy == str(strategy):
                length, depth = needle_cell(r.item)
                at = lengths.index(length), depths.index(depth)
                found[at] += float(r.contains)
                tried[at] += 1
        share = (found / tried.clamp(min=1)).numpy()
        ax.imshow(share, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, j in tried.nonzero().tolist():
            ax.text(j, i, f"{found[i, j]:.0f}/{tried[i, j]:.0f}", ha="center", va="center")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_title(str(strategy).replace("+", "\n+", 3), fontsize=9)  # long spellings wrap
    axes[0].set_ylabel("context tokens")
    fig.suptitle("needles found in the answer, per length and depth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
