"""Whether the work a trio task does now is waited for by a reader (issue #14).

A whole-step view fetches other ranks' files for two kinds of callers: a
reader's ``open()`` that waits for the bytes, and the background prefetch
after a restore. The view sets :data:`fetch_urgent` in the task that runs a
fetch (trio tasks inherit the context of the task that starts them); the peer
tier's file-fetch lane (:class:`tierfs.replication.lanes.PriorityLane`) reads
it to give a waiting reader the next free slot before any prefetch, and
:data:`fetch_hold` to pause a prefetch's transfer between chunks while a reader
waits for another file (the two would otherwise share the bandwidth), and
:data:`fetch_pause` to pause any transfer, a reader's too, while this node's own
save needs the room the fetches would write into (#14 trial 46 FAIL 6).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable


def _always() -> bool:
    return True


#: ``fetch_urgent.get()()`` is True while the current task's fetch is waited for by a
#: reader (a callable: a prefetch a reader then opens becomes urgent on the way).
#: Default: urgent (any caller that does not say otherwise waits for its bytes).
fetch_urgent: contextvars.ContextVar[Callable[[], bool]] = contextvars.ContextVar(
    "fetch_urgent", default=_always
)


def _never() -> bool:
    return False


#: ``fetch_hold.get()()`` is True while the current task's fetch should pause between
#: chunks (a reader waits for another file); any thread may call it. Default: never.
fetch_hold: contextvars.ContextVar[Callable[[], bool]] = contextvars.ContextVar(
    "fetch_hold", default=_never
)


#: ``fetch_pause.get()()`` is True while the current task's fetch should pause between
#: chunks whoever waits for it (this node's save needs the room it would write
#: into); unlike :data:`fetch_hold`, a reader waiting for a lane slot does not lift
#: it (the reader's own fetch would pause as well). Any thread may call it.
#: Default: never.
fetch_pause: contextvars.ContextVar[Callable[[], bool]] = contextvars.ContextVar(
    "fetch_pause", default=_never
)
