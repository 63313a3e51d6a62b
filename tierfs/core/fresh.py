"""Questions shared by concurrent askers, each answered by a call begun after it asked.

An open of another rank's file asks that rank's node which part it holds
(:meth:`tierfs.node.remote_view.RemoteView._owner_shown`). The answer is good
for an open only if the question was sent after the open began: a save begun
in between would be missed. Many opens of one part at once (several ranks per
node reading ``.metadata``, a reader with many threads) need not ask once
each: every asker that arrives while a question is under way waits for it to
end and then shares the *next* question, which begins after all of them
asked. A burst of opens costs at most two questions per key, and no answer is
older than its asker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

__all__ = ["FreshCalls"]

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


@dataclass(eq=False)
class _Round(Generic[_V]):
    """One question under way (or to come) for one key."""

    done: trio.Event = field(default_factory=trio.Event)
    #: the answer, once :attr:`done` is set and :attr:`answered`
    value: _V | None = None
    #: False when the call did not end with an answer (its asker was cancelled, or
    #: it raised): the askers sharing it ask again
    answered: bool = False
    started: bool = False


class FreshCalls(Generic[_K, _V]):
    """Shares calls per key among concurrent askers (trio thread only).

    :meth:`ask` returns the value of a call that began after :meth:`ask` was
    entered, so an answer is never older than the question it answers.
    """

    def __init__(self) -> None:
        #: the round whose call runs now, per key
        self._running: dict[_K, _Round[_V]] = {}
        #: the round the askers that came during the running one share, per key
        self._next: dict[_K, _Round[_V]] = {}
        #: calls made (for tests and status)
        self.calls = 0

    async def ask(self, key: _K, call: Callable[[], Awaitable[_V]]) -> _V:
        """The value of ``call()`` (or of another asker's call for ``key``, begun after
        this asker came). Raises what ``call`` raises when this asker ran it; an
        asker whose shared call did not answer (its runner was cancelled, or it
        raised) asks again."""
        while True:
            running = self._running.get(key)
            if running is None:
                mine = self._next.pop(key, None) or _Round()
                return await self._run(key, mine, call)
            # begun before this asker came: wait for it, then share the next round
            nxt = self._next.setdefault(key, _Round())
            await running.done.wait()
            if nxt.started:
                await nxt.done.wait()
                if nxt.answered:
                    return nxt.value  # type: ignore[return-value]
                continue
            if self._running.get(key) is None:
                if self._next.get(key) is nxt:
                    del self._next[key]
                return await self._run(key, nxt, call)

    async def _run(self, key: _K, rnd: _Round[_V], call: Callable[[], Awaitable[_V]]) -> _V:
        rnd.started = True
        self._running[key] = rnd
        self.calls += 1
        try:
            value = await call()
            rnd.value, rnd.answered = value, True
            return value
        finally:
            if self._running.get(key) is rnd:
                del self._running[key]
            rnd.done.set()
