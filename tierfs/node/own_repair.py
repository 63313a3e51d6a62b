"""Fetch back this node's own files whose RAM copy failed verification (#14 trial 49 F2).

A node's sealed part shares its bytes with the client's files in the view (hard
links). When a verification finds a file of that part damaged (a peer's pull
reported a bad chunk, a re-verification), the part is discarded and the damaged
files are taken out of the view (:meth:`tierfs.node.view.ClientView.withdraw_bad`),
so no reader gets the wrong bytes. Before this module they stayed out until a
restore of the step, although a verified copy of the same part sat in a peer's
RAM or in the bucket: a load of the node's own shard failed with ENOENT.

:class:`OwnRepair` fetches each such file from the whole-step view's file
sources (:data:`tierfs.core.ports.FileSource`: the peers that hold this node's
replicas, then the bucket), checks it against the discarded manifest's size and
crc32c, and links it back into the view where the view still lacks it: a file
the client wrote meanwhile is left alone, and so is one whose directory the
client removed or replaced (the directory is known by its file handle, taken
when the file left the view: trial 50 saw ``rm -rf step && mkdir step`` get
the old file back into the new directory). Every outcome is one line
in ``replicator.errors``. The part itself is not sealed again here: its replicas
and backups still protect the step.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence

import trio

from tierfs.core import syscalls
from tierfs.core.errors import FetchFailed
from tierfs.core.ports import FileSource
from tierfs.node.jobstate import JobState
from tierfs.store.manifest import FileEntry, crc32c_chunks
from tierfs.store.shards import Shard

log = logging.getLogger(__name__)

#: discarded parts waiting to be repaired, at most (more are only logged)
QUEUE = 64


class OwnRepair:
    """Fetches back this node's own files a discarded copy took out of the view.

    Args:
        view_dir: the RAM store's view (the client's files).
        scratch: a directory on the view's filesystem for files being fetched.
        state: the current job (read only).
        sources: where other copies come from, nearest first (the whole-step view's).
        report: writes one line to ``replicator.errors``.
        notify: tells the kernel a view path changed (its cached entry is dropped).
    """

    def __init__(
        self,
        view_dir: str,
        scratch: str,
        state: JobState,
        sources: Sequence[FileSource],
        report: Callable[[str], None],
        notify: Callable[[str], None],
    ) -> None:
        self.view_dir = view_dir
        self.scratch = scratch
        self.state = state
        self.sources = list(sources)
        self.report = report
        self.notify = notify
        self._send, self._receive = trio.open_memory_channel[
            tuple[Shard, list[str], dict[str, bytes | None] | None]
        ](QUEUE)
        #: files fetched back, and files no copy could serve (status and tests)
        self.repaired = 0
        self.lost = 0

    def taken_out(
        self,
        shard: Shard,
        paths: Sequence[str],
        parents: Mapping[str, bytes | None] | None = None,
    ) -> None:
        """``paths`` of ``shard`` left the view because its copy failed verification
        (trio thread): fetch back the ones of this node's own rank, each into the
        directory it left (``parents``: path → that directory's identity, taken
        before the file left, :meth:`tierfs.node.view.ClientView.withdraw_bad`;
        taken by the repair, in a worker thread, if not given)."""
        job = self.state.job
        if not paths or job is None or shard.key.job != job.name:
            return
        if shard.key.rank != job.node_rank:
            return  # another rank's replica: the whole-step view asks for it again
        try:
            self._send.send_nowait((shard, list(paths), None if parents is None else dict(parents)))
        except trio.WouldBlock:
            log.warning("step %d: %s not fetched back: too many repairs queued",
                        shard.key.step, ", ".join(paths))  # fmt: skip

    async def run(self) -> None:
        """Repair what :meth:`taken_out` queued, one part at a time (background task)."""
        async with self._receive:
            async for shard, paths, parents in self._receive:
                await self.repair(shard, paths, parents)

    def _dir_handle(self, path: str) -> bytes | None:
        """The identity of the view directory that holds ``path`` (relative), None if
        it is gone (:func:`tierfs.core.syscalls.identity`). Blocking."""
        return syscalls.identity(os.path.dirname(os.path.join(self.view_dir, path)))

    async def repair(
        self,
        shard: Shard,
        paths: Sequence[str],
        parents: dict[str, bytes | None] | None = None,
    ) -> None:
        """Fetch ``paths`` of ``shard`` (this node's own discarded part) back into the
        view, each from the first source with verified bytes, into the directory it
        left (``parents``: path → that directory's file handle when it left; taken
        now if not given); one line per file in ``replicator.errors`` either way."""
        entries = {f.path: f for f in shard.manifest.files if f.kind == "file"}
        if parents is None:
            parents = {p: await trio.to_thread.run_sync(self._dir_handle, p) for p in paths}
        for path in paths:
            entry = entries.get(path)
            parent = parents.get(path)
            if entry is None or parent is None:
                continue
            where, why = await self._fetch_back(shard, entry, parent)
            step = shard.key.step
            if where:
                self.repaired += 1
                self.report(
                    f"step {step}: this node's own {path} failed verification in RAM; "
                    f"its sealed bytes were fetched back from {where}"
                )
            elif why:
                self.lost += 1
                self.report(
                    f"step {step}: this node's own {path} failed verification in RAM and "
                    f"is not in the view: {why}"
                )

    async def _fetch_back(self, shard: Shard, entry: FileEntry, parent: bytes) -> tuple[str, str]:
        """(the source that served, "") once ``entry`` is back in the view; ("", why)
        when no source could serve it; ("", "") when the view no longer lacks it (the
        client wrote it, or removed or replaced its directory ``parent``)."""
        if not await trio.to_thread.run_sync(self._placeable, entry.path, parent, None):
            return "", ""  # the client wrote or removed it since: theirs
        job = self.state.job
        if job is None:
            return "", "the job ended"
        tmp = os.path.join(self.scratch, f"own-{uuid.uuid4().hex[:12]}")
        fd = await trio.to_thread.run_sync(self._scratch_file, tmp, entry.size)
        tried: list[str] = []
        try:
            for source in self.sources:
                checked = bool(getattr(source, "checks_written", False))
                try:
                    label = await source.fetch_file(
                        job.name,
                        shard.key.rank,
                        shard.key.step,
                        shard.manifest.digest,
                        entry.path,
                        fd,
                        writers=shard.manifest.nodes,
                        **({"expect": (entry.size, entry.crc32c)} if checked else {}),  # type: ignore[arg-type]
                    )
                except FetchFailed as exc:
                    tried.append(str(exc))
                    continue
                os.lseek(fd, 0, os.SEEK_SET)
                crc, size, _ = await trio.to_thread.run_sync(crc32c_chunks, fd)
                if (size, crc) != (entry.size, entry.crc32c):
                    tried.append(f"{label} served other bytes (crc32c {crc:08x})")
                    await trio.to_thread.run_sync(self._emptied, fd, entry.size)
                    continue
                os.fchmod(fd, entry.mode)
                if not await trio.to_thread.run_sync(self._placeable, entry.path, parent, tmp):
                    return "", ""  # the client got there first
                self.notify(entry.path)
                log.info("step %d: own %s fetched back from %s", shard.key.step, entry.path, label)
                return label, ""
            return "", "; ".join(tried) or "no other tier holds this node's steps"
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return "", f"no room for it ({exc.strerror})"
            raise
        finally:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def _scratch_file(self, tmp: str, size: int) -> int:
        """A new ``size``-byte scratch file at ``tmp`` (read-write descriptor). Blocking."""
        os.makedirs(self.scratch, 0o700, exist_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _emptied(fd: int, size: int) -> None:
        """Zero ``fd`` back to a ``size``-byte hole (for the next source). Blocking."""
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)

    def _placeable(self, path: str, parent: bytes, tmp: str | None) -> bool:
        """Whether the view still lacks ``path`` in the directory whose file handle is
        ``parent`` (the one it left; not a directory the client made anew); with
        ``tmp``, also link ``tmp`` there as ``path`` (False if the name was taken
        first). Blocking."""
        dest = os.path.join(self.view_dir, path)
        try:
            dfd = os.open(os.path.dirname(dest), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if syscalls.identity_of(dfd) != parent:
                return False
            name = os.path.basename(dest)
            if tmp is None:
                try:
                    os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return True
                return False
            try:
                os.link(tmp, name, dst_dir_fd=dfd)
            except FileExistsError:
                return False
            return True
        except OSError:
            return False
        finally:
            os.close(dfd)
