"""Whole-step view benchmark (issue #14): first byte of another rank's file, full-step reads.

Three real node daemons on 127.0.0.1 (``tierfs mount``, generic mode, one job
of 3 nodes, peers-per-node 1, keep-local 1). Every node writes its part of
step ``N/`` (as ``N.tmp/``, renamed to ``N``: that seals it): node 1 a big
part (``--gib`` GiB in 256 MiB files, or 200 files of 1 MiB), nodes 0 and 2 a
small file each (a node shows only steps it wrote a part of). With 3 nodes
and one replica, rank 1's part lives on nodes 1 and 0 only, so node 2 holds
nothing of it: every read of rank 1's files on node 2 goes through the fetch
path (a placeholder, fetched whole on the first open over one peer PullShard
``paths`` call with a trimmed manifest, written into node 2's RAM store with
its crc32c checked against the manifest's as it is written, then served by
passthrough; the "read back + crc32c" column is what that check cost when it
read the file back, before 284774a). Since the batched fetch (2569809), a file
of at most 4 MiB comes with the next small files of its part in the same call
(``$TIERFS_FETCH_BATCH`` files; ``TIERFS_FETCH_BATCH=1``: one call per file,
as before), while the raw baseline still makes one call per file. Before each timed
read the benchmark waits until node 2's ``.tierfs/status.json`` shows the
step with no ``ranks_missing``, until the step is replicated on every node,
and until the daemons are idle.

1. **first byte**: time from ``open()`` of one remote file on node 2 to its
   first byte (the open returns once the first 4 MiB chunk is verified
   against the manifest's per-chunk crc32c; a part sealed without them: once
   the whole file is), for a 256 MiB file in a 1 GiB and a 4 GiB step (``--big-gib``)
   and for a 1 MiB file; baseline: the raw gRPC stream below of that one
   file (discarded, and into tmpfs), and the time to read the fetched file
   back with crc32c (what the fetch's check adds).
   **mount to first byte**: node 2's daemon is killed (-9) and its ram-dir
   removed, ``tierfs mount`` is run again, and the time from its return until
   the first byte of rank 1's file is read is measured (waiting for the name
   to appear is part of it; so are node 2's restore of its own part from node
   0 and the restored step's background prefetch, which starts at once); a
   timeline of node 2's status (restore state, the view's first look) shows
   where that time goes.
2. **full-step read**: every remote file of a fresh step (a new step each
   repeat) read on node 2, one file after another and with 4 threads, in
   bytes/s; baseline: a raw gRPC server-stream on loopback between two
   processes (a server process reads the same sealed files from node 1's
   store in 4 MiB messages, tierfs's chunk size; the client discards the
   bytes, or writes them into a tmpfs file as the fetch must), 1 and 4
   streams, interleaved with the tierfs reads (ABAB: every repeat measures
   both, every second one the raw stream first), medians. The sequential read
   also says how much of its time went into ``open()`` (fetch and check).
3. **prefetch**: after a remount of node 2 (kill -9, RAM wiped), time until
   ``tierfs wait`` returns (restore done, names in the view) and until
   ``tierfs wait --bytes`` returns (every other rank's byte local); bytes/s
   of the second phase.

Each measured fetch's tier (``whole_view.fetched_bytes``), ``fetch_errors``
and every node's ``replicator.errors`` are reported.

Usage: ``python bench/whole_step_bench.py [--gib 1] [--big-gib 4] [--small-files 200]
[--repeat 3] [--json FILE]`` (root, /dev/fuse; 0 skips the 4 GiB or the small-file steps).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_seconds, daemon_pid, free_port, status, unmount, wait, write_json

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 4 * MiB  # tierfs's peer chunk (tierfs.replication.transfer.CHUNK)
JOB = "wsv"
NODES = 3
BIG, OWNER = 1, 2  # node 1 writes the big part; node 2 reads it

# ---------------------------------------------------------------------- cluster


def tierfs_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "tierfs", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


#: more arguments of every ``tierfs mount`` (``--mount-arg``)
MOUNT_ARGS: list[str] = []


class Cluster:
    """Three nodes of one generic job on loopback (node 0 serves the coordinator)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.ports = [free_port() for _ in range(NODES)]
        self.mounts = [work / f"node{i}" for i in range(NODES)]
        self.rams = [Path(f"/dev/shm/tierfs-wsb-{uuid.uuid4().hex[:8]}") for _ in range(NODES)]

    def mount(self, i: int) -> None:
        self.mounts[i].mkdir(exist_ok=True)
        p = tierfs_cli(
            "mount", str(self.mounts[i]), "--ram-dir", str(self.rams[i]),
            "--listen", f"127.0.0.1:{self.ports[i]}",
            "--coordinator", f"127.0.0.1:{self.ports[0]}",
            "--peer-token", "bench", "--join-timeout", "120",
            "--job", JOB, "--nodes", str(NODES), "--node-rank", str(i),
            "--peers-per-node", "1", "--keep-local", "1", *MOUNT_ARGS,
        )  # fmt: skip
        if p.returncode:
            raise SystemExit(f"tierfs mount of node {i} failed: {p.stderr}")

    def pid(self, i: int) -> int:
        return daemon_pid(self.rams[i])

    def pids(self) -> list[int]:
        return [self.pid(i) for i in range(NODES)]

    def lose(self, i: int) -> None:
        """kill -9 node ``i``'s daemon and remove its ram-dir (a node lost with its RAM)."""
        pid = self.pid(i)
        os.kill(pid, 9)
        wait(lambda: not Path(f"/proc/{pid}").exists(), 60, "the killed daemon to exit")
        shutil.rmtree(self.rams[i], ignore_errors=True)

    def errors(self, i: int) -> str:
        p = self.rams[i] / "view" / "replicator.errors"
        return p.read_text() if p.exists() else ""

    def part(self, rank: int, step: int) -> Path:
        """The sealed snapshot of rank ``rank``'s part of ``step`` on node ``rank``."""
        return self.rams[rank] / "store" / "shards" / JOB / str(rank) / str(step) / "data"

    def close(self) -> None:
        for m in self.mounts:
            unmount(m)
        for r in self.rams:
            shutil.rmtree(r, ignore_errors=True)


