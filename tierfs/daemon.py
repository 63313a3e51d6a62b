"""The node daemon: one trio process owning the mount, the node agent and its servers.

Startup is ordered (s3ql style): open the RAM store, count its bytes, build
the namespace, mount, serve FUSE requests, then start the node agent.
Shutdown (SIGTERM, SIGINT or an external ``umount``) unmounts and lets every
task finish; nothing in the RAM store is lost because every byte already
lives on tmpfs.
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from tierfs.core.config import NodeConfig
from tierfs.fuse.namespace import Namespace
from tierfs.fuse.session import FuseSession, MountOptions
from tierfs.store.ramstore import Budget, RamStore

if TYPE_CHECKING:
    from tierfs.node.agent import NodeAgent

log = logging.getLogger(__name__)

#: top-level name of the daemon-managed directory in the mount
CONTROL_DIR = ".tierfs"
#: the FUSE session's request counters (JSON, generated when opened)
FUSE_COUNTERS_FILE = b".tierfs/fuse.json"


def setup_logging(config: NodeConfig, foreground: bool) -> None:
    """Log to stderr in the foreground, else to a rotating file in the RAM store."""
    root = logging.getLogger()
    root.setLevel(config.log_level.upper())
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler
    if foreground and not config.log_file:
        handler = logging.StreamHandler(sys.stderr)
    else:
        path = config.log_file or RamStore(config.ram_dir).log_file
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=16 << 20, backupCount=2)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    logging.getLogger("google").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE as far as allowed: every inode the kernel holds is one fd."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = max(hard, int(f.read()))
        except (OSError, ValueError):
            pass
    for limit in (target, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            return limit
        except (ValueError, OSError):
            continue
    return soft


class NodeDaemon:
    """One node: RAM store, namespace, FUSE session and node agent.

    Args:
        config: validated node configuration (``mountpoint`` and ``ram_dir`` set).
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.store = RamStore(config.ram_dir)
        self.options = MountOptions.parse(config.mount_options)
        self.budget: Budget | None = None
        self.ns: Namespace | None = None
        self.session: FuseSession | None = None
        self.agent = None  # the NodeAgent, created in run()
        self._stop = trio.Event()

    def _write_pid(self) -> None:
        tmp = self.store.pid_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n{os.path.abspath(self.config.mountpoint)}\n")
        os.replace(tmp, self.store.pid_file)

    def _build(self) -> None:
        from tierfs.node.agent import NodeAgent  # the agent imports the tiers; keep startup lazy

        self.store.clear_incoming()
        used = self.store.usage()
        self.budget = Budget(self.store.root, self.config.size, used, recount=self.store.usage)
        self.store.attach_budget(self.budget)  # emptied trash frees budget at once
        self.agent = NodeAgent(self.config, self.store, self.budget)
        attach_tiers(self.agent)
        virtual = dict(self.agent.virtual_files())
        virtual[FUSE_COUNTERS_FILE] = self._fuse_counters
        self.ns = Namespace(
            self.store.view,
            self.budget,
            events=self.agent.fs_events(),
            reserved=frozenset({CONTROL_DIR.encode()}),
            virtual=virtual,
        )
        self.agent.attach(self.ns)
        counters = os.path.join(self.store.view, os.fsdecode(FUSE_COUNTERS_FILE))
        if not os.path.exists(counters):
            with open(counters, "wb") as f:
                f.write(b"{}\n")
            os.chmod(counters, 0o444)
        self.session = FuseSession(self.ns, self.config.mountpoint, self.options)

    def _fuse_counters(self) -> bytes:
        return self.session.counters_json() if self.session is not None else b"{}\n"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Mount, serve and run the agent until unmounted or signalled.

        ``task_status.started()`` fires once the kernel finished INIT, i.e.
        when the mount answers requests.

        Raises:
            OSError: mounting failed (e.g. ENOENT for a missing /dev/fuse).
        """
        os.umask(0)
        raise_fd_limit()
        self._build()
        assert self.session is not None and self.agent is not None
        self.session.mount()
        self._write_pid()
        log.info(
            "mounted %s (ram-dir %s, budget %d bytes, %s accounting)",
            self.config.mountpoint,
            self.store.root,
            self.budget.size if self.budget else 0,
            self.budget.mode if self.budget else "?",
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve_then_stop, nursery.cancel_scope)
                nursery.start_soon(self._signals)
                with trio.fail_after(30):
                    await self.session.initialized.wait()
                await nursery.start(self.agent.run)
                if self.config.metrics_port:
                    self._serve_metrics(self.config.metrics_port)
                task_status.started()
                await self._stop.wait()
                self._unmount()
        except BaseException:
            # a start that fails after mount(2) must not leave a dead mount behind
            self._unmount()
            raise
        finally:
            try:
                os.unlink(self.store.pid_file)
            except OSError:
                pass
            log.info("daemon stopped")

    def _serve_metrics(self, port: int) -> None:
        from tierfs.node import metrics

        agent = self.agent
        assert agent is not None
        token = trio.lowlevel.current_trio_token()
        # the exporter thread reads the agent's status on the trio thread
        metrics.serve(port, lambda: trio.from_thread.run_sync(agent.status, trio_token=token))

    async def _serve_then_stop(self, scope: trio.CancelScope) -> None:
        assert self.session is not None
        try:
            await self.session.serve()
        finally:
            self._stop.set()
            if self.agent is not None:
                await self.agent.shutdown()
            scope.cancel()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for signum in sigs:
                log.info("signal %d: unmounting", signum)
                self._unmount()
                self._stop.set()
                return

    def _unmount(self) -> None:
        if self.session is None:
            return
        try:
            self.session.unmount(lazy=True)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOENT):
                log.warning("unmount: %s", exc)
        # After a lazy unmount the kernel keeps the connection while files are
        # open; closing the channel ends it so the serve loop returns.
        self.session.close()


def attach_tiers(agent: NodeAgent) -> None:
    """Give ``agent`` its cluster and the tiers its configuration asks for.

    Without a peer plane (no ``--listen``/``--coordinator``) the node is a
    one-node cluster (:class:`tierfs.node.agent.LocalCluster`) and no tier follows
    its sealed steps. With one, the node gets a :class:`tierfs.replication.peer.PeerTier`
    (replication, gRPC server) and a :class:`tierfs.node.peer_restore.PeerCluster`
    (restore rounds through the coordinator). The GCS tier comes last: it
    wraps the cluster, takes the peer tier's backup orders and, without
    ``--coordinator``, gives it the bucket rendezvous.
    """
    from tierfs.backup.tier import attach_gcs
    from tierfs.node.peer_restore import PeerCluster
    from tierfs.replication.peer import PeerTier

    config = agent.config
    if config.listen or config.coordinator:
        tier = PeerTier(agent)
        agent.tiers.append(tier)
        agent.cluster = PeerCluster(tier)
    # the durable tier (off without --bucket); it wraps the cluster set above
    attach_gcs(agent)


def run_foreground(config: NodeConfig, on_ready: Callable[[], None] | None = None) -> int:
    """Run a daemon in this process until it stops; returns an exit status."""
    daemon = NodeDaemon(config)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.run)
            if on_ready is not None:
                on_ready()

    trio.run(main)
    return 0
