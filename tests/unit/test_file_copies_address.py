"""The file fetch's copies wait for an address the node just asked the coordinator for.

Regression (eleventh #16 trial NOTE H, a false error line): right after a job restart
with ``--peers-per-node 0`` (no replica partners, so no peer address known), the
whole-step view asked node 3 for a part's manifest, which asked the coordinator for its
address; the prefetch's fetch of one of its files a moment later found the rank already
asked for, did not wait for the next heartbeat, and failed at once with ``peer
node-rank 3: no address known here``, a line in ``replicator.errors``."""

from __future__ import annotations

import fake_ports
import trio
import trio.testing

from tierfs.core.control import JobSpec
from tierfs.replication import files
from tierfs.replication.addresses import AddressBook, Endpoint, PeerInfo
from tierfs.replication.files import PeerFiles


def peer_files(book: AddressBook) -> PeerFiles:
    async def address_of(job: str, rank: int) -> str | None:
        peer = book.reachable(rank)
        if peer is None:
            book.also_want(job, rank)
            return None
        return peer.address

    job = fake_ports.FakeJob(JobSpec("train", "generic", 0, 4, peers_per_node=0))
    return PeerFiles(book, address_of, None, None, job, job)  # type: ignore[arg-type]


def test_a_rank_asked_for_just_before_is_waited_for():
    book = AddressBook(Endpoint(None, ""))
    copies = peer_files(book)
    book.also_want("train", 3)  # the view's manifest call asked a moment ago

    async def main() -> list[tuple[int, str | None]]:
        async def heartbeat() -> None:
            await trio.sleep(0.3)
            book.peers[3] = PeerInfo(3, "127.0.0.1:7003", "i3", True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            return await copies._file_copies("train", 3)

    assert trio.run(main) == [(3, "127.0.0.1:7003")]


def test_a_rank_asked_for_long_ago_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(files, "ADDRESS_WAIT", 0.2)
    book = AddressBook(Endpoint(None, ""))
    copies = peer_files(book)
    book.also_want("train", 3)
    book.wanted_at[("train", 3)] -= 10.0  # asked for long ago, never answered

    async def main() -> tuple[list[tuple[int, str | None]], float]:
        start = trio.current_time()
        got = await copies._file_copies("train", 3)
        return got, trio.current_time() - start

    got, took = trio.run(main)
    assert got == [(3, None)] and took < 0.1


def background(copies: PeerFiles, job: str, rank: int):
    """``copies._file_copies`` as the prefetch calls it (no reader waits)."""
    from tierfs.core.priority import fetch_urgent

    async def call() -> list[tuple[int, str | None]]:
        token = fetch_urgent.set(lambda: False)
        try:
            return await copies._file_copies(job, rank)
        finally:
            fetch_urgent.reset(token)

    return call


def test_a_background_fetch_waits_for_a_node_that_mounts_later(monkeypatch):
    """Regression (#16 twelfth trial NOTE H, still seen after the fix above): the
    reader's 3 s counted from the daemon's first ask, and node 3 mounted 2-4 s after
    the others, so the prefetch right after the restore failed with "no address known
    here" (a false line in replicator.errors). A background fetch waits longer."""
    monkeypatch.setattr(files, "BACKGROUND_ADDRESS_WAIT", 5.0)
    book = AddressBook(Endpoint(None, ""))
    copies = peer_files(book)
    book.also_want("train", 3)
    book.wanted_at[("train", 3)] -= 10.0  # asked at the daemon's start

    async def main() -> list[tuple[int, str | None]]:
        async def mounted_later() -> None:
            await trio.sleep(0.3)
            book.peers[3] = PeerInfo(3, "127.0.0.1:7003", "i3", True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(mounted_later)
            return await background(copies, "train", 3)()

    assert trio.run(main) == [(3, "127.0.0.1:7003")]


def test_after_a_wait_ran_out_no_fetch_waits_for_that_address_for_a_while(monkeypatch):
    monkeypatch.setattr(files, "BACKGROUND_ADDRESS_WAIT", 0.2)
    book = AddressBook(Endpoint(None, ""))
    copies = peer_files(book)

    async def main() -> tuple[list[tuple[int, str | None]], float, float]:
        start = trio.current_time()
        await background(copies, "train", 3)()  # node 3 never comes: 0.2 s
        first = trio.current_time() - start
        got = await background(copies, "train", 3)()
        return got, first, trio.current_time() - start - first

    got, first, second = trio.run(main)
    assert got == [(3, None)] and first >= 0.2 and second < 0.1
