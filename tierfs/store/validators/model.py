"""The data a step judgement works on and what it answers (issue #15).

:class:`StepFiles` is plain data the caller builds from the manifests of every
rank's part of one step it knows (sizes) plus a callable for the bytes of the
files it holds locally. :class:`Verdict` is the answer. The per-format checks
(one module each beside this one) add :class:`Problem` lines to a
:class:`Findings`; :func:`tierfs.store.validators.judge_step` runs them.

Nothing here does I/O of its own: bytes are only read through
:attr:`StepFiles.read`, which may block (call the judgement from a worker
thread, never from the trio thread serving FUSE).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from tierfs.core.errors import StorageError

#: ``read(relpath, offset, length) -> bytes``: up to ``length`` bytes of a local
#: file from byte ``offset`` (fewer at end of file); raises OSError.
Reader = Callable[[str, int, int], bytes]

#: reasons kept in a verdict; the rest is counted in one last line
MAX_REASONS = 20


class Kind(StrEnum):
    """What is wrong with a step.

    * ``missing``: a file the format requires is in no known rank's part (the
      part of a rank not known yet may still bring it);
    * ``damaged``: a file is there but wrong (short, empty, unparsable): no
      other rank's part can repair it;
    * ``unreadable``: the judgement needs the bytes of a file this node does
      not hold (the node holding it, or a replica of it, must judge);
    * ``unfinished``: the framework itself says the save is not finished (a
      temp name, NeMo's ``-unfinished`` marker, no commit record).
    """

    MISSING = "missing"
    DAMAGED = "damaged"
    UNREADABLE = "unreadable"
    UNFINISHED = "unfinished"


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing that keeps a step from loading.

    Attributes:
        kind: see :class:`Kind`.
        path: the file (relative to the mount root) the problem is about.
        message: what is wrong, in words a user can act on.
    """

    kind: Kind
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class StepFiles:
    """One step as the caller knows it, across ranks.

    Attributes:
        name: the step's primary top-level entry (``"100"``, ``"step_10"``).
        sizes: every file of every known rank's part of the step, as path
            relative to the mount root (``"step_10/__1_0.distcp"``; tracker
            files are top-level, ``"latest"``) -> size in bytes. Directories and
            symlinks are not listed here.
        read: reads the bytes of local files (see :data:`Reader`); None when
            no bytes can be read (then only sizes are judged).
        local: the paths ``read`` serves; None means every path of ``sizes``.
        dirs: directories of the known parts (relative paths), for empty ones.
        holders: path -> node rank whose part holds it (only for messages).
        siblings: other top-level names in the view when judged (NeMo's
            ``<name>-unfinished`` marker lives beside the step, on rank 0).
    """

    name: str
    sizes: Mapping[str, int]
    read: Reader | None = None
    local: frozenset[str] | None = None
    dirs: frozenset[str] = frozenset()
    holders: Mapping[str, int] = field(default_factory=dict)
    siblings: frozenset[str] = frozenset()

    def readable(self, path: str) -> bool:
        """True if ``path`` is a known file whose bytes this node can read."""
        if self.read is None or path not in self.sizes:
            return False
        return self.local is None or path in self.local

    def under(self, directory: str) -> Iterator[tuple[str, int]]:
        """(path, size) of every file below ``directory`` (recursively), sorted."""
        prefix = f"{directory}/" if directory else ""
        for path in sorted(self.sizes):
            if path.startswith(prefix):
                yield path, self.sizes[path]

    def step_files(self) -> Iterator[tuple[str, int]]:
        """(path, size) of every file inside the step directory ``name/``."""
        return self.under(self.name)

    def where(self, path: str) -> str:
        """`` (rank N)`` when the holder of ``path`` is known, else ``''``."""
        rank = self.holders.get(path)
        return "" if rank is None else f" (rank {rank})"


class ReadFailed(StorageError):
    """A read through :attr:`StepFiles.read` failed or the file is not local."""


def read_bytes(files: StepFiles, path: str, offset: int = 0, length: int | None = None) -> bytes:
    """``length`` bytes of ``path`` from ``offset`` (to the end when None).

    Returns exactly the bytes asked for, or fewer only when the file is
    shorter than its listed size says (the caller compares lengths).

    Raises:
        ReadFailed: the file is not readable here, or the read raised OSError.
    """
    if not files.readable(path):
        raise ReadFailed(f"not held on this node{files.where(path)}")
    size = files.sizes[path]
    want = max(0, size - offset) if length is None else length
    assert files.read is not None
    out = bytearray()
    try:
        while len(out) < want:
            chunk = files.read(path, offset + len(out), want - len(out))
            if not chunk:
                break
            out += chunk
    except OSError as exc:
        raise ReadFailed(f"read failed: {exc.strerror or exc}") from None
    return bytes(out)


@dataclass
class Findings:
    """What the checks found so far for one step (mutable, one judgement)."""

    formats: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: set[str] = field(default_factory=set)
    #: safetensors path -> tensor names of its header (for the HF index check)
    tensor_names: dict[str, frozenset[str]] = field(default_factory=dict)

    def format(self, name: str) -> None:
        """Record a detected format (once, in detection order)."""
        if name not in self.formats:
            self.formats.append(name)

    def add(self, kind: Kind, path: str, message: str) -> None:
        """Record a problem (duplicates are dropped)."""
        p = Problem(kind, path, message)
        if p not in self.problems:
            self.problems.append(p)

    def missing(self, path: str, message: str) -> None:
        """A required file is in no known part."""
        self.add(Kind.MISSING, path, message)

    def damaged(self, path: str, message: str) -> None:
        """A file is there but cannot be loaded."""
        self.add(Kind.DAMAGED, path, message)

    def unfinished(self, path: str, message: str) -> None:
        """The framework says the save has not finished."""
        self.add(Kind.UNFINISHED, path, message)

    def unreadable(self, path: str, message: str) -> None:
        """The judgement needs bytes this node does not have."""
        self.add(Kind.UNREADABLE, path, message)

    def note(self, text: str) -> None:
        """Record a remark that does not change the verdict."""
        if text not in self.notes:
            self.notes.append(text)


@dataclass(frozen=True)
class Verdict:
    """Whether a step would load, and why not.

    Attributes:
        step: the step's primary top-level entry.
        format: the detected formats joined by ``+`` (``"dcp"``,
            ``"megatron+dcp"``, ``"orbax"``...), ``"unknown"`` if none.
        complete: True when nothing keeps the step from loading as far as the
            known parts show (always True for an unknown layout).
        problems: every problem found (see :class:`Kind`), in check order.
        notes: remarks that did not change the verdict (what could not be
            checked and why, which commit record was used).
        unknown_layout: no format was recognised: today's rename rule decides.
    """

    step: str
    format: str
    complete: bool
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    unknown_layout: bool = False

    @property
    def reasons(self) -> tuple[str, ...]:
        """One line per problem (``path: what is wrong``), at most :data:`MAX_REASONS`."""
        lines = [str(p) for p in self.problems[:MAX_REASONS]]
        if len(self.problems) > MAX_REASONS:
            lines.append(f"... and {len(self.problems) - MAX_REASONS} more problems")
        return tuple(lines)

    def of_kind(self, kind: Kind) -> tuple[Problem, ...]:
        """The problems of one kind."""
        return tuple(p for p in self.problems if p.kind is kind)

    @property
    def part_ok(self) -> bool:
        """No file of the known parts is damaged (missing/unreadable may still resolve)."""
        return not self.of_kind(Kind.DAMAGED)

    def summary(self) -> str:
        """One line for logs and ``replicator.errors``: step, format, first reason."""
        if self.complete:
            return f"step {self.step} ({self.format}): complete"
        first = self.reasons[0] if self.problems else "incomplete"
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"step {self.step} ({self.format}) is not loadable: {first}{more}"


def parent(path: str) -> str:
    """The directory of a relative path (``''`` for a top-level name)."""
    return posixpath.dirname(path)


def base(path: str) -> str:
    """The last component of a relative path."""
    return posixpath.basename(path)
