"""How a CSI call fails: :class:`Abort` carries the gRPC status and message
(CSI spec "Error Scheme"), :func:`rpc` turns it, and any unexpected error, into
the call's status, logged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from tierfs.core.errors import ProtocolError

log = logging.getLogger("tierfs.csi")

__all__ = ["Abort", "rpc"]


class Abort(ProtocolError):
    """End the RPC with this gRPC status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
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
