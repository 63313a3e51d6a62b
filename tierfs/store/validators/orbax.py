"""Orbax steps: committed by the step's own metadata, OCDBT stores whole.

What Orbax writes (google/orbax, ``checkpoint/orbax/checkpoint/_src``):

* ``_CHECKPOINT_METADATA`` in the step directory (``metadata/checkpoint.py``),
  JSON with ``item_handlers``, ``init_timestamp_nsecs`` and
  ``commit_timestamp_nsecs``; ``path/atomicity.py`` ``finalize`` sets the commit
  timestamp before it renames ``<step>.orbax-checkpoint-tmp`` to ``<step>``.
* ``commit_success.txt``: written by ``CommitFileTemporaryPath`` in every
  version, and by ``AtomicRenameTemporaryPath.finalize`` only since orbax
  0.12.3 (commit a97e5061, "Write commit_success.txt on all finalized
  checkpoints"); 0.11.x, 0.12.0 and 0.12.1 renaming steps never write it. So
  the commit record is ``commit_success.txt`` *or* a set
  ``commit_timestamp_nsecs``; a step whose ``_CHECKPOINT_METADATA`` has neither
  was not finalized. (In commit-file mode, which writes in place, ``finalize``
  sets the timestamp just before it writes ``commit_success.txt``; a judgement
  in that instant would take the timestamp. tierfs seals such a step only when
  ``commit_success.txt`` appears, so the seal path never sees that instant.)
* per item (a subdirectory named in ``item_handlers``, or the step itself
  when it is one unnamed item): ``_METADATA`` (pytree metadata JSON with
  ``use_ocdbt``), and with OCDBT (tensorstore ``kvstore/ocdbt``) a merged
  ``manifest.ocdbt`` plus ``ocdbt.process_<i>/manifest.ocdbt`` and ``d/``
  data files per process; without OCDBT, zarr arrays (``.zarray`` JSON, chunks).

The rule: a commit record as above; every item named by ``item_handlers`` is
present; every JSON file parses; every OCDBT manifest has tensorstore's magic
``0x0cdb3a2a``, its length field equals the file size and its crc32c footer
matches; ``ocdbt.process_<i>`` directories are numbered 0..N-1 without a gap,
each with its manifest; no file where bytes must be is empty.
"""

from __future__ import annotations

import json
import re
from typing import Any

import google_crc32c

from tierfs.store.validators.model import Findings, ReadFailed, StepFiles, base, parent, read_bytes

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
PYTREE_METADATA = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
OCDBT_MAGIC = 0x0CDB3A2A
PROCESS_DIR = re.compile(r"^ocdbt\.process_(?P<i>\d+)$")
TMP_MARK = ".orbax-checkpoint-tmp"
#: files of an Orbax step that are empty by design: the commit record, and the MTC
#: marker newer Orbax versions write into a step to have it backed up at once
#: (PROTOCOL.md section 3)
EMPTY_BY_DESIGN = frozenset({COMMIT_SUCCESS, "_BACKUP_REQUESTED"})
#: files Orbax writes as JSON
JSON_FILES = frozenset({CHECKPOINT_METADATA, PYTREE_METADATA, "_sharding", ".zarray", "zarr.json"})
#: the most bytes of one metadata file read to judge it
MAX_METADATA = 64 << 20
#: item handlers whose directories hold a pytree (``_METADATA``)
PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")


def is_orbax(files: StepFiles) -> bool:
    """True if the step looks like an Orbax step (its metadata or an OCDBT store)."""
    for path, _ in files.step_files():
        name = base(path)
        if name in (CHECKPOINT_METADATA, OCDBT_MANIFEST, PYTREE_METADATA):
            return True
        if any(PROCESS_DIR.match(part) for part in path.split("/")):
            return True
    return False


def check_orbax(files: StepFiles, out: Findings) -> None:
    """Judge an Orbax step (see the module docstring)."""
    out.format("orbax")
    step = files.name
    meta_path = f"{step}/{CHECKPOINT_METADATA}"
    meta = _json(files, meta_path, out) if meta_path in files.sizes else None
    _commit(files, meta_path, meta, out)
    if isinstance(meta, dict):
        _items(files, meta.get("item_handlers"), out)
    for path, size in files.step_files():
        name = base(path)
        if TMP_MARK in path[len(step) :]:
            out.unfinished(path, "inside an Orbax temp directory: that item was never finalized")
            continue
        if name in JSON_FILES or parent(path).endswith("/array_metadatas"):
            if path != meta_path:
                _json(files, path, out)
        elif name == OCDBT_MANIFEST or re.match(r"^manifest\.[0-9a-f]{16}$", name):
            _manifest(files, path, size, out)
        elif size == 0 and "/d/" in f"/{path}":
            out.damaged(path, "0 bytes: an OCDBT data file is never empty")
        elif size == 0 and name not in EMPTY_BY_DESIGN and not name.endswith(".__lock"):
            out.damaged(path, "0 bytes in an Orbax step (none of the files Orbax writes is empty)")
    _processes(files, out)


