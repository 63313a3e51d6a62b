"""A backup round's step judged over every rank's uploaded part (issue #15 item 2).

Node-rank 0 judges a multi-node step across ranks (:mod:`tierfs.node.whole_step`)
and keeps that verdict beside its own manifest in RAM; each rank's uploaded
manifest carries only its part's own seal-time verdict. After the cluster
lost its RAM, a rank-1 DCP shard shorter than rank 0's ``.metadata`` says
looked fine part by part, and the restore from the bucket took a step DCP
cannot load. So the restore's bucket reader and ``tierfs backups list``
judge a round's complete step again from the uploaded manifests, with the
same rules (:func:`tierfs.store.verdicts.judge_whole`): the small files the
rules read (DCP ``.metadata``, index files, JSON metadata, headers) are read
from the round's objects, each whole and checked against its manifest's size
and crc32c (a file larger than :data:`READ_LIMIT` or an object that differs is
judged by its size only, as a file on another node is).

Blocking (bucket reads): call from worker threads. One object read per small
file a rule needs (typically one: rank 0's ``.metadata``) per round judged.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from tierfs.backup.judge import RoundInfo
from tierfs.backup.layout import NodeBackup
from tierfs.core.types import WholeVerdict
from tierfs.store.validators import READ_LIMIT as VALIDATOR_READ_LIMIT
from tierfs.store.validators import Reader, checked_reader
from tierfs.store.verdicts import judge_whole, loads_across, loads_summary

log = logging.getLogger(__name__)

#: bytes of one file the judgement reads whole from the bucket; larger files are
#: judged by their sizes (their own node read them at seal time)
READ_LIMIT = VALIDATOR_READ_LIMIT


def object_reader(objects: Any, job: str, round_name: str, part: NodeBackup) -> Reader:
    """A :data:`~tierfs.store.validators.Reader` of one rank's part in a backup round.

    Args:
        objects: the bucket's objects (:class:`tierfs.backup.bucket.ObjectStore`:
            ``spec``, ``get_bytes``).
        part: the rank's uploaded tierfs manifest (paths -> object names).

    The reader raises OSError (the rules report the file ``unreadable`` and
    judge it by its size): ENOENT (no such file or object), EFBIG (larger than
    :data:`READ_LIMIT`), EIO (the object's size or crc32c differs from the
    manifest); and what the bucket client raises, as OSError(EIO).
    """
    prefix = objects.spec.round_dir(job, round_name)

    def get(relpath: str) -> bytes:
        obj = part.objects.get(relpath)
        if obj is None:
            raise OSError(errno.ENOENT, "not a file of the part", relpath)
        try:
            got = objects.get_bytes(prefix + obj)
        except Exception as exc:
            raise OSError(errno.EIO, f"bucket read failed: {exc}", relpath) from exc
        if got is None:
            raise OSError(errno.ENOENT, f"object {obj} not found", relpath)
        return bytes(got)

    return checked_reader(part.manifest.files, get, READ_LIMIT)


def _parts_of_step(info: RoundInfo) -> tuple[int, list[NodeBackup]] | None:
    """The round's complete step and every writer rank's tierfs manifest of it, in
    rank order; None without a complete step or when a part was written by MTC
    (no tierfs manifest, no verdict)."""
    step = info.complete_step
    if step is None:
        return None
    ranks = sorted(r for (r, s), e in info.parts.items() if s == step and e.complete)
    backups = [info.parts[(r, step)].backup for r in ranks]
    if not ranks or ranks != list(range(len(ranks))):
        return None
    found = [b for b in backups if b is not None]
    if len(found) != len(backups):
        return None
    writers = found[0].manifest.nodes or found[0].nodes or len(found)
    if writers != len(found):
        return None
    return step, found


def judge_round_step(backend: Any, job: str, info: RoundInfo) -> tuple[int, WholeVerdict] | None:
    """The round's complete step judged over every rank's part (blocking).

    ``backend``: the bucket (:class:`tierfs.backup.bucket.GcsBackend`).

    Returns:
        ``(step, verdict)`` for a step written by several nodes; None for a
        one-node step (its part's own verdict, judged with all its bytes,
        says it), a round without a complete step, a round written by MTC, or
        a judgement that failed (logged). Never raises.
    """
    found = _parts_of_step(info)
    if found is None or len(found[1]) < 2:
        return None
    step, parts = found
    readers = {p.manifest.rank: object_reader(backend.objects, job, info.name, p) for p in parts}
    verdict = judge_whole([p.manifest for p in parts], {}, readers=readers)
    if verdict is None:
        return None
    if verdict.unloadable:
        log.info(
            "round %s: step %d is not loadable across its %d ranks: %s",
            info.name,
            step,
            len(parts),
            verdict.unloadable,
        )
    return step, verdict


def round_loads(backend: Any, job: str, info: RoundInfo) -> str | None:
    """The ``loads`` words of a round's complete step for ``tierfs backups list``
    (blocking): ``yes (dcp, all 2 ranks)``, ``no, across its 2 ranks: ...``,
    ``no: ...`` for a one-node step; None when not judged (no complete step, a
    round written by MTC, parts sealed before verdicts existed)."""
    found = _parts_of_step(info)
    if found is None:
        return None
    _, parts = found
    if len(parts) == 1:
        return loads_summary(parts[0].manifest.verdict, whole=True)
    judged = judge_round_step(backend, job, info)
    return loads_across(judged[1], len(parts)) if judged is not None else None
