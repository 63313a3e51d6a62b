"""Unit tests of tierfs.fuse.session's answer of a request deferred by its handler
(:class:`tierfs.fuse.remote.Deferred`), without a mount."""

from __future__ import annotations

import errno
import logging

import trio

from tierfs.fuse import protocol as P
from tierfs.fuse import session as session_module
from tierfs.fuse.remote import Deferred
from tierfs.fuse.session import FuseSession


def answers(handler, first: Deferred) -> list[tuple[int, int, object]]:
    """Run the session's answer loop for one LOOKUP; returns the answers given."""
    s = object.__new__(FuseSession)
    given: list[tuple[int, int, object]] = []

    def answer(unique: int, err: int, payload: object = b"") -> None:
        given.append((unique, err, payload))

    s._answer = answer  # type: ignore[method-assign]
    hdr = P.RequestHeader(40, P.Op.LOOKUP, 7, 1, 0, 0, 1)
    trio.run(s._wait_and_answer, hdr, b"name\0", handler, first)
    return given


async def nothing() -> None:
    pass


def test_a_request_deferred_again_and_again_is_answered_eio_and_said_in_the_log(caplog):
    """Trial 63 MEDIUM-1: an open got EIO with nothing in the log after three waits (its
    lookup and its open may each wait for another rank's node, then for a fetch)."""
    runs = []

    def handler(hdr, body):  # type: ignore[no-untyped-def]
        runs.append(hdr.unique)
        raise Deferred(nothing)

    with caplog.at_level(logging.WARNING, logger="tierfs.fuse.session"):
        assert answers(handler, Deferred(nothing)) == [(7, errno.EIO, b"")]
    assert len(runs) == session_module.DEFERRALS
    assert "answered EIO" in caplog.text and "LOOKUP" in caplog.text


def test_a_request_deferred_a_few_times_is_answered_by_its_handler():
    runs = []

    def handler(hdr, body):  # type: ignore[no-untyped-def]
        runs.append(bytes(body))
        if len(runs) < 4:
            raise Deferred(nothing)
        return b"entry"

    assert answers(handler, Deferred(nothing)) == [(7, 0, b"entry")]
    assert runs == [b"name\0"] * 4
