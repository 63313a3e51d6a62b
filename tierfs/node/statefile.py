"""The node's ``state.json``: what a restarted daemon must know of the previous one.

The job (protocol mode), the view's step names, the published restore
markers, the restore state, the seal events not yet acted on and the seals a
write withdrew (with what their next seal replaces), written
atomically into the store directory (mode 0600) and read back at start.
:func:`encode`/:func:`decode` are pure; :func:`save`/:func:`load` do the
file work (blocking: small files, called on the trio thread as before).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tierfs.core import control
from tierfs.core.control import JobSpec
from tierfs.node.resave import EarlierSave
from tierfs.node.sealing import SealCandidate
from tierfs.node.view import Published
from tierfs.store.shards import ShardKey

log = logging.getLogger(__name__)

#: the format's version (``version`` in the file)
STATE_VERSION = 1
#: the file's name in the store directory
STATE_FILE = "state.json"


@dataclass
class SavedState:
    """The persisted part of a node's state.

    Attributes:
        mode: ``protocol``, ``generic`` or ``none``.
        job: the running job (kept across a restart in protocol mode only).
        view_steps: view entry name -> the sealed step it shows.
        published: marker name -> the published restore marker.
        restore: the restore state (``state`` and details).
        pending: seal events not yet acted on (a rename into a step name is the
            only sign a generic-mode step is complete: a restart must not lose it).
        abandoned: view entry name -> the step of this node a restore abandoned
            (never sealed again at a start, :attr:`tierfs.node.steps.StepBook.abandoned`).
        withdrawn: this node's parts whose seal a write withdrew -> their first seal
            time (Unix seconds; :attr:`tierfs.node.steps.StepBook.withdrawn_created`):
            a restart before the re-seal seals the step again at start.
        earlier: this node's parts -> what their next seal replaces (issue #16 F9,
            :meth:`tierfs.node.resave.EarlierSave.to_dict`).
        sealed: this node's parts shown in the view -> when this daemon sealed them
            (Unix seconds): a step written since is sealed again at a start even when
            the withdraw's record was lost (tenth #16 trial NOTE C).
    """

    mode: str = "none"
    job: JobSpec | None = None
    view_steps: dict[str, ShardKey] = field(default_factory=dict)
    published: dict[str, Published] = field(default_factory=dict)
    restore: dict[str, Any] = field(default_factory=lambda: {"state": "idle"})
    pending: list[SealCandidate] = field(default_factory=list)
    abandoned: dict[str, ShardKey] = field(default_factory=dict)
    withdrawn: dict[ShardKey, float] = field(default_factory=dict)
    earlier: dict[ShardKey, EarlierSave] = field(default_factory=dict)
    sealed: dict[ShardKey, float] = field(default_factory=dict)


def encode(saved: SavedState) -> bytes:
    """The file's bytes (JSON, sorted keys). Pure."""
    state = {
        "version": STATE_VERSION,
        "mode": saved.mode,
        "job": saved.job.to_dict() if saved.job else None,
        "view_steps": {n: [k.job, k.rank, k.step] for n, k in saved.view_steps.items()},
        "published": {
            m: [p.sibling, p.key.job, p.key.rank, p.key.step, p.entry]
            for m, p in saved.published.items()
        },
        "restore": saved.restore,
        "pending": {c.name: [c.step, list(c.entries), c.reason] for c in saved.pending},
    }
    if saved.abandoned:  # the key is new (issue #16): a file without it reads the same
        state["abandoned"] = {n: [k.job, k.rank, k.step] for n, k in saved.abandoned.items()}
    if saved.withdrawn:  # new keys (issue #16 F9): a file without them reads the same
        state["withdrawn"] = [[k.job, k.rank, k.step, t] for k, t in saved.withdrawn.items()]
    if saved.earlier:
        state["earlier"] = [[k.job, k.rank, k.step, e.to_dict()] for k, e in saved.earlier.items()]
    shown = set(saved.view_steps.values())
    sealed = [[k.job, k.rank, k.step, t] for k, t in saved.sealed.items() if k in shown]
    if sealed:  # new key (tenth #16 trial NOTE C): a file without it reads the same
        state["sealed"] = sealed
    return json.dumps(state, indent=1, sort_keys=True).encode()


