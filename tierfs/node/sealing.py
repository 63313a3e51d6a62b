"""Which names and events seal a step (PROTOCOL.md section 3, plus generic mode).

Pure policy: the node agent feeds namespace events (rename, release of a
writable handle, removal) and answers questions about the view through a
:class:`ViewProbe`; the rules answer with a :class:`SealCandidate` or None.

Framework rules:

* ``orbax``: a top-level directory renamed to an all-digit name
  (``<step>.orbax-checkpoint-tmp`` -> ``<step>``). Renaming a symlink (a client
  consuming a restore marker) is not a save.
* ``pytorch.distributed``: the same, plus the NeMo finalize of a synchronous
  save: ``step=<N>-unfinished`` removed while ``step=<N>/`` exists.
* ``pytorch``: ``<job>-s<step>-n<rank>-w<w>.save`` files; the step is complete
  once ``workers-per-node`` of them are closed.
* ``generic`` (no control file): a top-level directory renamed into a name
  matching a seal pattern; or a marker file appearing inside such a
  directory (``commit_success.txt``, DCP's ``.metadata``, and the Hugging
  Face Trainer's ``trainer_state.json``, which ``Trainer._save_checkpoint``
  writes after the model, optimizer, scheduler and RNG files of a
  ``checkpoint-<N>`` it saves in place, without a rename; a file added later
  seals the step again); or a tracker file
  naming the directory (Megatron ``latest_checkpointed_iteration.txt``,
  DeepSpeed ``latest``); or NeMo's ``-unfinished`` removal; or, on a node
  without DCP's global rank 0, a ``__<rank>_<i>.distcp`` file closed in such
  a directory: only rank 0 writes ``.metadata``, so the other nodes' parts
  have no marker of their own (issue #15 item 2); the part's verdict says
  it needs another rank's part, and the step is complete once rank 0's
  ``.metadata`` names only files some rank holds.

Temp names (``*.orbax-checkpoint-tmp*``, ``tmp-checkpoint-*``, ``*.__lock``)
never match, because every rule is anchored on a final name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tierfs.core.config import DEFAULT_SEAL_PATTERNS

DIGITS = re.compile(r"^(?P<step>\d+)$")
NEMO_STEP = re.compile(r"^step=(?P<step>\d+)$")
NEMO_UNFINISHED = re.compile(r"^(?P<name>step=\d+)-unfinished$")
#: files whose close inside a step directory says the save ended (generic mode): Orbax's
#: commit record, DCP's ``.metadata`` (rank 0, last), the HF Trainer's ``trainer_state.json``
#: (transformers ``trainer.py`` ``_save_checkpoint``: written after the model, optimizer,
#: scheduler and RNG state of ``checkpoint-<N>/``, which it saves in place)
MARKER_FILES = frozenset({"commit_success.txt", ".metadata", "trainer_state.json"})
#: a DCP ``FileSystemWriter`` data file: ``__<global rank>_<index>.distcp``
DCP_DATA = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")
#: why a step whose seal a write withdrew (or that changed after its seal) is sealed
#: again: no seal rule asked for it (:meth:`tierfs.node.sealer.Sealer.retry_pending`,
#: :meth:`tierfs.node.intake.EventIntake`)
RESEAL_REASONS = frozenset({"re-seal after write", "changed after seal"})
#: seconds such a re-seal of a directory holding its own marker file waits for the
#: marker to be written again (:meth:`SealRules.awaits_marker`); a collective save
#: writes it within seconds of its data files
MARKER_GRACE = 30.0
#: seconds a DCP part holding fewer of this node's ranks than its previous DCP part
#: waits for the others' data files before it is sealed
#: (:meth:`SealRules.awaits_ranks`); a DCP save creates every rank's file right
#: after one collective, so they come within seconds (#14 trial 55 F2: a rank 8 s
#: late outlasted a 5 s grace, and every step was sealed and replicated twice)
RANKS_GRACE = 15.0
#: the reason of a DCP part's candidate (:meth:`SealRules.on_release`)
DCP_PART = "DCP part"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER = "latest"
TRACKERS = frozenset({MEGATRON_TRACKER, DEEPSPEED_TRACKER})


@dataclass(frozen=True)
class SealCandidate:
    """A step that should be sealed now.

    Attributes:
        step: the step number.
        name: the primary top-level entry (the step directory, or the first file).
        entries: every top-level entry that belongs to the shard.
        reason: why (for logs and status).
        created: the seal time to record (Unix seconds), None for "now". A step
            found at a daemon start gets its directory's mtime, so retention
            (newest by seal time) does not rank it above steps sealed earlier.
    """

    step: int
    name: str
    entries: tuple[str, ...]
    reason: str
    created: float | None = None


class ViewProbe(Protocol):
    """What the rules may ask about the client's view (paths relative to the root)."""

    def is_dir(self, path: str) -> bool:
        """True for a real directory (not a symlink to one)."""

    def exists(self, path: str) -> bool:
        """True if the entry exists (symlinks count, even dangling)."""

    def read_text(self, path: str, limit: int = 256) -> str | None:
        """The first ``limit`` bytes of a small file as text, or None."""

    def listdir(self, path: str) -> list[str]:
        """Names in a directory ('' is the root)."""

    def is_other_rank(self, path: str) -> bool:
        """True for another rank's file placed by the whole-step view (not this node's)."""


