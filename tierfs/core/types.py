"""Value types several planes share (restore, replication, backup, the coordinator).

Plain frozen data, no behaviour beyond small pure helpers, no I/O: the
modules that act on them (:mod:`tierfs.cluster.restore_choice`,
:mod:`tierfs.cluster.backup_schedule`, :mod:`tierfs.cluster.coordinator`,
:mod:`tierfs.replication`, :mod:`tierfs.backup`, :mod:`tierfs.node`) import
them from here, so no plane imports another for a type (issue #12).

* restore: :class:`Holding` (one shard of a node's inventory), :data:`CopyId`,
  :class:`BucketPart`/:class:`BucketView` (what the bucket holds), the
  outcomes :data:`RESTORED`/:data:`OLDER`/:data:`FRESH`/:data:`INCOMPLETE`, and
  :class:`RestorePlan` (what a node restores, from where);
* backup rounds: :class:`Outcome` (a node's report of its part),
  :class:`RoundView` (a round as the coordinator describes it) and their states;
* the coordinator's wire constants :data:`COORDINATOR_RANK`, :data:`NO_STEP`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierfs.store.shards import Shard

#: node-rank that runs the coordinator
COORDINATOR_RANK = 0
#: ``step`` on the wire for "nothing to restore" / "no step yet"
NO_STEP = -1

# ---------------------------------------------------------------------- restore

#: outcomes of a restore decision: the newest step was restored; an older one,
#: as newer steps could not be (the problems say why); nothing exists anywhere;
#: something exists but no step is complete
RESTORED, OLDER, FRESH, INCOMPLETE = "restored", "older", "fresh", "incomplete"

#: a copy's holder: a node rank (RAM) or a backup round name (the bucket)
Holder = int | str
#: (holder, shard rank, step): one copy of one shard
CopyId = tuple[Holder, int, int]


@dataclass(frozen=True, order=True)
class Holding:
    """One shard in a node's inventory.

    Attributes:
        rank: the node rank whose data it is.
        step: the step.
        verified: its checksums were verified by the holding daemon.
        digest: :attr:`tierfs.store.manifest.Manifest.digest` (equal: identical bytes).
        bytes: its size in bytes.
        name: its primary top-level entry.
        backup_requested: the step carries ``_BACKUP_REQUESTED`` (back it up at once).
        created: Unix time (seconds) of its seal (0.0: unknown).
        unloadable: why the step can never load (a damaged file, an unfinished
            save: :func:`tierfs.store.verdicts.eligibility`), "" if nothing.
        missing: a file this part lacks or cannot read that another rank's
            part may bring ("" if none); as bad as ``unloadable`` in a one-node job.
        whole_digests: the step judged over every rank's part
            (:mod:`tierfs.node.whole_step`): the digest of each rank's part
            judged, by rank; () when not judged by this holder.
        whole_unloadable: why those parts together can never load ("" if
            they may; only meaningful with ``whole_digests``).
        nodes: the node count of the job that wrote the step (its writer
            topology, :attr:`tierfs.store.manifest.Manifest.nodes`); 0 unknown.
        replaces: (rank, digest) of the parts of an earlier save of the step that
            this part's save replaced (:attr:`tierfs.store.manifest.Manifest.replaces`).
    """

    rank: int
    step: int
    verified: bool
    digest: str
    bytes: int = 0
    name: str = ""
    backup_requested: bool = False
    created: float = 0.0
    unloadable: str = ""
    missing: str = ""
    whole_digests: tuple[str, ...] = ()
    whole_unloadable: str = ""
    nodes: int = 0
    replaces: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class WholeVerdict:
    """A step judged over every rank's part (issue #15, :mod:`tierfs.node.whole_step`).

    Attributes:
        digests: the manifest digest of each rank's part judged, by rank (its
            length is the job's node count).
        unloadable: why these parts together can never load, "" if they may.
        format: the detected formats (``"dcp"``...).
        unread: a file whose bytes the judge needed but another node holds
            (judged by its size only), "" if none; only when ``unloadable`` is "".
    """

    digests: tuple[str, ...]
    unloadable: str
    format: str = "unknown"
    unread: str = ""


@dataclass(frozen=True)
class BucketPart:
    """One node's complete part of one step in one backup round.

    Attributes:
        round: the round name (``YYYY-MM-DD_HH-MM``).
        digest: the part's manifest digest; "" when unknown (a round written by MTC).
        unloadable, missing: the part's seal-time verdict as its uploaded
            manifest records it (see :class:`Holding`); "" when it has none.
        nodes: the writer topology its manifest records (see :class:`Holding`);
            0 unknown (a round written by MTC or before it was recorded).
        replaces: the parts its save replaced, as its manifest records them (see
            :class:`Holding`).
    """

    round: str
    rank: int
    step: int
    digest: str = ""
    unloadable: str = ""
    missing: str = ""
    nodes: int = 0
    replaces: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class BucketView:
    """What the bucket holds for a job, as read for one restore round.

    Attributes:
        parts: every complete node part of the rounds read.
        incomplete: (round, its newest step or None, why) for each round read that
            holds something but no step complete for every node.
        rounds: the round names read, newest first.
        exhausted: every round of the job was read.
        error: the bucket could not be read (one line); nothing else is set then.
        forced: the round ``restore.version`` names, or None.
        forced_step: that round's step complete for every node, or None.
        forced_problem: why that round cannot be restored (missing, incomplete).
        depth: how many complete rounds the reader looked for.
        judged: (step, verdict) of each round's complete step written by several
            nodes, judged over every rank's uploaded part
            (:mod:`tierfs.backup.round_verdict`): node-rank 0's own verdict
            across ranks lives in its RAM, lost with it (issue #15).
    """

    parts: tuple[BucketPart, ...] = ()
    incomplete: tuple[tuple[str, int | None, str], ...] = ()
    rounds: tuple[str, ...] = ()
    exhausted: bool = True
    error: str | None = None
    forced: str | None = None
    forced_step: int | None = None
    forced_problem: str | None = None
    depth: int = 1
    judged: tuple[tuple[int, WholeVerdict], ...] = ()

    def floor(self, nodes: int) -> int | None:
        """The oldest step complete for its writers among the rounds read (the rounds
        not read are older, so they cannot hold a newer complete step); None if none.

        ``nodes``: the job's node count, the writer count of a part that records none."""
        by_round: dict[tuple[str, int, int], set[int]] = {}
        for p in self.parts:
            by_round.setdefault((p.round, p.step, p.nodes or nodes), set()).add(p.rank)
        steps = [s for (_r, s, w), ranks in by_round.items() if ranks >= set(range(w))]
        return min(steps) if steps else None

    def holds_anything(self) -> bool:
        """The bucket holds something of the job (a round, a part, restore.version)."""
        return bool(self.parts or self.incomplete or self.rounds or self.forced)

    def problems_above(self, step: int | None) -> list[str]:
        """Why the rounds read holding a newer step than ``step`` (None: any) are unusable."""
        return [
            f"backup round {name}{f' (step {s})' if s is not None else ''} is incomplete: {why}"
            for name, s, why in self.incomplete
            if step is None or s is None or s > step
        ]


@dataclass
class RestorePlan:
    """What the cluster decided for this node.

    Attributes:
        step: the step every node restores, or None for "nothing".
        backup: the GCS round name when the data comes from the bucket.
        shard: this node's local shard for ``step`` once fetched.
        source: where this node's data came from (``local``, ``peer:<rank>``, ``gcs``).
        detail: ``reason`` (one line), ``outcome`` (:data:`RESTORED`, :data:`FRESH`,
            :data:`INCOMPLETE`), ``problems`` (lines for ``replicator.errors``) and
            ``forced`` (the ``restore.version`` round, or None).
        writers: the node count that wrote ``step`` (issue #16; 0 unknown). A
            node whose rank is not below it holds no part of the step: its plan
            has ``step`` set, no ``shard`` and ``source`` ``"none"``.
    """

    step: int | None
    backup: str | None = None
    shard: Shard | None = None
    source: str = "local"
    detail: dict[str, Any] = field(default_factory=dict)
    writers: int = 0


# ---------------------------------------------------------------------- backup rounds

#: the words of a restore problem saying that the step restored is an older save of its
#: step number (:func:`tierfs.cluster.restore_choice.choose_restore`; ``tierfs wait``
#: makes that line its warning)
SAVED_AGAIN = " was saved again by "

DONE, FAILED = "done", "failed"
#: an outcome meaning "this node no longer holds the ordered step" (the round
#: moves to a newer step instead of failing)
MISSING = "missing"
#: states of a backup round (:class:`RoundView`); an incomplete round is
#: :data:`INCOMPLETE`, the same word as the restore outcome
RUNNING, COMPLETE = "running", "complete"


@dataclass(frozen=True)
class Outcome:
    """One node's report of its part of a round (``SyncRequest.backup`` on the wire).

    Attributes:
        round: the round name.
        step: the step the node uploaded (or tried to).
        state: :data:`DONE`, :data:`FAILED` or :data:`MISSING` (the node no
            longer holds ``step``).
        error: one human line for a failure.
        bytes: data bytes uploaded.
        seconds: how long the upload took.
        digest: the manifest digest of the part uploaded (:data:`DONE`; "" when
            not known): the bytes the round actually took.
    """

    round: str
    step: int
    state: str
    error: str = ""
    bytes: int = 0
    seconds: float = 0.0
    digest: str = ""


@dataclass(frozen=True)
class RoundView:
    """A round as the coordinator tells the nodes about it.

    Attributes:
        round: the round name.
        step: the step it backs up.
        state: :data:`RUNNING`, :data:`COMPLETE` or :data:`INCOMPLETE`.
    """

    round: str
    step: int
    state: str
