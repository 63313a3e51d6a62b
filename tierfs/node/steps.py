"""What the node agent knows of the steps in the client's view, and its state file.

One :class:`StepBook` is shared by the agent's parts (intake, sealer, keeper,
restore driver, status): the step names in the view, the seal candidates
waiting, the seals a write withdrew, the inodes being sealed and the
per-entry change counters. :meth:`StepBook.save` and :meth:`StepBook.load`
keep the part of it a restarted daemon needs in ``state.json``
(:mod:`tierfs.node.statefile`).

Concurrency: ``generation``, ``dirty_inos``, ``sealing_inos`` and
``sealed_inos`` are read or written on the FUSE thread (single dict or set
operations); everything else only on the trio thread.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable

from tierfs.core.control import JobSpec
from tierfs.fuse.namespace import Namespace
from tierfs.node import statefile
from tierfs.node.jobstate import JobState
from tierfs.node.resave import CutShort, EarlierSave, SeenPart
from tierfs.node.sealing import SealCandidate, SealRules
from tierfs.node.view import ClientView
from tierfs.store.manifest import CrcCache
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import ShardKey

__all__ = ["StepBook", "top_of"]


def top_of(path: str) -> str:
    """The top-level entry of a view-relative ``path`` (``"10/a/b"`` -> ``"10"``)."""
    return path.split("/", 1)[0]


class StepBook:
    """The agent's bookkeeping of steps (plain data, no I/O but :meth:`save`/:meth:`load`).

    Args:
        store: the RAM store (``state.json``'s place, the view directory).
        state: the running job (its mode, job and restore state are saved).
        view: the client view (its published markers are saved).
        sealed_inos: inode -> sealed shard, the catalog's map (the FUSE thread
            reads it to withdraw a seal on a write).

    Attributes:
        ns: the namespace once the agent is attached to it (None before): the
            sealer asks it for open writers, the status for passthrough.
        view_steps: view entry name -> the shard it is the step of.
        pending: seal candidates by entry name, waiting to be sealed.
        pending_at_start: seal candidates the previous daemon had not acted on.
        withdrawn_names: entry name -> shard whose seal a write withdrew.
        withdrawn_created: first seal time (Unix seconds) of a withdrawn step,
            kept when it is sealed again.
        earlier: this node's part of a step -> the parts of an earlier save its next
            seal replaces (:mod:`tierfs.node.resave`; saved in ``state.json`` with
            ``withdrawn_created``).
        abandoned: entry name -> this node's step a restore abandoned (a newer step
            than the one restored): not sealed again at a daemon start, until the
            client saves it again (saved in ``state.json``).
        sealing_inos: inode -> token of the seal snapshotting it right now.
        dirty_inos: inodes opened for writing while being sealed.
        generation: top-level entry -> count of changes under it.
        sealed_gens: entry name -> the :attr:`generation` of each top-level entry its
            last seal took (a candidate of an unchanged entry is that seal again).
        cut_short: this node's parts last sealed with files of an earlier save of
            their step (:class:`tierfs.node.resave.CutShort`; not kept across
            daemon restarts).
        crc_cache: crc32c of unchanged files, shared by the seals.
        rules: the job's seal rules (None without a job).
    """

    def __init__(
        self,
        store: RamStore,
        state: JobState,
        view: ClientView,
        sealed_inos: dict[int, ShardKey],
    ) -> None:
        self.store = store
        self.state = state
        self.view = view
        self.ns: Namespace | None = None
        self.sealed_inos = sealed_inos
        self.sealing_inos: dict[int, str] = {}
        self.dirty_inos: set[int] = set()
        self.generation: collections.Counter[str] = collections.Counter()
        self.sealed_gens: dict[str, dict[str, int]] = {}
        self.view_steps: dict[str, ShardKey] = {}
        self.pending: dict[str, SealCandidate] = {}
        self.pending_at_start: list[SealCandidate] = []
        self.withdrawn_names: dict[str, ShardKey] = {}
        self.withdrawn_created: dict[ShardKey, float] = {}
        self.earlier: dict[ShardKey, EarlierSave] = {}
        self.cut_short: dict[ShardKey, CutShort] = {}
        #: this node's parts shown in the view -> their seal time (Unix seconds)
        self.sealed_times: dict[ShardKey, float] = {}
        self.abandoned: dict[str, ShardKey] = {}
        self.crc_cache: CrcCache = {}
        self.rules: SealRules | None = None
        #: (step, node count) -> the other ranks' parts of that step the whole-step
        #: view shows (set by the composition root; trio thread): what a new save of
        #: the step replaces (:mod:`tierfs.node.resave`, tenth #16 trial FAIL A)
        self.shown: Callable[[int, int], list[SeenPart]] = lambda step, nodes: []
        #: (step, since) -> (node rank, digest) of the other ranks' parts of that step
        #: whose files the client opened at or after ``since`` (Unix seconds; set by
        #: the composition root, :meth:`tierfs.node.remote_view.RemoteView.read_parts`)
        self.read_parts: Callable[[int, float], list[tuple[int, str]]] = lambda step, since: []

    def resaving(self, key: ShardKey) -> bool:
        """True while this node's part ``key`` is withdrawn by a write of its client
        and not sealed again yet (trio thread)."""
        return key in self.withdrawn_names.values()

    def new_save(self, step: int) -> tuple[float, float] | None:
        """(cutoff, began) when a write began another save of this node's part of
        ``step`` and it is not sealed yet (:class:`tierfs.node.resave.EarlierSave`:
        the former part's seal time and the save's start, Unix seconds), else None."""
        job = self.state.job
        if job is None:
            return None
        earlier = self.earlier.get(ShardKey(job.name, job.node_rank, step))
        if earlier is None or earlier.cutoff <= 0:
            return None
        return earlier.cutoff, earlier.began

    def own_replaced(self, step: int) -> frozenset[tuple[int, str]]:
        """(node rank, digest) of this node's own parts of ``step`` that the save being
        written replaces (withdrawn or sealed again since its last seal by this
        daemon; not the older parts they replaced in turn), empty when no save of it
        is being written."""
        job = self.state.job
        if job is None:
            return frozenset()
        earlier = self.earlier.get(ShardKey(job.name, job.node_rank, step))
        if earlier is None:
            return frozenset()
        return frozenset((m.rank, m.digest) for m in earlier.own)

    def is_abandoned(self, step: int) -> bool:
        """True if a restore abandoned this node's own part of ``step`` of the running
        job and it was not saved again since (:attr:`abandoned`)."""
        job = self.state.job
        return job is not None and any(
            k.job == job.name and k.rank == job.node_rank and k.step == step
            for k in self.abandoned.values()
        )

    def names_of(self, key: ShardKey) -> list[str]:
        """The view entry names that are the step ``key`` (usually one)."""
        return [n for n, k in self.view_steps.items() if k == key]

    def save(self) -> None:
        """Write ``state.json`` (blocking file I/O, small; trio thread)."""
        statefile.save(
            self.store.store,
            statefile.SavedState(
                mode=self.state.mode,
                job=self.state.job,
                view_steps=self.view_steps,
                published=self.view.published,
                restore=self.state.restore_state,
                pending=list(self.pending.values()),
                abandoned=self.abandoned,
                withdrawn=dict(self.withdrawn_created),
                earlier=dict(self.earlier),
                sealed=dict(self.sealed_times),
            ),
        )

    def load(self) -> JobSpec | None:
        """Read ``state.json``: the view steps still in the view, the published markers,
        the restore state and the pending candidates. Returns the saved protocol-mode
        job (the caller sets it), or None."""
        saved = statefile.load(self.store.state_file)
        self.view_steps.clear()
        self.view_steps.update(
            {
                n: k
                for n, k in saved.view_steps.items()
                if os.path.lexists(os.path.join(self.store.view, n))
            }
        )
        self.view.published.update(saved.published)
        self.state.restore_state = saved.restore
        self.pending_at_start = saved.pending
        self.abandoned = {
            n: k
            for n, k in saved.abandoned.items()
            if os.path.lexists(os.path.join(self.store.view, n))
        }
        # a seal a write withdrew, its step still in the view: sealed again at start
        # with its first seal time and what it replaces (issue #16 F9)
        shown = set(self.view_steps.values())
        self.withdrawn_created = {k: t for k, t in saved.withdrawn.items() if k in shown}
        self.withdrawn_names = {
            n: k for n, k in self.view_steps.items() if k in self.withdrawn_created
        }
        self.earlier = {
            k: e for k, e in saved.earlier.items() if k in shown or k in self.abandoned.values()
        }
        self.sealed_times = {k: t for k, t in saved.sealed.items() if k in shown}
        return saved.job
