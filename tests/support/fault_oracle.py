"""The fault campaign's ground truth and oracle: pure functions over plain data.

No mounts, no processes, no bucket here (``tests/support/fault_campaign.py`` gathers
the data; ``tests/cluster/test_fault_campaign.py`` unit-tests these rules).

Ground truth
------------
Every save of a step by the campaign's trainers is one *save event* with a
global sequence number ``seq`` (one per step and attempt, shared by the ranks
that save it together). The bytes a rank writes are a pure function of
(campaign seed, seq, rank, step), so the test knows the exact bytes of every
rank of every version without asking tierfs. A :class:`Version` is complete
when every rank sealed it (a save that failed, e.g. with ENOSPC, leaves the
version incomplete). When the cluster restores version V, every later save
(``seq > V.seq``) is *abandoned* history; a fresh start abandons everything.

Copies (what the oracle may count)
----------------------------------
Just before a fault the campaign takes a snapshot. A RAM copy of (rank r,
step S) on node h counts only if **both** h's ``tierfs status`` lists it (for
h == r: S among its steps with ``local``; else: S of rank r among its
``replicas``) **and** the bytes under h's ``store/shards/<job>/<r>/<S>/data``
are exactly the bytes of one version's rank r. Then :func:`counted_copies`
drops copies that ``--keep-local`` retention may remove before the restore:
a copy with ``keep_local`` or more newer versions of its rank that are held
on h or still on their way to h (h is r or r's replica target, and r sealed
a non-abandoned newer version) does not count. A bucket round counts when
the campaign's own read of the bucket (google-cloud-storage, not tierfs)
finds for every rank its ``.meta`` naming data objects with exactly the
bytes of one version's rank, the same version for every rank (the ``.meta``
is written last, so this is a complete round). What each node's ``tierfs
status`` reported backed up is kept as its claim; a round every node claimed
that the bucket contradicts fails the injection.

The fault then destroys copies: node loss (every copy on that node), cluster
loss (every RAM copy), a flipped bit in a replica (that copy), a flipped bit
in a bucket object (the whole round), a stalled bucket (every round, for the
restore that runs while it is stalled). Nothing else destroys anything
(kill -9 and SIGSTOP of a daemon keep its RAM; ENOSPC only makes the new
version incomplete).

The rule (what a restore must achieve)
--------------------------------------
From the copies that survive, :func:`expected_restore` derives

* C: the newest (by ``seq``) non-abandoned complete version of which every
  rank has a surviving RAM copy (own or replica) -- "complete in the
  cluster";
* B: the newest non-abandoned version of a surviving complete round;
* the floor E = C if C exists, else B (else nothing). This is tierfs's
  documented order (docs/BACKUPS.md "Limits": the newest step complete in
  the cluster wins over a newer step only a backup holds); it demands no
  mixing of tiers per rank and never a copy the snapshot could not prove.

A restore passes when

1. every node restored the same step (MTC: the marker each trainer takes;
   generic: the step ``tierfs wait`` reports, and every node, the survivors
   too, presents ``checkpoint-<step>``);
2. on every node that step's bytes are exactly the bytes of one version's
   rank, the same version on every node;
3. that version is not older than E (``seq >= E.seq``); a restore of nothing
   passes only when E is nothing;
4. a fallback is explained. N is the newest non-abandoned version of which
   the restore can still see something: a RAM copy of any rank on a node
   that kept its RAM (corrupt copies included), or, when nothing is complete
   in the cluster (no C) and the bucket answers, a round (corrupt rounds
   included). If the restored version is older than N, or nothing was
   restored while N exists, some node's ``replicator.errors`` got a line
   during the restore that names the restore (``restore``) or step N; a
   fresh start while N exists also needs a ``tierfs wait`` that exits
   non-zero on some node (issue 19, case 5). A step whose every copy the
   fault destroyed needs no explanation (nothing is left to tell of it), nor
   does a newer round skipped because C exists (the documented order).

The restored version may be newer than E (the snapshot is conservative: a
copy that completed after it is real), never other bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

#: RAM copy: (holder node, rank, step, seq of the version its bytes are)
Copy = tuple[int, int, int, int]


@dataclass
class Version:
    """One save event of one step by the ranks of a job.

    Attributes:
        seq: global sequence number of the save event (larger is later).
        step: the step number the trainers wrote.
        epoch: the campaign epoch (one job name per epoch).
        digests: rank -> sha256 digest of the files that rank sealed.
        abandoned: a later restore chose an older version (or nothing).
    """

    seq: int
    step: int
    epoch: int
    digests: dict[int, str] = field(default_factory=dict)
    abandoned: bool = False

    def complete(self, nodes: int) -> bool:
        """True when every rank 0..nodes-1 sealed this version."""
        return all(r in self.digests for r in range(nodes))


class GroundTruth:
    """Every version the campaign's trainers saved, kept outside tierfs."""

    def __init__(self) -> None:
        self.versions: dict[int, Version] = {}
        self._by_bytes: dict[tuple[int, int, int, str], int] = {}
        self._seq = 0

    def new_version(self, step: int, epoch: int) -> Version:
        """A new save event of ``step``; ranks add themselves with :meth:`sealed`."""
        self._seq += 1
        v = Version(self._seq, step, epoch)
        self.versions[v.seq] = v
        return v

    def sealed(self, v: Version, rank: int, digest: str) -> None:
        """Rank ``rank`` saved ``v`` with files of sha256 digest ``digest``."""
        v.digests[rank] = digest
        self._by_bytes[(v.epoch, rank, v.step, digest)] = v.seq

    def identify(self, epoch: int, rank: int, step: int, digest: str) -> Version | None:
        """The version whose rank ``rank`` wrote exactly these bytes as ``step``."""
        seq = self._by_bytes.get((epoch, rank, step, digest))
        return self.versions.get(seq) if seq is not None else None

    def restored(self, epoch: int, seq: int | None) -> None:
        """The cluster went on from version ``seq`` (None: a fresh start)."""
        for v in self.versions.values():
            if v.epoch == epoch and (seq is None or v.seq > seq):
                v.abandoned = True


