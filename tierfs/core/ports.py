"""The narrow interfaces (ports) the planes get from the node, wired by ``tierfs.daemon``.

Every object receives its ports in ``__init__`` from the one composition root
(:func:`tierfs.daemon.build_node`); nothing is attached after construction.
The planes (:mod:`tierfs.replication`, :mod:`tierfs.backup`) and the node's
restorer (:class:`tierfs.node.restorer.Restorer`) see the node only through these
Protocols, so a unit test hands them small fakes (tests/unit/test_wiring.py,
tests/unit/test_restorer.py) and no plane imports the agent or another plane.

Threads: unless a method says otherwise it is called on the trio thread and
must not block (file work belongs in ``trio.to_thread``).

Implementations today:

* :class:`Catalog`: :class:`tierfs.node.catalog.ShardCatalog`;
* :class:`Reporter`: :class:`tierfs.node.reporter.NodeReporter`;
* :class:`CurrentJob`, :class:`Summons`: :class:`tierfs.node.jobstate.JobState`;
* :class:`RamBudget`: :class:`tierfs.store.ramstore.Budget`;
* :class:`PeerPlane`: :class:`tierfs.replication.plane.PlaneState`;
* :class:`BackupOrders`, :class:`BackupFetch`: :class:`tierfs.backup.tier.GcsTier`;
* :class:`Rendezvous`: :class:`tierfs.backup.tier.BucketRendezvous` (tests: fakes);
* :class:`CoordinatorHooks`: :class:`tierfs.cluster.coordinator.CoordinatorServicer`;
* :class:`Verifier`: :class:`tierfs.node.catalog.ShardVerifier`;
* :class:`RestoreProgress`: :class:`tierfs.node.jobstate.JobState`;
* :class:`RestoreSource`: :class:`tierfs.node.sources.LocalSource`,
  :class:`~tierfs.node.sources.PeerSource`, :class:`~tierfs.node.sources.BucketSource`;
* :class:`BucketRestore`: :class:`tierfs.node.sources.BucketRestoreSide`;
* :class:`Agreement`: :class:`tierfs.node.agreement.CoordinatorAgreement`;
* :class:`FileSource`: :class:`tierfs.replication.peer.PeerTier` (peers' RAM),
  :class:`tierfs.backup.tier.GcsTier` (bucket rounds);
* :class:`BatchFileSource`: :class:`tierfs.replication.peer.PeerTier`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec
    from tierfs.core.types import BucketView, CopyId, Outcome, RestorePlan, RoundView, WholeVerdict
    from tierfs.store.manifest import Manifest
    from tierfs.store.shards import Shard, ShardKey


class PositionalWrite(Protocol):
    """``write(data, offset, crc32c=None)``: a positional write of a fetched file's
    bytes (see FileSource).

    ``crc32c``, when given, is the crc32c of ``data`` that the caller computed itself
    from these very bytes (never a value a copy sent), so a writer that checks
    chunks against the manifest need not pass over the bytes again; None: not known.
    """

    def __call__(self, data: bytes, offset: int, crc32c: int | None = None) -> None: ...


#: a listener of a shard leaving the catalog (withdrawn, dropped by retention, replaced)
WithdrawnListener = Callable[["ShardKey"], None]
#: a listener of one of this node's steps being sealed (its shard is in the catalog)
SealedListener = Callable[["Shard"], None]


class Catalog(Protocol):
    """The shards this node holds: its own sealed steps and its peers' replicas.

    A read-only mapping ``ShardKey -> Shard`` plus the few changes the planes
    make. Trio thread only (the gRPC threads hop onto it first).
    """

    def get(self, key: ShardKey) -> Shard | None:
        """The held shard ``key``, or None."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[ShardKey]: ...

    def __len__(self) -> int: ...

    def items(self) -> Any:
        """(key, shard) pairs of every held shard (a view: copy before changing the catalog)."""
        ...

    def own_shards(self, job: JobSpec) -> list[Shard]:
        """This node's own shards of ``job`` (rank ``job.node_rank``), newest step first."""
        ...

    def shards_of(self, job: str) -> list[Shard]:
        """Every shard of job ``job`` held here (own and replicas), in no order."""
        ...

    def retained(self, key: ShardKey) -> bool:
        """``key`` is held and among the ``--keep-local`` newest (by seal time) of its
        (job, rank): worth sending or keeping."""
        ...

    def add(self, shard: Shard) -> None:
        """Register a committed shard (replacing one with the same key)."""
        ...

    def drop(self, key: ShardKey, reason: str) -> None:
        """Forget ``key`` and remove its files (one rename into the trash); the
        withdrawn listeners hear of it. A key not held is ignored. ``reason``: one
        line for the log."""
        ...

    def request_retention(self) -> None:
        """Ask the node to apply ``--keep-local`` retention soon (e.g. a replica arrived)."""
        ...

    def on_withdrawn(self, listener: WithdrawnListener) -> None:
        """Call ``listener(key)`` whenever a shard leaves the catalog (registration
        order; a plane registers in its ``__init__``)."""
        ...

    def on_sealed(self, listener: SealedListener) -> None:
        """Call ``listener(shard)`` whenever one of this node's steps is sealed."""
        ...

    def whole_verdict(self, key: ShardKey) -> WholeVerdict | None:
        """The step of ``key`` judged over every rank's part, if this node did, on the
        bytes held now (:mod:`tierfs.node.whole_step`)."""
        ...


