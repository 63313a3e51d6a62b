"""What the demo tells: the timeline (printed as it happens, kept for the log and the
plot), the watcher that turns the nodes' status into timeline events (a step sealed,
replicated, backed up on every node; a node's restore ready), and the final check that
every restore returned exactly the state saved at that step.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierfs.core.config import format_size
from tierfs.core.status import NodeStatus

if TYPE_CHECKING:
    from tierfs.demo.orchestrator import Demo

__all__ = ["StatusWatcher", "Timeline", "check_restores"]


@dataclass
class Timeline:
    """Timestamped events, printed as they happen and kept for the plot and the log."""

    log_path: Path
    start: float = field(default_factory=time.time)
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, text: str, **data: Any) -> None:
        t = time.time() - self.start
        event = {"t": round(t, 2), "kind": kind, "text": text, **data}
        with self.lock:
            self.events.append(event)
            line = f"[{t:6.1f}s] {text}"
            print(line, flush=True)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(event) + "\n")


class StatusWatcher(threading.Thread):
    """Polls every node's ``.tierfs/status.json`` and reports step transitions."""

    def __init__(self, demo: Demo) -> None:
        super().__init__(name="status-watcher", daemon=True)
        self.demo = demo
        self.stop = threading.Event()
        self.seen: dict[tuple[str, int], set[int]] = defaultdict(set)
        self.restores: dict[int, float] = {}

    def run(self) -> None:
        while not self.stop.wait(0.25):
            for node in self.demo.nodes:
                status = self.demo.status(node.rank)
                if status:
                    self._observe(node.rank, status)

    def _observe(self, rank: int, status: NodeStatus) -> None:
        n = self.demo.config.nodes
        for step in status.steps:
            where = step.where
            facts = {
                "sealed": True,
                "replicated": any(w.startswith("peer:") for w in where),
                "backed up": any(w.startswith("gcs:") for w in where),
            }
            for fact, true in facts.items():
                key = (fact, step.step)
                if true and rank not in self.seen[key]:
                    self.seen[key].add(rank)
                    if len(self.seen[key]) == n:
                        extra = ""
                        if fact == "backed up":
                            rounds = sorted({w[4:] for w in where if w.startswith("gcs:")})
                            extra = f" (round {rounds[-1]})" if rounds else ""
                        self.demo.timeline.add(
                            fact,
                            f"step {step.step:>3} {fact} on {n}/{n} nodes "
                            f"({format_size(step.bytes)} per node){extra}",
                            step=step.step,
                            bytes=step.bytes,
                        )
        restore = status.restore
        at = restore.at
        if restore.state == "done" and at and self.restores.get(rank) != at:
            self.restores[rank] = at
            if restore.step:
                src = restore.source or "?"
                if restore.backup:
                    src = f"GCS round {restore.backup}"
                self.demo.timeline.add(
                    "restored",
                    f"node {rank}: restore of step {restore.step} ready (data from {src})",
                    step=restore.step,
                    node=rank,
                    source=src,
                )

    def forget_node(self, rank: int) -> None:
        """A node lost its RAM: its facts must be seen again."""
        for ranks in self.seen.values():
            ranks.discard(rank)

    def forget_all(self) -> None:
        self.seen.clear()


def check_restores(
    events: list[dict[str, Any]], timeline: Timeline, phases: tuple[int, ...], out: Path
) -> dict[str, Any]:
    """Every restore in the trainers' ``events`` must return exactly the state saved at
    that step; adds the check to ``timeline``, writes ``summary.json`` and the loss plot
    to ``out`` and returns the summary."""
    saved = {(e["rank"], e["step"]): e["digest"] for e in events if e["event"] == "save"}
    restores = [e for e in events if e["event"] == "restore"]
    problems = []
    for e in restores:
        want = saved.get((e["rank"], e["step"]))
        if want != e["digest"]:
            problems.append(
                f"rank {e['rank']} step {e['step']}: restored {e['digest']}, saved {want}"
            )
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in restores:
        by_step[e["step"]].append(e)
    for step, group in sorted(by_step.items()):
        src = "GCS round " + group[0]["backup"] if group[0].get("backup") else "RAM/peers"
        timeline.add(
            "check",
            f"step {step}: {len(group)} ranks restored "
            f"{format_size(sum(g['bytes'] for g in group))} from "
            f"{src}; state identical to the saved state: "
            f"{'yes' if not problems else 'NO'}",
            step=step,
        )
    if len(by_step) < 2:
        problems.append(f"expected a restore after each failure, saw {sorted(by_step)}")
    summary = {
        "ok": not problems,
        "problems": problems,
        "restores": {str(k): len(v) for k, v in by_step.items()},
        "phases": phases,
        "out": str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    from tierfs.demo.plot import plot_run

    try:
        png = plot_run(events, timeline.events, out / "loss.png")
        timeline.add("done", f"plot written to {png}")
    except Exception as exc:  # a missing plotting library must not hide the result
        timeline.add("done", f"plot skipped: {exc}")
    return summary
