"""How many copies of each rank's part of a step the cluster holds (issue #16 item 3).

Pure, over the inventories the coordinator gets with every heartbeat: the count
behind ``tierfs status``' ``copies`` line on the coordinator's node, so a user
can see that the parts a lost node held are back to their copy count after
re-replication, and which are not yet.

A copy counts when a live member that is not declared gone holds it verified
with the part's digest: the owner's own digest when the owner is live and holds
its part, else the digest most holders have (a stale or damaged copy with
other bytes is not a copy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from tierfs.core.types import Holding


def copy_counts(
    inventories: Mapping[int, Iterable[Holding]],
    step: int,
    live: Callable[[int], bool],
    gone: frozenset[int] = frozenset(),
    writers: int = 0,
) -> dict[int, int]:
    """Rank -> the number of live members holding a verified copy of that rank's
    part of ``step`` (its own copy included), for every rank of which some live
    member holds one and, with ``writers``, 0 for each other rank below it;
    ranks in ``gone`` are not counted as holders.

    Args:
        inventories: member rank -> its inventory (own parts and replicas).
        step: the step to count.
        live: whether a member rank was heard from recently.
        gone: member ranks declared gone for good.
        writers: the node count that wrote the step (0: unknown; then the
            largest ``nodes`` any holding of the step names is used).

    Cost: O(holdings) of the inventories.
    """
    digests: dict[int, Counter[str]] = {}
    holders: dict[tuple[int, str], set[int]] = {}
    own: dict[int, str] = {}
    named = writers
    for member, inventory in inventories.items():
        if member in gone or not live(member):
            continue
        for h in inventory:
            if h.step != step or not h.verified:
                continue
            if not writers:
                named = max(named, h.nodes)
            digests.setdefault(h.rank, Counter())[h.digest] += 1
            holders.setdefault((h.rank, h.digest), set()).add(member)
            if h.rank == member:
                own[h.rank] = h.digest
    out: dict[int, int] = {}
    for rank, seen in digests.items():
        digest = own.get(rank) or seen.most_common(1)[0][0]
        out[rank] = len(holders[(rank, digest)])
    for rank in range(named):
        out.setdefault(rank, 0)
    return dict(sorted(out.items()))


def copies_line(step: int, counts: Mapping[int, int], shown: int = 8) -> str:
    """One line for ``tierfs status``: ``step 4: 2 copies of every rank's part``,
    ``step 4: 1-2 copies; fewest (1): rank(s) [2, 3]`` (at most ``shown`` ranks), or
    with a rank counted 0 ``step 4: incomplete: no copy of rank(s) [3]'s part on a
    live node; the others: 2 copies of every rank's part``."""
    if not counts or not any(counts.values()):
        return f"step {step}: no verified copy known"
    lost = [r for r, n in counts.items() if n == 0]
    if lost:
        more = f" (+{len(lost) - shown} more)" if len(lost) > shown else ""
        held = {r: n for r, n in counts.items() if n}
        rest = copies_line(step, held, shown).split(": ", 1)[1]
        return (
            f"step {step}: incomplete: no copy of rank(s) {lost[:shown]}{more}'s part "
            f"on a live node; the others: {rest}"
        )
    low, high = min(counts.values()), max(counts.values())
    if low == high:
        return f"step {step}: {low} {'copy' if low == 1 else 'copies'} of every rank's part"
    fewest = [r for r, n in counts.items() if n == low]
    more = f" (+{len(fewest) - shown} more)" if len(fewest) > shown else ""
    return f"step {step}: {low}-{high} copies; fewest ({low}): rank(s) {fewest[:shown]}{more}"
