"""What this node holds, as the peer plane sees and serves it.

DESIGN.md "Peer plane". :class:`Holdings` is the
:class:`tierfs.replication.service.PeerHost` the gRPC servicer calls (any
thread: each call hops onto the trio thread with ``trio.from_thread.run_sync``,
cheap dictionary work only), and keeps the plane's bookkeeping over the
node's catalog (trio thread):

* the inventory the coordinator and the peers are told (manifest digests
  cached per manifest object; own sealed steps count as verified);
* replicas adopted from pushes, including manifest-only ones whose files are
  hard links of a local shard (data parallelism: identical bytes) -- such a
  replica is dropped with its source unless retention dropped the source;
* pins: shards being sent or served (and a restore's chosen shard) are kept
  from retention; :func:`retention_pins` is the whole retention rule of the
  plane, a pure function.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import trio

from tierfs.core.ports import Catalog, CurrentJob, RamBudget
from tierfs.core.types import Holding
from tierfs.replication.addresses import Endpoint
from tierfs.replication.service import HostGone, PeerHost
from tierfs.rpc.wire import WireStats
from tierfs.store.manifest import Manifest
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore
from tierfs.store.verdicts import eligibility

#: other nodes' part manifests kept for relaying (a few KiB each)
REMEMBERED = 4096


class Holdings(PeerHost):
    """The node's shards for the peer plane (see the module docstring).

    Args:
        store: the RAM store (pushed replicas arrive in its ``incoming``).
        shards: the store of committed shards.
        catalog: the held shards (replicas are added, linked ones dropped).
        job: the current job (read only).
        budget: the RAM budget a pushed replica must fit.
        stats: the wire counters the servicer updates.
        me: this node's endpoint (its incarnation answers inventories).
        keep_local: ``--keep-local``.

    Attributes:
        pins: shard -> pin count (the Counter object is never replaced).
    """

    def __init__(
        self,
        *,
        store: RamStore,
        shards: ShardStore,
        catalog: Catalog,
        job: CurrentJob,
        budget: RamBudget,
        stats: WireStats,
        me: Endpoint,
        keep_local: int,
    ) -> None:
        self.ram = store
        self.shards = shards
        self.catalog = catalog
        self.current = job
        self.budget = budget
        self.stats = stats
        self.incarnation = me.incarnation  # answers every inventory
        self.keep_local = keep_local
        self.pins: collections.Counter[ShardKey] = collections.Counter()
        #: ``resaving_now(key)`` (trio thread): this node's own part ``key`` is
        #: withdrawn by a write of its client, its seal to come (set by the
        #: composition root; None: never)
        self.resaving_now: Callable[[ShardKey], bool] | None = None
        self._trusted: set[ShardKey] = set()
        self._linked: dict[ShardKey, ShardKey] = {}
        self._digests: dict[ShardKey, tuple[int, str]] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._damage_listeners: list[Callable[[ShardKey, str], None]] = []
        #: other nodes' manifests of their parts this node was told (newest last)
        self._manifests: collections.OrderedDict[ShardKey, Manifest] = collections.OrderedDict()

    @property
    def token(self) -> trio.lowlevel.TrioToken | None:
        """The trio loop this node serves on (None before :meth:`attach`)."""
        return self._token

    def attach(self, token: trio.lowlevel.TrioToken) -> None:
        """Serve the servicer's calls on the trio loop of ``token`` (at start)."""
        self._token = token

    # ------------------------------------------------------------------ trio thread

    def remember_manifest(self, manifest: Manifest) -> None:
        """Keep another node's manifest of its part, as its node sent it, to answer
        nodes that cannot reach that node (the whole-step view: node-rank 0, which
        reaches every member, relays). At most :data:`REMEMBERED` are kept."""
        key = ShardKey(manifest.job, manifest.rank, manifest.step)
        self._manifests[key] = manifest
        self._manifests.move_to_end(key)
        while len(self._manifests) > REMEMBERED:
            self._manifests.popitem(last=False)

    def known_manifest(self, key: ShardKey) -> Manifest | None:
        """The manifest of ``key`` another node sent this one, if kept (any thread:
        one dictionary read)."""
        return self._manifests.get(key)

    def digest(self, shard: Shard) -> str:
        """The shard's manifest digest (cached per manifest object)."""
        cached = self._digests.get(shard.key)
        if cached is not None and cached[0] == id(shard.manifest):
            return cached[1]
        d = shard.manifest.digest
        self._digests[shard.key] = (id(shard.manifest), d)
        return d

    def holdings(self, job: str) -> list[Holding]:
        """This node's inventory of ``job`` (with the step judged across ranks, where
        this node did: :mod:`tierfs.node.whole_step`)."""
        out = []
        for s in self.catalog.shards_of(job):
            digest = self.digest(s)
            whole = self.catalog.whole_verdict(s.key)
            out.append(
                Holding(
                    s.key.rank,
                    s.key.step,
                    s.verified or s.key in self._trusted,
                    digest,
                    s.bytes,
                    s.manifest.name,
                    s.manifest.backup_requested,
                    s.manifest.created,
                    *eligibility(s.manifest),
                    whole_digests=whole.digests if whole else (),
                    whole_unloadable=whole.unloadable if whole else "",
                    nodes=s.manifest.nodes,
                    replaces=s.manifest.replaces,
                )
            )
        return out

    def on_sealed(self, shard: Shard) -> None:
        """An own step was sealed here: its bytes are trusted (a catalog listener)."""
        self._trusted.add(shard.key)

    def on_withdrawn(self, key: ShardKey) -> None:
        """A shard left the catalog: forget it; drop the replicas linked to it unless
        retention dropped it (a catalog listener)."""
        self._trusted.discard(key)
        self._digests.pop(key, None)
        self._linked.pop(key, None)
        linked = [k for k, src in self._linked.items() if src == key]
        if linked and not self._retention_victim(key):
            for k in linked:
                del self._linked[k]
                self.catalog.drop(k, f"its files are hard links of {key}, which was withdrawn")
        elif linked:
            for k in linked:
                del self._linked[k]

    def _retention_victim(self, key: ShardKey) -> bool:
        steps = sorted(
            (k.step for k in self.catalog if k.job == key.job and k.rank == key.rank),
            reverse=True,
        )
        keep = steps[: self.keep_local]
        return len(keep) >= self.keep_local and key.step < min(keep)

    def register(self, shard: Shard, linked_from: ShardKey | None = None) -> None:
        """Catalog a committed replica (``linked_from``: its files are that shard's
        inodes, so the inode map stays the source's) and ask for retention."""
        if linked_from is not None:
            # the files are the source's inodes: leave the inode map to the source,
            # whose withdrawal then drops this replica too (see on_withdrawn)
            shard.inodes = set()
            self._linked[shard.key] = linked_from
        self.catalog.add(shard)
        self.catalog.request_retention()

    def pin_now(self, key: ShardKey, delta: int) -> None:
        """Pin (+1) or unpin (-1) ``key`` against retention."""
        self.pins[key] += delta
        if self.pins[key] <= 0:
            del self.pins[key]

    def relink_loaded(self) -> None:
        """After a daemon restart: replicas that are hard links of own shards (dedup)."""
        job = self.current.job
        if job is None:
            return
        own = {
            k: s for k, s in self.catalog.items() if k.job == job.name and k.rank == job.node_rank
        }
        by_ino = {ino: k for k, s in own.items() for ino in s.inodes}
        for k, s in list(self.catalog.items()):
            if k in own or k.job != job.name:
                continue
            shared = s.inodes & by_ino.keys()
            if shared:
                src = by_ino[next(iter(shared))]
                s.inodes = set()
                self._linked[k] = src
                self.catalog.add(own[src])

    # ------------------------------------------------------------------ PeerHost (any thread)

    def _on_trio(self, fn: Callable[..., Any], *args: Any) -> Any:
        token = self._token
        if token is None:
            raise HostGone()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            raise HostGone() from None

    def own_rank(self, job: str) -> int | None:
        j = self.current.job  # one attribute read of a frozen JobSpec: safe from any thread
        return j.node_rank if j is not None and j.name == job else None

    def inventory(self, job: str) -> list[Holding]:
        return self._on_trio(self.holdings, job)  # type: ignore[no-any-return]

    def find(self, key: ShardKey) -> Shard | None:
        return self._on_trio(self.catalog.get, key)  # type: ignore[no-any-return]

    def resaving(self, key: ShardKey) -> bool:
        test = self.resaving_now
        return test is not None and bool(self._on_trio(test, key))

    def find_digest(self, job: str, digest: str) -> tuple[Shard, bool] | None:
        def look() -> tuple[Shard, bool] | None:
            cur = self.current.job
            own = cur.node_rank if cur else None
            found = [s for s in self.catalog.shards_of(job) if self.digest(s) == digest]
            # prefer a copy that is not the client's view (no hard links to live files)
            found.sort(key=lambda s: (s.key.rank == own, -s.key.step))
            if not found:
                return None
            return found[0], found[0].key in self._trusted

        return self._on_trio(look)  # type: ignore[no-any-return]

    def adopt(self, shard: Shard, linked_from: ShardKey | None = None) -> None:
        self._on_trio(self.register, shard, linked_from)

    def pin(self, key: ShardKey, delta: int) -> None:
        self._on_trio(self.pin_now, key, delta)

    def damaged(self, key: ShardKey, path: str) -> None:
        try:
            self._on_trio(self._damaged_now, key, path)
        except HostGone:
            pass  # stopping: the next daemon verifies its copies at its restore

    def on_damaged(self, listener: Callable[[ShardKey, str], None]) -> None:
        """Call ``listener(key, path)`` (trio thread; must not block) when a pull served
        from this node found a chunk of file ``path`` of its copy of ``key`` with other
        bytes than its manifest (:meth:`PeerHost.damaged`)."""
        self._damage_listeners.append(listener)

    def _damaged_now(self, key: ShardKey, path: str) -> None:
        for listener in self._damage_listeners:
            listener(key, path)

    def check_space(self, nbytes: int) -> None:
        self.budget.check_growth(nbytes)


