"""The gRPC server's pool for plain handlers (tierfs/rpc/aio_server.py:
:class:`DaemonThreadPool`): it runs work like a thread pool and never holds up the
interpreter's exit with a thread stuck in a call."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent import futures

import pytest

from tierfs.rpc.aio_server import DaemonThreadPool


def test_a_process_exits_although_a_pool_thread_waits_for_ever():
    """Regression: ``make test-fast`` printed its summary and never returned on a loaded
    machine; the main thread joined a ``tierfs-rpc_0`` pool thread (a
    ``ThreadPoolExecutor``'s, joined at exit even after ``shutdown(wait=False)``) that
    waited in ``Future.result`` on a future of the stopped server's loop."""
    code = textwrap.dedent(
        """
        import threading
        from concurrent import futures
        from tierfs.rpc.aio_server import DaemonThreadPool

        pool = DaemonThreadPool(2, "tierfs-rpc")
        never = futures.Future()  # a future of a loop that has ended
        started = threading.Event()
        def stuck():
            started.set()
            never.result()
        pool.submit(stuck)
        started.wait()
        pool.shutdown(wait=False, cancel_futures=True)
        print("main done", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "main done\n"


def test_work_runs_and_its_errors_reach_the_caller():
    pool = DaemonThreadPool(3, "t")
    try:
        assert [f.result(timeout=30) for f in [pool.submit(pow, 2, n) for n in range(8)]] == [
            2**n for n in range(8)
        ]
        bad = pool.submit(int, "x")
        with pytest.raises(ValueError):
            bad.result(timeout=30)
        assert len(pool._threads) <= 3
    finally:
        pool.shutdown()


def test_idle_threads_are_reused_and_the_limit_holds_under_concurrency():
    pool = DaemonThreadPool(2, "t")
    gate = threading.Event()
    try:
        blocked = [pool.submit(gate.wait, 30) for _ in range(5)]
        assert len(pool._threads) == 2  # the other three wait in the queue
        gate.set()
        assert all(f.result(timeout=30) for f in blocked)
        for _ in range(5):
            pool.submit(int, "1").result(timeout=30)
        assert len(pool._threads) == 2
    finally:
        pool.shutdown()


def test_shutdown_cancels_what_has_not_started_and_refuses_new_work():
    pool = DaemonThreadPool(1, "t")
    gate = threading.Event()
    running = pool.submit(gate.wait, 30)
    queued = pool.submit(int, "1")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError):
        pool.submit(int, "1")
    gate.set()
    assert running.result(timeout=30) is True
    pool._threads[0].join(30)
    assert not pool._threads[0].is_alive()
    assert isinstance(running, futures.Future)
