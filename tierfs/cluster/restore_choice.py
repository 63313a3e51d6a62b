"""Which step a job restores, and from which copies (PROTOCOL.md section 4): pure policy.

One rule for every tier: the chosen step is the newest one for which **every**
node rank has a good copy somewhere -- in a node's RAM (its own shard or a
peer's replica) or in a backup round in the bucket -- counting only copies
not found bad so far. Each rank then gets an ordered list of sources: its
own copy, the peers holding the same bytes (nearest on the ring first), the
backup rounds holding the same bytes (newest first). A node whose sources
all fail reports the copies it found bad, and the step is chosen again
without them (:class:`tierfs.cluster.coordinator.Coordinator` runs that loop).

Which bytes a rank restores (its *digest*, :attr:`tierfs.store.manifest.Manifest.digest`):
the owner's own copy if it holds one, else the digest most nodes hold, else
the newest backup round's. Copies with another digest are other bytes and
are never mixed in. A backup round is used for a step only if it agrees with
every digest chosen from RAM for that step (else it belongs to another
generation of the step, e.g. from before a rollback), and a round is
*superseded* -- never used -- when a later round, or a shard sealed after
it, holds a smaller step (the job was rolled back after that round). A rank
with no copy in RAM takes its part from a round written as one save of the
step: one that holds a part of every node rank, or one sharing a part with
the RAM copies; ranks without RAM copies take the same such round where one
covers them all. Parts of half-written rounds are never combined with each
other: two failed rounds of one step may hold different saves of it.

A step whose chosen bytes for some rank were judged at seal as never
loadable (:attr:`Holding.unloadable`: a damaged file, an unfinished save;
in a one-node job also :attr:`Holding.missing`, a file no other rank will
bring) is skipped like an incomplete one, its reason among the problems
(issue #15). The judgement is per copy's bytes (its digest), so a backup
round with the same bytes is skipped too.

Writer topology (issue #16): every copy records the node count of the job
that wrote its step (:attr:`Holding.nodes`, :attr:`BucketPart.nodes`; 0,
unknown, reads as the restoring job's). A step written by W nodes is complete
when every rank 0..W-1 has a good copy, whatever node count N restores it:
after a shrink (W > N) ranks N..W-1 are restored by nobody and read through
the whole-step view; after a growth (W < N) node ranks W..N-1 hold no part
of the step. Copies of one step number written by different node counts are
different steps (different saves): each is judged alone and never mixed, and
of two complete ones the newer seal wins. The newest complete step is taken
whatever its W, so a resize never drops a newer complete step.

One step number saved again in place (issue #16 F9): every copy records the
parts of an earlier save its own save replaced (:attr:`Holding.replaces`,
:mod:`tierfs.node.resave`). A copy some copy of the same save lists as
replaced is never used -- a rank left with only such copies makes the step
incomplete ("only an earlier save ... is left"), never a mix of two saves --
unless a copy of those very bytes lists them itself (the rank saved identical
bytes again).

``restore.version`` (:attr:`BucketView.forced`) replaces the rule: exactly
the named round's step, each rank from that round or from a copy with the
same bytes; if that is impossible, nothing (no fallback).

The answer also classifies a "nothing": *fresh* (no node and no bucket holds
anything of the job) or *incomplete* (something exists but no step is
complete, or the bucket could not be read), with one line per reason, so a
fresh start is never silent (issue #19).
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from tierfs.core.types import FRESH as FRESH
from tierfs.core.types import INCOMPLETE as INCOMPLETE
from tierfs.core.types import OLDER as OLDER
from tierfs.core.types import RESTORED as RESTORED
from tierfs.core.types import SAVED_AGAIN
from tierfs.core.types import BucketPart as BucketPart
from tierfs.core.types import BucketView as BucketView
from tierfs.core.types import CopyId as CopyId
from tierfs.core.types import Holder as Holder
from tierfs.core.types import Holding as Holding

#: seconds a round's name (its UTC minute) may lag behind the seals it follows
ROUND_NAME_SLACK = 120.0


@dataclass(frozen=True)
class Choice:
    """A restore decision.

    Attributes:
        step: the step every node restores, or None for "nothing".
        holders: shard rank -> node ranks holding the chosen copy in RAM, verified.
        rounds: shard rank -> backup rounds holding the chosen copy (newest first).
        digests: shard rank -> the chosen copy's digest ("" unknown).
        reason: one human line (what was chosen and why).
        backup: the newest backup round some rank restores from (a forced
            choice: the named round), else None.
        forced: the round ``restore.version`` named when it made this choice
            (then ``step`` None means "nothing, no fallback").
        outcome: :data:`RESTORED` (the newest step), :data:`OLDER` (an older
            step: newer ones are incomplete or would not load, ``problems``
            say why), :data:`FRESH` (nothing exists anywhere) or
            :data:`INCOMPLETE` (something exists, no step is complete).
        problems: lines for ``replicator.errors``: why newer steps could not be
            restored, an unreadable bucket (empty for the newest step of all).
        writers: the node count that wrote ``step`` (its writer topology; the
            keys of ``holders`` are 0..writers-1); 0 for "nothing".
    """

    step: int | None
    holders: dict[int, tuple[int, ...]] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    reason: str = ""
    backup: str | None = None
    forced: str | None = None
    rounds: dict[int, tuple[str, ...]] = field(default_factory=dict)
    outcome: str = RESTORED
    problems: tuple[str, ...] = ()
    writers: int = 0


def writers_of(copy: Holding | BucketPart, nodes: int) -> int:
    """The node count that wrote ``copy``'s step: the one it records, else ``nodes``
    (the restoring job's; a copy from before the count was recorded). Pure."""
    return copy.nodes if copy.nodes > 0 else nodes


def round_time(name: str) -> float | None:
    """Unix time of a round name ``YYYY-MM-DD_HH-MM`` (UTC), None if it is not one."""
    try:
        return float(calendar.timegm(time.strptime(name, "%Y-%m-%d_%H-%M")))
    except ValueError:
        return None


def _ranks(ranks: Iterable[int]) -> str:
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"


def _holder_name(holder: Holder) -> str:
    return f"node-rank {holder}" if isinstance(holder, int) else f"backup round {holder}"


def superseded(
    parts: Iterable[BucketPart], inventories: Mapping[int, Iterable[Holding]]
) -> set[str]:
    """Rounds of an abandoned history: a later round holds a complete part of a
    smaller step, or some node holds a smaller step sealed after the round
    (plus :data:`ROUND_NAME_SLACK`). Pure."""
    steps: dict[str, set[int]] = {}
    for p in parts:
        steps.setdefault(p.round, set()).add(p.step)
    sealed = [(h.created, h.step) for held in inventories.values() for h in held if h.created > 0]
    out = set()
    names = sorted(steps)
    for i, name in enumerate(names):
        top = max(steps[name])
        if any(min(steps[later]) < top for later in names[i + 1 :]):
            out.add(name)
            continue
        at = round_time(name)
        if at is not None and any(s < top and t > at + ROUND_NAME_SLACK for t, s in sealed):
            out.add(name)
    return out


@dataclass
class _StepPlan:
    holders: dict[int, tuple[int, ...]]
    rounds: dict[int, tuple[str, ...]]
    digests: dict[int, str]
    missing: list[int]
    notes: list[str]


def _plan_step(
    writers: int,
    step: int,
    cluster: Mapping[int, Mapping[str, set[int]]],
    parts: list[BucketPart],
    whole: AbstractSet[tuple[str, int]] = frozenset(),
) -> _StepPlan:
    """Per rank 0..writers-1: the digest to restore and every good copy of it (see the
    module doc).

    ``whole``: the (round, step) pairs with a part of every node rank in the
    bucket, bad copies included (the round was written as one save of the step).
    """
    digests: dict[int, str] = {}
    holders: dict[int, tuple[int, ...]] = {}
    for r in range(writers):
        copies = cluster.get(r)
        if not copies:
            continue
        own = sorted(d for d, hs in copies.items() if r in hs)
        digest = own[0] if own else sorted(copies, key=lambda d: (-len(copies[d]), d))[0]
        digests[r] = digest
        holders[r] = tuple(sorted(copies[digest]))
    by_round: dict[str, dict[int, str]] = {}
    for p in parts:
        by_round.setdefault(p.round, {})[p.rank] = p.digest
    notes = []
    consistent = []
    for name in sorted(by_round, reverse=True):
        clash = [
            r
            for r, d in by_round[name].items()
            if r in digests and d and digests[r] and d != digests[r]
        ]
        if clash:
            notes.append(
                f"backup round {name} holds other bytes of step {step} for rank(s) "
                f"{_ranks(clash)} than the nodes' RAM (another generation); not used"
            )
        else:
            consistent.append(name)
    rounds: dict[int, tuple[str, ...]] = {}
    for r in digests:
        rounds[r] = tuple(n for n in consistent if digests[r] and by_round[n].get(r) == digests[r])

    def linked(name: str) -> bool:
        # one of the round's parts has the bytes chosen from RAM: the same generation
        return any(digests.get(r) and d == digests[r] for r, d in by_round[name].items())

    # a rank without a copy in RAM comes from a round that was complete for every
    # node (its parts were uploaded together, from one generation of the step) or
    # that shares a part with the RAM copies; never from a half-written round of
    # another save of the step (seed 7 #39: rank 1's part of an old failed round
    # combined with the other ranks' parts of a newer one)
    needed = [r for r in range(writers) if r not in digests]
    usable = [n for n in consistent if (n, step) in whole or linked(n)]
    anchor = next((n for n in usable if all(r in by_round[n] for r in needed)), None)
    for r in needed:
        first = (
            anchor
            if anchor is not None
            else next((n for n in usable if r in by_round[n] and linked(n)), None)
        )
        if first is None:
            continue
        digests[r] = by_round[first][r]
        rounds[r] = (
            first,
            *(n for n in usable if n != first and digests[r] and by_round[n].get(r) == digests[r]),
        )
    missing = [r for r in range(writers) if r not in digests]
    # name the ranks no usable round holds at all; when each has a part somewhere
    # but no round holds them together, say that the parts were not combined
    absent = [r for r in missing if not any(r in by_round[n] for n in usable)]
    if missing and not absent:
        notes.append(
            f"step {step}: no backup round holds rank(s) {_ranks(missing)} together "
            "and parts of different rounds are not combined (they may be different "
            "saves of the step)"
        )
    return _StepPlan(holders, rounds, digests, absent or missing, notes)


def _whole_rounds(nodes: int, parts: Iterable[BucketPart]) -> set[tuple[str, int]]:
    """(round, step) pairs holding a part of every rank of the node count that wrote
    them (:func:`writers_of`)."""
    ranks: dict[tuple[str, int, int], set[int]] = {}
    for p in parts:
        ranks.setdefault((p.round, p.step, writers_of(p, nodes)), set()).add(p.rank)
    return {(r, s) for (r, s, w), rs in ranks.items() if rs >= set(range(w))}


def _describe(
    step: int, plan: _StepPlan, bad: set[CopyId], stale: AbstractSet[int] = frozenset()
) -> str:
    line = f"step {step} lacks rank(s) {_ranks(plan.missing)}"
    found = sorted({_holder_name(h) for h, r, s in bad if s == step and r in plan.missing})
    if found:
        line += f" (bad copies: {', '.join(found)})"
    older = sorted(r for r in plan.missing if r in stale)
    if older:
        line += (
            f" (rank(s) {_ranks(older)}: only a part of an earlier save of step {step} "
            "is left; the step was saved again, and no node or backup round holds the "
            "new save's part)"
        )
    return line


#: (step, writers) -> the (rank, digest) pairs of an earlier save of that step
Replaced = dict[tuple[int, int], set[tuple[int, str]]]


def replaced_copies(nodes: int, copies: Iterable[Holding | BucketPart]) -> Replaced:
    """(step, writers) -> the (rank, digest) pairs some copy of that save lists as
    replaced by its save (:attr:`Holding.replaces`), less the pairs a copy of those
    very bytes lists itself (the rank saved identical bytes again). Pure."""
    listed: Replaced = {}
    renewed: set[tuple[int, int, int, str]] = set()
    for c in copies:
        if not c.replaces:
            continue
        key = (c.step, writers_of(c, nodes))
        listed.setdefault(key, set()).update(c.replaces)
        if (c.rank, c.digest) in c.replaces:
            renewed.add((*key, c.rank, c.digest))
    return {k: {p for p in v if (*k, *p) not in renewed} for k, v in listed.items()}


def _is_replaced(nodes: int, c: Holding | BucketPart, replaced: Replaced) -> bool:
    return (c.rank, c.digest) in replaced.get((c.step, writers_of(c, nodes)), ())


def _table(
    nodes: int,
    inventories: Mapping[int, Iterable[Holding]],
    bad: set[CopyId],
    replaced: Replaced | None = None,
) -> dict[tuple[int, int], dict[int, dict[str, set[int]]]]:
    """(step, writers) -> rank -> digest -> holders, of the verified copies not found
    bad and not replaced by another save (``writers``: :func:`writers_of`; ranks
    outside [0, writers) are ignored)."""
    table: dict[tuple[int, int], dict[int, dict[str, set[int]]]] = {}
    for holder, held in inventories.items():
        for h in held:
            w = writers_of(h, nodes)
            if not h.verified or not 0 <= h.rank < w or h.step < 0:
                continue
            if (holder, h.rank, h.step) in bad:
                continue
            if replaced and _is_replaced(nodes, h, replaced):
                continue
            copies = table.setdefault((h.step, w), {}).setdefault(h.rank, {})
            copies.setdefault(h.digest, set()).add(holder)
    return table


def _seals(
    inventories: Mapping[int, Iterable[Holding]], nodes: int
) -> dict[tuple[int, int], float]:
    """(step, writers) -> the latest seal time of a copy held in RAM (0.0 unknown)."""
    out: dict[tuple[int, int], float] = {}
    for held in inventories.values():
        for h in held:
            key = (h.step, writers_of(h, nodes))
            out[key] = max(out.get(key, 0.0), h.created)
    return out


def _unloadable(
    nodes: int, inventories: Mapping[int, Iterable[Holding]], parts: Iterable[BucketPart] = ()
) -> dict[tuple[int, int, str], str]:
    """(step, rank, digest) -> why those bytes never load (see the module doc), from
    the nodes' inventories and the verdicts in the bucket's manifests."""
    out: dict[tuple[int, int, str], str] = {}
    copies: list[Holding | BucketPart] = [h for held in inventories.values() for h in held]
    copies += parts
    for h in copies:
        why = h.unloadable or (h.missing if writers_of(h, nodes) == 1 else "")
        if why and h.digest:
            out.setdefault((h.step, h.rank, h.digest), why)
    return out


def _whole(
    nodes: int, inventories: Mapping[int, Iterable[Holding]]
) -> dict[tuple[int, tuple[str, ...]], str]:
    """(step, every rank's digest) -> why those parts together never load, for the
    steps a holder judged across ranks (:mod:`tierfs.node.whole_step`)."""
    out: dict[tuple[int, tuple[str, ...]], str] = {}
    for held in inventories.values():
        for h in held:
            if h.whole_unloadable and len(h.whole_digests) == writers_of(h, nodes):
                out.setdefault((h.step, tuple(h.whole_digests)), h.whole_unloadable)
    return out


def _not_loadable(
    step: int,
    digests: Mapping[int, str],
    unloadable: Mapping[tuple[int, int, str], str],
    whole: Mapping[tuple[int, tuple[str, ...]], str] | None = None,
) -> str:
    """The line saying why ``step`` is skipped, "" if its chosen bytes may load."""
    for r in sorted(digests):
        why = unloadable.get((step, r, digests[r]))
        if why:
            return f"step {step} is not loadable: {why} (rank {r}'s part)"
    chosen = tuple(digests.get(r, "") for r in range(len(digests)))
    why = (whole or {}).get((step, chosen), "")
    if why:
        return f"step {step} is not loadable across its {len(chosen)} ranks: {why}"
    return ""


def _rolled_back(tops: Mapping[str, int], step: int | None) -> list[str]:
    names = sorted(n for n, top in tops.items() if step is None or top > step)
    if not names:
        return []
    return [
        f"backup round(s) {', '.join(names)} not used: a later round or a later seal "
        "holds an older step (the job was rolled back after them)"
    ]


def _anything(
    nodes: int,
    inventories: Mapping[int, Iterable[Holding]],
    bucket: BucketView | None,
    bad: set[CopyId],
) -> bool:
    held = any(0 <= h.rank < writers_of(h, nodes) for hs in inventories.values() for h in hs)
    return held or bool(bad) or (bucket is not None and bucket.holds_anything())


def choose_restore(
    nodes: int,
    inventories: Mapping[int, Iterable[Holding]],
    bad: Iterable[CopyId] = (),
    bucket: BucketView | None = None,
    notes: Iterable[str] = (),
) -> Choice:
    """Pick the newest step with a good copy of every rank's shard (see the module doc).

    Args:
        nodes: the job's node count N (holders are node ranks 0..N-1); a step
            is judged against the node count that wrote it (:func:`writers_of`).
        inventories: holder node rank -> what it holds in RAM.
        bad: copies found corrupt or unusable (excluded).
        bucket: what the bucket holds (None: no bucket, or not read).
        notes: lines from the nodes (copies they discarded, failures) for the
            problems of a choice that is not the newest.

    Returns:
        The choice, with the outcome and the problems to report.
    """
    excluded = set(bad)
    if bucket is not None and bucket.forced is not None:
        return _choose_forced(nodes, inventories, excluded, bucket)
    all_parts = bucket.parts if bucket else ()
    replaced = replaced_copies(
        nodes, [*(h for held in inventories.values() for h in held), *all_parts]
    )
    table = _table(nodes, inventories, excluded, replaced)
    unloadable = _unloadable(nodes, inventories, bucket.parts if bucket else ())
    judged = _whole(nodes, inventories)
    for step, verdict in bucket.judged if bucket else ():
        if verdict.unloadable:  # judged over the parts uploaded (node 0's RAM may be gone)
            judged.setdefault((step, verdict.digests), verdict.unloadable)
    whole = _whole_rounds(nodes, bucket.parts if bucket else ())
    parts = [
        p
        for p in (bucket.parts if bucket else ())
        if 0 <= p.rank < writers_of(p, nodes) and (p.round, p.rank, p.step) not in excluded
    ]
    old = superseded(parts, inventories)
    old_tops = {
        p.round: max(q.step for q in parts if q.round == p.round) for p in parts if p.round in old
    }
    parts = [p for p in parts if p.round not in old]
    #: (step, writers) -> ranks with a copy of an earlier save only (set aside)
    stale: dict[tuple[int, int], set[int]] = {}
    current: set[tuple[int, int, int]] = set()
    copies: list[Holding | BucketPart] = [h for held in inventories.values() for h in held]
    for c in [*copies, *parts]:
        if _is_replaced(nodes, c, replaced):
            stale.setdefault((c.step, writers_of(c, nodes)), set()).add(c.rank)
        else:
            current.add((c.step, writers_of(c, nodes), c.rank))
    stale = {k: {r for r in rs if (*k, r) not in current} for k, rs in stale.items()}
    kept = [p for p in parts if not _is_replaced(nodes, p, replaced)]
    skipped: list[str] = []
    #: the newest step number skipped (-1: none)
    newest_skipped = -1
    notes = list(notes)
    warnings: list[str] = []
    if bucket is not None and bucket.error:
        warnings.append(f"the bucket could not be read ({bucket.error}); deciding without it")
    saved_at = _after_replaced(
        nodes,
        _saved_at(nodes, parts, _seals(inventories, nodes)),
        [h for held in inventories.values() for h in held] + list(parts),
    )
    #: (step, writers) -> why, of the saves skipped so far
    passed: dict[tuple[int, int], str] = {}
    for step, w in _candidates(nodes, table, kept, saved_at):
        plan = _plan_step(
            w,
            step,
            table.get((step, w), {}),
            [p for p in kept if p.step == step and writers_of(p, nodes) == w],
            whole,
        )
        if plan.missing:
            skipped.append(
                _describe(step, plan, excluded, stale.get((step, w), set())) + _topology(w, nodes)
            )
            passed[(step, w)] = skipped[-1]
            warnings.extend(plan.notes)
            newest_skipped = max(newest_skipped, step)
            continue
        unfit = _not_loadable(step, plan.digests, unloadable, judged)
        if unfit:
            skipped.append(unfit)
            passed[(step, w)] = skipped[-1]
            newest_skipped = max(newest_skipped, step)
            continue
        # the same step number saved again later (another seal or round, e.g. by
        # another node count) and that save incomplete: the older save's values come
        # back, said as an older state (regression, #16 fourth trial: exit 0 and no
        # word, with the newer save of step 20 cut off in the bucket)
        again = [
            (ww, why)
            for (s, ww), why in passed.items()
            if s == step and saved_at.get((s, ww), 0.0) > saved_at.get((step, w), 0.0)
        ]
        from_bucket = sorted(r for r in range(w) if not plan.holders.get(r))
        backup = None
        if not from_bucket:
            reason = f"step {step} is complete in the cluster"
        else:
            backup = plan.rounds[from_bucket[0]][0]
            if len(from_bucket) == w:
                reason = f"step {step} from backup round {backup}"
            else:
                reason = (
                    f"step {step}: rank(s) {_ranks(from_bucket)} from backup round "
                    f"{backup}, the others from the nodes' RAM"
                )
        reason += _topology(w, nodes)
        if skipped:
            reason += " (" + "; ".join(skipped) + ")"
        lines = skipped + plan.notes + warnings + _rolled_back(old_tops, step)
        if again:
            ww = again[0][0]
            lines.insert(
                0,
                f"step {step}{SAVED_AGAIN}{ww} node(s) after the save restored "
                f"(written by {w} nodes), and that newer save is incomplete "
                f"({again[0][1]}): the earlier save of step {step} is restored",
            )
        if skipped:
            lines += notes + (bucket.problems_above(step) if bucket is not None else [])
        holders = {r: plan.holders.get(r, ()) for r in range(w)}
        return Choice(
            step,
            holders,
            plan.digests,
            reason,
            backup,
            rounds=plan.rounds,
            # a newer save of the same step number that is incomplete makes this an
            # older state too (its values, not the ones the job saved last)
            outcome=OLDER if newest_skipped > step or again else RESTORED,
            problems=tuple(lines),
            writers=w,
        )
    anything = _anything(nodes, inventories, bucket, excluded) or bool(notes)
    if not anything and (bucket is None or not bucket.error):
        where = (
            "in RAM, on a peer or in the bucket"
            if bucket is not None
            else "in RAM or on a peer (no bucket)"
        )
        return Choice(
            None, reason=f"no step of the job exists {where}: a fresh start", outcome=FRESH
        )
    # "complete" alone would hide that the parts exist but would not load (stop 24 trial)
    unloadable_only = bool(skipped) and all(" is not loadable" in line for line in skipped)
    reason = (
        "no step would load (every rank's part exists)"
        if unloadable_only
        else "no step is complete for every rank"
    )
    why = skipped + (bucket.problems_above(None)[:2] if bucket is not None else [])
    if why:
        reason += " (" + "; ".join(why) + ")"
    if bucket is not None and bucket.error:
        reason += f" and the bucket could not be read ({bucket.error})"
    lines = (
        skipped
        + notes
        + warnings
        + _rolled_back(old_tops, None)
        + (bucket.problems_above(None) if bucket else [])
    )
    return Choice(None, reason=reason, outcome=INCOMPLETE, problems=tuple(lines))


def _saved_at(
    nodes: int, parts: Iterable[BucketPart], seals: Mapping[tuple[int, int], float]
) -> dict[tuple[int, int], float]:
    """(step, writers) -> when that save was made, as far as known (Unix seconds, 0.0
    unknown): the latest seal of a copy in RAM, else the newest backup round holding
    a part of it (round names are UTC minutes, :func:`round_time`)."""
    out = dict(seals)
    for p in parts:
        key = (p.step, writers_of(p, nodes))
        if out.get(key):
            continue
        at = round_time(p.round) or 0.0
        out[key] = max(out.get(key, 0.0), at)
    return out


def _after_replaced(
    nodes: int, saved_at: dict[tuple[int, int], float], copies: Iterable[Holding | BucketPart]
) -> dict[tuple[int, int], float]:
    """``saved_at`` with every save of a step ordered after the saves of that step whose
    parts its copies list as replaced (:attr:`Holding.replaces`): a step saved again in
    place keeps its first seal time (retention), so seal times alone can put the
    earlier save of another node count last (#16 N2 repro: every node's wait exited 2,
    ``step 20 was saved again by 4 node(s) after the save restored``, naming the
    earlier 4-node save as the newer one). Pure."""
    copies = list(copies)
    owner: dict[tuple[int, int, str], set[int]] = {}  # (step, rank, digest) -> writers
    for c in copies:
        owner.setdefault((c.step, c.rank, c.digest), set()).add(writers_of(c, nodes))
    out = dict(saved_at)
    for c in copies:
        w = writers_of(c, nodes)
        for rank, digest in c.replaces:
            for earlier in owner.get((c.step, rank, digest), ()):
                if earlier != w:
                    mine, theirs = out.get((c.step, w), 0.0), out.get((c.step, earlier), 0.0)
                    if mine <= theirs:
                        out[(c.step, w)] = theirs + 0.001
    return out


def _candidates(
    nodes: int,
    table: Mapping[tuple[int, int], object],
    parts: Iterable[BucketPart],
    saved_at: Mapping[tuple[int, int], float],
) -> list[tuple[int, int]]:
    """The (step, writers) pairs to try, best first: the newest step; of one step
    written by several node counts, the newest save (:func:`_saved_at`: the newest
    seal, else the newest backup round; regression, #16 fourth trial: after a loss
    of every RAM tier the older 4-node save of step 20 went first because it had
    more writers), then the job's own count, then the larger count."""
    keys = set(table) | {(p.step, writers_of(p, nodes)) for p in parts}
    return sorted(keys, key=lambda k: (-k[0], -saved_at.get(k, 0.0), k[1] != nodes, -k[1]))


def _topology(writers: int, nodes: int) -> str:
    """The note ``(written by W nodes; this job has N)`` when the two differ, else ""."""
    return f" (written by {writers} nodes; this job has {nodes})" if writers != nodes else ""


def _choose_forced(
    nodes: int, inventories: Mapping[int, Iterable[Holding]], bad: set[CopyId], bucket: BucketView
) -> Choice:
    """``restore.version``: the named round's step, each rank from it or the same bytes."""
    name = bucket.forced
    if name is None:
        raise ValueError("_choose_forced needs a BucketView with restore.version's round")
    step = bucket.forced_step
    if bucket.forced_problem or step is None:
        why = (
            bucket.forced_problem
            or f"restore.version names round {name}, which cannot be "
            "restored; nothing restored (no fallback)"
        )
        return Choice(None, reason=why, forced=name, outcome=INCOMPLETE, problems=(why,))
    named = [p for p in bucket.parts if p.round == name and p.step == step]
    w = max((writers_of(p, nodes) for p in named), default=nodes)
    parts = {p.rank: p.digest for p in named if (name, p.rank, step) not in bad}
    table = _table(nodes, inventories, bad).get((step, w), {})
    holders: dict[int, tuple[int, ...]] = {}
    rounds: dict[int, tuple[str, ...]] = {}
    digests: dict[int, str] = {}
    lacking = []
    for r in range(w):
        digest = parts.get(r)
        same = table.get(r, {}).get(digest, set()) if digest else set()
        if digest is None and not same:
            lacking.append(r)
            continue
        digests[r] = digest or ""
        holders[r] = tuple(sorted(same))
        rounds[r] = (name,) if r in parts else ()
    if lacking:
        why = (
            f"restore.version names round {name}, which could not be restored on every "
            f"node (rank(s) {_ranks(lacking)}: no good copy); nothing restored (no fallback)"
        )
        return Choice(None, reason=why, forced=name, outcome=INCOMPLETE, problems=(why,))
    return Choice(
        step,
        holders,
        digests,
        f"restore.version: round {name} step {step}" + _topology(w, nodes),
        backup=name,
        forced=name,
        rounds=rounds,
        writers=w,
    )


def sources_for(choice: Choice, rank: int, nodes: int) -> tuple[bool, list[int]]:
    """Where node ``rank`` gets its shard of ``choice.step`` from RAM.

    Returns:
        (local, holders): ``local`` when the node holds the chosen copy
        itself; ``holders`` the other nodes holding it, nearest first on the
        ring after ``rank`` (so several restoring nodes pull from different
        peers). The backup rounds holding it are ``choice.rounds[rank]``.
    """
    holders = choice.holders.get(rank, ())
    others = sorted((h for h in holders if h != rank), key=lambda h: (h - rank) % max(nodes, 1))
    return rank in holders, others


def needs_deeper_read(choice: Choice, bucket: BucketView | None, nodes: int) -> bool:
    """True when the bucket rounds not read yet might hold a newer complete step than
    ``choice`` (it fell below every complete round read, e.g. after bad copies)."""
    if bucket is None or bucket.exhausted or bucket.error or bucket.forced is not None:
        return False
    floor = bucket.floor(nodes)
    if floor is None:
        return bool(bucket.rounds)
    return choice.step is None or choice.step < floor
