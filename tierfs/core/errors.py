"""The one exception tree of tierfs: every exception tierfs defines is a :class:`TierfsError`.

::

    TierfsError
    ├── ConfigurationError   flags, config file, TIERFS_* variables, sizes, mount
    │                        options, CSI volume attributes, rendered manifests
    │       ConfigError (ValueError) > SettingError; SizeError (ValueError);
    │       MountOptionError (ValueError); ContextError (ValueError); RenderError (ValueError)
    ├── ProtocolError        a control file or a call that breaks its protocol
    │       ControlError (ValueError: replicator.yaml, jax-init-info.txt ...);
    │       CSI: Abort (ends the RPC with a status code), TargetBusy;
    │       StatusFormatError (ValueError: a .tierfs/status.json that is no status)
    ├── StorageError         the RAM store: manifests, seals
    │       ManifestError (ValueError); SealBusy
    ├── BackupError          the bucket: layout, rounds, transfers, copies
    │       GcsError > ChecksumMismatch, IncompleteRound, Cancelled, BucketTimeout;
    │       LayoutError (ValueError); BackupCopyError
    ├── ClusterError         the peer plane and the cluster agreement
    │       TransferError > BadCopy, Refused, Cancelled; Rejected; HostGone
    ├── RestoreError         a restore that cannot finish
    │       RestoreFailed > RestoreTimeout > NodesMissing; RestoreFailed > RestoreRefused;
    │       CopyFailed (one source's copy: the restorer tries the next)
    └── (tools, no family)   ApiError (RuntimeError, the operator's Kubernetes API),
                             DemoError (RuntimeError) > DemoInterrupted, EmulatorError
                             (RuntimeError)

Each class keeps its name, its module and its builtin base (``ValueError``,
``RuntimeError``), so code that catches ``ValueError`` or a leaf class catches
what it caught before; ``except TierfsError`` (or a family) catches every
failure tierfs itself raised, nothing from a library.

Not in the tree on purpose: ``OSError`` with an errno (``ENOSPC`` from the RAM
budget, ``EIO``, ``ENOENT``): the FUSE layer answers the kernel with that errno
and callers match on it; library exceptions (``grpc.RpcError``,
``google.api_core`` exceptions) propagate as they are, judged by
:func:`tierfs.backup.bucket.is_transient` and the policies of
:mod:`tierfs.core.retry`.

This module imports nothing of tierfs (the bottom of the layers), so every
package can derive from it.
"""

from __future__ import annotations

import errno

__all__ = [
    "NO_ROOM_ERRNOS",
    "BackupError",
    "ClusterError",
    "ConfigurationError",
    "FetchFailed",
    "ProtocolError",
    "RestoreError",
    "StorageError",
    "TierfsError",
]


class TierfsError(Exception):
    """Any failure tierfs itself raises; the message is one line for humans."""


class ConfigurationError(TierfsError):
    """Bad input from the operator: a flag, the config file, a ``TIERFS_*`` variable, a
    size, a mount option, a CSI volume attribute, a rendered manifest. Fails the command
    (or the mount) with the message; nothing was changed."""


class ProtocolError(TierfsError):
    """A control file or a call breaks its protocol (PROTOCOL.md: ``replicator.yaml``,
    ``jax-init-info.txt``; the CSI spec's call rules)."""


class StorageError(TierfsError):
    """The RAM store cannot do what was asked (a malformed manifest, a seal while a file
    is still open). A full RAM budget is ``OSError(ENOSPC)``, not this."""


class BackupError(TierfsError):
    """A backup or a restore from the bucket could not be done (the bucket layout, a
    round, a transfer, a copy)."""


class ClusterError(TierfsError):
    """The peer plane or the cluster agreement failed (a transfer, a join the coordinator
    refuses, a peer host that is not running)."""


class RestoreError(TierfsError):
    """A restore that cannot finish; the reason is in ``replicator.errors``."""


#: errno values of a write that found no room (RAM budget, tmpfs size, quota, file size):
#: no other copy of the same bytes would fit either
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class FetchFailed(TierfsError):
    """No copy in a tier could hand over a file of another rank's part (issue #14);
    the message names every copy tried and why it failed.

    Attributes:
        other_bytes: a copy holds other bytes of the file than the caller's
            manifest says (the part saved again since it was read), as opposed to
            no copy, a damaged one or an unreachable one.
        superseded: the part's own node holds a newer part of the step whose file
            has other bytes: every other copy of the caller's part is of an earlier
            save, and no further source may serve it (#14 trial 60 M1a).
    """

    def __init__(
        self, message: str, *, other_bytes: bool = False, superseded: bool = False
    ) -> None:
        super().__init__(message)
        self.other_bytes = other_bytes or superseded
        self.superseded = superseded
