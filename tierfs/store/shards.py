"""The local tier: sealed snapshots in the RAM store, their manifests and retention.

A sealed shard lives at ``store/shards/<job>/<rank>/<step>/``::

    data/<entry>/...     hard links of the client's files (no data copy on tmpfs)
    manifest.json        see tierfs.store.manifest

Shards of this node's rank are made by :meth:`ShardStore.snapshot`; peers'
replicas and GCS downloads arrive in ``store/incoming/`` and are committed
with :meth:`ShardStore.commit`. Either way a shard appears with one rename,
so a crash never leaves a half-written shard in the catalog.

Every method here blocks (filesystem walks, checksums): call from worker
threads, never from the FUSE thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.errors import StorageError
from tierfs.core.types import WholeVerdict
from tierfs.store.manifest import (
    CHUNK,
    CrcCache,
    Manifest,
    ManifestError,
    check_entries,
    check_self_contained,
    check_tree,
    scan_tree,
)
from tierfs.store.ramstore import RamStore
from tierfs.store.verdicts import judge_part, with_earlier_files

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: beside the manifest: the step judged across ranks by this node (tierfs.node.whole_step)
WHOLE = "whole.json"


@dataclass(frozen=True, order=True)
class ShardKey:
    """(job, rank, step): one node rank's data of one step."""

    job: str
    rank: int
    step: int

    def __str__(self) -> str:
        return f"{self.job}/n{self.rank}/s{self.step}"


@dataclass
class Shard:
    """A committed shard in the RAM store.

    Attributes:
        key: (job, rank, step).
        path: the shard directory.
        manifest: its manifest.
        verified: checksums were re-checked since this daemon loaded it.
        checked_at: ``time.monotonic()`` when this daemon last computed or checked
            the crc32c of every byte (sealed here, received verified, or
            :meth:`ShardStore.verify` passed); None since it was loaded from the
            store at startup (a restore re-checks it, :func:`needs_check`).
        whole: its step judged across ranks by this node, as read at load
            (:meth:`ShardStore.save_whole`), or None.
        bad: the manifest paths (relative to :attr:`data`) of the files the last
            :meth:`ShardStore.verify` found wrong or missing (empty: none).
    """

    key: ShardKey
    path: str
    manifest: Manifest
    verified: bool = False
    inodes: set[int] = field(default_factory=set)
    whole: WholeVerdict | None = None
    checked_at: float | None = None
    bad: tuple[str, ...] = ()

    @property
    def data(self) -> str:
        return os.path.join(self.path, "data")

    @property
    def bytes(self) -> int:
        return self.manifest.total_bytes


def needs_check(checked_at: float | None, now: float, window: float) -> bool:
    """Whether a held copy's bytes must be re-checked before a restore round counts it
    (pure).

    Args:
        checked_at: :attr:`Shard.checked_at` (``time.monotonic()`` seconds, or None:
            never checked by this daemon).
        now: ``time.monotonic()``.
        window: seconds a check stays good (``$TIERFS_REVERIFY_AFTER``); 0: every
            copy is re-checked.

    Returns:
        True if never checked by this daemon, or checked ``window`` seconds ago or more.
    """
    return checked_at is None or window <= 0 or now - checked_at >= window


class SealBusy(StorageError):
    """A file of the step is still open for writing; seal again after it is closed."""


def link_tree(src: str, dst: str) -> None:
    """Recreate ``src`` at ``dst`` with hard-linked files, copied dirs and symlinks.

    Sockets, FIFOs and devices are skipped. Same filesystem only.

    Raises:
        OSError: ``src`` vanished, EXDEV across filesystems.
    """
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst, stat.S_IMODE(st.st_mode) | 0o700)
        for name in os.listdir(src):
            link_tree(os.path.join(src, name), os.path.join(dst, name))
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        try:
            os.chown(dst, st.st_uid, st.st_gid)
        except PermissionError:
            pass
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        os.link(src, dst)


def drop_files(root: str, which: Callable[[int], bool]) -> int:
    """Unlink every regular file under ``root`` whose inode number ``which`` names;
    returns how many."""
    dropped = 0
    for top, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and which(st.st_ino):
                os.unlink(path)
                dropped += 1
    return dropped


def file_inodes(root: str) -> set[int]:
    """Inode numbers of every regular file under ``root``."""
    out: set[int] = set()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.add(st.st_ino)
    return out


