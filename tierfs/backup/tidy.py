"""Deleting backup rounds, and what failed or moved rounds left behind.

:meth:`RoundCleaner.delete_round` removes a whole round, pointers first (readers
see it partial at once); :meth:`RoundCleaner.tidy_round` judges a round again
from its listing and removes only the parts of its incomplete steps, never a
complete step and never the round ``restore.version`` names.

Blocking (HTTP); every request goes through :class:`tierfs.backup.bucket.ObjectStore`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierfs.backup import layout as L
from tierfs.backup.judge import NodeEntry, judge_round
from tierfs.backup.streams import run_parallel

if TYPE_CHECKING:
    from tierfs.backup.bucket import ObjectStore
    from tierfs.backup.listing import RoundListing


class RoundCleaner:
    """Deletions in rounds of one bucket spec (thread-safe).

    Args:
        objects: the bucket's objects (the only way to the bucket).
        rounds: the listing (rounds are judged again before anything is deleted).
    """

    def __init__(self, objects: ObjectStore, rounds: RoundListing) -> None:
        self.objects = objects
        self.rounds = rounds
        self.spec = objects.spec

    def delete_round(
        self,
        job: str,
        round_name: str,
        *,
        on_object: Callable[[str], None] | None = None,
        on_listed: Callable[[int], None] | None = None,
    ) -> int:
        """Delete every object of a round (and the nodes' outcome records of it);
        pointers first, so readers see it partial at once.

        Returns the number of objects deleted.
        """
        prefix = self.spec.round_dir(job, round_name)
        blobs, _ = self.objects.listing(prefix)
        names = [b.name for b in blobs]
        outcomes, _ = self.objects.listing(self.spec.round_status_dir(job, round_name))
        names += [b.name for b in outcomes]
        if on_listed is not None:
            on_listed(len(names))
        metas = [n for n in names if n.endswith(".meta") and "/" not in n[len(prefix) :]]
        rest = [n for n in names if n not in set(metas)]

        def rm(name: str) -> int:
            gone = self.objects.delete(name)
            if on_object is not None:
                on_object(name)
            return int(gone)

        threads = self.objects.settings.threads
        count: int = sum(run_parallel(threads, [functools.partial(rm, n) for n in metas], None))
        count += sum(run_parallel(threads, [functools.partial(rm, n) for n in rest], None))
        return count

    def tidy_round(self, job: str, round_name: str, nodes: int) -> int:
        """Remove what a failed or moved backup round left behind; returns the number
        of objects deleted.

        The round is judged first (the listing decides, not the caller's view),
        against the node count its manifests record (else ``nodes``): with no
        step complete for every node the whole round goes (:meth:`delete_round`,
        pointers first); otherwise the parts of the steps that are not complete
        -- their pointers, then their manifests, then data objects under their
        data names. A complete step, and the round ``restore.version`` names,
        are never touched.

        Raises:
            google.api_core exceptions after retries.
        """
        if self.rounds.read_restore_version(job) == round_name:
            return 0
        info = self.rounds.inspect_round(job, round_name)
        if not info.objects:
            return 0
        if not info.recorded_nodes:
            info.nodes = max(nodes, info.ranks_seen)
            judge_round(info)
        keep = {
            s
            for s in info.steps
            if all((r, s) in info.parts and info.parts[(r, s)].complete for r in range(info.nodes))
        }
        if not keep:
            return self.delete_round(job, round_name)
        prefix = self.spec.round_dir(job, round_name)
        pointers, manifests, heads = [], [], set()
        for name in info.objects:
            m = L.parse_meta_name(name)
            t = L.parse_tierfs_manifest_name(name)
            if m is not None and m[0] == job and m[1] not in keep:
                pointers.append(name)
            elif t is not None and t[0] == job and t[1] not in keep:
                manifests.append(name)

        def data_names(e: NodeEntry) -> set[str]:
            hashes = set(e.backup.hashes.values()) if e.backup is not None else set()
            hashes |= {h for h in e.metas.values() if h is not None}
            return {L.data_name(h) for h in hashes}

        for (_r, step), e in info.parts.items():
            if step not in keep:
                heads |= data_names(e)
        kept = set().union(*(data_names(e) for (_r, step), e in info.parts.items() if step in keep))
        data = [n for n in info.objects if n.split("/", 1)[0] in heads - kept]
        count = 0
        for batch in (pointers, manifests, data):
            count += sum(
                run_parallel(
                    self.objects.settings.threads,
                    [functools.partial(self._rm, prefix + n) for n in batch],
                    None,
                )
            )
        return count

    def _rm(self, name: str) -> int:
        return int(self.objects.delete(name))
