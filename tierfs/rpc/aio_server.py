"""A gRPC server on an asyncio loop of its own, for a daemon whose main loop is trio.

The node daemon's gRPC port serves two kinds of calls: the data plane
(``tierfs.peer.v1.Peer``: blocking file reads and writes, written as plain
handlers) and the coordinator (``tierfs.peer.v1.Coordinator``: long polls
that wait for other nodes). A thread-pool server holds a thread for every
waiting call, so a coordinator of thousands of nodes runs out of threads
(#17). :class:`AioServer` serves both from one ``grpc.aio`` server on one
asyncio loop in one thread:

* ``async def`` handlers (the coordinator) run on the loop: a waiting call
  is a suspended coroutine, no thread;
* plain handlers (the data plane) run in a thread pool of ``workers``
  threads (grpc's ``migration_thread_pool``) as before; their context gets
  :meth:`is_active` back (``grpc.aio`` hands plain handlers a context
  without it), see :func:`with_sync_context`.

The trio side never waits on the loop except in :meth:`AioServer.start` and
:meth:`AioServer.stop` (call those from a worker thread or at start/stop).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
import grpc.aio
from grpc.experimental import wrap_server_method_handler

from tierfs.core.errors import ProtocolError

log = logging.getLogger(__name__)

#: seconds :meth:`AioServer.start` waits for the loop thread to bind the port
START_TIMEOUT = 30.0


class DaemonThreadPool(futures.Executor):
    """A thread pool for plain gRPC handlers whose threads never hold up the
    interpreter's exit.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads at exit, also
    after ``shutdown(wait=False)``. ``grpc.aio`` runs a blocking handler's
    request stream in such a thread, waiting on a future of the server's loop;
    a call cut off by :meth:`AioServer.stop` just as the loop ended left that
    future unresolved for ever, and the process hung at exit after its work was
    done (regression: ``make test-fast`` printed its summary and never returned,
    a ``tierfs-rpc_0`` thread in ``Future.result``, on a loaded machine).
    These threads are daemon threads that nothing joins at exit.

    Args:
        max_workers: threads at most (started on demand, reused when idle).
        thread_name_prefix: thread names are ``<prefix>_<n>``.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue[
            tuple[futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None
        ] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        """Run ``fn(*args, **kwargs)`` in a pool thread; its future.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            fut: futures.Future[Any] = futures.Future()
            self._work.put((fut, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(
                    target=self._worker,
                    name=f"{self._prefix}_{len(self._threads)}",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)
            return fut

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the caller sees it through the future
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)
            del item, fut, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; with ``cancel_futures`` cancel what has not started;
        with ``wait`` join the threads (those stuck in a call are waited for)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for t in threads:
                t.join()


class _SyncContext:
    """A plain handler's ``grpc.aio`` context plus ``is_active()`` (the thread-pool
    server's context has it; the aio server's sync wrapper does not)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._done = threading.Event()
        context.add_callback(lambda *_: self._done.set())

    def is_active(self) -> bool:
        """False once the call ended (cancelled by the client, deadline, or finished)."""
        return not self._done.is_set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _Abort(ProtocolError):
    """``context.abort`` of a streaming handler run by :func:`_streamed` (its thread
    cannot await the loop's abort; the loop side does it)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _StreamContext:
    """What a plain server-streaming handler sees of its ``grpc.aio`` context when
    :func:`_streamed` runs it: ``is_active()``, ``abort()`` (raises, as the sync
    server's does) and the context's other synchronous methods."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._done = threading.Event()

    def end(self) -> None:
        """The call is over (any thread)."""
        self._done.set()

    def is_active(self) -> bool:
        """False once the call ended (cancelled by the client, deadline, or finished:
        the loop side closes the stream and says so with :meth:`end`)."""
        return not self._done.is_set()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` and ``details``.

        Raises:
            _Abort: always (the loop side aborts the call with it).
        """
        raise _Abort(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


#: what ``next(generator, _END)`` returns once a streaming handler's generator ended
_END = object()


def _streamed(
    behavior: Callable[[Any, Any], Any], pool: futures.Executor
) -> Callable[[Any, Any], Any]:
    """A plain server-streaming ``behavior`` as an async generator for ``grpc.aio``.

    ``grpc.aio`` runs a plain streaming handler's generator in a thread that waits,
    with no end, to hand each message to a full send queue once the client
    cancelled (grpc/grpc#22874, #25327, #28999): every cancelled stream kept one of
    the server's threads for good, and after as many as the pool has, the server
    answered no blocking call any more (#14 trial 43: batched file pulls given up
    after their first file). Here each step of the generator (``next``) is one
    task of ``pool``, awaited on the loop, the next step under way while a
    message is written (one message ahead); when the call ends (done, cancelled,
    aborted) the generator is closed in ``pool`` after its step under way, so its
    ``finally`` blocks run (a pull unpins its copy)."""

    async def call(request: Any, context: Any) -> Any:
        ctx = _StreamContext(context)
        gen = behavior(request, ctx)
        loop = asyncio.get_running_loop()
        step: futures.Future[Any] | None = None
        try:
            step = pool.submit(next, gen, _END)
            while True:
                item = await asyncio.wrap_future(step, loop=loop)
                if item is _END or context.done():
                    return  # an ended call (a write into it: QuietCancelledWrites)
                # the next message is made while this one is written (as grpc's own
                # thread did: without it a big file's pull was about a third slower)
                step = pool.submit(next, gen, _END)
                yield item
        except _Abort as exc:
            await context.abort(exc.code, exc.details)
        finally:
            ctx.end()
            last = step

            def close() -> None:
                if last is not None:
                    futures.wait([last])  # a step under way ends first
                gen.close()

            pool.submit(close)

    return call


def with_sync_context(
    handler: grpc.GenericRpcHandler, pool: futures.Executor | None = None
) -> grpc.GenericRpcHandler:
    """``handler`` (of plain, blocking behaviours) with :class:`_SyncContext` contexts;
    its server-streaming (unary request) behaviours are run by :func:`_streamed` in
    ``pool`` (default: a pool of 32 daemon threads of this module)."""
    streams = pool if pool is not None else _stream_pool()

    def wrap(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def call(request: Any, context: Any) -> Any:
            return behavior(request, _SyncContext(context))

        return call

    class _Wrapped(grpc.GenericRpcHandler):
        def service(
            self, handler_call_details: grpc.HandlerCallDetails
        ) -> grpc.RpcMethodHandler[Any, Any] | None:
            h = handler.service(handler_call_details)
            if h is None:
                return None
            if h.response_streaming and not h.request_streaming and h.unary_stream:
                return h._replace(unary_stream=_streamed(h.unary_stream, streams))  # type: ignore[attr-defined,no-any-return]
            return wrap_server_method_handler(wrap, h)  # type: ignore[no-untyped-call,no-any-return]

    return _Wrapped()


_STREAM_POOL: DaemonThreadPool | None = None
_STREAM_POOL_LOCK = threading.Lock()


def _stream_pool() -> DaemonThreadPool:
    """The threads that run streaming handlers' steps (one per process, made on use)."""
    global _STREAM_POOL
    with _STREAM_POOL_LOCK:
        if _STREAM_POOL is None:
            _STREAM_POOL = DaemonThreadPool(32, "tierfs-stream")
        return _STREAM_POOL


class QuietCancelledWrites(logging.Filter):
    """Turns grpc's ERROR "ExecuteBatchError raised in core by servicer method" of a
    streaming handler into a DEBUG line: it is a message written into a call whose
    client has gone (cancelled, reset), which that client sees as its own error
    (trial 43c: a 9-line traceback in a holder's log for every batched pull a reader
    gave up). Attached to the ``grpc._cython.cygrpc`` logger by :class:`AioServer`."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if type(exc).__name__ == "ExecuteBatchError" and "servicer method" in str(record.msg):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info, record.exc_text = None, None
            record.msg = f"{record.getMessage()} (the client has gone): {exc}"
            record.args = ()
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_cancelled_writes() -> None:
    """Attach :class:`QuietCancelledWrites` to grpc's server logger (once)."""
    logger = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, QuietCancelledWrites) for f in logger.filters):
        logger.addFilter(QuietCancelledWrites())


class AioServer:
    """One ``grpc.aio`` server on an asyncio loop in a daemon thread.

    Args:
        setup: called on the loop thread with the new server (before it starts)
            and the loop: adds the handlers (``add_generic_rpc_handlers``, the
            generated ``add_*Servicer_to_server``).
        interceptors: ``grpc.aio.ServerInterceptor`` objects.
        options: channel arguments of the server.
        workers: threads for plain (blocking) handlers.
        name: the thread's name.
    """

    def __init__(
        self,
        setup: Callable[[grpc.aio.Server, asyncio.AbstractEventLoop], None],
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        options: Sequence[tuple[str, Any]] = (),
        workers: int = 32,
        name: str = "tierfs-rpc",
    ) -> None:
        self._setup = setup
        self._interceptors = list(interceptors)
        self._options = list(options)
        self._pool = DaemonThreadPool(workers, name)
        self._name = name
        quiet_cancelled_writes()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    def start(self, address: str) -> int:
        """Bind ``address`` (``HOST:PORT``, port 0: any) and serve; returns the port.

        Blocks until the server runs (at most :data:`START_TIMEOUT` seconds).

        Raises:
            RuntimeError: the address cannot be bound (the message says which).
        """
        ready: futures.Future[int] = futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(address, ready), daemon=True, name=f"{self._name}-loop"
        )
        self._thread.start()
        return ready.result(timeout=START_TIMEOUT)

    def _run(self, address: str, ready: futures.Future[int]) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._serve(address, ready))
        except BaseException as exc:  # a failed bind: the starter raises it
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.exception("gRPC server loop failed")
        finally:
            # calls the stop cut off (long polls) end here, not as "destroyed" tasks
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    async def _serve(self, address: str, ready: futures.Future[int]) -> None:
        server = grpc.aio.server(
            migration_thread_pool=self._pool,
            interceptors=self._interceptors,
            options=self._options,
        )
        loop = asyncio.get_running_loop()
        self._setup(server, loop)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {address}: {exc}") from None
        if not port:
            raise RuntimeError(f"cannot listen on {address}")
        await server.start()
        self._server = server
        self._stopped = asyncio.Event()
        ready.set_result(port)
        await self._stopped.wait()

    def stop(self, grace: float | None = 0) -> None:
        """Stop serving (calls in flight are cancelled after ``grace`` seconds) and end
        the loop thread. Any thread but the loop's; idempotent."""
        loop, server, thread = self.loop, self._server, self._thread
        if loop is None or server is None or thread is None or loop.is_closed():
            return

        async def down() -> None:
            await server.stop(grace)
            if self._stopped is not None:
                self._stopped.set()

        try:
            asyncio.run_coroutine_threadsafe(down(), loop).result(timeout=(grace or 0) + 10)
        except (RuntimeError, futures.TimeoutError):
            log.warning("gRPC server did not stop in time")
        thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
