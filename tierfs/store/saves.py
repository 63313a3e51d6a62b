"""Which parts of one step number are of one save (pure; issue #16, ninth trial).

A job may save one step number again in place (``dcp.save`` into the same
directory). The parts of that step then come from two saves, and nothing in
their bytes says which: a rank whose new save never happened (its process
crashed, or its node died before its new part was copied anywhere) leaves its
*earlier* part beside the other ranks' new ones, and a load of that mix
returns two saves' values without an error.

Two signs tell an earlier part apart (both from the manifests, never from a
claim of the job):

* **listed**: another part of the step lists it in
  :attr:`tierfs.store.manifest.Manifest.replaces` (that node held it when its
  new save began, :mod:`tierfs.node.resave`), unless a part of those very
  bytes lists itself (the rank saved identical bytes again);
* **unchanged**: the part has the very digest its rank's part had before the
  newest save of the step began (``prior``: what the judging node saw of the
  earlier save), and is not a part of identical bytes saved again (one that
  lists itself as replaced); and, as a check, it was sealed before that save
  began, its own save :data:`RESAVE_GAP` or more before it (:func:`older_than`).
  A rank that saved the step again has other bytes, however late it began
  (tenth trial: a rank 8-25 s late is of the same save). Without ``prior``
  (a daemon restarted since) only the first sign is used.

:func:`earlier_parts` is used by the whole-step view (the node's opens of such
a part's files fail with EIO, :mod:`tierfs.node.remote_view`) and by the
judge across ranks (such a step is not judged loadable,
:mod:`tierfs.node.whole_step`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tierfs.store.manifest import Manifest

__all__ = ["RESAVE_GAP", "earlier_parts", "listed_replaced", "older_than", "sealed_at"]

#: seconds after its seal from which a write into a sealed part begins another save
#: of the step (earlier: a late write of the same save, e.g. a file rewritten)
RESAVE_GAP = 10.0


def sealed_at(m: Manifest) -> float:
    """When ``m`` was sealed (Unix seconds): its ``sealed``, else its ``created``."""
    return m.sealed or m.created


def listed_replaced(manifests: Iterable[Manifest]) -> set[tuple[int, str]]:
    """The (node rank, digest) pairs that any of ``manifests`` lists as replaced by its
    save, less the pairs a part of those very bytes lists itself (its rank saved
    identical bytes again): the parts of an earlier save of the step."""
    listed: set[tuple[int, str]] = set()
    renewed: set[tuple[int, str]] = set()
    for m in manifests:
        listed.update(m.replaces)
        if (m.rank, m.digest) in m.replaces:
            renewed.add((m.rank, m.digest))
    return listed - renewed


def older_than(m: Manifest, began: float) -> bool:
    """True if part ``m`` is of a save earlier than one begun at ``began`` (Unix
    seconds; 0: no save began again): sealed before it, and its own save began at
    least ``RESAVE_GAP`` before it (a part of a first save began at 0).

    The margin is the whole gap between two saves of a step: a part of the same
    save as ``began`` would have to start writing 10 s before that save's other
    rank and finish before it started (DCP's ranks start writing together, after
    its collective plan), while an earlier save's part began at least that long
    before."""
    return began > 0 and sealed_at(m) < began and m.began <= began - RESAVE_GAP


def earlier_parts(
    manifests: Iterable[Manifest],
    also_listed: Iterable[Manifest] = (),
    prior: Mapping[int, str] | None = None,
) -> dict[int, str]:
    """The parts among ``manifests`` (one per rank of one step and node count) that are
    of an earlier save of the step than another part of them (see the module doc).

    Args:
        manifests: the parts to judge (rank -> at most one).
        also_listed: more parts of the step whose ``replaces`` lists count (copies
            held here of other saves, this node's own part); they are not judged.
        prior: rank -> the digest of its part of the step the judging node knew
            before the newest save began (None: not known; then only the
            ``replaces`` sign).

    Returns:
        node rank -> why, one line naming the part and the sign (empty: one save).
        O(number of parts + pairs listed).
    """
    parts = list(manifests)
    listed = listed_replaced([*parts, *also_listed])
    renewed = {(m.rank, m.digest) for m in parts if (m.rank, m.digest) in m.replaces}
    newest = max(parts, key=lambda m: m.began, default=None)
    out: dict[int, str] = {}
    for m in parts:
        lister = (m.rank, m.digest) in listed
        if lister:
            out[m.rank] = (
                f"rank {m.rank}'s part {m.digest[:12]} is of an earlier save of the step "
                "(another part lists it as replaced)"
            )
        elif (
            prior is not None
            and prior.get(m.rank) == m.digest
            and (m.rank, m.digest) not in renewed
            and newest is not None
            and m is not newest
            and older_than(m, newest.began)
        ):
            out[m.rank] = (
                f"rank {m.rank}'s part {m.digest[:12]} is of an earlier save of the step "
                f"(unchanged since before rank {newest.rank} began saving it again)"
            )
    return out
