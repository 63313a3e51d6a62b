"""The durable plane's exceptions (the ``BackupError`` family of :mod:`tierfs.core.errors`).

Every message is one line for humans (status, ``replicator.errors``);
:func:`tierfs.backup.client.describe_error` turns library exceptions into such
lines and :func:`tierfs.backup.client.is_transient` tells an outage from an answer.
"""

from __future__ import annotations

from tierfs.core.errors import BackupError


class GcsError(BackupError):
    """A backup or restore could not be done; the message is one line for humans."""


class ChecksumMismatch(GcsError):
    """Bytes in the bucket (or read for upload) differ from the shard manifest."""


class IncompleteRound(GcsError):
    """A round lacks a node's pointer, manifest or data objects."""


class Cancelled(GcsError):
    """The operation was cancelled through its ``cancel`` event."""


class BucketTimeout(GcsError):
    """The caller's deadline passed before the bucket answered (a hanging bucket)."""


class NotYet(GcsError):
    """A polled object is not there yet (retried by a poll policy, never raised out)."""


class BackupCopyError(BackupError):
    """A backup round's copy of a shard cannot be used (one line: why)."""
