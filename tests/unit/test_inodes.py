"""Unit tests of tierfs.fuse.inodes.InodeTable alone: lookup counts, forget, the descriptor pool.

Driven over a directory on /dev/shm, without a namespace or a mount.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

import pytest

from tierfs.fuse.inodes import ROOT_ID, InodeTable


@pytest.fixture
def view():
    d = Path("/dev/shm") / f"tierfs-inodes-{uuid.uuid4().hex[:10]}"
    (d / ".tierfs").mkdir(parents=True)
    (d / ".tierfs" / "status.json").write_bytes(b"{}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def status() -> bytes:
    return b'{"ok": true}\n'


@pytest.fixture
def table(view):
    t = InodeTable(str(view), frozenset({b".tierfs"}), {b".tierfs/status.json": status}, 1 << 16)
    yield t
    t.close()


def learn(t: InodeTable, parent, name: bytes):
    fd, st = t.open_child(parent, name)
    return t.learn(parent, name, fd, st)


def fds_open() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_learning_the_same_object_twice_is_one_inode_with_two_lookups(table, view):
    (view / "f").write_bytes(b"x")
    os.link(view / "f", view / "hard")
    before = fds_open()
    a = learn(table, table.root, b"f")
    b = learn(table, table.root, b"hard")  # a hard link: the same inode
    assert a is b and a.lookups == 2 and a.nodeid > ROOT_ID
    assert fds_open() == before + 1  # the second descriptor was closed
    assert table.get(a.nodeid) is a and table.by_ino(a.ino) is a
    assert table.count() == 2  # root + f


def test_forget_drops_at_zero_lookups_and_never_the_root(table, view):
    (view / "f").write_bytes(b"")
    a = learn(table, table.root, b"f")
    learn(table, table.root, b"f")
    table.forget(a.nodeid, 1)
    assert table.get(a.nodeid) is a
    table.forget(a.nodeid, 1)
    with pytest.raises(OSError) as e:
        table.get(a.nodeid)
    assert e.value.errno == errno.ESTALE
    assert table.by_ino(a.ino) is None and a.opath == -1
    table.forget(a.nodeid, 3)  # unknown: ignored
    table.forget(ROOT_ID, 1 << 20)
    assert table.get(ROOT_ID) is table.root


def test_an_inode_with_open_handles_outlives_its_lookups(table, view):
    (view / "f").write_bytes(b"")
    a = learn(table, table.root, b"f")
    a.handles = 1
    table.forget(a.nodeid, 1)
    assert table.get(a.nodeid) is a
    a.handles = 0
    table.drop_if_unused(a)
    with pytest.raises(OSError):
        table.get(a.nodeid)


def test_node_ids_are_never_reused(table, view):
    seen = set()
    for _ in range(10):
        (view / "f").write_bytes(b"")
        a = learn(table, table.root, b"f")
        assert a.nodeid not in seen
        seen.add(a.nodeid)
        os.unlink(view / "f")
        table.forget(a.nodeid, a.lookups)


def test_reserved_and_virtual_inodes(table, view):
    (view / "plain").mkdir()
    ctl = learn(table, table.root, b".tierfs")
    st = learn(table, ctl, b"status.json")
    plain = learn(table, table.root, b"plain")
    assert ctl.reserved and st.reserved and not plain.reserved
    assert st.virtual is status and ctl.virtual is None and plain.virtual is None


def test_directory_get_and_invalid_names(table, view):
    (view / "f").write_bytes(b"")
    f = learn(table, table.root, b"f")
    with pytest.raises(OSError) as e:
        table.directory(f.nodeid)
    assert e.value.errno == errno.ENOTDIR
    for bad in (b".", b"..", b"a/b"):
        with pytest.raises(OSError) as e:
            table.open_child(table.root, bad)
        assert e.value.errno == errno.EINVAL


def test_writers_and_node_id_hints(table, view):
    (view / "f").write_bytes(b"")
    (view / "g").write_bytes(b"")
    f = learn(table, table.root, b"f")
    f.writers = 2
    assert table.writers_of(f.ino) == 2
    g_st = os.lstat(view / "g")
    assert table.writers_of(g_st.st_ino) == 0
    assert table.nodeid_hint(os.lstat(view / "f")) == f.nodeid
    assert table.nodeid_hint(g_st) == g_st.st_ino  # not known: the inode number
    assert table.nodeid_hint(None) == 0


def test_trim_counts_other_descriptors_and_evicted_inodes_come_back(view):
    t = InodeTable(str(view), frozenset(), {}, 8)
    try:
        if not t.can_evict:
            pytest.skip("no file handles on this filesystem")
        inodes = []
        for i in range(8):
            (view / f"f{i}").write_bytes(str(i).encode())
            inodes.append(learn(t, t.root, f"f{i}".encode()))
        assert t.pooled() == 8
        assert t.trim(0) == 0  # at the budget: nothing to do
        evicted = t.trim(4)  # 4 open handles besides the pool: 12 > 8, down to 8 - 8 // 16
        assert evicted == 4 and t.pooled() == 4
        first = inodes[0]
        assert first.opath == -1 and first.fhandle is not None  # least recently used first
        st = os.lstat(view / "f0")
        assert t.known(st) is first  # inode number and ctime match: certain
        fd = t.fd_of(first)  # reopened by handle
        assert os.fstat(fd).st_ino == first.ino and t.pooled() == 5
        assert t.relpath(first) == b"f0"
    finally:
        t.close()


def test_an_unlinked_inode_is_never_evicted(view):
    t = InodeTable(str(view), frozenset(), {}, 1)
    try:
        (view / "gone").write_bytes(b"")
        a = learn(t, t.root, b"gone")
        os.unlink(view / "gone")
        assert t.trim(10) == 0
        assert a.opath >= 0 and t.relpath(a) is None
    finally:
        t.close()


def test_relpaths_follow_renames(table, view):
    (view / "d").mkdir()
    (view / "d" / "f").write_bytes(b"")
    d = learn(table, table.root, b"d")
    f = learn(table, d, b"f")
    assert table.relpath(table.root) == b""
    assert table.relpath(f) == b"d/f"
    os.rename(view / "d", view / "e")
    assert table.relpath(f) == b"e/f"
    assert table.child_relpath(d, b"x") == b"e/x"
    assert table.child_relpath(table.root, b"x") == b"x"
