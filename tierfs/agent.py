"""The node agent: the job state machine of one node (placeholder until sealing lands)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import trio

from tierfs.config import NodeConfig
from tierfs.fs.namespace import FsEvents, Namespace, NullEvents
from tierfs.fs.ramstore import Budget, RamStore

STATUS_FILE = b".tierfs/status.json"


class NodeAgent:
    """Job state machine of one node.

    Args:
        config: the node configuration.
        store: the RAM store.
        budget: the RAM budget.
    """

    def __init__(self, config: NodeConfig, store: RamStore, budget: Budget) -> None:
        self.config = config
        self.store = store
        self.budget = budget
        self.ns: Namespace | None = None
        self.started = time.time()

    def fs_events(self) -> FsEvents:
        """The receiver of namespace events."""
        return NullEvents()

    def virtual_files(self) -> dict[bytes, Callable[[], bytes]]:
        """Daemon-generated files in the mount (relative path -> content generator)."""
        return {STATUS_FILE: self.status_json}

    def attach(self, ns: Namespace) -> None:
        """Bind the namespace and prepare the daemon-managed ``.tierfs/`` directory."""
        self.ns = ns
        control = os.path.join(self.store.view, ".tierfs")
        os.makedirs(control, exist_ok=True)
        os.chmod(control, 0o755)
        path = os.path.join(self.store.view, os.fsdecode(STATUS_FILE))
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(self.status_json())
            os.chmod(path, 0o444)

    def status(self) -> dict[str, object]:
        """The node's status as plain data (what ``tierfs status`` prints)."""
        return {
            "mountpoint": os.path.abspath(self.config.mountpoint),
            "ram_dir": self.store.root,
            "pid": os.getpid(),
            "uptime_seconds": round(time.time() - self.started, 1),
            "budget": {"mode": self.budget.mode, "total_bytes": self.budget.size,
                       "used_bytes": self.budget.used(), "free_bytes": self.budget.free()},
            "passthrough": bool(self.ns and self.ns.passthrough),
            "job": None,
            "steps": [],
            "errors": [],
        }

    def status_json(self) -> bytes:
        return (json.dumps(self.status(), indent=2, sort_keys=True) + "\n").encode()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run until cancelled."""
        task_status.started()
        await trio.sleep_forever()

    async def shutdown(self) -> None:
        """Persist state before the daemon exits."""
