"""The shared backoff in front of the bucket client (tierfs.backup.gate), alone and
against the rate-limited fake bucket."""

from __future__ import annotations

import concurrent.futures as cf
import random

from fake_bucket import FakeClient, fast_settings
from rated_bucket import RatedGcs

from tierfs.backup.bucket import GcsBackend
from tierfs.backup.gate import SharedBackoff


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_refusals_close_the_gate_longer_each_time_and_an_answer_opens_it() -> None:
    c = Clock()
    g = SharedBackoff(1.0, 8.0, clock=c, sleep=c.sleep, rng=random.Random(1))
    assert g.wait() == 0.0
    pauses = []
    for _ in range(5):
        g.answered(429)
        pauses.append(g.wait())
    for n, p in enumerate(pauses, 1):
        assert g.pause_for(n) / 2 <= p < g.pause_for(n)
    assert [g.pause_for(n) for n in range(1, 6)] == [1, 2, 4, 8, 8]
    g.answered(503)
    g.answered(200)
    assert g.refusals == 0 and g.wait() == 0.0
    g.answered(None)  # no response: nothing changes
    g.answered(404)  # an answer about the bucket opens it too
    assert g.wait() == 0.0


def test_a_refusal_pauses_every_thread_not_past_its_deadline() -> None:
    c = Clock()
    g = SharedBackoff(4.0, 30.0, clock=c, sleep=c.sleep, rng=random.Random(2))
    g.answered(429)
    until = g.until
    assert until >= 2.0
    assert g.wait(deadline=1.0) == 1.0  # a request's own deadline comes first
    assert g.wait() == until - 1.0
    assert c.now == until


def test_the_gate_is_configured_by_the_first_store() -> None:
    client = FakeClient(RatedGcs())
    GcsBackend("bkt", client=client, settings=fast_settings(2.0), widen_pool=False)
    s = fast_settings(9.0)
    GcsBackend(
        "bkt",
        client=client,
        settings=s.__class__(retry_initial=3.0, retry_max=9.0),
        widen_pool=False,
    )
    gate = client._http._tierfs_monitor.gate
    assert (gate.first, gate.max_wait) == (0.005, 0.02)


def test_threads_survive_the_rate_limit_together() -> None:
    """16 threads write 400 small objects into a bucket that takes 200 writes/s:
    the fake answers 429s, every write lands once, and the gate made the threads
    wait (shared pauses) instead of each retrying on its own."""
    server = RatedGcs(writes_per_s=200, reads_per_s=1000)
    be = GcsBackend(
        "bkt", client=FakeClient(server), settings=fast_settings(30.0), widen_pool=False
    )
    gate = be.monitor.gate

    def put(i: int) -> None:
        be.objects.put_bytes(f"job/o{i:04d}", b"%d" % i, "text/plain")

    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(400)))
    assert server.counts.writes == 400
    assert sorted(server.objects()) == [f"job/o{i:04d}" for i in range(400)]
    assert server.refused > 0
    assert gate.paused > 0
    # without the shared gate, each refused thread would retry at once (0.005 s)
    assert server.refused < 400
