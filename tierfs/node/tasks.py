"""Background tasks of the node agent whose failure is logged, never fatal.

The agent's parts start work (a seal, a restore, a view entry hidden later)
as tasks in the agent's nursery. A task that raises is logged and its error
line reaches the node's status; the daemon keeps running.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["TaskSpawner"]

log = logging.getLogger(__name__)


class TaskSpawner:
    """Starts guarded tasks in the agent's nursery (trio thread).

    Args:
        errors: the node's last problem lines (the reporter's deque); a failed
            task appends ``internal error in <name>: <exception>``.

    Attributes:
        nursery: the nursery tasks start in; set by :meth:`NodeAgent.run
            <tierfs.node.agent.NodeAgent.run>` when it opens it. Before that
            :meth:`spawn` does nothing (no loop runs yet).
    """

    def __init__(self, errors: collections.deque[str]) -> None:
        self.errors = errors
        self.nursery: trio.Nursery | None = None

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Run ``fn(*args)`` as a task whose failure is logged, never fatal to the daemon."""
        if self.nursery is not None:
            self.nursery.start_soon(self._guarded, fn, args, name=getattr(fn, "__name__", fn))

    async def _guarded(self, fn: Callable[..., Awaitable[object]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception as exc:
            log.exception("%s failed", getattr(fn, "__name__", fn))
            self.errors.append(f"internal error in {getattr(fn, '__name__', fn)}: {exc}")
