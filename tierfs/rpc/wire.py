"""The wire of the peer plane: auth and channel settings around ``tierfs/rpc/peer.proto``.

The messages and stubs are :mod:`tierfs.rpc.peer_pb2` and
:mod:`tierfs.rpc.peer_pb2_grpc`, generated when tierfs is built or installed.

Authentication: every call carries the shared token (``--peer-token``,
``peerToken``, ``$TIERFS_PEER_TOKEN``) in the metadata header
:data:`TOKEN_HEADER`; :class:`TokenInterceptor` answers UNAUTHENTICATED to
any call without the right one. A node without a token accepts only calls
without one (a cluster either uses a token everywhere or nowhere).

Both sides also share :func:`held_shard` (a node's holding as a ``HeldShard``
message), the counters of bytes and calls (:class:`WireStats`) and a
hand-made encoding and decoding of data chunks (:func:`encode_chunk`,
:func:`decode_chunk`).
"""

from __future__ import annotations

import collections
import hmac
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from tierfs.rpc import peer_pb2

if TYPE_CHECKING:
    from tierfs.cluster.coordinator import Holding

TOKEN_HEADER = "x-tierfs-token"
#: largest message: a 4 MiB chunk plus framing, with room to spare
MAX_MESSAGE = 16 << 20
#: chunk size of shard transfers (the issue asks for 1-4 MiB)
CHUNK = 4 << 20

