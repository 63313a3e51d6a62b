"""The rules of the whole-step view (issue #14): which rank's file a path shows (pure).

A step of a multi-node job is written in parts, one per node rank, each
sealed on its own node. The whole-step view shows on every node the union of
all parts' files (docs/SEMANTICS.md, "The whole-step view"):

* a path only one part holds is that part's file;
* a path several parts hold with identical size and crc32c is one file (the
  node's own copy if it has one, else the lowest rank's);
* a path several parts hold with different bytes is a **conflict**: the
  node's own copy wins in its view; without one the lowest rank's copy is
  shown; either way the conflict is reported once;
* directories are created as needed; symlinks of other parts are created
  where no entry of that name exists.

Files every process writes for itself (:data:`PER_PROCESS_NAMES`: Orbax's
``_CHECKPOINT_METADATA``, whose init and commit timestamps differ per process,
and ``commit_success.txt``, which names the process's own path, when each host
finalizes its own step directory, ``primary_host=None``) show
the node's own copy (else the lowest rank's) like a conflict, but different
bytes there are expected and not reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tierfs.store.manifest import FileEntry, Manifest

#: file names every process writes with its own bytes (see the module docstring)
PER_PROCESS_NAMES = frozenset({"_CHECKPOINT_METADATA", "commit_success.txt"})


@dataclass(frozen=True)
class Conflict:
    """One path that parts hold with different bytes.

    Attributes:
        path: relative to the step's parts' roots.
        shown: the rank whose copy the view shows; -1 for the node's own copy.
        ranks: every rank holding the path, ascending.
    """

    path: str
    shown: int
    ranks: tuple[int, ...]


@dataclass
class UnionPlan:
    """What the view of one step must show beyond the node's own part.

    Attributes:
        files: path -> (rank, entry): other ranks' regular files to place.
        dirs: directories of other parts (entries of kind ``dir``), parents first.
        symlinks: other parts' symlinks (path -> entry).
        conflicts: paths held with different bytes, ascending by path.
    """

    files: dict[str, tuple[int, FileEntry]] = field(default_factory=dict)
    dirs: list[FileEntry] = field(default_factory=list)
    symlinks: dict[str, FileEntry] = field(default_factory=dict)
    conflicts: list[Conflict] = field(default_factory=list)


def _same(a: FileEntry, b: FileEntry) -> bool:
    return a.kind == b.kind and a.size == b.size and a.crc32c == b.crc32c and a.target == b.target


def union_plan(own: Manifest | None, others: Mapping[int, Manifest]) -> UnionPlan:
    """The other ranks' entries the node's view of a step shows, and the conflicts.

    Args:
        own: the node's own part of the step (None: it holds none).
        others: rank -> manifest of that rank's part (the node's own rank excluded).

    Returns:
        the plan; deterministic for the same inputs (ranks in ascending order).
    """
    plan = UnionPlan()
    own_entries = {f.path: f for f in own.files} if own is not None else {}
    holders: dict[str, list[tuple[int, FileEntry]]] = {}
    for rank in sorted(others):
        for f in others[rank].files:
            holders.setdefault(f.path, []).append((rank, f))
    dirs: dict[str, FileEntry] = {}
    for path in sorted(holders):
        held = holders[path]
        mine = own_entries.get(path)
        first_rank, first = held[0]
        entries = ([mine] if mine is not None else []) + [f for _, f in held]
        per_process = path.rsplit("/", 1)[-1] in PER_PROCESS_NAMES
        differ = not all(_same(entries[0], e) for e in entries)
        if any(e.kind != "dir" for e in entries) and differ and not per_process:
            ranks = tuple(sorted({r for r, _ in held}))
            plan.conflicts.append(Conflict(path, -1 if mine is not None else first_rank, ranks))
        if mine is not None:
            continue  # the node's own entry stays what it is
        if first.kind == "dir":
            dirs.setdefault(path, first)
        elif first.kind == "symlink":
            plan.symlinks[path] = first
        elif first.kind == "file":
            plan.files[path] = (first_rank, first)
    plan.dirs = [dirs[p] for p in sorted(dirs, key=lambda p: (p.count("/"), p))]
    return plan


#: a reported rank of -1: every placed part of that step is to be asked again
ALL_RANKS = -1


def changed_ranks(placed: Mapping[int, str], reported: Mapping[int, str]) -> list[int]:
    """The ranks whose part placed in the view is not the part their node reports now
    (that rank saved the step again), ascending.

    Args:
        placed: rank -> the manifest digest of the part whose files the view shows.
        reported: rank -> the digest of that rank's own part as its node reported it
            to the coordinator (:data:`ALL_RANKS` -> anything: the changes are not
            known, every placed rank counts as changed).

    A rank not placed yet (the view's next look finds its part) or reported with
    no digest does not count; nor does a rank placed with the reported digest.
    """
    if ALL_RANKS in reported:
        return sorted(placed)
    return sorted(r for r, d in reported.items() if d and r in placed and placed[r] != d)
