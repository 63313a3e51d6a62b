"""The CSI v1 messages and service stubs, compiled from ``csi.proto`` at run time.

Nothing generated is committed: :func:`load` hands ``tierfs/csi/csi.proto``
to ``grpc.protos_and_services`` (grpcio-tools) on first use and caches the
two modules it returns (the ``_pb2`` messages and the ``_pb2_grpc`` stubs and
servicer bases).
"""

from __future__ import annotations

from types import ModuleType

from tierfs.protos import load_proto

#: the proto file, relative to the directory that holds the ``tierfs`` package
PROTO_PATH = "tierfs/csi/csi.proto"

#: fully qualified gRPC method paths tierfs serves (CSI spec "RPC Interface")
IDENTITY_METHODS = ("GetPluginInfo", "GetPluginCapabilities", "Probe")
NODE_METHODS = ("NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities",
                "NodeGetInfo")
METHOD_PATHS = tuple([f"/csi.v1.Identity/{m}" for m in IDENTITY_METHODS]
                     + [f"/csi.v1.Node/{m}" for m in NODE_METHODS])


def load() -> tuple[ModuleType, ModuleType]:
    """Compile ``csi.proto`` (once per process) and return ``(pb2, pb2_grpc)``.

    Raises:
        ImportError: grpcio-tools is missing or the file does not compile.
    """
    return load_proto(PROTO_PATH)
