"""A restore's pull from a peer (tierfs/node/sources.py ``PeerSource``) when the holder
was unreachable a moment before: the channel's reconnect backoff must not fail a
pull from a daemon that listens again (fault campaign seed 29 #4)."""

from __future__ import annotations

import socket
import threading
from concurrent import futures
from typing import Any

import grpc
import pytest
import trio

from tierfs.core.control import JobSpec
from tierfs.node.sources import CopyFailed, PeerSource
from tierfs.replication.client import PeerClient
from tierfs.rpc.wire import WireStats

JOB = JobSpec("j", "generic", 3, 4)


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses; last error: Connection refused"


class Tier:
    """A peer tier whose first ``fail`` pulls find the holder unreachable."""

    def __init__(self, fail: int, reachable: bool) -> None:
        self.fail = fail
        self.answers = reachable
        self.pulls = 0
        self.asked: list[tuple[str, float]] = []
        self.stats = WireStats()

    async def pull(self, address: str, key: Any, digest: str, cancel: threading.Event) -> Any:
        self.pulls += 1
        if self.pulls <= self.fail:
            raise Unavailable()
        return Shard(key)

    async def reachable(self, address: str, timeout: float) -> bool:
        self.asked.append((address, timeout))
        return self.answers


class Shard:
    def __init__(self, key: Any) -> None:
        self.key = key
        self.bytes = 10


class Catalog:
    def __init__(self) -> None:
        self.added: list[Any] = []

    def add(self, shard: Any) -> None:
        self.added.append(shard)


class Progress:
    def progress(self, info: dict[str, Any]) -> None:
        pass


def source(tier: Tier) -> tuple[PeerSource, Catalog]:
    catalog = Catalog()
    return PeerSource(tier, catalog, Progress(), 2, "127.0.0.1:1"), catalog  # type: ignore[arg-type]


def test_a_holder_that_answers_again_is_pulled_again():
    """Regression (seed 29 #4): node 2 was killed during a restore and restarted; its
    Join opened the next round, and node 3's pull of rank 3's step 10 from it, 50 ms
    later, failed with the backoff's "Connection refused". The copy counted as bad,
    and the job restored step 7 from the bucket although step 10 was complete."""
    tier = Tier(fail=1, reachable=True)
    src, catalog = source(tier)
    shard = trio.run(src.fetch, JOB, 10, "d")
    assert tier.pulls == 2 and tier.asked == [("127.0.0.1:1", 3.0)]
    assert catalog.added == [shard]


def test_a_holder_that_stays_unreachable_fails_the_copy():
    tier = Tier(fail=5, reachable=False)
    src, catalog = source(tier)
    with pytest.raises(CopyFailed, match="pulling from node-rank 2 failed"):
        trio.run(src.fetch, JOB, 10, "d")
    assert tier.pulls == 1 and catalog.added == []


def test_a_channel_reaches_a_server_started_after_its_failed_calls():
    """The channel options' short reconnect backoff and ``wait_ready``: a channel whose
    calls failed while nothing listened reaches the server at once once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    client = PeerClient(None, WireStats())
    call = client.channel(address).unary_unary("/x.Y/Z")
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as failed:
            call(b"", timeout=1)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert client.wait_ready(address, 0.2) is False
    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_insecure_port(address)
    server.start()
    try:
        assert client.wait_ready(address, 10.0) is True
        with pytest.raises(grpc.RpcError) as answered:
            call(b"", timeout=5)
        assert answered.value.code() == grpc.StatusCode.UNIMPLEMENTED  # it was reached
    finally:
        server.stop(None)
        client.close()
