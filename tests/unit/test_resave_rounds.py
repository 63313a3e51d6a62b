"""A step saved again under its number after a restore gets a new backup round
(issue #16, third trial's finding 2): the schedule remembers which bytes of the
step it counts as backed up (``last_parts``) across a restore and a seed."""

from __future__ import annotations

from tierfs.backup.health import seed_parts
from tierfs.backup.judge import NodeEntry, RoundInfo
from tierfs.backup.layout import NodeBackup
from tierfs.cluster import backup_schedule as S
from tierfs.store.manifest import FileEntry, Manifest

V1 = {0: "d0-v1", 1: "d1-v1", 2: "d2-v1"}
V2 = {0: "d0-v2", 1: "d1-v2", 2: "d2-v2"}
ROUND = "1970-01-01_00-10"


def due(state: S.ScheduleState, parts: dict[int, str], step: int = 40) -> str:
    """The decision's action for ``step`` with ``parts`` now in RAM (settled: far
    past the re-save's settling window)."""
    state.again_since = 0.0
    return S.decide_round(state, now=10_000.0, step=step, interval_steps=1, parts=parts).action


def backed_up_40() -> S.ScheduleState:
    return S.ScheduleState(
        started_at=0.0,
        last_round=ROUND,
        last_round_at=600.0,
        last_step=40,
        last_parts=tuple(sorted(V1.items())),
    )


def test_restored_from_the_cluster_after_a_round_of_that_step():
    # regression: the restore forgot the round's parts; the re-save read as "no new step"
    t = S.restart_timeline(backed_up_40(), backup=None, step=40, now=1000.0, parts=V1)
    assert t.last_step == 40 and dict(t.last_parts or ()) == V1
    assert due(t, V2) == S.START
    assert due(t, V1) == S.WAIT


def test_restored_from_the_round_itself():
    t = S.restart_timeline(S.ScheduleState(0.0), backup=ROUND, step=40, now=1000.0, parts=V1)
    assert due(t, V2) == S.START
    assert due(t, V1) == S.WAIT


def test_a_new_coordinator_seeded_before_the_restore():
    # every daemon restarted (the trial): the bucket is listed, then the restore decided
    st = S.ScheduleState(started_at=5000.0)
    S.apply_seed(st, (ROUND, 40), after_restore=False, parts=V1)
    assert st.last_step == 40 and dict(st.last_parts or ()) == V1
    t = S.restart_timeline(st, backup=None, step=40, now=6000.0, parts=V1)
    assert due(t, V2) == S.START
    assert due(t, V1) == S.WAIT


def test_a_new_coordinator_seeded_after_the_restore_trusts_the_bucket():
    # RAM held a second save of step 40 that the bucket never got: the restore's
    # parts are v2, the bucket's v1; the seed says what the bucket holds
    t = S.restart_timeline(S.ScheduleState(0.0), backup=None, step=40, now=1000.0, parts=V2)
    S.apply_seed(t, (ROUND, 40), after_restore=True, parts=V1)
    assert dict(t.last_parts or ()) == V1
    assert due(t, V2) == S.START


def test_a_seed_of_another_step_leaves_the_parts_alone():
    t = S.restart_timeline(backed_up_40(), backup=None, step=40, now=1000.0, parts=V1)
    S.apply_seed(t, ("1970-01-01_00-05", 30), after_restore=True, parts={0: "x"})
    assert t.last_step == 30  # the interval counts from the older complete round
    assert due(t, V2) == S.START  # step 40 is newer than 30 anyway


def test_the_round_book_backs_up_a_step_saved_again_after_a_restore():
    book = S.RoundBook()
    book.reset("job", 3, 0.0)
    book.seed("job", ROUND, (ROUND, 40), V1)
    book.restored(None, 40, 6000.0, parts=V1)
    held = dict(V2)
    d = book.tick(6001.0, step=40, interval_steps=1, holders=lambda step: held)
    assert d.action == S.START and d.step == 40, d
    assert "saved again" in d.reason
    assert book.order_for(0) == (d.round, 40)
    assert d.round is not None and d.round > ROUND


