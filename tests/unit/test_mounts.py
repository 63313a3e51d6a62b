"""Unit tests of tierfs.core.mounts: parsing /proc/self/mountinfo (pure) and reading it."""

from __future__ import annotations

import os

from tierfs.core import mounts

LINES = [
    "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n",
    "30 22 0:30 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=65536k\n",
    "41 30 0:41 / /dev/shm/ram rw,nosuid,nodev - tmpfs tierfs-ram rw,size=1048576k,mode=700\n",
    "42 22 0:42 / /mnt/with\\040space rw - fuse.tierfs tierfs rw,user_id=0,group_id=0\n",
    "43 41 0:43 / /dev/shm/ram rw - tmpfs tierfs-ram rw,size=2097152k\n",  # mounted on top
    "garbage\n",
]


def test_parse_line_fields_and_escapes():
    e = mounts.parse_line(LINES[3])
    assert e == {
        "mountpoint": "/mnt/with space",
        "fstype": "fuse.tierfs",
        "source": "tierfs",
        "options": "rw,rw,user_id=0,group_id=0",
        "device": "0:42",
    }
    assert mounts.parse_line("garbage") is None
    assert mounts.parse_line("1 2 3 4 5 6 - tmpfs") is None  # no source
    assert mounts.unescape("a\\011b\\012c\\134d") == "a\tb\nc\\d"


def test_entry_at_is_the_top_mount_exactly_at_the_path():
    top = mounts.entry_at(LINES, "/dev/shm/ram")
    assert top is not None and top["device"] == "0:43" and top["source"] == "tierfs-ram"
    assert mounts.entry_at(LINES, "/dev/shm/ram/view") is None  # inside, not at
    assert mounts.entry_at(LINES, "/mnt/with space") is not None


def test_fs_type_in_takes_the_longest_containing_mount_point():
    assert mounts.fs_type_in(LINES, "/dev/shm/ram/view/x") == "tmpfs"
    assert mounts.fs_type_in(LINES, "/dev/shm/other") == "tmpfs"
    assert mounts.fs_type_in(LINES, "/dev/shmem") == "ext4"  # a prefix, not a parent
    assert mounts.fs_type_in(LINES, "/mnt/with space/a") == "fuse.tierfs"
    assert mounts.fs_type_in([], "/x") == "unknown"


def test_the_readers_see_this_process_mounts():
    assert mounts.is_mountpoint("/")
    assert mounts.mount_entry("/") is not None
    assert mounts.fs_type("/proc/self") == "proc"
    assert not mounts.is_mountpoint(os.path.join("/proc", "self", "no-such-mount"))
