"""A seeded randomized fault campaign against a 4-node tierfs cluster with a bucket.

What it runs: 4 real node daemons (``tierfs mount``, peer plane on 127.0.0.1,
``--bucket`` on the real fake-gcs-server), and in this process one trainer
per node (threads) that saves steps as a real client does:

* **MTC mode**: the Orbax file protocol -- ``replicator.yaml.tmp`` renamed to
  ``replicator.yaml``, wait for it to go, read and delete
  ``replicator.errors``, fail on ``replicator.failed``, take the newest
  ``.restore`` marker (rename it to ``<step>``, drop the empty ``s0``), then
  save ``<step>.orbax-checkpoint-tmp/`` renamed to ``<step>``. Every fault
  ends in a job restart: every trainer does the handshake again (as a JobSet
  restarts every pod).
* **generic mode**: HF-style ``tmp-checkpoint-<N>/`` renamed to
  ``checkpoint-<N>/`` (two newest kept, as ``save_total_limit=2``), job
  parameters as mount flags. After a daemon restart ``tierfs wait`` on the
  restarted node(s) gives the agreed step; every rank resumes from it, so
  every node, the survivors too, must present ``checkpoint-<step>``.

The schedule (:func:`schedule`) is a pure function of the seed: the kinds (a
shuffled bag of all :data:`KINDS` per round of 9, so both corruption kinds
occur), their target nodes, how many steps are saved before the fault, how
settled the cluster is when it hits, and the variant. Timing is not
deterministic (the machine is busy); the oracle never relies on it: every
wait is for a condition, with generous timeouts.

Per injection: save 1-3 steps on every node, settle (``hot``: no wait,
``replicated``: the newest step replicated on every node, ``backed_up``: it
also carries ``_BACKUP_REQUESTED`` and its round is complete), take the
snapshot (statuses, store bytes, bucket bytes; see ``fault_oracle``), inject
the fault, restart what it killed, run the restore, judge it with
:func:`fault_oracle.judge`, record kind, recovery time (from the fault to the
last node's verified outcome) and pass/fail with the reasons. After a split
or unusable outcome the campaign starts a new epoch (new job name, every RAM
store wiped); otherwise the trainers go on from the restored step.

The kinds:

``kill9``             kill -9 of one daemon, remount (RAM kept)
``node_loss``         kill -9 and wipe of one node's RAM store, remount
``cluster_loss``      the same on every node
``kill_during_restore`` a kill -9 or node loss, then kill -9 of a node while
                      the restore runs (its state ``cleanup``/``planning``/``barrier``)
``bucket_stall``      SIGSTOP of fake-gcs-server; a step saved meanwhile; kill -9 of a
                      node and the restore with the bucket stalled; SIGCONT during
                      or after the restore
``sigstop``           SIGSTOP of one daemon during a save or during a restore, SIGCONT
                      once the others got as far as they can
``enospc``            one node's RAM budget filled (``--size`` 8 MiB, a filler file):
                      the next save there must fail with ENOSPC; then the trainer
                      cleans up and the job restarts (generic: the rank saves again
                      and the step must reach every peer)
``flip_replica``      a flipped bit in a peer's replica of a rank's newest step, then
                      that rank's node is lost
``flip_bucket``       a flipped bit in a data object of one rank's part of the newest
                      complete round (on disk: the object keeps its crc32c metadata;
                      or rewritten through the API), then the cluster is lost

Run it: ``make soak SEED=7 INJECTIONS=200`` or ``python tests/support/fault_campaign.py
--seed 7 --injections 60``; ``tests/cluster/test_fault_campaign.py`` runs 20
injections with a fixed seed.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import hashlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from conftest import Mount, tierfs
from fault_oracle import (
    Copy,
    Expectation,
    GroundTruth,
    NodeRestore,
    Version,
    counted_copies,
    expected_restore,
    judge,
)
from gcs_fixtures import FakeGcs
from mtc_client import content, read_tree
from peer_cluster import Cluster
from step_bytes import safetensors_bytes, torch_like_zip

KINDS = (
    "kill9",
    "node_loss",
    "cluster_loss",
    "kill_during_restore",
    "bucket_stall",
    "sigstop",
    "enospc",
    "flip_replica",
    "flip_bucket",
)
CORRUPTION = ("flip_replica", "flip_bucket")
MODES = ("mtc", "generic")
NODES = 4
KEEP_LOCAL = 2  # tierfs's default --keep-local
RAM_SIZE = "8MiB"
BACKUP_INTERVAL_STEPS = 3
#: seconds a SIGSTOPped daemon stays stopped at most while another node restores
STOP_LIMIT = 20
#: restore states in which a node's restore is running
RESTORING = ("pending", "cleanup", "planning", "barrier")
MARKER = re.compile(r"^.+-s(?P<step>\d+)-n\d+-w\d+\.restore$")
META = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<rank>\d+)-w(?P<w>\d+)\.meta$")
ROUND_NAME = re.compile(r"^\d{4}-\d\d-\d\d_\d\d-\d\d$")
ROUND_OPENED = re.compile(r"coordinator: restore round \d+ opened by")
WAITED = re.compile(r"^restored step (?P<step>\d+) from (?P<source>.+)$")
#: ``tierfs wait``'s exit status for "nothing restored (incomplete)": an outcome (no step
#: is complete for every rank, with the reasons), not a failure of the restore
WAIT_INCOMPLETE = 3
#: ``tierfs wait``: an older step was restored (newer ones incomplete or unloadable)
WAIT_OLDER = 2

#: environment of the daemons: short GCS deadlines so a stalled bucket costs seconds
CAMPAIGN_ENV = {
    "TIERFS_GCS_TICK": "0.5",
    "TIERFS_GCS_RETRY_DEADLINE": "8",
    "TIERFS_GCS_FALLBACK_DEADLINE": "5",
    "TIERFS_GCS_LOOKUP_DEADLINE": "5",
    "TIERFS_GCS_START_DEADLINE": "3",
    "TIERFS_GCS_STALL_SECONDS": "3",
    "TIERFS_GCS_UPLOAD_RETRY_MAX": "4",
    "TIERFS_GCS_ROUND_TIMEOUT": "60",
}


class Aborted(Exception):
    """A trainer's wait was stopped on purpose (its daemon is being killed)."""


# ---------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Injection:
    """One fault of the schedule (all of it drawn from the seed).

    Attributes:
        index: position in the campaign (0-based).
        kind: one of :data:`KINDS`.
        mode: ``mtc`` or ``generic``.
        node: the node the fault hits first (the rank whose replica or round part
            is corrupted for the flips).
        other: a second node (kill during restore: the node killed then; sigstop
            during a generic restore: the node restarted).
        steps: steps saved before the fault (1-3).
        settle: ``hot``, ``replicated`` or ``backed_up``.
        variant: kind-specific (see the module docstring), or "".
    """

    index: int
    kind: str
    mode: str
    node: int
    other: int
    steps: int
    settle: str
    variant: str

    def describe(self) -> str:
        v = f" {self.variant}" if self.variant else ""
        return (
            f"#{self.index} {self.kind}{v} [{self.mode}] node {self.node} other "
            f"{self.other}, {self.steps} step(s) {self.settle}"
        )


_VARIANTS = {
    "kill_during_restore": ("after_kill9", "after_loss"),
    "bucket_stall": ("thaw_after", "thaw_during"),
    "sigstop": ("during_save", "during_restore"),
    "flip_bucket": ("disk", "disk", "api"),
}


def schedule(
    seed: int,
    injections: int,
    *,
    mode: str = "both",
    nodes: int = NODES,
    kinds: tuple[str, ...] = KINDS,
) -> list[Injection]:
    """The campaign's faults, a pure function of its arguments.

    Args:
        seed: the campaign seed.
        injections: how many faults.
        mode: ``mtc``, ``generic``, ``both`` (the first half in one mode, the second
            half in the other, the order drawn from the seed) or ``seed`` (one mode
            drawn from the seed).
        nodes: the cluster size.
        kinds: the kinds to draw from (every kind once per bag of ``len(kinds)``).
    """
    rng = random.Random(seed)
    if mode == "seed":
        modes = [rng.choice(MODES)] * injections
    elif mode == "both":
        first, second = rng.sample(MODES, 2)
        half = (injections + 1) // 2
        modes = [first] * half + [second] * (injections - half)
    elif mode in MODES:
        modes = [mode] * injections
    else:
        raise ValueError(f"unknown mode {mode!r}")
    order: list[str] = []
    bag: list[str] = []
    for i in range(injections):
        if not bag or (i > 0 and modes[i] != modes[i - 1]):
            bag = list(kinds)
            rng.shuffle(bag)
        order.append(bag.pop())
    out = []
    for i, kind in enumerate(order):
        r = random.Random(f"{seed}/{i}")
        settle = r.choice(("hot", "replicated", "replicated", "backed_up"))
        if kind == "flip_replica":
            settle = "replicated"
        elif kind == "flip_bucket":
            settle = "backed_up"
        variants = _VARIANTS.get(kind, ("",))
        out.append(
            Injection(
                i,
                kind,
                modes[i],
                r.randrange(nodes),
                r.randrange(nodes),
                r.randint(1, 3),
                settle,
                r.choice(variants),
            )
        )
    return out


