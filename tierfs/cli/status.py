"""Rendering of a node's status (``tierfs status``).

Every string in the status may come from users (job names from
``replicator.yaml``, step names, paths, error lines quoting them), so
nothing from it is ever parsed as rich markup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tierfs.cli.console import stdout_console
from tierfs.cluster.copies import copies_line
from tierfs.core.config import format_size
from tierfs.core.status import NodeStatus, PeerStatus

#: what ``tierfs status`` says of a tier the daemon runs without
TIERS_OFF = {
    "peer": "off (no --listen or --coordinator: a one-node cluster)",
    "gcs": "off (no --bucket)",
}


def format_status(data: NodeStatus | Mapping[str, Any]) -> list[str]:
    """The status (typed, or its JSON object) as plain text lines (no colour), e.g. for
    logs and tests."""
    st = _typed(data)
    lines = []
    job = st.job
    lines.append(f"mount      {st.mountpoint}  (pid {st.pid}, ram-dir {st.ram_dir})")
    if job:
        lines.append(
            f"job        {job.name}  rank {job.node_rank}/{job.nodes}  framework "
            f"{job.framework}  state {job.state}" + _generation(st)
        )
    else:
        lines.append("job        none (no replicator.yaml and no --job)")
    lines += _copies(st)
    lines += _ram_lines(st)
    restore = st.restore
    if restore.state not in (None, "idle"):
        text = f"restore    {restore.state}"
        if restore.step and restore.source == "none":
            text += (
                f": step {restore.step} (written by {restore.writers} nodes: this node "
                "holds no part of it)"
            )
        elif restore.step:
            source = f"GCS round {restore.backup}" if restore.backup else restore.source or "?"
            text += f": step {restore.step} from {source}"
            if job and restore.writers and restore.writers != job.nodes:
                text += f" (written by {restore.writers} nodes)"
        elif restore.state == "done":
            text += (
                ": nothing to restore (fresh start)"
                if restore.outcome == "fresh"
                else f": nothing restored ({restore.outcome or 'incomplete'})"
            )
        if restore.outcome in ("missing", "refused", "timeout"):
            text += f" [{restore.outcome}]"
        if restore.error:
            text += f" ({restore.error})"
        elif restore.reason and (restore.problems or not restore.step):
            text += f" ({restore.reason})"
        if restore.phase and restore.state not in ("done", "failed"):
            text += f": {restore.phase}"
        lines.append(text)
    for tier, off in TIERS_OFF.items():
        info = st.tiers.get(tier)
        lines.append(f"{tier:<10} {info.summary if info is not None else off}")
        if isinstance(info, PeerStatus) and info.peers:
            lines.append(
                "peers      "
                + ", ".join(
                    f"{p.rank}@{p.address}{'' if p.live else ' (not heard)'}" for p in info.peers
                )
            )
    lines += _whole_view_lines(st)
    return lines


def _whole_view_lines(st: NodeStatus) -> list[str]:
    """Other ranks' files of each step in the view (issue #14), newest steps first."""
    view = st.whole_view
    if not view.active:
        return []
    fetched = ", ".join(f"{n} bytes from {t}" for t, n in sorted(view.fetched_bytes.items()))
    head = f"others    other ranks' files: {fetched or 'nothing fetched yet'}"
    if view.fetch_errors:
        head += f", {view.fetch_errors} failed fetches"
    if view.dropped_bytes:
        head += f", {view.dropped_bytes} bytes dropped for room (fetched again when read)"
    if view.pinned_bytes:
        head += f", {view.pinned_bytes} bytes kept by open files or memory maps"
    lines = [head]
    peer = st.tiers.get("peer")
    gone = set(peer.gone) if isinstance(peer, PeerStatus) else set()
    for s in view.steps[:3]:
        later = [r for r in s.ranks_missing if r not in gone]
        lost = [r for r in s.ranks_missing if r in gone]
        kept = "" if s.own_part else "; no sealed part of this node is kept here"
        written = (
            f" (written by {s.writers} nodes{kept})"
            if st.job is not None and s.writers and (s.writers != st.job.nodes or not s.own_part)
            else ""
        )
        text = (
            f"  step {s.step}{written}: ranks {','.join(map(str, s.ranks_known)) or '-'} known"
            + (f", {','.join(map(str, later))} not yet" if later else "")
            # a rank declared gone brings no part (regression: "3 not yet")
            + (f", {','.join(map(str, lost))} gone" if lost else "")
            + f"; files {s.local} here, {s.remote} remote ({s.bytes_remote} bytes)"
            + (f", {s.fetching} fetching" if s.fetching else "")
        )
        if s.resaved:
            text += f"; saved again: rank(s) {','.join(map(str, s.resaved))}"
        if s.refused:
            text += (
                f"; NOT SERVED (an earlier save than the other parts): rank(s) "
                f"{','.join(map(str, s.refused))}"
            )
        if s.conflicts:
            text += f"; conflicts: {', '.join(s.conflicts[:3])}"
        if s.failed:
            text += f"; failed: {', '.join(s.failed[:3])}"
        lines.append(text)
    return lines