class ManifestSource(Protocol):
    """Other nodes' manifests of their own parts, for judging a step across ranks."""

    async def part_manifest(
        self,
        job: str,
        rank: int,
        step: int,
        *,
        writers: int = 0,
        round_name: str = "",
        beside: tuple[int, str] | None = None,
    ) -> Manifest | None:
        """Node ``rank``'s manifest of its part of ``step`` (asked of that node; no
        file bytes), or None while it is unreachable or has no such part. Never raises.

        ``writers``: the node count that wrote the step (issue #16; 0: the job's):
        where its replicas are placed; a rank the job no longer has is not asked.
        ``round_name``: a backup source takes that round's part first (the round the
        restore of ``step`` decided: another round of the same step number may be
        another save of it); other sources ignore it. ``beside``: (rank, manifest
        digest) of the asking node's own part: a backup source never takes a round
        holding another part of that rank (the round is of another save of the
        step); other sources ignore it."""
        ...


#: :meth:`OwnerParts.owner_part`'s answer while the node's client writes the step again
PART_SAVING = "saving"


class OwnerParts(Protocol):
    """What a node holds of its own part now, asked of that node alone."""

    async def owner_part(self, job: str, rank: int, step: int) -> str | None:
        """The digest of node ``rank``'s own part of ``step`` as that node holds it now;
        :data:`PART_SAVING` while its client writes the step again (its seal to
        come); None when it cannot say (unreachable, no such part). Never raises."""
        ...


class PartReports(Protocol):
    """The digests the nodes report of their own parts (node-rank 0's coordinator:
    each node's inventory arrives with its heartbeat, about every second)."""

    def own_part_digests(self, job: str, steps: Collection[int]) -> dict[int, dict[int, str]]:
        """Step -> rank -> the manifest digest of that rank's own part of the step, as
        its node last reported it; ranks that report none are left out, and so is
        every step when this node does not serve ``job``'s coordinator. Blocking
        (a short lock: call it from a worker thread); never raises."""
        ...