# ---------------------------------------------------------------------- small helpers


def digest(files: dict[str, bytes]) -> str:
    """sha256 over sorted (path, sha256(bytes)): the identity of a step's bytes."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


def wait_for(
    cond: Callable[[], Any],
    timeout: float,
    what: str,
    stop: threading.Event | None = None,
    interval: float = 0.1,
) -> Any:
    """Poll ``cond`` until truthy; returns its value.

    Raises:
        TimeoutError: ``timeout`` seconds passed (the message names ``what``).
        Aborted: ``stop`` was set.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        if stop is not None and stop.is_set():
            raise Aborted(what)
        try:
            value = cond()
            if value:
                return value
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout:.0f} s waiting for {what}"
                + (f" (last error: {last!r})" if last else "")
            )
        time.sleep(interval)


def parallel(fn: Callable[[int], Any], items: list[int]) -> dict[int, Any]:
    """``fn(i)`` for every item at once (threads); item -> result or the exception."""
    out: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # recorded, judged by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def flip_bit(path: str | os.PathLike[str], rng: random.Random) -> int:
    """Flip one bit of a file in place; returns the byte offset."""
    size = os.path.getsize(path)
    offset = rng.randrange(size)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    return offset


def largest_file(root: str) -> str:
    files = [os.path.join(d, n) for d, _dirs, names in os.walk(root) for n in names]
    return max(files, key=lambda p: (os.path.getsize(p), p))


def take_errors(root: Path) -> list[str]:
    """Read and delete ``replicator.errors`` as a client does; returns its lines."""
    p = root / "replicator.errors"
    try:
        text = p.read_text(errors="replace")
        p.unlink()
    except FileNotFoundError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()]


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ---------------------------------------------------------------------- records


@dataclass
class Record:
    """The outcome of one injection (one JSON line of ``records.jsonl``)."""

    index: int
    seed: int
    kind: str
    variant: str
    mode: str
    epoch: int
    job: str
    node: int
    other: int
    settle: str
    ok: bool = True
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    recovery_s: float | None = None
    expected: dict[str, Any] = field(default_factory=dict)
    restored: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)
    logs: dict[str, list[str]] = field(default_factory=dict)
    #: restore rounds the coordinator opened during the injection (one per node and
    #: restart is normal; hundreds mean the nodes kept reopening rounds)
    restore_rounds: int = 0

    def line(self) -> str:
        state = "ok  " if self.ok else "FAIL"
        rec = f"{self.recovery_s:6.1f}s" if self.recovery_s is not None else "     - "
        what = (
            "; ".join(x[:160] for x in self.reasons)
            if self.reasons
            else ", ".join(f"n{k}={v.get('step')}" for k, v in sorted(self.restored.items()))
        )
        return (
            f"{state} #{self.index:<3} {self.kind:<20} {self.variant:<14} {self.mode:<7} "
            f"node {self.node}/{self.other} {self.settle:<10} {rec}  {what}"
        )


def explanation_only(rec: Record) -> bool:
    """True if every reason of a failed record is a missing explanation (the restored
    data itself was right)."""
    return not rec.ok and all(
        r.startswith(("unexplained ", "fresh start while")) for r in rec.reasons
    )