def test_seed_parts_are_the_complete_steps_manifest_digests():
    def entry(rank: int, step: int, crc: int) -> NodeEntry:
        m = Manifest(
            job="job",
            rank=rank,
            step=step,
            name="40",
            framework="generic",
            files=[FileEntry("a", "file", 1, crc32c=crc)],
        )
        return NodeEntry(rank, step, backup=NodeBackup(m, ROUND, 2, rank, None, {}, {}))

    parts = {(0, 40): entry(0, 40, 1), (1, 40): entry(1, 40, 2), (0, 30): entry(0, 30, 3)}
    info = RoundInfo(ROUND, 2, parts=parts, complete_step=40)
    digests = {r: e.backup.manifest.digest for (r, s), e in parts.items() if s == 40 and e.backup}
    assert seed_parts(info) == digests and len(set(digests.values())) == 2
    info.parts[(1, 40)] = NodeEntry(1, 40, foreign=True)  # written by MTC: no manifest
    assert seed_parts(info) == {0: digests[0]}


# ---------------------------------------------------------------------- the bytes a round took


def test_a_round_counts_the_part_its_upload_took():
    """Regression (replay of the #16 trial, a DCP re-save in place on 3 nodes): rank 0's
    part was sealed twice 40 ms apart -- after ``__0_0.distcp`` (the old ``.metadata``
    still in it), then after the new ``.metadata``. Every rank had new bytes by the first
    seal, so the round started at once and recorded rank 0's first seal; rank 0 uploaded
    its second. The round book then saw rank 0's part "saved again" and backed up the
    same bytes in a second round 30 s later."""
    book = S.RoundBook()
    book.reset("job", 3, 0.0)
    book.seed("job", ROUND, (ROUND, 40), V1)
    first_seal = {0: "d0-v2-old-metadata", 1: "d1-v2", 2: "d2-v2"}
    held = dict(first_seal)
    d = book.tick(7000.0, step=40, interval_steps=1, holders=lambda step: held)
    assert d.action == S.START, d
    held[0] = "d0-v2"  # the .metadata rename seals rank 0's part again
    for rank in range(3):
        book.report(rank, S.Outcome(d.round or "", 40, S.DONE, digest=held[rank]))
    book.tick(7001.0, step=40, interval_steps=1, holders=lambda step: held)
    assert book.active is None  # complete
    late = book.tick(7100.0, step=40, interval_steps=1, holders=lambda step: held)
    assert late.action == S.WAIT and late.reason == "no new step to back up", late


def test_a_round_that_took_the_first_seal_is_followed_by_the_second():
    # the other order: rank 0 uploaded before its part was sealed again; the bucket
    # holds the first seal, so the newer bytes are backed up in a round of their own
    book = S.RoundBook()
    book.reset("job", 3, 0.0)
    book.seed("job", ROUND, (ROUND, 40), V1)
    held = {0: "d0-v2-old-metadata", 1: "d1-v2", 2: "d2-v2"}
    d = book.tick(7000.0, step=40, interval_steps=1, holders=lambda step: held)
    for rank in range(3):
        book.report(rank, S.Outcome(d.round or "", 40, S.DONE, digest=held[rank]))
    held[0] = "d0-v2"
    book.tick(7001.0, step=40, interval_steps=1, holders=lambda step: held)
    assert book.active is None
    again = book.tick(7100.0, step=40, interval_steps=1, holders=lambda step: held)
    assert again.action == S.START and "rank(s) [0]" in again.reason, again


def test_an_outcome_without_a_digest_or_of_another_step_changes_nothing():
    st = backed_up_40()
    S.took(st, 40, 0, "")  # an older daemon's outcome: no digest on the wire
    S.took(st, 30, 0, "x")
    assert dict(st.last_parts or ()) == V1
    S.took(st, 40, 1, "d1-v2")
    assert dict(st.last_parts or ()) == {**V1, 1: "d1-v2"}


def test_the_digest_an_upload_took_reaches_the_coordinator_over_the_wire():
    from tierfs.cluster.coordinator import Coordinator
    from tierfs.cluster.servicer import CoordinatorServicer
    from tierfs.replication.client import sync_request

    servicer = CoordinatorServicer(Coordinator(clock=lambda: 1000.0, live_seconds=5.0))
    servicer.coordinator.join("job", 2, 1, "10.0.0.1:7000", "i1", (), "r1", "protocol")
    seen = []
    real = servicer.coordinator.sync

    def sync(*args, **kw):
        seen.append(args[5])
        return real(*args, **kw)

    servicer.coordinator.sync = sync  # type: ignore[method-assign]
    sent = S.Outcome(ROUND, 40, S.DONE, "", 123, 0.5, "d1-v2")
    servicer._sync_reply(sync_request("job", 1, "i1", 40, [], backup=sent))
    assert seen == [sent]
