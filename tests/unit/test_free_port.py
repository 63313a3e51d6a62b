"""free_port (tests, demo, benches): regressions for two nodes of one test cluster that
were handed the same port (`Failed to bind to address 127.0.0.1:58327`, a loaded
`make test`, 2 December 2026: binding port 0 twice in a row may return one port twice)
and for a port of the ephemeral range taken by an outgoing connection before the
daemon bound it (`cannot listen on 127.0.0.1:44769`, CI, 7 December 2026)."""

from __future__ import annotations

import socket

from tierfs.demo import emulator
from tierfs.demo.emulator import free_port


def test_never_the_same_port_twice():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free right now


def test_ports_are_below_the_ephemeral_range_and_away_from_torchs():
    start = emulator._ephemeral_start()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert start == int(f.read().split()[0])
    for _ in range(50):
        p = free_port()
        assert p < start and p not in range(29000, 30000)
    # an outgoing connection's local port comes from the ephemeral range, never ours
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        assert client.getsockname()[1] >= start


def test_a_port_in_use_is_skipped(monkeypatch):
    monkeypatch.setattr(emulator, "_HANDED_OUT", set())
    first = emulator._candidates()[0]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        got = free_port()
    assert got != first and got in emulator._candidates()


def test_xdist_workers_start_in_slices_of_their_own(monkeypatch):
    starts = {}
    for n in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        starts[n] = set(emulator._candidates()[:500])
    assert not (starts[0] & starts[1]) and not (starts[1] & starts[2])
    assert not (starts[0] & starts[2])
