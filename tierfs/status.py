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

from tierfs.config import format_size

#: what ``tierfs status`` says of a tier the daemon runs without
TIERS_OFF = {"peer": "off (no --listen or --coordinator: a one-node cluster)",
             "gcs": "off (no --bucket)"}


def format_status(data: dict[str, Any]) -> list[str]:
    """The status as plain text lines (no colour), e.g. for logs and tests."""
    lines = []
    job = data.get("job") or {}
    budget = data.get("budget", {})
    lines.append(f"mount      {data.get('mountpoint')}  (pid {data.get('pid')}, ram-dir "
                 f"{data.get('ram_dir')})")
    if job:
        lines.append(f"job        {job.get('name')}  rank {job.get('node_rank')}/"
                     f"{job.get('nodes')}  framework {job.get('framework')}  "
                     f"state {job.get('state')}")
    else:
        lines.append("job        none (no replicator.yaml and no --job)")
    lines.append(f"ram        {format_size(budget.get('used_bytes', 0))} used of "
                 f"{format_size(budget.get('total_bytes', 0))} "
                 f"({format_size(budget.get('free_bytes', 0))} free, "
                 f"{budget.get('mode')} accounting, passthrough "
                 f"{'on' if data.get('passthrough') else 'off'})")
    restore = data.get("restore") or {}
    if restore.get("state") not in (None, "idle"):
        text = f"restore    {restore.get('state')}"
        if restore.get("step"):
            source = (f"GCS round {restore['backup']}" if restore.get("backup")
                      else restore.get("source", "?"))
            text += f": step {restore['step']} from {source}"
        elif restore.get("state") == "done":
            text += (": nothing to restore (fresh start)" if restore.get("outcome") == "fresh"
                     else f": nothing restored ({restore.get('outcome') or 'incomplete'})")
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
            lines.append("peers      " + ", ".join(
                f"{p['rank']}@{p['address']}{'' if p.get('live') else ' (not heard)'}"
                for p in info["peers"]))
    return lines


def render_status(data: dict[str, Any]) -> None:
    """Print the status as text plus a table of steps."""
    console = Console()
    for line in format_status(data):
        console.print(line, markup=False, highlight=False)
    steps = data.get("steps") or []
    if steps:
        table = Table(title="steps")
        for col in ("step", "name", "state", "size", "where"):
            table.add_column(col)
        for s in steps:
            cells = (str(s.get("step")), str(s.get("name", "")), str(s.get("state")),
                     format_size(s.get("bytes", 0)), ", ".join(s.get("where", [])))
            table.add_row(*(Text(c) for c in cells))  # Text: never markup
        console.print(table)
    errors = data.get("errors") or []
    if errors:
        console.print("recent errors:", style="bold red")
        for e in errors[-10:]:
            console.print(f"  {e}", markup=False, highlight=False)
