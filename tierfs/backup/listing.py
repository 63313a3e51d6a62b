"""Listing and judging backup rounds, and choosing the round a job restores.

A round is usable for a node only when its pointer exists and every data
object its manifest names exists with the manifest's size and crc32c
(:meth:`RoundListing.inspect_round`, judged by :mod:`tierfs.backup.judge`);
rounds cut off half-way are never chosen. ``restore.version`` names the round
a restore must use (PROTOCOL.md section 5; :meth:`RoundListing.choose_restore`).

Blocking (HTTP); every request goes through :class:`tierfs.backup.bucket.ObjectStore`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierfs.backup import layout as L
from tierfs.backup.client import crc_from_b64, describe_error
from tierfs.backup.judge import (
    NodeEntry,
    ObjectInfo,
    RoundInfo,
    apply_job_nodes,
    infer_job_nodes,
    judge_round,
    meta_crc,
)
from tierfs.backup.layout import LayoutError, NodeBackup

if TYPE_CHECKING:
    from tierfs.backup.bucket import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreChoice:
    """Which backup to restore for a job (see :meth:`RoundListing.choose_restore`).

    Attributes:
        round: the round name, or None for "nothing".
        step: the step in it every node restores, or None.
        forced: chosen through ``restore.version``.
        reason: why nothing was chosen or what was chosen (one line).
        info: the inspected round (None when nothing).
    """

    round: str | None
    step: int | None
    forced: bool = False
    reason: str = ""
    info: RoundInfo | None = None


class RoundListing:
    """The rounds of one bucket spec as the listing shows them (thread-safe).

    Args:
        objects: the bucket's objects (the only way to the bucket).
    """

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.spec = objects.spec

    def read_restore_version(self, job: str) -> str | None:
        """The round named by ``gs://<bucket>/<job>/restore.version`` (stripped), or None.

        Raises:
            google.api_core exceptions after retries (bucket unreachable...).
        """
        data = self.objects.get_bytes(self.spec.restore_version(job))
        if data is None:
            return None
        return data.decode("utf-8", "replace").strip()

    def list_round_names(self, job: str) -> list[str]:
        """Round directory names of ``job``, newest first."""
        _blobs, prefixes = self.objects.listing(self.spec.job_dir(job), delimiter="/")
        base = self.spec.job_dir(job)
        names = [p[len(base) :].rstrip("/") for p in prefixes]
        return sorted((n for n in names if L.is_round_name(n)), reverse=True)

    def inspect_round(
        self,
        job: str,
        round_name: str,
        nodes: int | None = None,
        *,
        fallback: int | None = None,
    ) -> RoundInfo:
        """List one round and judge which step (if any) is complete for every node.

        Args:
            job: the job name.
            round_name: ``YYYY-MM-DD_HH-MM``.
            nodes: the node count to judge against; if None, the largest
                ``nodes`` found in the round's manifests (the node count of the
                job that wrote the round: its writer topology, issue #16), else
                ``fallback``, else the highest rank seen + 1.
            fallback: the node count of a round that records none (a round
                written by MTC): the restoring job's.

        Raises:
            google.api_core exceptions after retries.
        """
        prefix = self.spec.round_dir(job, round_name)
        blobs, _ = self.objects.listing(prefix)
        objects: dict[str, ObjectInfo] = {}
        for b in blobs:
            rel = b.name[len(prefix) :]
            updated = b.updated.timestamp() if getattr(b, "updated", None) else 0.0
            objects[rel] = ObjectInfo(rel, int(b.size or 0), crc_from_b64(b.crc32c), updated)
        metas: dict[tuple[int, int, int], str] = {}
        manifests: dict[tuple[int, int], str] = {}
        for rel in objects:
            if "/" in rel:
                continue
            m = L.parse_meta_name(rel)
            if m is not None and m[0] == job:
                metas[(m[2], m[1], m[3])] = rel
                continue
            t = L.parse_tierfs_manifest_name(rel)
            if t is not None and t[0] == job:
                manifests[(t[2], t[1])] = rel
        fetched = self.objects.get_many(prefix, list(manifests.values()))
        parts: dict[tuple[int, int], NodeEntry] = {}
        seen_nodes = 0
        for (rank, step), name in manifests.items():
            # a manifest without pointer: the upload did not finish
            part = parts.setdefault((rank, step), NodeEntry(rank, step))
            data = fetched.get(name)
            if data is None:
                continue
            try:
                nb = NodeBackup.from_json(data)
            except LayoutError as exc:
                part.notes.append(f"unreadable manifest: {exc}")
                continue
            if (nb.manifest.rank, nb.manifest.step) != (rank, step):
                continue
            part.backup = nb
            seen_nodes = max(seen_nodes, nb.nodes)
        # a pointer listed with the size and crc32c of the hash its part's manifest
        # names holds that hash: read only the others (MTC's, or unexpected ones)
        unread: dict[tuple[int, int, int], str] = {}
        for (rank, step, worker), name in metas.items():
            part = parts.setdefault((rank, step), NodeEntry(rank, step))
            want = part.backup.hashes.get(worker) if part.backup is not None else None
            o = objects[name]
            if want is not None and o.size == len(want) and o.crc32c == meta_crc(want):
                part.metas[worker] = want
            else:
                unread[(rank, step, worker)] = name
        fetched = self.objects.get_many(prefix, list(unread.values()))
        for (rank, step, worker), name in unread.items():
            data = fetched.get(name)
            try:
                parts[(rank, step)].metas[worker] = (
                    L.check_meta_content(data.decode("ascii", "replace"))
                    if data is not None
                    else None
                )
            except LayoutError:
                parts[(rank, step)].metas[worker] = None
        if nodes is None:
            nodes = seen_nodes or fallback or (max((r for r, _ in parts), default=-1) + 1)
        info = RoundInfo(
            round_name,
            nodes,
            parts,
            objects,
            sum(o.size for o in objects.values()),
            recorded_nodes=seen_nodes,
        )
        return judge_round(info)

    def read_part(self, job: str, round_name: str, rank: int, step: int) -> NodeBackup | None:
        """Node ``rank``'s tierfs manifest of ``step`` in one round (one GET), or None
        when the round holds no such object (a round written by MTC has none).

        A part read this way may be incomplete (no pointer yet, or an upload cut
        off): only the objects it names that exist, with the manifest's size and
        crc32c, are its bytes.

        Raises:
            LayoutError: the object is not a tierfs manifest of that part.
            google.api_core exceptions after retries; BucketTimeout.
        """
        name = self.spec.round_dir(job, round_name) + L.tierfs_manifest_name(job, step, rank)
        data = self.objects.get_bytes(name)
        if data is None:
            return None
        nb = NodeBackup.from_json(data)
        m = nb.manifest
        if (m.job, m.rank, m.step) != (job, rank, step):
            raise LayoutError(
                f"{name} describes {m.job}/n{m.rank}/s{m.step}, not {job}/n{rank}/s{step}"
            )
        return nb

    def list_rounds(
        self,
        job: str,
        nodes: int | None = None,
        *,
        on_round: Callable[[RoundInfo], None] | None = None,
        on_names: Callable[[list[str]], None] | None = None,
    ) -> list[RoundInfo]:
        """Inspect every round of ``job``, newest first (see :meth:`inspect_round`).

        Args:
            on_names: told the round names before inspection starts (progress bars).
            on_round: told each inspected round as it finishes (any thread).
        """
        names = self.list_round_names(job)
        if on_names is not None:
            on_names(names)
        out: dict[str, RoundInfo] = {}

        def one(name: str) -> RoundInfo:
            try:
                info = self.inspect_round(job, name, nodes)
            except Exception as exc:
                info = RoundInfo(name, nodes or 0, error=describe_error(exc))
            if on_round is not None:
                on_round(info)
            return info

        workers = max(1, min(4, len(names)))
        with cf.ThreadPoolExecutor(workers) as pool:
            for info in pool.map(one, names):
                out[info.name] = info
        rounds = [out[n] for n in names]
        if nodes is None:
            apply_job_nodes(rounds, infer_job_nodes(rounds))
        return rounds

    def job_nodes(self, job: str) -> int | None:
        """The job's node count as its backups tell it (see :func:`infer_job_nodes`),
        from listings only: the newest round holding a tierfs manifest gives it
        (one manifest read); without one, the most ranks any round holds.
        None when the job has no round with a pointer or manifest.

        Raises:
            google.api_core exceptions after retries.
        """
        most = 0
        for name in self.list_round_names(job):
            prefix = self.spec.round_dir(job, name)
            blobs, _ = self.objects.listing(prefix, delimiter="/")
            for b in blobs:
                rel = b.name[len(prefix) :]
                t = L.parse_tierfs_manifest_name(rel)
                if t is not None and t[0] == job:
                    data = self.objects.get_bytes(b.name)
                    try:
                        nb = NodeBackup.from_json(data) if data is not None else None
                    except LayoutError:
                        nb = None
                    if nb is not None and nb.nodes > 0:
                        return nb.nodes
                m = L.parse_meta_name(rel)
                if m is not None and m[0] == job:
                    most = max(most, m[2] + 1)
                elif t is not None and t[0] == job:
                    most = max(most, t[2] + 1)
        return most or None

    def inspect_round_of_job(
        self, job: str, round_name: str, nodes: int | None = None
    ) -> RoundInfo:
        """:meth:`inspect_round` for one round, judged like :meth:`list_rounds` judges
        it: a round without a tierfs manifest (written by MTC) against the job's
        node count (:meth:`job_nodes`) unless ``nodes`` is given."""
        info = self.inspect_round(job, round_name, nodes)
        if nodes is None and not info.recorded_nodes and info.parts:
            apply_job_nodes([info], self.job_nodes(job))
        return info

    def choose_restore(self, job: str, nodes: int) -> RestoreChoice:
        """The backup every node of ``job`` restores when no step is complete in-cluster.

        ``restore.version`` wins (PROTOCOL.md section 5): if it names a round,
        that round's newest step complete for all ``nodes`` is chosen, and if
        the round is missing or incomplete the choice is *nothing* (no
        fallback). Otherwise the newest round complete for all nodes; partial
        rounds are skipped.

        Raises:
            google.api_core exceptions after retries (the caller decides what an
            unreachable bucket means).
        """
        forced = self.read_restore_version(job)
        if forced is not None:
            if not L.is_round_name(forced):
                return RestoreChoice(
                    None, None, True, f"restore.version names {forced[:40]!r}, not a round"
                )
            info = self.inspect_round(job, forced, fallback=nodes)
            if not info.objects:
                return RestoreChoice(
                    None,
                    None,
                    True,
                    f"restore.version names round {forced}, which does "
                    "not exist; nothing restored (no fallback)",
                )
            if info.complete_step is None:
                why = "; ".join(info.problems()[:3])
                return RestoreChoice(
                    None,
                    None,
                    True,
                    f"restore.version names round {forced}, which is "
                    f"incomplete ({why}); nothing restored (no fallback)",
                    info,
                )
            return RestoreChoice(
                forced,
                info.complete_step,
                True,
                f"restore.version: round {forced} step {info.complete_step}",
                info,
            )
        for name in self.list_round_names(job):
            info = self.inspect_round(job, name, fallback=nodes)
            if info.complete_step is not None:
                return RestoreChoice(
                    name,
                    info.complete_step,
                    False,
                    f"newest complete round {name} step {info.complete_step}",
                    info,
                )
            log.info("backup round %s skipped: %s", name, "; ".join(info.problems()[:2]))
        return RestoreChoice(None, None, False, "no complete backup round")
