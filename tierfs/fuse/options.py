"""Options of a FUSE mount: the ``-o`` list (libfuse's names) and what mount(2) is given.

:meth:`MountOptions.parse` turns ``-o`` values into :class:`MountOptions`
(clear errors for unknown options and bad values); :func:`mount_data` is the
data string of a root mount(2) of ``/dev/fuse``, :func:`fusermount_options`
the ``-o`` of ``fusermount3`` for other users.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from tierfs.core import syscalls
from tierfs.core.errors import ConfigurationError

#: longest accepted entry/attr cache timeout (seconds, about 31 years): "forever"
#: in practice, and it fits the protocol's u64 seconds with room to spare
MAX_TIMEOUT = 1e9

_FLAG_OPTS = {
    "ro": 1,  # MS_RDONLY
    "nosuid": syscalls.MS_NOSUID,
    "nodev": syscalls.MS_NODEV,
    "noexec": 8,
    "sync": 16,
    "dirsync": 128,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
}
_NEGATED = {
    "rw": "ro",
    "suid": "nosuid",
    "dev": "nodev",
    "exec": "noexec",
    "atime": "noatime",
    "async": "sync",
}


class MountOptionError(ConfigurationError, ValueError):
    """An ``-o`` option tierfs does not understand or a value it cannot parse."""


@dataclass
class MountOptions:
    """Options of one FUSE mount (the ``-o`` list plus tierfs's own).

    Attributes:
        allow_other: let users other than the mounter in (FUSE ``allow_other``).
        default_permissions: the kernel checks mode bits (always on unless
            ``-o no_default_permissions``, which only the mounting user may use:
            it is refused together with ``allow_other``).
        flags: mount(2) flags (MS_RDONLY, MS_NOSUID, ...).
        fsname: the source shown in /proc/mounts.
        passthrough: use FUSE passthrough when the kernel and budget allow.
        entry_timeout, attr_timeout: kernel cache lifetimes in seconds.
        max_read: optional FUSE ``max_read`` (bytes).
        auto_unmount: unmount when the daemon dies.
    """

    allow_other: bool = False
    default_permissions: bool = True
    flags: int = syscalls.MS_NOSUID | syscalls.MS_NODEV
    fsname: str = "tierfs"
    subtype: str = "tierfs"
    passthrough: bool = True
    entry_timeout: float = 10.0
    attr_timeout: float = 10.0
    max_read: int | None = None
    auto_unmount: bool = False
    extra: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, opts: list[str]) -> MountOptions:
        """Parse ``-o`` values (each may hold a comma-separated list).

        Raises:
            MountOptionError: unknown option or bad value, naming it.
        """
        result = cls()
        for group in opts:
            for raw in group.split(","):
                opt = raw.strip()
                if not opt:
                    continue
                key, eq, value = opt.partition("=")
                try:
                    result._apply(key, value if eq else None)
                except ValueError as exc:
                    raise MountOptionError(f"bad mount option {opt!r}: {exc}") from None
        if result.allow_other and not result.default_permissions:
            # The daemon runs as root and checks no mode bits itself: with other users let
            # in, each could read, write, chmod and delete every file of every other user.
            raise MountOptionError(
                "no_default_permissions cannot be combined with allow_other or allow_root: tierfs "
                "leaves permission checks to the kernel (default_permissions), so every "
                "user let in could read and change every file"
            )
        return result

    def _apply(self, key: str, value: str | None) -> None:
        if key in _FLAG_OPTS:
            self.flags |= _FLAG_OPTS[key]
        elif key in _NEGATED:
            self.flags &= ~_FLAG_OPTS[_NEGATED[key]]
        elif key in ("allow_other", "allow_root"):
            self.allow_other = True
        elif key == "default_permissions":
            self.default_permissions = True
        elif key == "no_default_permissions":
            self.default_permissions = False
        elif key == "fsname" and value:
            self.fsname = value
        elif key == "subtype" and value:
            self.subtype = value
        elif key in ("entry_timeout", "attr_timeout", "negative_timeout") and value is not None:
            seconds = float(value)
            if not math.isfinite(seconds) or not 0 <= seconds <= MAX_TIMEOUT:
                raise ValueError(
                    f"a timeout must be a number of seconds from 0 to {MAX_TIMEOUT:.0f}"
                )
            if key == "entry_timeout":
                self.entry_timeout = seconds
            elif key == "attr_timeout":
                self.attr_timeout = seconds
        elif key == "max_read" and value is not None:
            self.max_read = int(value)
            if not 0 < self.max_read < 1 << 32:
                raise ValueError("max_read must be a positive number of bytes below 4 GiB")
        elif key == "auto_unmount":
            self.auto_unmount = True
        elif key == "passthrough":
            self.passthrough = value in (None, "on", "1", "true", "yes")
        elif key == "no_passthrough":
            self.passthrough = False
        elif key in (
            "nonempty",
            "big_writes",
            "atomic_o_trunc",
            "splice_read",
            "splice_write",
            "splice_move",
            "hard_remove",
            "use_ino",
            "kernel_cache",
            "auto_cache",
        ):
            self.extra.append(key)  # libfuse-era options: accepted, tierfs behaves so already
        else:
            raise ValueError("unknown option")


def mount_data(fd: int, opts: MountOptions, rootmode: int) -> str:
    """The data string of mount(2) for ``/dev/fuse`` open as ``fd``; ``rootmode``: S_IFMT bits."""
    parts = [
        f"fd={fd}",
        f"rootmode={rootmode:o}",
        f"user_id={os.getuid()}",
        f"group_id={os.getgid()}",
    ]
    if opts.allow_other:
        parts.append("allow_other")
    if opts.default_permissions:
        parts.append("default_permissions")
    if opts.max_read:
        parts.append(f"max_read={opts.max_read}")
    return ",".join(parts)


def fusermount_options(opts: MountOptions) -> str:
    """The ``-o`` argument of ``fusermount3`` for ``opts`` (nosuid, nodev: its own defaults)."""
    parts = [f"fsname={opts.fsname}", f"subtype={opts.subtype}"]
    if opts.allow_other:
        parts.append("allow_other")
    if opts.default_permissions:
        parts.append("default_permissions")
    names = {v: k for k, v in _FLAG_OPTS.items()}
    for bit, name in names.items():
        if opts.flags & bit and name not in ("nosuid", "nodev"):
            parts.append(name)
    return ",".join(parts)
