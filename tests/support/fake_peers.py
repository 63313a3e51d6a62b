"""An in-process peer transport with fault injection: several PeerTiers in one process,
no sockets, behind the seams :class:`tierfs.replication.peer.PeerTier` takes (its
``client`` and ``server`` arguments).

``PeerTier(..., client=net.client(address), server=net.server)`` runs the real
plane code end to end -- :class:`~tierfs.replication.client.PeerClient`, the
servicer (:class:`~tierfs.replication.service.PeerServicer`), the token
interceptor, the coordinator's :class:`~tierfs.cluster.servicer.CoordinatorServicer`
on an asyncio loop (as :class:`~tierfs.rpc.aio_server.AioServer` runs it), the
checked receiving of :mod:`tierfs.replication.transfer` -- with
:class:`PeerNetwork` standing in for the sockets only:

* a :class:`FakeChannel` (what ``PeerClient`` dials) stands in for the
  ``grpc.Channel`` calls the client makes (``unary_unary`` for the generated
  stubs, ``stream_unary(...).future`` for PushShard, ``unary_stream`` for
  PullShard); every message is serialized and deserialized with the
  serializers the client and the handlers name, so the bytes are the wire's;
* a :class:`FakeServer` (what the tier's ``_start_server`` builds) collects the
  handlers ``setup`` adds and is reachable at its address from ``start`` until
  ``stop``; each call runs its handler in a thread of its own (the server's
  pool), coroutine handlers on the network's loop thread;
* a handler's ``context.abort(code, details)`` reaches the caller as a
  ``grpc.RpcError`` with that code and details; a call's ``timeout`` ends it
  with DEADLINE_EXCEEDED and makes its server context inactive.

Faults (:meth:`PeerNetwork.down`, :meth:`PeerNetwork.corrupt`,
:meth:`PeerNetwork.reset`): a node unreachable (UNAVAILABLE, as a refused
connection), one chunk of a PushShard/PullShard stream with a flipped bit but
its original crc32c (bytes damaged in transit), a stream broken after some
chunks (a connection reset: UNAVAILABLE for the caller). Each fault matches a
method, a callee and a caller (None: any) for ``times`` calls (None: until
removed). :attr:`PeerNetwork.log` records every call as ``(caller, callee,
method, outcome)``; outcome is "ok", a status code name, or the fault applied.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from tierfs.replication.client import PeerClient
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.wire import WireStats

#: a call whose caller gives no timeout ends after this many seconds (no test hangs)
CALL_LIMIT = 120.0


class FakeRpcError(grpc.RpcError):
    """A failed call as the caller sees it (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Aborted(Exception):
    """Raised by a server context's ``abort`` (the handler ends there)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclasses.dataclass
class Fault:
    """One injected fault (see the module docstring)."""

    kind: str  # "down", "corrupt", "reset"
    method: str | None = None  # "PushShard", "PullShard", "Sync"...; None: any
    callee: str | None = None
    caller: str | None = None
    times: int | None = 1
    #: reset: chunks that get through before the stream breaks
    after_chunks: int = 0
    #: corrupt: which chunk of the stream (0: the first) and the byte flipped in it
    chunk: int = 0
    at: int = 0

    def matches(self, caller: str, callee: str, method: str) -> bool:
        return (
            (self.times is None or self.times > 0)
            and self.method in (None, method)
            and self.callee in (None, callee)
            and self.caller in (None, caller)
        )


def flip(data: bytes, at: int = 0) -> bytes:
    """``data`` with one bit flipped at byte ``at`` (mod length)."""
    if not data:
        return b"\0"
    i = at % len(data)
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


class _Details:
    """``grpc.HandlerCallDetails`` of one call."""

    def __init__(self, method: str, metadata: Sequence[tuple[str, str]]) -> None:
        self.method = method
        self.invocation_metadata = tuple(metadata)


class _ServerContext:
    """The handler's side of one call (sync and aio handlers alike)."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def abort(self, code: grpc.StatusCode, details: str = "") -> Any:
        raise _Aborted(code, details)

    def is_active(self) -> bool:
        return not self._done.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def add_callback(self, callback: Callable[..., None]) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._callbacks.append(callback)
        return True

    def end(self) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()


class FakeServer:
    """A node's server on the network (see the module docstring; built by
    :meth:`PeerNetwork.server`)."""

    def __init__(
        self,
        network: PeerNetwork,
        setup: Callable[[Any, asyncio.AbstractEventLoop], None],
        interceptors: Sequence[Any],
    ) -> None:
        self.network = network
        self._setup = setup
        self._interceptors = list(interceptors)
        self._generic: list[grpc.GenericRpcHandler] = []
        self._registered: dict[str, Any] = {}
        self.address: str | None = None

    # what setup() calls (the generated add_*Servicer_to_server and the tier)
    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, h in handlers.items():
            self._registered[f"/{service}/{name}"] = h

    # RpcServer
    def start(self, address: str) -> int:
        host, _, port = address.rpartition(":")
        number = int(port) or next(self.network.ports)
        self.address = f"{host}:{number}"
        self._setup(self, self.network.loop)
        self.network._servers[self.address] = self
        if address != self.address:
            self.network._servers[address] = self  # the tier advertises HOST:0 until start
        return number

    def stop(self, grace: float | None = 0) -> None:
        for addr, srv in list(self.network._servers.items()):
            if srv is self:
                del self.network._servers[addr]

    def handler(self, method: str, metadata: Sequence[tuple[str, str]]) -> Any:
        """The method handler of ``method`` after the interceptors (None: unknown)."""
        details = _Details(method, metadata)

        async def find(d: Any) -> Any:
            h = self._registered.get(d.method)
            if h is not None:
                return h
            for g in self._generic:
                h = g.service(d)
                if h is not None:
                    return h
            return None

        async def chain() -> Any:
            cont: Callable[[Any], Any] = find
            for icpt in reversed(self._interceptors):
                cont = _bind(icpt, cont)
            return await cont(details)

        return asyncio.run_coroutine_threadsafe(chain(), self.network.loop).result(30)


def _bind(icpt: Any, cont: Callable[[Any], Any]) -> Callable[[Any], Any]:
    async def step(details: Any) -> Any:
        return await icpt.intercept_service(cont, details)

    return step


class PeerNetwork:
    """Routes the calls of every node's client to the addressed node's server.

    Use: ``client=net.client(address)`` and ``server=net.server`` for each
    :class:`~tierfs.replication.peer.PeerTier`; :meth:`close` at the end.
    """

    def __init__(self) -> None:
        self._servers: dict[str, FakeServer] = {}
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str, str]] = []
        self.ports = itertools.count(40000)
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="fake-peers-loop"
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the loop thread (calls in flight on it are cancelled)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ seams

    def client(self, caller: str, token: str | None = None) -> PeerClient:
        """A real :class:`PeerClient` of the node at ``caller`` over this network."""
        return PeerClient(
            token, WireStats(), connect=lambda address: FakeChannel(self, caller, address)
        )

    def server(
        self,
        setup: Callable[[Any, asyncio.AbstractEventLoop], None],
        *,
        interceptors: Sequence[Any] = (),
        options: Sequence[tuple[str, Any]] = (),
        name: str = "",
    ) -> FakeServer:
        """The tier's ``server`` factory (:class:`tierfs.replication.peer.ServerFactory`)."""
        return FakeServer(self, setup, interceptors)

    # ------------------------------------------------------------------ faults

    def down(self, address: str) -> Fault:
        """``address`` is unreachable until :meth:`heal` (every call: UNAVAILABLE)."""
        return self._add(Fault("down", callee=address, times=None))

    def corrupt(self, method: str, **match: Any) -> Fault:
        """Flip a bit in one chunk of the next ``times`` ``method`` streams (keyword
        arguments: :class:`Fault` fields)."""
        return self._add(Fault("corrupt", method=method, **match))

    def reset(self, method: str, after_chunks: int = 0, **match: Any) -> Fault:
        """Break the next ``times`` ``method`` streams after ``after_chunks`` chunks."""
        return self._add(Fault("reset", method=method, after_chunks=after_chunks, **match))

    def heal(self, fault: Fault | None = None) -> None:
        """Remove ``fault`` (None: every fault)."""
        with self._lock:
            self.faults = [f for f in self.faults if fault is not None and f is not fault]

    def _add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def take(self, kind: str, caller: str, callee: str, method: str) -> Fault | None:
        """The first matching fault of ``kind`` (its ``times`` counted down)."""
        with self._lock:
            for f in self.faults:
                if f.kind == kind and f.matches(caller, callee, method):
                    if f.times is not None:
                        f.times -= 1
                    return f
        return None

    def record(self, caller: str, callee: str, method: str, outcome: str) -> None:
        with self._lock:
            self.log.append((caller, callee, method, outcome))

    def calls(self, method: str | None = None) -> list[tuple[str, str, str, str]]:
        """The log, optionally of one method (its short name, e.g. ``PullShard``)."""
        with self._lock:
            return [c for c in self.log if method is None or c[2] == method]

    def route(self, caller: str, callee: str, path: str, metadata: Any) -> tuple[Any, str]:
        """The handler for a call, or raise UNAVAILABLE (down, nobody listening)."""
        method = path.rsplit("/", 1)[-1]
        with self._lock:
            down = any(f.kind == "down" and f.matches(caller, callee, method) for f in self.faults)
            server = self._servers.get(callee)
        if down or server is None:
            self.record(caller, callee, method, "UNAVAILABLE")
            raise FakeRpcError(
                grpc.StatusCode.UNAVAILABLE, f"failed to connect to all addresses ({callee})"
            )
        handler = server.handler(path, tuple(metadata or ()))
        if handler is None:
            self.record(caller, callee, method, "UNIMPLEMENTED")
            raise FakeRpcError(grpc.StatusCode.UNIMPLEMENTED, f"{path} is not served")
        return handler, method


