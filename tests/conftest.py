"""Shared fixtures: real tierfs mounts started through the CLI, as a user would."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # the shared helpers

from gcs_fixtures import fake_gcs  # noqa: F401  (GCS emulator fixture)

# Property and model tests draw the same examples on every run (a suite that passed
# passes again: no flaky CI); TIERFS_HYPOTHESIS_EXPLORE=1 draws new ones to hunt for bugs.
hypothesis_settings.register_profile("tierfs-ci", derandomize=True)
hypothesis_settings.register_profile("tierfs-explore", derandomize=False)
hypothesis_settings.load_profile(
    "tierfs-explore" if os.environ.get("TIERFS_HYPOTHESIS_EXPLORE") else "tierfs-ci"
)


def _suite_tmpfs() -> Path:
    """A tmpfs of this test process's own under /dev/shm, where the tests' ram-dirs go.

    Under ``make test``'s parallel workers every worker gets one, so the free space a
    test reads (statfs of a mount, the native budget) moves only with its own writes,
    not with another worker's. Its size is /dev/shm's (a limit, nothing is reserved).
    Falls back to /dev/shm itself where mounting is not allowed (not root). Mounts of
    processes that died (a killed worker) are removed first.
    """
    shm = Path("/dev/shm")
    if os.geteuid() != 0:
        return shm
    for stale in shm.glob("tierfs-suite-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path("/proc", pid).exists():
            subprocess.run(["umount", "-l", str(stale)], check=False, capture_output=True)
            shutil.rmtree(stale, ignore_errors=True)
    own = shm / f"tierfs-suite-{os.getpid()}"
    own.mkdir(exist_ok=True)
    size = shutil.disk_usage(shm).total
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tierfs-suite", str(own)],
        check=False,
        capture_output=True,
    )
    return own if done.returncode == 0 else shm


SHM = _suite_tmpfs()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove this process's suite tmpfs (:func:`_suite_tmpfs`)."""
    if SHM.name.startswith("tierfs-suite-"):
        subprocess.run(["umount", "-l", str(SHM)], check=False, capture_output=True)
        shutil.rmtree(SHM, ignore_errors=True)


TIERFS = [sys.executable, "-m", "tierfs"]


def tierfs(
    *args: str, check: bool = True, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the tierfs CLI in a subprocess; returns the completed process."""
    proc = subprocess.run(
        [*TIERFS, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"tierfs {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def is_mounted(path: Path) -> bool:
    target = str(path.resolve()) if path.exists() else str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def remove_ram_dir(path: Path) -> None:
    """Delete a test's ram-dir, and the tmpfs tierfs mounted on it for ``--size`` (if any)."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists() and is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Mount:
    """A tierfs mount made with ``tierfs mount`` (background daemon)."""

    path: Path
    ram_dir: Path
    args: list[str] = field(default_factory=list)
    mount_stderr: str = ""

    @property
    def view(self) -> Path:
        return self.ram_dir / "view"

    def pid(self) -> int:
        return int((self.ram_dir / "store" / "daemon.pid").read_text().split()[0])

    def mount(self) -> None:
        proc = tierfs("mount", str(self.path), "--ram-dir", str(self.ram_dir), *self.args)
        self.mount_stderr = proc.stderr

    def unmount(self) -> None:
        if is_mounted(self.path):
            tierfs("unmount", str(self.path), "--lazy")

    def kill9(self) -> None:
        """kill -9 the daemon (the mount is left dead, answering ENOTCONN)."""
        pid = self.pid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # a zombie counts until init reaps it
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)
        raise AssertionError(f"daemon {pid} survived SIGKILL")

    def log(self) -> str:
        p = self.ram_dir / "store" / "daemon.log"
        return p.read_text(errors="replace") if p.exists() else ""


def _fuse_available() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if os.geteuid() != 0:
        return "tests mount with mount(2) and need root"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the longest tests first: ``long`` (by ``minutes``), then ``slow``, then the rest.

    ``make test`` spreads the suite over several pytest-xdist workers (``--dist load``
    with small chunks hands each worker the next test in this order as it frees up):
    a multi-minute test started last would run alone at the end while the other
    workers idle. The sort is stable, so the order within each group is unchanged.
    """

    def weight(item: pytest.Item) -> tuple[int, float]:
        long = item.get_closest_marker("long")
        if long is not None:  # @pytest.mark.long(minutes=N): the longest start first
            return 0, -float(long.kwargs.get("minutes", 1))
        return (1 if item.get_closest_marker("slow") else 2), 0.0

    items.sort(key=weight)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Remember each phase's report on the item (fixtures print daemon logs on failure)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def make_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    """Factory: ``make_mount(*extra_args, ram_dir=None)`` mounts and returns a :class:`Mount`."""
    reason = _fuse_available()
    if reason:
        pytest.skip(reason)
    mounts: list[Mount] = []
    ram_dirs: list[Path] = []

    def factory(*args: str, ram_dir: Path | None = None, name: str | None = None) -> Mount:
        mnt = tmp_path / (name or f"mnt{len(mounts)}")
        mnt.mkdir(exist_ok=True)
        if ram_dir is None:
            ram_dir = SHM / f"tierfs-test-{uuid.uuid4().hex[:10]}"
            ram_dirs.append(ram_dir)
        m = Mount(mnt, ram_dir, list(args))
        m.mount()
        mounts.append(m)
        return m

    yield factory
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for m in mounts:
            print(f"\n===== daemon log of {m.path} (ram-dir {m.ram_dir}) =====\n{m.log()[-20000:]}")
    for m in mounts:
        try:
            m.unmount()
        except Exception:
            subprocess.run(["umount", "-l", str(m.path)], check=False, capture_output=True)
    for d in ram_dirs:
        remove_ram_dir(d)


@pytest.fixture
def mount(make_mount) -> Mount:
    """One tierfs mount with default options and ``allow_other``."""
    return make_mount("-o", "allow_other")