def summarize(records: list[Record]) -> str:
    """Per kind: count, failures (of which only a missing explanation), recovery median and
    max (seconds)."""
    lines = [
        f"{'kind':<20} {'count':>5} {'failures':>8} {'explain-only':>12} "
        f"{'median s':>9} {'max s':>7}"
    ]
    for kind in (*KINDS, None):
        rs = [r for r in records if r.kind == kind] if kind else records
        if not rs:
            continue
        times = [r.recovery_s for r in rs if r.recovery_s is not None]
        med = f"{statistics.median(times):9.1f}" if times else f"{'-':>9}"
        mx = f"{max(times):7.1f}" if times else f"{'-':>7}"
        lines.append(
            f"{kind or 'all':<20} {len(rs):>5} {sum(not r.ok for r in rs):>8} "
            f"{sum(explanation_only(r) for r in rs):>12} {med} {mx}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- the campaign


@dataclass
class Snapshot:
    """What was provably where just before a fault (see ``fault_oracle``)."""

    statuses: dict[int, dict[str, Any] | None]
    listed: set[Copy]
    copies: set[Copy]
    rounds: dict[str, int]
    targets: dict[int, list[int]]


@dataclass
class Fault:
    """What a fault destroyed (for the oracle) and when it hit (``time.monotonic()``)."""

    lost: set[int] = field(default_factory=set)
    bad_copies: set[Copy] = field(default_factory=set)
    bad_rounds: set[str] = field(default_factory=set)
    bucket_usable: bool = True
    t0: float = 0.0


class Campaign:
    """The fault campaign (see the module docstring).

    Args:
        make_mount: ``make_mount(*args, name=...) -> Mount`` (the conftest fixture or
            :class:`MountFactory`).
        gcs: a running fake-gcs-server with ``gcs.bucket`` created.
        seed: the campaign seed.
        injections: number of faults.
        mode: see :func:`schedule`.
        out: directory for ``records.jsonl``, the daemon logs and the summary.
        restore_timeout: seconds a restore may take before it counts as stuck.
        kinds: the kinds to draw from.
        size: bytes of the largest file of a step (a step is about 1.35x that).
        say: where progress lines go.
    """

    def __init__(
        self,
        make_mount: Callable[..., Mount],
        gcs: FakeGcs,
        *,
        seed: int,
        injections: int,
        mode: str = "both",
        out: Path,
        restore_timeout: float = 150,
        kinds: tuple[str, ...] = KINDS,
        size: int = 60_000,
        say: Callable[[str], None] = print,
    ) -> None:
        self.make_mount = make_mount
        self.gcs = gcs
        self.seed = seed
        self.plan = schedule(seed, injections, mode=mode, kinds=kinds)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.restore_timeout = restore_timeout
        self.size = size
        self.say = say
        self.truth = GroundTruth()
        self.records: list[Record] = []
        self.epoch = 0
        self.job = ""
        self.mode = ""
        self.step = 0  # the trainers' last step (they save step + 1 next)
        self.c: Cluster | None = None
        self.stopped: set[int] = set()
        #: job -> round -> rank -> step the node reported backed up there
        self.claims: dict[str, dict[str, dict[int, int]]] = {}
        #: job -> round -> seq: rounds verified complete by reading the bucket
        self.rounds: dict[str, dict[str, int]] = {}
        self.bad_rounds: dict[str, set[str]] = {}
        self.pre_problems: list[str] = []
        self.log_offsets: dict[int, int] = {}
        self._client: Any = None  # google.cloud.storage.Client, made on first use
        #: (job, round) -> the (rank, step) .meta objects and whether every node claimed
        #: the round, at its last check
        self._round_checked: dict[tuple[str, str], tuple[Any, ...]] = {}
        # per injection (reset by run_one)
        self.notes: list[str] = []
        self.reasons_extra: list[str] = []
        self.late_snapshot: Snapshot | None = None

    # ------------------------------------------------------------------ cluster

    def log_path(self, i: int) -> Path:
        return self.out / f"node{i}.log"

    def _node_args(self, i: int) -> list[str]:
        args = ["--log-file", str(self.log_path(i))]
        if self.mode == "generic":
            args += [
                "--job",
                self.job,
                "--nodes",
                str(NODES),
                "--node-rank",
                str(i),
                "--peers-per-node",
                "1",
                "--backup-interval-steps",
                str(BACKUP_INTERVAL_STEPS),
            ]
        return args

    @property
    def cluster(self) -> Cluster:
        assert self.c is not None
        return self.c

    def root(self, i: int) -> Path:
        return self.cluster.root(i)

    def status(self, i: int) -> dict[str, Any]:
        return json.loads((self.root(i) / ".tierfs" / "status.json").read_text())

    def restore_state(self, i: int) -> str | None:
        return (self.status(i).get("restore") or {}).get("state")

    def mount(self, i: int) -> None:
        m = self.cluster.mounts[i]
        m.args = self.cluster.args(i)
        m.mount()

    def mount_all(self, nodes: list[int]) -> None:
        """Mount these nodes at once (as restarted nodes come back together)."""
        bad = {i: e for i, e in parallel(self.mount, nodes).items() if e is not None}
        if bad:
            raise RuntimeError(f"tierfs mount failed: {bad}")

    def kill9(self, i: int) -> None:
        self.cont(i)
        self.cluster.mounts[i].kill9()

    def lose(self, i: int) -> None:
        self.kill9(i)
        shutil.rmtree(self.cluster.mounts[i].ram_dir, ignore_errors=True)

    def stop(self, i: int) -> None:
        pid = self.cluster.mounts[i].pid()
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(i)
        wait_for(lambda: proc_state(pid) in ("T", "t", "gone"), 10, f"daemon {i} to stop")

    def cont(self, i: int) -> None:
        if i in self.stopped:
            self.stopped.discard(i)
            with contextlib.suppress(OSError, ValueError):
                os.kill(self.cluster.mounts[i].pid(), signal.SIGCONT)

    def alive(self, i: int) -> bool:
        try:
            pid = self.cluster.mounts[i].pid()
        except (OSError, ValueError):
            return False
        return proc_state(pid) not in ("gone", "Z", "X")

    def _start_cluster(self) -> None:
        self.c = Cluster(
            self.make_mount,
            NODES,
            extra=("--bucket", self.gcs.bucket, "--size", RAM_SIZE),
            start=False,
            node_args=self._node_args,
            join_timeout=90,
        )
        made = parallel(
            lambda i: self.make_mount(*self.cluster.args(i), name=f"node{i}"), list(range(NODES))
        )
        bad = {i: m for i, m in made.items() if isinstance(m, BaseException)}
        if bad:
            raise RuntimeError(f"tierfs mount failed: {bad}")
        self.cluster.mounts.extend(made[i] for i in range(NODES))

    def new_epoch(self, mode: str, why: str) -> None:
        """A fresh job: new job name, every RAM store wiped, every daemon remounted."""
        self.epoch += 1
        self.job = f"fc{self.epoch}"
        self.mode = mode
        self.step = 0
        self.say(f"--- epoch {self.epoch}: job {self.job}, {mode} mode ({why})")
        with contextlib.suppress(Exception):
            self.gcs.thaw()
        if self.c is None:
            self._start_cluster()
        else:
            for i, m in enumerate(self.cluster.mounts):
                self.cont(i)
                try:
                    m.unmount()
                except Exception:
                    subprocess.run(["umount", "-l", str(m.path)], check=False, capture_output=True)
                    with contextlib.suppress(Exception):
                        m.kill9()
                shutil.rmtree(m.ram_dir, ignore_errors=True)
            self.mount_all(list(range(NODES)))
        outcomes = self.restore(set(range(NODES)))
        bad = {i: o for i, o in outcomes.items() if o.step is not None or o.error}
        if bad:
            raise RuntimeError(f"a fresh job did not start from nothing: {bad}")
        for i in range(NODES):
            take_errors(self.root(i))

    # ------------------------------------------------------------------ trainers

    def files(self, v: Version, rank: int, backup: bool) -> dict[str, bytes]:
        """The exact bytes rank ``rank`` saves for version ``v``."""
        if self.mode == "mtc":
            files = content(f"{self.seed}/{v.seq}", rank, v.step, self.size)
        else:
            # what HF Trainer writes, in formats the seal-time validators accept (issue
            # #15: random bytes named .safetensors/.pt are a damaged step, never restored)
            rnd = random.Random(f"{self.seed}/{v.seq}/{rank}")
            weights = rnd.randbytes(self.size)
            files = {
                "model.safetensors": safetensors_bytes({"w": ("U8", [len(weights)], weights)}),
                "optimizer.pt": torch_like_zip(payload=rnd.randbytes(self.size // 3 + 11)),
                "rng_state.pth": torch_like_zip(payload=rnd.randbytes(1000)),
                "trainer_state.json": json.dumps(
                    {"global_step": v.step, "seq": v.seq, "rank": rank}
                ).encode(),
            }
        if backup:
            files["_BACKUP_REQUESTED"] = b""
        return files

    def step_dir(self, step: int) -> str:
        return str(step) if self.mode == "mtc" else f"checkpoint-{step}"

    def save_one(self, i: int, v: Version, backup: bool) -> None:
        """Rank ``i`` saves ``v`` as its client would; records it in the ground truth.

        Raises:
            OSError: the save failed (the partial temp directory is left).
        """
        root = self.root(i)
        files = self.files(v, i, backup)
        tmp = root / (
            f"{v.step}.orbax-checkpoint-tmp" if self.mode == "mtc" else f"tmp-checkpoint-{v.step}"
        )
        if tmp.exists():  # a stale temp dir of a crashed save: start again (Orbax does)
            shutil.rmtree(tmp)
        final = root / self.step_dir(v.step)
        if self.mode == "generic" and final.exists():  # the abandoned history's
            shutil.rmtree(final)
        for path, data in files.items():
            full = tmp / path
            full.parent.mkdir(parents=True, exist_ok=True)
            full.write_bytes(data)
        os.rename(tmp, final)
        self.truth.sealed(v, i, digest(files))
        if self.mode == "generic":  # save_total_limit=2
            for old in self._checkpoints(i)[:-2]:
                shutil.rmtree(root / f"checkpoint-{old}", ignore_errors=True)

    def _checkpoints(self, i: int) -> list[int]:
        out = []
        for name in os.listdir(self.root(i)):
            m = re.fullmatch(r"checkpoint-(\d+)", name)
            if m:
                out.append(int(m[1]))
        return sorted(out)

    def save_all(self, backup: bool = False) -> tuple[Version, dict[int, Any]]:
        """Every rank saves the next step at once; returns the version and per rank None
        or the exception its save raised."""
        v = self.truth.new_version(self.step + 1, self.epoch)
        self.step = v.step
        res = parallel(lambda i: self.save_one(i, v, backup), list(range(NODES)))
        return v, res

    def _train(self, inj: Injection) -> Version:
        for k in range(inj.steps):
            backup = inj.settle == "backed_up" and k == inj.steps - 1
            if backup:
                self._wait_no_round()
            v, res = self.save_all(backup)
            bad = {i: e for i, e in res.items() if e is not None}
            if bad:
                raise RuntimeError(f"saving step {v.step} failed: {bad}")
        return v

    def _wait_no_round(self) -> None:
        def idle() -> bool:
            g = self.status(0)["tiers"]["gcs"]
            return g.get("active_round") is None

        try:
            wait_for(idle, 60, "no backup round running")
        except TimeoutError as exc:
            self.notes.append(str(exc))

    def _settle(self, inj: Injection, v: Version) -> None:
        if inj.settle == "hot":
            return
        try:
            for i in range(NODES):
                wait_for(
                    lambda i=i: self._own_state(i, v.step) == "replicated",
                    60,
                    f"node {i}: step {v.step} replicated",
                )
            if inj.settle == "backed_up":
                for i in range(NODES):
                    wait_for(
                        lambda i=i: self._backed_up(i, v.step),
                        60,
                        f"node {i}: step {v.step} backed up",
                    )
        except TimeoutError as exc:
            self.notes.append(f"settle: {exc}")

    def _own_state(self, i: int, step: int) -> str | None:
        for s in self.status(i)["steps"]:
            if s["step"] == step:
                return s["state"]
        return None

    def _backed_up(self, i: int, step: int) -> str | None:
        for s in self.status(i)["tiers"]["gcs"].get("steps", []):
            if s["step"] == step:
                return s["where"][0].removeprefix("gcs:")
        return None

    # ------------------------------------------------------------------ the snapshot

    def snapshot(self, bucket: bool = True) -> Snapshot:
        """Statuses, the RAM copies proven by status and bytes, the verified rounds."""
        statuses: dict[int, dict[str, Any] | None] = {}
        for i in range(NODES):
            try:
                statuses[i] = self.status(i) if i not in self.stopped else None
            except (OSError, ValueError) as exc:
                statuses[i] = None
                self.pre_problems.append(f"node {i}: status unreadable before the fault: {exc!r}")
        listed: set[Copy] = set()
        targets: dict[int, list[int]] = {}
        for h, st in statuses.items():
            if st is None:
                continue
            targets[h] = list(st["tiers"]["peer"].get("replicate_to") or [])
            cands = [(h, s["step"]) for s in st["steps"] if "local" in s.get("where", [])]
            cands += [
                (r["rank"], r["step"]) for r in st.get("replicas", []) if r["job"] == self.job
            ]
            for rank, step in cands:
                seq = self._store_copy(h, rank, step)
                if seq is not None:
                    listed.add((h, rank, step, seq))
            for s in st["tiers"]["gcs"].get("steps", []):
                rnd = s["where"][0].removeprefix("gcs:")
                self.claims.setdefault(self.job, {}).setdefault(rnd, {})[h] = s["step"]
        if bucket:
            self._verify_rounds()
        copies = counted_copies(listed, self.truth.versions, targets, KEEP_LOCAL)
        rounds = {
            r: s
            for r, s in self.rounds.get(self.job, {}).items()
            if r not in self.bad_rounds.get(self.job, set())
        }
        return Snapshot(statuses, listed, copies, rounds, targets)

    def _shard_dir(self, holder: int, rank: int, step: int) -> Path:
        return (
            self.cluster.mounts[holder].ram_dir
            / "store"
            / "shards"
            / self.job
            / str(rank)
            / str(step)
            / "data"
        )

    def _store_copy(self, holder: int, rank: int, step: int) -> int | None:
        """seq of the version whose bytes node ``holder`` holds for (rank, step), or None."""
        data = self._shard_dir(holder, rank, step)
        try:
            tops = os.listdir(data)
            if len(tops) != 1:
                return None
            files = read_tree(str(data / tops[0]))
        except OSError:
            return None
        v = self.truth.identify(self.epoch, rank, step, digest(files))
        return v.seq if v is not None else None

    def _verify_rounds(self) -> None:
        """Read the job's rounds from the bucket (not from tierfs): a round is complete when
        every rank's ``.meta`` names data objects holding exactly one version's bytes, the
        same version for every rank. A round every node reported backed up that the bucket
        contradicts is a problem of this injection."""
        if self._client is None:
            self._client = self.gcs.client()
        client, bucket = self._client, self.gcs.bucket
        top = client.list_blobs(bucket, prefix=f"{self.job}/", delimiter="/")
        list(top)  # the prefixes are known once the pages are read
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in top.prefixes)
        done = self.rounds.setdefault(self.job, {})
        bad = self.bad_rounds.get(self.job, set())
        for rnd in names:
            if rnd in done or rnd in bad or not ROUND_NAME.match(rnd):
                continue
            prefix = f"{self.job}/{rnd}/"
            blobs = {b.name[len(prefix) :]: b for b in client.list_blobs(bucket, prefix=prefix)}
            metas = {}
            for name in blobs:
                m = META.fullmatch(name)
                if m and m["job"] == self.job and m["w"] == "0":
                    metas[int(m["rank"])] = int(m["step"])
            key = (self.job, rnd)
            claims = self.claims.get(self.job, {}).get(rnd, {})
            # a claim of a complete round is every node's "done" for one step; "done"
            # for different steps is a round that moved after some nodes finished the
            # older step, which nobody claims complete (seed 23 #38: rank 0 reported
            # step 22, the others 23, while the round, moved to 23, still ran)
            claimed = sorted(claims) == list(range(NODES)) and len(set(claims.values())) == 1
            seen = (*sorted(metas.items()), claimed)
            if self._round_checked.get(key) == seen:
                continue  # nothing new since the last look
            self._round_checked[key] = seen
            problem = self._judge_round(rnd, metas, blobs)
            if problem is not None and claimed:
                self.pre_problems.append(
                    f"round {rnd}: every node reported step(s) {sorted(set(claims.values()))} "
                    f"backed up there, but the bucket says otherwise: {problem}"
                )

    def _judge_round(self, rnd: str, metas: dict[int, int], blobs: dict[str, Any]) -> str | None:
        """Record ``rnd`` as complete (returns None) or say why it is not."""
        if sorted(metas) != list(range(NODES)):
            return f"ranks {sorted(set(range(NODES)) - set(metas))} have no .meta"
        steps = set(metas.values())
        if len(steps) != 1:
            return f"ranks name different steps {metas}"
        step = steps.pop()
        seqs, problems = set(), []
        for r in range(NODES):
            try:
                name = blobs[f"{self.job}-s{step}-n{r}-w0.meta"].download_as_bytes().decode()
                data = f"{name.strip()}.data/"
                files = {
                    n[len(data) :]: b.download_as_bytes()
                    for n, b in blobs.items()
                    if n.startswith(data)
                }
            except Exception as exc:
                problems.append(f"rank {r}'s part unreadable: {exc!r}")
                continue
            v = self.truth.identify(self.epoch, r, step, digest(files))
            if v is None:
                problems.append(
                    f"rank {r}'s part holds bytes of no save of step {step} ({len(files)} objects)"
                )
            else:
                seqs.add(v.seq)
        if problems or len(seqs) != 1:
            return "; ".join(problems) or f"ranks hold different saves {sorted(seqs)}"
        self.rounds[self.job][rnd] = seqs.pop()
        return None

    def _round_objects(self, rnd: str, step: int, rank: int) -> tuple[list[Any], str]:
        """The data objects of rank ``rank``'s part of ``rnd`` (via its ``.meta``) and
        their common name prefix."""
        if self._client is None:
            self._client = self.gcs.client()
        bucket = self._client.bucket(self.gcs.bucket)
        meta = bucket.blob(f"{self.job}/{rnd}/{self.job}-s{step}-n{rank}-w0.meta")
        name = meta.download_as_bytes().decode().strip()
        prefix = f"{self.job}/{rnd}/{name}.data/"
        return list(self._client.list_blobs(self.gcs.bucket, prefix=prefix)), prefix

    # ------------------------------------------------------------------ restores

    def handshake(self, i: int, stop: threading.Event) -> NodeRestore:
        """Trainer ``i``'s job restart in MTC mode (the Orbax sequence, module docstring)."""
        root = self.root(i)
        t = self.restore_timeout
        yml = root / "replicator.yaml"
        lines = [
            f"job-name: {self.job}",
            "framework: orbax",
            f"node-rank: {i}",
            f"nodes: {NODES}",
            "peers-per-node: 1",
            f"backup-interval-steps: {BACKUP_INTERVAL_STEPS}",
        ]
        wait_for(
            lambda: not os.path.lexists(yml), t, f"node {i}: an earlier replicator.yaml to go", stop
        )
        tmp = root / "replicator.yaml.tmp"
        tmp.write_text("\n".join(lines))
        os.replace(tmp, yml)
        wait_for(lambda: not os.path.lexists(yml), t, f"node {i}: replicator.yaml consumed", stop)
        errors = take_errors(root)
        failed = root / "replicator.failed"

        def markers() -> list[str] | str:
            if failed.exists():
                return "failed"
            return sorted(glob.glob(str(root / "*.restore")))

        found = wait_for(markers, t, f"node {i}: a restore marker", stop)
        if found == "failed":
            return NodeRestore(
                None, error=f"replicator.failed: {failed.read_text().strip()}", errors=errors
            )
        pre_path = root / "replicator.prerestore"
        prerestore = pre_path.read_text() if pre_path.exists() else ""
        real = []
        for m in found:
            match = MARKER.match(os.path.basename(m))
            if match is None:
                return NodeRestore(None, error=f"odd marker {m}", errors=errors)
            step = int(match["step"])
            if os.path.islink(m):
                real.append((step, m))
        if not real:
            for m in found:
                os.unlink(m)
            if prerestore.strip() not in ("{}", ""):
                return NodeRestore(
                    None,
                    error=f"empty s0 marker but prerestore {prerestore.strip()!r}",
                    errors=errors,
                )
            return NodeRestore(None, errors=errors)
        step, marker = max(real)
        os.replace(marker, root / str(step))
        for _s, m in real:
            if m != marker and os.path.lexists(m):
                os.unlink(m)
        for m in found:
            if os.path.lexists(m) and not os.path.islink(m):
                os.unlink(m)
        wait_for(
            lambda: not os.path.islink(root / str(step)),
            30,
            f"node {i}: step {step} to become a directory",
            stop,
        )
        return self._identify(i, step, root / str(step), errors, prerestore=prerestore)

    def _identify(
        self, i: int, step: int, path: Path, errors: list[str], prerestore: str | None = None
    ) -> NodeRestore:
        files = read_tree(str(path))
        v = self.truth.identify(self.epoch, i, step, digest(files))
        if v is None:
            return NodeRestore(
                step,
                error=f"step {step}'s bytes ({len(files)} files) match no save of rank {i}",
                errors=errors,
            )
        if prerestore is not None and f"restore-step: {step}" not in prerestore:
            return NodeRestore(
                step,
                v.seq,
                error=f"prerestore {prerestore.strip()!r} does not name step {step}",
                errors=errors,
            )
        return NodeRestore(step, v.seq, errors=errors)

    def mtc_restore(
        self, hook: Callable[[threading.Event, Callable[[], bool]], None] | None = None
    ) -> dict[int, NodeRestore] | None:
        """Every trainer restarts (handshake); ``hook(stop, finished)`` runs meanwhile
        (``finished()``: every handshake has returned) and may abort by setting ``stop``.

        Returns per node the outcome, or None when the hook set ``stop``."""
        stop = threading.Event()
        results: dict[int, Any] = {}

        def run(i: int) -> None:
            try:
                results[i] = self.handshake(i, stop)
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(NODES)]
        for t in threads:
            t.start()
        try:
            if hook is not None:
                hook(stop, lambda: not any(t.is_alive() for t in threads))
        except BaseException:
            stop.set()
            raise
        finally:
            for t in threads:
                t.join(self.restore_timeout + 30 if stop.is_set() else None)
        if stop.is_set():
            return None
        out = {}
        for i in range(NODES):
            r = results.get(i)
            if isinstance(r, NodeRestore):
                out[i] = r
            else:
                out[i] = NodeRestore(None, error=f"trainer: {r!r}")
        return out

    def wait_cmd(self, i: int) -> tuple[int, str]:
        proc = tierfs(
            "wait",
            str(self.root(i)),
            "--timeout",
            str(self.restore_timeout),
            check=False,
            timeout=self.restore_timeout + 60,
        )
        return proc.returncode, (proc.stdout.strip() or proc.stderr.strip())

    def generic_restore(
        self, restarted: set[int], hook: Callable[[], set[int]] | None = None
    ) -> dict[int, NodeRestore]:
        """``tierfs wait`` on the restarted nodes (``hook`` may restart more); then every
        node must present ``checkpoint-<agreed step>`` with its rank's bytes."""
        box: dict[str, Any] = {}
        th = threading.Thread(
            target=lambda: box.update(parallel(self.wait_cmd, sorted(restarted))), daemon=True
        )
        th.start()
        more = hook() if hook is not None else set()
        th.join()
        waited: dict[int, Any] = {i: box[i] for i in restarted}
        if more:
            waited.update(parallel(self.wait_cmd, sorted(more)))
        out: dict[int, NodeRestore] = {}
        for i, res in sorted(waited.items()):
            if isinstance(res, BaseException):
                out[i] = NodeRestore(None, error=f"tierfs wait: {res!r}")
                continue
            rc, text = res
            m = WAITED.match(text)
            if rc == WAIT_INCOMPLETE:  # nothing restored, with the reasons: judged as such
                out[i] = NodeRestore(None, wait_rc=rc, said=text)
            elif rc not in (0, WAIT_OLDER) or (rc == WAIT_OLDER and not m):
                out[i] = NodeRestore(
                    None, error=f"tierfs wait exit {rc}: {text}", wait_rc=rc, said=text
                )
            elif m:
                out[i] = NodeRestore(int(m["step"]), wait_rc=rc, said=text)
            else:
                out[i] = NodeRestore(None, wait_rc=rc, said=text)
        agreed = {o.step for o in out.values() if not o.error}
        if len(agreed) == 1 and not any(o.error for o in out.values()):
            step = agreed.pop()
            if step is None:
                for i in range(NODES):
                    out.setdefault(i, NodeRestore(None))
            else:  # every node, the survivors too
                out = self._present_all({i: step for i in range(NODES)}, out)
        else:  # no agreement: still record which bytes each restarted node shows
            out = self._present_all(
                {i: o.step for i, o in out.items() if o.step is not None and not o.error}, out
            )
        for i in range(NODES):
            if i in out:
                out[i].errors += take_errors(self.root(i))
        return out

    def _present_all(
        self, steps: dict[int, int], waited: dict[int, NodeRestore]
    ) -> dict[int, NodeRestore]:
        """:meth:`_present` for every node of ``steps`` at once; keeps what ``tierfs wait``
        said; the other nodes of ``waited`` stay as they are."""
        got = parallel(
            lambda i: self._present(i, steps[i], waited[i].wait_rc if i in waited else None),
            sorted(steps),
        )
        out = dict(waited)
        for i, r in got.items():
            if isinstance(r, BaseException):
                r = NodeRestore(None, error=f"reading checkpoint-{steps[i]}: {r!r}")
            r.said = waited[i].said if i in waited else ""
            out[i] = r
        return out

    def _present(self, i: int, step: int, wait_rc: int | None) -> NodeRestore:
        """Node ``i`` presents ``checkpoint-<step>`` with its rank's bytes (waits for it)."""
        path = self.root(i) / f"checkpoint-{step}"
        last: list[NodeRestore] = []

        def good() -> bool:
            if not path.is_dir():
                return False
            last[:] = [self._identify(i, step, path, [])]
            return not last[0].error

        try:
            wait_for(good, 30, f"node {i} to present checkpoint-{step}")
        except TimeoutError:
            if last:
                r = last[0]
            else:
                have = self._checkpoints(i)
                r = NodeRestore(
                    None,
                    error=f"does not present the agreed checkpoint-{step} "
                    f"(it has {[f'checkpoint-{s}' for s in have]})",
                )
            r.wait_rc = wait_rc
            return r
        r = last[0]
        r.wait_rc = wait_rc
        return r

    def restore(self, restarted: set[int]) -> dict[int, NodeRestore]:
        """The restore after a fault without hooks, in the epoch's mode."""
        if self.mode == "mtc":
            out = self.mtc_restore()
            assert out is not None
            for i in range(NODES):
                out[i].errors += take_errors(self.root(i))
            return out
        return self.generic_restore(restarted)

    def progress(self, v: Version) -> dict[int, NodeRestore]:
        """Generic mode without a restart: ``v`` must reach every node's peers and every
        node must present it."""
        out = {}
        for i in range(NODES):
            try:
                wait_for(
                    lambda i=i: self._own_state(i, v.step) == "replicated",
                    90,
                    f"node {i}: step {v.step} replicated after the fault",
                )
                out[i] = self._present(i, v.step, None)
            except TimeoutError as exc:
                out[i] = NodeRestore(None, error=str(exc))
            out[i].errors += take_errors(self.root(i))
        return out

    def wait_rcs(self, outcomes: dict[int, NodeRestore]) -> None:
        """MTC: `tierfs wait` on every node (its exit status is judged on fresh starts)."""
        res = parallel(self.wait_cmd, list(range(NODES)))
        for i, r in res.items():
            if i in outcomes and not isinstance(r, BaseException):
                outcomes[i].wait_rc, outcomes[i].said = r

    # ------------------------------------------------------------------ the kinds

    def _poll_until(self, cond: Callable[[], bool], what: str, timeout: float = 60) -> bool:
        """Wait for ``cond``; False (and a note) if it did not happen in time."""
        try:
            wait_for(cond, timeout, what, interval=0.02)
            return True
        except TimeoutError:
            self.notes.append(f"{what}: did not happen within {timeout:.0f} s")
            return False

    def _states(self, nodes: list[int]) -> dict[int, str | None]:
        out = {}
        for i in nodes:
            try:
                out[i] = self.restore_state(i)
            except (OSError, ValueError):
                out[i] = "unreadable"
        return out

    def _fault_and_restore(
        self, inj: Injection, snap: Snapshot, fault: Fault
    ) -> dict[int, NodeRestore]:
        kind, n = inj.kind, inj.node
        fault.t0 = time.monotonic()
        if kind == "kill9":
            self.kill9(n)
            self.mount(n)
            return self.restore({n})
        if kind == "node_loss":
            self.lose(n)
            fault.lost = {n}
            self.mount(n)
            return self.restore({n})
        if kind == "cluster_loss":
            return self._cluster_loss(fault)
        if kind == "kill_during_restore":
            return self._kill_during_restore(inj, fault)
        if kind == "bucket_stall":
            return self._bucket_stall(inj, fault)
        if kind == "sigstop":
            return self._sigstop(inj, fault)
        if kind == "enospc":
            return self._enospc(inj, fault)
        if kind == "flip_replica":
            rng = random.Random(f"{self.seed}/{inj.index}/flip")
            holder = (snap.targets.get(n) or [n ^ 1])[0]
            held = sorted(
                (c for c in snap.listed if c[0] == holder and c[1] == n), key=lambda c: c[3]
            )
            if held:
                copy = held[-1]
                path = largest_file(str(self._shard_dir(holder, n, copy[2])))
                off = flip_bit(path, rng)
                fault.bad_copies = {copy}
                self.notes.append(
                    f"flipped a bit at byte {off} of "
                    f"{os.path.relpath(path, self.cluster.mounts[holder].ram_dir)}"
                    f" on node {holder} (its replica of rank {n} step {copy[2]})"
                )
            else:
                self.notes.append(f"node {holder} held no replica of rank {n}: no flip")
            fault.t0 = time.monotonic()
            self.lose(n)
            fault.lost = {n}
            self.mount(n)
            return self.restore({n})
        if kind == "flip_bucket":
            self._flip_bucket(inj, snap, fault)
            return self._cluster_loss(fault)
        raise ValueError(kind)

    def _cluster_loss(self, fault: Fault) -> dict[int, NodeRestore]:
        fault.t0 = time.monotonic()
        for i in range(NODES):
            self.lose(i)
        fault.lost = set(range(NODES))
        self.mount_all(list(range(NODES)))
        return self.restore(set(range(NODES)))

    def _flip_bucket(self, inj: Injection, snap: Snapshot, fault: Fault) -> None:
        rng = random.Random(f"{self.seed}/{inj.index}/flip")
        if not snap.rounds:
            self.notes.append("no verified complete round to corrupt: no flip")
            return
        rnd = max(snap.rounds, key=lambda r: snap.rounds[r])
        step = self.truth.versions[snap.rounds[rnd]].step
        blobs = [b for b in self._round_objects(rnd, step, inj.node)[0] if (b.size or 0) > 0]
        blob = max(blobs, key=lambda b: (b.size, b.name))
        if inj.variant == "api":
            data = bytearray(blob.download_as_bytes())
            off = rng.randrange(len(data))
            data[off] ^= 1 << rng.randrange(8)
            blob.upload_from_string(bytes(data))
            how = "rewritten through the API (new crc32c metadata)"
        else:
            path = Path(self.gcs.root) / "data" / self.gcs.bucket / blob.name
            off = flip_bit(path, rng)
            how = "on disk (crc32c metadata unchanged)"
        fault.bad_rounds = {rnd}
        self.bad_rounds.setdefault(self.job, set()).add(rnd)
        self.notes.append(
            f"flipped a bit at byte {off} of gs://{self.gcs.bucket}/{blob.name} "
            f"(rank {inj.node}'s part of round {rnd}, step {step}) {how}"
        )

    def _kill_during_restore(self, inj: Injection, fault: Fault) -> dict[int, NodeRestore]:
        """A kill -9 or node loss of ``node``, then kill -9 of ``other`` while the restore
        runs. MTC: ``other`` dies once its state is cleanup/planning/barrier (the restore
        waits for every trainer, so this is seen). Generic: a restarted node's restore is
        over before ``tierfs mount`` returns, so ``other`` dies once ``node``'s daemon
        logged its mount (``other`` == ``node``: once its GCS tier is up, the restore
        starts right after) while that mount is still in progress."""
        n, o = inj.node, inj.other
        if inj.variant == "after_loss":
            self.lose(n)
            fault.lost = {n}
        else:
            self.kill9(n)
        if self.mode == "mtc":
            self.mount(n)

            def hook(stop: threading.Event, finished: Callable[[], bool]) -> None:
                seen: list[dict[int, str | None]] = []

                def restoring() -> bool:
                    seen[:] = [self._states(list(range(NODES)))]
                    return seen[0][o] in RESTORING or finished()

                self._poll_until(restoring, f"node {o} restoring", self.restore_timeout)
                during = bool(seen) and seen[0][o] in RESTORING
                self.notes.append(
                    f"node {o} killed {'during' if during else 'after'} the "
                    f"restore (states {seen[0] if seen else '?'})"
                )
                self.kill9(o)
                stop.set()

            self.mtc_restore(hook)
            self.mount(o)
            return self.restore(set())
        off = self._log_size(n)
        mounting = threading.Thread(target=self._try_mount, args=(n,), daemon=True)
        mounting.start()
        trigger = "GCS tier:" if o == n else "INFO tierfs.daemon: mounted"
        self._poll_until(
            lambda: trigger in self._log_text(n, off),
            f"node {n}'s daemon to log {trigger!r}",
            self.restore_timeout,
        )
        text = self._log_text(n, off)
        done = "generic restore" in text or "restore of step" in text
        self.notes.append(
            f"node {o} killed {'after' if done else 'during'} node {n}'s "
            f"restore ({'the restore had ended' if done else 'not ended yet'})"
        )
        with contextlib.suppress(OSError, ValueError, AssertionError):
            self.kill9(o)
        mounting.join()
        self.mount(o)
        if o != n and not self._mounted(n):
            self.mount(n)
        return self.generic_restore({n, o})

    def _try_mount(self, i: int) -> None:
        try:
            self.mount(i)
        except Exception as exc:  # the daemon was killed while mounting
            self.notes.append(
                f"node {i}: tierfs mount failed as its daemon was killed: "
                f"{str(exc).splitlines()[0][:200]}"
            )

    def _mounted(self, i: int) -> bool:
        try:
            self.status(i)
            return True
        except (OSError, ValueError):
            return False

    def _log_size(self, i: int) -> int:
        p = self.log_path(i)
        return p.stat().st_size if p.exists() else 0

    def _log_text(self, i: int, offset: int) -> str:
        with open(self.log_path(i), "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def _restore_over(self, nodes: list[int]) -> bool:
        """Generic mode, after their mount: every one of ``nodes`` finished its restore."""
        return all(s in ("done", "failed") for s in self._states(nodes).values())

    def _bucket_stall(self, inj: Injection, fault: Fault) -> dict[int, NodeRestore]:
        n = inj.node
        fault.bucket_usable = False
        try:
            self.gcs.freeze()
            fault.t0 = time.monotonic()
            v, res = self.save_all()
            if any(e is not None for e in res.values()):
                raise RuntimeError(f"saving step {v.step} with a stalled bucket failed: {res}")
            for i in range(NODES):
                self._poll_until(
                    lambda i=i: self._own_state(i, v.step) == "replicated",
                    f"node {i}: step {v.step} replicated with the bucket stalled",
                )
            self.late_snapshot = self.snapshot(bucket=False)
            self.kill9(n)
            self.mount(n)
            if inj.variant == "thaw_during":

                def thaw_when_restoring(finished: Callable[[], bool]) -> None:
                    seen: list[dict[int, str | None]] = []

                    def restoring() -> bool:
                        seen[:] = [self._states(list(range(NODES)))]
                        return any(s in RESTORING for s in seen[0].values()) or finished()

                    self._poll_until(restoring, "a node restoring", self.restore_timeout)
                    self.gcs.thaw()
                    self.notes.append(
                        f"bucket thawed during the restore (states {seen[0] if seen else '?'})"
                    )

                if self.mode == "mtc":
                    out = self.mtc_restore(lambda stop, finished: thaw_when_restoring(finished))
                    assert out is not None
                    for i in range(NODES):
                        out[i].errors += take_errors(self.root(i))
                    return out
                return self.generic_restore(
                    {n}, lambda: (thaw_when_restoring(lambda: self._restore_over([n])), set())[1]
                )
            return self.restore({n})
        finally:
            self.gcs.thaw()

    def _sigstop(self, inj: Injection, fault: Fault) -> dict[int, NodeRestore]:
        n = inj.node
        others = [i for i in range(NODES) if i != n]
        if inj.variant == "during_save":
            v = self.truth.new_version(self.step + 1, self.epoch)
            self.step = v.step
            box: dict[int, Any] = {}
            try:
                self.stop(n)
                fault.t0 = time.monotonic()
                th = threading.Thread(
                    target=lambda: box.update(
                        parallel(lambda i: self.save_one(i, v, False), list(range(NODES)))
                    ),
                    daemon=True,
                )
                th.start()
                for i in others:
                    self._poll_until(
                        lambda i=i: self._own_state(i, v.step) is not None,
                        f"node {i}: step {v.step} sealed while node {n} is stopped",
                    )
                self.notes.append(f"node {n} stopped while the others sealed step {v.step}")
            finally:
                self.cont(n)
            th.join()
            bad = {i: e for i, e in box.items() if e is not None}
            if bad:
                self.reasons_extra.append(f"saving step {v.step} around a SIGSTOP failed: {bad}")
            if self.mode == "generic":
                return self.progress(v)
            for i in range(NODES):
                self._poll_until(
                    lambda i=i: self._own_state(i, v.step) == "replicated",
                    f"node {i}: step {v.step} replicated after the SIGCONT",
                )
            self.late_snapshot = self.snapshot()
            fault.t0 = time.monotonic()
            return self.restore(set())
        # during the restore
        if self.mode == "mtc":

            def hook(stop: threading.Event, finished: Callable[[], bool]) -> None:
                try:
                    self.stop(n)
                    fault.t0 = time.monotonic()
                    self._poll_until(
                        lambda: all(s in RESTORING for s in self._states(others).values()),
                        f"nodes {others} restoring while node {n} is stopped",
                    )
                    self.notes.append(f"node {n} resumed; the others were {self._states(others)}")
                finally:
                    self.cont(n)

            out = self.mtc_restore(hook)
            assert out is not None
            for i in range(NODES):
                out[i].errors += take_errors(self.root(i))
            return out
        k = inj.other if inj.other != n else (n + 1) % NODES
        self.kill9(k)
        self.stop(n)
        fault.t0 = time.monotonic()
        try:
            self.mount(k)

            def ghook() -> set[int]:
                # node n stays stopped until k's restore is over (it copes with a hung
                # peer) or STOP_LIMIT s passed (it waits for n; then n resumes)
                try:
                    over = self._poll_until(
                        lambda: self._restore_over([k]),
                        f"node {k}'s restore to end while node {n} is stopped",
                        STOP_LIMIT,
                    )
                    self.notes.append(
                        f"node {k} restarted; node {n} resumed "
                        f"{'after' if over else 'during'} node {k}'s restore "
                        f"({self._states([k])[k]})"
                    )
                finally:
                    self.cont(n)
                return set()

            return self.generic_restore({k}, ghook)
        finally:
            self.cont(n)

    def _enospc(self, inj: Injection, fault: Fault) -> dict[int, NodeRestore]:
        n = inj.node
        root = self.root(n)
        filler = root / "filler.bin"
        fault.t0 = time.monotonic()
        log_at = self._log_size(n)
        written, full = self._fill(filler, cap=2 * self._budget(n))
        if not full:
            self.reasons_extra.append(
                f"node {n}: {written} bytes written past its {RAM_SIZE} RAM budget without ENOSPC"
            )
        v, res = self.save_all()
        err = res.get(n)
        since = self._log_text(n, log_at)
        # retention dropped an old step after the filler's ENOSPC (regression: CI under
        # load, seed 19 #6), or a replica arriving meanwhile was refused for lack of room
        # and what it had received was removed (seed 29 #15, settle "hot"): the save
        # found room that tierfs freed, correct, not a fault
        freed = "dropping shard" in since or re.search(
            r"refused a replica .*No space left on device", since
        )
        if err is None and freed:
            self.notes.append(
                f"node {n}: save of step {v.step} found room that tierfs freed after the fill"
            )
        elif err is None:
            self.reasons_extra.append(
                f"node {n}: saving step {v.step} ({self.size} bytes) "
                f"succeeded although a filler of {written} bytes had "
                "just got ENOSPC"
            )
        elif not isinstance(err, OSError) or err.errno != errno.ENOSPC:
            self.reasons_extra.append(
                f"node {n}: saving step {v.step} on a full RAM budget "
                f"failed with {err!r}, not ENOSPC"
            )
        else:
            self.notes.append(f"node {n}: save of step {v.step} got ENOSPC as it should")
        for i, e in res.items():
            if i != n and e is not None:
                self.reasons_extra.append(f"node {i}: saving step {v.step} failed: {e!r}")
        # the trainer cleans up: its partial temp dir and the filler
        for p in (root / f"{v.step}.orbax-checkpoint-tmp", root / f"tmp-checkpoint-{v.step}"):
            shutil.rmtree(p, ignore_errors=True)
        filler.unlink()
        sv = os.statvfs(root)
        if sv.f_bavail * sv.f_frsize < written // 2:  # regression: freed after the unlink
            self.notes.append(
                f"node {n}: {sv.f_bavail * sv.f_frsize} bytes free right after the filler "
                f"of {written} bytes was removed"
            )
        if self.mode == "mtc":
            return self.restore(set())
        try:
            self.save_one(n, v, False)
        except OSError as exc:
            self.reasons_extra.append(
                f"node {n}: saving step {v.step} again after freeing the RAM failed: {exc!r}"
            )
        return self.progress(v)

    def _budget(self, i: int) -> int:
        sv = os.statvfs(self.root(i))
        return sv.f_blocks * sv.f_frsize

    @staticmethod
    def _fill(path: Path, cap: int) -> tuple[int, bool]:
        """Write zeros to ``path`` until ENOSPC, with ever smaller writes (the RAM budget is
        then full to within 64 bytes, whatever tierfs could reclaim); at most ``cap`` bytes.

        Returns (bytes written, True if ENOSPC ended it).

        Raises:
            OSError: a write failed with another errno than ENOSPC.
        """
        written = 0
        with open(path, "wb", buffering=0) as f:
            for size in (256 << 10, 16 << 10, 1 << 10, 64):
                chunk = b"\0" * size
                while written < cap:
                    try:
                        written += f.write(chunk) or 0
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
                else:
                    return written, False
        return written, True

    # ------------------------------------------------------------------ one injection

    def _log_mark(self) -> None:
        for i in range(NODES):
            p = self.log_path(i)
            self.log_offsets[i] = p.stat().st_size if p.exists() else 0

    def _log_slice(self, i: int) -> str:
        p = self.log_path(i)
        if not p.exists():
            return ""
        off = self.log_offsets.get(i, 0)
        if p.stat().st_size < off:  # rotated
            off = 0
        with open(p, "rb") as f:
            f.seek(off)
            return f.read().decode(errors="replace")

    def _health(self) -> None:
        """Every daemon alive and answering before the next fault (restart a crashed one)."""
        for i in range(NODES):
            if not self.alive(i):
                tail = self._log_slice(i).splitlines()[-15:]
                self.pre_problems.append(
                    f"node {i}'s daemon died by itself before this fault; log tail: {tail}"
                )
                self.mount(i)

    def run_one(self, inj: Injection) -> Record:
        """Train, settle, snapshot, inject, restore, judge: one :class:`Record`."""
        if inj.mode != self.mode:
            self.new_epoch(inj.mode, "mode switch")
        rec = Record(
            inj.index,
            self.seed,
            inj.kind,
            inj.variant,
            inj.mode,
            self.epoch,
            self.job,
            inj.node,
            inj.other,
            inj.settle,
        )
        self.notes = rec.notes
        self.reasons_extra = []
        self.pre_problems = []
        self.late_snapshot = None
        self._log_mark()
        self._health()
        v = self._train(inj)
        self._settle(inj, v)
        snap = self.snapshot()
        fault = Fault()
        t_end = None
        try:
            outcomes = self._fault_and_restore(inj, snap, fault)
            t_end = time.monotonic()
        finally:
            for i in list(self.stopped):
                self.cont(i)
            with contextlib.suppress(Exception):
                self.gcs.thaw()
        if self.late_snapshot is not None:  # the fault saved a step before the snapshot
            snap = self.late_snapshot
        if self.mode == "mtc" and any(o.step is None for o in outcomes.values()):
            self.wait_rcs(outcomes)
        exp = expected_restore(
            snap.copies,
            snap.rounds,
            self.truth.versions,
            NODES,
            lost_nodes=fault.lost,
            bad_copies=fault.bad_copies,
            bad_rounds=fault.bad_rounds,
            bucket_usable=fault.bucket_usable,
            all_copies=snap.listed,
        )
        reasons = self.pre_problems + self.reasons_extra + judge(outcomes, exp, self.truth.versions)
        rec.reasons = reasons
        rec.ok = not reasons
        rec.recovery_s = round(t_end - fault.t0, 2) if t_end is not None else None
        rec.expected = self._expectation(exp)
        rec.restored = {
            str(i): {
                "step": o.step,
                "seq": o.seq,
                "error": o.error,
                "wait_rc": o.wait_rc,
                "said": o.said,
            }
            for i, o in sorted(outcomes.items())
        }
        rec.errors = {str(i): o.errors for i, o in sorted(outcomes.items()) if o.errors}
        self._keep_logs(rec, since=time.time() - (time.monotonic() - fault.t0))
        rec.restore_rounds = len(ROUND_OPENED.findall(self._log_slice(0)))
        if rec.restore_rounds > 3 * NODES:
            rec.notes.append(
                f"the coordinator opened {rec.restore_rounds} restore rounds during this injection"
            )
        self._go_on(outcomes)
        return rec

    def _expectation(self, exp: Expectation) -> dict[str, Any]:
        return {
            "floor_step": exp.floor_step,
            "floor_seq": exp.floor,
            "where": exp.where,
            "newest_step": exp.newest_step,
            "newest_seq": exp.newest,
            "detail": exp.detail,
        }

    _INTERESTING = re.compile(
        r"WARNING|ERROR|restore|decision|round|crc32c|verif|abandon|"
        r"retention|barrier|replan|no longer held",
        re.I,
    )

    def _keep_logs(self, rec: Record, since: float | None = None) -> None:
        """Write each node's log lines of this injection to the output directory; for a
        failure keep the interesting ones since the fault (``since``, epoch seconds)."""
        start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since - 1)) if since else ""
        for i in range(NODES):
            text = self._log_slice(i)
            (self.out / f"inj{rec.index:03d}-node{i}.log").write_text(text)
            if not rec.ok:
                lines = [
                    ln
                    for ln in text.splitlines()
                    if ln[:19] >= start and self._INTERESTING.search(ln)
                ]
                rec.logs[str(i)] = lines[-40:]

    def _go_on(self, outcomes: dict[int, NodeRestore]) -> None:
        """The trainers resume from the common restored version, or a new epoch starts."""
        seqs = {o.seq for o in outcomes.values()}
        steps = {o.step for o in outcomes.values()}
        usable = (
            len(steps) == 1
            and len(seqs) == 1
            and not any(o.error for o in outcomes.values())
            and len(outcomes) == NODES
        )
        if not usable:
            self.new_epoch(self.mode, "the restore left no common step")
            return
        seq = seqs.pop()
        self.truth.restored(self.epoch, seq)
        self.step = self.truth.versions[seq].step if seq is not None else 0
        if self.mode == "generic":
            for i in range(NODES):
                for s in self._checkpoints(i):
                    if s > self.step:
                        shutil.rmtree(self.root(i) / f"checkpoint-{s}", ignore_errors=True)

    # ------------------------------------------------------------------ the whole run

    def run(self) -> list[Record]:
        """Run every injection of the schedule; returns the records (also in records.jsonl)."""
        t0 = time.monotonic()
        self.say(f"fault campaign: seed {self.seed}, {len(self.plan)} injections, out {self.out}")
        with open(self.out / "records.jsonl", "w") as log:
            self.new_epoch(self.plan[0].mode if self.plan else "mtc", "start")
            for inj in self.plan:
                try:
                    rec = self.run_one(inj)
                except Exception as exc:  # a step failed: record it, start over
                    rec = Record(
                        inj.index,
                        self.seed,
                        inj.kind,
                        inj.variant,
                        inj.mode,
                        self.epoch,
                        self.job,
                        inj.node,
                        inj.other,
                        inj.settle,
                        ok=False,
                        reasons=[
                            *self.pre_problems,
                            *self.reasons_extra,
                            f"campaign step failed: {exc!r}",
                        ],
                        notes=list(self.notes),
                    )
                    self._keep_logs(rec)
                    try:
                        self.new_epoch(inj.mode, "after a failed step")
                    except Exception as again:  # once more from scratch, then give up
                        rec.reasons.append(f"a new epoch failed too: {again!r}")
                        self.new_epoch(inj.mode, "after a failed new epoch")
                self.records.append(rec)
                log.write(json.dumps(asdict(rec)) + "\n")
                log.flush()
                self.say(rec.line())
        summary = summarize(self.records)
        took = time.monotonic() - t0
        text = f"{summary}\nseed {self.seed}: {len(self.records)} injections in {took:.0f} s"
        (self.out / "summary.txt").write_text(text + "\n" + self.failure_report() + "\n")
        self.say(text)
        return self.records

    def failure_report(self) -> str:
        """Every failure with what each node restored, the expectation and log lines."""
        out = []
        for r in self.records:
            if r.ok:
                continue
            out.append(
                f"\n== FAIL seed {r.seed} injection #{r.index} {r.kind} {r.variant} "
                f"[{r.mode}] job {r.job} node {r.node} other {r.other} settle {r.settle}"
            )
            out.extend(f"   reason: {x}" for x in r.reasons)
            out.extend(f"   note: {x}" for x in r.notes)
            out.append(f"   expected: {r.expected}")
            out.append(f"   restored: {r.restored}")
            for node, lines in r.errors.items():
                out.extend(f"   node {node} replicator.errors: {ln}" for ln in lines)
            for node, lines in r.logs.items():
                out.extend(f"   node {node} log: {ln}" for ln in lines)
        return "\n".join(out)