def retention_pins(
    pins: Iterable[ShardKey],
    held: Iterable[ShardKey],
    job: str | None,
    *,
    synced: int | None,
    restore_open: bool,
    keep_local: int,
) -> set[ShardKey]:
    """The shards the peer plane keeps from retention (pure).

    Args:
        pins: shards being sent or served, a restore's chosen shard.
        held: every shard key the node holds.
        job: the running multi-node job with a peer plane, or None (pins only).
        synced: the cluster's synced step (the newest every node sealed and
            replicated) from the last sync round, or None.
        restore_open: the coordinator has a restore round open.
        keep_local: ``--keep-local``.

    Returns:
        ``pins``; with a job and an open restore round, every copy of the job
        (any may be chosen); else, per rank, the ``keep_local`` newest steps not
        newer than ``synced`` (steps sealed while a peer is down can never be
        complete, so they must not push out the ones that are).
    """
    keep = set(pins)
    if job is None:
        return keep
    mine = [k for k in held if k.job == job]
    if restore_open:
        return keep | set(mine)
    if synced is None:
        return keep
    by_rank: dict[int, list[int]] = {}
    for k in mine:
        if k.step <= synced:
            by_rank.setdefault(k.rank, []).append(k.step)
    for rank, steps in by_rank.items():
        keep |= {ShardKey(job, rank, s) for s in sorted(steps, reverse=True)[:keep_local]}
    return keep