class PartWatch(Protocol):
    """The whole-step view's side of the heartbeat (issue #14): the steps it shows and
    the own-part digests node-rank 0's coordinator reports changed in them (a rank
    saved a step again), so a node notices without holding a replica of that rank;
    and the step directories being saved, up from this node and down from the
    others (:mod:`tierfs.cluster.savers`)."""

    def watched(self) -> tuple[str, list[tuple[int, int]]]:
        """(parts epoch, [(step, parts version)]): the steps shown and the version of
        that epoch up to which their parts' changes are known ("", 0: none yet).
        Trio thread; never raises."""
        ...

    def parts_reported(
        self,
        epoch: str,
        version: int,
        asked: Sequence[int],
        changes: Sequence[tuple[int, int, str]],
    ) -> None:
        """The coordinator's answer for the steps ``asked``: (step, rank, digest) of
        the own parts reported since (rank -1: that step's changes are lost, ask
        every rank again); they are now known up to ``version`` of ``epoch``.
        Trio thread; never raises."""
        ...

    def saving(self) -> list[str]:
        """The top-level step directories this node is saving now (a file in it open
        for writing, or its seal still to come), for the coordinator. Trio thread;
        never raises."""
        ...

    def others_saving(self, names: Sequence[str]) -> None:
        """The coordinator's answer: the step directories the other live nodes are
        saving now (a coordinator without this field never calls it). Trio thread;
        never raises."""
        ...


class FileSource(Protocol):
    """One tier that hands over a single file of another rank's part (issue #14:
    the whole-step view fetches a file the node does not hold on first read).

    Attributes:
        name: ``"peer"`` or ``"gcs"`` (status and metrics name fetched bytes by it).
    """

    name: str

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
        """Write file ``path`` (relative to the part's root) of node ``rank``'s part
        of ``step`` into the open descriptor ``fd``, from offset 0 (positional
        writes; ``fd`` is not truncated).

        ``digest`` is the manifest digest of the part the caller knows (a copy
        with that digest is preferred; another copy may serve the file too: the
        caller checks size and crc32c of what was written). ``skip`` names copies
        (as returned) that served wrong bytes before: they are not used again.
        ``writers``: the node count that wrote the step (see
        :meth:`ManifestSource.part_manifest`). ``expect``: (size in bytes, crc32c)
        of the file by the caller's manifest; a source whose ``checks_written``
        attribute is True then checks the bytes against it as they are written
        (on return they are exactly that file: the caller need not read them
        back; a copy with other bytes is skipped, and when no copy served,
        :attr:`FetchFailed.other_bytes` says whether one held other bytes).
        Other sources ignore it (the caller checks what was written).
        ``write`` (given only to a source whose ``chunk_writes`` attribute is
        True): when given, every piece of a copy's bytes goes through
        ``write(data, offset)`` instead of a positional write into ``fd`` (in a
        worker thread, in offset order from 0; a next copy starts at 0 again):
        the caller checks each chunk before it writes it. An exception it
        raises refuses that copy like a checksum failure (the next copy is
        tried), except an ``OSError`` of no room, which ends the fetch as a
        full ``fd`` does.

        Returns:
            which copy served the bytes, e.g. ``"peer node-rank 2 (10.0.0.3:7070)"``
            or ``"bucket round r-20261202-1200"`` (a key for ``skip``).

        Raises:
            tierfs.core.errors.FetchFailed: no copy in this tier could be read (the
                reason names each copy tried). Never anything else but
                ``trio.Cancelled``.
        """
        ...


@dataclass(frozen=True)
class FileTarget:
    """One file of a batched fetch (:meth:`BatchFileSource.fetch_files`).

    Attributes:
        path: relative to the part's root, as its manifest lists it.
        size: bytes; crc32c: of the whole file, by the caller's manifest (a copy
            whose entry differs is not written).
        write: ``write(data, offset)`` of each piece of the file's bytes, in offset
            order from 0, in a worker thread (the caller checks chunks against its
            manifest and writes them; what it raises ends that copy's call).
    """

    path: str
    size: int
    crc32c: int
    write: PositionalWrite


