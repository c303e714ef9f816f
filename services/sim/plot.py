"""Latency CDF plots of a policy comparison (matplotlib, Agg backend: no display needed).

One figure, two panels — short lane and long lane — each with one end-to-end latency
CDF per policy on a logarithmic time axis, from :func:`services.sim.metrics.cdf_points`.
A panel with no completed request says so instead (and carries no legend). The format
follows the file's suffix: PNG, SVG or PDF.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # the backend is chosen above, before pyplot loads

Cdf = tuple[list[float], list[float]]


def plot_cdfs(runs: Mapping[str, Mapping[str, Cdf]], out: Path, *, title: str = "") -> None:
    """Write ``out`` (format by suffix): per lane, the e2e latency CDF of every policy in
    ``runs``."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    handles: dict[str, Any] = {}  # one legend entry per policy that drew in either panel
    for ax, lane in zip(axes, ("short", "long"), strict=True):
        for i, (name, cdfs) in enumerate(runs.items()):
            xs, ys = cdfs.get(lane, ([], []))
            if xs:  # a fixed colour per policy, whichever policies a panel lacks
                (line,) = ax.step(xs, ys, where="post", label=name, color=f"C{i}",
                                  linewidth=2.2 if name == "llmq" else 1.4)
                handles.setdefault(name, line)
        if ax.lines:
            ax.set_xscale("log")
        else:  # a log axis over nothing only draws warnings
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_title(f"{lane} lane")
        ax.set_xlabel("end-to-end latency (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of completed requests")
    if handles:
        axes[1].legend(list(handles.values()), list(handles), loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