def counted_copies(
    listed: Iterable[Copy],
    versions: dict[int, Version],
    targets: dict[int, list[int]],
    keep_local: int,
) -> set[Copy]:
    """The listed RAM copies that ``--keep-local`` retention cannot drop before the restore.

    Args:
        listed: copies the status lists and whose bytes match a version.
        versions: the ground truth (seq -> version).
        targets: rank -> the nodes it replicates to.
        keep_local: ``--keep-local`` (sealed steps per rank kept per node).

    Returns:
        the copies that count (a subset of ``listed``).
    """
    listed = set(listed)
    out = set()
    for holder, rank, step, seq in listed:
        newer = {s for h, r, _st, s in listed if h == holder and r == rank and s > seq}
        if holder == rank or holder in targets.get(rank, []):
            newer |= {
                v.seq
                for v in versions.values()
                if rank in v.digests and v.seq > seq and not v.abandoned
            }
        if len(newer) < keep_local:
            out.add((holder, rank, step, seq))
    return out


@dataclass(frozen=True)
class Expectation:
    """What a restore after a fault must reach.

    Attributes:
        floor: seq of E (None: nothing is provably complete).
        floor_step: E's step.
        where: "cluster" (E = C), "bucket" (E = B) or "" (nothing).
        newest: seq of N, the newest non-abandoned version the restore can still see
            something of (None: nothing; a fresh start is then truly fresh).
        newest_step: N's step.
        detail: one line for the record (C, B, N and the destroyed copies).
    """

    floor: int | None
    floor_step: int | None
    where: str
    newest: int | None
    newest_step: int | None
    detail: str


