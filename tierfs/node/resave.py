"""Which parts of an earlier save a new save of the same step replaces (pure; issue #16 F9).

A job may save one step number again in place (DCP ``dcp.save`` into the
same directory after a restore, a loop that overwrites a step). Parts of one
step number at one node count then come from different saves, and nothing in
their bytes says which save a part belongs to: a node lost before its new part
was replicated leaves only its *old* part, and a restore combining it with the
survivors' new parts returns a mix of two saves (the fourth #16 trial's F9:
exit 0, ``dcp.load`` returned rank 2's values of the first save).

So every seal records what it replaced
(:attr:`tierfs.store.manifest.Manifest.replaces`):

* the node's own former part of the step (always: those bytes are gone from
  the client's view), and what that part replaced in turn;
* when the seal was withdrawn by a write into a file sealed at least
  :data:`RESAVE_GAP` seconds before (the node began *another save*, not a
  late write of the same save), the other ranks' parts of the step it held
  then and holds at the seal, except those whose writer began its save after
  this node's former part was sealed (a part of the new save that arrived
  early), and the same of the other ranks' parts its whole-step view showed
  then and shows at the seal (:class:`SeenPart`; tenth #16 trial FAIL A: with
  ``--peers-per-node 0`` no node holds another rank's part, and a restart
  before node-rank 0's verdict restored a rank's earlier part beside the
  others' new ones);
* the parts a restore abandoned (a save of the step in the new history
  replaces them).

The restore (:mod:`tierfs.cluster.restore_choice`) never uses a copy some
part of the same step lists as replaced, unless a copy of those very bytes
lists them itself (the rank saved identical bytes again). Only written files
withdraw a seal: a file added to a sealed step (DCP's ``.metadata`` renamed
in after the data files) seals again without starting a new save.

Clocks: :attr:`Manifest.began` is the writer's clock and is compared with
this node's seal times; the margin is a training interval (two saves of a
step are :data:`RESAVE_GAP` or more apart), far above the skew of NTP clocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierfs.store.manifest import Manifest
from tierfs.store.saves import RESAVE_GAP, sealed_at

__all__ = [
    "MAX_REPLACED",
    "RESAVE_GAP",
    "CutShort",
    "EarlierSave",
    "SeenPart",
    "not_rewritten",
    "replaced_pairs",
    "sealed_at",
]

#: at most this many (rank, digest) pairs a manifest records as replaced
MAX_REPLACED = 256


@dataclass(frozen=True, slots=True)
class SeenPart:
    """Another rank's part of a step as this node's whole-step view shows it: node rank
    ``rank``, manifest ``digest``, ``began`` (the writer's :attr:`Manifest.began`,
    Unix seconds; 0.0 a first save) and ``sealed`` (when it was sealed, Unix seconds;
    0.0 unknown)."""

    rank: int
    digest: str
    began: float
    sealed: float = 0.0


#: the part of :data:`RESAVE_GAP` (1 s of 10 s) before this node began its new save by
#: which another rank's first save of the step (``began`` 0) must have been sealed to
#: count as of the earlier save: the parts of one save are sealed within a second or
#: two of each other, and a new save begins at least RESAVE_GAP after the earlier one
FIRST_SAVE_SLACK = 0.1


def _of_earlier_save(began: float, sealed: float, save: EarlierSave) -> bool:
    """Whether another rank's part (its save ``began``, ``sealed``, Unix seconds) is of
    the save this node's new one replaces: its save began by :attr:`EarlierSave.cutoff`;
    a first save (``began`` 0, its start unknown) by its seal: sealed by the cutoff,
    or more than :data:`FIRST_SAVE_SLACK` × :data:`RESAVE_GAP` s before this node began
    the new save.

    Regression (#14 trial 57 H1): rank 0 was killed before ``.metadata``; DCP retried
    the save at once. Node 0 had never sealed a part of the step, so its part of the
    retry was a first save (``began`` 0) and node 1, sealing its own (200 MB) part of
    the retry after it, listed it as replaced: every node then refused rank 0's new
    part "of an earlier save" and ``dcp.load`` failed although the save succeeded."""
    if began > 0:
        return began <= save.cutoff
    if sealed <= 0 or sealed <= save.cutoff:
        return True
    return save.began > 0 and sealed < save.began - FIRST_SAVE_SLACK * RESAVE_GAP


@dataclass
class EarlierSave:
    """What the next seal of one of this node's parts replaces.

    Attributes:
        began: when this node began the save being sealed (Unix seconds; 0.0: a
            first save, or unknown).
        cutoff: the seal time of the own part a new save withdrew (Unix seconds):
            held parts of other ranks whose save began after it are of the new
            save; 0.0: record no held parts (no new save began).
        own: this node's former parts of the step (withdrawn or sealed again).
        held: other ranks' parts of the step held when the new save began.
        seen: other ranks' parts of the step the whole-step view showed then.
        abandoned: parts of the step a restore abandoned.
        read: (node rank, manifest digest) of the other ranks' parts whose files this
            node's client opened after its former part was sealed and before it
            wrote that part again (a load between two saves): of the earlier save.
        recorded: (node rank, manifest digest) pairs a previous daemon had gathered
            (``state.json``, :meth:`to_dict`): replaced as well.
        former_files: file paths of this node's former parts a previous daemon knew.
    """

    began: float = 0.0
    cutoff: float = 0.0
    own: list[Manifest] = field(default_factory=list)
    held: list[Manifest] = field(default_factory=list)
    seen: list[SeenPart] = field(default_factory=list)
    abandoned: list[Manifest] = field(default_factory=list)
    read: list[tuple[int, str]] = field(default_factory=list)
    recorded: list[tuple[int, str]] = field(default_factory=list)
    former_files: list[str] = field(default_factory=list)

    def files(self) -> list[str]:
        """The file paths of this node's former parts (those withdrawn or sealed
        again, and those a previous daemon knew)."""
        return list(
            dict.fromkeys([*(f.path for m in self.own for f in m.files), *self.former_files])
        )

    def to_dict(self) -> dict[str, Any]:
        """The record for ``state.json``: a daemon restarted between the write that
        began the save and its seal still records what the seal replaces (the held
        parts already filtered by :attr:`cutoff`). Computes manifest digests (reads
        every file entry). Plain JSON types."""
        return {
            "began": self.began,
            "cutoff": self.cutoff,
            "replaces": [list(p) for p in replaced_pairs(self)],
            "files": self.files(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EarlierSave:
        """The record :meth:`to_dict` wrote. Raises ``ValueError``, ``TypeError`` or
        ``KeyError`` on a malformed one."""
        return cls(
            began=float(d["began"]),
            cutoff=float(d["cutoff"]),
            recorded=[(int(r), str(g)) for r, g in d.get("replaces", ())],
            former_files=[str(f) for f in d.get("files", ())],
        )

    def withdrawn(
        self,
        own: Manifest,
        held: Iterable[Manifest],
        now: float,
        seen: Iterable[SeenPart] = (),
        read: Iterable[tuple[int, str]] = (),
    ) -> None:
        """A write withdrew this node's part ``own`` at ``now`` (Unix seconds);
        ``held``: the other ranks' parts of the step (same node count) held here;
        ``seen``: those the whole-step view shows (same node count); ``read``: (node
        rank, digest) of the other ranks' parts whose files the client opened since
        ``own`` was sealed.

        The write begins another save when ``own`` was sealed at least
        :data:`RESAVE_GAP` s before, or when the client read other ranks' files of
        the step since (a save, a load, a save again at once: the parts read are of
        the earlier save; #14 trial 55 F3: another node's load right after returned
        the earlier save's values of other ranks, with no error). Otherwise it is a
        late write of the same save."""
        self.own.append(own)
        others = [p for p in read if p[0] != own.rank]
        if others or now - sealed_at(own) >= RESAVE_GAP:
            self.began = self.began or now
            self.cutoff = max(self.cutoff, sealed_at(own))
            self.held.extend(m for m in held if m.rank != own.rank)
            self.seen.extend(p for p in seen if p.rank != own.rank)
            self.read.extend(p for p in others if p not in self.read)
        else:
            self.began = self.began or own.began

    def resealed(self, own: Manifest) -> None:
        """This node's part ``own`` is sealed again without a withdraw (a file added):
        the same save goes on."""
        self.own.append(own)
        self.began = self.began or own.began


def replaced_pairs(
    save: EarlierSave, held_now: Iterable[Manifest] = (), seen_now: Iterable[SeenPart] = ()
) -> tuple[tuple[int, str], ...]:
    """The (node rank, manifest digest) pairs the next seal records as replaced (see
    the module doc): ``held_now`` are the parts of the step held at the seal and
    ``seen_now`` those the whole-step view shows then (this node's own rank among
    them is left out). At most :data:`MAX_REPLACED`: this node's own former parts,
    those recorded before a restart, the held and the abandoned parts first, then
    the parts the view showed, nearest ranks after this node's own first (on a ring
    of the node count: in a job of more than ``MAX_REPLACED`` nodes each node lists
    another window of ranks, so every rank's earlier part is listed by about that
    many nodes), then what this node's former parts listed. Reads every file entry
    of the manifests (their digests): call it from a worker thread for large ones."""
    out: dict[tuple[int, str], None] = {}
    for m in reversed(save.own):
        out.setdefault((m.rank, m.digest), None)
    for pair in save.recorded:
        out.setdefault(pair, None)
    own_ranks = {m.rank for m in save.own}
    if save.cutoff > 0:
        for m in [*save.held, *held_now]:
            if m.rank not in own_ranks and _of_earlier_save(m.began, sealed_at(m), save):
                out.setdefault((m.rank, m.digest), None)
        for pair in save.read:
            if len(out) >= MAX_REPLACED:
                break
            out.setdefault(pair, None)
    for m in save.abandoned:
        out.setdefault((m.rank, m.digest), None)
    if save.cutoff > 0 and save.own:
        me = save.own[-1]
        ring = max(me.nodes, 1 + max((p.rank for p in [*save.seen, *seen_now]), default=0))
        seen = sorted(
            (
                p
                for p in [*save.seen, *seen_now]
                if p.rank not in own_ranks and _of_earlier_save(p.began, p.sealed, save)
            ),
            key=lambda p: ((p.rank - me.rank) % ring, p.rank),
        )
        for p in seen:
            if len(out) >= MAX_REPLACED:
                break
            out.setdefault((p.rank, p.digest), None)
    for m in reversed(save.own):
        for pair in m.replaces:
            out.setdefault(pair, None)
    return tuple(list(out)[:MAX_REPLACED])


#: seconds a file's modification time may lie before the moment it was written (tmpfs
#: takes the coarse clock, one scheduler tick behind)
MTIME_SLACK = 0.02


@dataclass(frozen=True)
class CutShort:
    """A part sealed with files of an earlier save of its step (a save cut short).

    Attributes:
        began: when this node began the save the part is of (Unix seconds).
        files: the names of the files of the earlier save it was sealed with.
    """

    began: float
    files: frozenset[str]


def not_rewritten(
    mtimes: Mapping[str, float], began: float, cut: CutShort | None = None
) -> list[str]:
    """The names in ``mtimes`` (a node's own data files of one save kind, e.g. DCP's
    ``__<rank>_0.distcp``, name -> modification time in Unix seconds) not written
    since ``began`` (when the node began saving the step again) while another was:
    a part of them would mix two saves. Empty when none or all were written (pure).

    ``cut``: the node's part last sealed was of a save cut short (sealed with files
    of the save before). When only those missing files were written since ``began``,
    the save cut short goes on (a rank late by more than the rank grace), and the
    files are judged against its start instead: a late rank never turns its
    node's files of the same save into an "earlier save".
    """

    def stale_since(since: float) -> tuple[list[str], list[str]]:
        old = sorted(n for n, t in mtimes.items() if t < since - MTIME_SLACK)
        return old, [n for n in mtimes if n not in old]

    stale, fresh = stale_since(began)
    if cut is not None and cut.began < began and fresh and set(fresh) <= cut.files:
        stale, fresh = stale_since(cut.began)
    return stale if fresh else []