def decode(state: dict[str, Any]) -> SavedState:
    """The state a parsed file describes; a part that does not parse is left out (a
    job only in protocol mode; bad pending entries drop all of them). Pure."""
    saved = SavedState()
    job = state.get("job")
    if job and state.get("mode") == "protocol":
        try:
            saved.job = JobSpec.from_dict(job)
            saved.mode = "protocol"
        except (KeyError, TypeError, ValueError):
            pass
    saved.view_steps = {
        n: ShardKey(j, int(r), int(s)) for n, (j, r, s) in state.get("view_steps", {}).items()
    }
    saved.published = {
        m: Published(m, sib, ShardKey(j, int(r), int(s)), entry)
        for m, (sib, j, r, s, entry) in state.get("published", {}).items()
    }
    saved.restore = state.get("restore", {"state": "idle"})
    try:
        saved.pending = [
            SealCandidate(int(st), n, tuple(e), str(r))
            for n, (st, e, r) in state.get("pending", {}).items()
        ]
    except (TypeError, ValueError):
        saved.pending = []
    try:
        saved.abandoned = {
            n: ShardKey(str(j), int(r), int(s))
            for n, (j, r, s) in (state.get("abandoned") or {}).items()
        }
    except (AttributeError, TypeError, ValueError):
        saved.abandoned = {}
    try:
        saved.withdrawn = {
            ShardKey(str(j), int(r), int(s)): float(t)
            for j, r, s, t in state.get("withdrawn") or ()
        }
    except (TypeError, ValueError):
        saved.withdrawn = {}
    try:
        saved.earlier = {
            ShardKey(str(j), int(r), int(s)): EarlierSave.from_dict(d)
            for j, r, s, d in state.get("earlier") or ()
        }
    except (AttributeError, KeyError, TypeError, ValueError):
        saved.earlier = {}
    try:
        saved.sealed = {
            ShardKey(str(j), int(r), int(s)): float(t) for j, r, s, t in state.get("sealed") or ()
        }
    except (TypeError, ValueError):
        saved.sealed = {}
    return saved


def save(store_dir: str, saved: SavedState) -> None:
    """Write ``state.json`` atomically into ``store_dir`` (0600). A failure (a full
    tmpfs) is logged, never raised: it must not stop sealing or a restore; the
    next save catches up."""
    try:
        control.atomic_write(store_dir, STATE_FILE, encode(saved), 0o600)
    except OSError as exc:
        log.warning("could not save state.json: %s", exc.strerror or exc)


def load(path: str) -> SavedState:
    """The state in ``path``; a missing or unreadable file is the empty state."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    if not isinstance(state, dict):
        state = {}
    return decode(state)


#: node-rank 0's record of the job generation its coordinator serves (issue #16)
GENERATION_FILE = "coordinator-generation.json"


def load_generation(store_dir: str) -> tuple[str, int, int, float] | None:
    """(job, nodes, generation, since) the previous coordinator of this node recorded
    (:class:`tierfs.cluster.coordinator.Coordinator`'s ``generation``), None if none
    or unreadable."""
    try:
        with open(os.path.join(store_dir, GENERATION_FILE), encoding="utf-8") as f:
            d = json.load(f)
        return str(d["job"]), int(d["nodes"]), int(d["generation"]), float(d["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_generation(store_dir: str, job: str, nodes: int, generation: int, since: float) -> None:
    """Record the generation started (atomically, 0600); a failure is only logged."""
    data = {"job": job, "nodes": nodes, "generation": generation, "since": since}
    try:
        control.atomic_write(
            store_dir, GENERATION_FILE, json.dumps(data, sort_keys=True).encode(), 0o600
        )
    except OSError as exc:
        log.warning("could not save %s: %s", GENERATION_FILE, exc.strerror or exc)


def load_gone(store_dir: str) -> tuple[int, ...]:
    """The node ranks declared gone for good in the generation of the
    :data:`GENERATION_FILE` (issue #16); () if none or unreadable."""
    try:
        with open(os.path.join(store_dir, GENERATION_FILE), encoding="utf-8") as f:
            d = json.load(f)
        return tuple(sorted({int(r) for r in d.get("gone", ())}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ()


def save_gone(store_dir: str, gone: tuple[int, ...]) -> None:
    """Record ``gone`` with the generation in :data:`GENERATION_FILE` (atomically,
    0600); a new generation (:func:`save_generation`) clears it. A failure is only
    logged."""
    path = os.path.join(store_dir, GENERATION_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as exc:
        log.warning("could not record the gone ranks in %s: %s", GENERATION_FILE, exc)
        return
    data["gone"] = sorted(gone)
    try:
        control.atomic_write(
            store_dir, GENERATION_FILE, json.dumps(data, sort_keys=True).encode(), 0o600
        )
    except OSError as exc:
        log.warning("could not save %s: %s", GENERATION_FILE, exc.strerror or exc)
