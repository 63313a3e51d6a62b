"""The ``TIERFS_*`` environment variables: one table, each with its type, default, unit and doc.

Every variable tierfs reads is a :class:`Setting` in :data:`ALL`; code reads a
value when it uses it (``settings.GCS_TICK.get()``), never a copy frozen at
import, so a test or a daemon's environment set after import still counts.
An unset or empty variable means the default. A bad value is an error naming
the variable (:class:`SettingError`); ``tierfs mount`` checks them all before
it starts a daemon (:func:`check_environment`), so a typo fails the mount
with one line instead of being ignored.

The README's configuration reference holds :func:`markdown_table` between
``<!-- settings:start -->`` and ``<!-- settings:end -->`` (a test keeps them
equal; ``python -m tierfs.core.settings`` prints it).

Why not pydantic-settings: it is not a dependency (pydantic neither), it reads
every variable once into a frozen object (the opposite of read-when-used), and
22 scalar variables need nothing it adds over this table.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from tierfs import __version__
from tierfs.core.config import ConfigError

V = TypeVar("V", int, float, str)


class SettingError(ConfigError):
    """A ``TIERFS_*`` variable holds a value of the wrong type or range; the message names it
    (never a secret's value)."""


def default_threads() -> int:
    """Objects in flight per node: the CPU count, between 2 and 8.

    Every byte passes through Python (the library reads responses in 8 KiB
    pieces and tierfs checksums them), so more threads than cores only add
    GIL contention; on the 2-core benchmark machine 8 threads restored ~20 %
    slower than 2.
    """
    return max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class Setting(Generic[V]):
    """One environment variable.

    Attributes:
        name: the variable (``TIERFS_…``).
        kind: ``int``, ``float`` or ``str``.
        default: the value when unset or empty (ignored if ``factory`` is set).
        unit: ``s``, ``MiB`` … or ``""``.
        doc: one line: what it changes.
        minimum: the smallest value accepted (numbers only), inclusive unless
            ``exclusive``.
        factory: computes the default when it depends on the machine.
        default_doc: how the README shows a computed default.
        secret: its value never appears in an error or a log.
        used_by: the part of tierfs that reads it.
    """

    name: str
    kind: type[V]
    default: V
    unit: str
    doc: str
    used_by: str
    minimum: float | None = None
    exclusive: bool = False
    factory: Callable[[], V] | None = None
    default_doc: str | None = None
    secret: bool = False

    def get(self, env: Mapping[str, str] | None = None) -> V:
        """The value now: parsed from ``env`` (default ``os.environ``, read at this call),
        or the default when unset or empty.

        Raises:
            SettingError: not a ``kind`` (numbers: decimal, finite), or below ``minimum``.
        """
        raw = (os.environ if env is None else env).get(self.name, "").strip()
        if not raw:
            return self.factory() if self.factory is not None else self.default
        return self.parse(raw)

    def parse(self, raw: str) -> V:
        """``raw`` as this setting's value.

        Raises:
            SettingError: as :meth:`get`.
        """
        if self.kind is str:
            return self.kind(raw)
        try:
            value = self.kind(raw)
        except ValueError:
            value = None
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            raise SettingError(
                f"environment variable {self.name}={self._shown(raw)} is not "
                f"{self.expected()} ({self.doc})"
            )
        number = float(value)
        if self.minimum is not None and (
            number < self.minimum or (self.exclusive and number == self.minimum)
        ):
            raise SettingError(
                f"environment variable {self.name}={self._shown(raw)} is out of "
                f"range: it must be {self.expected()} ({self.doc})"
            )
        return value

    def expected(self) -> str:
        """What a value must be, in words (``a number of seconds > 0``)."""
        noun = {int: "an integer", float: "a number", str: "a string"}[self.kind]
        if self.unit:
            noun += {"s": " of seconds", "MiB": " of MiB"}.get(self.unit, f" ({self.unit})")
        if self.minimum is not None:
            low = int(self.minimum) if float(self.minimum).is_integer() else self.minimum
            noun += f" {'>' if self.exclusive else '>='} {low}"
        return noun

    def shown_default(self) -> str:
        """The default as the README shows it."""
        if self.default_doc is not None:
            return self.default_doc
        if self.kind is str:
            return f"`{self.default}`" if self.default else "unset"
        value = self.default
        return f"{int(value)}" if float(value).is_integer() else f"{value}"

    def _shown(self, raw: str) -> str:
        return "<redacted>" if self.secret else repr(raw)


def _seconds(
    name: str, default: float, doc: str, used_by: str, *, zero_ok: bool = False
) -> Setting[float]:
    return Setting(name, float, default, "s", doc, used_by, minimum=0.0, exclusive=not zero_ok)


_GCS = "backups (GCS tier)"
_PEER = "peer plane"

GCS_THREADS = Setting(
    "TIERFS_GCS_THREADS",
    int,
    2,
    "",
    "objects transferred in parallel per node",
    _GCS,
    minimum=1,
    factory=default_threads,
    default_doc="CPU count, 2..8",
)
GCS_CHUNK_MIB = Setting(
    "TIERFS_GCS_CHUNK_MIB",
    float,
    64.0,
    "MiB",
    "bytes per request of a resumable upload, in 1/4 MiB steps; one chunk is buffered "
    "per large upload in flight",
    _GCS,
    minimum=0.0,
    exclusive=True,
)
GCS_RETRY_DEADLINE = _seconds(
    "TIERFS_GCS_RETRY_DEADLINE",
    300.0,
    "deadline of each bucket request, retries and waiting for the answer included",
    _GCS,
)
GCS_TIMEOUT = _seconds(
    "TIERFS_GCS_TIMEOUT",
    120.0,
    "read timeout of one HTTP attempt, at most (capped by the request's deadline)",
    _GCS,
)
GCS_TICK = _seconds(
    "TIERFS_GCS_TICK", 1.0, "pause between the backup decider's ticks (seals wake it too)", _GCS
)
GCS_ROUND_TIMEOUT = _seconds(
    "TIERFS_GCS_ROUND_TIMEOUT",
    1800.0,
    "a backup round not finished by every node after this long is given up",
    _GCS,
)
GCS_FALLBACK_DEADLINE = _seconds(
    "TIERFS_GCS_FALLBACK_DEADLINE",
    30.0,
    "deadline of each request of the coordinator's restore.version read and bucket "
    "fallback (they hold the coordinator's lock)",
    _GCS,
)
GCS_LOOKUP_DEADLINE = _seconds(
    "TIERFS_GCS_LOOKUP_DEADLINE",
    20.0,
    "deadline of each request of the restore-time lookups (restore.version, choosing a round)",
    _GCS,
)
GCS_RENDEZVOUS_DEADLINE = _seconds(
    "TIERFS_GCS_RENDEZVOUS_DEADLINE",
    10.0,
    "deadline of one rendezvous read or write in the bucket (the caller polls again)",
    _GCS,
)
GCS_START_DEADLINE = _seconds(
    "TIERFS_GCS_START_DEADLINE",
    5.0,
    'deadline of the bucket check at mount (only "does not exist" fails the mount)',
    _GCS,
)
GCS_STALL_SECONDS = _seconds(
    "TIERFS_GCS_STALL_SECONDS",
    20.0,
    'requests waiting this long without any answer show as "slow or stalled"',
    _GCS,
)
GCS_UPLOAD_RETRY_FIRST = _seconds(
    "TIERFS_GCS_UPLOAD_RETRY_FIRST",
    2.0,
    "first pause before a failed upload is tried again (and between checks of a bucket "
    "with a problem)",
    _GCS,
)
GCS_UPLOAD_RETRY_MAX = _seconds(
    "TIERFS_GCS_UPLOAD_RETRY_MAX",
    30.0,
    "longest such pause (it doubles from the first); an answer from the bucket ends it",
    _GCS,
)
GCS_DEDUP_WAIT = _seconds(
    "TIERFS_GCS_DEDUP_WAIT",
    60.0,
    "a data-parallel rank waits this long after the last progress for its column's "
    "uploader's objects, then uploads its own",
    _GCS,
    zero_ok=True,
)
PEER_TOKEN = Setting(
    "TIERFS_PEER_TOKEN",
    str,
    "",
    "",
    "shared secret on every peer call when --peer-token / peerToken is not given",
    _PEER,
    secret=True,
)
PEER_PUSH_PATIENCE = _seconds(
    "TIERFS_PEER_PUSH_PATIENCE",
    120.0,
    "how long a push of a step to a peer is retried while the peer is unreachable",
    _PEER,
    zero_ok=True,
)
EARLY_READ_MIB = Setting(
    "TIERFS_EARLY_READ_MIB",
    float,
    256.0,
    "MiB",
    "an open of another rank's file in the whole-step view waits for the whole file "
    "(then served by passthrough) when at most this much of it is still to come; a "
    "larger remainder is served from its verified chunks at once (first byte within a "
    "chunk's fetch; that handle is served by the daemon, slower for full reads); 0: "
    "always at once",
    _PEER,
    minimum=0.0,
)
EARLY_READ_WAIT = _seconds(
    "TIERFS_EARLY_READ_WAIT",
    0.5,
    "the longest an open of another rank's file waits for the whole file under "
    "TIERFS_EARLY_READ_MIB (counted from the first open that waits); then it is served "
    "from its verified chunks: the first byte after a mount within about this long "
    "whatever the fetch's rate",
    _PEER,
    zero_ok=True,
)
FETCH_BATCH = Setting(
    "TIERFS_FETCH_BATCH",
    int,
    64,
    "files",
    "the whole-step view fetches another rank's file of at most 4 MiB together with the "
    "next such files of that rank's part (path order, at most 64 MiB) in one call to a "
    "peer, at most this many files per call; 1: one call per file",
    _PEER,
    minimum=1,
)
REVERIFY_AFTER = _seconds(
    "TIERFS_REVERIFY_AFTER",
    600.0,
    "a node summoned to a restore round re-reads and re-checks the crc32c of the copies "
    "it holds, except those whose bytes it sealed, received verified or checked within "
    "this many seconds (about 0.5 s per GiB held on a 2-vCPU VM); a copy loaded at "
    "startup is always checked; 0: re-check every copy",
    _PEER,
    zero_ok=True,
)
TRAINER_SAME_START = _seconds(
    "TIERFS_TRAINER_SAME_START",
    60.0,
    "trainer starts (tierfs wait) on one node within this many seconds of the one that "
    "got the last restore are the same start (its other local ranks) and get that "
    "result; a later one is a restart of the job and opens a new restore round",
    _PEER,
    zero_ok=True,
)
REFUSAL_GRACE = _seconds(
    "TIERFS_REFUSAL_GRACE",
    30.0,
    "how long the coordinator may refuse this node's join for good (wrong token, another "
    "job) before the restore fails (another node count: up to --join-timeout)",
    _PEER,
    zero_ok=True,
)
BUCKET = Setting(
    "TIERFS_BUCKET",
    str,
    "",
    "",
    "default --bucket of the `tierfs backups` commands",
    "tierfs backups",
)
IMAGE = Setting(
    "TIERFS_IMAGE",
    str,
    f"tierfs:{__version__}",
    "",
    "the node image of rendered DaemonSets",
    "operator",
)
NAMESPACE = Setting(
    "TIERFS_NAMESPACE",
    str,
    "tierfs-system",
    "",
    "namespace of rendered DaemonSets (the node ServiceAccount's)",
    "operator",
)
DRIVER_NAME = Setting(
    "TIERFS_DRIVER_NAME",
    str,
    "tierfs.csi.dev",
    "",
    "CSI driver name of rendered DaemonSets (the CSIDriver object's name)",
    "operator",
)

#: every variable, in the README's order
ALL: tuple[Setting[int] | Setting[float] | Setting[str], ...] = (
    GCS_THREADS,
    GCS_CHUNK_MIB,
    GCS_RETRY_DEADLINE,
    GCS_TIMEOUT,
    GCS_TICK,
    GCS_ROUND_TIMEOUT,
    GCS_FALLBACK_DEADLINE,
    GCS_LOOKUP_DEADLINE,
    GCS_RENDEZVOUS_DEADLINE,
    GCS_START_DEADLINE,
    GCS_STALL_SECONDS,
    GCS_UPLOAD_RETRY_FIRST,
    GCS_UPLOAD_RETRY_MAX,
    GCS_DEDUP_WAIT,
    PEER_TOKEN,
    PEER_PUSH_PATIENCE,
    EARLY_READ_MIB,
    EARLY_READ_WAIT,
    FETCH_BATCH,
    REVERIFY_AFTER,
    TRAINER_SAME_START,
    REFUSAL_GRACE,
    BUCKET,
    IMAGE,
    NAMESPACE,
    DRIVER_NAME,
)
BY_NAME: dict[str, Setting[int] | Setting[float] | Setting[str]] = {s.name: s for s in ALL}


def problems(env: Mapping[str, str] | None = None) -> Iterator[str]:
    """One message per variable of :data:`ALL` whose value in ``env`` (default
    ``os.environ``) is bad."""
    for setting in ALL:
        try:
            setting.get(env)
        except SettingError as exc:
            yield str(exc)


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Parse every variable of :data:`ALL` now.

    Raises:
        SettingError: naming every bad variable (``; ``-joined).
    """
    found = list(problems(env))
    if found:
        raise SettingError("; ".join(found))


def markdown_table() -> str:
    """The README's table of :data:`ALL` (variable, default, unit, used by, what it does)."""
    lines = ["| variable | default | unit | read by | what it changes |", "|---|---|---|---|---|"]
    for s in ALL:
        lines.append(
            f"| `{s.name}` | {s.shown_default()} | {s.unit or '-'} | {s.used_by} | "
            f"{s.doc}{' (a secret: never logged)' if s.secret else ''} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