@contextmanager
def cluster() -> Iterator[Cluster]:
    work = Path(tempfile.mkdtemp(prefix="tierfs-wsb-"))
    c = Cluster(work)
    try:
        for i in range(NODES):
            c.mount(i)
        for m in c.mounts:
            wait(lambda m=m: status(m)["restore"].get("state") == "done", 120, "startup restore")
        yield c
    finally:
        c.close()
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------- steps


def write_files(d: Path, sizes: list[int], block: bytes) -> None:
    for n, size in enumerate(sizes):
        with open(d / f"rank1-{n:03d}.bin", "wb") as f:
            for off in range(0, size, len(block)):
                f.write(block[: min(len(block), size - off)])


def save_step(c: Cluster, step: int, sizes: list[int], block: bytes) -> None:
    """Every node writes its part of ``step/`` (node 1: files of ``sizes``) and seals it."""
    for i in range(NODES):
        tmp = c.mounts[i] / f"{step}.tmp"
        tmp.mkdir()
        if i == BIG:
            write_files(tmp, sizes, block)
        else:
            (tmp / f"rank{i}.txt").write_bytes(os.urandom(4096))
    for i in range(NODES):
        os.rename(c.mounts[i] / f"{step}.tmp", c.mounts[i] / str(step))


def peer_state(mnt: Path, step: int) -> str:
    for s in status(mnt)["tiers"]["peer"]["steps"]:
        if s["step"] == step:
            return s.get("state", "")
    return ""


