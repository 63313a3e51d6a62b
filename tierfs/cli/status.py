"""Rendering of a node's status (``tierfs status``).

Every string in the status may come from users (job names from
``replicator.yaml``, step names, paths, error lines quoting them), so
nothing from it is ever parsed as rich markup.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tierfs.core.config import format_size

#: what ``tierfs status`` says of a tier the daemon runs without
TIERS_OFF = {
    "peer": "off (no --listen or --coordinator: a one-node cluster)",
    "gcs": "off (no --bucket)",
}


def format_status(data: dict[str, Any]) -> list[str]:
    """The status as plain text lines (no colour), e.g. for logs and tests."""
    lines = []
    job = data.get("job") or {}
    lines.append(
        f"mount      {data.get('mountpoint')}  (pid {data.get('pid')}, ram-dir "
        f"{data.get('ram_dir')})"
    )
    if job:
        lines.append(
            f"job        {job.get('name')}  rank {job.get('node_rank')}/"
            f"{job.get('nodes')}  framework {job.get('framework')}  "
            f"state {job.get('state')}"
        )
    else:
        lines.append("job        none (no replicator.yaml and no --job)")
    lines += _ram_lines(data)
    restore = data.get("restore") or {}
    if restore.get("state") not in (None, "idle"):
        text = f"restore    {restore.get('state')}"
        if restore.get("step"):
            source = (
                f"GCS round {restore['backup']}"
                if restore.get("backup")
                else restore.get("source", "?")
            )
            text += f": step {restore['step']} from {source}"
        elif restore.get("state") == "done":
            text += (
                ": nothing to restore (fresh start)"
                if restore.get("outcome") == "fresh"
                else f": nothing restored ({restore.get('outcome') or 'incomplete'})"
            )
        if restore.get("outcome") in ("missing", "refused", "timeout"):
            text += f" [{restore['outcome']}]"
        if restore.get("error"):
            text += f" ({restore['error']})"
        elif restore.get("reason") and (restore.get("problems") or not restore.get("step")):
            text += f" ({restore['reason']})"
        if restore.get("phase") and restore.get("state") not in ("done", "failed"):
            text += f": {restore['phase']}"
        lines.append(text)
    for tier, off in TIERS_OFF.items():
        info = data.get(tier) or (data.get("tiers") or {}).get(tier)
        lines.append(f"{tier:<10} {info.get('summary', '') if info else off}")
        if tier == "peer" and info and info.get("peers"):
            lines.append(
                "peers      "
                + ", ".join(
                    f"{p['rank']}@{p['address']}{'' if p.get('live') else ' (not heard)'}"
                    for p in info["peers"]
                )
            )
    return lines


def _ram_lines(data: dict[str, Any]) -> list[str]:
    """What tierfs holds (its own count, by area), the budget, and the filesystem's
    free space (shared with other programs), as separate lines."""
    budget = data.get("budget") or {}
    usage = data.get("usage")
    passthrough = f"passthrough {'on' if data.get('passthrough') else 'off'}"
    if not usage:  # a daemon from before the count by area
        return [
            f"ram        {format_size(budget.get('used_bytes', 0))} used of "
            f"{format_size(budget.get('total_bytes', 0))} "
            f"({format_size(budget.get('free_bytes', 0))} free, "
            f"{budget.get('mode')} accounting, {passthrough})"
        ]
    lines = [
        f"ram        tierfs holds {format_size(usage['total_bytes'])}: view "
        f"{format_size(usage['view_bytes'])}, snapshots "
        f"{format_size(usage['snapshot_bytes'])}, replicas "
        f"{format_size(usage['replica_bytes'])}, trash and transfers "
        f"{format_size(usage['other_bytes'])} (counted {usage['age_seconds']:.0f} s ago)"
    ]
    if budget.get("mode") == "managed":
        lines.append(
            f"budget     {format_size(budget.get('total_bytes', 0))} (--size, counted "
            f"by tierfs): {format_size(budget.get('free_bytes', 0))} left; "
            f"{passthrough}"
        )
    elif budget.get("size_bytes"):  # --size given: tierfs's own tmpfs of that size
        lines.append(
            f"budget     {format_size(budget['size_bytes'])} (--size, a tmpfs of "
            f"that size: the kernel enforces it); {passthrough}"
        )
    else:
        lines.append(f"budget     the filesystem's free space (no --size); {passthrough}")
    fs = data.get("filesystem") or {}
    if fs:
        others = max(0, fs["used_bytes"] - usage["total_bytes"])
        lines.append(
            f"filesystem {format_size(fs['free_bytes'])} free of "
            f"{format_size(fs['total_bytes'])} ({format_size(others)} used by "
            "other programs)"
        )
    return lines


def _console() -> Console:
    """A console for stdout; when it is not a terminal (a pipe, a file), lines are
    never wrapped or cut (rich would wrap at 80 columns)."""
    probe = Console()
    if probe.is_terminal:
        return probe
    return Console(width=10_000, soft_wrap=True)


def render_status(data: dict[str, Any]) -> None:
    """Print the status as text plus a table of steps."""
    console = _console()
    for line in format_status(data):
        console.print(line, markup=False, highlight=False)
    steps = data.get("steps") or []
    if steps:
        table = Table(title="steps")
        for col in ("step", "name", "state", "size", "where"):
            table.add_column(col)
        for s in steps:
            cells = (
                str(s.get("step")),
                str(s.get("name", "")),
                str(s.get("state")),
                format_size(s.get("bytes", 0)),
                ", ".join(s.get("where", [])),
            )
            table.add_row(*(Text(c) for c in cells))  # Text: never markup
        console.print(table)
    errors = data.get("errors") or []
    if errors:
        console.print("recent errors:", style="bold red")
        for e in errors[-10:]:
            console.print(f"  {e}", markup=False, highlight=False)
