"""The end-to-end demo in its small setting, and its pure helpers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierfs.demo.orchestrator import DemoConfig
from tierfs.demo.plot import loss_segments


def test_loss_segments_split_runs_at_restarts():
    events = [{"event": "start", "step": 0, "t": 0}]
    events += [{"event": "loss", "step": s, "loss": 1.0 / s, "t": s} for s in (1, 2, 3, 4)]
    events += [{"event": "start", "step": 2, "t": 10}]
    events += [{"event": "loss", "step": s, "loss": 0.5, "t": 10 + s} for s in (3, 4, 5)]
    events += [{"event": "save", "step": 5, "t": 20}]
    segs = loss_segments(events)
    assert [[s for s, _ in seg] for seg in segs] == [[1, 2, 3, 4], [3, 4, 5]]


def test_phases_leave_room_after_the_failure():
    assert DemoConfig(steps=50, save_every=5, backup_every=10).phases() == (20, 25, 45, 55)
    assert DemoConfig(steps=30, save_every=5, backup_every=10).phases() == (10, 15, 35, 45)
    for steps in (8, 30, 50, 100):
        p1, kill, p2, end = DemoConfig(steps=steps, save_every=2, backup_every=4).phases()
        assert p1 % 4 == 0 and kill == p1 + 2 and p2 >= kill + 8 and p2 % 2 == 0
        assert end >= max(steps, p2 + 4)


@pytest.mark.slow
def test_demo_survives_node_and_cluster_loss(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "tierfs", "demo", "--nodes", "3", "--steps", "30",
         "--model-size", "tiny", "--step-delay", "0.05", "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FINAL CHECK PASSED" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["problems"] == []
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    kinds = [t["kind"] for t in timeline]
    assert kinds.count("failure") == 2
    sources = {t.get("source", "") for t in timeline if t["kind"] == "restored"}
    assert any(s.startswith("peer:") for s in sources), sources
    assert any(s.startswith("GCS round") for s in sources), sources
    events = [json.loads(line)
              for line in (out / "trainer-events.jsonl").read_text().splitlines()]
    saved = {(e["rank"], e["step"]): e["digest"] for e in events if e["event"] == "save"}
    restored = [e for e in events if e["event"] == "restore"]
    assert restored and all(saved[(e["rank"], e["step"])] == e["digest"] for e in restored)
    assert (out / "loss.png").stat().st_size > 10_000
