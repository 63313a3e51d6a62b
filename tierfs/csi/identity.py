"""The CSI Identity service (spec "Identity Service RPC") and what it knows of the
node's tierfs mount (:class:`NodeMount`: ready, failed, its ram-dirs)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf import wrappers_pb2

from tierfs import __version__
from tierfs.csi import mounts
from tierfs.csi.abort import Abort, rpc
from tierfs.csi.nodemount import read_status
from tierfs.rpc import csi_pb2, csi_pb2_grpc

#: the driver name: domain-name notation, at most 63 characters (spec "GetPluginInfo")
DEFAULT_DRIVER_NAME = "tierfs.csi.dev"
FUSE_DEVICE = "/dev/fuse"
_NAME_RE = r"^[A-Za-z0-9]([A-Za-z0-9.\-]{0,61}[A-Za-z0-9])?$"

__all__ = [
    "DEFAULT_DRIVER_NAME",
    "FUSE_DEVICE",
    "IdentityService",
    "NodeMount",
    "StaticMount",
    "validate_driver_name",
]


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

    @rpc
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Name and version (spec "GetPluginInfo": both REQUIRED)."""
        return csi_pb2.GetPluginInfoResponse(name=self.name, vendor_version=__version__)

    @rpc
    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        """No plugin capabilities: node service only, no topology constraints."""
        return csi_pb2.GetPluginCapabilitiesResponse()

    @rpc
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
