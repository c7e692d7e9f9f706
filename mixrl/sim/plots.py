"""Plots of ``mixrl simulate`` results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from mixrl.sim.fleet import SimResult

COLORS = {"mixrl": "#1f77b4", "mixrl-budget": "#17becf", "keda": "#d62728", "static": "#7f7f7f"}


def _rolling_mean(values: np.ndarray, width: int) -> np.ndarray:
    """NaN-aware moving average (NaN = no request admitted in that sample)."""
    valid = ~np.isnan(values)
    filled = np.where(valid, values, 0.0)
    kernel = np.ones(width)
    sums = np.convolve(filled, kernel, mode="same")
    counts = np.convolve(valid.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def plot_results(results: Mapping[str, SimResult], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    first = next(iter(results.values()))
    hours = first.times / 3600.0

    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True, dpi=80)
    axes[0].plot(hours, first.sessions_target, color="black", lw=0.8, label="sessions (workload)")
    axes[0].set_ylabel("sessions")
    axes[0].legend(loc="upper left", fontsize=8)
    for name, result in results.items():
        color = COLORS.get(name)
        axes[1].plot(hours, result.requested_capacity, color=color, lw=1.0, label=f"{name} requested")
        axes[1].plot(hours, result.ready_capacity, color=color, lw=0.6, ls=":", label=f"{name} ready")
        axes[2].plot(hours, _rolling_mean(result.wait_mean, 10), color=color, lw=1.0, label=name)
    axes[1].set_ylabel("capacity (H100-BF16 units)")
    axes[1].legend(loc="upper left", fontsize=7, ncol=2)
    axes[2].set_ylabel("queue wait, 5-min mean (s)")
    axes[2].set_xlabel("hours")
    axes[2].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)

    names = list(results)
    fig, axes = plt.subplots(1, 4, figsize=(10, 2.8), dpi=80)
    metrics = [
        ("$ per Mtok", [r.cost_per_mtok for r in results.values()]),
        ("p95 queue wait (s)", [r.wait_quantile(0.95) for r in results.values()]),
        ("utilization", [r.utilization for r in results.values()]),
        ("scaling actions", [len(r.actions) for r in results.values()]),
    ]
    for ax, (label, values) in zip(axes, metrics, strict=True):
        ax.bar(names, values, color=[COLORS.get(n, "#999999") for n in names])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / "summary.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
    return paths
