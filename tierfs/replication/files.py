"""Other ranks' files from peers' RAM, one file at a time (issue #14, the whole-step view).

:class:`PeerFiles` is the peer tier's :class:`tierfs.core.ports.FileSource`:
which nodes may hold a rank's part (the owner, then its replica holders by the
job's placement), their addresses (asked of the coordinator when not known
yet), and one ``PullShard`` call with ``paths`` per copy tried, in the file
fetch lane's worker threads (:class:`tierfs.replication.lanes.PriorityLane`: a
reader's open before the prefetch), every chunk's and the file's crc32c checked
by the client as the bytes are written.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import trio

from tierfs.core.control import JobSpec
from tierfs.core.errors import NO_ROOM_ERRNOS, FetchFailed
from tierfs.core.ports import CurrentJob, FileTarget, PositionalWrite, Reporter
from tierfs.core.priority import fetch_hold, fetch_pause, fetch_urgent
from tierfs.replication import placement
from tierfs.replication.addresses import AddressBook
from tierfs.replication.client import PeerClient, rpc_code, rpc_reason
from tierfs.replication.lanes import PriorityLane
from tierfs.replication.transfer import BadCopy, OtherBytes, Refused
from tierfs.store.chunks import ChunkMismatch
from tierfs.store.shards import ShardKey

log = logging.getLogger(__name__)

#: how a copy whose checksum failed is named in the reasons
BAD = "bad copy"

#: the "code" of a copy whose file is not the caller's ``expect`` (:meth:`PeerFiles._pull_file`)
OTHER = "other bytes"
#: how :meth:`PeerFiles._pull_batch` begins its answer for a holder of another part
#: of the step (FAILED_PRECONDITION)
MOVED_ON = "another part held"

#: seconds a file fetch waits for the address of a holder asked for just now
ADDRESS_WAIT = 3.0
#: a nearer copy that failed only after this many seconds kept its reader waiting:
#: said in ``replicator.errors`` once another copy served (a hung holder)
SLOW_COPY = 5.0
#: seconds a background fetch (no reader waits: the prefetch after a restore) waits
#: for a holder's address it does not know (a node of the job mounting a few seconds
#: after this one: #16 twelfth trial NOTE H, a false "could not be read" line)
BACKGROUND_ADDRESS_WAIT = 30.0
#: seconds after such a wait ran out during which no fetch waits for that address
GAVE_UP_FOR = 60.0


def receivers_of(job: JobSpec, rank: int, writers: int = 0) -> list[int]:
    """The ranks receiving node ``rank``'s steps by ``job``'s placement, in preference
    order; none with explicit ``peer-ranks`` (each node's own) or an impossible one.

    ``writers``: the node count that wrote the step (issue #16; 0: ``job.nodes``):
    its placement, of which only the node ranks ``job`` still has are returned."""
    if job.peer_ranks is not None:
        return []
    try:
        ranks = placement.peer_ranks(
            rank,
            writers or job.nodes,
            peers_per_node=job.peers_per_node,
            data_parallelism=job.assume_data_parallelism,
        )
    except ValueError:
        return []
    return [r for r in ranks if r < job.nodes]


def holders_of(
    job: JobSpec, rank: int, writers: int = 0, gone: frozenset[int] = frozenset()
) -> list[int]:
    """The node ranks of ``job`` that may hold node ``rank``'s part of a step written
    by ``writers`` nodes (0: ``job.nodes``), in the order to ask them (issue #16):
    the owner while the job has that rank, the receivers of the writers' placement,
    and for a rank the job no longer has also the receivers of those receivers in
    today's placement (where they copy the lost rank's part again,
    :meth:`tierfs.replication.replicator.Replicator.catch_up`).

    ``gone``: the ranks declared gone for good, never named. When the owner or a
    receiver is gone, today's receivers of the owner and of each receiver, with
    stand-ins for the gone ones (:func:`.placement.with_stand_ins`), are named
    too: the owner sent its parts to its stand-in receiver before it was lost
    itself (regression, new-user trial: after ``nodes gone 3`` and then
    ``nodes gone 2``, rank 2's part lived on node 0 only, and the other nodes
    asked nodes 2 and 3 only: EIO on a step ``tierfs wait`` called restored)."""
    first = receivers_of(job, rank, writers)
    owner = [rank] if rank < job.nodes else []
    out = owner + first
    if rank >= job.nodes or rank in gone or any(h in gone for h in first):
        for holder in owner + first:
            today = receivers_of(job, holder)
            out += placement.with_stand_ins(today, holder, job.nodes, gone)
    return [r for r in dict.fromkeys(out) if r not in gone]


class PeerFiles:
    """Hands over single files of other ranks' parts from peers (see the module docstring).

    Args:
        book: the peers' addresses (and the ranks asked for beyond them).
        address_of: ``address_of(job, rank)``: the node's address if known, else
            None (and the next heartbeat asks for it).
        client: the calls to peers.
        lane: the file fetch lane (its own slots, urgent fetches first).
        job: the running job (its placement names the replica holders).
        reporter: ``replicator.errors`` (a damaged copy skipped for another one).
    """

    name = "peer"
    #: the bytes are checked against ``expect`` as they are written (FileSource)
    checks_written = True
    #: a copy's bytes go through fetch_file's ``write`` when given (FileSource)
    chunk_writes = True

    def __init__(
        self,
        book: AddressBook,
        address_of: Callable[[str, int], Awaitable[str | None]],
        client: PeerClient,
        lane: PriorityLane,
        job: CurrentJob,
        reporter: Reporter,
    ) -> None:
        self.reporter = reporter
        self.book = book
        self.address_of = address_of
        self.client = client
        self.lane = lane
        #: (job, rank) -> when a wait for that node's address ran out (monotonic s)
        self._gave_up: dict[tuple[str, int], float] = {}
        self.job = job

    async def fetch_file(
        self,
        job: str,
        rank: int,
        step: int,
        digest: str,
        path: str,
        fd: int,
        *,
        skip: frozenset[str] = frozenset(),
        writers: int = 0,
        expect: tuple[int, int] | None = None,
        write: PositionalWrite | None = None,
    ) -> str:
        """Write file ``path`` of node ``rank``'s part of ``step`` into ``fd`` from a
        peer's RAM (a :class:`tierfs.core.ports.FileSource`; trio thread).

        The copies, in order: node ``rank`` itself, then the nodes that receive
        its steps by the placement of the node count that wrote the step
        (``writers``, 0: the job's; :func:`receivers_of`: :func:`.placement.peer_ranks`
        with ``peers-per-node`` and ``assume-data-parallelism``; a node rank the
        job no longer has is not asked; with explicit
        ``peer-ranks`` a node knows only its own receivers, so only node
        ``rank`` is asked). This node's own copies are not (the caller reads
        its catalog). A node's address is the address book's, else, on the
        node serving the coordinator, the member's. Each copy is one
        :meth:`PeerClient.pull_file` call (every chunk's crc32c and the file's
        checked as they are written, and with ``expect`` the holder's entry
        compared with it before any byte is sent) in a worker thread of the file
        fetch lane (:attr:`lane`), writing through its own duplicate of ``fd`` (a
        cancelled fetch's abandoned thread stops at its next chunk). Copies with
        ``digest`` first; holders of other bytes of the step
        (FAILED_PRECONDITION) are asked again without it after every other
        copy failed, except node ``rank`` itself, which is asked again at once
        (with ``expect``, the file's bytes): its part is the current one (or its
        client is writing it again), so unless it serves the expected bytes the
        fetch ends there (``superseded``), never served from a copy of the
        earlier part (#14 trial 60 M1a: after two saves
        in a row a node read another node's ranks' first-save bytes from a
        replica, silently). A corrupt copy (BadCopy, or a chunk ``write`` refused:
        :class:`tierfs.store.chunks.ChunkMismatch`) or one with other bytes than
        ``expect`` only moves on to the next one.

        Returns:
            the copy that served, ``"peer node-rank R (ADDRESS)"`` (what ``skip``
            names).

        Raises:
            tierfs.core.errors.FetchFailed: no copy served; the message names every
                copy and why (``"peer node-rank 1 (10.0.0.2:7000): NOT_FOUND: ..."``).
                A write into ``fd`` that found no room (ENOSPC) ends the fetch
                at once (no copy would fit), with the ``OSError`` as its cause.
                ``other_bytes``: a holder's file was not ``expect``;
                ``superseded``: node ``rank``'s own file was not (only with ``expect``).
        """
        key = ShardKey(job, rank, step)
        tried: list[str] = []
        slow: list[str] = []  # nearer copies that failed only after SLOW_COPY seconds
        other: list[tuple[str, str]] = []  # (label, address): holders of other bytes
        others = False  # a holder's file is not ``expect``
        for r, address in await self._file_copies(job, rank, writers):
            if address is None:
                tried.append(f"peer node-rank {r}: no address known here")
                continue
            label = f"peer node-rank {r} ({address})"
            if label in skip:
                tried.append(f"{label}: skipped (it served wrong bytes before)")
                continue
            began = trio.current_time()
            failed = await self._pull_file(address, key, digest, path, fd, expect, write)
            if failed is None:
                self._say_bad(key, path, label, tried)
                self._say_slow(key, path, label, slow)
                return label
            why, code = failed
            others |= code is OTHER
            owner = r == rank and expect is not None
            if digest and code == grpc.StatusCode.FAILED_PRECONDITION and owner:
                # the part's own node sealed another part of the step since the caller's
                # manifest was read: its file, if still these bytes, is served from
                # there; if not, every other copy holds the earlier save's bytes
                again = await self._pull_file(address, key, "", path, fd, expect, write)
                if again is None:
                    self._say_bad(key, path, label, tried)
                    return label
                raise FetchFailed(
                    f"{path} of step {step} of node-rank {rank}: its node holds a newer "
                    f"part of the step ({why}; its file: {again[0]}); the copies of the "
                    "earlier part are not served",
                    superseded=True,
                )
            if digest and code == grpc.StatusCode.FAILED_PRECONDITION:
                other.append((label, address))  # it holds other bytes of the step
            tried.append(f"{label}: {why}")
            waited = trio.current_time() - began
            if waited >= SLOW_COPY and BAD not in why:
                slow.append(f"{label}: {why} (after {waited:.0f} s)")
        for label, address in other:
            failed = await self._pull_file(address, key, "", path, fd, expect, write)
            if failed is None:
                self._say_bad(key, path, label, tried)
                return label
            others |= failed[1] is OTHER
            tried.append(f"{label} (any bytes): {failed[0]}")
        raise FetchFailed(
            f"{path} of step {step} of node-rank {rank} from peers: "
            + ("; ".join(tried) or "no copy known"),
            other_bytes=others,
        )

    async def fetch_files(
        self,
        job: str,
        rank: int,
        step: int,
        digest: str,
        files: Sequence[FileTarget],
        landed: Callable[[str, str], None],
        *,
        writers: int = 0,
    ) -> None:
        """Several small files of node ``rank``'s part of ``step`` from a peer's RAM in
        one :meth:`PeerClient.pull_files` call per copy (a
        :class:`tierfs.core.ports.BatchFileSource`; trio thread).

        The copies are :meth:`fetch_file`'s, in its order, with ``digest`` only;
        each copy is asked for the files not landed yet, in one slot of the file
        fetch lane. When node ``rank`` itself holds another part of the step
        (FAILED_PRECONDITION), no further copy is asked: they hold the earlier part
        (#14 trial 60 M1a), and the caller's :meth:`fetch_file` of each file left
        asks that node for the file's bytes.
        caller fetches what did not land on its own, which reports), except a copy
        with wrong bytes when a farther copy then served files: one line in
        ``replicator.errors`` as :meth:`fetch_file` writes it.

        Raises:
            tierfs.core.errors.FetchFailed: a write found no room (ENOSPC...).
        """
        key = ShardKey(job, rank, step)
        left = {f.path: f for f in files}
        bad: list[str] = []  # nearer copies that served wrong bytes
        for r, address in await self._file_copies(job, rank, writers):
            if not left or address is None:
                continue
            label = f"peer node-rank {r} ({address})"
            before = len(left)
            why = await self._pull_batch(address, key, digest, left, landed, label)
            if bad and len(left) < before:
                # as fetch_file says it: the files were read, a nearer copy is damaged
                self.reporter.error(
                    f"step {step}: {before - len(left)} of rank {rank}'s files were read "
                    f"from {label}; a nearer copy is damaged: {'; '.join(bad)}"
                )
            if why is not None and why.startswith(BAD):
                bad.append(f"{label}: {why}")
            if r == rank and why is not None and why.startswith(MOVED_ON):
                # the part's own node holds a newer part: the other copies are of the
                # earlier one; the caller fetches what is left file by file, which
                # asks that node for each file's bytes (fetch_file, trial 60 M1a)
                return

    def _hold(self) -> Callable[[], bool]:
        """The pause of a transfer: the caller's (a prefetch gives way to readers),
        except while an urgent fetch waits for a lane slot: then the paused transfer
        goes on and frees its slot (else that reader would wait for a slot held by
        a transfer waiting for readers); and whenever the caller's
        :data:`tierfs.core.priority.fetch_pause` says so (room for this node's save)."""
        caller = fetch_hold.get()
        pause = fetch_pause.get()
        lane = self.lane
        return lambda: pause() or (caller() and not lane.urgent_waiting())

    async def _pull_batch(
        self,
        address: str,
        key: ShardKey,
        digest: str,
        left: dict[str, FileTarget],
        landed: Callable[[str, str], None],
        label: str,
    ) -> str | None:
        """One copy's :meth:`PeerClient.pull_files` of the files in ``left`` (those that
        land are taken out of it) in one slot of the file fetch lane: None when the
        call ended well, else why not (logged; :data:`BAD` first for wrong bytes).

        Raises:
            FetchFailed: a write found no room (ENOSPC, EDQUOT, EFBIG).
        """

        def one(path: str) -> None:
            left.pop(path, None)
            landed(path, label)

        batch = list(left.values())
        cancel = threading.Event()
        hold = self._hold()

        def pull() -> set[str]:
            return self.client.pull_files(address, key, digest, batch, cancel, one, hold=hold)

        try:
            async with self.lane.slot():
                await trio.to_thread.run_sync(pull, abandon_on_cancel=True)
            return None
        except (BadCopy, ChunkMismatch) as exc:
            why = f"{BAD}: {exc}"
        except OSError as exc:
            if exc.errno in NO_ROOM_ERRNOS:
                raise FetchFailed(
                    f"{len(batch)} files of step {key.step} of node-rank {key.rank}: no "
                    f"room for them here ({exc.strerror or exc})"
                ) from exc
            why = str(exc)
        except grpc.RpcError as exc:
            why = rpc_reason(exc)
            if rpc_code(exc) == grpc.StatusCode.FAILED_PRECONDITION:
                why = f"{MOVED_ON}: {why}"
        except Exception as exc:  # Refused, OtherBytes...: the next copy
            why = f"{type(exc).__name__}: {exc}"
        finally:
            cancel.set()
        log.info("%d files of %s from %s: %s", len(batch), key, address, why)
        return why

    def _say_slow(self, key: ShardKey, path: str, label: str, slow: list[str]) -> None:
        """Nearer copies failed only after :data:`SLOW_COPY` seconds or more (a hung or
        vanished holder), so the read waited that long: one line in
        ``replicator.errors`` naming them, although another copy served (#14 trial
        49 F6: a stopped holder held reads 77 s, and nothing said why)."""
        if slow:
            self.reporter.error(
                f"step {key.step}: rank {key.rank}'s {path} was read from {label}; a "
                f"nearer copy kept the read waiting: {'; '.join(slow)}"
            )

    def _say_bad(self, key: ShardKey, path: str, label: str, tried: list[str]) -> None:
        """A nearer copy served wrong bytes (a checksum failed): one line in
        ``replicator.errors`` naming it, although another copy served."""
        bad = [t for t in tried if BAD in t]
        if bad:
            self.reporter.error(
                f"step {key.step}: rank {key.rank}'s {path} was read from {label}; "
                f"a nearer copy is damaged: {'; '.join(bad)}"
            )

    async def _file_copies(
        self, job: str, rank: int, writers: int = 0
    ) -> list[tuple[int, str | None]]:
        """(rank, address or None) of every node that may hold node ``rank``'s part of
        ``job``, owner first (see :meth:`fetch_file`)."""
        spec = self.job.job
        ranks = [rank]
        if spec is not None and spec.name == job:
            ranks = holders_of(spec, rank, writers, frozenset(self.book.gone))
        me = spec.node_rank if spec is not None and spec.name == job else None
        out: list[tuple[int, str | None]] = []
        for r in dict.fromkeys(ranks):
            if r == me:
                continue
            address = await self.address_of(job, r)
            left = self._address_wait(job, r) if address is None else 0.0
            if left > 0:
                # asked for lately (here, or by a manifest asked of that node just
                # before: eleventh #16 trial NOTE H, a prefetch right after a restart
                # failed at once): the next heartbeat (about a second) brings it
                with trio.move_on_after(left):
                    while address is None:
                        await trio.sleep(0.1)
                        peer = self.book.reachable(r)
                        address = peer.address if peer is not None else None
                if address is None:
                    self._gave_up[(job, r)] = time.monotonic()
            out.append((r, address))
        return out

    def _address_wait(self, job: str, rank: int) -> float:
        """Seconds a fetch waits for node ``rank``'s unknown address: a reader's
        :data:`ADDRESS_WAIT` from when it was first asked for (the next copy serves
        sooner), a background fetch :data:`BACKGROUND_ADDRESS_WAIT` (that node may
        mount later than this one); none for :data:`GAVE_UP_FOR` seconds after such a
        wait ran out."""
        now = time.monotonic()
        gave_up = self._gave_up.get((job, rank))
        if gave_up is not None and now - gave_up < GAVE_UP_FOR:
            return 0.0
        if not fetch_urgent.get()():
            return BACKGROUND_ADDRESS_WAIT
        since = self.book.wanted_at.get((job, rank))
        return ADDRESS_WAIT - (now - since) if since is not None else 0.0

    async def _pull_file(
        self,
        address: str,
        key: ShardKey,
        digest: str,
        path: str,
        fd: int,
        expect: tuple[int, int] | None = None,
        write: PositionalWrite | None = None,
    ) -> tuple[str, grpc.StatusCode | str | None] | None:
        """One copy's :meth:`PeerClient.pull_file` in the file fetch lane: None when it
        served, else why not (one line) and the call's status code (:data:`OTHER`: the
        holder's file is not ``expect``; None: not a gRPC error).

        Raises:
            FetchFailed: ``fd`` has no room (ENOSPC, EDQUOT, EFBIG), from the ``OSError``.
        """
        cancel = threading.Event()
        code: grpc.StatusCode | str | None = None
        try:
            hold = self._hold()
            async with self.lane.slot():
                own = os.dup(fd)

                def pull() -> int:
                    try:
                        return int(
                            self.client.pull_file(
                                address,
                                key,
                                digest,
                                path,
                                own,
                                cancel,
                                expect=expect,
                                hold=hold,
                                write=write,
                            )
                        )
                    finally:
                        os.close(own)

                await trio.to_thread.run_sync(pull, abandon_on_cancel=True)
            return None
        except grpc.RpcError as exc:
            why, code = rpc_reason(exc), rpc_code(exc)
        except (BadCopy, ChunkMismatch) as exc:
            why = f"{BAD}: {exc}"
        except OtherBytes as exc:
            why, code = f"other bytes: {exc}", OTHER
        except Refused as exc:
            why = f"refused: {exc}"
        except OSError as exc:
            if exc.errno in NO_ROOM_ERRNOS:
                raise FetchFailed(
                    f"{path} of step {key.step} of node-rank {key.rank}: no room for it "
                    f"here ({exc.strerror or exc})"
                ) from exc
            why = f"writing it failed: {exc.strerror or exc}"
        except Exception as exc:  # a FileSource raises nothing else: say what it was
            why = f"{type(exc).__name__}: {exc}"
        finally:
            cancel.set()
        log.info("file %s of %s from %s: %s", path, key, address, why)
        return why, code