class BatchFileSource(Protocol):
    """A :class:`FileSource` that also hands over several small files of one part in
    one call (issue #14 goal 2: a call per small file costs more than its bytes)."""

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
        """Bring as many of ``files`` (of node ``rank``'s part of ``step`` with
        manifest ``digest``) as one copy serves whole and right, best effort.

        ``landed(path, label)`` is called from a worker thread as soon as a file's
        every byte went through its ``write`` and its size and crc32c are the
        target's (``label`` names the copy, as :meth:`FileSource.fetch_file`
        returns it). A file never landed may hold some verified pieces: the
        caller fetches it on its own (which reports what failed).

        Raises:
            tierfs.core.errors.FetchFailed: a write found no room (ENOSPC), with
                the ``OSError`` as its cause. Nothing else but ``trio.Cancelled``.
        """
        ...


class Reporter(Protocol):
    """The job-visible problem report: ``replicator.errors`` / ``replicator.failed``."""

    def error(self, message: str) -> None:
        """A recoverable problem: one line in ``replicator.errors`` and the status.

        An identical message is written at most once a minute (repeats are
        counted in the next line). Never raises (a full tmpfs is logged).
        """
        ...

    def failure(self, message: str, *, job_context: bool = True) -> None:
        """A failed job-level action: one line in ``replicator.failed`` and ``.errors``.

        ``job_context=False``: the line names no job (a refused replicator.yaml
        must not name the job that ran before it). Never raises.
        """
        ...


class CurrentJob(Protocol):
    """The job this node runs right now, read-only (the agent changes it).

    ``job`` is a frozen :class:`tierfs.core.control.JobSpec`; one attribute read
    is safe from any thread.
    """

    @property
    def job(self) -> JobSpec | None:
        """The running job (None before the first one)."""
        ...

    @property
    def mode(self) -> str:
        """``protocol`` (replicator.yaml), ``generic`` (no control files) or ``none``."""
        ...

    @property
    def timeline_since(self) -> float:
        """Unix time (seconds) the current timeline began: steps sealed before it
        belong to the job's previous run."""
        ...

    @property
    def restore_state(self) -> Mapping[str, Any]:
        """The restore's state (``state``: idle, pending, cleanup, planning, barrier,
        done, failed; plus ``step``, ``source``, ``outcome``, ``phase``...)."""
        ...

    def restoring(self) -> bool:
        """A restore runs on this node (``cleanup``, ``planning`` or ``barrier``)."""
        ...


class Summons(Protocol):
    """How the peer plane asks the node to join another node's restore round."""

    def summoned(self, job: JobSpec) -> None:
        """The coordinator summons this node into a restore round of ``job`` (generic
        mode; the node joins unless a restore already runs). Must not block."""
        ...


class RamBudget(Protocol):
    """The RAM budget of the store (bytes)."""

    def check_growth(self, nbytes: int) -> None:
        """Raise ``OSError(ENOSPC)`` if ``nbytes`` more bytes do not fit. Any thread."""
        ...

    def free(self) -> int:
        """Bytes still free in the budget."""
        ...


class PeerPlane(Protocol):
    """What the backup plane needs to know of the node's peer plane (multi-node jobs)."""

    def active_job(self) -> JobSpec | None:
        """The running job if it spans several nodes and a coordinator can be found."""
        ...

    @property
    def serving(self) -> bool:
        """This node serves the coordinator of its job right now (any thread)."""
        ...

    def synced_step(self) -> int | None:
        """The newest step every node sealed and replicated (the last sync round)."""
        ...

    def reported_steps(self) -> tuple[int, ...]:
        """Own steps reported replicated in the ``Sync`` in flight and the last one
        answered: the coordinator may order a backup round of either."""
        ...

    def heartbeat_now(self) -> None:
        """Send a heartbeat (``Sync``) now, e.g. to report a backup outcome."""
        ...


