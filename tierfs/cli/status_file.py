"""Reading a daemon's ``.tierfs/status.json`` through its mount, bounded in time.

One helper for every reader: ``tierfs status``, ``tierfs wait`` and ``tierfs
unmount`` (:mod:`tierfs.cli.main`, :mod:`tierfs.cli.wait`, :mod:`tierfs.cli.unmount`)
and the CSI driver (:func:`tierfs.csi.nodemount.read_status`). A read through the
mount of a stopped or stuck daemon blocks until the daemon answers, so a reader
that must not hang gives a timeout: the read then runs in a daemon thread that
is left behind (the kernel ends the request when the process exits).
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable
from typing import Any

from tierfs.cli.console import fail
from tierfs.core.errors import ProtocolError

#: the status file, relative to the mountpoint (the daemon serves it, never stored)
STATUS_PATH = os.path.join(".tierfs", "status.json")
#: opened for writing by ``tierfs wait``: a trainer starts here (see :func:`tell_trainer_start`)
RESTART_PATH = os.path.join(".tierfs", "restart")

#: how long `tierfs status` waits for a daemon to answer (seconds)
STATUS_TIMEOUT = 10.0

__all__ = [
    "RESTART_PATH",
    "STATUS_PATH",
    "STATUS_TIMEOUT",
    "DaemonNotAnswering",
    "not_answering",
    "read_json",
    "read_status",
    "read_status_file",
    "tell_trainer_start",
]


class DaemonNotAnswering(ProtocolError):
    """The status file did not open within the time given: the daemon is stopped or stuck."""


def _bounded(call: Callable[[], Any], path: str, timeout: float | None) -> Any:
    """``call()``, given up after ``timeout`` seconds (None: no limit): it then runs on in
    a daemon thread that is left behind.

    Raises:
        DaemonNotAnswering: no answer within ``timeout`` (``path`` in the message).
        What ``call`` raises.
    """
    if timeout is None:
        return call()
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            error.append(exc)

    t = threading.Thread(target=run, name="tierfs-status", daemon=True)
    t.start()
    t.join(max(0.0, timeout))
    if t.is_alive():
        raise DaemonNotAnswering(path)
    if error:
        raise error[0]
    return result[0]


def read_json(path: str, timeout: float | None) -> Any:
    """``json.load`` of ``path``, given up after ``timeout`` seconds (None: no limit).

    Raises:
        DaemonNotAnswering: no answer within ``timeout``.
        OSError, ValueError: as ``open``/``json.load`` raise them.
    """

    def read() -> Any:
        with open(path, "rb") as f:
            return json.loads(f.read())

    return _bounded(read, path, timeout)


def tell_trainer_start(mountpoint: str, timeout: float | None = None) -> dict[str, Any]:
    """Tell the daemon at ``mountpoint`` that a trainer starts on this node: open its
    ``.tierfs/restart`` for writing (the daemon decides at the open,
    :mod:`tierfs.node.trainer_start`), then read its answer from the same file.

    Returns:
        The answer: ``action`` (``join``, ``current``, ``round``, ``nothing``),
        ``why``, ``at`` (Unix seconds); {} if unreadable.

    Raises:
        DaemonNotAnswering: no answer within ``timeout`` seconds.
        OSError: ENOENT or EPERM from a daemon older than the file; as ``open``.
    """
    path = os.path.join(mountpoint, RESTART_PATH)

    def tell() -> Any:
        os.close(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
        with open(path, "rb") as f:
            return json.loads(f.read() or b"{}")

    try:
        answer = _bounded(tell, path, timeout)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def read_status_file(mountpoint: str, timeout: float | None = None) -> dict[str, Any] | None:
    """The daemon's status at ``mountpoint`` (its ``.tierfs/status.json``).

    Args:
        timeout: seconds to wait for the daemon to answer (None: no limit).

    Returns:
        The status object; None if the file holds JSON that is not an object.

    Raises:
        DaemonNotAnswering: no answer within ``timeout``.
        OSError: nothing answers there (ENOENT: not tierfs; ENOTCONN or
            ECONNABORTED: the daemon is gone).
        ValueError: the file is not JSON (``json.JSONDecodeError``).
    """
    data = read_json(os.path.join(mountpoint, STATUS_PATH), timeout)
    return data if isinstance(data, dict) else None


def read_status(mountpoint: str, timeout: float | None = None) -> dict[str, Any]:
    """:func:`read_status_file` for a command: what is wrong is the command's error.

    Args:
        timeout: seconds to wait for the daemon to answer (None: no limit).

    Returns:
        The status ({} for a file that is JSON but not an object).

    Raises:
        click.ClickException: not a tierfs mount, or its daemon is gone.
        DaemonNotAnswering: no answer within ``timeout`` (a stopped or stuck daemon).
    """
    try:
        return read_status_file(mountpoint, timeout) or {}
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            fail(
                f"{mountpoint}: the tierfs daemon is not running (transport endpoint "
                "not connected); mount again to recover"
            )
        fail(f"{mountpoint} is not a tierfs mount ({exc.strerror})")
    except ValueError:
        fail(f"{mountpoint}: unreadable status file")


def not_answering(mountpoint: str, waited: float) -> str:
    """The line for a daemon that did not answer within ``waited`` seconds."""
    return (
        f"{mountpoint}: the tierfs daemon does not answer (no status within {waited:.0f}s): "
        "it is stopped or stuck; `tierfs unmount` still unmounts it"
    )
