"""Which step directories the job's nodes are saving now (pure; issue #14).

Stock ``torch.distributed.checkpoint`` runs ``dcp.save``, a barrier and
``dcp.load`` on every rank. The coordinator rank writes ``.metadata`` last,
after its own data files; a node whose own files were written long before (the
coordinator rank had much more to write, #14 trial 54 F2) must keep a lookup of
``.metadata`` waiting while that save goes on, not only for a fixed window after
its own writes (:mod:`tierfs.node.dcp_expect`). Every heartbeat brings the step
directories a node is saving (a file in it open for writing, or its seal still to
come); node-rank 0's coordinator keeps the last report of each rank and answers
every heartbeat with the directories the *other* nodes reported within
:data:`SAVING_FRESH` seconds.

A report only ever makes a lookup wait longer (bounded by
:data:`tierfs.node.remote_view.SAVING_MAX`); no report shortens a wait, so a
late or lost heartbeat costs at most the fixed window of before.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MAX_NAMES", "SAVING_FRESH", "Savers"]

#: seconds a node's report stays good: about two heartbeats (one through a group
#: leader's batch); a node silent for longer is not taken as saving any more
SAVING_FRESH = 3.0
#: names kept per report (a node saves one or two steps at a time; a longer list is
#: cut, never refused)
MAX_NAMES = 16


class Savers:
    """The step directories each rank last reported saving, with when (the caller's
    clock, seconds). Not thread-safe: the coordinator's servicer calls it under its lock.
    """

    def __init__(self, fresh: float = SAVING_FRESH) -> None:
        self.fresh = fresh
        #: rank -> (names, when reported)
        self._reports: dict[int, tuple[frozenset[str], float]] = {}
        #: name -> ranks that reported it in their last report
        self._by_name: dict[str, set[int]] = {}

    def report(self, rank: int, names: Iterable[str], now: float) -> None:
        """Rank ``rank``'s heartbeat at ``now`` says it is saving ``names`` (replacing
        its previous report; empty: none)."""
        new = frozenset(list(names)[:MAX_NAMES])
        old = self._reports.get(rank)
        if old is not None:
            for name in old[0] - new:
                ranks = self._by_name.get(name)
                if ranks is not None:
                    ranks.discard(rank)
                    if not ranks:
                        del self._by_name[name]
        for name in new:
            self._by_name.setdefault(name, set()).add(rank)
        if new:
            self._reports[rank] = (new, now)
        else:
            self._reports.pop(rank, None)

    def others(self, rank: int, now: float) -> list[str]:
        """The names (sorted) some rank other than ``rank`` reported saving within
        :attr:`fresh` seconds before ``now``. O(names reported)."""
        out = []
        for name, ranks in self._by_name.items():
            for r in ranks:
                if r != rank and now - self._reports[r][1] <= self.fresh:
                    out.append(name)
                    break
        return sorted(out)

    def clear(self) -> None:
        """Forget every report (a new job or generation)."""
        self._reports.clear()
        self._by_name.clear()