PEER_METHODS = ("Inventory", "PushShard", "PullShard", "Replicate")
COORDINATOR_METHODS = (
    "Join",
    "Decide",
    "Barrier",
    "Sync",
    "Gone",
    "SyncBatch",
    "DecideBatch",
    "BarrierBatch",
)
RELAY_METHODS = ("Relay", "RelayDecide", "RelayBarrier", "Nudge")
METHOD_PATHS = tuple(
    [f"/tierfs.peer.v1.Peer/{m}" for m in PEER_METHODS]
    + [f"/tierfs.peer.v1.Coordinator/{m}" for m in COORDINATOR_METHODS]
    + [f"/tierfs.peer.v1.SyncRelay/{m}" for m in RELAY_METHODS]
)

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 20000),
    ("grpc.keepalive_timeout_ms", 10000),
    ("grpc.enable_retries", 0),
    # a peer back from a restart is reached within about a second: gRPC's default
    # reconnect backoff (1 s, growing to 120 s) kept failing calls to a daemon that
    # was listening again (fault campaign seed 29 #4: a restore pull 50 ms after the
    # restarted holder joined got "Connection refused" from the backoff's last error)
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
)

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")
#: the messages of the two streaming calls (PushShard's requests, PullShard's replies)
StreamMessage = TypeVar("StreamMessage", peer_pb2.PushMessage, peer_pb2.PullMessage)


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` (empty without one)."""
    return ((TOKEN_HEADER, token),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose :data:`TOKEN_HEADER` is not ``token`` (UNAUTHENTICATED).

    Args:
        token: the shared secret, or None/empty for "calls carry no token".
    """

    def __init__(self, token: str | None) -> None:
        self.token = (token or "").encode()

        def deny(request: object, context: grpc.ServicerContext) -> NoReturn:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing tierfs peer token")

        self._deny: dict[tuple[bool, bool], grpc.RpcMethodHandler[Any, Any]] = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], grpc.RpcMethodHandler[_Request, _Response] | None
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Request, _Response] | None:
        sent = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_HEADER:
                sent = value.encode() if isinstance(value, str) else bytes(value)
        if hmac.compare_digest(sent, self.token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._deny[(handler.request_streaming, handler.response_streaming)]


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """:class:`TokenInterceptor` for a ``grpc.aio`` server (the same rule and answer)."""

    def __init__(self, token: str | None) -> None:
        self.token = (token or "").encode()

        async def deny(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "wrong or missing tierfs peer token"
            )

        self._deny: dict[tuple[bool, bool], grpc.RpcMethodHandler[Any, Any]] = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        sent = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_HEADER:
                sent = value.encode() if isinstance(value, str) else bytes(value)
        handler = await continuation(handler_call_details)
        if handler is None or hmac.compare_digest(sent, self.token):
            return handler
        return self._deny[(handler.request_streaming, handler.response_streaming)]


def same_endpoint(a: str | None, b: str | None) -> bool:
    """True if two ``HOST:PORT`` strings name the same endpoint (``localhost`` = 127.0.0.1)."""
    if not a or not b:
        return False

    def norm(x: str) -> tuple[str, str]:
        host, _, port = x.rpartition(":")
        host = host.strip("[]").lower()
        if host in ("localhost", "::1", "ip6-localhost"):
            host = "127.0.0.1"
        return host, port

    return norm(a) == norm(b)


def held_shard(h: Holding) -> peer_pb2.HeldShard:
    """The ``HeldShard`` message describing ``h`` (inventories, Join and Sync requests)."""
    return peer_pb2.HeldShard(
        rank=h.rank,
        step=h.step,
        verified=h.verified,
        digest=h.digest,
        bytes=h.bytes,
        name=h.name,
        backup_requested=h.backup_requested,
        created=h.created,
        unloadable=h.unloadable,
        missing=h.missing,
        whole_digests=list(h.whole_digests),
        whole_unloadable=h.whole_unloadable,
        nodes=h.nodes,
        replaces=[peer_pb2.PartDigest(step=h.step, rank=r, digest=d) for r, d in h.replaces],
    )


# ---------------------------------------------------------------------- stats


class WireStats:
    """Byte and call counters of the peer plane (thread-safe; shown in the status)."""

    FIELDS = (
        "sent_bytes",
        "received_bytes",
        "pushes_sent",
        "pushes_received",
        "manifest_only_sent",
        "manifest_only_received",
        "manifest_bytes_sent",
        "pulls_served",
        "served_bytes",
        "pulls",
        "pulled_bytes",
        # the data lane (docs/PROTOCOL.md "Data lane"): pulls whose bytes came over a
        # holder's lane (file and part pulls, replicas pulled for a Replicate), and
        # the lane streams this node served with their bytes
        "lane_pulls",
        "lane_served",
        "lane_served_bytes",
        "corrupt_copies",
        "refused",
        # heartbeats (issue #17 item 2): this node's own, and the batches it sent as
        # its group's leader
        "heartbeats_direct",
        "heartbeats_relayed",
        "heartbeat_fallbacks",
        "heartbeats_skipped",
        "heartbeat_batches_sent",
        "heartbeats_batched",
        # the restore round's Decide/Barrier calls likewise (ARCHITECTURE.md
        # "Batched restore round")
        "round_calls_direct",
        "round_calls_relayed",
        "round_fallbacks",
        "round_batches_sent",
        "round_calls_batched",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: collections.Counter[str] = collections.Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f: self._c.get(f, 0) for f in self.FIELDS}


# ---------------------------------------------------------------------- fast path


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_chunk(path: str, offset: int, data: bytes, crc: int) -> bytes:
    """A ``PushMessage``/``PullMessage`` carrying one ``FileChunk`` (field 2), encoded by hand.

    Byte-identical to ``PushMessage(chunk=FileChunk(...)).SerializeToString()``
    (tests/cluster/test_peer_wire.py checks it) but with one copy of ``data`` instead
    of three: building and serializing the message through protobuf costs
    about as much as the whole gRPC transfer of the bytes.
    """
    p = path.encode()
    head = b"\x0a" + _varint(len(p)) + p
    if offset:
        head += b"\x10" + _varint(offset)
    if data:
        head += b"\x1a" + _varint(len(data))
    tail = b"\x20" + _varint(crc) if crc else b""
    inner = len(head) + len(data) + len(tail)
    return b"".join((b"\x12", _varint(inner), head, data, tail))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One ``FileChunk`` of a shard transfer, decoded by :func:`decode_chunk`.

    Attributes:
        path: the file's path inside the shard (validated by the receiver).
        offset: where ``data`` starts in the file, in bytes.
        data: the bytes (1-4 MiB on the wire).
        crc32c: crc32c (Castagnoli) of ``data`` as the sender computed it.
    """

    path: str
    offset: int
    data: bytes
    crc32c: int


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A base-128 varint at ``pos``: ``(value, position after it)``; ValueError if cut short."""
    value = shift = 0
    while shift < 70:
        b = buf[pos]  # IndexError past the end
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint longer than 10 bytes")


def decode_chunk(raw: bytes) -> Chunk | None:
    """Decode a ``PushMessage``/``PullMessage`` that carries a ``FileChunk`` (field 2).

    The inverse of :func:`encode_chunk`, with one copy of the data (a slice of
    ``raw``) instead of protobuf's parse, which costs about 0.45 s of CPU per
    GiB on the receiver. Follows the protobuf wire format (fields in any order,
    the last occurrence wins), but returns None for anything it does not
    expect -- another kind of message, an unknown field, truncated or
    out-of-range values -- so that the caller parses it with protobuf, which
    also reports malformed input (``google.protobuf.message.DecodeError``).
    """
    try:
        if not raw or raw[0] != 0x12:
            return None
        size, pos = _read_varint(raw, 1)
        if pos + size != len(raw):
            return None
        path, offset, data, crc = "", 0, b"", 0
        while pos < len(raw):
            tag, pos = _read_varint(raw, pos)
            if tag in (0x0A, 0x1A):  # path, data: length-delimited
                n, pos = _read_varint(raw, pos)
                end = pos + n
                if end > len(raw):
                    return None
                if tag == 0x0A:
                    path = raw[pos:end].decode()
                else:
                    data = raw[pos:end]
                pos = end
            elif tag == 0x10:  # offset: int64
                offset, pos = _read_varint(raw, pos)
                if offset >= 1 << 63:
                    offset -= 1 << 64
            elif tag == 0x20:  # crc32c: uint32
                crc, pos = _read_varint(raw, pos)
                if crc >= 1 << 32:
                    return None
            else:
                return None
        return Chunk(path, offset, data, crc)
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def chunk_deserializer(
    message_class: type[StreamMessage],
) -> Callable[[bytes], StreamMessage | Chunk]:
    """A gRPC deserializer for ``PushMessage``/``PullMessage``: a :class:`Chunk` when
    :func:`decode_chunk` reads the bytes, else ``message_class.FromString(raw)``
    (``google.protobuf.message.DecodeError`` on malformed bytes)."""

    def deserialize(raw: bytes) -> StreamMessage | Chunk:
        return decode_chunk(raw) or message_class.FromString(raw)

    return deserialize


def kind_of(message: peer_pb2.PushMessage | peer_pb2.PullMessage | Chunk) -> str | None:
    """The ``kind`` of a Push/PullMessage as a deserializer returned it (``"chunk"`` for a
    :class:`Chunk`, None for a message with no kind set)."""
    return "chunk" if isinstance(message, Chunk) else message.WhichOneof("kind")


def as_chunk(message: peer_pb2.PushMessage | peer_pb2.PullMessage | Chunk) -> Chunk:
    """A message whose :func:`kind_of` is ``"chunk"`` as a :class:`Chunk`."""
    if isinstance(message, Chunk):
        return message
    c = message.chunk
    return Chunk(c.path, c.offset, c.data, c.crc32c)


def serialize(message: Message | bytes) -> bytes:
    """gRPC request/response serializer: pre-encoded ``bytes`` pass through."""
    return message if isinstance(message, bytes) else message.SerializeToString()
