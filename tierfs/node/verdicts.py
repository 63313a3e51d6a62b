"""Say once when a sealed step would not load (issue #15).

The verdict itself is judged at seal time, off the FUSE thread, and kept in
the shard's manifest (:meth:`tierfs.store.shards.ShardStore.snapshot`,
:mod:`tierfs.store.verdicts`); the restore choice skips such a step
(:mod:`tierfs.cluster.restore_choice`, :meth:`tierfs.node.restorer.Restorer`).
:class:`SealVerdicts` listens to the catalog's seals and writes one line in
``replicator.errors`` (and so ``tierfs status``) per sealed content of a step
that can never load -- not on every re-seal or retry of the same bytes.
"""

from __future__ import annotations

from tierfs.core.ports import CurrentJob, Reporter
from tierfs.node.catalog import ShardCatalog
from tierfs.store.shards import Shard


def unloadable_line(shard: Shard, whole: bool) -> str:
    """The ``replicator.errors`` line for a sealed part that can never load, "" if none.

    Args:
        shard: the sealed shard (its manifest's verdict).
        whole: the part is the whole step (a one-node job).
    """
    verdict = shard.manifest.verdict
    if verdict is None:
        return ""
    why = verdict.reason(whole)
    if not why:
        return ""
    return (
        f"step {shard.key.step} ({shard.manifest.name}, {verdict.format}) is not loadable: "
        f"{why}; it is not restored while an older complete step exists"
    )


class SealVerdicts:
    """Reports sealed steps whose framework could not load them, once per content.

    Args:
        catalog: whose seals are watched (registers itself as a sealed listener).
        reporter: ``replicator.errors``.
        job: the running job (a one-node job's missing file is final).
    """

    def __init__(self, catalog: ShardCatalog, reporter: Reporter, job: CurrentJob) -> None:
        self.reporter = reporter
        self.job = job
        self._said: set[tuple[str, int, int, str]] = set()
        catalog.on_sealed(self.on_sealed)

    def on_sealed(self, shard: Shard) -> None:
        """A step of this node was sealed (trio thread; never blocks)."""
        job = self.job.job
        line = unloadable_line(shard, whole=job is not None and job.nodes == 1)
        if not line:
            return
        key = (shard.key.job, shard.key.rank, shard.key.step, shard.manifest.digest)
        if key in self._said:
            return
        self._said.add(key)
        self.reporter.error(line)