# ---------------------------------------------------------------------- the client side


def _apply(fn: Callable[[Any], Any] | None, value: Any) -> Any:
    """A (de)serializer applied, or ``value`` itself without one (the token's deny handlers)."""
    return fn(value) if fn is not None else value


class _Call:
    """One call in flight: the handler runs in a thread of its own (or on the loop)."""

    def __init__(
        self,
        network: PeerNetwork,
        caller: str,
        callee: str,
        method: str,
        behavior: Callable[..., Any],
        request: Any,
        metadata: Any,
    ) -> None:
        self.network = network
        self.caller, self.callee, self.method = caller, callee, method
        self.context = _ServerContext(tuple(metadata or ()))
        self.result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._behavior = behavior
        self._request = request

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name=f"fake-{self.method}").start()

    def _run(self) -> None:
        try:
            out = self._behavior(self._request, self.context)
            if inspect.iscoroutine(out):
                out = asyncio.run_coroutine_threadsafe(out, self.network.loop).result()
            self.result.set_result(out)
        except _Aborted as exc:
            self.result.set_exception(FakeRpcError(exc.code, exc.details))
        except FakeRpcError as exc:
            self.result.set_exception(exc)
        except BaseException as exc:  # a handler crash: what grpc answers
            self.result.set_exception(
                FakeRpcError(grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")
            )
        finally:
            if self.method != "PullShard":
                self.context.end()

    def wait(self, timeout: float | None) -> Any:
        try:
            return self.result.result(timeout if timeout is not None else CALL_LIMIT)
        except concurrent.futures.TimeoutError:
            self.context.end()
            self.network.record(self.caller, self.callee, self.method, "DEADLINE_EXCEEDED")
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None


class FakeChannel:
    """A ``grpc.Channel`` from node ``caller`` to ``callee`` on a :class:`PeerNetwork`."""

    def __init__(self, network: PeerNetwork, caller: str, callee: str) -> None:
        self.network = network
        self.caller = caller
        self.callee = callee

    def close(self) -> None:
        pass

    def _encode(self, serializer: Callable[[Any], bytes] | None, message: Any) -> bytes:
        return serializer(message) if serializer is not None else message

    def unary_unary(
        self,
        path: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool = False,
    ) -> Callable[..., Any]:
        def call(request: Any, metadata: Any = None, timeout: float | None = None) -> Any:
            handler, method = self.network.route(self.caller, self.callee, path, metadata)
            req = _apply(handler.request_deserializer, self._encode(request_serializer, request))
            c = _Call(
                self.network, self.caller, self.callee, method, handler.unary_unary, req, metadata
            )
            c.start()
            try:
                reply = c.wait(timeout)
            except FakeRpcError as exc:
                self.network.record(self.caller, self.callee, method, exc.code().name)
                raise
            self.network.record(self.caller, self.callee, method, "ok")
            raw = _apply(handler.response_serializer, reply)
            return response_deserializer(raw) if response_deserializer else raw

        return call

    def stream_unary(
        self,
        path: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool = False,
    ) -> Any:
        channel = self

        class _Multi:
            def future(
                self, requests: Iterator[Any], metadata: Any = None, timeout: float | None = None
            ) -> _PushFuture:
                return _PushFuture(
                    channel, path, requests, metadata, request_serializer, response_deserializer
                )

        return _Multi()

    def unary_stream(
        self,
        path: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool = False,
    ) -> Callable[..., Any]:
        def call(request: Any, metadata: Any = None, timeout: float | None = None) -> _Stream:
            return _Stream(self, path, request, metadata, request_serializer, response_deserializer)

        return call


class _PushFuture:
    """A client-streaming call in flight (``future.result(timeout)``, ``cancel()``)."""

    def __init__(
        self,
        channel: FakeChannel,
        path: str,
        requests: Iterator[Any],
        metadata: Any,
        serializer: Callable[[Any], bytes] | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        net = channel.network
        self.channel = channel
        self._deserializer = deserializer
        self._cancelled = threading.Event()
        self._reset = False
        handler, self.method = net.route(channel.caller, channel.callee, path, metadata)
        self._handler = handler
        corrupt = net.take("corrupt", channel.caller, channel.callee, self.method)
        reset = net.take("reset", channel.caller, channel.callee, self.method)
        self.fault = corrupt or reset

        def incoming() -> Iterator[Any]:
            chunks = 0
            for msg in requests:
                if self._cancelled.is_set():
                    raise FakeRpcError(
                        grpc.StatusCode.CANCELLED, "Locally cancelled by application!"
                    )
                raw = channel._encode(serializer, msg)
                chunk = peer_wire.decode_chunk(raw)
                if chunk is not None:
                    if reset is not None and chunks >= reset.after_chunks:
                        self._reset = True
                        raise FakeRpcError(grpc.StatusCode.CANCELLED, "connection reset")
                    if corrupt is not None and chunks == corrupt.chunk:
                        raw = peer_wire.encode_chunk(
                            chunk.path, chunk.offset, flip(chunk.data, corrupt.at), chunk.crc32c
                        )
                    chunks += 1
                yield _apply(handler.request_deserializer, raw)

        self._call = _Call(
            net,
            channel.caller,
            channel.callee,
            self.method,
            handler.stream_unary,
            incoming(),
            metadata,
        )
        self._call.start()

    def result(self, timeout: float | None = None) -> Any:
        net, ch = self.channel.network, self.channel
        try:
            reply = self._call.result.result(timeout)
        except concurrent.futures.TimeoutError:
            raise grpc.FutureTimeoutError() from None
        except FakeRpcError as exc:
            if self._reset:
                net.record(ch.caller, ch.callee, self.method, "reset")
                raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection reset") from None
            net.record(ch.caller, ch.callee, self.method, exc.code().name)
            raise
        if self._reset:  # the handler answered, but the answer never arrives
            net.record(ch.caller, ch.callee, self.method, "reset")
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection reset")
        net.record(ch.caller, ch.callee, self.method, "corrupt" if self.fault else "ok")
        raw = _apply(self._handler.response_serializer, reply)
        return self._deserializer(raw) if self._deserializer else raw

    def cancel(self) -> bool:
        self._cancelled.set()
        self._call.context.end()
        return True


class _Stream:
    """A server-streaming call (an iterator of replies with ``cancel()``)."""

    _END = object()

    def __init__(
        self,
        channel: FakeChannel,
        path: str,
        request: Any,
        metadata: Any,
        serializer: Callable[[Any], bytes] | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        net = channel.network
        self.channel = channel
        self._deserializer = deserializer
        handler, self.method = net.route(channel.caller, channel.callee, path, metadata)
        self._handler = handler
        self._corrupt = net.take("corrupt", channel.caller, channel.callee, self.method)
        self._reset = net.take("reset", channel.caller, channel.callee, self.method)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=4)
        self._chunks = 0
        self._finished = False
        self._flipped = False
        req = _apply(handler.request_deserializer, channel._encode(serializer, request))
        self.context = _ServerContext(tuple(metadata or ()))
        threading.Thread(
            target=self._produce, args=(handler.unary_stream, req), daemon=True
        ).start()

    def _put(self, item: Any) -> bool:
        while self.context.is_active():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _replies(self, behavior: Callable[..., Any], request: Any) -> Iterator[Any]:
        """The handler's replies: a plain generator's, or an async generator's (as
        :func:`tierfs.rpc.aio_server.with_sync_context` serves streams) stepped on the
        network's loop and closed there when the caller stops early."""
        if not inspect.isasyncgenfunction(behavior):
            yield from behavior(request, self.context)
            return
        loop = self.channel.network.loop
        agen = behavior(request, self.context)
        try:
            while True:
                try:
                    reply = asyncio.run_coroutine_threadsafe(agen.__anext__(), loop).result()
                except StopAsyncIteration:
                    return
                yield reply
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), loop).result()

    def _produce(self, behavior: Callable[..., Any], request: Any) -> None:
        replies = self._replies(behavior, request)
        try:
            for reply in replies:
                if not self._put(("msg", _apply(self._handler.response_serializer, reply))):
                    return
            self._put(("end", None))
        except _Aborted as exc:
            self._put(("error", FakeRpcError(exc.code, exc.details)))
        except BaseException as exc:
            self._put(("error", FakeRpcError(grpc.StatusCode.UNKNOWN, str(exc))))
        finally:
            self.context.end()
            replies.close()

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        net, ch = self.channel.network, self.channel
        if self._finished:
            raise StopIteration
        try:
            kind, item = self._queue.get(timeout=CALL_LIMIT)
        except queue.Empty:
            self.cancel()
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if kind == "end":
            self._finished = True
            net.record(ch.caller, ch.callee, self.method, "corrupt" if self._corrupt else "ok")
            raise StopIteration
        if kind == "error":
            self._finished = True
            net.record(ch.caller, ch.callee, self.method, item.code().name)
            raise item
        raw = item
        chunk = peer_wire.decode_chunk(raw)
        if chunk is not None:
            if self._reset is not None and self._chunks >= self._reset.after_chunks:
                self._finished = True
                self.context.end()
                net.record(ch.caller, ch.callee, self.method, "reset")
                raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection reset")
            if self._corrupt is not None and self._chunks == self._corrupt.chunk:
                raw = peer_wire.encode_chunk(
                    chunk.path, chunk.offset, flip(chunk.data, self._corrupt.at), chunk.crc32c
                )
                self._flipped = True
            self._chunks += 1
        return self._deserializer(raw) if self._deserializer else raw

    def cancel(self) -> bool:
        if not self._finished:  # the caller gave up (a corrupt chunk, cancelled)
            ch = self.channel
            outcome = "corrupt" if self._flipped else "CANCELLED"
            ch.network.record(ch.caller, ch.callee, self.method, outcome)
        self._finished = True
        self.context.end()
        return True