def _copies(st: NodeStatus) -> list[str]:
    """``copies     step 4: 2 copies of every rank's part`` on the node serving the
    coordinator (issue #16: re-replication after a node loss), else nothing."""
    peer = st.tiers.get("peer")
    coord = peer.coordinator_state if isinstance(peer, PeerStatus) else None
    if coord is None or coord.copies_step is None:
        return []
    return [f"copies     {copies_line(coord.copies_step, coord.copies)}"]


def _generation(st: NodeStatus) -> str:
    """``  generation G (N nodes)`` on the node serving the coordinator, else ""; then
    ``  gone [3]`` on every node that knows ranks declared gone for good (issue #16)."""
    peer = st.tiers.get("peer")
    if not isinstance(peer, PeerStatus):
        return ""
    coord = peer.coordinator_state
    gone = coord.gone if coord is not None and coord.gone else peer.gone
    out = ""
    if coord is not None and coord.generation:
        out = f"  generation {coord.generation} ({coord.nodes} nodes)"
    if gone:
        out += f"  gone {list(gone)}"
    return out


def _typed(data: NodeStatus | Mapping[str, Any]) -> NodeStatus:
    return data if isinstance(data, NodeStatus) else NodeStatus.from_json(data)


def _ram_lines(st: NodeStatus) -> list[str]:
    """What tierfs holds (its own count, by area), the budget, and the filesystem's
    free space (shared with other programs), as separate lines."""
    budget = st.budget
    usage = st.usage
    passthrough = f"passthrough {'on' if st.passthrough else 'off'}"
    if not usage:  # a daemon from before the count by area
        return [
            f"ram        {format_size(budget.used_bytes)} used of "
            f"{format_size(budget.total_bytes)} "
            f"({format_size(budget.free_bytes)} free, "
            f"{budget.mode} accounting, {passthrough})"
        ]
    lines = [
        f"ram        tierfs holds {format_size(usage.total_bytes)}: view "
        f"{format_size(usage.view_bytes)}, snapshots "
        f"{format_size(usage.snapshot_bytes)}, replicas "
        f"{format_size(usage.replica_bytes)}, trash, transfers and log "
        f"{format_size(usage.other_bytes)} (counted {usage.age_seconds:.0f} s ago)"
    ]
    if budget.mode == "managed":
        lines.append(
            f"budget     {format_size(budget.total_bytes)} (--size, counted "
            f"by tierfs): {format_size(budget.free_bytes)} left; "
            f"{passthrough}"
        )
    elif budget.size_bytes:  # --size given: tierfs's own tmpfs of that size
        lines.append(
            f"budget     {format_size(budget.size_bytes)} (--size, a tmpfs of "
            f"that size: the kernel enforces it); {passthrough}"
        )
    else:
        lines.append(f"budget     the filesystem's free space (no --size); {passthrough}")
    fs = st.filesystem
    if fs:
        others = max(0, fs.used_bytes - usage.total_bytes)
        lines.append(
            f"filesystem {format_size(fs.free_bytes)} free of "
            f"{format_size(fs.total_bytes)} ({others_phrase(others, usage.age_seconds)})"
        )
    return lines


#: seconds within which tierfs's count of its own bytes is taken as now's
FRESH_COUNT = 1.0


def others_phrase(others: int, age_seconds: float) -> str:
    """What the filesystem's used bytes beyond tierfs's own count (``others``, bytes)
    are, given that count's age in seconds (pure): other programs', and, once the
    count is older than :data:`FRESH_COUNT`, also what tierfs wrote since.

    Regression (#14 trials 49 F5.4 and 51): right after a restore or a save, status
    said "912.1 MiB used by other programs" for tierfs's own files, counted 2 s ago."""
    text = f"{format_size(others)} used by other programs"
    if age_seconds >= FRESH_COUNT and others:
        text += f" or written since tierfs's count {age_seconds:.0f} s ago"
    return text


def _console() -> Console:
    """A console for stdout (:func:`tierfs.cli.console.stdout_console`)."""
    return stdout_console()


def render_status(data: NodeStatus | Mapping[str, Any]) -> None:
    """Print the status (typed, or its JSON object) as text plus a table of steps."""
    st = _typed(data)
    console = _console()
    for line in format_status(st):
        console.print(line, markup=False, highlight=False)
    if st.steps:
        table = Table(title="steps")
        for col in ("step", "name", "state", "size", "where", "loads"):
            table.add_column(col)
        for s in st.steps:
            cells = (
                str(s.step),
                s.name,
                str(s.state),
                format_size(s.bytes),
                ", ".join(s.where),
                s.loads or "",
            )
            table.add_row(*(Text(c) for c in cells))  # Text: never markup
        console.print(table)
    if st.errors:
        console.print("recent errors:", style="bold red")
        for e in st.errors[-10:]:
            console.print(f"  {e}", markup=False, highlight=False)
