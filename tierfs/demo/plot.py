"""The demo's plot: training loss against step, with failures and restores marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def loss_segments(events: list[dict[str, Any]]) -> list[list[tuple[int, float]]]:
    """Rank 0's loss per step, one segment per run of the training job.

    Pure (unit-tested). A run begins at a ``start`` event (or where the step
    number goes back, for logs without them); a restarted job re-runs the
    steps after its restored checkpoint, so runs may overlap.
    """
    segments: list[list[tuple[int, float]]] = []
    last: int | None = None
    for e in sorted(
        (e for e in events if e.get("event") in ("loss", "start")), key=lambda e: e["t"]
    ):
        if e["event"] == "start":
            segments.append([])
            last = e["step"]
            continue
        if not segments or last is None or e["step"] <= last:
            segments.append([])
        segments[-1].append((e["step"], e["loss"]))
        last = e["step"]
    return [s for s in segments if s]


def plot_run(events: list[dict[str, Any]], timeline: list[dict[str, Any]], path: Path) -> Path:
    """Write the PNG: one line per training run, failures and restores as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    for i, seg in enumerate(loss_segments(events)):
        xs, ys = zip(*seg, strict=True)
        ax.plot(xs, ys, marker=".", linewidth=1.2, label=f"run {i + 1}")
    restores: dict[int, str] = {}
    for e in events:
        if e.get("event") == "restore":
            src = "GCS backup" if e.get("backup") else "RAM / peer"
            restores[e["step"]] = src
    failures = [t for t in timeline if t.get("kind") == "failure" and t.get("step")]
    for n, (step, src) in enumerate(sorted(restores.items())):
        color = "tab:purple" if src == "GCS backup" else "tab:green"
        ax.axvline(step, color=color, linestyle="--", linewidth=1)
        ax.annotate(
            f"restored step {step}\nfrom {src}",
            (step, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -28 - 24 * (n % 2)),
            textcoords="offset points",
            fontsize=8,
            color=color,
        )
    for t in failures:
        ax.axvline(t["step"], color="tab:red", linewidth=1.5, alpha=0.6)
        ax.annotate(
            "node failure" if "NODE" in t["text"] else "cluster loss",
            (t["step"], 0),
            xycoords=("data", "axes fraction"),
            xytext=(3, 6),
            textcoords="offset points",
            fontsize=8,
            color="tab:red",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_yscale("log")
    ax.set_title("tierfs demo: training survives a node loss and a cluster loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
