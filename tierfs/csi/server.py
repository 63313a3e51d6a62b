"""The CSI Identity and Node services of tierfs, served by grpcio on a unix socket.

Follows the CSI v1 specification (container-storage-interface/spec, spec.md);
section names are cited where a rule comes from. In short:

* Identity: ``GetPluginInfo``, ``GetPluginCapabilities`` (none: no controller
  service, no topology), ``Probe`` (ready once the node's tierfs mount answers and
  the driver recorded or adopted it;
  FAILED_PRECONDITION when /dev/fuse is missing or the mount failed).
* Node: ``NodeGetInfo``, ``NodeGetCapabilities`` (none: no staging),
  ``NodePublishVolume`` (bind-mount the node's tierfs mount at
  ``target_path``; read-only through a read-only bind remount; write
  ``jax-init-info.txt``), ``NodeUnpublishVolume``. Every other CSI RPC is
  absent from the servicer and gRPC answers UNIMPLEMENTED ("Error Scheme").

State lives in the kernel: whether a target is published is read from
/proc/self/mountinfo on every call (:mod:`tierfs.csi.mounts`). A small record
per target (volume id and a digest of the publish arguments, never a secret)
is kept in a state directory only to tell an idempotent re-publish from a
conflicting one after a driver restart.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf import wrappers_pb2

from tierfs import __version__
from tierfs.core.errors import ProtocolError
from tierfs.csi import mounts
from tierfs.csi import volume_context as vc
from tierfs.csi.nodemount import read_status
from tierfs.rpc import csi_pb2, csi_pb2_grpc

log = logging.getLogger("tierfs.csi")

#: the gRPC methods this server registers (CSI spec "RPC Interface"); gRPC answers
#: every other CSI method UNIMPLEMENTED
IDENTITY_METHODS = ("GetPluginInfo", "GetPluginCapabilities", "Probe")
NODE_METHODS = ("NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities", "NodeGetInfo")
METHOD_PATHS = tuple(
    [f"/csi.v1.Identity/{m}" for m in IDENTITY_METHODS]
    + [f"/csi.v1.Node/{m}" for m in NODE_METHODS]
)

#: the driver name: domain-name notation, at most 63 characters (spec "GetPluginInfo")
DEFAULT_DRIVER_NAME = "tierfs.csi.dev"
JAX_INIT_INFO = "jax-init-info.txt"
FUSE_DEVICE = "/dev/fuse"
#: Linux's limits on a path (with its NUL) and on one name in it, in bytes
PATH_MAX = 4096
NAME_MAX = 255
_NAME_RE = r"^[A-Za-z0-9]([A-Za-z0-9.\-]{0,61}[A-Za-z0-9])?$"

_Mode = csi_pb2.VolumeCapability.AccessMode.Mode
_READ_ONLY_MODES = frozenset({_Mode.SINGLE_NODE_READER_ONLY, _Mode.MULTI_NODE_READER_ONLY})


class NodeMount(Protocol):
    """What the servicer needs to know about the node's tierfs mount."""

    mountpoint: str

    def ready(self) -> bool:
        """True once the mount answers requests."""

    def error(self) -> str | None:
        """Why the mount is not up, if starting it failed; None while starting or up."""

    def ram_dirs(self) -> list[str]:
        """The ram-dir(s) holding the mount's bytes, as far as known (absolute paths)."""


@dataclass
class StaticMount:
    """A :class:`NodeMount` for a mount someone else keeps up (tests, ``--no-mount``).

    Attributes:
        mountpoint: where the tierfs mount is.
        ram_dir: its ram-dir, if known; the one the daemon reports is used too.
    """

    mountpoint: str
    ram_dir: str | None = None

    def ready(self) -> bool:
        """True if a FUSE filesystem is mounted at the mountpoint and answers stat."""
        entry = mounts.top_mount(self.mountpoint)
        return (
            entry is not None
            and entry.fstype.startswith("fuse")
            and not mounts.is_dead(self.mountpoint)
        )

    def error(self) -> str | None:
        """Always None: nothing is started here."""
        return None

    def ram_dirs(self) -> list[str]:
        """``ram_dir`` if given, and the ram-dir the mount's ``.tierfs/status.json`` names."""
        status = read_status(self.mountpoint)
        found = status.ram_dir if status is not None and isinstance(status.ram_dir, str) else None
        return [d for d in dict.fromkeys((self.ram_dir, found)) if d]


