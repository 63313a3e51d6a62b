"""bench/flash_bench.py's pure parts: size parsing, medians and the side-by-side table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "flash_bench.py"
_spec = importlib.util.spec_from_file_location("flash_bench", _PATH)
assert _spec and _spec.loader
flash_bench = importlib.util.module_from_spec(_spec)
sys.modules["flash_bench"] = flash_bench
_spec.loader.exec_module(flash_bench)


def test_parse_size() -> None:
    assert flash_bench.parse_size("1GiB") == 1 << 30
    assert flash_bench.parse_size("128MiB") == 128 << 20
    assert flash_bench.parse_size("0.5G") == 1 << 29
    assert flash_bench.parse_size("4096") == 4096
    with pytest.raises(ValueError):
        flash_bench.parse_size("lots")


def test_table_medians_ratio_and_skipped() -> None:
    runs = {
        "tierfs-dcp": [
            {"returned": 0.7, "replicated": 2.0, "slowdown": 0.1},
            {"returned": 0.6, "replicated": 4.0, "slowdown": None},
            {"returned": 0.5, "replicated": 3.0, "slowdown": 0.3},
        ],
        "nvrx": [{"returned": 2.5, "replicated": 2.5, "slowdown": None}] * 3,
        "mlf": [{"returned": 1.2, "replicated": 3.2, "slowdown": 0.05}] * 3,
    }
    summary = flash_bench.summarize(runs)
    assert summary["tierfs-dcp"] == {
        "returned": 0.6,
        "replicated": 3.0,
        "slowdown": pytest.approx(0.2),
        "runs": 3,
    }
    table = flash_bench.format_table(summary, {"other": "not installed"})
    lines = table.splitlines()
    assert lines[2] == (
        "| tierfs, DCP into its mounts (peers-per-node 1) | 0.60 s | 3.00 s | +20% |"
    )
    assert lines[3].endswith("| 2.50 s | 2.50 s | blocked (save returns replicated) |")
    assert lines[4].endswith("| 1.20 s | 3.20 s | +5% |")
    # 3.0 / 2.5 against NVRx, the faster competitor on "saved + replicated"
    assert (
        "tierfs-dcp / nvrx (the faster competitor), saved + replicated: 1.20x "
        "(goal <= 0.80: goal not met)"
    ) in lines
    assert lines[-1] == "skipped other: not installed"


def test_table_without_competitors_has_no_ratio() -> None:
    summary = flash_bench.summarize({"tierfs-files": [{"returned": 0.2, "replicated": 1.0}]})
    table = flash_bench.format_table(summary, {"mlf": "no venv"})
    assert "no competitor ran: no ratio" in table
    assert "x (goal" not in table
