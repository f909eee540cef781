"""Stage waterfall plots (matplotlib, imported lazily): where the seconds of a start went."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_waterfall(
    startups: list[dict[str, Any]], path: Path, title: str = "", labels: list[str] | None = None
) -> None:
    """One row group per startup manifest, one bar per stage at its start offset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [f"{s['kind']} ({s['tier']})" for s in startups]
    rows = [
        (label, stage) for label, s in zip(labels, startups, strict=True) for stage in s["stages"]
    ]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    colors = plt.get_cmap("tab20").colors
    names = sorted({stage["name"] for _, stage in rows})
    for i, (_, stage) in enumerate(rows):
        color = colors[names.index(stage["name"]) % len(colors)]
        ax.barh(i, max(stage["seconds"], 1e-4), left=stage["start_s"], color=color)
        ax.text(
            stage["start_s"] + stage["seconds"],
            i,
            f" {stage['seconds']:.3f}s",
            va="center",
            fontsize=7,
        )
    ax.set_yticks(
        range(len(rows)), [f"{label}: {stage['name']}" for label, stage in rows], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds since start")
    ax.set_title(title or "snapfn start-up waterfall")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
