"""The data lane: a file's bytes from a holder to a puller over a plain TCP stream
beside gRPC (issue #18 item 2, issue #14 goal 2).

A file pull over gRPC costs the puller most of its CPU in gRPC itself (its
receive thread, the hand-over to the calling thread, a slice out of every
message) and the holder a read and a framing copy of every byte. Over the lane
the holder hands each chunk to the kernel with ``sendfile(2)`` (no copy in this
process) and the puller receives it with one ``recv`` into a ``bytes`` object,
checks its crc32c and writes it; every check of the gRPC path stays.

The lane is negotiated inside an authenticated ``PullShard`` call
(``PullRequest.lane``): a holder that offers one answers with the manifest only,
carrying ``ShardManifest.lane_port`` and ``lane_ticket`` (32 random bytes, good
for one connection within :data:`TICKET_TTL` seconds); the ticket is the lane's
only credential, given only to a caller that passed the peer token. The wire
format (docs/PROTOCOL.md "Data lane"), all integers big-endian:

* puller -> holder, once: :data:`MAGIC` then the 32-byte ticket;
* holder -> puller: frames of a :data:`HEADER` (kind u8; file index u32 among
  the file entries of the manifest sent, in its order; offset u64; length u32;
  crc32c u32), then ``length`` bytes: :data:`CHUNK_FRAME` (a chunk of at most :data:`MAX_CHUNK`
  bytes, its crc32c the manifest's per-chunk value where the manifest has one,
  else the holder's own), :data:`END_FRAME` (no bytes; every file was sent) or
  :data:`ERROR_FRAME` (a UTF-8 reason; the stream ends);
* puller -> holder, at most once: ``b"D"`` and a file index u32: that file's
  bytes failed the puller's check. The holder then checks its own copy
  (:meth:`tierfs.replication.service.PeerHost.damaged`), as it does when its
  own read finds a damaged chunk on the gRPC path; a report decides nothing by
  itself.

The holder's side is :class:`LaneServer` (plain threads, one per stream, at most
:data:`STREAMS`; an offer beyond that returns None and the bytes go over gRPC),
the puller's :class:`LaneStream`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import google_crc32c

from tierfs.replication.transfer import CHUNK, REPLICATION_NICE, TransferError, set_thread_nice
from tierfs.rpc.wire import Chunk
from tierfs.store.manifest import FileEntry

log = logging.getLogger(__name__)

#: the first bytes a puller sends (the lane's protocol version)
MAGIC = b"TFL1"
#: bytes of a ticket
TICKET_BYTES = 32
#: seconds an offered ticket stays good for its connection
TICKET_TTL = 30.0
#: lane streams a holder serves at once (offered tickets included)
STREAMS = 16
#: connections whose ticket is not read yet, at most (more are closed at once)
HANDSHAKES = 64
#: seconds a connection may take to send its ticket
HANDSHAKE_TIMEOUT = 5.0
#: seconds one frame (a header, a chunk) may take to arrive, or a send to go out,
#: before the stream fails (a dead peer is noticed as soon as gRPC's keepalive would:
#: 20 s between pings and 10 s for the answer)
IDLE_TIMEOUT = 30.0
#: seconds the holder's send may wait: a puller pauses a background pull while a
#: reader's fetch waits (``hold``), and the stream then stalls, as a gRPC stream
#: stalls under flow control; a puller that is gone is noticed at this timeout at
#: the latest (its pin on the copy with it)
SEND_TIMEOUT = 600.0
#: seconds a puller waits for the TCP connection
CONNECT_TIMEOUT = 5.0
#: the largest chunk a puller accepts (the holder sends :data:`CHUNK`-byte chunks)
MAX_CHUNK = 16 << 20
#: kind u8, file index u32, offset u64, length u32, crc32c u32
HEADER = struct.Struct("!BIQII")
CHUNK_FRAME, END_FRAME, ERROR_FRAME = 1, 2, 3
#: the puller's damage report: ``b"D"`` and the file index
DAMAGE = struct.Struct("!cI")


class LaneFailed(TransferError):
    """The lane stream broke: the holder could not be reached, closed early, sent
    an error frame or something that is not the protocol (the message says which).
    The pull goes to the next copy, as for a failed gRPC call (a
    :class:`TransferError`, as the callers of a pull expect)."""


# ---------------------------------------------------------------------- holder


@dataclasses.dataclass
class Grant:
    """What one ticket lets its connection read.

    Attributes:
        root: the directory of the copy's files (the part's data directory).
        files: the files to send, in this order (their index is the frame's).
        chunk_crcs: per file, the manifest's crc32c of each :data:`CHUNK`-byte
            chunk, or None where the manifest has none (the holder computes them).
        release: called once when the grant ends, in a lane thread or the
            thread that expired it: ``release(damaged, sent)``, ``damaged`` the
            path the puller reported ("" none), ``sent`` the bytes sent. Never
            raises (it is logged).
    """

    root: str
    files: Sequence[FileEntry]
    chunk_crcs: Sequence[Sequence[int] | None]
    release: Callable[[str, int], None]
    expires: float = 0.0


class LaneServer:
    """The holder's data lane: a listening TCP socket and a thread per stream.

    Args:
        host: the address to listen on ("" or ``0.0.0.0``: every IPv4 address;
            ``::``: every address).
        port: the TCP port (0: any free one; :attr:`port` says which).
        streams: grants outstanding at once (:data:`STREAMS`).
    """

    def __init__(self, host: str, port: int = 0, streams: int = STREAMS) -> None:
        self.host = host
        self.port = port
        self.streams = streams
        self._grants: dict[bytes, Grant] = {}
        self._running = 0  # grants whose connection is being served
        #: streams served (a ticket's connection came), and bytes sent on them
        self.served = 0
        self.sent_bytes = 0
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES)
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Listen and serve (a daemon thread); returns the port.

        Raises:
            OSError: the address cannot be bound (EADDRINUSE...).
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
            sock.settimeout(1.0)  # the accept loop sweeps expired grants each second
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="tierfs-lane", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop accepting and release every grant not yet connected (running
        streams end on their own: their sockets fail or finish)."""
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            grants, self._grants = list(self._grants.values()), {}
        for g in grants:
            _release(g, "", 0)

    def offer(self, grant: Grant) -> bytes | None:
        """A ticket for ``grant`` (good for one connection within :data:`TICKET_TTL`
        seconds), or None when :attr:`streams` grants are outstanding or the lane
        is stopped (the caller then streams over gRPC and keeps what it holds;
        ``grant.release`` is not called). Any thread."""
        self._sweep()
        with self._lock:
            if self._stop.is_set() or len(self._grants) + self._running >= self.streams:
                return None
            ticket = secrets.token_bytes(TICKET_BYTES)
            grant.expires = time.monotonic() + TICKET_TTL
            self._grants[ticket] = grant
            return ticket

    def outstanding(self) -> int:
        """Grants offered or being served."""
        with self._lock:
            return len(self._grants) + self._running

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [t for t, g in self._grants.items() if g.expires <= now]
            gone = [self._grants.pop(t) for t in old]
        for g in gone:
            log.debug("data lane: a ticket for %d files was not used", len(g.files))
            _release(g, "", 0)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            self._sweep()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("data lane: accept failed")
                time.sleep(0.1)
                continue
            if not self._handshakes.acquire(blocking=False):
                conn.close()  # too many connections without a ticket yet
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="tierfs-lane-stream", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        set_thread_nice(REPLICATION_NICE)
        grant: Grant | None = None
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            try:
                hello = _recv_exact(conn, len(MAGIC) + TICKET_BYTES)
            except (OSError, LaneFailed):
                return
            finally:
                self._handshakes.release()
            if hello[: len(MAGIC)] != MAGIC:
                return
            with self._lock:
                grant = self._grants.pop(hello[len(MAGIC) :], None)
                if grant is not None:
                    self._running += 1
            if grant is None:
                return  # unknown, or expired and released by the sweep
            if grant.expires <= time.monotonic():
                _release(grant, "", 0)
                return
            conn.settimeout(SEND_TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            damaged, sent = _send_files(conn, grant)
            with self._lock:
                self.served += 1
                self.sent_bytes += sent
            _release(grant, damaged, sent)
        finally:
            if grant is not None:
                with self._lock:
                    self._running -= 1
            conn.close()


def _release(grant: Grant, damaged: str, sent: int) -> None:
    try:
        grant.release(damaged, sent)
    except Exception:
        log.exception("data lane: releasing a grant")


def _send_files(conn: socket.socket, grant: Grant) -> tuple[str, int]:
    """Send every file of ``grant`` on ``conn``: (the path the puller reported
    damaged or "", bytes sent). A socket error ends it quietly (the puller went
    away or gave up); a file that cannot be read is sent as an error frame."""
    sent = 0
    poll = select.poll()
    poll.register(conn.fileno(), select.POLLIN)
    try:
        for index, entry in enumerate(grant.files):
            crcs = grant.chunk_crcs[index]
            try:
                f = open(os.path.join(grant.root, entry.path), "rb", buffering=0)  # noqa: SIM115
            except OSError as exc:
                # this copy is damaged (a file of its manifest is gone): the holder
                # checks it, as for a damage report
                _error(conn, f"{entry.path} vanished here: {exc.strerror or exc}")
                return entry.path, sent
            with f:
                for k, offset in enumerate(range(0, entry.size, CHUNK)):
                    n = min(CHUNK, entry.size - offset)
                    if crcs is not None and k < len(crcs):
                        conn.sendall(HEADER.pack(CHUNK_FRAME, index, offset, n, crcs[k]))
                        done = conn.sendfile(f, offset, n)  # type: ignore[arg-type]
                        if done != n:
                            # the frame promised n bytes: fill it (the puller's check
                            # refuses the chunk), then say why and end
                            conn.sendall(bytes(n - done))
                            _error(conn, f"{entry.path} is shorter here than its manifest")
                            return entry.path, sent
                    else:
                        data = os.pread(f.fileno(), n, offset)
                        if len(data) != n:
                            _error(conn, f"{entry.path} is shorter here than its manifest")
                            return entry.path, sent
                        head = HEADER.pack(CHUNK_FRAME, index, offset, n, google_crc32c.value(data))
                        conn.sendall(head)
                        conn.sendall(data)
                    sent += n
                    if poll.poll(0):
                        report = _damage_report(conn, grant)
                        if report is not None:
                            return report, sent
        conn.sendall(HEADER.pack(END_FRAME, 0, 0, 0, 0))
        # the puller may still report the last file: it answers within the idle time
        conn.settimeout(HANDSHAKE_TIMEOUT)
        report = _damage_report(conn, grant)
        return report or "", sent
    except OSError:
        return "", sent  # the puller went away (cancelled, no room, its own timeout)


def _error(conn: socket.socket, why: str) -> None:
    data = why.encode()[:4096]
    try:
        conn.sendall(HEADER.pack(ERROR_FRAME, 0, 0, len(data), 0) + data)
    except OSError:
        pass


def _damage_report(conn: socket.socket, grant: Grant) -> str | None:
    """The path of a damage report waiting on ``conn`` (None: the puller closed or
    sent nothing that reads as one)."""
    try:
        raw = _recv_exact(conn, DAMAGE.size)
    except (OSError, LaneFailed):
        return None
    tag, index = DAMAGE.unpack(raw)
    if tag != b"D" or index >= len(grant.files):
        return None
    return grant.files[index].path


# ---------------------------------------------------------------------- puller


def lane_host(address: str) -> str:
    """The host part of a peer address ``HOST:PORT`` (``[V6]:PORT`` gives ``V6``)."""
    if address.startswith("["):
        return address[1 : address.index("]")]
    return address.rsplit(":", 1)[0]


class LaneStream:
    """The puller's end of one lane stream: iterate it for :class:`Chunk` records
    (``path`` from ``paths`` by the frame's index, the data as ``bytes``, its
    claimed crc32c), in the holder's order; the caller checks every crc32c.

    Args:
        address: the holder's peer address (``HOST:PORT``); the lane is on its host.
        port: ``ShardManifest.lane_port``. ticket: ``ShardManifest.lane_ticket``.
        paths: the paths of the manifest sent, in its order.

    Raises:
        LaneFailed: (from the constructor) the lane cannot be reached in
            :data:`CONNECT_TIMEOUT` seconds or sends no first frame (the holder
            closed at once), or (while iterating) the stream broke,
            sent an error frame, stalled for :data:`IDLE_TIMEOUT` seconds or
            broke the protocol.
    """

    def __init__(self, address: str, port: int, ticket: bytes, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        host = lane_host(address)
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            raise LaneFailed(f"data lane {host}:{port} unreachable: {exc}") from exc
        try:
            # blocking with kernel timeouts: recv(MSG_WAITALL) fills a chunk in one call
            sock.settimeout(None)
            tv = struct.pack("ll", int(IDLE_TIMEOUT), 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            sock.sendall(MAGIC + ticket)
            # the first frame's header: a holder that closes before it (its
            # handshake slots taken by a flood, the ticket expired) did not serve
            # this stream, and the caller takes the bytes over gRPC (trial 46)
            self._first: bytes | None = _recv_exact(sock, HEADER.size)
        except (OSError, LaneFailed) as exc:
            sock.close()
            raise LaneFailed(f"data lane {host}:{port} served nothing: {exc}") from exc
        self.sock = sock
        self.where = f"{host}:{port}"
        self.ended = False

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while True:
                head, self._first = self._first or _recv_exact(self.sock, HEADER.size), None
                kind, index, offset, n, crc = HEADER.unpack(head)
                if kind == CHUNK_FRAME:
                    if index >= len(self.paths) or not 0 < n <= MAX_CHUNK:
                        raise LaneFailed(f"data lane {self.where}: a frame out of protocol")
                    yield Chunk(self.paths[index], offset, _recv_exact(self.sock, n), crc)
                elif kind == END_FRAME:
                    self.ended = True
                    return
                elif kind == ERROR_FRAME and n <= 4096:
                    why = _recv_exact(self.sock, n).decode(errors="replace")
                    raise LaneFailed(f"the holder's data lane: {why}")
                else:
                    raise LaneFailed(f"data lane {self.where}: a frame out of protocol")
        except OSError as exc:
            raise LaneFailed(f"data lane {self.where}: {exc}") from exc

    def damaged(self, path: str) -> None:
        """Tell the holder the bytes of ``path`` failed the check here, then close
        (best effort: the holder checks its own copy)."""
        try:
            index = self.paths.index(path)
        except ValueError:
            self.cancel()
            return
        try:
            self.sock.sendall(DAMAGE.pack(b"D", index))
            self.sock.shutdown(socket.SHUT_WR)
            # read what is still in flight until the holder closes, so the close
            # below sends no reset that could drop the report
            self.sock.settimeout(HANDSHAKE_TIMEOUT)
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT
            while time.monotonic() < deadline and self.sock.recv(1 << 20):
                pass
        except OSError:
            pass
        self.cancel()

    def cancel(self) -> None:
        """Close the stream (the holder's send fails and ends it); idempotent."""
        try:
            self.sock.close()
        except OSError:
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (one ``recv`` with ``MSG_WAITALL`` on a
    blocking socket, the usual case: no join).

    On a socket with a kernel receive timeout (``SO_RCVTIMEO``, the puller's) the
    whole frame must arrive within that timeout from the first ``recv``: a
    stream that stalls after part of a frame fails then, not a timeout later
    (trial 46: a stall mid-chunk took twice the timeout to notice).

    Raises:
        LaneFailed: the peer closed first, or the frame did not arrive in time.
        OSError: the socket failed (or, on a socket with a Python timeout, timed out).
    """
    start = time.monotonic()
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    limit = _rcvtimeo(sock)
    try:
        while got < n:
            if not parts[-1]:
                raise LaneFailed("the other end closed the data lane mid-frame")
            if limit:
                left = limit - (time.monotonic() - start)
                if left <= 0:
                    raise LaneFailed(f"the data lane stalled for {limit:.0f} s mid-frame")
                _set_rcvtimeo(sock, left)
            try:
                more = sock.recv(n - got, socket.MSG_WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO ran out with nothing more
                raise LaneFailed(f"the data lane stalled for {limit:.0f} s mid-frame") from None
            parts.append(more)
            got += len(more)
    finally:
        if limit:
            _set_rcvtimeo(sock, limit)
    return b"".join(parts)


def _rcvtimeo(sock: socket.socket) -> float:
    """``sock``'s kernel receive timeout in seconds (0: none)."""
    if sock.gettimeout() is not None:
        return 0.0  # Python's own timeout (the holder's sockets): it governs each call
    sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
    return sec + usec / 1e6


def _set_rcvtimeo(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    micro = max(int((seconds - whole) * 1e6), 1000 if not whole else 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, micro))


__all__ = [
    "Grant",
    "LaneFailed",
    "LaneServer",
    "LaneStream",
]