def _top(path: str) -> tuple[str, str]:
    top, _, rest = path.partition("/")
    return top, rest


class SealRules:
    """Seal rules of one job on one node.

    Args:
        framework: ``orbax``, ``pytorch.distributed``, ``pytorch`` or ``generic``.
        job: job name (``pytorch`` file names carry it).
        rank: this node's rank (``pytorch`` file names carry it).
        workers_per_node: ``pytorch`` files needed per step.
        patterns: generic-mode step name patterns, each with a ``(?P<step>\\d+)`` group.
    """

    def __init__(
        self,
        framework: str,
        job: str = "",
        rank: int = 0,
        workers_per_node: int = 1,
        patterns: Sequence[str] = DEFAULT_SEAL_PATTERNS,
    ) -> None:
        self.framework = framework
        self.job = job
        self.rank = rank
        self.workers = workers_per_node
        self.patterns = [re.compile(p) for p in patterns]
        self._save_re = re.compile(
            rf"^{re.escape(job)}-s(?P<step>\d+)-n{rank}-w(?P<worker>\d+)\.save$"
        )
        #: (step directory, this node's DCP ranks in it) of the newest DCP part seen,
        #: and of the one before it in another directory (:meth:`awaits_ranks`)
        self._dcp_now: tuple[str, frozenset[str]] | None = None
        self._dcp_before: tuple[str, frozenset[str]] | None = None

    # ------------------------------------------------------------------ names

    def step_of(self, name: str) -> int | None:
        """The step a top-level directory name denotes under these rules, else None."""
        if self.framework in ("orbax", "pytorch.distributed"):
            m = DIGITS.match(name) or (
                NEMO_STEP.match(name) if self.framework == "pytorch.distributed" else None
            )
            return int(m["step"]) if m else None
        if self.framework == "generic":
            for p in self.patterns:
                m = p.match(name)
                if m:
                    return int(m["step"])
        return None

    # ------------------------------------------------------------------ events

    def on_rename(
        self, old: str, new: str, is_dir: bool, is_symlink: bool, view: ViewProbe
    ) -> SealCandidate | None:
        """A rename inside the view finished (``old`` -> ``new``)."""
        if is_symlink:
            return None
        _, rest = _top(new)
        if not rest:
            if self.framework == "pytorch":
                return self._pytorch_files(new, view)
            if not is_dir:
                return self.on_release(new, view)
            if self.framework in ("orbax", "pytorch.distributed"):
                m = DIGITS.match(new)
                if m:
                    return SealCandidate(int(m["step"]), new, (new,), "renamed into place")
                return None
            if self.framework == "generic":
                step = self.step_of(new)
                if step is not None:
                    return SealCandidate(step, new, (new,), "renamed into place")
            return None
        # a marker file renamed into a step directory (e.g. commit_success.txt)
        return self.on_release(new, view)

    def on_release(self, path: str, view: ViewProbe) -> SealCandidate | None:
        """A handle that wrote ``path`` was closed."""
        top, rest = _top(path)
        if self.framework == "pytorch":
            return self._pytorch_files(top, view) if not rest else None
        if self.framework != "generic":
            return None
        if rest and rest in MARKER_FILES:
            step = self.step_of(top)
            if step is not None and view.is_dir(top):
                return SealCandidate(step, top, (top,), f"marker {rest}")
            return None
        if not rest and top in TRACKERS:
            return self._tracker(top, view)
        step = self.step_of(top)
        if rest and DCP_DATA.match(rest) and step is not None and view.is_dir(top):
            self._saw_dcp_files(top, view)  # rank 0's node too: its ranks are counted
            if self._dcp_part(top, view):
                return SealCandidate(
                    step, top, (top,), f"{DCP_PART} {rest} (no rank 0's file here)"
                )
        return None

    def awaits_ranks(self, cand: SealCandidate, view: ViewProbe) -> bool:
        """A DCP part ``cand`` (generic mode, a node without rank 0) should wait up to
        :data:`RANKS_GRACE` seconds: its directory holds data files of fewer of this
        node's ranks than this node's previous DCP save in another directory (two
        ranks per node: ``__2_0.distcp`` closed before ``__3_0.distcp`` was created;
        on the node of ranks 0 and 1, ``__1_0.distcp`` before ``__0_0.distcp``: the
        part waits for rank 0's ``.metadata``, whose candidate replaces it).

        The count of earlier saves only delays the seal; the part sealed is always what
        the directory holds when a file of the last rank closes or the grace ends.
        Regression (#14 trial 54 F4): with 2 ranks per node a partial part (one rank's
        file) was sealed, replicated and logged "saved again" before the whole one.
        """
        if self.framework != "generic" or not cand.reason.startswith(DCP_PART):
            return False
        before = self._dcp_before
        if before is None or before[0] == cand.name or not view.is_dir(cand.name):
            return False
        return len(self._own_dcp_ranks(cand.name, view)) < len(before[1])

    def still_holds(self, cand: SealCandidate, view: ViewProbe) -> bool:
        """Whether ``cand`` is still a candidate when its seal begins: a DCP part's
        directory may have got this node's file of rank 0 since (its node seals on
        ``.metadata``, the coordinator's marker; #14 trial 55 F4: the part of ranks 0
        and 1, sealed when the rank grace ended without ``.metadata``, was judged
        "not loadable" in ``replicator.errors``). Other candidates always hold."""
        if not cand.reason.startswith(DCP_PART):
            return True
        return self._dcp_part(cand.name, view)

    def ranks_settled(self, top: str, view: ViewProbe) -> None:
        """A DCP part of ``top`` that waited for more of this node's ranks is sealed
        without them (the grace ended, or a load began): the job runs that many ranks
        on this node now. Saves after it, into ``top`` again or another directory,
        compare with this count and do not wait (#14 trial 58 L1: every re-save of the
        step waited the whole grace again)."""
        self._dcp_before = (top, self._own_dcp_ranks(top, view))

    def _saw_dcp_files(self, top: str, view: ViewProbe) -> None:
        """Count this node's DCP ranks in ``top`` (a DCP data file closed there)."""
        ranks = self._own_dcp_ranks(top, view)
        now = self._dcp_now
        if now is not None and now[0] == top:
            self._dcp_now = (top, now[1] | ranks)
            return
        if now is not None:
            self._dcp_before = now
        self._dcp_now = (top, ranks)

    def awaits_marker(
        self,
        cand: SealCandidate,
        view: ViewProbe,
        former: Callable[[], Iterable[str]] = lambda: (),
    ) -> bool:
        """A re-seal (:data:`RESEAL_REASONS`) of ``cand`` should wait up to
        :data:`MARKER_GRACE` seconds: its directory holds a marker file of this node's
        own (generic mode: DCP rank 0's ``.metadata``, ``commit_success.txt``,
        ``trainer_state.json``), so the step is being saved again in place and the
        marker, written last, seals it (:meth:`on_release`, :meth:`on_rename`).

        Sealing at once took the half-saved part (regression: a DCP save in place
        sealed rank 0's part after ``__0_0.distcp`` with the old ``.metadata``, and again
        40 ms later; the backup round took the first seal and its upload was stopped
        by the second). A file changed by hand without its marker is sealed once the
        grace has passed.

        ``former``: gives the file paths of this node's former part of the step
        (sealed, or withdrawn by the write; called only for a re-seal). A marker it
        held counts even when the client removed it (regression, #16 F1 replay:
        DCP's ``overwrite=True`` removes the old ``.metadata`` first; rank 0's part
        was sealed at once without one, or with ``.metadata.tmp``, and other nodes'
        ``dcp.load`` failed "metadata is None").
        """
        if self.framework != "generic" or cand.reason not in RESEAL_REASONS:
            return False
        top = cand.name
        if not view.is_dir(top):
            return False
        markers = [f"{top}/{m}" for m in sorted(MARKER_FILES)]
        if not set(markers).isdisjoint(former()):
            return True
        return any(view.exists(p) and not view.is_other_rank(p) for p in markers)

    @classmethod
    def _dcp_part(cls, top: str, view: ViewProbe) -> bool:
        """``top`` holds DCP data files of this node, none of global rank 0 (whose node
        writes ``.metadata``, the marker there): this node's part is done when they
        are. Other ranks' files of the whole-step view do not count (regression: a
        step saved again into a directory showing rank 0's file never sealed here)."""
        if not view.is_dir(top):
            return False
        ranks = cls._own_dcp_ranks(top, view)
        return bool(ranks) and "0" not in ranks

    @staticmethod
    def _own_dcp_ranks(top: str, view: ViewProbe) -> frozenset[str]:
        """The global ranks (decimal strings) of this node's DCP data files in ``top``."""
        return frozenset(
            m["rank"]
            for name in view.listdir(top)
            if (m := DCP_DATA.match(name)) and not view.is_other_rank(f"{top}/{name}")
        )

    def on_remove(self, path: str, view: ViewProbe) -> SealCandidate | None:
        """``path`` was unlinked or removed (NeMo's ``step=N-unfinished`` finalize)."""
        top, rest = _top(path)
        if rest or self.framework not in ("pytorch.distributed", "generic"):
            return None
        m = NEMO_UNFINISHED.match(top)
        if not m or view.exists(top):
            return None
        name = m["name"]
        step = int(NEMO_STEP.match(name)["step"])  # type: ignore[index]
        if self.framework == "generic" and self.step_of(name) is None:
            return None
        if view.is_dir(name):
            return SealCandidate(step, name, (name,), "-unfinished marker removed")
        return None

    def scan(self, view: ViewProbe) -> list[SealCandidate]:
        """Every complete step visible now (used after a daemon restart)."""
        found: dict[int, SealCandidate] = {}
        names = view.listdir("")
        for name in names:
            cand: SealCandidate | None = None
            if self.framework == "pytorch":
                cand = self._pytorch_files(name, view)
            elif self.framework in ("orbax", "pytorch.distributed"):
                if view.is_dir(name) and DIGITS.match(name):
                    cand = SealCandidate(int(name), name, (name,), "found at start")
                elif (
                    self.framework == "pytorch.distributed"
                    and NEMO_STEP.match(name)
                    and view.is_dir(name)
                    and f"{name}-unfinished" not in names
                ):
                    cand = SealCandidate(int(name[5:]), name, (name,), "found at start")
            elif self.framework == "generic" and view.is_dir(name):
                step = self.step_of(name)
                if step is None:
                    continue
                inside = set(view.listdir(name))
                finished_nemo = NEMO_STEP.match(name) and f"{name}-unfinished" not in names
                if inside & MARKER_FILES or finished_nemo or self._dcp_part(name, view):
                    cand = SealCandidate(step, name, (name,), "found at start")
            if cand is not None and cand.step not in found:
                found[cand.step] = cand
        return [found[s] for s in sorted(found)]

    # ------------------------------------------------------------------ helpers

    def _pytorch_files(self, name: str, view: ViewProbe) -> SealCandidate | None:
        m = self._save_re.match(name)
        if not m:
            return None
        step = int(m["step"])
        files = [f"{self.job}-s{step}-n{self.rank}-w{w}.save" for w in range(self.workers)]
        if all(view.exists(f) and not view.is_dir(f) for f in files):
            return SealCandidate(
                step, files[0], tuple(files), f"{self.workers} worker file(s) closed"
            )
        return None

    def _tracker(self, tracker: str, view: ViewProbe) -> SealCandidate | None:
        text = (view.read_text(tracker) or "").strip()
        if tracker == MEGATRON_TRACKER:
            if not text.isdigit():
                return None
            name = f"iter_{int(text):07d}"
        else:
            name = text
        if not name or "/" in name or not view.is_dir(name):
            return None
        step = self.step_of(name)
        if step is None:
            return None
        return SealCandidate(step, name, (name, tracker), f"tracker {tracker}")