def view_entry(mnt: Path, step: int) -> dict[str, Any] | None:
    for s in status(mnt)["whole_view"]["steps"]:
        if s["step"] == step:
            return s
    return None


def view_ready(mnt: Path, step: int) -> dict[str, Any] | None:
    s = view_entry(mnt, step)
    return s if s is not None and not s["ranks_missing"] else None


def settle(c: Cluster, step: int) -> None:
    """Until the step is replicated on every node and node 2 shows rank 1's files."""
    for i in range(NODES):
        wait(lambda i=i: peer_state(c.mounts[i], step) == "replicated", 600, f"{step} on {i}")
    wait(lambda: view_ready(c.mounts[OWNER], step), 120, f"rank 1's files of {step} on node 2")
    quiesce(c.pids())


def remove_step(c: Cluster, step: int) -> None:
    """The client's retention: remove ``step/`` from every mount (frees the fetched bytes)."""
    for m in c.mounts:
        shutil.rmtree(m / str(step), ignore_errors=True)


def quiesce(pids: list[int], timeout: float = 20.0) -> None:
    """Until the daemons use under 5 % of a CPU over half a second (other processes
    on the machine are not waited for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(0.5)
        if sum(cpu_seconds(p) for p in pids) - before < 0.025:
            return


# ---------------------------------------------------------------------- reading on node 2


def read_one(path: Path, buf: bytearray) -> tuple[int, float, float]:
    """Read ``path`` whole; (bytes, seconds to open, seconds from open() to the first byte)."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        t_open = time.perf_counter() - t0
        n = f.readinto(memoryview(buf)[:1])
        t_first = time.perf_counter() - t0
        while True:
            k = f.readinto(buf)
            if not k:
                break
            n += k
    return n, t_open, t_first