def _commit(files: StepFiles, meta_path: str, meta: Any, out: Findings) -> None:
    commit = f"{files.name}/{COMMIT_SUCCESS}"
    if commit in files.sizes:
        out.checked.add(commit)
        return
    if meta_path not in files.sizes:
        out.missing(
            meta_path,
            f"absent (and no {COMMIT_SUCCESS}): Orbax writes it on the primary host (rank 0)",
        )
        return
    if not isinstance(meta, dict):
        return  # unreadable or damaged: already recorded
    if meta.get("commit_timestamp_nsecs"):
        out.note(
            f"{files.name}: no {COMMIT_SUCCESS} (orbax 0.11-0.12.1 renaming steps write none); "
            "committed per commit_timestamp_nsecs in _CHECKPOINT_METADATA"
        )
        return
    out.unfinished(
        meta_path,
        f"no commit_timestamp_nsecs and no {COMMIT_SUCCESS}: the save was never finalized",
    )


def _items(files: StepFiles, handlers: Any, out: Findings) -> None:
    if not isinstance(handlers, dict):
        return  # one unnamed item in the step directory itself (a str), or not recorded
    for item, handler in sorted(handlers.items()):
        if not isinstance(item, str) or "/" in item or item in ("", ".", ".."):
            continue
        directory = f"{files.name}/{item}"
        inside = [p for p, _ in files.under(directory)]
        if not inside:
            out.missing(directory, f"item {item!r} named in _CHECKPOINT_METADATA is absent")
            continue
        if isinstance(handler, str) and handler.endswith(PYTREE_HANDLERS):
            meta = f"{directory}/{PYTREE_METADATA}"
            if meta not in files.sizes:
                out.missing(meta, f"item {item!r} ({handler.rsplit('.', 1)[-1]}) has no _METADATA")


def _processes(files: StepFiles, out: Findings) -> None:
    per_store: dict[str, set[int]] = {}
    for path, _ in files.step_files():
        parts = path.split("/")
        for k, part in enumerate(parts[:-1]):
            m = PROCESS_DIR.match(part)
            if m:
                per_store.setdefault("/".join(parts[:k]), set()).add(int(m["i"]))
    for store, ids in sorted(per_store.items()):
        for i in sorted(set(range(max(ids) + 1)) - ids):
            out.missing(
                f"{store}/ocdbt.process_{i}",
                f"absent while ocdbt.process_{max(ids)} exists: process {i}'s part is in no "
                "known rank's files",
            )
        for i in sorted(ids):
            manifest = f"{store}/ocdbt.process_{i}/{OCDBT_MANIFEST}"
            if manifest not in files.sizes:
                out.missing(manifest, f"process {i}'s OCDBT store has no manifest")
        merged = f"{store}/{OCDBT_MANIFEST}"
        if merged not in files.sizes:
            out.missing(merged, "absent: the merged OCDBT manifest (written by the primary host)")


def _json(files: StepFiles, path: str, out: Findings) -> Any:
    out.checked.add(path)
    size = files.sizes[path]
    if size == 0:
        out.damaged(path, "0 bytes: Orbax metadata is JSON, never empty")
        return None
    if size > MAX_METADATA or not files.readable(path):
        return None
    try:
        data = read_bytes(files, path)
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError):
        out.damaged(path, f"not JSON ({size} bytes): cut off or overwritten")
        return None


def check_ocdbt_manifest(data: bytes) -> str | None:
    """Judge the bytes of one OCDBT manifest; None if whole, else what is wrong.

    The layout (tensorstore ``kvstore/ocdbt/index.rst``, "Manifest format"):
    ``uint32be`` magic ``0x0cdb3a2a``, ``uint64le`` length of the whole
    manifest, varint version and compression, the body, and a ``uint32le``
    crc32c of everything before it.
    """
    if len(data) < 16:
        return f"{len(data)} bytes: shorter than an OCDBT manifest header and footer"
    if int.from_bytes(data[:4], "big") != OCDBT_MAGIC:
        return "does not start with the OCDBT magic 0x0cdb3a2a"
    length = int.from_bytes(data[4:12], "little")
    if length != len(data):
        return f"header says {length} bytes, the file has {len(data)}"
    crc = int.from_bytes(data[-4:], "little")
    if int(google_crc32c.value(data[:-4])) != crc:
        return "crc32c footer does not match its bytes"
    return None


def _manifest(files: StepFiles, path: str, size: int, out: Findings) -> None:
    out.checked.add(path)
    if size == 0:
        out.damaged(path, "0 bytes: an OCDBT manifest is never empty")
        return
    if size > MAX_METADATA or not files.readable(path):
        return
    try:
        data = read_bytes(files, path)
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return
    problem = check_ocdbt_manifest(data)
    if problem:
        out.damaged(path, f"OCDBT manifest {problem}")