class BackupOrders(Protocol):
    """The node's side of coordinator-driven backup rounds (the backup plane)."""

    def backup_outcome(self) -> Outcome | None:
        """The outcome of the last round this node was ordered into (None: none yet)."""
        ...

    def on_backup_round(
        self,
        job: JobSpec,
        order: tuple[str, int] | None,
        last: RoundView | None,
        dedup: bool = False,
    ) -> None:
        """The coordinator's answer: the (round, step) to upload now, if any, the
        newest round with its state, and whether this node's shard has its
        data-parallel uploader's checksums (``dedup``). Must not block (start
        uploads as tasks)."""
        ...


class BackupFetch(Protocol):
    """The restore side of the backup plane: bring this node's shard from a round."""

    async def fetch_backup(
        self, agent: Any, job: JobSpec, step: int, backup: str, digest: str = ""
    ) -> Shard:
        """This node's shard of ``step`` from backup round ``backup``, verified and in
        the catalog. ``digest``: the bytes the decision chose ("": any).
        ``agent``: what the download needs of the restoring node: ``verify_shard``
        (its own copy's checksums) and ``restore_state.update`` (progress); the
        restorer passes a small adapter (:mod:`tierfs.node.sources`).

        Raises:
            tierfs.backup.tier.BackupCopyError: one line why this round's copy
                cannot be used (corrupt, incomplete, other bytes, no room).
        """
        ...


class Rendezvous(Protocol):
    """Where nodes of a job publish their peer addresses (the bucket).

    Both calls do their I/O in worker threads and give up within a bounded time.
    """

    def where(self, job: str, rank: int) -> str:
        """Where node ``rank``'s record of ``job`` lives, for messages (``gs://...``)."""
        ...

    async def publish(self, job: str, rank: int, address: str, incarnation: str) -> None:
        """Write this node's record. Raises ``Exception`` (one line) when it cannot."""
        ...

    async def lookup(self, job: str, rank: int) -> tuple[str, str] | None:
        """Node ``rank``'s record: (address, incarnation), or None if there is none.

        Raises ``Exception`` (one line) when the bucket cannot be read.
        """
        ...


