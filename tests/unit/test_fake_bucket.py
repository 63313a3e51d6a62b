"""The in-memory bucket of tests/support/fake_bucket.py, driven through the real
:class:`tierfs.backup.bucket.GcsBackend`: what each fault looks like to tierfs
(retried, given up, refused, detected), so tests built on the fake can trust it."""

from __future__ import annotations

import threading
import time

import fake_bucket as fb
import pytest
import requests
from google.api_core import exceptions as gexc

from tierfs.backup.bucket import (
    BucketTimeout,
    ChecksumMismatch,
    describe_error,
    is_transient,
)


def test_objects_round_trip_and_listing_with_a_delimiter():
    server = fb.FakeGcs()
    b = fb.backend(server)
    b.objects.put_bytes("job/2026-12-01_10-00/a.meta", b"abc", "text/plain")
    b.objects.put_bytes("job/2026-12-01_10-01/x/y", b"", "text/plain")
    b.objects.put_bytes("job/notaround/z", b"1", "text/plain")
    assert b.objects.get_bytes("job/2026-12-01_10-00/a.meta") == b"abc"
    assert b.objects.get_bytes("job/missing") is None
    assert b.list_round_names("job") == ["2026-12-01_10-01", "2026-12-01_10-00"]
    blobs, prefixes = b.objects.listing("job/", delimiter="/")
    assert blobs == [] and prefixes == {
        "job/2026-12-01_10-00/",
        "job/2026-12-01_10-01/",
        "job/notaround/",
    }
    listed = {x.name: x for x in b.objects.listing("job/2026-12-01_10-00/")[0]}
    assert listed["job/2026-12-01_10-00/a.meta"].size == 3
    assert listed["job/2026-12-01_10-00/a.meta"].crc32c == fb._b64(fb.crc32c(b"abc"))
    assert b.objects.delete("job/notaround/z") and not b.objects.delete("job/notaround/z")
    assert b.bucket_exists()
    assert not fb.backend(server, spec="other").bucket_exists()


@pytest.mark.parametrize("status", [429, 503])
def test_a_transient_status_is_retried_by_the_real_retry_policy(status):
    server = fb.FakeGcs()
    retried: list[Exception] = []
    b = fb.backend(server)
    b.objects.on_retry = retried.append
    server.inject("status", "put", "obj", status=status, times=2)
    b.objects.put_bytes("obj", b"data", "text/plain")
    assert [o for op, n, o in server.log if op == "put"] == [str(status), str(status), "200"]
    assert len(retried) == 2 and all(is_transient(e) for e in retried)
    assert type(retried[0]) is type(gexc.from_http_status(status, "x"))
    assert server.objects()["obj"].data == b"data"


def test_a_persistent_status_gives_up_at_the_retry_deadline():
    server = fb.FakeGcs()
    b = fb.backend(server, deadline=0.3)
    server.inject("status", "get", status=503, times=None)
    t0 = time.monotonic()
    # the retry's deadline and the request deadline (BucketMonitor) are the same 0.3 s:
    # whichever passes first ends the call (on a busy machine either may), both as
    # "bucket unreachable"
    with pytest.raises((gexc.RetryError, BucketTimeout)) as err:
        b.objects.get_bytes("anything")
    assert time.monotonic() - t0 < 10
    assert is_transient(err.value)
    assert describe_error(err.value).startswith("bucket unreachable")


def test_a_definite_answer_is_not_retried():
    server = fb.FakeGcs()
    b = fb.backend(server)
    server.inject("status", "get", status=403)
    with pytest.raises(gexc.Forbidden) as err:
        b.objects.get_bytes("obj")
    assert not is_transient(err.value)
    assert describe_error(err.value).startswith("access denied")
    assert [o for op, _n, o in server.log] == ["403"]


def test_a_connection_reset_is_retried_and_a_persistent_one_gives_up():
    server = fb.FakeGcs()
    b = fb.backend(server, deadline=0.3)
    server.put_object("bkt", "obj", b"xyz")
    server.inject("reset", "get", "obj", times=1)
    assert b.objects.get_bytes("obj") == b"xyz"
    assert [o for _op, _n, o in server.log] == ["reset", "200"]
    server.inject("reset", "get", "obj", times=None)
    # the retry's deadline or the request deadline, whichever passes first (both 0.3 s)
    with pytest.raises((gexc.RetryError, BucketTimeout)) as err:
        b.objects.get_bytes("obj")
    if isinstance(err.value, gexc.RetryError):
        assert isinstance(err.value.cause, requests.exceptions.ConnectionError)
    assert is_transient(err.value)
    assert describe_error(err.value).startswith("bucket unreachable")


def test_bytes_corrupted_on_the_way_up_are_refused_by_gcs_and_detected_with_an_emulator():
    server = fb.FakeGcs()
    b = fb.backend(server)
    server.inject("corrupt_write", "put", "obj")
    with pytest.raises(gexc.BadRequest) as err:  # GCS checks the crc32c the client sent
        b.objects.put_bytes("obj", b"payload", "text/plain")
    assert not is_transient(err.value) and "obj" not in server.objects()
    lax = fb.FakeGcs(enforce_crc=False)
    b = fb.backend(lax)
    lax.inject("corrupt_write", "put", "obj")
    with pytest.raises(ChecksumMismatch):  # tierfs compares the crc32c GCS reports back
        b.objects.put_bytes("obj", b"payload", "text/plain")


def test_a_wrong_crc32c_in_the_answer_is_a_checksum_mismatch():
    server = fb.FakeGcs()
    b = fb.backend(server)
    server.inject("wrong_crc", "put", "obj")
    with pytest.raises(ChecksumMismatch):
        b.objects.put_bytes("obj", b"payload", "text/plain")


def test_bytes_corrupted_on_the_way_down_are_detected_by_the_library_check():
    server = fb.FakeGcs()
    b = fb.backend(server)
    server.put_object("bkt", "obj", b"payload")
    server.inject("corrupt_read", "get", "obj")
    with pytest.raises(fb._data_corruption()):
        b.objects.get_bytes("obj")
    assert b.objects.get_bytes("obj") == b"payload"  # the fault hit once


def test_a_stall_blocks_until_released_and_the_monitor_sees_it():
    server = fb.FakeGcs()
    b = fb.backend(server, deadline=60.0)
    assert b.monitor is not None  # the real monitor wrapped the fake session
    stall = server.stall("exists", times=1)
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(b.bucket_exists()))
    t.start()
    assert stall.waiting.wait(30)
    fb.wait_for(lambda: b.monitor.in_flight() == 1)
    assert t.is_alive() and out == []
    stall.release()
    t.join(30)
    assert out == [True] and b.monitor.in_flight() == 0
    assert b.monitor.last_answer > 0


def test_a_stall_never_released_costs_a_bounded_backend_its_deadline():
    server = fb.FakeGcs()
    b = fb.backend(server, deadline=60.0).bounded(0.5)
    server.stall("get", times=None)
    t0 = time.monotonic()
    with pytest.raises((gexc.RetryError, BucketTimeout)) as err:
        b.objects.get_bytes("obj")
    assert time.monotonic() - t0 < 20  # the deadline (0.5 s), never the stall limit
    assert is_transient(err.value)
    server.clear_faults()


def test_bit_rot_at_rest_keeps_the_listed_crc32c():
    server = fb.FakeGcs()
    server.put_object("bkt", "obj", b"payload")
    listed = fb.backend(server).objects.listing("obj")[0][0].crc32c
    server.rot("bkt", "obj")
    assert fb.backend(server).objects.listing("obj")[0][0].crc32c == listed
    assert server.objects()["obj"].data != b"payload"
