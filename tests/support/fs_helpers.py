"""Helpers shared by the real-mount tests: mount modes, errno capture, running as another user."""

from __future__ import annotations

import json
import os
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the two data paths of a tierfs mount: kernel passthrough, and the daemon serving READ/WRITE
MODES = ("passthrough", "no_passthrough")

#: uid/gid of the unprivileged "trainer" in tests (nothing needs to exist in /etc/passwd)
USER = 1000
GROUP = 1000


def mount_mode(make_mount: Callable[..., Any], mode: str, *extra: str, **kwargs: Any) -> Any:
    """Mount with ``allow_other`` in ``mode`` (one of :data:`MODES`) and check the mode took.

    ``extra`` are more CLI arguments, ``kwargs`` go to ``make_mount`` (e.g.
    ``ram_dir``). Returns the conftest ``Mount``.
    """
    opts = "allow_other" if mode == "passthrough" else "allow_other,no_passthrough"
    m = make_mount("-o", opts, *extra, **kwargs)
    status = json.loads((m.path / ".tierfs" / "status.json").read_text())
    assert status["passthrough"] is (mode == "passthrough"), status
    return m


def err(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Call ``fn``; return 0 on success or the ``errno`` of the ``OSError`` it raised."""
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno or -1
    return 0


def in_child(
    fn: Callable[..., Any],
    *args: Any,
    uid: int | None = None,
    gid: int | None = None,
    cwd: str | Path | None = None,
) -> Any:
    """Run ``fn(*args)`` in a forked child and return its result.

    The child first changes to ``cwd`` (as root, so it may sit below
    directories the user cannot search), then drops to ``gid``/``uid`` with
    no supplementary groups. An ``OSError`` in the child is re-raised here
    with the same errno; any other exception becomes an ``AssertionError``
    carrying the child's traceback.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.close(r)
            if cwd is not None:
                os.chdir(cwd)
            if gid is not None:
                os.setgroups([])
                os.setgid(gid)
            if uid is not None:
                os.setuid(uid)
            try:
                out: tuple[str, Any] = ("ok", fn(*args))
            except OSError as exc:
                out = ("oserror", (exc.errno, str(exc)))
            except BaseException:
                out = ("error", traceback.format_exc())
            data = pickle.dumps(out)
            while data:
                data = data[os.write(w, data) :]
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while True:
            chunk = f.read()
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child failed with status {status}"
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "oserror":
        raise OSError(value[0], value[1])
    if kind == "error":
        raise AssertionError(f"child raised:\n{value}")
    return value


def as_user(
    fn: Callable[..., Any],
    *args: Any,
    cwd: str | Path | None = None,
    uid: int = USER,
    gid: int = GROUP,
) -> Any:
    """:func:`in_child` as the unprivileged test user."""
    return in_child(fn, *args, uid=uid, gid=gid, cwd=cwd)


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic, non-repeating-looking bytes (no long runs of zeros)."""
    block = bytes((i * 131 + seed * 7 + (i >> 8) * 17 + 1) % 251 + 1 for i in range(65536))
    reps, rest = divmod(n, len(block))
    return block * reps + block[:rest]


def fork_many(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(i)`` for ``i`` in ``range(n)`` in ``n`` forked processes started at once.

    Children wait on a shared pipe until all are forked, so their calls
    race. Returns each child's result, or the ``OSError`` it raised (as an
    exception object with the same errno), in order of ``i``.
    """
    go_r, go_w = os.pipe()
    children = []
    for i in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(go_w)
                os.close(r)
                os.read(go_r, 1)  # blocks until the parent closes go_w
                try:
                    out: tuple[str, Any] = ("ok", fn(i))
                except OSError as exc:
                    out = ("oserror", (exc.errno, str(exc)))
                except BaseException:
                    out = ("error", traceback.format_exc())
                data = pickle.dumps(out)
                while data:
                    data = data[os.write(w, data) :]
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        children.append((pid, r))
    os.close(go_r)
    os.close(go_w)
    results = []
    for pid, r in children:
        with os.fdopen(r, "rb") as f:
            raw = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"child {pid} failed: {status}"
        kind, value = pickle.loads(raw)
        if kind == "error":
            raise AssertionError(f"child raised:\n{value}")
        results.append(OSError(value[0], value[1]) if kind == "oserror" else value)
    return results
