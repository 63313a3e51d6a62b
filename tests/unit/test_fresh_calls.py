"""FreshCalls: concurrent askers share calls, and no answer is older than its asker."""

from __future__ import annotations

import trio
import trio.testing

from tierfs.core.fresh import FreshCalls


def test_a_burst_of_askers_costs_two_calls_and_every_answer_began_after_its_asker():
    fresh: FreshCalls[str, float] = FreshCalls()
    answers: list[tuple[float, float]] = []  # (asked at, the answering call's start)

    async def call() -> float:
        began = trio.current_time()
        await trio.sleep(1.0)
        return began

    async def asker(delay: float) -> None:
        await trio.sleep(delay)
        asked = trio.current_time()
        answers.append((asked, await fresh.ask("rank 0", call)))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for delay in (0.0, 0.1, 0.2, 0.5, 0.9, 1.5, 1.6):
                nursery.start_soon(asker, delay)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(answers) == 7
    assert all(began >= asked for asked, began in answers), answers
    # the first at 0; those during it share one at 1.0; those during that, one at 2.0
    assert sorted(began for _, began in answers) == [0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    assert fresh.calls == 3


def test_other_keys_and_sequential_askers_each_get_their_own_call():
    fresh: FreshCalls[int, int] = FreshCalls()

    async def main() -> None:
        assert await fresh.ask(1, _answer(11)) == 11
        assert await fresh.ask(1, _answer(12)) == 12
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fresh.ask, 1, _answer(13))
            nursery.start_soon(fresh.ask, 2, _answer(21))
        assert fresh.calls == 4

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _answer(value: int):
    async def call() -> int:
        await trio.sleep(0.5)
        return value

    return call


def test_askers_sharing_a_call_whose_runner_was_cancelled_ask_again():
    """The asker that runs a shared call may be cancelled (an interrupted open): the
    others sharing it then ask again, never left without an answer."""
    fresh: FreshCalls[str, int] = FreshCalls()
    scopes: dict[object, trio.CancelScope] = {}
    runner_of: dict[int, object] = {}
    got: dict[str, int] = {}

    async def call() -> int:
        n = fresh.calls  # this call's number, counted as it began
        runner_of[n] = trio.lowlevel.current_task()
        await trio.sleep(1.0)
        return n

    async def asker(name: str, delay: float) -> None:
        await trio.sleep(delay)
        with trio.CancelScope() as scope:
            scopes[trio.lowlevel.current_task()] = scope
            got[name] = await fresh.ask("k", call)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(asker, "a", 0.0)  # call 1, 0 to 1.0
            nursery.start_soon(asker, "b", 0.1)  # b and c share call 2, from 1.0
            nursery.start_soon(asker, "c", 0.2)
            await trio.sleep(1.5)
            scopes[runner_of[2]].cancel()  # whichever of b and c runs it

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got.pop("a") == 1
    assert list(got.values()) == [3] and fresh.calls == 3  # the other asked again
