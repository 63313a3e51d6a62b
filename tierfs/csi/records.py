"""What the CSI driver keeps per published target: a small record (to tell an
idempotent re-publish from a conflicting one after a driver restart; never a
secret) and which targets have a call in flight (spec "Concurrency")."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from tierfs.core.errors import ProtocolError

__all__ = ["PublishRecord", "PublishRecords", "TargetBusy", "TargetLocks"]


@dataclass(frozen=True)
class PublishRecord:
    """What a publish at one target was: enough to judge a re-publish, nothing secret.

    Attributes:
        target_path: the published target (resolved).
        volume_id: the volume published there.
        readonly: whether the bind mount is read-only.
        digest: sha256 of the publish arguments (secrets and tokens left out).
        created: True if the publish created the target directory (unpublish
            removes it), False if it was there before (the CO's: unpublish
            leaves it), None if unknown (a record of an older driver, or a
            publication adopted without its record).
    """

    target_path: str
    volume_id: str
    readonly: bool
    digest: str
    created: bool | None = None


class PublishRecords:
    """One small JSON file per published target in ``state_dir`` (written atomically).

    Args:
        state_dir: directory for the records (created, mode 0700).
    """

    def __init__(self, state_dir: str) -> None:
        self.dir = state_dir
        os.makedirs(state_dir, mode=0o700, exist_ok=True)

    def _path(self, target: str) -> str:
        return os.path.join(self.dir, hashlib.sha256(target.encode()).hexdigest()[:32] + ".json")

    def get(self, target: str) -> PublishRecord | None:
        """The record for ``target``, or None (missing or unreadable)."""
        try:
            with open(self._path(target), encoding="utf-8") as f:
                data = json.load(f)
            rec = PublishRecord(**data)
        except (OSError, ValueError, TypeError):
            return None
        return rec if rec.target_path == target else None

    def put(self, rec: PublishRecord) -> None:
        """Write the record for ``rec.target_path`` (tmp + rename)."""
        path = self._path(rec.target_path)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec.__dict__, f)
        os.replace(tmp, path)

    def remove(self, target: str) -> None:
        """Forget ``target`` (no error if there is no record)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(target))


# ---------------------------------------------------------------------------- helpers


class TargetBusy(ProtocolError):
    """Another call on the same target is in flight."""


class TargetLocks:
    """Targets with a call in flight (spec "Concurrency": ABORTED for a second call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[str] = set()

    @contextlib.contextmanager
    def hold(self, target: str) -> Iterator[None]:
        """Hold ``target`` for the duration of the block.

        Raises:
            TargetBusy: another call holds it (never waits).
        """
        with self._lock:
            if target in self._busy:
                raise TargetBusy(target)
            self._busy.add(target)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(target)
