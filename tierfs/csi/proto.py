"""The CSI v1 messages and service stubs, compiled from ``csi.proto`` at run time.

Nothing generated is committed: :func:`load` hands ``tierfs/csi/csi.proto``
to ``grpc.protos_and_services`` (grpcio-tools) on first use and caches the
two modules it returns (the ``_pb2`` messages and the ``_pb2_grpc`` stubs and
servicer bases).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from types import ModuleType

#: the proto file, relative to the directory that holds the ``tierfs`` package
PROTO_PATH = "tierfs/csi/csi.proto"

#: fully qualified gRPC method paths tierfs serves (CSI spec "RPC Interface")
IDENTITY_METHODS = ("GetPluginInfo", "GetPluginCapabilities", "Probe")
NODE_METHODS = ("NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities",
                "NodeGetInfo")
METHOD_PATHS = tuple([f"/csi.v1.Identity/{m}" for m in IDENTITY_METHODS]
                     + [f"/csi.v1.Node/{m}" for m in NODE_METHODS])

_lock = threading.Lock()


def _package_root() -> str:
    """The directory that contains the ``tierfs`` package (the proto include root)."""
    import tierfs

    return os.path.dirname(os.path.dirname(os.path.abspath(tierfs.__file__)))


@functools.cache
def load() -> tuple[ModuleType, ModuleType]:
    """Compile ``csi.proto`` (once per process) and return ``(pb2, pb2_grpc)``.

    grpcio-tools resolves the file and its import of
    ``google/protobuf/wrappers.proto`` through ``sys.path``; the package root
    is put on it for the duration of the call, since an editable or zipped
    install need not have it there.

    Raises:
        ImportError: grpcio-tools is missing or the file does not compile.
    """
    import grpc

    root = _package_root()
    with _lock:
        added = root not in sys.path
        if added:
            sys.path.insert(0, root)
        try:
            return grpc.protos_and_services(PROTO_PATH)
        finally:
            if added:
                try:
                    sys.path.remove(root)
                except ValueError:
                    pass
