"""Unit tests of tierfs.fuse.access: the namespace's permission and name rules (pure)."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from tierfs.fuse import access

OWNER, GROUP = 1000, 1000


@pytest.mark.parametrize(
    ("mode", "uid", "gid", "flags", "allowed"),
    [
        (0o600, OWNER, GROUP, os.O_RDONLY, True),  # owner's triplet
        (0o600, OWNER, GROUP, os.O_RDWR, True),
        (0o400, OWNER, GROUP, os.O_WRONLY, False),
        (0o400, OWNER, GROUP, os.O_RDONLY | os.O_TRUNC, False),  # O_TRUNC needs write
        (0o060, OWNER, GROUP, os.O_RDONLY, False),  # the owner gets the owner's bits only
        (0o640, 2000, GROUP, os.O_RDONLY, True),  # group's triplet
        (0o640, 2000, GROUP, os.O_WRONLY, False),
        (0o604, 2000, 2000, os.O_RDONLY, True),  # others' triplet
        (0o640, 2000, 2000, os.O_RDONLY, False),
        (0o000, 0, 0, os.O_RDWR | os.O_TRUNC, True),  # root may always
    ],
)
def test_may_open_follows_the_mode_bit_triplets(mode, uid, gid, flags, allowed):
    assert access.may_open(mode, OWNER, GROUP, uid, gid, flags) is allowed


def test_needed_bits_per_access_mode():
    assert access.needed_bits(os.O_RDONLY) == access.MAY_READ
    assert access.needed_bits(os.O_WRONLY) == access.MAY_WRITE
    assert access.needed_bits(os.O_RDWR) == access.MAY_READ | access.MAY_WRITE
    assert access.needed_bits(os.O_RDONLY | os.O_TRUNC) == access.MAY_READ | access.MAY_WRITE


def test_opens_for_write():
    assert not access.opens_for_write(os.O_RDONLY)
    assert not access.opens_for_write(os.O_RDONLY | os.O_APPEND)
    assert access.opens_for_write(os.O_WRONLY)
    assert access.opens_for_write(os.O_RDWR)
    assert access.opens_for_write(os.O_RDONLY | os.O_TRUNC)


def test_check_open_access_raises_eacces(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"")
    os.chown(p, OWNER, GROUP)
    os.chmod(p, 0o640)
    st = os.stat(p)
    access.check_open_access(st, OWNER, GROUP, os.O_RDWR)
    with pytest.raises(OSError) as e:
        access.check_open_access(st, 2000, 2000, os.O_RDONLY)
    assert e.value.errno == errno.EACCES


@pytest.mark.parametrize(
    ("mode", "kill"),
    [
        (0o4755, stat.S_ISUID),
        (0o2755, stat.S_ISGID),  # setgid with group execute
        (0o2745, 0),  # setgid without group execute: mandatory locking, kept
        (0o6755, stat.S_ISUID | stat.S_ISGID),
        (0o6745, stat.S_ISUID),
        (0o0755, 0),
        (stat.S_IFREG | 0o4700, stat.S_ISUID),  # type bits are ignored
    ],
)
def test_kill_bits_is_linuxs_should_remove_suid(mode, kill):
    assert access.kill_bits(mode) == kill


@pytest.mark.parametrize("name", [b".", b"..", b"a/b", b"/", b"a/"])
def test_check_name_refuses_what_is_not_one_component(name):
    with pytest.raises(OSError) as e:
        access.check_name(name)
    assert e.value.errno == errno.EINVAL


def test_check_name_accepts_dotted_names():
    for name in (b"a", b".a", b"..a", b"...", b"a.b"):
        access.check_name(name)


def test_reserved_names_only_at_the_root_and_below_reserved_directories():
    reserved = frozenset({b".tierfs"})
    assert access.is_reserved_child(False, True, b".tierfs", reserved)
    assert not access.is_reserved_child(False, False, b".tierfs", reserved)  # not at the root
    assert not access.is_reserved_child(False, True, b"step_1", reserved)
    assert access.is_reserved_child(True, False, b"anything", reserved)  # below .tierfs
    assert not access.is_reserved_child(False, True, None, reserved)
    with pytest.raises(OSError) as e:
        access.check_mutable(False, True, b".tierfs", reserved)
    assert e.value.errno == errno.EPERM
    access.check_mutable(False, True, b"ok", reserved)
    assert access.managed_error().errno == errno.EPERM
