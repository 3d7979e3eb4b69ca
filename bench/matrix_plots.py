"""PNG plots of the matrix's cells (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kvtier.bench.matrix_report import TIERS, _columns, column_key


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(cells: Sequence[dict], round_no: int) -> tuple[list[str], list[str], dict]:
    workloads = sorted({c["workload"] for c in cells})
    by = {(c["workload"], column_key(c)): c for c in cells if c["round"] == round_no}
    return workloads, _columns(cells), by


def plot_ttft(cells: Sequence[dict], path: Path) -> Path:
    """One panel per workload: mean TTFT per configuration, round 1 and round 2 side by side."""
    plt = _pyplot()
    workloads, cols, _ = _grid(cells, 2)
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for r, offset in ((1, -0.2), (2, 0.2)):
            by = {column_key(c): c for c in cells if c["workload"] == w and c["round"] == r}
            ys = [by[k]["ttft_mean_s"] * 1000 if k in by else 0 for k in cols]
            ax.bar([i + offset for i in range(len(cols))], ys, width=0.4, label=f"round {r}")
        ax.set_title(f"workload {w}")
        ax.set_xticks(range(len(cols)), cols, rotation=45, fontsize=7)
        ax.set_ylabel("TTFT mean (ms)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _stacked(cells: Sequence[dict], path: Path, field: str, ylabel: str, title: str) -> Path:
    """Round 2: one stacked bar (device, host, storage) per workload x configuration."""
    plt = _pyplot()
    workloads, cols, by = _grid(cells, 2)
    names = [(w, k) for w in workloads for k in cols if (w, k) in by]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(names)), 4.0))
    bottom = [0.0] * len(names)
    for tier in TIERS:
        ys = [float(by[n][field][tier]) for n in names]
        ax.bar(range(len(names)), ys, bottom=bottom, label=tier)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(range(len(names)), [f"{w}/{k}" for w, k in names], rotation=90, fontsize=6)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(out: Path, cells: Sequence[dict]) -> list[Path]:
    return [plot_ttft(cells, out / "ttft_by_config.png"),
            _stacked(cells, out / "hit_tokens_by_tier.png", "hit_tokens", "tokens",
                     "round 2: reused tokens by tier (workload/config)"),
            _stacked(cells, out / "bytes_moved.png", "bytes_moved", "bytes",
                     "round 2: bytes moved by tier (device = hits x bytes/token)")]