class CoordinatorHooks(Protocol):
    """This node's coordinator as the backup plane drives it (used only while it serves).

    Both calls may block on the coordinator's lock: run them in a worker thread.
    """

    def locked(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(coordinator)`` under the coordinator's lock; returns its result."""
        ...

    def set_bucket_reader(self, reader: Callable[[str, int, int], BucketView]) -> None:
        """Install ``reader(job, nodes, depth)``: restore decisions wait for it."""
        ...


# ---------------------------------------------------------------------- restore


class Verifier(Protocol):
    """Re-checks a held shard's bytes against its manifest (crc32c of every file)."""

    async def verify(self, shard: Shard) -> bool:
        """True if every file matches. A bad copy is reported (one line in
        ``replicator.errors``) and dropped from the catalog. File work runs in a
        worker thread."""
        ...


class RestoreProgress(Protocol):
    """Where a restore says what it does now (the restore state's ``phase`` and details)."""

    def progress(self, fields: Mapping[str, Any]) -> None:
        """Merge ``fields`` (``phase``: one line; ``source``, ``round``, ``step``...) into
        the running restore's state (``tierfs status``). Must not block."""
        ...


class RestoreSource(Protocol):
    """One place this node's shard of a decided step can come from.

    Attributes:
        name: ``local``, ``peer:<node rank>`` or ``gcs:<backup round>``.
        round: the backup round (bucket sources), else None.
    """

    name: str
    round: str | None

    async def fetch(self, job: JobSpec, step: int, digest: str) -> Shard:
        """This node's shard (rank ``job.node_rank``) of ``step`` with manifest digest
        ``digest`` ("": any), verified and in the catalog.

        Raises:
            tierfs.node.sources.CopyFailed: this source's copy cannot be used
                (``reason``: one line; ``line``: what ``replicator.errors``
                says, if anything).
        """
        ...


#: the peer source of node rank ``holder`` reachable at ``address``
PeerSources = Callable[[int, str], RestoreSource]


class BucketRestore(Protocol):
    """The bucket as the restorer sees it (``--bucket``)."""

    async def view(self, job: JobSpec, depth: int) -> BucketView:
        """What the bucket holds of ``job``: the ``depth`` newest complete rounds
        (worker thread, bounded time; a read failure is ``BucketView.error``)."""
        ...

    def source(self, round: str) -> RestoreSource:
        """The source of backup round ``round``."""
        ...

    def note_restored(self, job: JobSpec, plan: RestorePlan, forced: str | None) -> None:
        """Record a finished restore plan (the backup schedule restarts from it; a
        restore through ``restore.version`` round ``forced`` is remembered)."""
        ...


@dataclass(frozen=True)
class Decision:
    """The coordinator's restore decision as this node sees it (PROTOCOL.md section 4).

    Attributes:
        round: the restore round number.
        version: the decision's version (a replan after a bad copy raises it).
        step: the step every node restores, or None for "nothing".
        reason: one line why.
        outcome: ``restored``, ``fresh``, ``incomplete`` (None: not said).
        problems: lines for ``replicator.errors``.
        forced: the ``restore.version`` round that made the decision, or None.
        digest: the manifest digest of this node's shard to restore ("": any).
        local: this node holds that copy itself.
        peers: (node rank, address) of the peers holding it, in the order to try.
        rounds: the backup rounds holding it, in the order to try.
        writers: the node count that wrote ``step`` (its writer topology, issue
            #16; 0 unknown): a node whose rank is not below it has no part.
    """

    round: int
    version: int
    step: int | None
    reason: str = ""
    outcome: str | None = None
    problems: tuple[str, ...] = ()
    forced: str | None = None
    digest: str = ""
    local: bool = False
    peers: tuple[tuple[int, str], ...] = ()
    rounds: tuple[str, ...] = ()
    writers: int = 0


class Agreement(Protocol):
    """The coordinator's restore round as this node takes part in it (PROTOCOL.md
    section 4): join, decide, the "ready" and "done" barriers.

    Every call waits (without a thread) for the coordinator within the node's
    ``--join-timeout`` and says what it waits for through the restore progress.

    Raises (every call but :meth:`pin`):
        tierfs.node.agreement.RestoreTimeout: no answer or no progress in time
            (``NodesMissing``: node ranks never joined);
        tierfs.node.agreement.RestoreRefused: the coordinator refuses this node;
        each with its line in ``replicator.errors``.
    """

    async def join(self, job: JobSpec, restore_id: str, strict: bool, notes: Sequence[str]) -> int:
        """Join the restore round (``strict``: protocol mode, else generic) with
        ``notes`` (copies this node discarded); returns the round number."""
        ...

    async def decide(self, job: JobSpec, restore_id: str, round: int) -> Decision | None:
        """The round's decision, once every node joined; None: join again (the
        coordinator restarted or moved)."""
        ...

    async def ready(
        self,
        job: JobSpec,
        restore_id: str,
        round: int,
        version: int,
        ok: bool,
        bad: Sequence[CopyId],
        detail: str = "",
    ) -> str:
        """Barrier "ready" of ``round`` (decision ``version``): this node has its data
        (``ok``) or found ``bad`` copies (``detail``: one line why). Returns
        ``passed``, ``replan`` (decide again) or ``rejoin``."""
        ...

    async def done(self, job: JobSpec, restore_id: str, round: int, version: int) -> str:
        """Barrier "done" (every node wrote its prerestore), bounded to at most 60 s.
        Returns ``passed``, ``replan`` or ``rejoin``."""
        ...

    def pin(self, key: ShardKey, delta: int) -> None:
        """Hold (+1) or release (-1) ``key`` against retention (trio thread)."""
        ...
