"""The CLI's output plumbing: the daemon's start-up handshake with ``tierfs mount``
(tierfs/cli/spawn.py) and tables on stdout (tierfs/cli/console.py)."""

from __future__ import annotations

import os

import pytest

from tierfs.cli.spawn import announce_ready


def test_ready_reaches_a_waiting_mount():
    r, w = os.pipe()
    announce_ready(w)
    assert os.read(r, 100) == b"READY\n"
    os.close(r)
    with pytest.raises(OSError):
        os.fstat(w)  # closed


def test_ready_after_the_mount_gave_up_waiting_keeps_the_daemon():
    """Regression (new-user trial under load): `tierfs mount` printed `daemon did not
    become ready in 120s (... still running ...)` and exited; when the daemon became
    ready a moment later, EPIPE on the ready pipe ended it (`mount failed: Broken
    pipe`)."""
    r, w = os.pipe()
    os.close(r)  # the waiting mount exited
    announce_ready(w)  # no exception
    with pytest.raises(OSError):
        os.fstat(w)


def test_tables_piped_to_a_file_are_never_wrapped(capsys):
    """Regression (new-user trial): `tierfs backups list | cat` wrapped its table at 80
    columns (one word per line); `tierfs status` already printed whole lines."""
    from tierfs.cli.console import stdout_console

    console = stdout_console(markup=False)
    assert not console.is_terminal and console.width == 10_000
    console.print("x" * 300)
    assert capsys.readouterr().out == "x" * 300 + "\n"
