"""The server side of the peer plane: the ``tierfs.peer.v1.Peer`` service (gRPC threads).

DESIGN.md "Peer plane". :class:`PeerServicer` answers inventories, receives
pushed replicas into ``store/incoming``
(:class:`tierfs.replication.transfer.ShardReceiver`) and streams sealed
snapshots to pullers (whole, only their manifest, or only some files of them:
``PullRequest.paths``, one file a whole-step view reads, issue #14). It
reaches the agent only through a :class:`PeerHost`
(:class:`tierfs.replication.holdings.Holdings`), whose calls hop onto the trio thread
with ``trio.from_thread.run_sync`` (cheap dictionary work only). The
``tierfs.peer.v1.Coordinator`` service beside it is
:class:`tierfs.cluster.coordinator.CoordinatorServicer`; both are registered by
:meth:`tierfs.replication.peer.PeerTier.run`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from tierfs.core.errors import ClusterError
from tierfs.core.types import Holding
from tierfs.replication.lane import Grant, LaneServer
from tierfs.replication.transfer import (
    CHUNK,
    REPLICATION_NICE,
    BadCopy,
    Cancelled,
    Refused,
    ShardReceiver,
    TransferError,
    check_identity,
    identical_content,
    iter_chunks,
    link_copy,
    parse_manifest,
    set_thread_nice,
)
from tierfs.rpc import peer_pb2
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.wire import WireStats
from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.shards import Shard, ShardKey

log = logging.getLogger(__name__)

_JOB_RE = re.compile(r"^[^/\0]+$")


# ---------------------------------------------------------------------- host


#: how a PullShard refused for a part its node's client is writing again begins its
#: details (:meth:`PeerHost.resaving`)
RESAVING = "being saved again"


class PeerHost:
    """What the servicer may ask of its node; every method is safe from any thread.

    Implemented by :class:`tierfs.replication.holdings.Holdings` (hops onto the trio
    thread); tests may provide their own.
    """

    ram: Any
    shards: Any
    stats: WireStats
    incarnation: str

    def own_rank(self, job: str) -> int | None:
        """This node's rank in ``job``, or None if it runs another job."""
        raise NotImplementedError

    def inventory(self, job: str) -> list[Holding]:
        """Every shard of ``job`` held here."""
        raise NotImplementedError

    def find(self, key: ShardKey) -> Shard | None:
        """The committed shard ``key`` or None."""
        raise NotImplementedError

    def find_digest(self, job: str, digest: str) -> tuple[Shard, bool] | None:
        """A shard of ``job`` with this manifest digest and whether it is trusted."""
        raise NotImplementedError

    def adopt(self, shard: Shard, linked_from: ShardKey | None = None) -> None:
        """Register a committed replica (``linked_from``: its files are hard links of that)."""
        raise NotImplementedError

    def pin(self, key: ShardKey, delta: int) -> None:
        """Pin (+1) or unpin (-1) a shard against retention."""
        raise NotImplementedError

    def check_space(self, nbytes: int) -> None:
        """Raise ``OSError(ENOSPC)`` if ``nbytes`` more do not fit the RAM budget."""
        raise NotImplementedError

    def known_manifest(self, key: ShardKey) -> Manifest | None:
        """Another node's manifest of its part ``key`` this node was told, if kept (a
        relay for nodes that cannot reach that node; any thread)."""
        return None

    def resaving(self, key: ShardKey) -> bool:
        """True while this node's own part ``key`` is withdrawn because its client
        writes the step again (its next seal is to come); any thread."""
        return False

    def damaged(self, key: ShardKey, path: str) -> None:
        """A chunk of file ``path`` of the copy of ``key`` held here was read for a pull
        with other bytes than its manifest's crc32c: check that copy now (any thread;
        never raises, never blocks on the check)."""


class HostGone(ClusterError):
    """The agent's trio loop is not running (starting or stopping).

    Raised by a :class:`PeerHost` called while its node cannot answer; the
    servicer then answers UNAVAILABLE.
    """


class Superseded(ClusterError):
    """This node holds a later save of the pushed part's step (:func:`later_save_held`):
    the push is refused with ``ALREADY_EXISTS``."""


