"""torch.distributed.checkpoint (DCP) steps written by ``FileSystemWriter``.

The layout (torch/distributed/checkpoint/filesystem.py): each rank writes
``__<rank>_<n>.distcp`` files into the checkpoint directory; the coordinator
(rank 0) writes ``.metadata`` last (``finish``: ``.metadata.tmp`` renamed over
``.metadata``), a pickled ``Metadata`` whose ``storage_data`` names, for every
tensor chunk and byte item, the file, offset and length ``FileSystemReader``
will read. Without collectives (``use_collectives=False``) every rank writes
its own ``__<rank>.metadata`` naming only its files. ``dcp.load`` fails when
``.metadata`` is missing (``metadata is None``) or a named file or byte range
is not there.

The rule: in every directory holding ``.distcp`` files or a metadata file,
the metadata exists, parses (safely, :mod:`.dcp_pickle`) and every range it
names lies within a file of the known parts (any rank's), whose size covers
``offset + length``.
"""

from __future__ import annotations

import posixpath
import re

from tierfs.store.validators.dcp_pickle import BadMetadata, parse_metadata
from tierfs.store.validators.model import Findings, ReadFailed, StepFiles, base, parent, read_bytes

METADATA = ".metadata"
RANK_METADATA = re.compile(r"^__(?P<rank>\d+)\.metadata$")
DISTCP = re.compile(r"^__(?P<rank>\d+)_(?P<n>\d+)\.distcp$")
#: the most bytes of one ``.metadata`` read into memory
MAX_METADATA_BYTES = 1 << 30


def dcp_dirs(files: StepFiles) -> list[str]:
    """Directories of the step that hold a DCP checkpoint (metadata or ``.distcp`` files)."""
    found = set()
    for path, _ in files.step_files():
        name = base(path)
        if (
            name in (METADATA, METADATA + ".tmp")
            or RANK_METADATA.match(name)
            or name.endswith(".distcp")
        ):
            found.add(parent(path))
    return sorted(found)


def check_dcp(files: StepFiles, out: Findings) -> None:
    """Judge every DCP directory of the step (see the module docstring)."""
    for directory in dcp_dirs(files):
        out.format("dcp")
        _check_dir(files, directory, out)


def _check_dir(files: StepFiles, directory: str, out: Findings) -> None:
    names = {base(p): s for p, s in files.sizes.items() if parent(p) == directory}
    global_md = posixpath.join(directory, METADATA)
    rank_mds = sorted(n for n in names if RANK_METADATA.match(n))
    if METADATA in names:
        _check_metadata(files, global_md, out)
        return
    if rank_mds:  # use_collectives=False: one metadata file per rank, rank 0's must exist
        ranks = {int(m["rank"]) for n in names if (m := DISTCP.match(n))}
        have = {int(RANK_METADATA.match(n)["rank"]) for n in rank_mds}  # type: ignore[index]
        for rank in sorted(ranks - have):
            out.missing(
                posixpath.join(directory, f"__{rank}.metadata"),
                f"rank {rank} wrote .distcp files here but its metadata file is in no known part",
            )
        for name in rank_mds:
            _check_metadata(files, posixpath.join(directory, name), out)
        return
    tmp = METADATA + ".tmp" in names
    out.missing(
        global_md,
        "absent: dcp.load needs it (written last by the coordinator, rank 0)"
        + ("; only .metadata.tmp is there, the save did not finish" if tmp else ""),
    )


def _check_metadata(files: StepFiles, path: str, out: Findings) -> None:
    out.checked.add(path)
    size = files.sizes[path]
    if size == 0:
        out.damaged(path, "0 bytes: a DCP metadata file is a pickle, never empty")
        return
    if size > MAX_METADATA_BYTES:
        out.unreadable(path, f"{size} bytes, more than the {MAX_METADATA_BYTES} read to judge it")
        return
    try:
        data = read_bytes(files, path)
    except ReadFailed as exc:
        out.unreadable(path, f"its references cannot be checked here: {exc}")
        return
    if len(data) != size:
        out.damaged(path, f"{len(data)} bytes readable, the manifest says {size}")
        return
    try:
        md = parse_metadata(data)
    except BadMetadata as exc:
        out.damaged(path, f"not a DCP Metadata pickle: {exc}")
        return
    directory = parent(path)
    stored = {ref.fqn for ref in md.refs}
    for fqn in sorted(md.fqns - stored)[:5]:
        out.damaged(path, f"declares {fqn!r} but names no storage for it")
    ends: dict[str, tuple[int, str]] = {}
    for ref in md.refs:
        rel = ref.relative_path
        if not _safe(rel):
            out.damaged(path, f"names an unsafe file {rel!r} for {ref.fqn!r}")
            continue
        if ref.offset < 0 or ref.length < 0:
            out.damaged(path, f"names a negative range for {ref.fqn!r} in {rel}")
            continue
        end = ref.offset + ref.length
        if rel not in ends or end > ends[rel][0]:
            ends[rel] = (end, ref.fqn)
    for rel, (end, fqn) in sorted(ends.items()):
        target = posixpath.join(directory, rel)
        out.checked.add(target)
        if target not in files.sizes:
            out.missing(
                target,
                f"absent from every known part; {base(path)} names it for {fqn!r} "
                f"(bytes up to {end})",
            )
        elif files.sizes[target] < end:
            have = files.sizes[target]
            out.damaged(
                target,
                f"{have} bytes{files.where(target)}, but {base(path)} names bytes up to {end} "
                f"(for {fqn!r})" + ("; truncated to 0 bytes" if have == 0 else ""),
            )
    out.note(
        f"{path}: {len(md.refs)} storage entries in {len(ends)} files checked "
        f"(DCP metadata version {md.version or 'unset'})"
    )


def _safe(rel: str) -> bool:
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))
