"""Latency CDF plots of a policy comparison (matplotlib, Agg backend: no display needed).

One figure, two panels — short lane and long lane — each with one end-to-end latency
CDF per policy on a logarithmic time axis, from :func:`services.sim.metrics.cdf_points`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # the backend is chosen above, before pyplot loads

Cdf = tuple[list[float], list[float]]


def plot_cdfs(runs: Mapping[str, Mapping[str, Cdf]], out: Path, *, title: str = "") -> None:
    """Write ``out`` (PNG): per lane, the e2e latency CDF of every policy in ``runs``."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, lane in zip(axes, ("short", "long"), strict=True):
        for name, cdfs in runs.items():
            xs, ys = cdfs.get(lane, ([], []))
            if xs:
                ax.step(xs, ys, where="post", label=name,
                        linewidth=2.2 if name == "llmq" else 1.4)
        ax.set_xscale("log")
        ax.set_title(f"{lane} lane")
        ax.set_xlabel("end-to-end latency (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of completed requests")
    axes[1].legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
