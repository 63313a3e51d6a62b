"""The entry point: :func:`judge_step` runs every format's check over one step.

Pure over :class:`StepFiles` (reads only through its callable); the rules
and their sources are in the format modules and in docs/SEMANTICS.md, "What
makes a step complete".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from tierfs.store.manifest import Manifest
from tierfs.store.validators import archive, dcp, hf_index, markers, orbax, trackers
from tierfs.store.validators.model import (
    Findings,
    Reader,
    ReadFailed,
    StepFiles,
    Verdict,
    base,
    read_bytes,
)
from tierfs.store.validators.numpy_npy import check_npy_file
from tierfs.store.validators.safetensors import check_safetensors_file

#: framework layouts come first in a verdict's format, file formats after them
FRAMEWORKS = ("nemo", "megatron", "deepspeed", "orbax", "dcp", "hf-sharded")

#: the most bytes of a plain JSON file of a known layout read to check it parses
MAX_JSON = 64 << 20


def judge_step(files: StepFiles) -> Verdict:
    """Judge whether a step would load, across every rank's part the caller knows.

    Args:
        files: the step's files (see :class:`StepFiles`); bytes are read only
            through ``files.read``, which may block: call from a worker thread.

    Returns:
        the :class:`Verdict`. ``unknown_layout`` means no format was
        recognised (the caller's rename rule decides); ``complete`` is True
        only when no problem was found.

    Never raises for any content of the files (a read that raises OSError is
    reported as ``unreadable``).
    """
    out = Findings()
    markers.check_markers(files, out)
    dcp.check_dcp(files, out)
    if orbax.is_orbax(files):
        orbax.check_orbax(files, out)
    for path, _ in files.step_files():
        _check_file(files, path, out)
    for path in hf_index.index_files(files):
        hf_index.check_hf_index(files, path, out)
    trackers.check_megatron_dir(files, out)
    trackers.check_deepspeed_dir(files, out)
    trackers.check_trackers(files, out)
    if out.formats:
        for path, _ in files.step_files():
            if path.endswith(".json") and path not in out.checked:
                _check_json(files, path, out)
    return Verdict(
        step=files.name,
        format="+".join(sorted(out.formats, key=_rank)) or "unknown",
        complete=not out.problems,
        problems=tuple(out.problems),
        notes=tuple(out.notes),
        unknown_layout=not out.formats,
    )


def _rank(fmt: str) -> int:
    return FRAMEWORKS.index(fmt) if fmt in FRAMEWORKS else len(FRAMEWORKS)


def _check_file(files: StepFiles, path: str, out: Findings) -> None:
    name = base(path)
    if name.endswith(".safetensors"):
        check_safetensors_file(files, path, out)
    elif name.endswith(archive.TORCH_STRICT + archive.TORCH_LOOSE):
        archive.check_torch_file(files, path, out)
    elif name.endswith(".npy"):
        check_npy_file(files, path, out)
    elif name.endswith(".npz"):
        archive.check_npz_file(files, path, out)


def _check_json(files: StepFiles, path: str, out: Findings) -> None:
    out.checked.add(path)
    size = files.sizes[path]
    if size == 0:
        out.damaged(path, "0 bytes: an empty JSON file does not parse")
        return
    if size > MAX_JSON or not files.readable(path):
        return
    try:
        json.loads(read_bytes(files, path))
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
    except (UnicodeDecodeError, ValueError):
        out.damaged(path, "not JSON: cut off or overwritten")


def step_files_from_manifests(
    manifests: Iterable[Manifest],
    local_ranks: Iterable[int] = (),
    read: Reader | None = None,
    siblings: Iterable[str] = (),
    name: str | None = None,
    readers: Mapping[int, Reader] | None = None,
) -> StepFiles:
    """Build :class:`StepFiles` from the manifests of a step's parts.

    Args:
        manifests: one per rank's part known (this node's and the ones the
            catalog or coordinator knows), all of the same step.
        local_ranks: ranks whose part's bytes ``read`` can serve (this node's
            own rank, and ranks it holds a replica of).
        read: reads a path relative to the mount root (the snapshot's data dir).
        siblings: top-level names in the view now (for NeMo's marker).
        name: the step's primary entry; default: the first manifest's ``name``.
        readers: instead of ``read``/``local_ranks``: rank -> a reader of that
            rank's part held here (this node's snapshot, received replicas, e.g.
            :func:`~tierfs.store.validators.snapshot.dir_reader` of each data dir);
            each path is read from the part that holds it.

    A path in several parts keeps the size of a local part, else the lowest
    rank's.

    Raises:
        ValueError: no manifest and no name.
    """
    parts = sorted(manifests, key=lambda m: m.rank)
    local = set(readers) if readers is not None else set(local_ranks)
    parts.sort(key=lambda m: (m.rank not in local, m.rank))
    if name is None:
        if not parts:
            raise ValueError("no manifest to judge")
        name = parts[0].name
    sizes: dict[str, int] = {}
    holders: dict[str, int] = {}
    local_paths: set[str] = set()
    dirs: set[str] = set()
    for m in parts:
        for f in m.files:
            if f.kind == "dir":
                dirs.add(f.path)
            elif f.kind == "file" and f.path not in sizes:
                sizes[f.path] = f.size
                holders[f.path] = m.rank
                if m.rank in local:
                    local_paths.add(f.path)
    if readers is not None:
        by_rank = dict(readers)

        def read_part(path: str, offset: int, length: int) -> bytes:
            return by_rank[holders[path]](path, offset, length)

        read = read_part
    return StepFiles(
        name=name,
        sizes=sizes,
        read=read,
        local=frozenset(local_paths),
        dirs=frozenset(dirs),
        holders=holders,
        siblings=frozenset(siblings),
    )
