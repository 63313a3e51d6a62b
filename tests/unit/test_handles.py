"""Unit tests of tierfs.fuse.handles.HandleTable alone: how data moves, backing ids, release.

The kernel's backing registry is a recording fake (a real one needs a FUSE
session; tests/fuse covers passthrough through a mount).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

import pytest

from tierfs.fuse.handles import HandleTable
from tierfs.fuse.inodes import Inode
from tierfs.fuse.kernel import KernelLink


class Registry:
    """FUSE_DEV_IOC_BACKING_OPEN/CLOSE that records, or fails with ``fail``."""

    def __init__(self, fail: int | None = None) -> None:
        self.fail = fail
        self.opened: list[int] = []
        self.closed: list[int] = []

    def open(self, fd: int) -> int:
        if self.fail is not None:
            raise OSError(self.fail, "refused")
        self.opened.append(fd)
        return 100 + len(self.opened)

    def close(self, backing_id: int) -> None:
        self.closed.append(backing_id)


@pytest.fixture
def path():
    d = Path("/dev/shm") / f"tierfs-handles-{uuid.uuid4().hex[:10]}"
    d.mkdir()
    (d / "f").write_bytes(b"data")
    yield d / "f"
    shutil.rmtree(d, ignore_errors=True)


def link(registry: Registry, passthrough: bool = True) -> KernelLink:
    return KernelLink(
        passthrough=passthrough, register_backing=registry.open, close_backing=registry.close
    )


def inode_of(path: Path) -> Inode:
    return Inode(2, os.stat(path).st_ino, -1, 0o100000)


def test_passthrough_opens_of_one_inode_share_one_backing_id(path):
    reg = Registry()
    table = HandleTable(link(reg))
    inode = inode_of(path)
    a = table.new_file(inode, os.open(path, os.O_RDONLY), os.O_RDONLY)
    b = table.new_file(inode, os.open(path, os.O_RDWR), os.O_RDWR)
    assert a.passthrough and b.passthrough and inode.backing_id == 101
    assert len(reg.opened) == 1
    assert (inode.handles, inode.writers) == (2, 1)
    assert table.release_file(a.fh) is a
    assert reg.closed == [] and inode.backing_id == 101  # b still open
    table.release_file(b.fh)
    assert reg.closed == [101] and inode.backing_id == 0
    assert (inode.handles, inode.writers) == (0, 0)


def test_a_failed_registration_turns_passthrough_off_and_serves_the_open(path):
    reg = Registry(fail=errno.ELOOP)
    kernel = link(reg)
    table = HandleTable(kernel)
    h = table.new_file(inode_of(path), os.open(path, os.O_RDONLY), os.O_RDONLY)
    assert not h.passthrough and h.keep_cache
    assert kernel.passthrough is False
    table.release_file(h.fh)


def test_daemon_served_opens_without_passthrough(path):
    table = HandleTable(link(Registry(), passthrough=False))
    inode = inode_of(path)
    r = table.new_file(inode, os.open(path, os.O_RDONLY), os.O_RDONLY)
    w = table.new_file(inode, os.open(path, os.O_WRONLY), os.O_WRONLY)
    rw = table.new_file(inode, os.open(path, os.O_RDWR), os.O_RDWR)
    assert (r.keep_cache, r.direct_io) == (True, False)
    assert (w.keep_cache, w.direct_io) == (False, True)  # write-only: no mmap can happen
    assert (rw.keep_cache, rw.direct_io) == (True, False)
    assert table.open_for_write() == 2 and table.count() == 3
    before = table.bytes_open_for_write()  # one inode, counted once
    assert before == os.stat(path).st_blocks * 512 > 0
    os.pwrite(w.fd, b"x" * (1 << 20), 0)  # a client writes (#14: a save under way)
    assert table.bytes_open_for_write() >= 1 << 20 > before
    for h in (r, w, rw):
        table.release_file(h.fh)
    assert table.count() == 0 and table.bytes_open_for_write() == 0


def test_no_passthrough_for_setuid_files_or_beside_daemon_served_handles(path):
    reg = Registry()
    table = HandleTable(link(reg))
    os.chmod(path, 0o4755)
    suid = inode_of(path)
    h = table.new_file(suid, os.open(path, os.O_RDWR), os.O_RDWR)
    assert not h.passthrough  # its writes must reach the daemon to clear the bit
    os.chmod(path, 0o644)
    h2 = table.new_file(suid, os.open(path, os.O_RDONLY), os.O_RDONLY)
    assert not h2.passthrough  # the inode already has a daemon-served handle
    assert reg.opened == []
    table.close_all()


def test_generated_files_are_direct_io(path):
    table = HandleTable(link(Registry()))
    inode = inode_of(path)
    inode.virtual = lambda: b"{}"
    h = table.new_file(inode, os.open(path, os.O_RDONLY), os.O_RDONLY)
    assert h.direct_io and not h.passthrough
    table.release_file(h.fh)


def test_file_and_directory_handles_are_told_apart(path):
    table = HandleTable(KernelLink())
    fh = table.new_file(inode_of(path), os.open(path, os.O_RDONLY), os.O_RDONLY)
    dinode = Inode(3, os.stat(path.parent).st_ino, -1, 0o040000)
    dh = table.new_dir(dinode, os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY))
    assert fh.fh != dh.fh
    assert table.file(fh.fh) is fh and table.directory(dh.fh) is dh
    for call in (lambda: table.file(dh.fh), lambda: table.directory(fh.fh)):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.EBADF
    assert table.release_file(dh.fh) is None  # the wrong kind: nothing released
    assert table.release_dir(dh.fh) is dh and dinode.handles == 0
    assert table.release_dir(dh.fh) is None  # twice: never raises
    table.release_file(fh.fh)