# ---------------------------------------------------------------------- outside pytest


class MountFactory:
    """``make_mount`` without pytest: mountpoints under ``root``, RAM stores in /dev/shm."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounts: list[Mount] = []

    def __call__(self, *args: str, name: str) -> Mount:
        mnt = self.root / name
        mnt.mkdir(parents=True, exist_ok=True)
        ram = Path("/dev/shm") / f"tierfs-campaign-{uuid.uuid4().hex[:10]}"
        m = Mount(mnt, ram, list(args))
        m.mount()
        self.mounts.append(m)
        return m

    def close(self) -> None:
        for m in self.mounts:
            with contextlib.suppress(Exception):
                os.kill(m.pid(), signal.SIGCONT)
            try:
                m.unmount()
            except Exception:
                subprocess.run(["umount", "-l", str(m.path)], check=False, capture_output=True)
            shutil.rmtree(m.ram_dir, ignore_errors=True)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Seeded randomized fault campaign against a "
        "4-node tierfs cluster with a bucket (make soak)."
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--injections", type=int, default=200)
    p.add_argument("--mode", default="both", choices=("both", "seed", *MODES))
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to draw from")
    p.add_argument("--out", default=None, help="output directory (default: a new temp dir)")
    p.add_argument("--restore-timeout", type=float, default=150)
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)}")
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        p.error("needs root and /dev/fuse")
    work = Path(a.out) if a.out else Path(f"/tmp/tierfs-soak-{a.seed}-{uuid.uuid4().hex[:6]}")
    work.mkdir(parents=True, exist_ok=True)
    gcs = FakeGcs(work / "fake-gcs")
    gcs.start()
    factory = MountFactory(work / "mnt")
    try:
        gcs.bucket = gcs.create_bucket()
        env = {**CAMPAIGN_ENV, "STORAGE_EMULATOR_HOST": gcs.url}
        with environment(env):
            os.environ.pop("GOOGLE_CLOUD_PROJECT", None)
            camp = Campaign(
                factory,
                gcs,
                seed=a.seed,
                injections=a.injections,
                mode=a.mode,
                out=work / "out",
                restore_timeout=a.restore_timeout,
                kinds=kinds,
            )
            records = camp.run()
        report = camp.failure_report()
        if report:
            print(report)
        print(f"records: {work / 'out' / 'records.jsonl'}")
        return 1 if any(not r.ok for r in records) else 0
    finally:
        factory.close()
        gcs.stop()


if __name__ == "__main__":
    sys.exit(main())
