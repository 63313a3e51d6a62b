"""The wire formats of tierfs: the .proto files and the modules generated from them.

* ``peer.proto`` (package ``tierfs.peer.v1``): the peer plane and the
  coordinator calls -> :mod:`tierfs.rpc.peer_pb2`, :mod:`tierfs.rpc.peer_pb2_grpc`.
* ``csi.proto`` (package ``csi.v1``): the CSI v1 subset tierfs serves ->
  :mod:`tierfs.rpc.csi_pb2`, :mod:`tierfs.rpc.csi_pb2_grpc`.

The ``*_pb2*.py`` modules and their ``.pyi`` type stubs are generated when
tierfs is built or installed (setup.py's ``build_rpc``: grpcio-tools' protoc
and mypy-protobuf, both build requirements only); nothing is compiled at run
time and nothing generated is committed. Import them directly::

    from tierfs.rpc import peer_pb2, peer_pb2_grpc

A source checkout that was never installed has no generated modules: this
package then raises ImportError naming the fix (``make install``, or
``pip install -e .``) instead of a bare ModuleNotFoundError.
"""

from __future__ import annotations

import importlib.util

#: the generated modules, as ``tierfs.rpc.<name>``
GENERATED = ("csi_pb2", "csi_pb2_grpc", "peer_pb2", "peer_pb2_grpc")

_missing = [m for m in GENERATED if importlib.util.find_spec(f"{__name__}.{m}") is None]
if _missing:
    raise ImportError(
        f"{', '.join(f'{__name__}.{m}' for m in _missing)} missing: the protobuf/gRPC "
        "modules of tierfs/rpc are generated from its .proto files when tierfs is "
        "installed, and this tierfs was not (a source checkout?). Run `make install` "
        "(or `pip install -e .`) in the checkout",
        name=f"{__name__}.{_missing[0]}",
    )

from tierfs.rpc import csi_pb2, csi_pb2_grpc, peer_pb2, peer_pb2_grpc  # noqa: E402

__all__ = ["GENERATED", "csi_pb2", "csi_pb2_grpc", "peer_pb2", "peer_pb2_grpc"]
