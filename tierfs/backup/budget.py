"""Bucket requests of one backup round and of one restore, as the code makes them
(pure; issue #17). The table in docs/BACKUPS.md ("Requests per round") is
:func:`markdown_table`.

Counts are HTTP requests against the bucket, split as GCS bills and rate-limits
them: object writes (uploads of data, manifests, pointers, the round index),
object reads (downloads, small-object GETs; a GET of a missing object counts
too) and list calls (one per page of at most :data:`LIST_PAGE` entries; GCS
counts listings against the read rate). Retries are not counted.

Assumptions, each a parameter: a node part of ``files`` data objects under
one data name (directory data: orbax, pytorch.distributed, generic; with
``pytorch``'s file per GPU every file is its own data name, ``heads=files``),
``workers`` pointers per part, no data-parallel sharing, a fresh round (the
resume listing finds nothing), one round in the bucket, ``restore.version``
absent.
"""

from __future__ import annotations

from dataclasses import dataclass

#: entries per page of a GCS listing (objects and prefixes alike)
LIST_PAGE = 1000
#: GCS's starting request rates per bucket (they ramp up x2 every 20 minutes)
BASE_WRITES_PER_S = 1000.0
BASE_READS_PER_S = 5000.0


def pages(entries: int) -> int:
    """List calls of a listing of ``entries`` results (at least one)."""
    return max(1, -(-entries // LIST_PAGE))


@dataclass(frozen=True)
class Requests:
    """A number of bucket requests.

    Attributes:
        writes: object writes. reads: object reads (GETs). lists: list calls (pages).
    """

    writes: int = 0
    reads: int = 0
    lists: int = 0

    def __add__(self, other: Requests) -> Requests:
        return Requests(
            self.writes + other.writes, self.reads + other.reads, self.lists + other.lists
        )

    def times(self, n: int) -> Requests:
        """These requests made ``n`` times."""
        return Requests(self.writes * n, self.reads * n, self.lists * n)

    def seconds(
        self, writes_per_s: float = BASE_WRITES_PER_S, reads_per_s: float = BASE_READS_PER_S
    ) -> float:
        """Seconds the requests take at least at these rates (writes and reads are
        separate budgets; list calls count as reads)."""
        return max(self.writes / writes_per_s, (self.reads + self.lists) / reads_per_s)


@dataclass(frozen=True)
class RoundCost:
    """Requests of one backup round or one restore.

    Attributes:
        node: one node other than node-rank 0. rank0: node-rank 0 (it also does
            the coordinator's work). total: the whole job.
    """

    node: Requests
    rank0: Requests
    total: Requests


def _round_objects(nodes: int, files: int, workers: int) -> int:
    """Objects in a complete round: data, one manifest and ``workers`` pointers per node."""
    return nodes * (files + 1 + workers)


def backup_round(
    nodes: int, files: int, *, workers: int = 1, heads: int = 1, index: bool = True
) -> RoundCost:
    """Requests of one backup round of ``nodes`` nodes, ``files`` data objects per part.

    Per node (:meth:`tierfs.backup.upload.Uploader.upload_shard`): one resume
    listing per data name (``heads``), ``files`` data writes, its manifest, its
    ``workers`` pointers. With ``index``, node-rank 0 then writes the round index
    (:mod:`tierfs.backup.round_index`): one listing of the round's top level
    (manifests, pointers and data names, delimiter ``/``) and one write.
    """
    per = Requests(writes=files + 1 + workers, lists=heads * pages(max(1, files // heads)))
    rank0 = per
    if index:
        top = nodes * (1 + workers) + nodes * heads
        rank0 = per + Requests(writes=1, lists=pages(top))
    return RoundCost(per, rank0, per.times(nodes - 1) + rank0)


def restore(nodes: int, files: int, *, workers: int = 1, index: bool = True) -> RoundCost:
    """Requests of one restore of ``nodes`` nodes from one complete round.

    Node-rank 0, as the coordinator's bucket reader
    (:meth:`tierfs.backup.fetch.BucketRestore.read_bucket`): ``restore.version``
    (a GET answered 404), the round names (one listing), the round judged (a
    listing of every object of the round, one GET per manifest; pointers whose
    listed crc32c is the expected one are not read), and with the index one GET
    that finds the round's index (a round without one gets it written then: one
    listing and one write more, once). Then every node fetches its
    part (:meth:`tierfs.backup.fetch.BucketRestore.fetch_backup`): without the
    index it judges the whole round again (the same listing and ``nodes``
    manifest GETs; a round without an index costs that plus the GET that finds
    no index); with it, one GET of the index and one of its own manifest.
    Then its ``files`` data GETs. Reads by the loadability verdict (a few small
    files of the step) are not counted.
    """
    whole = Requests(reads=nodes, lists=pages(_round_objects(nodes, files, workers)))
    coordinator = Requests(reads=2 if index else 1, lists=1) + whole
    own = Requests(reads=2) if index else whole
    per = own + Requests(reads=files)
    rank0 = coordinator + per
    return RoundCost(per, rank0, per.times(nodes - 1) + rank0)


def markdown_table(node_counts: tuple[int, ...] = (100, 1000, 10000), files: int = 64) -> str:
    """The docs/BACKUPS.md table: requests and seconds at base rates, per round."""
    rows = [
        "| N nodes | what | per node (w/r/l) | node-rank 0 (w/r/l) | total writes "
        "| total reads | total lists | seconds at base rates |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def fmt(r: Requests) -> str:
        return f"{r.writes:,}/{r.reads:,}/{r.lists:,}"

    for n in node_counts:
        for what, cost in (
            ("backup round, no index (before)", backup_round(n, files, index=False)),
            ("backup round, round index", backup_round(n, files)),
            ("restore, no index (before)", restore(n, files, index=False)),
            ("restore, round index", restore(n, files)),
        ):
            t = cost.total
            rows.append(
                f"| {n:,} | {what} | {fmt(cost.node)} | {fmt(cost.rank0)} | {t.writes:,} | "
                f"{t.reads:,} | {t.lists:,} | {t.seconds():,.0f} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
