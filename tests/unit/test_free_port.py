"""free_port (tests, demo, benches): regression for two nodes of one test cluster that
were handed the same port (`Failed to bind to address 127.0.0.1:58327`, a loaded
`make test`, 2 December 2026): binding port 0 twice in a row may return one port twice."""

from __future__ import annotations

import socket

from tierfs.demo.emulator import _below_ephemeral, free_port


def test_never_the_same_port_twice_and_outside_the_ephemeral_range():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    allowed = _below_ephemeral()
    assert all(p in allowed for p in ports) if len(allowed) else True
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free right now


def test_a_port_in_use_or_handed_out_before_is_skipped(monkeypatch):
    from tierfs.demo import emulator

    given = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        draws = iter([taken, given, taken, 0])  # 0: the kernel's choice
        monkeypatch.setattr(emulator.random, "choice", lambda seq: next(draws))
        got = free_port()
    assert got not in (taken, given, 0)