def later_save_held(held: Manifest, incoming: Manifest) -> bool:
    """Whether a copy ``held`` here of the same (job, rank, step) as ``incoming`` is of
    a later save of that step (pure): then ``incoming`` must not replace it.

    * ``held`` lists ``incoming``'s bytes as a part it replaced
      (:attr:`Manifest.replaces`: a seal records the node's own former part of the
      step) and ``incoming`` does not list ``held``'s; when each lists the other
      (a rank that saved identical bytes again), the later seal wins (one writer's
      clock: ``sealed``, else ``created``; Unix seconds).
    * Or both were written by known, different node counts and ``held`` was sealed
      later (the writers' clocks).

    Regressions: (#16 fifth trial F8) renumbered again, the node that was rank 2 of
    a 4-node save of step 20 became rank 2 of a 3-node job and pushed that old part
    to node 0, replacing node 0's replica of the 3-node save's rank 2: its view then
    showed the older part. (#14 trial 65) a step saved three times in a row: the
    pull of rank 1's second save ended after the pull of its third and replaced
    it, so node 0 held an earlier save than rank 1's node."""
    if held.digest == incoming.digest:
        return False
    later = (held.sealed or held.created) > (incoming.sealed or incoming.created)
    if (incoming.rank, incoming.digest) in held.replaces:
        return (held.rank, held.digest) not in incoming.replaces or later
    return held.nodes > 0 and incoming.nodes > 0 and held.nodes != incoming.nodes and later


def _valid_job(job: str) -> bool:
    return bool(_JOB_RE.match(job)) and job not in (".", "..")


# ---------------------------------------------------------------------- servicer


