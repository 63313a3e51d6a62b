"""Prometheus metrics: the pure mapping and a real scrape of a mount."""

from __future__ import annotations

import urllib.request

from mtc_clients import orbax_initialize, orbax_save, orbax_yaml, wait_for

from tierfs.demo.emulator import free_port
from tierfs.node.metrics import families


def sample_values(fams) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in fams:
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_families_from_a_status_snapshot():
    status = {
        "budget": {"total_bytes": 100, "used_bytes": 40, "free_bytes": 60},
        "job": {"name": "j", "framework": "orbax", "node_rank": 1, "nodes": 4},
        "mode": "protocol",
        "steps": [
            {"step": 10, "state": "replicated", "bytes": 7, "where": ["local", "peer:0"]},
            {"step": 5, "state": "sealed", "bytes": 3, "where": ["local", "gcs:2026-11-30_10-00"]},
            {"step": 15, "state": "writing", "bytes": 0, "where": []},
        ],
        "replicas": [{"job": "j", "rank": 0, "step": 10, "bytes": 9}],
        "errors": ["e1"],
        "restore": {"state": "done", "step": 5},
        "passthrough": True,
        "tiers": {"peer": {"wire": {"lane_served_bytes": 4096, "lane_pulls": 2}}},
    }
    v = sample_values(families(status))
    assert v[("tierfs_peer_bytes_total", (("counter", "lane_served"),))] == 4096
    assert v[("tierfs_peer_calls_total", (("counter", "lane_pulls"),))] == 2
    assert v[("tierfs_ram_bytes", (("kind", "used"),))] == 40
    assert v[("tierfs_steps", (("state", "replicated"),))] == 1
    assert v[("tierfs_steps", (("state", "writing"),))] == 1
    assert v[("tierfs_newest_step", (("tier", "local"),))] == 10
    assert v[("tierfs_newest_step", (("tier", "peer"),))] == 10
    assert v[("tierfs_newest_step", (("tier", "gcs"),))] == 5
    assert v[("tierfs_sealed_bytes", (("owner", "replicas"),))] == 9
    assert v[("tierfs_restored_step", ())] == 5
    assert v[("tierfs_passthrough", ())] == 1


def test_scrape_a_running_mount(make_mount):
    port = free_port()
    m = make_mount("--metrics-port", str(port))
    orbax_initialize(m.path, orbax_yaml("job", 0, 1))
    orbax_save(m.path, 3, {"a": b"x" * 5000})

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    text = wait_for(
        lambda: 'tierfs_newest_step{tier="local"} 3.0' in scrape() and scrape(),
        20,
        "step 3 in the metrics",
    )
    assert 'tierfs_job_info{framework="orbax"' in text
    assert 'tierfs_ram_bytes{kind="total"}' in text