def expected_restore(
    copies: set[Copy],
    rounds: dict[str, int],
    versions: dict[int, Version],
    nodes: int,
    *,
    lost_nodes: Iterable[int] = (),
    bad_copies: Iterable[Copy] = (),
    bad_rounds: Iterable[str] = (),
    bucket_usable: bool = True,
    all_copies: Iterable[Copy] = (),
) -> Expectation:
    """The oracle's floor E and the newest version N (see the module docstring).

    Args:
        copies: counted RAM copies (:func:`counted_copies`) before the fault.
        rounds: verified complete bucket rounds before the fault: round -> seq.
        versions: the ground truth.
        nodes: the job's node count.
        lost_nodes: nodes whose RAM the fault wiped.
        bad_copies: RAM copies the fault corrupted.
        bad_rounds: rounds the fault corrupted.
        bucket_usable: False while the bucket is stalled for the whole restore.
        all_copies: every listed copy (counted or not), for N.
    """
    lost = set(lost_nodes)
    bad = set(bad_copies)
    live = {c for c in copies if c[0] not in lost and c not in bad}
    held: dict[int, set[int]] = {}
    for _h, rank, _step, seq in live:
        held.setdefault(seq, set()).add(rank)
    cluster = [
        s
        for s, ranks in held.items()
        if len(ranks) == nodes and not versions[s].abandoned and versions[s].complete(nodes)
    ]
    usable = {r: s for r, s in rounds.items() if r not in set(bad_rounds)} if bucket_usable else {}
    bucket = [s for s in usable.values() if not versions[s].abandoned]
    c = max(cluster, default=None)
    b = max(bucket, default=None)
    floor, where = (c, "cluster") if c is not None else (b, "bucket" if b is not None else "")
    # what the restore can see: copies on nodes that kept their RAM (corrupt ones too),
    # and, when nothing is complete in the cluster, the bucket's rounds (corrupt ones too)
    seen = {cp[3] for cp in set(all_copies) | set(copies) if cp[0] not in lost}
    if c is None and bucket_usable:
        seen |= set(rounds.values())
    newest = max((s for s in seen if not versions[s].abandoned), default=None)

    def name(seq: int | None) -> str:
        return "-" if seq is None else f"step {versions[seq].step} (seq {seq})"

    detail = (
        f"C={name(c)} B={name(b)} N={name(newest)}; lost nodes {sorted(lost)}; "
        f"corrupt copies {sorted(bad)}; corrupt rounds {sorted(set(bad_rounds))}; "
        f"bucket {'usable' if bucket_usable else 'stalled'}"
    )
    return Expectation(
        floor,
        versions[floor].step if floor is not None else None,
        where,
        newest,
        versions[newest].step if newest is not None else None,
        detail,
    )


@dataclass
class NodeRestore:
    """What one node restored, as the campaign observed it.

    Attributes:
        step: the restored step (None: nothing).
        seq: the version its bytes are (None: nothing, or bytes of no version).
        error: why the node has no usable outcome (timeout, replicator.failed,
            wrong bytes, a survivor lacking the agreed step), or "".
        errors: ``replicator.errors`` lines the node wrote during the restore.
        wait_rc: exit status of ``tierfs wait`` (None: not run).
        said: what ``tierfs wait`` printed, for the record.
    """

    step: int | None
    seq: int | None = None
    error: str = ""
    errors: list[str] = field(default_factory=list)
    wait_rc: int | None = None
    said: str = ""


def judge(
    outcomes: dict[int, NodeRestore], exp: Expectation, versions: dict[int, Version]
) -> list[str]:
    """Why a restore fails the rule (empty: it passes). See the module docstring."""
    if not outcomes:
        return ["no node reported an outcome"]
    problems = [f"node {i}: {o.error}" for i, o in sorted(outcomes.items()) if o.error]
    steps = {i: o.step for i, o in outcomes.items()}
    if len(set(steps.values())) > 1:
        problems.append(
            "split restore: " + ", ".join(f"node {i} step {s}" for i, s in sorted(steps.items()))
        )
    seqs = {o.seq for o in outcomes.values() if o.step is not None and not o.error}
    if len(seqs) > 1 and len(set(steps.values())) == 1:
        problems.append(f"nodes restored bytes of different saves of one step (seq {sorted(seqs)})")
    if problems:
        return problems
    step = next(iter(steps.values()))
    seq = next(iter(seqs), None)
    if step is None:
        if exp.floor is not None:
            problems.append(
                f"fresh start although step {exp.floor_step} (seq {exp.floor}) was "
                f"provably complete ({exp.where}): {exp.detail}"
            )
    elif exp.floor is not None and seq is not None and seq < exp.floor:
        problems.append(
            f"restored step {step} (seq {seq}), older than step {exp.floor_step} "
            f"(seq {exp.floor}) provably complete ({exp.where}): {exp.detail}"
        )
    if exp.newest is not None and (seq is None or seq < exp.newest):
        lines = [ln for o in outcomes.values() for ln in o.errors]
        said = any("restore" in ln or f"step {exp.newest_step}" in ln for ln in lines)
        what = "fresh start" if step is None else f"fallback to step {step}"
        if not said:
            problems.append(
                f"unexplained {what}: step {exp.newest_step} (seq {exp.newest}) "
                "existed before the fault, no replicator.errors line names the "
                "restore or that step"
            )
        if step is None and not any((o.wait_rc or 0) != 0 for o in outcomes.values()):
            problems.append(
                f"fresh start while step {exp.newest_step} existed, but every "
                "`tierfs wait` exited 0"
            )
    return problems
