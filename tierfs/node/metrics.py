"""Prometheus metrics (``tierfs mount --metrics-port PORT`` serves ``/metrics``).

The exporter is a custom collector: at each scrape it asks the node agent
for its status on the trio thread (``trio.from_thread``) and turns that into
metric families, so nothing on the FUSE path is instrumented and the numbers
are the same ones ``tierfs status`` shows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

STEP_STATES = ("writing", "sealed", "verified", "replicating", "replicated", "replication failed")


def families(status: dict[str, Any]) -> list[Any]:
    """Metric families for one status snapshot (pure; unit-tested)."""
    budget = status.get("budget", {})
    ram = GaugeMetricFamily("tierfs_ram_bytes", "RAM tier budget in bytes", labels=["kind"])
    for kind in ("total", "used", "free"):
        ram.add_metric([kind], float(budget.get(f"{kind}_bytes", 0)))
    job = status.get("job") or {}
    info = InfoMetricFamily("tierfs_job", "The job this node serves")
    info.add_metric(
        [],
        {
            "name": str(job.get("name", "")),
            "framework": str(job.get("framework", "")),
            "node_rank": str(job.get("node_rank", "")),
            "nodes": str(job.get("nodes", "")),
            "mode": str(status.get("mode", "")),
        },
    )
    steps = status.get("steps", [])
    by_state = GaugeMetricFamily("tierfs_steps", "Steps of this node by state", labels=["state"])
    counts = {s: 0 for s in STEP_STATES}
    for s in steps:
        counts[s.get("state", "sealed")] = counts.get(s.get("state", "sealed"), 0) + 1
    for state, n in sorted(counts.items()):
        by_state.add_metric([state], float(n))
    newest = GaugeMetricFamily(
        "tierfs_newest_step", "Newest step per tier on this node", labels=["tier"]
    )
    sealed = [s["step"] for s in steps if s.get("state") != "writing"]
    newest.add_metric(["local"], float(max(sealed, default=0)))
    replicated = [
        s["step"] for s in steps if any(w.startswith("peer:") for w in s.get("where", []))
    ]
    newest.add_metric(["peer"], float(max(replicated, default=0)))
    backed = [s["step"] for s in steps if any(w.startswith("gcs:") for w in s.get("where", []))]
    newest.add_metric(["gcs"], float(max(backed, default=0)))
    held = GaugeMetricFamily(
        "tierfs_sealed_bytes", "Bytes of sealed steps held in RAM", labels=["owner"]
    )
    held.add_metric(["own"], float(sum(s.get("bytes", 0) for s in steps)))
    held.add_metric(["replicas"], float(sum(r.get("bytes", 0) for r in status.get("replicas", []))))
    errors = GaugeMetricFamily("tierfs_recent_errors", "Recent problems reported by the node")
    errors.add_metric([], float(len(status.get("errors", []))))
    restore = status.get("restore") or {}
    restored = GaugeMetricFamily("tierfs_restored_step", "Step of the last finished restore")
    restored.add_metric([], float(restore.get("step") or 0))
    up = GaugeMetricFamily("tierfs_passthrough", "1 if FUSE passthrough serves file data")
    up.add_metric([], 1.0 if status.get("passthrough") else 0.0)
    return [
        ram,
        info,
        by_state,
        newest,
        held,
        errors,
        restored,
        up,
        *_whole_view(status),
        *_peer_wire(status),
    ]


def _peer_wire(status: dict[str, Any]) -> list[Any]:
    """The peer plane's counters (``tiers.peer.wire``): bytes and calls, one sample
    per counter (``tierfs_peer_bytes`` for the ``*_bytes`` ones, in bytes)."""
    wire = ((status.get("tiers") or {}).get("peer") or {}).get("wire") or {}
    nbytes = CounterMetricFamily(
        "tierfs_peer_bytes",
        "Bytes moved by the peer plane (sent, received, pulled, served; over the data lane)",
        labels=["counter"],
    )
    calls = CounterMetricFamily(
        "tierfs_peer_calls", "Calls and events of the peer plane", labels=["counter"]
    )
    for name, n in sorted(wire.items()):
        if name.endswith("_bytes"):
            nbytes.add_metric([name.removesuffix("_bytes")], float(n))
        else:
            calls.add_metric([name], float(n))
    return [nbytes, calls]


def _whole_view(status: dict[str, Any]) -> list[Any]:
    """The whole-step view's families (issue #14): bytes fetched per tier, failed
    fetches, and the newest step's other-rank files by state."""
    view = status.get("whole_view") or {}
    fetched = CounterMetricFamily(
        "tierfs_other_ranks_fetched_bytes",
        "Bytes of other ranks' files fetched into this node's view, by tier",
        labels=["tier"],
    )
    for tier, n in sorted((view.get("fetched_bytes") or {}).items()):
        fetched.add_metric([tier], float(n))
    failed = CounterMetricFamily(
        "tierfs_other_ranks_fetch_errors", "Fetches of other ranks' files no copy could serve"
    )
    failed.add_metric([], float(view.get("fetch_errors", 0)))
    dropped = CounterMetricFamily(
        "tierfs_other_ranks_dropped_bytes",
        "Bytes of other ranks' fetched files dropped for room (a cache; fetched again on read)",
    )
    dropped.add_metric([], float(view.get("dropped_bytes", 0)))
    pinned = GaugeMetricFamily(
        "tierfs_other_ranks_pinned_bytes",
        "Bytes of other ranks' fetched files the last drop for room kept: open, or "
        "memory-mapped by a reader",
    )
    pinned.add_metric([], float(view.get("pinned_bytes", 0)))
    files = GaugeMetricFamily(
        "tierfs_other_ranks_files",
        "Other ranks' files of the newest step in this node's view, by state",
        labels=["state"],
    )
    newest = (view.get("steps") or [{}])[0]
    for state in ("local", "remote", "fetching"):
        files.add_metric([state], float(newest.get(state, 0)))
    return [fetched, failed, dropped, pinned, files]


class StatusCollector(Collector):
    """A collector that turns ``snapshot()`` (a status dict) into metric families."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        try:
            status = self.snapshot()
        except Exception:  # a scrape must never take the daemon down
            log.exception("metrics snapshot failed")
            return
        yield from families(status)


def serve(port: int, snapshot: Callable[[], dict[str, Any]], addr: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` on ``addr:port`` from a background thread.

    Raises:
        OSError: the port is taken (the message names ``--metrics-port``).
    """
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:  # name the flag: "Address already in use" alone says nothing
        raise OSError(exc.errno, f"--metrics-port {port}: {exc.strerror or exc}") from exc
    log.info("Prometheus metrics on %s:%d/metrics", addr, port)
