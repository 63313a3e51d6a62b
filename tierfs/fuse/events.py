"""What the namespace tells the node agent: the :class:`FsEvents` port.

The namespace calls these on the FUSE thread, in the request that caused
them; a receiver must be quick and must not block (the node agent hands the
work to trio, see :class:`tierfs.node.intake.AgentEvents`). Paths are bytes
relative to the mount root.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol


class FsEvents(Protocol):
    """What the namespace tells the node agent. Called on the FUSE thread: be quick."""

    def opening_for_write(self, ino: int) -> None:
        """Backing inode ``ino`` is about to be opened for writing or truncated."""

    def changed(self, relpath: bytes) -> None:
        """The entry ``relpath`` (relative to the mount root) was created, removed or modified."""

    def renamed(self, old: bytes, new: bytes, mode: int) -> None:
        """``old`` was renamed to ``new`` (paths relative to the root); ``mode`` is its st_mode."""

    def released(self, relpath: bytes | None, ino: int) -> None:
        """A handle opened for writing was closed; ``relpath`` is None if the file is unlinked."""

    def removing(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """The last link of regular file ``ino`` (backing inode number) is about to go:
        None to go ahead, else what to wait for first (the node's own reader of the
        file letting go of it, so that its RAM is free once the removal is answered)."""


class NullEvents:
    """An :class:`FsEvents` that ignores everything (a bare RAM filesystem)."""

    def opening_for_write(self, ino: int) -> None:
        """Ignored."""

    def changed(self, relpath: bytes) -> None:
        """Ignored."""

    def renamed(self, old: bytes, new: bytes, mode: int) -> None:
        """Ignored."""

    def released(self, relpath: bytes | None, ino: int) -> None:
        """Ignored."""

    def removing(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """Nothing to wait for."""
        return None