class PeerServicer:
    """The ``tierfs.peer.v1.Peer`` service (gRPC threads).

    Args:
        host: the node (see :class:`PeerHost`).
    """

    def __init__(
        self, host: PeerHost, lane: LaneServer | None = None, puller: Any | None = None
    ) -> None:
        self.host = host
        #: the data lane offered to pulls that ask for it (None: gRPC only)
        self.lane = lane
        #: pulls a replica a Replicate call hands over (a
        #: :class:`tierfs.replication.client.PeerClient`; None: Replicate is
        #: UNIMPLEMENTED here and senders push)
        self.puller = puller

    def Inventory(self, request: Any, context: Any) -> Any:
        """What this node holds of ``request.job``; optionally wait (dedup decision)."""
        deadline = time.monotonic() + min(max(request.wait_ms, 0), 5000) / 1000.0
        own = self.host.own_rank(request.job)
        while True:
            held = self.host.inventory(request.job)
            if not request.want_digest or request.wait_ms <= 0:
                break
            if any(h.digest == request.want_digest for h in held):
                break
            if (
                own is not None
                and request.wait_step >= 0
                and any(h.rank == own and h.step == request.wait_step for h in held)
            ):
                break
            if time.monotonic() >= deadline or not context.is_active():
                break
            time.sleep(0.1)
        return peer_pb2.InventoryReply(
            node_rank=-1 if own is None else own,
            incarnation=self.host.incarnation,
            shards=[peer_wire.held_shard(h) for h in held],
        )

    def PushShard(self, request_iterator: Any, context: Any) -> Any:
        """Receive a replica: header, chunks, manifest last; commit only if all checks pass."""
        it = iter(request_iterator)
        first = next(it, None)
        if first is None or peer_wire.kind_of(first) != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PushShard must start with a header")
        h = first.header
        key = self._replica_key(h, context)
        code, detail = None, ""
        inc = None
        old_nice = set_thread_nice(REPLICATION_NICE)
        try:
            if not h.dedup:
                self.host.check_space(h.total_bytes)
            inc = self.host.ram.new_incoming(f"peer-{h.rank}-{h.step}")
            if h.dedup:
                return self._dedup(h, key, it, inc)
            rx = ShardReceiver(inc)
            manifest = None
            for msg in it:
                kind = peer_wire.kind_of(msg)
                if kind == "chunk":
                    c = peer_wire.as_chunk(msg)
                    rx.chunk(c.path, c.offset, c.data, c.crc32c)
                    self.host.stats.add("received_bytes", len(c.data))
                elif kind == "manifest":
                    manifest = parse_manifest(msg.manifest.json)
                    break
                else:
                    raise Refused(f"unexpected {kind} message")
            if manifest is None:
                rx.abort()
                inc = None
                return peer_pb2.PushReply(
                    committed=False,
                    bytes_received=rx.bytes_received,
                    detail="stream ended without a manifest",
                )
            check_identity(manifest, key, h.digest)
            self._not_superseded(key, manifest)
            rx.finish(manifest)
            shard = self.host.shards.commit(inc, manifest, verified=True)
            inc = None
            self.host.adopt(shard)
            self.host.stats.add("pushes_received")
            log.info(
                "received step %d of rank %d from node-rank %d (%d bytes)",
                h.step,
                h.rank,
                h.sender_rank,
                rx.bytes_received,
            )
            return peer_pb2.PushReply(committed=True, bytes_received=rx.bytes_received)
        except (BadCopy, Refused, Superseded, OSError, HostGone) as exc:
            code, detail = self._refusal(h, exc)
        except grpc.RpcError:
            code, detail = grpc.StatusCode.CANCELLED, "sender went away"
        finally:
            if inc is not None:
                shutil.rmtree(inc, ignore_errors=True)
            if old_nice is not None:
                set_thread_nice(old_nice)
        # a later save held here is no fault of either node
        level = logging.INFO if code == grpc.StatusCode.ALREADY_EXISTS else logging.WARNING
        log.log(level, "refused a replica from node-rank %d: %s", h.sender_rank, detail)
        context.abort(code, detail)

    def Replicate(self, request: Any, context: Any) -> Any:
        """Take a replica by pulling it from its sender (``request.pull_from``, over the
        sender's data lane when it offers one): the header is checked as for
        :meth:`PushShard`, every crc32c as for any pull, and the copy is committed
        only if all pass and no later save of that step by another node count is
        held here. Answers a :class:`PushReply` (committed), or aborts with the
        codes of :meth:`PushShard`; UNAVAILABLE when the sender cannot be
        reached or its stream broke, CANCELLED when the sender gave up,
        UNIMPLEMENTED on a node without a puller."""
        h = request.header
        if self.puller is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node takes replicas by push")
        key = self._replica_key(h, context)
        if h.dedup or not request.pull_from:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "Replicate needs pull_from and no dedup"
            )
        own = self.host.own_rank(h.job)
        old_nice = set_thread_nice(REPLICATION_NICE)
        try:
            self.host.check_space(h.total_bytes)
            shard = self.puller.pull(
                request.pull_from,
                key,
                h.digest,
                own if own is not None else -1,
                self.host.ram,
                self.host.shards,
                _CallGone(context),
                before_commit=lambda m: self._not_superseded(key, m),
            )
            self.host.adopt(shard)
            got = shard.manifest.total_bytes
            self.host.stats.add("received_bytes", got)
            self.host.stats.add("pushes_received")
            log.info(
                "received step %d of rank %d from node-rank %d (%d bytes, pulled)",
                h.step,
                h.rank,
                h.sender_rank,
                got,
            )
            return peer_pb2.PushReply(committed=True, bytes_received=got)
        except (BadCopy, Refused, Superseded, OSError, HostGone) as exc:
            code, detail = self._refusal(h, exc)
        except Cancelled:
            code, detail = grpc.StatusCode.CANCELLED, "sender went away"
        except (TransferError, grpc.RpcError) as exc:
            code = grpc.StatusCode.UNAVAILABLE
            detail = f"pulling step {h.step} of rank {h.rank} from {request.pull_from}: " + (
                rpc_text(exc)
            )
        finally:
            if old_nice is not None:
                set_thread_nice(old_nice)
        # a later save held here is no fault of either node
        level = logging.INFO if code == grpc.StatusCode.ALREADY_EXISTS else logging.WARNING
        log.log(level, "refused a replica from node-rank %d: %s", h.sender_rank, detail)
        context.abort(code, detail)

    def _replica_key(self, h: Any, context: Any) -> ShardKey:
        """The key of the replica header ``h`` names; aborts INVALID_ARGUMENT for a bad
        identity, FAILED_PRECONDITION for this node's own rank."""
        if not _valid_job(h.job) or h.rank < 0 or h.step < 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad shard identity job={h.job!r} rank={h.rank} step={h.step}",
            )
        if self.host.own_rank(h.job) == h.rank:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node-rank {h.rank} does not take replicas of its own rank",
            )
        return ShardKey(h.job, h.rank, h.step)

    def _refusal(self, h: Any, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status code and detail a refused replica is answered with (counted)."""
        if isinstance(exc, BadCopy):
            self.host.stats.add("corrupt_copies")
            return grpc.StatusCode.DATA_LOSS, f"step {h.step} of rank {h.rank}: {exc}"
        if isinstance(exc, Refused):
            self.host.stats.add("refused")
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if isinstance(exc, Superseded):
            self.host.stats.add("refused")
            return grpc.StatusCode.ALREADY_EXISTS, str(exc)
        if isinstance(exc, HostGone):
            return grpc.StatusCode.UNAVAILABLE, "daemon is stopping"
        assert isinstance(exc, OSError)
        code = (
            grpc.StatusCode.RESOURCE_EXHAUSTED
            if exc.errno == errno.ENOSPC
            else grpc.StatusCode.INTERNAL
        )
        return code, f"step {h.step} of rank {h.rank}: {exc.strerror or exc}"

    def _not_superseded(self, key: ShardKey, manifest: Manifest) -> None:
        """Raise :class:`Superseded` if the copy of ``key`` held here is of a later save
        than ``manifest`` (:func:`later_save_held`)."""
        held = self.host.find(key)
        if held is not None and later_save_held(held.manifest, manifest):
            raise Superseded(
                f"step {key.step} of rank {key.rank}: this node holds a later save of it "
                f"({held.manifest.digest[:12]}, by {held.manifest.nodes} nodes) than this "
                f"copy ({manifest.digest[:12]}, by {manifest.nodes})"
            )

    def _dedup(self, h: Any, key: ShardKey, it: Any, inc: str) -> Any:
        msg = next(it, None)
        if msg is None or peer_wire.kind_of(msg) != "manifest":
            raise Refused("a manifest-only push must carry the manifest")
        manifest = parse_manifest(msg.manifest.json)
        check_identity(manifest, key, h.digest)
        self._not_superseded(key, manifest)
        found = self.host.find_digest(h.job, h.digest)
        if found is None:
            shutil.rmtree(inc, ignore_errors=True)
            return peer_pb2.PushReply(committed=False, detail="no local copy with that digest")
        src, trusted = found
        if not identical_content(src.manifest, manifest):
            # equal digests, other files: only what the checksums prove is linked
            log.warning(
                "manifest-only push of step %d of rank %d from node-rank %d: the "
                "local copy with digest %s (%s) lists other files; asking for the "
                "data",
                h.step,
                h.rank,
                h.sender_rank,
                h.digest,
                src.key,
            )
            shutil.rmtree(inc, ignore_errors=True)
            return peer_pb2.PushReply(
                committed=False, detail="no local copy with identical checksums"
            )
        try:
            link_copy(src.data, inc)
        except OSError:
            shutil.rmtree(inc, ignore_errors=True)
            return peer_pb2.PushReply(committed=False, detail="no local copy with that digest")
        shard = self.host.shards.commit(
            inc, manifest, verified=src.verified or trusted, checked_at=src.checked_at
        )
        self.host.adopt(shard, linked_from=src.key)
        self.host.stats.add("manifest_only_received")
        self.host.stats.add("pushes_received")
        log.info(
            "received step %d of rank %d from node-rank %d as a manifest (identical to %s)",
            h.step,
            h.rank,
            h.sender_rank,
            src.key,
        )
        return peer_pb2.PushReply(committed=True, deduped=True)

    def PullShard(self, request: Any, context: Any) -> Any:
        """Stream a sealed shard: its manifest, then every file's chunks (only the
        manifest when ``request.manifest_only``; only the chunks of the files
        ``request.paths`` names, in manifest order, when it names any).

        With ``request.trim_manifest`` (and ``paths``) the manifest sent lists only
        those files and ``ShardManifest.digest`` carries the whole manifest's digest;
        with ``manifest_only`` and no ``paths`` it lists no file (the digest answers
        which part is held, whatever the part's size).

        A ``manifest_only`` request for a part not held here is answered with the
        manifest its node sent this one, if kept (:meth:`PeerHost.known_manifest`).

        Aborts (before any message): UNAVAILABLE while the daemon stops;
        FAILED_PRECONDITION for this node's own part while its client writes the
        step again (:meth:`PeerHost.resaving`); NOT_FOUND without a copy of the
        shard, or for a path of ``request.paths`` the
        manifest does not list as a file (the details name it);
        FAILED_PRECONDITION for a copy with another digest than ``request.digest``.
        """
        key = ShardKey(request.job, request.rank, request.step)
        resaving = False
        try:
            shard = self.host.find(key)
            if shard is None:
                resaving = self.host.resaving(key)
                if not resaving:
                    # sealed between the two questions (its withdraw ends as the seal
                    # adds the part: trial 61 saw NOT_FOUND 9 ms after a re-seal)
                    shard = self.host.find(key)
        except HostGone:
            context.abort(grpc.StatusCode.UNAVAILABLE, "daemon is stopping")
        if shard is None:
            if resaving:
                # the earlier part's copies elsewhere are of the save before: a
                # fetcher must not take them for this part (#14 trial 60 M1a)
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{RESAVING}: the part {key} here is being saved again (its seal is to come)",
                )
            relayed = self.host.known_manifest(key) if request.manifest_only else None
            if relayed is not None:
                # only the manifest, as its node sent it here (the whole-step view of
                # a node that cannot reach that node; its bytes are checked on read)
                yield peer_pb2.PullMessage(
                    manifest=peer_pb2.ShardManifest(json=relayed.to_json())
                ).SerializeToString()
                return
            context.abort(grpc.StatusCode.NOT_FOUND, f"no copy of {key} here")
        if request.digest and _index(shard.manifest).digest != request.digest:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the copy of {key} here has digest {shard.manifest.digest}, not {request.digest}",
            )
        files = shard.manifest.files
        if request.paths:
            files, unknown = _only_files(shard.manifest, request.paths)
            if unknown is not None:
                context.abort(
                    grpc.StatusCode.NOT_FOUND, f"{unknown!r} is not a file of the copy of {key}"
                )
        self.host.pin(key, +1)
        sent = 0
        failed = None
        handed = False  # the pin went with a data lane grant (released by it)
        check = _ChunkCheck(shard.manifest)
        try:
            if request.trim_manifest and (request.paths or request.manifest_only):
                # only the entries of the files sent (none for a manifest-only question:
                # which part is held), and the whole manifest's digest
                trimmed = dataclasses.replace(shard.manifest, files=files if request.paths else ())
                head = peer_pb2.ShardManifest(
                    json=trimmed.to_json(), digest=_index(shard.manifest).digest
                )
            else:
                head = peer_pb2.ShardManifest(json=shard.manifest.to_json())
            if request.lane and not request.manifest_only and self.lane:
                ticket = self.lane.offer(self._grant(key, shard, files))
                if ticket is not None:
                    head.lane_port, head.lane_ticket = self.lane.port, ticket
                    handed = True
                    yield peer_pb2.PullMessage(manifest=head).SerializeToString()
                    return
            yield peer_pb2.PullMessage(manifest=head).SerializeToString()
            if request.manifest_only:
                return
            for path, off, data, crc in iter_chunks(
                shard.data, files, cancelled=lambda: not context.is_active()
            ):
                if check.wrong(path, off, crc):
                    log.warning("serving %s of %s: a chunk at %d is damaged here", path, key, off)
                yield peer_wire.encode_chunk(path, off, data, crc)  # a PullMessage
                sent += len(data)
            self.host.stats.add("pulls_served")
        except (OSError, Cancelled) as exc:
            failed = f"the copy of {key} vanished while being sent: {exc}"
        finally:
            if not handed:
                self._served(key, sent, check.damaged)
        if failed:
            context.abort(grpc.StatusCode.NOT_FOUND, failed)

    def _grant(self, key: ShardKey, shard: Shard, files: Sequence[FileEntry]) -> Grant:
        """A data lane grant for ``files`` of ``shard`` (pinned by the caller; the
        grant's release unpins it)."""
        files = [f for f in files if f.kind == "file"]
        crcs: list[tuple[int, ...] | None] = []
        for entry in files:
            found = shard.manifest.chunks_of(entry)
            crcs.append(found[1] if found is not None and found[0] == CHUNK else None)

        def release(damaged: str, sent: int) -> None:
            if sent:
                self.host.stats.add("pulls_served")
                self.host.stats.add("lane_served")
                self.host.stats.add("lane_served_bytes", sent)
            self._served(key, sent, damaged)

        return Grant(shard.data, files, crcs, release)

    def _served(self, key: ShardKey, sent: int, damaged: str) -> None:
        """A pull of ``key`` ended (``sent`` bytes; ``damaged``: a file whose bytes
        failed a check, "" none): count it, unpin, have a damaged copy checked."""
        self.host.stats.add("served_bytes", sent)
        try:
            self.host.pin(key, -1)
        except HostGone:
            pass
        if damaged:
            # the puller refused those bytes (its own check) and reads another copy;
            # this node checks its copy now, once the stream is over, so the puller
            # sees the damage, not the copy vanishing under it (ninth trial FAIL 13:
            # only the puller knew, and a restore used the copy "from local")
            try:
                self.host.damaged(key, damaged)
            except Exception:
                log.exception("reporting the damaged copy of %s", key)


class _CallGone:
    """``is_set()`` of a pull's cancel event: the call was cancelled or timed out."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def is_set(self) -> bool:
        return not self.context.is_active()


def rpc_text(exc: BaseException) -> str:
    """One line for a failed pull: the gRPC status and details, else the message."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


class _ChunkCheck:
    """Compares the crc32c of each chunk a pull sends with the manifest's per-chunk
    crc32c (:meth:`tierfs.store.manifest.Manifest.chunks_of`), where the manifest has
    them and its chunks are the wire's (:data:`CHUNK`): no byte is read twice."""

    def __init__(self, manifest: Manifest) -> None:
        self.entries = _index(manifest).entries
        self.manifest = manifest
        self.path = ""
        self.chunks: tuple[int, ...] | None = None
        self.said = False
        #: the file of the first damaged chunk ("" none)
        self.damaged = ""

    def wrong(self, path: str, offset: int, crc: int) -> bool:
        """True the first time a chunk of the pull (``path`` at ``offset`` bytes, its
        crc32c ``crc``) differs from the manifest."""
        if path != self.path:
            self.path, self.chunks = path, None
            entry = self.entries.get(path)
            found = self.manifest.chunks_of(entry) if entry is not None else None
            if found is not None and found[0] == CHUNK:
                self.chunks = found[1]
        if self.said or self.chunks is None or offset % CHUNK:
            return False
        k = offset // CHUNK
        if k < len(self.chunks) and self.chunks[k] != crc:
            self.said, self.damaged = True, path
            return True
        return False


@dataclasses.dataclass(frozen=True)
class _Index:
    """What a file pull needs of a manifest, computed once per manifest (a 10,000-file
    part's digest and path lookup would otherwise be rebuilt for every file pulled)."""

    manifest: Manifest
    digest: str
    entries: dict[str, FileEntry]


#: manifests indexed lately, by ``id`` (the index holds the manifest: the id stays its)
_INDEXES: dict[int, _Index] = {}
_INDEXES_LOCK = threading.Lock()
#: manifests kept indexed (the oldest is forgotten first)
INDEXES_KEPT = 64


def _index(manifest: Manifest) -> _Index:
    """``manifest``'s :class:`_Index` (cached; any thread)."""
    with _INDEXES_LOCK:
        found = _INDEXES.get(id(manifest))
    if found is not None and found.manifest is manifest:
        return found
    made = _Index(manifest, manifest.digest, {f.path: f for f in manifest.files})
    with _INDEXES_LOCK:
        _INDEXES[id(manifest)] = made
        while len(_INDEXES) > INDEXES_KEPT:
            del _INDEXES[next(iter(_INDEXES))]
    return made


def _only_files(
    manifest: Manifest, paths: Iterable[str]
) -> tuple[tuple[FileEntry, ...], str | None]:
    """The entries of ``manifest`` that ``paths`` names, in manifest order, and the first
    path that is not a file of it (None if every one is)."""
    entries = _index(manifest).entries
    wanted: list[FileEntry] = []
    for path in dict.fromkeys(paths):
        entry = entries.get(path)
        if entry is None or entry.kind != "file":
            return (), path
        wanted.append(entry)
    if len(wanted) == 1:
        return tuple(wanted), None
    order = {f.path: i for i, f in enumerate(manifest.files)}
    return tuple(sorted(wanted, key=lambda f: order[f.path])), None


def peer_handlers(servicer: PeerServicer) -> grpc.GenericRpcHandler:
    """The Peer service's handlers; PullShard answers with pre-encoded ``bytes`` messages."""
    return grpc.method_handlers_generic_handler(
        "tierfs.peer.v1.Peer",
        {
            "Inventory": grpc.unary_unary_rpc_method_handler(
                servicer.Inventory,
                request_deserializer=peer_pb2.InventoryRequest.FromString,
                response_serializer=peer_wire.serialize,
            ),
            "PushShard": grpc.stream_unary_rpc_method_handler(
                servicer.PushShard,
                request_deserializer=peer_wire.chunk_deserializer(peer_pb2.PushMessage),
                response_serializer=peer_wire.serialize,
            ),
            "PullShard": grpc.unary_stream_rpc_method_handler(
                servicer.PullShard,
                request_deserializer=peer_pb2.PullRequest.FromString,
                response_serializer=peer_wire.serialize,
            ),
            "Replicate": grpc.unary_unary_rpc_method_handler(
                servicer.Replicate,
                request_deserializer=peer_pb2.ReplicateRequest.FromString,
                response_serializer=peer_wire.serialize,
            ),
        },
    )
