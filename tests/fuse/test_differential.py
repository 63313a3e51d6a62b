"""Differential test: random file operations on a tierfs mount and on plain tmpfs.

A Hypothesis state machine applies each operation (open with random flags,
writes at offsets including far past EOF, reads, truncates, renames of files
and directories over existing ones, unlink while open, mkdir/rmdir, links,
lseek with SEEK_DATA/SEEK_HOLE, mmap reads and writes) to a directory in the
mount and to a directory under /dev/shm, and requires the same result: the
same bytes, sizes and types, or the same errno. At the end of each example the
tree through the mount and the tree in the RAM store behind it must both equal
the reference. Runs against both data paths (passthrough and no_passthrough).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest
from fs_helpers import MODES, mount_mode, pattern
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

# A small name space so that operations collide: files and directories at two levels.
PATHS = ["a", "b", "c", "d", "e", "d/a", "d/b", "d/f", "e/a", "d/f/a"]
ACCESS = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}
MAX_OPEN = 6

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.renameat2.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
]


def _renameat2(old: str, new: str, flags: int) -> None:
    if _libc.renameat2(-100, old.encode(), -100, new.encode(), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class Data(bytes):
    """Bytes compared exactly but shown short (length, hash, head) in failure messages."""

    def __repr__(self) -> str:
        digest = hashlib.sha1(self).hexdigest()[:10]
        return f"<{len(self)} bytes sha1:{digest} {bytes(self[:12])!r}>"


def _short(value: Any) -> Any:
    if isinstance(value, bytes):
        return Data(value)
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_short(v) for v in value)
    return value


def seek_answer_valid(
    res: tuple[str, Any], whence: int, offset: int, size: int, data: bytes
) -> bool:
    """Is ``res`` (an :func:`outcome` of lseek) a valid SEEK_DATA/SEEK_HOLE answer?

    ``data`` are the file's bytes from ``offset`` to its end. A hole must read
    as zeros; any range may be called data.
    """
    kind, value = res
    if offset >= size:
        return kind == "errno" and value == "ENXIO"
    if whence == os.SEEK_DATA:
        if kind == "errno":
            return value == "ENXIO" and not any(data)  # no data: all holes
        return offset <= value < size and not any(data[: value - offset])
    if kind == "errno":
        return False
    return offset <= value <= size and not any(data[value - offset : value - offset + 1])


def outcome(fn: Any, *args: Any) -> Any:
    """The result of ``fn(*args)``, or ``("errno", name)``, or ``("exc", type name)``."""
    try:
        return ("ok", _short(fn(*args)))
    except OSError as exc:
        return ("errno", errno.errorcode.get(exc.errno or 0, exc.errno))
    except (ValueError, OverflowError) as exc:
        return ("exc", type(exc).__name__)


def stat_view(st_: os.stat_result) -> tuple[int, int, int, int]:
    """What must agree between the mount and tmpfs (no inode numbers, no times)."""
    size = st_.st_size if not stat.S_ISDIR(st_.st_mode) else -1  # dir size: tmpfs detail
    return (stat.S_IFMT(st_.st_mode), stat.S_IMODE(st_.st_mode), size, st_.st_nlink)


def read_all(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def mmap_read(fd: int, offset: int, size: int) -> bytes:
    length = os.fstat(fd).st_size
    with mmap.mmap(fd, length, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED) as m:
        return m[offset : offset + size]


def mmap_write(fd: int, offset: int, data: bytes) -> int:
    length = os.fstat(fd).st_size
    end = min(length, offset + len(data))
    if offset >= end:
        return 0
    with mmap.mmap(fd, length, prot=mmap.PROT_READ | mmap.PROT_WRITE, flags=mmap.MAP_SHARED) as m:
        m[offset:end] = data[: end - offset]
        m.flush()
    return end - offset


def tree(root: str) -> dict[str, Any]:
    """Types, modes, sizes, link counts and file contents of everything below ``root``."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st_ = os.lstat(p)
            out[rel] = (stat_view(st_), read_all(p) if stat.S_ISREG(st_.st_mode) else None)
    return out


