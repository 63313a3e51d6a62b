"""The retry policies (tierfs/core/retry.py): what each retries and what not, its waits,
its deadline, the table in docs/RETRIES.md. Deterministic: stamina's testing mode or a
fake clock, never a real backoff."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import pytest
import requests
import stamina
import trio
from google.api_core import exceptions as gexc

from tierfs.backup import bucket
from tierfs.core import retry

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "RETRIES.md"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_stamina(policy: retry.Policy, on, failures: list[BaseException]) -> tuple[int, object]:
    """Run ``policy`` over a call that raises ``failures`` in turn, then returns "ok".
    Returns (calls made, result or the exception raised)."""
    calls = 0

    def call() -> str:
        nonlocal calls
        calls += 1
        if calls <= len(failures):
            raise failures[calls - 1]
        return "ok"

    try:
        for attempt in policy.retry_context(on=on):
            with attempt:
                result = call()
                return calls, result
    except Exception as exc:
        return calls, exc
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- waits


def test_waits_double_from_first_up_to_max_without_jitter():
    p = retry.Policy("p", "", "", first=2.0, max_wait=30.0, deadline=None, layer="", where="")
    assert [p.wait(n) for n in range(1, 7)] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_jitter_is_added_and_capped_at_max():
    p = retry.Policy(
        "p", "", "", first=1.0, max_wait=5.0, deadline=None, layer="", where="", jitter=1.0
    )
    assert p.wait(1, rand=lambda a, b: b) == 2.0
    assert p.wait(1, rand=lambda a, b: a) == 1.0
    assert p.wait(3, rand=lambda a, b: b) == 5.0  # 4 + 1, capped at 5
    assert p.wait(9, rand=lambda a, b: b) == 5.0


def test_fixed_poll():
    p = retry.gcs_rendezvous_wait(timeout=10, poll=0.5)
    assert [p.wait(n) for n in (1, 2, 10)] == [0.5, 0.5, 0.5]


def test_backoff_counts_resets_and_stops_at_its_deadline():
    clock = FakeClock()
    p = retry.Policy("p", "", "", first=0.25, max_wait=1.0, deadline=10.0, layer="", where="")
    b = p.backoff(clock)
    assert [b.next() for _ in range(4)] == [0.25, 0.5, 1.0, 1.0]
    assert not b.expired() and b.left() == 10.0
    clock.now += 9.9
    assert not b.expired()
    b.progress()  # the deadline counts from now, the waits keep growing
    clock.now += 9.9
    assert not b.expired() and b.next() == 1.0
    clock.now += 0.1
    assert b.expired()
    b.reset()
    assert not b.expired() and b.next() == 0.25


def test_backoff_without_deadline_never_expires():
    clock = FakeClock()
    b = retry.csi_mount(max_backoff=60).backoff(clock)
    clock.now += 1e9
    assert b.left() is None and not b.expired()
    assert [b.next() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]


def test_backoff_has_no_waits_in_stamina_testing_mode():
    b = retry.gcs_upload().backoff()
    with stamina.set_testing(True):
        assert [b.next() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.next() == retry.gcs_upload().wait(4)


# ---------------------------------------------------------------------- knobs


def test_upload_policy_reads_its_knobs_when_built(monkeypatch):
    monkeypatch.delenv("TIERFS_GCS_UPLOAD_RETRY_FIRST", raising=False)
    monkeypatch.delenv("TIERFS_GCS_UPLOAD_RETRY_MAX", raising=False)
    monkeypatch.delenv("TIERFS_GCS_ROUND_TIMEOUT", raising=False)
    p = retry.gcs_upload()
    assert (p.first, p.max_wait, p.deadline, p.jitter) == (2.0, 30.0, 1800.0, 0.0)
    monkeypatch.setenv("TIERFS_GCS_UPLOAD_RETRY_FIRST", "0.5")
    monkeypatch.setenv("TIERFS_GCS_UPLOAD_RETRY_MAX", "3")
    p = retry.gcs_upload()
    assert [p.wait(n) for n in range(1, 5)] == [0.5, 1.0, 2.0, 3.0]
    assert retry.gcs_bucket_check().first == 0.5 and retry.gcs_bucket_check().deadline is None


def test_gcs_request_waits_and_deadline(monkeypatch):
    monkeypatch.delenv("TIERFS_GCS_RETRY_DEADLINE", raising=False)
    p = retry.gcs_request()
    assert (p.first, p.max_wait, p.deadline) == (1.0, 30.0, 300.0)
    monkeypatch.setenv("TIERFS_GCS_RETRY_DEADLINE", "20")
    p = retry.gcs_request()
    assert (p.first, p.max_wait, p.deadline) == (0.25, 5.0, 20.0)
    # GcsSettings and bounded backends keep their numbers (one rule, in retry.py)
    s = bucket.GcsSettings.from_env()
    assert (s.retry_initial, s.retry_max, s.retry_deadline) == (0.25, 5.0, 20.0)
    s = bucket.GcsSettings.from_env(retry_deadline=600.0)
    assert (s.retry_initial, s.retry_max) == (1.0, 30.0)
    s = bucket.GcsSettings.from_env(retry_deadline=8.0, retry_max=1.0)
    assert (s.retry_initial, s.retry_max) == (0.25, 1.0)
    assert retry.bounded_waits(1.0, 30.0, 5.0) == (0.25, 1.25)
    assert retry.bounded_waits(1.0, 30.0, 1.0) == (0.25, 0.5)
    assert retry.bounded_waits(1.0, 30.0, 300.0) == (0.25, 30.0)


def test_gcs_request_builds_the_librarys_retry_with_its_predicate():
    policy = retry.gcs_request(20.0)
    r = bucket._make_retry(policy, lambda exc: None)
    assert (r._initial, r._maximum, r._multiplier, r._timeout) == (0.25, 5.0, 2.0, 20.0)
    assert r._predicate(gexc.TooManyRequests("slow down"))
    assert r._predicate(gexc.ServiceUnavailable("try later"))
    assert r._predicate(requests.ConnectionError("reset by peer"))
    assert not r._predicate(gexc.NotFound("no such object"))
    assert not r._predicate(gexc.Forbidden("denied"))


# ---------------------------------------------------------------------- what is retried


@pytest.fixture
def testing_mode():
    with stamina.set_testing(True, attempts=5):
        yield


def outage_or_not(exc: Exception) -> bool:
    """The predicate the upload policy uses (bucket.is_transient)."""
    return bucket.is_transient(exc)


@pytest.mark.parametrize(
    "failure",
    [
        gexc.TooManyRequests("429"),
        gexc.ServiceUnavailable("503"),
        gexc.InternalServerError("500"),
        requests.ConnectionError("connection reset by peer"),
        ConnectionResetError(104, "reset"),
        bucket.BucketTimeout("no answer"),
        gexc.RetryError("gave up", cause=gexc.ServiceUnavailable("503")),
    ],
    ids=lambda e: type(e).__name__,
)
def test_outages_are_retried(testing_mode, failure):
    calls, result = run_stamina(retry.gcs_upload(), outage_or_not, [failure, failure])
    assert (calls, result) == (3, "ok")


@pytest.mark.parametrize(
    "failure",
    [
        gexc.NotFound("404"),
        gexc.Forbidden("403"),
        gexc.BadRequest("400"),
        bucket.ChecksumMismatch("crc32c differs"),
        bucket.Cancelled("cancelled"),
        FileNotFoundError(2, "snapshot gone"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_definite_answers_are_not_retried(testing_mode, failure):
    calls, result = run_stamina(retry.gcs_upload(), outage_or_not, [failure, failure])
    assert calls == 1 and result is failure


def test_stamina_gives_up_after_its_attempts(testing_mode):
    failures = [gexc.ServiceUnavailable("503")] * 9
    calls, result = run_stamina(retry.gcs_upload(), outage_or_not, failures)
    assert calls == 5 and isinstance(result, gexc.ServiceUnavailable)


def test_stamina_stops_at_the_policy_deadline():
    """A real (short) deadline, no testing mode: the attempts stop once it passed;
    the waits are 1 ms so the test takes milliseconds, never a backoff."""
    p = retry.Policy("p", "", "", first=0.001, max_wait=0.001, deadline=0.05, layer="", where="")
    start = time.monotonic()
    calls = 0
    with pytest.raises(TimeoutError):
        for attempt in p.retry_context(on=TimeoutError):
            with attempt:
                calls += 1
                raise TimeoutError("still down")
    # the last attempt failed at the deadline (a busy machine may fit one only): at or
    # after it with stamina < 26.2, no more than a wait (1 ms) before it since 26.2,
    # which does not start a wait that would end past the deadline
    assert calls >= 1 and time.monotonic() - start >= 0.05 - 0.01


def test_trio_code_runs_the_same_policy(testing_mode):
    calls = 0

    async def main() -> str:
        nonlocal calls
        async for attempt in retry.rendezvous_publish().retry_context(on=ConnectionError):
            with attempt:
                calls += 1
                if calls < 3:
                    raise ConnectionError("bucket down")
                return "published"
        raise AssertionError("unreachable")

    assert trio.run(main) == "published" and calls == 3


# ---------------------------------------------------------------------- GcsBackend loops


class FakeRendezvousBackend(bucket.GcsBackend):
    """A GcsBackend whose rendezvous reads come from a list (no bucket)."""

    def __init__(self, answers: list) -> None:  # no client, no settings
        self.answers = list(answers)
        self.reads = 0
        self.spec = bucket.L.parse_bucket("tierfs-test")

    def read_address(self, job, rank=0):
        self.reads += 1
        a = self.answers.pop(0) if self.answers else None
        if isinstance(a, BaseException):
            raise a
        return a


def record(written: float):
    return bucket.L.RendezvousRecord("10.0.0.1:7000", 0, "inc", written)


def test_wait_for_address_polls_through_outages(testing_mode):
    b = FakeRendezvousBackend(
        [None, gexc.ServiceUnavailable("503"), record(written=5.0), record(written=50.0)]
    )
    rec = b.wait_for_address("job", 0, timeout=60, newer_than=10.0, poll=30.0)
    assert rec.written == 50.0 and b.reads == 4  # old record ignored, no real 30 s polls


def test_wait_for_address_times_out_and_stops_on_cancel(testing_mode):
    b = FakeRendezvousBackend([None] * 10)
    with pytest.raises(TimeoutError, match="no address of rank 0"):
        b.wait_for_address("job", 0, timeout=60, poll=30.0)
    assert b.reads == 5  # testing mode: 5 attempts
    cancel = threading.Event()
    cancel.set()
    b = FakeRendezvousBackend([record(1.0)])
    with pytest.raises(bucket.Cancelled):
        b.wait_for_address("job", 0, timeout=60, cancel=cancel)
    assert b.reads == 0


class FakeListingBackend(bucket.GcsBackend):
    def __init__(self, missing: list[list[str]]) -> None:
        self.missing = missing
        self.listings = 0

    def unproven(self, prefix, uploads):
        self.listings += 1
        return self.missing.pop(0) if len(self.missing) > 1 else self.missing[0]


def test_await_objects_returns_when_everything_is_there(testing_mode):
    b = FakeListingBackend([["a", "b"], ["b"], []])
    ups = [object(), object()]
    assert b.await_objects("p/", ups, wait=60) == [] and b.listings == 3


def test_await_objects_gives_up_after_wait_without_progress(testing_mode):
    b = FakeListingBackend([["a"]])
    start = time.monotonic()
    assert b.await_objects("p/", [object()], wait=0.05) == ["a"]
    assert time.monotonic() - start >= 0.05 and b.listings >= 2


def test_await_objects_without_wait_lists_once(testing_mode):
    b = FakeListingBackend([["a"]])
    assert b.await_objects("p/", [object()], wait=0) == ["a"] and b.listings == 1


# ---------------------------------------------------------------------- the table


def test_every_policy_is_complete():
    names = set()
    for p in retry.all_policies():
        assert p.name not in names
        names.add(p.name)
        assert p.retries and p.not_retried and p.where and p.layer
        assert 0 < p.first <= p.max_wait
        assert p.deadline is None or p.deadline > 0
        path = pathlib.Path(__file__).resolve().parents[2] / "tierfs" / p.where.split(":")[0]
        func = p.where.split(":")[1].split(" ")[0].split(".")[-1]
        assert path.exists(), p.where
        if func != "GcsBackend":
            assert f"def {func}(" in path.read_text(), p.where


def test_docs_table_matches_the_code(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TIERFS_"):
            monkeypatch.delenv(name)
    text = DOCS.read_text()
    start = text.index("<!-- retries:start -->\n") + len("<!-- retries:start -->\n")
    end = text.index("<!-- retries:end -->")
    assert text[start:end] == retry.markdown_table(), (
        "docs/RETRIES.md is stale: python -m tierfs.core.retry prints the table"
    )
