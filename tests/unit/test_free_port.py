"""free_port (tests, demo, benches): regression for two nodes of one test cluster that
were handed the same port (`Failed to bind to address 127.0.0.1:58327`, a loaded
`make test`, 2 December 2026): binding port 0 twice in a row may return one port twice."""

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


def test_a_port_the_kernel_gives_again_is_skipped(monkeypatch):
    given = free_port()

    class Repeating(socket.socket):
        """The kernel's choice repeats the port handed out before, then moves on."""

        calls = 0

        def bind(self, address: object) -> None:
            Repeating.calls += 1
            super().bind(("127.0.0.1", given if Repeating.calls == 1 else 0))

    monkeypatch.setattr(emulator.socket, "socket", Repeating)
    # only ``given`` handed out (regression: with the 300 ports of the test above
    # handed out in the same process, the kernel's next choice was one of them once)
    monkeypatch.setattr(emulator, "_HANDED_OUT", {given})
    got = free_port()
    assert Repeating.calls == 2 and got != given
