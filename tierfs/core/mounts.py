"""What /proc/self/mountinfo says about a path: the mount at it, the filesystem it lies on.

Read from the file every time (mounts change under a running daemon), never
with a stat of the path itself: a stat of a FUSE mount point would ask the
daemon, which may be the caller (a deadlock) or dead (a hang). The parsing
is pure (:func:`parse_line`, :func:`entry_at`, :func:`fs_type_in`) and the
two readers (:func:`mount_entry`, :func:`fs_type`) only add the file.

Format (proc(5)): ``id parent major:minor root mountpoint options [optional
fields...] - fstype source super-options``; paths escape space, tab,
newline and backslash as ``\\ooo`` octal.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

MOUNTINFO = "/proc/self/mountinfo"

#: a parsed line. Keys: ``mountpoint``, ``fstype``, ``source``, ``options`` (the
#: per-mount options, a comma, the super options), ``device`` (major:minor)
MountDict = dict[str, str]


def unescape(field: str) -> str:
    r"""Undo mountinfo's octal escapes (``\040`` space, ``\011`` tab, ``\012``, ``\134``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_line(line: str) -> MountDict | None:
    """One mountinfo line as a :data:`MountDict`; None for a line that is not one."""
    left, sep, right = line.partition(" - ")
    fields, rfields = left.split(), right.split()
    if not sep or len(fields) < 6 or len(rfields) < 2:
        return None
    return {
        "mountpoint": unescape(fields[4]),
        "fstype": rfields[0],
        "source": unescape(rfields[1]),
        "options": fields[5] + "," + (rfields[2] if len(rfields) > 2 else ""),
        "device": fields[2],
    }


def entry_at(lines: Iterable[str], path: str) -> MountDict | None:
    """The entry mounted exactly at the absolute path ``path``: the top one (listed last)."""
    found = None
    for line in lines:
        entry = parse_line(line)
        if entry is not None and entry["mountpoint"] == path:
            found = entry
    return found


def fs_type_in(lines: Iterable[str], path: str) -> str:
    """Type of the filesystem the absolute path ``path`` lies on; "unknown" if none matches.

    The mount with the longest mount point containing ``path`` (the later
    one of equal mount points: it is on top).
    """
    best, best_type = "", "unknown"
    for line in lines:
        entry = parse_line(line)
        if entry is None:
            continue
        mnt = entry["mountpoint"]
        inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, best_type = mnt, entry["fstype"]
    return best_type


def mount_entry(path: str) -> MountDict | None:
    """The /proc/self/mountinfo entry mounted exactly at ``path`` (the top one), or None.

    ``path`` is made absolute, symlinks are not resolved (mountinfo lists
    resolved paths: pass a resolved one). None also when mountinfo cannot be
    read.
    """
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            return entry_at(f, os.path.abspath(path))
    except OSError:
        return None


def is_mountpoint(path: str) -> bool:
    """True if ``path`` is listed as a mount point in /proc/self/mountinfo."""
    return mount_entry(path) is not None


def fs_type(path: str) -> str:
    """The filesystem type of ``path`` as /proc/self/mountinfo names it ("tmpfs", "ext4", ...).

    Symlinks in ``path`` are resolved; "unknown" when nothing matches or
    mountinfo cannot be read.
    """
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            return fs_type_in(f, os.path.realpath(path))
    except OSError:
        return "unknown"
