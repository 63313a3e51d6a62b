"""The catalog of the shards this node holds (:class:`tierfs.core.ports.Catalog`).

Own sealed steps and the peers' replicas, by :class:`~tierfs.store.shards.ShardKey`,
plus the inode map a write into a sealed file is checked against, and the
listeners the planes register in their ``__init__`` (sealed, withdrawn) and
the node's retention hook. Trio thread only, except :attr:`ShardCatalog.sealed_inos`
(read by the FUSE thread: one dict lookup).

:class:`ShardVerifier` re-checks a held shard's bytes (:class:`tierfs.core.ports.Verifier`)
and drops a bad copy from the catalog.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, ItemsView, Iterator, Mapping

import trio

from tierfs.core.control import JobSpec
from tierfs.core.ports import Reporter, SealedListener, WithdrawnListener
from tierfs.core.types import WholeVerdict
from tierfs.store.manifest import Manifest
from tierfs.store.shards import Shard, ShardKey, ShardStore

log = logging.getLogger(__name__)


class ShardCatalog(Mapping[ShardKey, Shard]):
    """Held shards, read as a mapping ``ShardKey -> Shard``.

    Args:
        shards: the store of committed shards (files removed on :meth:`drop`).
        keep_local: ``--keep-local``: newest shards kept per (job, rank), >= 1.
    """

    def __init__(self, shards: ShardStore, keep_local: int) -> None:
        self.shards = shards
        self.keep_local = keep_local
        self._held: dict[ShardKey, Shard] = {}
        #: inode -> the sealed shard whose snapshot shares it (the FUSE thread reads it)
        self.sealed_inos: dict[int, ShardKey] = {}
        self._withdrawn: list[WithdrawnListener] = []
        self._sealed: list[SealedListener] = []
        self._added: list[SealedListener] = []
        self._retention: list[Callable[[], None]] = []
        #: own steps judged over every rank's part (tierfs.node.whole_step)
        self._whole: dict[ShardKey, WholeVerdict] = {}
        self._unjudged: dict[ShardKey, str] = {}

    # ------------------------------------------------------------------ Mapping

    def __getitem__(self, key: ShardKey) -> Shard:
        return self._held[key]

    def __iter__(self) -> Iterator[ShardKey]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def items(self) -> ItemsView[ShardKey, Shard]:
        return self._held.items()

    # ------------------------------------------------------------------ queries

    def own_shards(self, job: JobSpec) -> list[Shard]:
        """This node's shards of ``job``, newest step first."""
        return sorted(
            (s for k, s in self._held.items() if k.job == job.name and k.rank == job.node_rank),
            key=lambda s: s.key.step,
            reverse=True,
        )

    def shards_of(self, job: str) -> list[Shard]:
        """Every shard of ``job`` held here (own and replicas)."""
        return [s for k, s in self._held.items() if k.job == job]

    def step_manifests(self, job: str, step: int, nodes: int) -> list[Manifest]:
        """The manifests of every rank's part of ``step`` held here (own and replicas)
        written by ``nodes`` nodes (its :attr:`Manifest.nodes`). O(catalog)."""
        return [
            s.manifest
            for k, s in self._held.items()
            if k.job == job and k.step == step and s.manifest.nodes == nodes
        ]

    def age(self, key: ShardKey) -> tuple[float, int]:
        """Recency of a shard for retention: (seal time, step); larger is newer."""
        shard = self._held.get(key)
        return (shard.manifest.created if shard is not None else 0.0, key.step)

    def retained(self, key: ShardKey) -> bool:
        """True if ``key`` is among the ``--keep-local`` newest shards of its (job, rank)."""
        if key not in self._held:
            return False
        mine = self.age(key)
        newer = sum(
            1 for k in self._held if (k.job, k.rank) == (key.job, key.rank) and self.age(k) > mine
        )
        return newer < self.keep_local

    # ------------------------------------------------------------------ changes

    def add(self, shard: Shard) -> None:
        """Register a committed shard (trio thread)."""
        old = self._held.get(shard.key)
        if old is not None:
            self._forget_inodes(old)
        self._held[shard.key] = shard
        for ino in shard.inodes:
            self.sealed_inos[ino] = shard.key
        for listener in self._added:
            listener(shard)

    def _forget_inodes(self, shard: Shard) -> None:
        for ino in shard.inodes:
            if self.sealed_inos.get(ino) == shard.key:
                del self.sealed_inos[ino]

    def drop(self, key: ShardKey, reason: str) -> None:
        """Remove a shard from the catalog and the store (trio thread; one rename),
        then tell the withdrawn listeners."""
        shard = self._held.pop(key, None)
        if shard is None:
            return
        self._whole.pop(key, None)
        self._unjudged.pop(key, None)
        log.info("dropping shard %s: %s", key, reason)
        self._forget_inodes(shard)
        try:
            self.shards.remove(shard)
        except OSError as exc:
            log.warning("removing %s: %s", shard.path, exc)
        for listener in self._withdrawn:
            listener(key)

    def whole_verdict(self, key: ShardKey) -> WholeVerdict | None:
        """The step of ``key`` judged over every rank's part, if it was, on the bytes
        held now (a verdict on another digest of this part is None; trio thread)."""
        shard = self._held.get(key)
        if shard is None:
            return None
        found = self._whole.get(key) or shard.whole
        if found is None or len(found.digests) <= key.rank:
            return None
        return found if found.digests[key.rank] == shard.manifest.digest else None

    def set_whole_verdict(self, key: ShardKey, verdict: WholeVerdict) -> None:
        """Record the judgement of ``key``'s step over every rank's part (trio thread)."""
        self._whole[key] = verdict
        self._unjudged.pop(key, None)

    def set_unjudged(self, key: ShardKey, why: str) -> None:
        """Record why ``key``'s step is not judged across ranks yet ("" clears it):
        e.g. ``rank 3's part: no copy found on a live node`` (trio thread)."""
        if why:
            self._unjudged[key] = why
        else:
            self._unjudged.pop(key, None)

    def unjudged(self, key: ShardKey) -> str:
        """Why ``key``'s step is not judged across ranks yet, "" if nothing is known."""
        return self._unjudged.get(key, "")

    def sealed(self, shard: Shard) -> None:
        """One of this node's steps was sealed (already added): tell the sealed listeners."""
        for listener in self._sealed:
            listener(shard)

    def request_retention(self) -> None:
        """Ask the node to apply retention soon (the registered retention hooks)."""
        for hook in self._retention:
            hook()

    # ------------------------------------------------------------------ listeners

    def on_withdrawn(self, listener: WithdrawnListener) -> None:
        """Call ``listener(key)`` whenever a shard leaves the catalog."""
        self._withdrawn.append(listener)

    def on_added(self, listener: SealedListener) -> None:
        """Call ``listener(shard)`` whenever a shard enters the catalog (sealed here,
        restored, a replica received); trio thread, must not block."""
        self._added.append(listener)

    def on_sealed(self, listener: SealedListener) -> None:
        """Call ``listener(shard)`` whenever one of this node's steps is sealed."""
        self._sealed.append(listener)

    def on_retention_wanted(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on :meth:`request_retention` (the node's retention; must not
        block)."""
        self._retention.append(hook)


class ShardVerifier:
    """Re-checks held shards against their manifests (:class:`tierfs.core.ports.Verifier`).

    Args:
        shards: the store of committed shards (``verify`` reads every file).
        catalog: where a bad copy is dropped.
        reporter: ``replicator.errors``.
        limiter: the node's file-work limiter (shared with the budget count).
    """

    def __init__(
        self,
        shards: ShardStore,
        catalog: ShardCatalog,
        reporter: Reporter,
        limiter: trio.CapacityLimiter,
    ) -> None:
        self.shards = shards
        self.catalog = catalog
        self.reporter = reporter
        self.limiter = limiter
        self._bad: list[Callable[[Shard], Awaitable[None]]] = []
        #: copies to check soon (:meth:`suspect`), in order, and why
        self._suspects: dict[ShardKey, str] = {}
        self._wake = trio.Event()

    def on_bad(self, listener: Callable[[Shard], Awaitable[None]]) -> None:
        """Await ``listener(shard)`` (trio thread; its file work in worker threads) when
        :meth:`verify` finds ``shard`` bad, before it is dropped (its files still in
        the store; :attr:`tierfs.store.shards.Shard.bad` names the wrong ones): the
        view takes back its entries that are these files (hard links to the bad
        bytes)."""
        self._bad.append(listener)

    def suspect(self, key: ShardKey, path: str) -> None:
        """A node pulling file ``path`` of the copy of ``key`` held here got a chunk with
        other bytes than its manifest (trio thread; never blocks): :meth:`run` checks
        that copy soon, whenever it was checked last.

        Regression (#16 ninth trial FAIL 13): a flipped byte in a replica held here
        was refused by the node that read it (another copy served it), but this node
        kept its copy, counted it in every inventory and, after a restart within
        ``$TIERFS_REVERIFY_AFTER``, restored it "from local" (exit 0, wrong values)."""
        if key not in self._suspects:
            self._suspects[key] = path
            self._wake.set()

    async def run(self) -> None:
        """Check the copies :meth:`suspect` names, one at a time, forever (trio task);
        a copy no longer held is skipped."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._suspects:
                key, path = next(iter(self._suspects.items()))
                shard = self.catalog.get(key)
                if shard is not None:
                    log.warning(
                        "checking the copy of step %d of rank %d held here: a node reading "
                        "its %s got other bytes",
                        key.step,
                        key.rank,
                        path,
                    )
                    try:
                        await self.verify(shard)
                    except Exception:
                        log.exception("checking the copy of %s", key)
                del self._suspects[key]

    async def verify(self, shard: Shard) -> bool:
        """True if every file of ``shard`` matches its crc32c (worker thread); a bad
        copy gets one line in ``replicator.errors``, the view's entries that are its
        wrong files leave the view (:meth:`on_bad`) and it is dropped.

        Regression (#16 fifth trial F6): a flipped byte in node 2's own part of
        step 10; the restart found it, fetched a verified copy from a peer and
        said ``restored step 10 from peer:0`` (exit 0), while the mount kept
        serving the corrupt file (the view's hard link to the discarded copy)."""
        async with self.limiter:
            problems = await trio.to_thread.run_sync(self.shards.verify, shard)
        if problems:
            self.reporter.error(
                f"step {shard.key.step} of rank {shard.key.rank} failed "
                f"verification ({problems[0]}; {len(problems)} problem(s)); "
                "copy discarded"
            )
            for listener in self._bad:
                await listener(shard)
            self.catalog.drop(shard.key, "checksum mismatch")
            return False
        return True