def validate_driver_name(name: str) -> str:
    """Check a driver name against the spec's rule (spec "GetPluginInfo": <= 63 chars,
    alphanumeric at both ends, dashes, dots and alphanumerics between).

    Raises:
        ValueError: naming the rule broken.
    """
    if not re.match(_NAME_RE, name):
        raise ValueError(
            f"driver name {name!r} must be at most 63 characters of [A-Za-z0-9.-], "
            "beginning and ending with an alphanumeric character"
        )
    return name


# ---------------------------------------------------------------------------- records


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


class Abort(ProtocolError):
    """End the RPC with this gRPC status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn :class:`Abort` and unexpected errors into a gRPC status with a message."""

    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Abort as exc:
            log.info("%s: %s: %s", fn.__name__, exc.code.name, exc.message)
            context.abort(exc.code, exc.message)
        except Exception as exc:  # every failure must become a status
            log.exception("%s failed", fn.__name__)
            msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: {msg}")

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


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


class IdentityService(csi_pb2_grpc.IdentityServicer):
    """CSI Identity service (spec "Identity Service RPC").

    Args:
        name: the driver name (see :func:`validate_driver_name`).
        node: the node's tierfs mount.
        fuse_device: the FUSE device whose absence makes Probe fail.
    """

    def __init__(self, name: str, node: NodeMount, fuse_device: str = FUSE_DEVICE) -> None:
        self.name = validate_driver_name(name)
        self.node = node
        self.fuse_device = fuse_device

    @_rpc
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Name and version (spec "GetPluginInfo": both REQUIRED)."""
        return csi_pb2.GetPluginInfoResponse(name=self.name, vendor_version=__version__)

    @_rpc
    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        """No plugin capabilities: node service only, no topology constraints."""
        return csi_pb2.GetPluginCapabilitiesResponse()

    @_rpc
    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Readiness (spec "Probe"): FAILED_PRECONDITION for a missing dependency
        (/dev/fuse) or a mount that failed to start; ``ready=false`` while the
        mount is still starting; ``ready=true`` once it answers.
        """
        if not os.path.exists(self.fuse_device):
            raise Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.fuse_device} is missing: tierfs needs FUSE (privileged container)",
            )
        ready = self.node.ready()
        if not ready:
            err = self.node.error()
            if err:
                raise Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the node's tierfs mount at {self.node.mountpoint} failed: {err}",
                )
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=ready))


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
        self.locks = TargetLocks()
        self._jax_lock = threading.Lock()

    @_rpc
    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The node id; no volume limit, no topology (spec "NodeGetInfo")."""
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id)

    @_rpc
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
                path :meth:`_check_target` refuses.
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
        target = self._check_target(request.target_path)
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

    def _check_target(self, target_path: str) -> str:
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
        own.append(("the CSI driver's state directory", self.records.dir))
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
        if outer is not None and self._is_ours(outer):
            raise Abort(
                bad,
                f"target_path {target_path} lies inside the tierfs mount at "
                f"{outer.mountpoint}: volumes cannot be published inside tierfs",
            )
        return target

    @_rpc
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
            if not self._is_ours(top):
                raise Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{pub.target} holds a {top.fstype} mount that is not tierfs",
                )
            if mounts.is_dead(pub.target):
                log.warning("%s: replacing a bind mount of a tierfs daemon that died", pub.target)
                old = self.records.get(pub.target)
                self._unmount_all(pub.target)
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
            created = self._make_target(pub) or created
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

    def _make_target(self, pub: _Publish) -> bool:
        """Create ``target_path`` and any missing parents, queueing their removal on undo.

        Returns:
            True if ``target_path`` itself was created here.
        """
        missing = []
        path = pub.target
        while True:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                missing.append(path)
                path = os.path.dirname(path)
                continue
            if path == pub.target and not stat.S_ISDIR(st.st_mode):
                raise Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{pub.target} exists and is not a directory",
                )
            break
        for d in reversed(missing):
            os.mkdir(d, 0o750)
            pub.undo.append(lambda d=d: os.rmdir(d))
        return bool(missing)

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

    def _is_ours(self, entry: mounts.MountEntry) -> bool:
        """True if ``entry`` is a tierfs FUSE mount (a bind of this or an earlier node mount)."""
        node = mounts.top_mount(self.node.mountpoint)
        if node is not None and entry.device == node.device:
            return True
        fstypes = {"fuse.tierfs"}
        if node is not None and node.fstype.startswith("fuse."):
            fstypes.add(node.fstype)
        return entry.fstype in fstypes

    def _unmount_all(self, target: str) -> int:
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
            if not self._is_ours(top):
                raise Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{target} holds a {top.fstype} mount that is not tierfs; not unmounting it",
                )
            mounts.unmount(target)
            count += 1

    def _remove_target(self, target: str, rec: PublishRecord | None, unmounted: int) -> None:
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

    @_rpc
    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Unmount ``target_path`` and remove the directory publish made (spec
        "NodeUnpublishVolume": "The SP MUST delete the file or directory it
        created at this path").

        Idempotent: a target that is not published (missing, an unrelated
        directory, empty or not) answers OK and is not touched. What is
        mounted there is read from /proc/self/mountinfo, so bind mounts made
        by an earlier run of the driver are found too. Which directories are
        removed: :meth:`_remove_target`.

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
        target = self._check_target(request.target_path)
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
                unmounted = self._unmount_all(target)
                self._remove_target(target, rec, unmounted)
                self.records.remove(target)
        except TargetBusy:
            raise Abort(
                grpc.StatusCode.ABORTED, f"an operation on {target} is already in progress"
            ) from None
        log.info("unpublished %s", target)
        return csi_pb2.NodeUnpublishVolumeResponse()


# ---------------------------------------------------------------------------- server


def socket_path(endpoint: str) -> str:
    """The socket path of a CSI endpoint (spec "CSI_ENDPOINT": ``unix:///path.sock``).

    Also accepts ``unix:/path`` and a bare absolute path.

    Raises:
        ValueError: any other scheme, or a relative path.
    """
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
    elif endpoint.startswith("unix:"):
        path = endpoint[len("unix:") :]
    elif "://" in endpoint:
        raise ValueError(f"CSI endpoint {endpoint!r}: only unix sockets are allowed")
    else:
        path = endpoint
    if not path.startswith("/"):
        raise ValueError(f"CSI endpoint {endpoint!r} needs an absolute socket path")
    return path


def serve(
    endpoint: str, identity: IdentityService, node: NodeService, max_workers: int = 8
) -> grpc.Server:
    """Start a gRPC server for both services on a unix socket of mode 0600.

    A stale socket file left by a killed driver is removed first.

    Returns:
        the started server; ``server.stop(grace)`` ends it (the socket file is removed
        by :func:`remove_socket`).

    Raises:
        ValueError: a bad endpoint; RuntimeError: the socket cannot be bound.
    """
    path = socket_path(endpoint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
        else:
            raise ValueError(f"{path} exists and is not a socket")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="csi")
    )
    csi_pb2_grpc.add_IdentityServicer_to_server(identity, server)
    csi_pb2_grpc.add_NodeServicer_to_server(node, server)
    old = os.umask(0o177)
    try:
        if server.add_insecure_port(f"unix://{path}") == 0:
            raise RuntimeError(f"cannot listen on {path}")
        server.start()
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    log.info("CSI driver %s listening on unix://%s", identity.name, path)
    return server


def remove_socket(endpoint: str) -> None:
    """Remove the socket file of ``endpoint`` if it is still there."""
    with contextlib.suppress(OSError, ValueError):
        os.unlink(socket_path(endpoint))
