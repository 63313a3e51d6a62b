"""Opt-in retention of GCS backup rounds (``tierfs backups prune``): pure selection.

MTC never deletes backups (PROTOCOL.md section 5); tierfs offers retention
only as an explicit command, and this module only *chooses*. The rules, in
the spirit of restic/borg ``forget``:

* ``keep_last`` N: the N newest complete rounds.
* ``hourly``/``daily``/``weekly`` N: going from the newest complete round
  back, the newest complete round of each of the N most recent UTC hours /
  days / ISO weeks that have one.
* Always kept, whatever the policy: the newest complete round, every round
  named in ``protected`` (``restore.version``), and partial rounds newer
  than the newest complete round (they may still be uploading). With no
  complete round at all nothing partial is deleted either.
* Everything else is deleted: complete rounds no rule keeps, and partial
  rounds older than the newest complete round (a round is never resumed
  once a newer one has completed, so they can never become usable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tierfs.backup.layout import round_time


@dataclass(frozen=True)
class RetentionPolicy:
    """How many rounds each rule keeps (0 = rule off).

    Attributes:
        keep_last: newest complete rounds kept.
        hourly, daily, weekly: UTC hours / days / ISO weeks whose newest complete round is kept.
    """

    keep_last: int = 0
    hourly: int = 0
    daily: int = 0
    weekly: int = 0

    def __post_init__(self) -> None:
        for name in ("keep_last", "hourly", "daily", "weekly"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def empty(self) -> bool:
        """No rule is on (prune refuses to run: retention is opt-in)."""
        return not (self.keep_last or self.hourly or self.daily or self.weekly)

    def describe(self) -> str:
        """The policy as the CLI flags that set it."""
        parts = [
            f"--{flag} {n}"
            for flag, n in (
                ("keep-last", self.keep_last),
                ("hourly", self.hourly),
                ("daily", self.daily),
                ("weekly", self.weekly),
            )
            if n
        ]
        return " ".join(parts) or "(no rule)"


@dataclass(frozen=True)
class RoundState:
    """What retention needs to know about a round: its name (a UTC minute) and
    whether it is complete for every node."""

    name: str
    complete: bool


@dataclass
class PruneSelection:
    """The outcome of :func:`select_rounds`.

    Attributes:
        keep: round name -> the reasons it is kept.
        delete: rounds to delete, newest first.
    """

    keep: dict[str, list[str]] = field(default_factory=dict)
    delete: list[str] = field(default_factory=list)


def _bucketed(rounds: list[RoundState], count: int, key: Callable[[str], object]) -> list[str]:
    kept: list[str] = []
    seen: set[object] = set()
    for r in rounds:
        k = key(r.name)
        if k in seen:
            continue
        seen.add(k)
        kept.append(r.name)
        if len(kept) >= count:
            break
    return kept


def select_rounds(
    rounds: Iterable[RoundState], policy: RetentionPolicy, protected: dict[str, str] | None = None
) -> PruneSelection:
    """Choose which backup rounds a prune keeps and deletes (pure; see the module docstring).

    Args:
        rounds: every round of the job (any order; names ``YYYY-MM-DD_HH-MM``).
        policy: the rules; must not be empty.
        protected: round name -> reason, never deleted (e.g. ``restore.version``).

    Raises:
        ValueError: an empty policy (retention must be asked for explicitly),
            or a malformed round name.
    """
    if policy.empty:
        raise ValueError("no retention rule given (use keep_last, hourly, daily or weekly)")
    everything = sorted({r.name: r for r in rounds}.values(), key=lambda r: r.name, reverse=True)
    times = {r.name: round_time(r.name) for r in everything}
    complete = [r for r in everything if r.complete]
    sel = PruneSelection()

    def keep(name: str, why: str) -> None:
        sel.keep.setdefault(name, []).append(why)

    for name, why in (protected or {}).items():
        if name in times:
            keep(name, why)
    newest = complete[0].name if complete else None
    if newest is not None:
        keep(newest, "newest complete round")
    for r in everything:
        if not r.complete and (newest is None or r.name > newest):
            keep(r.name, "partial, newer than the newest complete round (may be uploading)")
    for name in [r.name for r in complete[: policy.keep_last]]:
        keep(name, f"last {policy.keep_last}")
    rules: list[tuple[int, str, Callable[[str], object]]] = [
        (policy.hourly, "hourly", lambda n: times[n].strftime("%Y-%m-%d %H")),
        (policy.daily, "daily", lambda n: times[n].date()),
        (policy.weekly, "weekly", lambda n: times[n].isocalendar()[:2]),
    ]
    for count, label, key in rules:
        if count:
            for name in _bucketed(complete, count, key):
                keep(name, f"{label} {count}")
    sel.delete = [r.name for r in everything if r.name not in sel.keep]
    return sel