class ShardStore:
    """The catalog of shards on disk under ``store/shards``.

    Args:
        ram: the RAM store.
    """

    def __init__(self, ram: RamStore) -> None:
        self.ram = ram

    def path_of(self, key: ShardKey) -> str:
        return os.path.join(self.ram.shards, key.job, str(key.rank), str(key.step))

    def load(self) -> dict[ShardKey, Shard]:
        """Scan the store; unreadable shards are moved to trash. Blocking."""
        found: dict[ShardKey, Shard] = {}
        for job in sorted(os.listdir(self.ram.shards)):
            job_dir = os.path.join(self.ram.shards, job)
            for rank in os.listdir(job_dir):
                rank_dir = os.path.join(job_dir, rank)
                for step in os.listdir(rank_dir):
                    path = os.path.join(rank_dir, step)
                    try:
                        with open(os.path.join(path, MANIFEST), "rb") as f:
                            manifest = Manifest.from_json(f.read())
                        key = ShardKey(manifest.job, manifest.rank, manifest.step)
                        if (key.job, str(key.rank), str(key.step)) != (job, rank, step):
                            raise ManifestError("manifest does not match its location")
                    except (OSError, ManifestError) as exc:
                        log.warning("dropping unreadable shard %s: %s", path, exc)
                        self.ram.to_trash(path)
                        continue
                    found[key] = Shard(
                        key,
                        path,
                        manifest,
                        inodes=file_inodes(os.path.join(path, "data")),
                        whole=_read_whole(path),
                    )
        return found

    def save_whole(self, shard: Shard, verdict: WholeVerdict) -> None:
        """Keep ``verdict`` (``shard``'s step judged across ranks) beside its manifest,
        for :meth:`load` after a restart. Blocking.

        Raises:
            OSError: it could not be written (a full tmpfs).
        """
        doc = {
            "digests": list(verdict.digests),
            "unloadable": verdict.unloadable,
            "format": verdict.format,
            "unread": verdict.unread,
        }
        tmp = os.path.join(shard.path, WHOLE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(shard.path, WHOLE))

    def snapshot(
        self,
        view: str,
        key: ShardKey,
        name: str,
        entries: Iterable[str],
        framework: str,
        *,
        cache: CrcCache | None = None,
        writers: Callable[[int], int] | None = None,
        cancelled: Callable[[], bool] | None = None,
        on_inodes: Callable[[set[int]], None] | None = None,
        created: float | None = None,
        judge: bool = True,
        copied: Iterable[str] = (),
        foreign: Callable[[int], bool] | None = None,
        nodes: int = 0,
        replaces: Iterable[tuple[int, str]] = (),
        began: float = 0.0,
        earlier_files: Iterable[str] = (),
    ) -> Shard:
        """Seal: hard-link ``view/<entry>`` for each entry into a new shard and checksum it.

        Args:
            view: the client-visible tree root.
            key: the shard's identity.
            name: its primary top-level entry.
            entries: top-level entries that form the shard.
            framework: recorded in the manifest.
            cache: crc32c cache (see :func:`tierfs.store.manifest.scan_tree`).
            writers: ``writers(inode)`` = open writable handles on that inode.
            cancelled: polled during checksumming.
            on_inodes: told the snapshot's file inodes before they are checksummed
                (so writes opened meanwhile can be noticed).
            created: the seal time to record (Unix seconds; default: now). A step
                sealed again after a write keeps its first seal time, so retention
                (newest by seal time) does not rank it above later steps.
            judge: record in the manifest whether the step's framework could
                load this part (:func:`tierfs.store.verdicts.judge_part`).
            copied: entries (regular files) copied, not hard-linked: files that
                the next step rewrites in place (Megatron's and DeepSpeed's
                tracker files), so that rewrite leaves this snapshot sealed.
            foreign: ``foreign(inode)`` is True for a file that belongs to
                another rank's part (the whole-step view,
                :mod:`tierfs.node.remote_view`): left out of this node's part.
            nodes: the job's node count, recorded as the step's writer topology
                (:attr:`tierfs.store.manifest.Manifest.nodes`; 0 unknown).
            replaces: (node rank, digest) of the parts of an earlier save of the
                step this one replaces (:attr:`tierfs.store.manifest.Manifest.replaces`).
            began: when this node began the save (Unix seconds; 0.0 a first save,
                :attr:`tierfs.store.manifest.Manifest.began`).
            earlier_files: paths (relative to ``view``) of this part's files that
                are of an earlier save of the step than its others (a save cut short
                on this node): each an ``unfinished`` problem of the verdict
                (:func:`tierfs.store.verdicts.with_earlier_files`), so the step is
                never judged loadable nor restored with them.

        Raises:
            SealBusy: a file is still open for writing.
            ManifestError: the step holds a symlink that leaves it (absolute,
                ``..`` past its top, or into another step): no other node could
                restore it safely.
            OSError: an entry vanished or changed meanwhile.
        """
        entries = tuple(entries)
        copy = set(copied)
        inc = self.ram.new_incoming(f"seal-{key.rank}-{key.step}")
        data = os.path.join(inc, "data")
        os.mkdir(data)
        try:
            for entry in entries:
                src, dst = os.path.join(view, entry), os.path.join(data, entry)
                if entry in copy and stat.S_ISREG(os.lstat(src).st_mode):
                    shutil.copy2(src, dst)
                else:
                    link_tree(src, dst)
            if foreign is not None:
                drop_files(data, foreign)
            inodes = file_inodes(data)
            if on_inodes is not None:
                on_inodes(inodes)
            if writers is not None:
                for ino in inodes:
                    if writers(ino) > 0:
                        raise SealBusy(f"{key}: a file is still open for writing")
            files = scan_tree(data, entries, cache=cache, cancelled=cancelled)
            check_entries(files, CHUNK)  # what a peer or a restart would refuse is never sealed
            check_self_contained(files)
            backup = any(f.path.rsplit("/", 1)[-1] == "_BACKUP_REQUESTED" for f in files)
            manifest = Manifest(
                job=key.job,
                rank=key.rank,
                step=key.step,
                name=name,
                framework=framework,
                files=tuple(files),
                backup_requested=backup,
                nodes=nodes,
                chunk_size=CHUNK,
                replaces=tuple(sorted(set(replaces))),
                began=began,
                sealed=time.time(),
            )
            if created is not None:
                manifest = dataclasses.replace(manifest, created=created)
            if judge:
                siblings = [n for n in os.listdir(view) if n not in entries]
                verdict = judge_part(manifest, data, siblings)
                manifest = dataclasses.replace(manifest, verdict=verdict)
            if earlier := sorted(set(earlier_files)):
                verdict = with_earlier_files(manifest.verdict, earlier)
                manifest = dataclasses.replace(manifest, verdict=verdict)
            # the crc32c were computed from these bytes just now: checked
            return self._install(inc, manifest, inodes, verified=False, checked=time.monotonic())
        except BaseException:
            shutil.rmtree(inc, ignore_errors=True)
            raise

    def commit(
        self,
        incoming: str,
        manifest: Manifest,
        *,
        verified: bool,
        checked_at: float | None = None,
    ) -> Shard:
        """Install a shard received in ``incoming`` (holding ``data/``) under its key.

        The caller has verified the bytes (or says so with ``verified``; then
        :attr:`Shard.checked_at` is now, else ``checked_at``: e.g. the time the
        copy its files are hard-linked from was checked).
        """
        return self._install(
            incoming,
            manifest,
            file_inodes(os.path.join(incoming, "data")),
            verified=verified,
            checked=time.monotonic() if verified else checked_at,
        )

    def _install(
        self,
        inc: str,
        manifest: Manifest,
        inodes: set[int],
        verified: bool,
        checked: float | None,
    ) -> Shard:
        with open(os.path.join(inc, MANIFEST), "wb") as f:
            f.write(manifest.to_json())
        key = ShardKey(manifest.job, manifest.rank, manifest.step)
        dest = self.path_of(key)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if os.path.lexists(dest):
            self.ram.to_trash(dest)
        os.rename(inc, dest)
        return Shard(key, dest, manifest, verified=verified, inodes=inodes, checked_at=checked)

    def remove(self, shard: Shard) -> None:
        """Drop a shard (one rename to trash; the bytes go when the trash is emptied)."""
        if os.path.lexists(shard.path):
            self.ram.to_trash(shard.path)

    def verify(self, shard: Shard, cancelled: Callable[[], bool] | None = None) -> list[str]:
        """Re-check every file against the manifest; returns problems as lines
        ``"<path>: <problem>"`` (empty: good) and records the paths in
        :attr:`Shard.bad`."""
        started = time.monotonic()
        found = check_tree(shard.data, shard.manifest.files, cancelled)
        shard.verified = not found
        shard.checked_at = None if found else started
        shard.bad = tuple(path for path, _ in found)
        return [f"{path}: {why}" for path, why in found]

    def materialize(self, shard: Shard, dest_dir: str, renames: dict[str, str]) -> list[str]:
        """Hard-link the shard's top-level entries into ``dest_dir``.

        ``renames`` maps a top-level entry to the name it gets in ``dest_dir``
        (entries not in it keep their name). Returns the names created.

        Raises:
            FileExistsError: a destination name exists.
        """
        created = []
        for entry in shard.manifest.top_level:
            target = renames.get(entry, entry)
            dest = os.path.join(dest_dir, target)
            if os.path.lexists(dest):
                raise FileExistsError(dest)
            link_tree(os.path.join(shard.data, entry), dest)
            created.append(target)
        return created


