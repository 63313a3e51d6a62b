"""The peer tier's file fetch lane (issue #14): a reader's open gets the next free slot
before the background prefetch (:class:`tierfs.replication.lanes.PriorityLane`)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tierfs.core.priority import fetch_urgent
from tierfs.replication.lanes import PriorityLane


def test_an_urgent_waiter_gets_the_next_slot_before_earlier_prefetches():
    order: list[str] = []

    async def main() -> None:
        lane = PriorityLane(1)
        release = trio.Event()

        async def holder() -> None:
            async with lane.slot():
                order.append("holder")
                await release.wait()

        async def one(name: str, urgent: bool) -> None:
            fetch_urgent.set(lambda: urgent)
            async with lane.slot():
                order.append(name)
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, "prefetch 1", False)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, "prefetch 2", False)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(one, "reader", True)
            await trio.testing.wait_all_tasks_blocked()
            assert (lane.busy, lane.waiting) == (1, 3)
            release.set()
        assert (lane.busy, lane.waiting) == (0, 0)

    trio.run(main)
    assert order == ["holder", "reader", "prefetch 1", "prefetch 2"]


def test_a_prefetch_that_becomes_urgent_while_it_waits_goes_first():
    order: list[str] = []

    async def main() -> None:
        lane = PriorityLane(1)
        release = trio.Event()
        wanted = {"late": False}

        async def holder() -> None:
            async with lane.slot():
                await release.wait()

        async def one(name: str) -> None:
            fetch_urgent.set(lambda: wanted.get(name, False))
            async with lane.slot():
                order.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await trio.testing.wait_all_tasks_blocked()
            for name in ("early", "late"):
                nursery.start_soon(one, name)
                await trio.testing.wait_all_tasks_blocked()
            wanted["late"] = True  # a reader opened that file meanwhile
            release.set()

    trio.run(main)
    assert order == ["late", "early"]


def test_a_cancelled_waiter_leaves_no_slot_taken():
    async def main() -> None:
        lane = PriorityLane(2)
        async with lane.slot(), lane.slot():
            with trio.move_on_after(0.01) as scope:
                async with lane.slot():
                    raise AssertionError("no third slot")
            assert scope.cancelled_caught and lane.waiting == 0
        assert lane.busy == 0
        async with lane.slot():
            assert lane.busy == 1

    trio.run(main)
    with pytest.raises(ValueError):
        PriorityLane(0)


def test_a_paused_transfer_goes_on_while_an_urgent_fetch_waits_for_its_slot():
    """Second review of the batched fetch: a prefetch paused for readers kept its slot
    (the pause has no end of its own); with every slot held so, a reader whose file
    is in none of them waited for a slot forever. While an urgent fetch waits for a
    slot, the paused transfer's hold is off, so it ends and frees its slot."""
    from tierfs.core.priority import fetch_hold
    from tierfs.replication.files import PeerFiles

    async def main() -> None:
        lane = PriorityLane(1)
        files = PeerFiles.__new__(PeerFiles)  # only its lane is used by _hold
        files.lane = lane
        readers = {"n": 1}  # a reader waits: a prefetch pauses
        fetch_hold.set(lambda: readers["n"] > 0)
        hold = files._hold()
        assert hold() is True and lane.urgent_waiting() is False
        got = trio.Event()

        async def reader() -> None:
            fetch_urgent.set(lambda: True)
            async with lane.slot():
                got.set()

        async with trio.open_nursery() as nursery:
            async with lane.slot():  # the paused prefetch's transfer
                nursery.start_soon(reader)
                await trio.testing.wait_all_tasks_blocked()
                assert lane.urgent_waiting() is True
                assert hold() is False  # goes on, and ends
            with trio.fail_after(5):
                await got.wait()
        assert lane.urgent_waiting() is False and hold() is True

    trio.run(main)


def test_a_pause_for_this_nodes_save_holds_even_while_an_urgent_fetch_waits():
    """#14 trial 46 FAIL 6: the pause for this node's save (``fetch_pause``) holds every
    transfer, a reader's too; an urgent fetch waiting for a slot does not lift it
    (that fetch would pause as well once it had the slot)."""
    from tierfs.core.priority import fetch_pause
    from tierfs.replication.files import PeerFiles

    async def main() -> None:
        lane = PriorityLane(1)
        files = PeerFiles.__new__(PeerFiles)
        files.lane = lane
        saving = {"on": False}
        fetch_pause.set(lambda: saving["on"])
        hold = files._hold()  # a reader's fetch: fetch_hold is never
        assert hold() is False
        saving["on"] = True
        assert hold() is True

        async def reader() -> None:
            fetch_urgent.set(lambda: True)
            async with lane.slot():
                pass

        async with trio.open_nursery() as nursery, lane.slot():
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert lane.urgent_waiting() is True
            assert hold() is True  # still paused for the save
            saving["on"] = False
            assert hold() is False

    trio.run(main)
