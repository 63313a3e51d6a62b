"""The client side of the peer plane: blocking calls to peers and the coordinator.

:class:`PeerClient` asks peers for their inventory, pushes replicas to them,
pulls a shard or one file of it from a holder (verifying every crc32c) and makes the
coordinator's calls (Join, Decide, Barrier, Sync). Every call blocks: run it
in a ``trio.to_thread`` worker with a capacity limiter, as
:class:`tierfs.replication.peer.PeerTier` does (:mod:`tierfs.replication.lanes`).
:func:`rpc_reason` and :func:`rpc_code` describe a failed call.

The channels come from ``connect`` (default: ``grpc.insecure_channel`` with
:data:`tierfs.rpc.wire.CHANNEL_OPTIONS`); the in-process network of
``tests/support/fake_peers.py`` passes channels that call the other nodes'
handlers directly, so the same client code runs without sockets.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import google_crc32c
import grpc

from tierfs.core.ports import FileTarget
from tierfs.core.types import CopyId, Holding, Outcome
from tierfs.replication.lane import LaneFailed, LaneStream
from tierfs.replication.transfer import (
    CHUNK,
    REPLICATION_NICE,
    BadCopy,
    Cancelled,
    OtherBytes,
    Refused,
    ShardReceiver,
    check_identity,
    iter_chunks,
    parse_manifest,
    set_thread_nice,
)
from tierfs.rpc import peer_pb2, peer_pb2_grpc
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.wire import WireStats
from tierfs.store.chunks import ChunkMismatch, crc32c_append
from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.shards import Shard, ShardKey

log = logging.getLogger(__name__)

#: longest long poll of a Decide/Barrier call (milliseconds): a waiting call costs the
#: coordinator no thread and no CPU (#17), so it may wait long; the coordinator caps it
#: (tierfs.cluster.servicer.MAX_WAIT) and answers at once on progress
POLL_MS = 25_000
#: seconds one file pull (:meth:`PeerClient.pull_file`) may take, its bytes included
FILE_PULL_TIMEOUT = 600.0
#: seconds a holder whose data lane could not be reached is asked for none
LANE_RETRY = 300.0
#: seconds between looks while a file pull is held (:meth:`PeerClient.pull_file` ``hold``)
HOLD_POLL = 0.005


class PeerClient:
    """Blocking calls to peers and the coordinator (run them in worker threads).

    Args:
        token: the shared peer token or None.
        stats: counters to update (the peer tier's wire counters).
        connect: ``connect(address)`` -> a ``grpc.Channel`` to ``HOST:PORT`` (called
            once per address; None: :func:`insecure_channel`).
        lane: ask holders for their data lane in file pulls
            (:mod:`tierfs.replication.lane`; a holder without one streams over gRPC).
    """

    def __init__(
        self,
        token: str | None,
        stats: WireStats,
        connect: Callable[[str], grpc.Channel] | None = None,
        lane: bool = True,
    ) -> None:
        self.md = peer_wire.metadata(token)
        self.stats = stats
        self.lane = lane
        self._connect = connect or insecure_channel
        self._channels: dict[str, grpc.Channel] = {}
        #: addresses whose data lane could not be reached, and when (monotonic s)
        self._lane_down: dict[str, float] = {}
        #: this node's peer address while its data lane serves: a replica is then
        #: handed over by its receiver pulling it from here (:meth:`push`)
        self.pull_from: str | None = None
        #: receivers that get pushes for :data:`LANE_RETRY` seconds, and since when
        #: (monotonic s): they answered Replicate with UNIMPLEMENTED or could not pull
        #: from here
        self._push_only: dict[str, float] = {}
        self._lock = threading.Lock()

    def channel(self, address: str) -> grpc.Channel:
        """The channel to ``address`` (one per address, made on first use)."""
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = self._connect(address)
            return ch

    def wait_ready(self, address: str, timeout: float) -> bool:
        """Whether the channel to ``address`` connects within ``timeout`` seconds (it is
        asked to connect now, not after its reconnect backoff). Blocking."""
        ready = grpc.channel_ready_future(self.channel(address))
        try:
            ready.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            ready.cancel()
            return False
        return True

    def _pull_shard(self, address: str) -> Any:
        """The ``PullShard`` server-streaming callable on ``address``'s channel (a
        chunk message arrives as a ``Chunk``, any other as a ``PullMessage``:
        ``chunk_deserializer`` in :mod:`tierfs.rpc.wire`)."""
        return self.channel(address).unary_stream(
            "/tierfs.peer.v1.Peer/PullShard",
            request_serializer=peer_wire.serialize,
            response_deserializer=peer_wire.chunk_deserializer(peer_pb2.PullMessage),
        )

    def peer(self, address: str) -> Any:
        return peer_pb2_grpc.PeerStub(self.channel(address))

    def coordinator(self, address: str) -> Any:
        return peer_pb2_grpc.CoordinatorStub(self.channel(address))

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    # ------------------------------------------------------------------ data

    def inventory(
        self,
        address: str,
        job: str,
        want_digest: str = "",
        wait_step: int = -1,
        wait_s: float = 0.0,
        timeout: float = 10.0,
    ) -> Any:
        """The peer's :class:`InventoryReply` (waiting up to ``wait_s`` for the digest).

        Raises:
            grpc.RpcError: unreachable (after ``wait_s + timeout`` seconds at most).
        """
        req = peer_pb2.InventoryRequest(
            job=job, want_digest=want_digest, wait_step=wait_step, wait_ms=int(wait_s * 1000)
        )
        return self.peer(address).Inventory(req, metadata=self.md, timeout=wait_s + timeout)

    def push(
        self, address: str, shard: Shard, sender_rank: int, dedup: bool, cancel: threading.Event
    ) -> Any:
        """Push ``shard`` (or only its manifest with ``dedup``); returns the PushReply.

        While this node's data lane serves (:attr:`pull_from`), the bytes are
        handed over by the receiver pulling them from here (``Replicate``: one
        call, the bytes over this node's lane, every crc32c checked there as in
        any pull); a receiver that does not know ``Replicate`` gets a
        ``PushShard`` stream, as does a ``dedup`` push.

        Raises:
            Cancelled: ``cancel`` was set.
            grpc.RpcError: the peer refused (DATA_LOSS for a checksum mismatch,
                RESOURCE_EXHAUSTED for a full RAM budget...) or is unreachable.
            OSError: the snapshot vanished while it was read.
        """
        if not dedup and self.pull_from and self._pulls_from_here(address):
            try:
                return self._replicate(address, shard, sender_rank, cancel)
            except grpc.RpcError as exc:
                code = rpc_code(exc)
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    # an older daemon, or one without a lane: asked again after a while
                    # (it may restart with one; trial 46)
                    with self._lock:
                        self._push_only[address] = time.monotonic()
                    log.info("%s takes replicas by push only: %s", address, rpc_reason(exc))
                elif code == grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith(
                    "pulling "
                ):
                    # it could not reach this node (a one-way network, another
                    # --advertise): push to it, as before Replicate, for a while
                    with self._lock:
                        self._push_only[address] = time.monotonic()
                    log.warning(
                        "%s cannot pull replicas from here (%s); pushing to it for %.0f s",
                        address,
                        rpc_reason(exc),
                        LANE_RETRY,
                    )
                else:
                    raise
        m = shard.manifest
        problem: list[BaseException] = []

        def messages() -> Any:
            yield peer_pb2.PushMessage(
                header=peer_pb2.PushHeader(
                    job=m.job,
                    rank=m.rank,
                    step=m.step,
                    digest=m.digest,
                    sender_rank=sender_rank,
                    total_bytes=0 if dedup else m.total_bytes,
                    dedup=dedup,
                )
            )
            if not dedup:
                set_thread_nice(REPLICATION_NICE)  # grpc's per-call request thread
                try:
                    for path, off, data, crc in iter_chunks(
                        shard.data, m.files, cancelled=cancel.is_set
                    ):
                        yield peer_wire.encode_chunk(path, off, data, crc)  # a PushMessage
                        self.stats.add("sent_bytes", len(data))
                except (OSError, Cancelled) as exc:
                    problem.append(exc)
                    return  # ends the stream without a manifest: the receiver discards it
            data = m.to_json()
            self.stats.add("manifest_bytes_sent", len(data))
            yield peer_pb2.PushMessage(manifest=peer_pb2.ShardManifest(json=data))

        push = self.channel(address).stream_unary(
            "/tierfs.peer.v1.Peer/PushShard",
            request_serializer=peer_wire.serialize,
            response_deserializer=peer_pb2.PushReply.FromString,
        )
        fut = push.future(messages(), metadata=self.md)
        reply = _result_unless_cancelled(fut, cancel)
        if problem:
            raise problem[0]
        self.stats.add("pushes_sent")
        if dedup and reply.committed:
            self.stats.add("manifest_only_sent")
        return reply

    def _replicate(
        self, address: str, shard: Shard, sender_rank: int, cancel: threading.Event
    ) -> Any:
        """One ``Replicate`` call: the receiver at ``address`` pulls ``shard`` from
        :attr:`pull_from`; its PushReply (raises as :meth:`push`)."""
        m = shard.manifest
        req = peer_pb2.ReplicateRequest(
            header=peer_pb2.PushHeader(
                job=m.job,
                rank=m.rank,
                step=m.step,
                digest=m.digest,
                sender_rank=sender_rank,
                total_bytes=m.total_bytes,
            ),
            pull_from=self.pull_from,
        )
        fut = self.peer(address).Replicate.future(req, metadata=self.md)
        reply = _result_unless_cancelled(fut, cancel)
        self.stats.add("pushes_sent")
        self.stats.add("sent_bytes", m.total_bytes)
        return reply

    def pull(
        self,
        address: str,
        key: ShardKey,
        digest: str,
        puller_rank: int,
        ram: Any,
        shards: Any,
        cancel: threading.Event | Any,
        before_commit: Callable[[Manifest], None] | None = None,
    ) -> Shard:
        """Pull ``key`` from a holder, verify it and commit it to ``shards``.

        The bytes come over the holder's data lane when it offers one
        (:mod:`tierfs.replication.lane`), else in the PullShard call.

        Args:
            cancel: anything with ``is_set()`` (checked before every chunk).
            before_commit: called with the verified manifest just before the
                commit; what it raises ends the pull with nothing committed.

        Returns:
            The committed shard (not yet in the agent's catalog).

        Raises:
            BadCopy: a chunk or file failed its crc32c, or the manifest is not
                the expected one (the copy is corrupt).
            Refused: the holder broke the protocol (unsafe paths...).
            Cancelled: ``cancel`` was set.
            grpc.RpcError: the holder is unreachable or has no such copy.
            LaneFailed: the holder's data lane broke mid-stream.
            whatever ``before_commit`` raised.
        """
        lane = self.lane and self._lane_ok(address)
        req = peer_pb2.PullRequest(
            job=key.job,
            rank=key.rank,
            step=key.step,
            digest=digest,
            puller_rank=puller_rank,
            lane=lane,
        )
        pull = self._pull_shard(address)
        call: Any = pull(req, metadata=self.md)
        inc = ram.new_incoming(f"pull-{key.rank}-{key.step}")
        rx: ShardReceiver | None = None
        c: peer_wire.Chunk | None = None
        try:
            first = next(call)
            if peer_wire.kind_of(first) != "manifest":
                raise Refused("PullShard must start with the manifest")
            manifest = parse_manifest(first.manifest.json)
            check_identity(manifest, key, digest)
            rx = ShardReceiver(inc, manifest)
            if lane and first.manifest.lane_port > 0 and first.manifest.lane_ticket:
                call.cancel()  # it ended after the manifest
                files = [f.path for f in manifest.files if f.kind == "file"]
                try:
                    call = LaneStream(
                        address, first.manifest.lane_port, first.manifest.lane_ticket, files
                    )
                    self.stats.add("lane_pulls")
                except LaneFailed as exc:
                    self._lane_unreachable(address, exc)
                    rx.abort()
                    rx = None
                    return self.pull(
                        address, key, digest, puller_rank, ram, shards, cancel, before_commit
                    )
            for msg in call:
                if cancel.is_set():
                    raise Cancelled("transfer cancelled")
                if peer_wire.kind_of(msg) != "chunk":
                    raise Refused("PullShard sent a second manifest")
                c = peer_wire.as_chunk(msg)
                rx.chunk(c.path, c.offset, c.data, c.crc32c)
                self.stats.add("pulled_bytes", len(c.data))
            c = None
            if isinstance(call, LaneStream):
                call.cancel()  # every frame read: the holder's stream ends now
            rx.finish()
            if before_commit is not None:
                before_commit(manifest)
            shard = shards.commit(inc, manifest, verified=True)
            self.stats.add("pulls")
            return shard
        except BaseException as exc:
            if isinstance(call, LaneStream) and isinstance(exc, BadCopy) and c is not None:
                call.damaged(c.path)  # the holder checks its copy
            call.cancel()
            if rx is not None:
                rx.abort()
            else:
                shutil.rmtree(inc, ignore_errors=True)
            raise

    def pull_file(
        self,
        address: str,
        key: ShardKey,
        digest: str,
        path: str,
        fd: int,
        cancel: threading.Event,
        timeout: float = FILE_PULL_TIMEOUT,
        expect: tuple[int, int] | None = None,
        hold: Callable[[], bool] | None = None,
        write: Callable[[bytes, int], None] | None = None,
    ) -> int:
        """Pull one file of the holder's copy of ``key`` into the open descriptor ``fd``
        (issue #14: a whole-step view reads a file of another rank's part).

        One PullShard call naming ``path`` (``PullRequest.paths``, with
        ``trim_manifest``): the manifest (only that file's entry and the whole
        manifest's digest; an older holder sends all of it), then that file's
        chunks. Each chunk's bytes are written at its offset with ``os.pwrite``
        (``fd``'s file offset does not move; ``fd`` is not truncated), after its
        crc32c was checked; the file's crc32c is computed from the chunks as they
        are written (the bytes are not read back) and must be the manifest's at the
        end, as must its size.

        Args:
            path: relative to the part's root, as the manifest lists it.
            digest: the manifest digest the copy must have ("": any; a holder
                with another one answers FAILED_PRECONDITION).
            timeout: seconds the whole call may take.
            expect: (size in bytes, crc32c) the caller's manifest gives the file;
                a holder whose entry differs raises :class:`OtherBytes` before any
                byte is written (None: the holder's entry is taken).
            hold: called before every chunk is written; while it returns True the
                pull pauses (polled every :data:`HOLD_POLL` seconds; the stream
                stalls under gRPC flow control): a prefetch gives way to a reader.
            write: ``write(data, offset)`` writes each chunk instead of ``os.pwrite``
                into ``fd`` (the caller checks chunks against its manifest first;
                what it raises ends the pull).

        Returns:
            bytes written (the file's size).

        Raises:
            OtherBytes: the holder's file is not ``expect`` (nothing written).
            BadCopy: a chunk failed its crc32c, the file's size or crc32c is not
                the manifest's, or the manifest is not the expected one (some
                bytes may have been written: the copy is corrupt).
            Refused: the holder broke the protocol (no manifest first, ``path``
                not a file of it, chunks of other files or out of order).
            Cancelled: ``cancel`` was set (checked before every write).
            grpc.RpcError: the holder is unreachable, has no such copy or file
                (NOT_FOUND), has another digest (FAILED_PRECONDITION), or took
                longer than ``timeout`` (DEADLINE_EXCEEDED).
            OSError: writing to ``fd`` failed (ENOSPC...).
        """
        call, entries = self._pull_paths(address, key, digest, [path], timeout)
        try:
            entry = entries.get(path)
            if entry is None or entry.kind != "file":
                raise Refused(f"{path!r} is not a file of the manifest sent")
            if expect is not None and (entry.size, entry.crc32c) != expect:
                raise OtherBytes(
                    f"{path}: the holder's file is {entry.size} bytes crc32c "
                    f"{(entry.crc32c or 0):08x}, the manifest here says {expect[0]} bytes "
                    f"crc32c {expect[1]:08x}"
                )
            written = crc = 0
            for msg in call:
                if peer_wire.kind_of(msg) != "chunk":
                    raise Refused("PullShard sent a second manifest")
                c = peer_wire.as_chunk(msg)
                if c.path != path:
                    raise Refused(
                        f"PullShard sent {c.path!r}, not only {path!r} (a holder that "
                        "does not know PullRequest.paths)"
                    )
                if c.offset != written:
                    raise Refused(f"{path!r}: chunk at offset {c.offset}, expected {written}")
                # one pass over the bytes: the wire check, the writer's check against
                # the manifest and the file's crc all use it (three passes before)
                got = google_crc32c.value(c.data)
                if got != c.crc32c:
                    raise BadCopy(f"{path}: {_chunk_at(c.offset)}: chunk crc32c mismatch")
                if written + len(c.data) > entry.size:
                    raise BadCopy(f"{path}: more bytes than the manifest's {entry.size}")
                while hold is not None and hold() and not cancel.is_set():
                    time.sleep(HOLD_POLL)
                if cancel.is_set():
                    raise Cancelled("transfer cancelled")
                if write is not None:
                    write(c.data, c.offset, got)
                else:
                    _pwrite_all(fd, c.data, c.offset)
                written += len(c.data)
                crc = crc32c_append(crc, c.data, got)
                self.stats.add("pulled_bytes", len(c.data))
            if written != entry.size:
                raise BadCopy(f"{path}: size {written} != {entry.size}")
            if crc != entry.crc32c:
                raise BadCopy(f"{path}: crc32c {crc:08x} != {(entry.crc32c or 0):08x}")
            return written
        except (BadCopy, ChunkMismatch):
            if isinstance(call, LaneStream):
                call.damaged(path)  # the holder checks its copy (the gRPC path's own check)
            raise
        finally:
            call.cancel()  # a no-op once the stream ended

    def _pull_paths(
        self,
        address: str,
        key: ShardKey,
        digest: str,
        paths: list[str],
        timeout: float,
        lane: bool = True,
    ) -> tuple[Any, dict[str, FileEntry]]:
        """Start one PullShard call for ``paths`` (``trim_manifest``) and read its
        manifest: the chunks' source (the call, or a
        :class:`tierfs.replication.lane.LaneStream` when the holder offered its data
        lane; both iterate chunk messages and have ``cancel()``) and the manifest's
        entries by path. A lane that cannot be reached is not asked for again for
        :data:`LANE_RETRY` seconds (logged once); the files then come over gRPC.

        Raises:
            Refused: the first message is no manifest. BadCopy: the manifest names
                another shard or digest. grpc.RpcError: as the call failed.
        """
        lane = lane and self.lane and self._lane_ok(address)
        req = peer_pb2.PullRequest(
            job=key.job,
            rank=key.rank,
            step=key.step,
            digest=digest,
            puller_rank=-1,
            paths=paths,
            trim_manifest=True,
            lane=lane,
        )
        pull = self._pull_shard(address)
        call = pull(req, metadata=self.md, timeout=timeout)
        try:
            first = next(call, None)
            if first is None or peer_wire.kind_of(first) != "manifest":
                raise Refused("PullShard must start with the manifest")
            manifest = parse_manifest(first.manifest.json)
            if first.manifest.digest:
                # a trimmed manifest: its own digest is not the part's
                check_identity(manifest, key, "")
                if digest and first.manifest.digest != digest:
                    raise BadCopy(f"manifest digest {first.manifest.digest} != announced {digest}")
            else:
                check_identity(manifest, key, digest)
        except BaseException:
            call.cancel()
            raise
        entries = {f.path: f for f in manifest.files}
        port, ticket = first.manifest.lane_port, first.manifest.lane_ticket
        if not (lane and port > 0 and ticket):
            return call, entries
        call.cancel()  # it ended after the manifest
        try:
            stream = LaneStream(address, port, ticket, [f.path for f in manifest.files])
        except LaneFailed as exc:
            self._lane_unreachable(address, exc)
            return self._pull_paths(address, key, digest, paths, timeout, lane=False)
        self.stats.add("lane_pulls")
        return stream, entries

    def _lane_unreachable(self, address: str, exc: LaneFailed) -> None:
        """``address``'s data lane could not be reached: ask it for none for
        :data:`LANE_RETRY` seconds (one warning, later ones are debug lines)."""
        with self._lock:
            said = address in self._lane_down
            self._lane_down[address] = time.monotonic()
        (log.debug if said else log.warning)(
            "%s; pulling over gRPC from %s for %.0f s", exc, address, LANE_RETRY
        )

    def _pulls_from_here(self, address: str) -> bool:
        """Whether the receiver at ``address`` is asked to pull replicas (Replicate)."""
        with self._lock:
            if address not in self._push_only:
                return True
            if time.monotonic() - self._push_only[address] >= LANE_RETRY:
                del self._push_only[address]
                return True
            return False

    def _lane_ok(self, address: str) -> bool:
        """Whether to ask ``address`` for its data lane (not unreachable lately)."""
        with self._lock:
            down = self._lane_down.get(address)
        return down is None or time.monotonic() - down >= LANE_RETRY

    def pull_files(
        self,
        address: str,
        key: ShardKey,
        digest: str,
        files: Sequence[FileTarget],
        cancel: threading.Event,
        landed: Callable[[str], None],
        timeout: float = FILE_PULL_TIMEOUT,
        hold: Callable[[], bool] | None = None,
    ) -> set[str]:
        """Pull several files of the holder's copy of ``key`` in one PullShard call
        (issue #14 goal 2: a whole-step view reading many small files of a part).

        The holder streams the files in its manifest's order; each chunk's crc32c is
        checked, then it goes through its target's ``write``. When a file's last
        byte is written and its size and crc32c are the target's, ``landed(path)``
        is called (in this thread). A file whose entry in the holder's manifest is
        not the target's (other bytes) is not written; its chunks are skipped.

        Args:
            digest: the manifest digest the copy must have ("": any).
            timeout: seconds the whole call may take.
            hold: as for :meth:`pull_file`.

        Returns:
            the paths landed (all of ``files`` but those with other bytes, unless
            an error is raised).

        Raises:
            BadCopy: a chunk failed its crc32c or a file ended with the wrong size or
                crc32c; Refused: the holder broke the protocol (a file not asked
                for, chunks out of order); Cancelled: ``cancel`` was set;
                grpc.RpcError: as the call failed; whatever a ``write`` raised
                (ChunkMismatch, OSError). Files landed before it stay landed.
            ValueError: ``files`` is empty.
        """
        if not files:
            raise ValueError("pull_files needs at least one file (no paths: the whole part)")
        targets = {f.path: f for f in files}
        done: set[str] = set()
        call, entries = self._pull_paths(address, key, digest, list(targets), timeout)
        try:
            wanted: dict[str, FileTarget] = {}
            for path, target in targets.items():
                entry = entries.get(path)
                if entry is None or entry.kind != "file":
                    raise Refused(f"{path!r} is not a file of the manifest sent")
                if (entry.size, entry.crc32c) == (target.size, target.crc32c):
                    wanted[path] = target
            written = dict.fromkeys(targets, 0)
            crcs = dict.fromkeys(targets, 0)
            c: peer_wire.Chunk | None = None
            for msg in call:
                if peer_wire.kind_of(msg) != "chunk":
                    raise Refused("PullShard sent a second manifest")
                if cancel.is_set():
                    raise Cancelled("transfer cancelled")
                c = peer_wire.as_chunk(msg)
                at = written.get(c.path)
                if at is None:
                    raise Refused(f"PullShard sent {c.path!r}, which was not asked for")
                if c.offset != at:
                    raise Refused(f"{c.path!r}: chunk at offset {c.offset}, expected {at}")
                got = google_crc32c.value(c.data)  # the only pass over the bytes
                if got != c.crc32c:
                    raise BadCopy(f"{c.path}: {_chunk_at(c.offset)}: chunk crc32c mismatch")
                written[c.path] = at + len(c.data)
                target = wanted.get(c.path)
                if target is None:
                    continue  # other bytes than the caller's: not written
                if written[c.path] > target.size:
                    raise BadCopy(f"{c.path}: more bytes than the manifest's {target.size}")
                while hold is not None and hold() and not cancel.is_set():
                    time.sleep(HOLD_POLL)
                if cancel.is_set():
                    raise Cancelled("transfer cancelled")
                target.write(c.data, c.offset, got)
                crcs[c.path] = crc32c_append(crcs[c.path], c.data, got)
                self.stats.add("pulled_bytes", len(c.data))
                if written[c.path] == target.size:
                    if crcs[c.path] != target.crc32c:
                        raise BadCopy(f"{c.path}: crc32c {crcs[c.path]:08x} != {target.crc32c:08x}")
                    done.add(c.path)
                    landed(c.path)
            c = None  # every chunk was right
            for path, target in wanted.items():
                if target.size == 0 and path not in done:  # no chunk is sent for it
                    if target.crc32c != 0:
                        raise BadCopy(f"{path}: an empty file with crc32c {target.crc32c:08x}")
                    done.add(path)
                    landed(path)
            return done
        except (BadCopy, ChunkMismatch):
            if isinstance(call, LaneStream) and c is not None:
                call.damaged(c.path)  # the holder checks its copy
            raise
        finally:
            call.cancel()  # a no-op once the stream ended

    def manifest(self, address: str, key: ShardKey, timeout: float = 10.0) -> Manifest:
        """The manifest of the holder's copy of ``key`` (no file bytes).

        Raises:
            Refused: the holder broke the protocol (the first message is no manifest).
            BadCopy: the manifest does not parse or names another shard.
            grpc.RpcError: unreachable (after ``timeout`` seconds), or NOT_FOUND.
        """
        req = peer_pb2.PullRequest(
            job=key.job, rank=key.rank, step=key.step, puller_rank=-1, manifest_only=True
        )
        pull = self._pull_shard(address)
        call = pull(req, metadata=self.md, timeout=timeout)
        try:
            first = next(call)
            if peer_wire.kind_of(first) != "manifest":
                raise Refused("PullShard must start with the manifest")
            manifest = parse_manifest(first.manifest.json)
            check_identity(manifest, key, "")
            return manifest
        finally:
            call.cancel()  # an older holder streams the files too: not wanted

    def part_digest(self, address: str, key: ShardKey, timeout: float = 10.0) -> str:
        """The digest of the holder's copy of ``key``: a manifest-only pull asking for
        no file entries (``trim_manifest``), so a question costs the same for a part
        of 2 files or 10,000; an older holder's whole manifest is read as well.

        Raises:
            Refused: the holder broke the protocol (the first message is no manifest).
            BadCopy: the manifest does not parse or names another shard.
            grpc.RpcError: unreachable (after ``timeout`` seconds), NOT_FOUND, or
                FAILED_PRECONDITION (its client writes that part again).
        """
        req = peer_pb2.PullRequest(
            job=key.job,
            rank=key.rank,
            step=key.step,
            puller_rank=-1,
            manifest_only=True,
            trim_manifest=True,
        )
        pull = self._pull_shard(address)
        call = pull(req, metadata=self.md, timeout=timeout)
        try:
            first = next(call)
            if peer_wire.kind_of(first) != "manifest":
                raise Refused("PullShard must start with the manifest")
            manifest = parse_manifest(first.manifest.json)
            check_identity(manifest, key, "")
            return first.manifest.digest or manifest.digest
        finally:
            call.cancel()

    # ------------------------------------------------------------------ coordinator

    def join(self, coord: str, **fields: Any) -> Any:
        """Join (or register with) the coordinator at ``coord``; fields of JoinRequest."""
        inventory = fields.pop("inventory", ())
        req = peer_pb2.JoinRequest(inventory=[peer_wire.held_shard(h) for h in inventory], **fields)
        return self.coordinator(coord).Join(req, metadata=self.md, timeout=10)

    def decide(
        self, address: str, job: str, rank: int, restore_id: str, wait_s: float | None = None
    ) -> Any:
        """The DecideReply, after a long poll of ``wait_s`` seconds at most (None:
        :data:`POLL_MS`) while the decision waits."""
        return self.decide_call(address, decide_request(job, rank, restore_id, wait_s))

    def decide_call(self, address: str, request: Any) -> Any:
        """Send the DecideRequest ``request`` to the coordinator at ``address``; the
        DecideReply (deadline: its long poll + 10 s)."""
        return self.coordinator(address).Decide(
            request, metadata=self.md, timeout=request.wait_ms / 1000 + 10
        )

    def barrier(
        self,
        address: str,
        bad: Iterable[CopyId] = (),
        wait_s: float | None = None,
        **fields: Any,
    ) -> Any:
        """The BarrierReply (fields of BarrierRequest), after a long poll of ``wait_s``
        seconds at most (None: :data:`POLL_MS`) while the phase waits."""
        return self.barrier_call(address, barrier_request(bad, wait_s, **fields))

    def barrier_call(self, address: str, request: Any) -> Any:
        """Send the BarrierRequest ``request`` to the coordinator at ``address``; the
        BarrierReply (deadline: its long poll + 10 s)."""
        return self.coordinator(address).Barrier(
            request, metadata=self.md, timeout=request.wait_ms / 1000 + 10
        )

    def sync(
        self,
        address: str,
        job: str,
        rank: int,
        incarnation: str,
        step: int,
        inventory: Iterable[Holding],
        backup: Outcome | None = None,
        data_parallelism: int | None = None,
        want_peers: Iterable[int] | None = None,
        view_steps: Iterable[tuple[int, int]] = (),
        parts_epoch: str = "",
    ) -> Any:
        """Heartbeat and sync report (with the last backup outcome and the job's
        ``assume-data-parallelism``); returns the SyncReply. ``want_peers``: the
        ranks whose addresses the reply lists (a compact reply); None: every member.
        ``view_steps``: (step, parts version) of the steps the whole-step view shows,
        known at ``parts_epoch`` (the reply's ``part_changes``)."""
        req = sync_request(
            job,
            rank,
            incarnation,
            step,
            inventory,
            backup,
            data_parallelism,
            want_peers,
            view_steps,
            parts_epoch,
        )
        return self.sync_call(address, req)

    def sync_call(self, address: str, request: Any) -> Any:
        """Send the SyncRequest ``request`` to the coordinator at ``address``; the SyncReply."""
        return self.coordinator(address).Sync(request, metadata=self.md, timeout=10)

    def relay(self, leader: str, coord: str, request: Any, timeout: float) -> Any:
        """Send the SyncRequest ``request`` through the group leader at ``leader`` (its
        ``SyncRelay`` service) to the coordinator at ``coord``; the member's SyncReply.

        Raises:
            grpc.RpcError: the leader did not answer within ``timeout`` seconds, or
                could not reach the coordinator (UNAVAILABLE): sync directly.
        """
        stub = peer_pb2_grpc.SyncRelayStub(self.channel(leader))
        req = peer_pb2.RelayRequest(coordinator=coord, sync=request)
        return stub.Relay(req, metadata=self.md, timeout=timeout)

    def relay_decide(self, leader: str, coord: str, request: Any, timeout: float) -> Any:
        """Send the DecideRequest ``request`` through the group leader at ``leader`` to
        the coordinator at ``coord``; the member's DecideReply.

        Raises:
            grpc.RpcError: as :meth:`relay`: call the coordinator directly.
        """
        stub = peer_pb2_grpc.SyncRelayStub(self.channel(leader))
        req = peer_pb2.RelayDecideRequest(coordinator=coord, decide=request)
        return stub.RelayDecide(req, metadata=self.md, timeout=timeout)

    def relay_barrier(self, leader: str, coord: str, request: Any, timeout: float) -> Any:
        """Send the BarrierRequest ``request`` through the group leader at ``leader`` to
        the coordinator at ``coord``; the member's BarrierReply.

        Raises:
            grpc.RpcError: as :meth:`relay`: call the coordinator directly.
        """
        stub = peer_pb2_grpc.SyncRelayStub(self.channel(leader))
        req = peer_pb2.RelayBarrierRequest(coordinator=coord, barrier=request)
        return stub.RelayBarrier(req, metadata=self.md, timeout=timeout)


def decide_request(job: str, rank: int, restore_id: str, wait_s: float | None = None) -> Any:
    """The DecideRequest of :meth:`PeerClient.decide` (a long poll of ``wait_s`` seconds
    at most; None: :data:`POLL_MS`), sent directly or through a leader."""
    return peer_pb2.DecideRequest(
        job=job, rank=rank, restore_id=restore_id, wait_ms=_poll_ms(wait_s)
    )


def barrier_request(bad: Iterable[CopyId] = (), wait_s: float | None = None, **fields: Any) -> Any:
    """The BarrierRequest of :meth:`PeerClient.barrier` (fields of BarrierRequest)."""
    return peer_pb2.BarrierRequest(
        bad=[
            peer_pb2.BadCopy(holder=h, rank=r, step=s)
            if isinstance(h, int)
            else peer_pb2.BadCopy(holder=-1, rank=r, step=s, round=h)
            for h, r, s in bad
        ],
        wait_ms=_poll_ms(wait_s),
        **fields,
    )


def sync_request(
    job: str,
    rank: int,
    incarnation: str,
    step: int,
    inventory: Iterable[Holding],
    backup: Outcome | None = None,
    data_parallelism: int | None = None,
    want_peers: Iterable[int] | None = None,
    view_steps: Iterable[tuple[int, int]] = (),
    parts_epoch: str = "",
    gone_tag: str = "",
    saving: Iterable[str] = (),
) -> Any:
    """The SyncRequest of :meth:`PeerClient.sync` (sent directly or through a leader);
    ``gone_tag``: the tag of the gone ranks this node knows (the reply leaves them out
    while they are unchanged); ``saving``: the step directories this node is saving."""
    req = peer_pb2.SyncRequest(
        job=job,
        rank=rank,
        incarnation=incarnation,
        step=step,
        inventory=[peer_wire.held_shard(h) for h in inventory],
        data_parallelism=data_parallelism or 0,
        want_peers=list(want_peers or ()),
        compact=want_peers is not None,
        view_steps=[peer_pb2.ViewStep(step=s, version=v) for s, v in view_steps],
        parts_epoch=parts_epoch,
        gone_tag=gone_tag,
        saving=list(saving),
    )
    if backup is not None:
        req.backup.CopyFrom(
            peer_pb2.BackupOutcome(
                round=backup.round,
                step=backup.step,
                state=backup.state,
                error=backup.error,
                bytes=backup.bytes,
                seconds=backup.seconds,
                digest=backup.digest,
            )
        )
    return req


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (``os.pwrite`` may write less)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _result_unless_cancelled(fut: Any, cancel: threading.Event) -> Any:
    """The result of the gRPC future ``fut``, looking at ``cancel`` every 0.25 s.

    Raises:
        Cancelled: ``cancel`` was set (the call is cancelled). grpc.RpcError: as the
            call failed.
    """
    while True:
        try:
            return fut.result(timeout=0.25)
        except grpc.FutureTimeoutError:
            if cancel.is_set():
                fut.cancel()
                raise Cancelled("transfer cancelled") from None


def _chunk_at(offset: int) -> str:
    """``chunk K (offset N)`` as the manifest checks name a chunk (the wire's chunks
    are the manifest's :data:`tierfs.replication.transfer.CHUNK` bytes)."""
    return f"chunk {offset // CHUNK} (offset {offset})"


def insecure_channel(address: str) -> grpc.Channel:
    """A plain gRPC channel to ``address`` with the peer plane's channel options (the
    peer token travels in the call metadata)."""
    return grpc.insecure_channel(address, options=list(peer_wire.CHANNEL_OPTIONS))


def _poll_ms(wait_s: float | None) -> int:
    if wait_s is None:
        return POLL_MS
    return max(0, min(POLL_MS, int(wait_s * 1000)))


def rpc_reason(exc: BaseException) -> str:
    """A short one-line reason for a failed call."""
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else ""
        name = code.name if code is not None else "ERROR"
        return f"{name}: {details}" if details else name
    return str(exc) or type(exc).__name__


def rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a failed gRPC call, or None for any other exception."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code()
    return None