def retention(
    keys: Iterable[ShardKey],
    keep: int,
    pinned: set[ShardKey],
    age: Callable[[ShardKey], Any] | None = None,
) -> list[ShardKey]:
    """Shards to drop: per (job, rank), all but the newest ``keep``, never a pinned one.

    "Newest" is by ``age(key)`` (larger = newer; default: the step number).
    The node agent passes the seal time, so after a job rolled back to an
    older step the steps it saves now are kept, not the abandoned higher ones.
    Pure policy (unit-tested): ``keep`` >= 1.
    """
    order = age or (lambda k: k.step)
    by_owner: dict[tuple[str, int], list[ShardKey]] = {}
    for k in keys:
        by_owner.setdefault((k.job, k.rank), []).append(k)
    drop = []
    for owned in by_owner.values():
        owned.sort(key=order, reverse=True)
        drop.extend(k for k in owned[keep:] if k not in pinned)
    return sorted(drop)


def _read_whole(path: str) -> WholeVerdict | None:
    """The :data:`WHOLE` file of the shard directory ``path``; None if absent or unreadable."""
    try:
        with open(os.path.join(path, WHOLE)) as f:
            doc = json.load(f)
        return WholeVerdict(
            tuple(str(d) for d in doc["digests"]),
            str(doc.get("unloadable", "")),
            str(doc.get("format", "unknown")),
            str(doc.get("unread", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
