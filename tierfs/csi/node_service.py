"""The CSI Node service: publish the node's tierfs mount at a pod's target path
(a bind mount, read-only where asked, ``jax-init-info.txt`` written if asked), and
unpublish it (spec "Node Service RPC").

State lives in the kernel: whether a target is published is read from
/proc/self/mountinfo on every call (:mod:`tierfs.csi.mounts`). A small record
per target (:mod:`tierfs.csi.records`) tells an idempotent re-publish from a
conflicting one after a driver restart; the rules for target paths are
:class:`tierfs.csi.targets.Targets`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from tierfs.csi import mounts
from tierfs.csi import volume_context as vc
from tierfs.csi.abort import Abort, rpc
from tierfs.csi.records import PublishRecord, PublishRecords, TargetBusy, TargetLocks
from tierfs.csi.targets import Targets
from tierfs.rpc import csi_pb2, csi_pb2_grpc

if TYPE_CHECKING:
    from tierfs.csi.identity import NodeMount

log = logging.getLogger("tierfs.csi")

JAX_INIT_INFO = "jax-init-info.txt"

_Mode = csi_pb2.VolumeCapability.AccessMode.Mode
_READ_ONLY_MODES = frozenset({_Mode.SINGLE_NODE_READER_ONLY, _Mode.MULTI_NODE_READER_ONLY})

__all__ = ["JAX_INIT_INFO", "NodeService", "write_atomically"]


def write_atomically(directory: str, name: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``directory/name`` through a temporary sibling and rename (never half a file).

    Raises:
        OSError: e.g. EROFS on a read-only mount; the temporary file is removed.
    """
    tmp = os.path.join(directory, f".tmp.{name}.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _request_summary(request: Any) -> str:
    """A log line for a publish request: never ``secrets``, never a token value."""
    return (
        f"volume_id={request.volume_id!r} target_path={request.target_path!r} "
        f"readonly={request.readonly} secrets={sorted(request.secrets)} "
        f"volume_context={vc.redacted(dict(request.volume_context))}"
    )


@dataclass
class _Publish:
    """A validated NodePublishVolume request."""

    volume_id: str
    target: str
    readonly: bool
    flags: int
    digest: str
    jax: vc.JaxInitInfo | None
    undo: list[Callable[[], None]] = field(default_factory=list)


# ---------------------------------------------------------------------------- services


class NodeService(csi_pb2_grpc.NodeServicer):
    """CSI Node service (spec "Node Service RPC") publishing the node's tierfs mount.

    Args:
        node_id: this node's id (Kubernetes: the node name).
        node: the node's tierfs mount, the source of every bind mount.
        state_dir: where publish records live (see :class:`PublishRecords`).
    """

    def __init__(self, node_id: str, node: NodeMount, state_dir: str) -> None:
        if not node_id:
            raise ValueError("node id must not be empty")
        self.node_id = node_id
        self.node = node
        self.records = PublishRecords(state_dir)
        self.targets = Targets(node, state_dir)
        self.locks = TargetLocks()
        self._jax_lock = threading.Lock()

    @rpc
    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The node id; no volume limit, no topology (spec "NodeGetInfo")."""
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id)

    @rpc
    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        """No node capabilities: no staging, no volume stats (spec "NodeGetCapabilities")."""
        return csi_pb2.NodeGetCapabilitiesResponse()

    # ------------------------------------------------------------------ publish

    def _validate_publish(self, request: Any) -> _Publish:
        """Check a NodePublishVolume request before touching anything.

        Raises:
            Abort: INVALID_ARGUMENT for a missing volume_id, target_path or
                volume_capability, a block or missing access type, an
                unsupported fs type, mount flag or mount group, malformed
                tierfs volume attributes (spec "Error Scheme"), or a target
                path :meth:`tierfs.csi.targets.Targets.check` refuses.
        """
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not request.volume_id:
            raise Abort(bad, "volume_id is required")
        if not request.target_path:
            raise Abort(bad, "target_path is required")
        if not request.HasField("volume_capability"):
            raise Abort(bad, "volume_capability is required")
        cap = request.volume_capability
        kind = cap.WhichOneof("access_type")
        if kind == "block":
            raise Abort(bad, "block access is not supported: tierfs is a filesystem")
        if kind != "mount":
            raise Abort(bad, "volume_capability needs the mount access type")
        if cap.mount.fs_type not in ("", "tierfs", "fuse.tierfs"):
            raise Abort(bad, f"fs_type {cap.mount.fs_type!r} is not supported (leave it empty)")
        if cap.mount.volume_mount_group:
            raise Abort(bad, "volume_mount_group is not supported (fsGroupPolicy: None)")
        try:
            flags = mounts.parse_flags(list(cap.mount.mount_flags))
        except ValueError as exc:
            raise Abort(bad, str(exc)) from None
        try:
            jax = vc.jax_init_info(request.volume_context)
        except vc.ContextError as exc:
            raise Abort(bad, str(exc)) from None
        target = self.targets.check(request.target_path)
        readonly = (
            request.readonly
            or cap.access_mode.mode in _READ_ONLY_MODES
            or bool(flags & mounts.MS_RDONLY)
        )
        params = {
            "volume_id": request.volume_id,
            "readonly": readonly,
            "fs_type": cap.mount.fs_type,
            "flags": flags,
            "mode": int(cap.access_mode.mode),
            "context": vc.comparable(request.volume_context),
            "publish_context": dict(sorted(request.publish_context.items())),
        }
        digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
        return _Publish(request.volume_id, target, readonly, flags & ~mounts.MS_RDONLY, digest, jax)

    @rpc
    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Bind-mount the node's tierfs mount at ``target_path`` (spec "NodePublishVolume").

        Idempotent: the same arguments at a published target answer OK;
        different ones (another volume, readonly flag, capability or context)
        answer ALREADY_EXISTS. A second call on a target with a call in flight
        answers ABORTED. UNAVAILABLE while the node mount is not up. If a step
        fails, every earlier step is undone (the target directory, the record,
        the bind mount) before the error is returned.
        """
        log.info("NodePublishVolume %s", _request_summary(request))
        pub = self._validate_publish(request)
        try:
            with self.locks.hold(pub.target):
                self._publish(pub)
        except TargetBusy:
            raise Abort(
                grpc.StatusCode.ABORTED, f"an operation on {pub.target} is already in progress"
            ) from None
        return csi_pb2.NodePublishVolumeResponse()

    def _publish(self, pub: _Publish) -> None:
        if not self.node.ready():
            raise Abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the node's tierfs mount at {self.node.mountpoint} is not ready yet",
            )
        top = mounts.top_mount(pub.target)
        if top is not None:
            if not self.targets.is_ours(top):
                raise Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{pub.target} holds a {top.fstype} mount that is not tierfs",
                )
            if mounts.is_dead(pub.target):
                log.warning("%s: replacing a bind mount of a tierfs daemon that died", pub.target)
                old = self.records.get(pub.target)
                self.targets.unmount_all(pub.target)
                # the dead mount's publish made the directory, or nobody knows who did
                created: bool | None = old.created if old is not None else None
            else:
                rec = self.records.get(pub.target)
                if top.readonly != pub.readonly or (rec is not None and rec.digest != pub.digest):
                    raise Abort(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"{pub.target} is already published with different arguments"
                        + (f" (volume {rec.volume_id!r})" if rec else ""),
                    )
                if rec is None:  # published by a run whose record is gone: adopt it
                    self.records.put(
                        PublishRecord(
                            pub.target, pub.volume_id, pub.readonly, pub.digest, created=None
                        )
                    )
                log.info("%s already published: OK", pub.target)
                return
        else:
            created = False
        try:
            created = self.targets.make(pub.target, pub.undo) or created
            self.records.put(
                PublishRecord(pub.target, pub.volume_id, pub.readonly, pub.digest, created)
            )
            pub.undo.append(lambda: self.records.remove(pub.target))
            mounts.bind_mount(self.node.mountpoint, pub.target)
            pub.undo.append(lambda: mounts.unmount(pub.target))
            if pub.readonly or pub.flags:
                ro = mounts.MS_RDONLY if pub.readonly else 0
                mounts.remount_bind(pub.target, pub.flags | ro)
            if pub.jax is not None:
                self._write_jax_init_info(pub.jax)
        except BaseException as exc:
            for step in reversed(pub.undo):
                try:
                    step()
                except Exception:  # keep undoing; the original error is reported
                    log.exception("undo after a failed publish of %s", pub.target)
            if isinstance(exc, Abort):
                raise
            if isinstance(exc, OSError):
                raise Abort(
                    grpc.StatusCode.INTERNAL,
                    f"publishing at {pub.target} failed, nothing left behind: "
                    f"{exc.strerror or exc}",
                ) from exc
            raise
        log.info(
            "published %s at %s%s",
            self.node.mountpoint,
            pub.target,
            " (read-only)" if pub.readonly else "",
        )

    def _write_jax_init_info(self, info: vc.JaxInitInfo) -> None:
        """Write ``jax-init-info.txt`` into the node mount root (PROTOCOL.md §1)."""
        with self._jax_lock:
            write_atomically(self.node.mountpoint, JAX_INIT_INFO, info.render())
        log.info(
            "wrote %s: process %d, coordinator %s:%d",
            JAX_INIT_INFO,
            info.process_id,
            info.host,
            info.port,
        )

    # ------------------------------------------------------------------ unpublish

    @rpc
    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Unmount ``target_path`` and remove the directory publish made (spec
        "NodeUnpublishVolume": "The SP MUST delete the file or directory it
        created at this path").

        Idempotent: a target that is not published (missing, an unrelated
        directory, empty or not) answers OK and is not touched. What is
        mounted there is read from /proc/self/mountinfo, so bind mounts made
        by an earlier run of the driver are found too. Which directories are
        removed: :meth:`tierfs.csi.targets.Targets.remove`.

        The target path identifies the publication, not ``volume_id``: the CO
        keeps target paths unique per volume (spec "NodePublishVolume"), a
        target holds at most one publication (another volume there answers
        ALREADY_EXISTS), and must be unpublished at least once for each
        successful publish. An unpublish naming another volume than the
        record therefore still unpublishes the target, with a warning: a
        refusal would leave the pod stuck terminating, and it cannot reach
        another volume's data (every tierfs volume is the same node mount).
        ``volume_id`` is still required (INVALID_ARGUMENT without it).
        """
        bad = grpc.StatusCode.INVALID_ARGUMENT
        log.info(
            "NodeUnpublishVolume volume_id=%r target_path=%r",
            request.volume_id,
            request.target_path,
        )
        if not request.volume_id:
            raise Abort(bad, "volume_id is required")
        target = self.targets.check(request.target_path)
        try:
            with self.locks.hold(target):
                rec = self.records.get(target)
                if rec is not None and rec.volume_id != request.volume_id:
                    log.warning(
                        "%s was published for volume %r; unpublishing it for %r, "
                        "as the target path names the publication",
                        target,
                        rec.volume_id,
                        request.volume_id,
                    )
                unmounted = self.targets.unmount_all(target)
                self.targets.remove(target, rec, unmounted)
                self.records.remove(target)
        except TargetBusy:
            raise Abort(
                grpc.StatusCode.ABORTED, f"an operation on {target} is already in progress"
            ) from None
        log.info("unpublished %s", target)
        return csi_pb2.NodeUnpublishVolumeResponse()