def read_all(files: list[Path], threads: int) -> tuple[int, float]:
    """Read ``files`` with ``threads`` readers (files handed out in order); (bytes, s)."""
    todo = list(files)
    lock = threading.Lock()
    total = [0]
    failures: list[BaseException] = []

    def worker() -> None:
        buf = bytearray(CHUNK)
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop(0)
            try:
                n, _, _ = read_one(path, buf)
            except BaseException as exc:
                failures.append(exc)
                return
            with lock:
                total[0] += n

    t = time.perf_counter()
    ws = [threading.Thread(target=worker) for _ in range(threads)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    dt = time.perf_counter() - t
    if failures:
        raise SystemExit(f"reading on node 2 failed: {failures[0]!r}")
    return total[0], dt


def check_bytes(files: list[Path], block: bytes) -> None:
    """Every file holds the block pattern it was written with (not timed)."""
    for p in files:
        with open(p, "rb") as f:
            while True:
                data = f.read(len(block))
                if not data:
                    break
                if data != block[: len(data)]:
                    raise SystemExit(f"{p}: wrong bytes")


def remote_files(c: Cluster, step: int) -> list[Path]:
    return sorted((c.mounts[OWNER] / str(step)).glob("rank1-*.bin"))


def crc_seconds(path: Path) -> float:
    """Seconds to read ``path`` back in 1 MiB preads and crc32c it (the fetch's check)."""
    import google_crc32c

    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.perf_counter()
        crc, off = 0, 0
        while True:
            chunk = os.pread(fd, MiB, off)
            if not chunk:
                break
            crc = google_crc32c.extend(crc, chunk)
            off += len(chunk)
        return time.perf_counter() - t
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- raw baseline

RAW_SERVER = r"""
import os, sys, grpc
from concurrent import futures
CHUNK = int(sys.argv[1])
def pull(req, ctx):
    fd = os.open(req.decode(), os.O_RDONLY)
    try:
        while True:
            data = os.read(fd, CHUNK)
            if not data:
                return
            yield data
    finally:
        os.close(fd)
srv = grpc.server(futures.ThreadPoolExecutor(8), options=[
    ("grpc.max_send_message_length", 16 << 20)])
srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
    "bench.Raw", {"Pull": grpc.unary_stream_rpc_method_handler(pull)}),))
port = srv.add_insecure_port("127.0.0.1:0")
srv.start()
print(port, flush=True)
sys.stdin.read()
"""


class Raw:
    """A raw gRPC server-stream of files' bytes from another process (the transport's
    ceiling): one call per file, 4 MiB messages, no checksums; the client discards
    the bytes or writes them into a fresh tmpfs file (as a fetch must)."""

    def __init__(self) -> None:
        import grpc

        self.proc = subprocess.Popen(
            [sys.executable, "-c", RAW_SERVER, str(CHUNK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        port = int(self.proc.stdout.readline())
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 16 << 20)]
        )
        self.pull = self.channel.unary_stream("/bench.Raw/Pull")
        self.sinks = Path(tempfile.mkdtemp(prefix="tierfs-wsb-sink-", dir="/dev/shm"))

    def chunks(self, path: str) -> Iterator[bytes]:
        """The bytes of ``path`` as the server sends them."""
        yield from self.pull(path.encode(), timeout=600)

    def one(self, path: str, write: bool) -> int:
        """Bytes of ``path`` received (into a fresh tmpfs file when ``write``)."""
        n = 0
        fd = -1
        if write:
            fd = os.open(self.sinks / uuid.uuid4().hex, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for data in self.chunks(path):
                if fd >= 0:
                    os.pwrite(fd, data, n)
                n += len(data)
        finally:
            if fd >= 0:
                os.close(fd)
        return n

    def first_byte(self, path: str, write: bool) -> float:
        """Seconds until a file's bytes are all here (a whole-file fetch's first byte)."""
        t = time.perf_counter()
        self.one(path, write)
        return time.perf_counter() - t

    def run(self, files: list[str], streams: int, write: bool) -> tuple[int, float]:
        todo = list(files)
        lock = threading.Lock()
        total = [0]

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    path = todo.pop(0)
                n = self.one(path, write)
                with lock:
                    total[0] += n

        t = time.perf_counter()
        ws = [threading.Thread(target=worker) for _ in range(streams)]
        for w in ws:
            w.start()
        for w in ws:
            w.join()
        dt = time.perf_counter() - t
        self.clean()
        return total[0], dt

    def clean(self) -> None:
        for p in self.sinks.iterdir():
            p.unlink()

    def close(self) -> None:
        self.channel.close()
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.sinks, ignore_errors=True)


RAW_TCP_SERVER = r"""
import os, socket, sys, threading
def serve(conn):
    with conn:
        path = conn.makefile("rb").readline().decode().strip()
        with open(path, "rb") as f:
            conn.sendfile(f)
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


class RawTcp(Raw):
    """A raw TCP stream of a file's bytes from another process: ``sendfile`` on the
    server, ``recv`` of 4 MiB into ``bytes`` and ``pwrite`` on the client, no
    framing and no checksums (the data lane's ceiling on this machine)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RAW_TCP_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(self.proc.stdout.readline())
        self.sinks = Path(tempfile.mkdtemp(prefix="tierfs-wsb-sink-", dir="/dev/shm"))

    def chunks(self, path: str) -> Iterator[bytes]:
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(path.encode() + b"\n")
            while data := s.recv(CHUNK, socket.MSG_WAITALL):
                yield data

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.sinks, ignore_errors=True)


# ---------------------------------------------------------------------- measurements


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def shm_used() -> float:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize / GiB


class Bench:
    def __init__(self, c: Cluster, raw: Raw, block: bytes, tcp: RawTcp) -> None:
        self.c = c
        self.raw = raw
        self.tcp = tcp
        self.block = block
        self.step = 0
        self.results: dict[str, list[float]] = {}
        self.notes: list[str] = []
        self.timelines: list[list[tuple[float, str]]] = []

    def add(self, key: str, value: float) -> None:
        self.results.setdefault(key, []).append(value)

    def new_step(self, sizes: list[int]) -> int:
        if self.step:
            remove_step(self.c, self.step)
        self.step += 1
        save_step(self.c, self.step, sizes, self.block)
        settle(self.c, self.step)
        return self.step

    def raw_files(self, step: int) -> list[str]:
        return sorted(str(p) for p in self.c.part(BIG, step).rglob("rank1-*.bin"))

    def cpu(self) -> list[float]:
        return [cpu_seconds(p) for p in self.c.pids()]

    def full_read(self, label: str, sizes: list[int], threads: int, raw_first: bool) -> None:
        """A fresh step read whole on node 2 (A) and the raw streams of its bytes (B);
        ``raw_first``: B before A (the repeats alternate)."""
        c = self.c
        step = self.new_step(sizes)
        files = remote_files(c, step)
        raw = self.raw_files(step)
        got: dict[str, Any] = {}

        def tierfs_read() -> None:
            quiesce(c.pids())
            cpu0 = self.cpu()
            if threads == 1:
                buf = bytearray(CHUNK)
                t = time.perf_counter()
                n, opens, firsts = 0, [], []
                for p in files:
                    k, t_open, t_first = read_one(p, buf)
                    n += k
                    opens.append(t_open)
                    firsts.append(t_first)
                dt = time.perf_counter() - t
                got.update(opens=opens, firsts=firsts)
            else:
                n, dt = read_all(files, threads)
            got.update(n=n, dt=dt, cpu=[x - y for x, y in zip(self.cpu(), cpu0, strict=True)])

        def raw_read() -> None:
            quiesce(c.pids())
            got["raw"] = self.raw.run(raw, threads, write=False)
            got["raw_write"] = self.raw.run(raw, threads, write=True)
            got["tcp_write"] = self.tcp.run(raw, threads, write=True)

        for part in (raw_read, tierfs_read) if raw_first else (tierfs_read, raw_read):
            part()
        n, dt, cpu = got["n"], got["dt"], got["cpu"]
        (rn, rdt), (wn, wdt), (tn, tdt) = got["raw"], got["raw_write"], got["tcp_write"]
        assert n == sum(sizes) == rn == wn == tn, (n, sum(sizes), rn, wn, tn)
        view = status(c.mounts[OWNER])["whole_view"]
        check_bytes(files, self.block)
        if threads == 1:
            opens, firsts = got["opens"], got["firsts"]
            self.add(f"{label}: first byte, step in the view (s)", firsts[0])
            self.add(f"{label}: open (fetch + check) per file, median (ms)", median(opens) * 1e3)
            self.add(f"{label}: share of the read time spent in open()", sum(opens) / dt)
        self.add(f"{label}: tierfs, {threads} reader(s) (MB/s)", n / dt / 1e6)
        self.add(f"{label}: CPU s/GiB node 1 (sender)", cpu[BIG] / (n / GiB))
        self.add(f"{label}: CPU s/GiB node 2 (fetcher)", cpu[OWNER] / (n / GiB))
        self.add(f"{label}: raw, {threads} stream(s), discarded (MB/s)", rn / rdt / 1e6)
        self.add(f"{label}: raw, {threads} stream(s), into tmpfs (MB/s)", wn / wdt / 1e6)
        self.add(f"{label}: raw TCP, {threads} stream(s), into tmpfs (MB/s)", tn / tdt / 1e6)
        print(
            f"  {label}, {threads} reader(s): tierfs {n / dt / 1e6:6.0f} MB/s   raw "
            f"{rn / rdt / 1e6:6.0f} MB/s (ratio {(n / dt) / (rn / rdt):.2f})   raw into tmpfs "
            f"{wn / wdt / 1e6:6.0f} MB/s (ratio {(n / dt) / (wn / wdt):.2f})   raw TCP into tmpfs "
            f"{tn / tdt / 1e6:6.0f} MB/s (ratio {(n / dt) / (tn / tdt):.2f})   "
            f"CPU/GiB node1 {cpu[BIG] / (n / GiB):.2f} s node2 {cpu[OWNER] / (n / GiB):.2f} s"
            f"   fetched {view['fetched_bytes']} errors {view['fetch_errors']}"
            + ("   (raw first)" if raw_first else ""),
            flush=True,
        )
        if threads == 1:
            print(
                f"      first byte of the first file {firsts[0] * 1e3:.0f} ms, median open "
                f"{median(opens) * 1e3:.1f} ms, {sum(opens) / dt:.0%} of the time in open()"
            )

    def first_byte(self, label: str, sizes: list[int], raw_first: bool) -> None:
        """First byte of rank 1's first file on node 2 (A) and the raw stream of that
        file (B); ``raw_first``: B before A (the repeats alternate)."""
        c = self.c
        step = self.new_step(sizes)
        files = remote_files(c, step)
        raw = self.raw_files(step)[0]
        got: dict[str, float] = {}

        def tierfs_read() -> None:
            quiesce(c.pids())
            buf = bytearray(1)
            t0 = time.perf_counter()
            with open(files[0], "rb", buffering=0) as f:
                got["open"] = time.perf_counter() - t0
                f.readinto(buf)
                got["first"] = time.perf_counter() - t0

        def raw_read() -> None:
            quiesce(c.pids())
            got["raw"] = self.raw.first_byte(raw, write=False)
            got["raw_write"] = self.raw.first_byte(raw, write=True)
            self.raw.clean()

        for part in (raw_read, tierfs_read) if raw_first else (tierfs_read, raw_read):
            part()
        crc = crc_seconds(files[0])
        t_open, t_first, r, w = got["open"], got["first"], got["raw"], got["raw_write"]
        self.add(f"{label}: first byte (s)", t_first)
        self.add(f"{label}: raw stream of the file, discarded (s)", r)
        self.add(f"{label}: raw stream of the file, into tmpfs (s)", w)
        self.add(f"{label}: read back + crc32c of the file (s)", crc)
        print(
            f"  {label}: open {t_open * 1e3:.0f} ms, first byte {t_first * 1e3:.0f} ms;"
            f" raw stream of the file {r * 1e3:.0f} ms, into tmpfs {w * 1e3:.0f} ms;"
            f" read back + crc32c {crc * 1e3:.0f} ms   (/dev/shm {shm_used():.1f} GiB)"
            + ("   (raw first)" if raw_first else ""),
            flush=True,
        )

    def remount(self) -> float:
        """Node 2 lost with its RAM and mounted again; returns when ``tierfs mount`` did."""
        c = self.c
        c.lose(OWNER)
        c.mount(OWNER)
        return time.perf_counter()

    def mount_to_first_byte(self, label: str, sizes: list[int]) -> None:
        c = self.c
        step = self.new_step(sizes)
        name = remote_files(c, step)[0].name
        t0 = self.remount()
        target = c.mounts[OWNER] / str(step) / name
        named = 0.0
        buf = bytearray(1)
        timeline: list[tuple[float, str]] = []  # node 2's state changes on the way
        seen = ""
        while True:
            now = time.perf_counter() - t0
            if os.path.exists(target):
                named = now
                break
            if now > 300:
                raise SystemExit("mount to first byte: the name never appeared")
            try:
                st = status(c.mounts[OWNER])
                v = next((s for s in st["whole_view"]["steps"] if s["step"] == step), None)
                own = next((s for s in st["tiers"]["peer"]["steps"] if s["step"] == step), None)
                state = (
                    f"restore {st['restore'].get('state')}, own part "
                    f"{own.get('state') if own else 'absent'}, view "
                    + (f"missing ranks {v['ranks_missing']}" if v else "not looked at")
                )
            except (OSError, ValueError, KeyError):
                state = "no status"
            if state != seen:
                timeline.append((now, state))
                seen = state
            time.sleep(0.02)
        with open(target, "rb", buffering=0) as f:
            f.readinto(buf)
        t_first = time.perf_counter() - t0
        self.add(f"{label}: mount to first byte (s)", t_first)
        self.add(f"{label}: mount to name (s)", named)
        wait(lambda: view_entry(c.mounts[OWNER], step), 60, "the view after the remount")
        restored = next((t for t, s in timeline if s.startswith("restore done")), float("nan"))
        self.add(f"{label}: mount to restore done (s)", restored)
        print(
            f"  {label}: mount to first byte {t_first:.2f} s (restore done at "
            f"{restored:.2f} s, name at {named:.2f} s, fetch + first byte "
            f"{t_first - named:.2f} s)",
            flush=True,
        )
        for t, s in timeline:
            print(f"      {t:6.2f} s  {s}")
        self.timelines.append([(round(t, 3), s) for t, s in timeline])
        # let the background prefetch finish before the next measurement
        w = tierfs_cli("wait", str(c.mounts[OWNER]), "--bytes", "--timeout", "600", timeout=700)
        if w.returncode:
            self.notes.append(f"tierfs wait --bytes after a remount: {w.returncode} {w.stdout}")

    def prefetch(self, label: str, sizes: list[int]) -> None:
        """Remount of node 2: ``tierfs wait``, then ``tierfs wait --bytes`` (A); raw (B)."""
        c = self.c
        step = self.new_step(sizes)
        n = sum(sizes)
        t0 = self.remount()
        w1 = tierfs_cli("wait", str(c.mounts[OWNER]), "--timeout", "600", timeout=700)
        t_names = time.perf_counter() - t0
        w2 = tierfs_cli("wait", str(c.mounts[OWNER]), "--bytes", "--timeout", "600", timeout=700)
        t_bytes = time.perf_counter() - t0
        for w in (w1, w2):
            if w.returncode:
                raise SystemExit(f"tierfs wait: {w.returncode} {w.stdout} {w.stderr}")
        view = status(c.mounts[OWNER])["whole_view"]
        rate = n / (t_bytes - t_names)
        self.add(f"{label}: mount to names ready (s)", t_names)
        self.add(f"{label}: mount to all bytes (s)", t_bytes)
        self.add(f"{label}: prefetch after names (MB/s)", rate / 1e6)
        raw = self.raw_files(step)
        quiesce(c.pids())
        rn, rdt = self.raw.run(raw, 2, write=True)
        self.add(f"{label}: raw, 2 streams, into tmpfs (MB/s)", rn / rdt / 1e6)
        print(
            f"  {label}: tierfs wait {t_names:.2f} s ({w1.stdout.strip()}), "
            f"tierfs wait --bytes {t_bytes:.2f} s: {rate / 1e6:.0f} MB/s; raw 2 streams "
            f"into tmpfs {rn / rdt / 1e6:.0f} MB/s (ratio {rate / (rn / rdt):.2f}); "
            f"fetched {view['fetched_bytes']}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the step read whole")
    p.add_argument("--big-gib", type=float, default=4.0, help="the larger step (0: none)")
    p.add_argument("--small-files", type=int, default=200, help="files of 1 MiB (0: none)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="bench-out/whole_step_bench.json")
    p.add_argument(
        "--only",
        choices=("all", "small"),
        default="all",
        help="small: only the full reads of the small-file step (an A/B of a setting: "
        "run it alternately with and without, e.g. TIERFS_FETCH_BATCH=1)",
    )
    p.add_argument(
        "--mount-arg",
        action="append",
        default=[],
        help="one more argument of every tierfs mount (repeatable; an A/B of a "
        "setting, e.g. --mount-arg=--data-port=-1: every byte over gRPC)",
    )
    a = p.parse_args()
    MOUNT_ARGS.extend(a.mount_arg)

    def big_files(gib: float) -> list[int]:
        total = int(gib * GiB)
        return [min(256 * MiB, total - off) for off in range(0, total, 256 * MiB)]

    step_files = big_files(a.gib)
    small = [MiB] * a.small_files
    block = os.urandom(CHUNK)
    print(
        f"whole_step_bench: {NODES} nodes on loopback, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}; step of {a.gib:g} GiB in {len(step_files)} files",
        flush=True,
    )
    with cluster() as c:
        raw, tcp = Raw(), RawTcp()
        b = Bench(c, raw, block, tcp)
        try:
            for r in range(a.repeat):
                print(f"repeat {r + 1}", flush=True)
                rf = r % 2 == 1  # every second repeat measures the raw stream first
                if a.only == "small":
                    b.full_read(f"{len(small)} x 1 MiB step", small, 1, rf)
                    b.full_read(f"{len(small)} x 1 MiB step", small, 4, rf)
                    continue
                b.first_byte(f"{a.gib:g} GiB step, 256 MiB file", step_files, rf)
                if a.big_gib:
                    b.first_byte(f"{a.big_gib:g} GiB step, 256 MiB file", big_files(a.big_gib), rf)
                if small:
                    b.first_byte(f"{len(small)} x 1 MiB step, 1 MiB file", small, rf)
                b.full_read(f"{a.gib:g} GiB step", step_files, 1, rf)
                b.full_read(f"{a.gib:g} GiB step", step_files, 4, rf)
                if small:
                    b.full_read(f"{len(small)} x 1 MiB step", small, 1, rf)
                    b.full_read(f"{len(small)} x 1 MiB step", small, 4, rf)
                b.mount_to_first_byte(f"{a.gib:g} GiB step", step_files)
                b.prefetch(f"{a.gib:g} GiB step", step_files)
            errors = {i: c.errors(i) for i in range(NODES)}
        finally:
            raw.close()
            tcp.close()

    print("medians:")
    for k, v in b.results.items():
        print(f"  {k}: {median(v):.3f}  ({', '.join(f'{x:.3f}' for x in v)})")
    ratios = {}
    for k in list(b.results):
        if ": tierfs, " in k:
            label, rest = k.split(": tierfs, ")
            threads = rest.split(" ")[0]
            for kind in ("discarded", "into tmpfs"):
                base = f"{label}: raw, {threads} stream(s), {kind} (MB/s)"
                ratios[f"{label}, {threads} reader(s) / raw {kind}"] = median(
                    b.results[k]
                ) / median(b.results[base])
        elif k.endswith(": prefetch after names (MB/s)"):
            label = k.split(": ")[0]
            base = f"{label}: raw, 2 streams, into tmpfs (MB/s)"
            ratios[f"{label}, prefetch / raw into tmpfs"] = median(b.results[k]) / median(
                b.results[base]
            )
    print("ratios (goal >= 0.80 against the raw stream):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f} {'OK' if v >= 0.8 else 'BELOW GOAL'}")
    print("first byte (goal < 1 s whatever the step size):")
    for k, v in b.results.items():
        if "first byte" in k:
            print(f"  {k}: {median(v):.2f} s {'OK' if median(v) < 1 else 'ABOVE GOAL'}")
    for i, e in errors.items():
        print(f"replicator.errors of node {i}: {e.strip() or '(empty)'}")
    for n in b.notes:
        print(f"note: {n}")
    write_json(
        a.json,
        {
            "cpus": os.cpu_count(),
            "kernel": os.uname().release,
            "gib": a.gib,
            "big_gib": a.big_gib,
            "repeat": a.repeat,
            "results": b.results,
            "medians": {k: median(v) for k, v in b.results.items()},
            "ratios": ratios,
            "errors": errors,
            "notes": b.notes,
            "mount_timelines": b.timelines,
        },
    )


if __name__ == "__main__":
    main()