sizes = st.one_of(
    st.integers(0, 5000), st.integers(0, 70_000), st.sampled_from([4095, 4096, 4097, 65536])
)
offsets = st.one_of(
    st.integers(0, 10_000),
    st.integers(0, 150_000),
    st.sampled_from([0, 4096, 8191, 1 << 20, (1 << 20) + 5]),
)
datas = st.tuples(sizes, st.integers(0, 250)).map(lambda t: pattern(t[0], seed=t[1]))
paths = st.sampled_from(PATHS)


class DiffMachine(RuleBasedStateMachine):
    """Applies each rule to both trees and compares (see the module docstring)."""

    mount_base: Path
    ref_base: Path
    view_base: Path  # the mount's backing directory in the RAM store

    def __init__(self) -> None:
        super().__init__()
        tag = uuid.uuid4().hex[:8]
        self.roots = (str(self.mount_base / tag), str(self.ref_base / tag))
        self.view_root = str(self.view_base / tag)
        for r in self.roots:
            os.mkdir(r)
        self.fds: list[tuple[int, int, str]] = []  # (mount fd, ref fd, description)

    def both(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` with each root's arguments; assert equal outcomes; return it."""
        results = []
        for root in self.roots:
            real = [os.path.join(root, a) if isinstance(a, _P) else a for a in args]
            results.append(outcome(fn, *real))
        assert results[0] == results[1], (fn.__name__, args, results)
        return results[0]

    def both_fd(self, i: int, fn: Any, *args: Any) -> Any:
        m, r, what = self.fds[i % len(self.fds)]
        res_m, res_r = outcome(fn, m, *args), outcome(fn, r, *args)
        assert res_m == res_r, (fn.__name__, what, args, res_m, res_r)
        return res_m

    @initialize(layout=st.lists(st.tuples(paths, st.booleans()), max_size=4))
    def populate(self, layout: list[tuple[str, bool]]) -> None:
        for d in ("d", "e", "d/f"):
            self.both(os.mkdir, _P(d))
        for path, size in (("a", 5000), ("b", 70_000), ("d/a", 100), ("e/a", 0), ("d/f/a", 4097)):
            self.both(_write_file, _P(path), pattern(size, seed=size % 251))
        for path, is_dir in layout:
            if is_dir:
                self.both(os.mkdir, _P(path))
            else:
                self.both(_write_file, _P(path), pattern(len(path) * 1000, seed=len(path)))

    # ------------------------------------------------------------ descriptors

    @precondition(lambda self: len(self.fds) < MAX_OPEN)
    @rule(
        path=paths,
        acc=st.sampled_from(["r", "w", "rw", "rw"]),
        creat=st.sampled_from([True, True, False]),
        trunc=st.booleans(),
        append=st.booleans(),
        excl=st.booleans(),
    )
    def open_(
        self, path: str, acc: str, creat: bool, trunc: bool, append: bool, excl: bool
    ) -> None:
        flags = (
            ACCESS[acc]
            | (os.O_CREAT if creat else 0)
            | (os.O_TRUNC if trunc else 0)
            | (os.O_APPEND if append else 0)
            | (os.O_EXCL if excl else 0)
        )
        res = []
        for root in self.roots:
            res.append(outcome(os.open, os.path.join(root, path), flags, 0o644))
        kinds = [r[0] for r in res]
        if kinds == ["ok", "ok"]:
            self.fds.append(
                (res[0][1], res[1][1], f"{path} {acc} c{creat} t{trunc} a{append} x{excl}")
            )
            return
        for r in res:  # never leak a descriptor when the two sides disagree
            if r[0] == "ok":
                os.close(r[1])
        assert res[0] == res[1], (path, flags, res)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN))
    def close(self, i: int) -> None:
        m, r, _ = self.fds.pop(i % len(self.fds))
        assert outcome(os.close, m) == outcome(os.close, r)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), data=datas, offset=offsets)
    def pwrite(self, i: int, data: bytes, offset: int) -> None:
        self.both_fd(i, os.pwrite, data, offset)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), data=datas)
    def write(self, i: int, data: bytes) -> None:
        self.both_fd(i, os.write, data)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), size=sizes, offset=offsets)
    def pread(self, i: int, size: int, offset: int) -> None:
        self.both_fd(i, os.pread, size, offset)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), size=sizes)
    def read(self, i: int, size: int) -> None:
        self.both_fd(i, os.read, size)

    @precondition(lambda self: self.fds)
    @rule(
        i=st.integers(0, MAX_OPEN),
        offset=offsets,
        whence=st.sampled_from([os.SEEK_SET, os.SEEK_CUR, os.SEEK_END, os.SEEK_DATA, os.SEEK_HOLE]),
    )
    def lseek(self, i: int, offset: int, whence: int) -> None:
        m, _r, _ = self.fds[i % len(self.fds)]
        if stat.S_ISDIR(os.fstat(m).st_mode) and whence != os.SEEK_SET:
            return  # directory seeks are the kernel's FUSE code, not tierfs (SEEK_END differs)
        if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            self.both_fd(i, os.lseek, offset, whence)
            return
        # Where a file is "data" or "hole" depends on page allocation, which
        # differs legitimately: tmpfs allocates a page on an mmap read fault of
        # a hole, a FUSE read through the daemon does not. POSIX lets a
        # filesystem report any hole as data. Both answers must be valid for
        # the (identical) bytes; then both descriptors continue at the same offset.
        m, r, what = self.fds[i % len(self.fds)]
        res_m, res_r = outcome(os.lseek, m, offset, whence), outcome(os.lseek, r, offset, whence)
        if res_m == res_r:
            return
        size = os.fstat(r).st_size
        data = os.pread(r, max(0, size - offset), offset) if offset < size else b""
        for res in (res_m, res_r):
            assert seek_answer_valid(res, whence, offset, size, data), (
                "lseek",
                what,
                offset,
                whence,
                res_m,
                res_r,
            )
        if res_r[0] == "ok":
            os.lseek(m, res_r[1], os.SEEK_SET)
        elif res_m[0] == "ok":
            os.lseek(r, res_m[1], os.SEEK_SET)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), size=offsets)
    def ftruncate(self, i: int, size: int) -> None:
        self.both_fd(i, os.ftruncate, size)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN))
    def fstat(self, i: int) -> None:
        self.both_fd(i, lambda fd: stat_view(os.fstat(fd)))

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), datasync=st.booleans())
    def fsync(self, i: int, datasync: bool) -> None:
        self.both_fd(i, os.fdatasync if datasync else os.fsync)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), size=sizes, offset=st.integers(0, 80_000))
    def mmap_read(self, i: int, size: int, offset: int) -> None:
        self.both_fd(i, mmap_read, offset, size)

    @precondition(lambda self: self.fds)
    @rule(i=st.integers(0, MAX_OPEN), data=datas, offset=st.integers(0, 80_000))
    def mmap_write(self, i: int, data: bytes, offset: int) -> None:
        self.both_fd(i, mmap_write, offset, data)

    # ------------------------------------------------------------ names

    @rule(path=paths, size=offsets)
    def truncate(self, path: str, size: int) -> None:
        self.both(os.truncate, _P(path), size)

    @rule(src=paths, dst=paths, flags=st.sampled_from([0, 0, 1, 2]))
    def rename(self, src: str, dst: str, flags: int) -> None:
        if flags:
            self.both(_renameat2, _P(src), _P(dst), flags)
        else:
            self.both(os.rename, _P(src), _P(dst))

    @rule(path=paths)
    def unlink(self, path: str) -> None:
        self.both(os.unlink, _P(path))

    @rule(path=paths)
    def mkdir(self, path: str) -> None:
        self.both(os.mkdir, _P(path), 0o755)

    @rule(path=paths)
    def rmdir(self, path: str) -> None:
        self.both(os.rmdir, _P(path))

    @rule(src=paths, dst=paths)
    def link(self, src: str, dst: str) -> None:
        self.both(os.link, _P(src), _P(dst))

    @rule(path=paths)
    def stat(self, path: str) -> None:
        self.both(lambda p: stat_view(os.lstat(p)), _P(path))

    @rule(path=st.sampled_from(["", "d", "e", "d/f", "a"]))
    def listdir(self, path: str) -> None:
        self.both(lambda p: sorted(os.listdir(p)), _P(path))

    @rule(path=paths)
    def read_file(self, path: str) -> None:
        self.both(read_all, _P(path))

    @invariant()
    def same_names(self) -> None:
        assert sorted(os.listdir(self.roots[0])) == sorted(os.listdir(self.roots[1]))

    def teardown(self) -> None:
        try:
            for m, r, _ in self.fds:
                os.close(m)
                os.close(r)
            self.fds = []
            expect = _short(tree(self.roots[1]))
            assert _short(tree(self.roots[0])) == expect
            # What the RAM store holds (and a restarted daemon serves) must match too:
            # the kernel's page cache can hide a wrong byte in tmpfs from every read.
            assert _short(tree(self.view_root)) == expect
        finally:
            for r in self.roots:
                shutil.rmtree(r, ignore_errors=True)


class _P(str):
    """A path relative to each root (``both`` joins it)."""


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


#: examples per data path; each runs up to 50 steps (raise it for a longer hunt)
EXAMPLES = int(os.environ.get("TIERFS_DIFF_EXAMPLES", "150"))


@pytest.mark.long(minutes=2)
@pytest.mark.parametrize("mode", MODES)
def test_mount_behaves_like_tmpfs(make_mount, mode):
    m = mount_mode(make_mount, mode)
    ref = Path("/dev/shm") / f"tierfs-diff-{uuid.uuid4().hex[:10]}"
    ref.mkdir()
    try:
        DiffMachine.mount_base = m.path
        DiffMachine.ref_base = ref
        DiffMachine.view_base = m.view
        run_state_machine_as_test(
            DiffMachine,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=50,
                deadline=None,
                report_multiple_bugs=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )
    finally:
        shutil.rmtree(ref, ignore_errors=True)
    assert sorted(os.listdir(m.path)) == [".tierfs"]


def test_seek_answers_for_a_hole_read_through_mmap():
    """Regression (CI, seed 52211629082842445596825772633101440874): after
    ftruncate(1) and an mmap read, tmpfs answers SEEK_DATA 0 -> 0 (the fault
    allocated a page) while the daemon's data path answers ENXIO (a hole). Both
    are valid for a file whose only byte is zero; a non-zero byte is data."""
    assert seek_answer_valid(("errno", "ENXIO"), os.SEEK_DATA, 0, 1, b"\0")
    assert seek_answer_valid(("ok", 0), os.SEEK_DATA, 0, 1, b"\0")
    assert not seek_answer_valid(("errno", "ENXIO"), os.SEEK_DATA, 0, 1, b"\1")
    assert not seek_answer_valid(("ok", 1), os.SEEK_DATA, 0, 2, b"\1\0")
    assert seek_answer_valid(("ok", 0), os.SEEK_HOLE, 0, 1, b"\0")
    assert seek_answer_valid(("ok", 1), os.SEEK_HOLE, 0, 1, b"\0")
    assert not seek_answer_valid(("ok", 0), os.SEEK_HOLE, 0, 1, b"\1")
    assert seek_answer_valid(("errno", "ENXIO"), os.SEEK_HOLE, 5, 1, b"")
