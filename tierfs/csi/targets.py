"""The target paths of NodePublishVolume and NodeUnpublishVolume: which ones may be
published at all, creating them, what is mounted there, and removing them after.

:class:`Targets` refuses a target that would harm the node (the node mount, its
ram-dirs, the driver's state directory, anything inside a tierfs mount), creates
a target and its parents with an undo list, unmounts every tierfs mount stacked
at a target (never another filesystem's), and removes the directory afterwards
only when it is the driver's to remove (spec "NodeUnpublishVolume").
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from tierfs.csi import mounts
from tierfs.csi.abort import Abort

if TYPE_CHECKING:
    from tierfs.csi.identity import NodeMount
    from tierfs.csi.records import PublishRecord

log = logging.getLogger("tierfs.csi")

#: Linux's limits on a path (with its NUL) and on one name in it, in bytes
PATH_MAX = 4096
NAME_MAX = 255

__all__ = ["NAME_MAX", "PATH_MAX", "Targets"]


class Targets:
    """The rules and steps for target paths on this node.

    Args:
        node: the node's tierfs mount (its mountpoint and ram-dirs are protected).
        state_dir: the driver's state directory (protected too).
    """

    def __init__(self, node: NodeMount, state_dir: str) -> None:
        self.node = node
        self.state_dir = state_dir

    def check(self, target_path: str) -> str:
        """Check a ``target_path`` of publish or unpublish; return it resolved (realpath).

        Refused, before anything is touched, are paths that hold a NUL byte,
        are not absolute or are too long for Linux (PATH_MAX, NAME_MAX), and
        paths a bind mount would harm the node through:

        * the node's tierfs mount (``--mount-dir``), anything inside it, and
          any directory above it (a mount there would hide it from the
          driver); unpublishing the mount dir would end the daemon under
          every pod;
        * the ram-dir(s) behind it, inside them, or above them;
        * the driver's state directory, inside it, or above it;
        * a path inside any tierfs mount (a published target included):
          tierfs would be mounted inside itself, and the directories a
          publish creates would appear to every trainer.

        Symlinks are resolved first, so no link leads around these rules;
        the resolved path is where mount(2) would act, and what the
        publication is recorded under.

        Raises:
            Abort: INVALID_ARGUMENT naming the rule (spec "Error Scheme":
                "Invalid or unsupported field in the request").
        """
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not target_path:
            raise Abort(bad, "target_path is required")
        if "\0" in target_path:
            raise Abort(bad, "target_path must not contain a NUL byte")
        if not os.path.isabs(target_path):
            raise Abort(bad, "target_path must be an absolute path")
        if len(os.fsencode(target_path)) >= PATH_MAX or any(
            len(os.fsencode(part)) > NAME_MAX for part in target_path.split("/")
        ):
            raise Abort(
                bad,
                f"target_path is longer than Linux allows ({PATH_MAX - 1} bytes, "
                f"{NAME_MAX} per name)",
            )
        target = os.path.realpath(target_path)
        named = os.path.normpath(target_path)
        own = [("the node's tierfs mount", self.node.mountpoint)]
        own += [("the node's ram-dir", d) for d in self.node.ram_dirs()]
        own.append(("the CSI driver's state directory", self.state_dir))
        for what, path in own:
            for p in dict.fromkeys((os.path.normpath(path), os.path.realpath(path))):
                for t in dict.fromkeys((named, target)):
                    if mounts.is_within(t, p):
                        where = "is" if t == p else "lies inside"
                        raise Abort(
                            bad,
                            f"target_path {target_path} {where} {what} ({p}): "
                            "volumes cannot be published there",
                        )
                    if mounts.is_within(p, t):
                        raise Abort(
                            bad,
                            f"target_path {target_path} contains {what} ({p}): "
                            "a mount there would hide it",
                        )
        outer = mounts.containing_mount(os.path.dirname(target))
        if outer is not None and self.is_ours(outer):
            raise Abort(
                bad,
                f"target_path {target_path} lies inside the tierfs mount at "
                f"{outer.mountpoint}: volumes cannot be published inside tierfs",
            )
        return target

    def make(self, target: str, undo: list[Callable[[], None]]) -> bool:
        """Create ``target`` and any missing parents, appending their removal to ``undo``.

        Returns:
            True if ``target`` itself was created here.

        Raises:
            Abort: FAILED_PRECONDITION if ``target`` exists and is not a directory.
            OSError: mkdir failed.
        """
        missing: list[str] = []
        path = target
        while True:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                missing.append(path)
                path = os.path.dirname(path)
                continue
            if path == target and not stat.S_ISDIR(st.st_mode):
                raise Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{target} exists and is not a directory",
                )
            break
        for d in reversed(missing):
            os.mkdir(d, 0o750)
            undo.append(functools.partial(os.rmdir, d))
        return bool(missing)

    def is_ours(self, entry: mounts.MountEntry) -> bool:
        """True if ``entry`` is a tierfs FUSE mount (a bind of this or an earlier node mount)."""
        node = mounts.top_mount(self.node.mountpoint)
        if node is not None and entry.device == node.device:
            return True
        fstypes = {"fuse.tierfs"}
        if node is not None and node.fstype.startswith("fuse."):
            fstypes.add(node.fstype)
        return entry.fstype in fstypes

    def unmount_all(self, target: str) -> int:
        """Unmount every tierfs mount stacked at ``target``.

        Returns:
            how many mounts were unmounted.

        Raises:
            Abort: FAILED_PRECONDITION if a mount that is not tierfs is found there.
        """
        count = 0
        while True:
            top = mounts.top_mount(target)
            if top is None:
                return count
            if not self.is_ours(top):
                raise Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{target} holds a {top.fstype} mount that is not tierfs; not unmounting it",
                )
            mounts.unmount(target)
            count += 1

    def remove(self, target: str, rec: PublishRecord | None, unmounted: int) -> None:
        """Remove the target directory after unpublishing, if it is the driver's to remove.

        Removed (``rmdir``, so only when empty) is a directory the record says
        a publish created, or, when who created it is unknown (no record, or
        a record of an older driver), one that held a tierfs bind mount: a
        mountpoint a tierfs publish made. Left alone, with a log line: a
        directory that was there before the publish (the CO's), any path
        that was not published (not mounted, no record: nothing to undo, spec
        "NodeUnpublishVolume" is idempotent), and a published directory that
        is not empty once unmounted (something wrote into it underneath the
        mount; removing it would lose that).

        Raises:
            OSError: rmdir failed for another reason (EACCES, EROFS, EBUSY, ...):
                INTERNAL, and the record stays so a retry removes it.
        """
        if rec is not None and rec.created is not None:
            ours = rec.created
            why = "created by the publish" if ours else "there before the publish"
        else:
            ours = unmounted > 0
            why = "a tierfs mountpoint" if ours else "not published"
        if not ours:
            if os.path.lexists(target):
                log.info("%s: %s; left in place", target, why)
            return
        try:
            os.rmdir(target)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            log.warning(
                "%s: %s, but %s once unmounted; left in place",
                target,
                why,
                "not a directory" if exc.errno == errno.ENOTDIR else "not empty",
            )
