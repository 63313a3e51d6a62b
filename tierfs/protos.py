"""The .proto files of tierfs, compiled at run time (nothing generated is committed).

``grpc.protos_and_services`` (grpcio-tools) resolves a proto file and its
imports (e.g. ``google/protobuf/wrappers.proto``) through ``sys.path``; the
directory holding the ``tierfs`` package is put there for the duration of
the call, since an editable or zipped install need not have it there.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from types import ModuleType

_lock = threading.Lock()


def package_root() -> str:
    """The directory that contains the ``tierfs`` package (the proto include root)."""
    import tierfs

    return os.path.dirname(os.path.dirname(os.path.abspath(tierfs.__file__)))


@functools.cache
def load_proto(path: str) -> tuple[ModuleType, ModuleType]:
    """Compile ``path`` (relative to :func:`package_root`) once per process.

    Returns:
        ``(pb2, pb2_grpc)``: the message classes and the stubs/servicer bases.

    Raises:
        ImportError: grpcio-tools is missing or the file does not compile.
    """
    import grpc

    root = package_root()
    with _lock:
        added = root not in sys.path
        if added:
            sys.path.insert(0, root)
        try:
            return grpc.protos_and_services(path)
        finally:
            if added:
                try:
                    sys.path.remove(root)
                except ValueError:
                    pass
