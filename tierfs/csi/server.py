"""The CSI Identity and Node services of tierfs, served by grpcio on a unix socket.

Follows the CSI v1 specification (container-storage-interface/spec, spec.md);
section names are cited where a rule comes from. In short:

* Identity (:mod:`tierfs.csi.identity`): ``GetPluginInfo``,
  ``GetPluginCapabilities`` (none: no controller service, no topology),
  ``Probe`` (ready once the node's tierfs mount answers and the driver recorded
  or adopted it; FAILED_PRECONDITION when /dev/fuse is missing or the mount
  failed).
* Node (:mod:`tierfs.csi.node_service`): ``NodeGetInfo``, ``NodeGetCapabilities``
  (none: no staging), ``NodePublishVolume`` (bind-mount the node's tierfs mount
  at ``target_path``; read-only through a read-only bind remount; write
  ``jax-init-info.txt``), ``NodeUnpublishVolume``. Every other CSI RPC is
  absent from the servicer and gRPC answers UNIMPLEMENTED ("Error Scheme").

This module starts the server (:func:`serve`) and names the services for
:mod:`tierfs.csi.cli`. How a call fails: :mod:`tierfs.csi.abort`; the target
paths: :mod:`tierfs.csi.targets`; the publish records: :mod:`tierfs.csi.records`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from concurrent import futures

import grpc

from tierfs.csi.abort import Abort
from tierfs.csi.identity import (
    DEFAULT_DRIVER_NAME,
    FUSE_DEVICE,
    IdentityService,
    NodeMount,
    StaticMount,
    validate_driver_name,
)
from tierfs.csi.node_service import JAX_INIT_INFO, NodeService
from tierfs.csi.records import PublishRecord, PublishRecords, TargetBusy
from tierfs.rpc import csi_pb2_grpc

log = logging.getLogger("tierfs.csi")

#: the gRPC methods this server registers (CSI spec "RPC Interface"); gRPC answers
#: every other CSI method UNIMPLEMENTED
IDENTITY_METHODS = ("GetPluginInfo", "GetPluginCapabilities", "Probe")
NODE_METHODS = ("NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities", "NodeGetInfo")
METHOD_PATHS = tuple(
    [f"/csi.v1.Identity/{m}" for m in IDENTITY_METHODS]
    + [f"/csi.v1.Node/{m}" for m in NODE_METHODS]
)

__all__ = [
    "DEFAULT_DRIVER_NAME",
    "FUSE_DEVICE",
    "JAX_INIT_INFO",
    "METHOD_PATHS",
    "Abort",
    "IdentityService",
    "NodeMount",
    "NodeService",
    "PublishRecord",
    "PublishRecords",
    "StaticMount",
    "TargetBusy",
    "remove_socket",
    "serve",
    "socket_path",
    "validate_driver_name",
]


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
