"""A `tierfs csi` driver process and a kubelet-like client of it (tests/csi, tests/fuse)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
from conftest import SHM, tierfs

from tierfs.csi import mounts
from tierfs.rpc import csi_pb2 as pb2
from tierfs.rpc import csi_pb2_grpc as pb2_grpc

DRIVER = "tierfs.csi.dev"


class Driver:
    """One `tierfs csi` process and a kubelet-like client of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock_dir = Path(tempfile.mkdtemp(prefix="csik-", dir="/tmp"))
        self.endpoint = f"unix://{self.sock_dir}/csi.sock"
        self.mount_dir = root / "node-mount"
        self.state_dir = root / "state"
        self.ram_dir = SHM / f"tierfs-test-{uuid.uuid4().hex[:10]}"
        self.kubelet = root / "kubelet"
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[Path] = []
        self.channel: grpc.Channel | None = None

    # -- process
    def start(self, *extra: str, ram_dir: Path | None = None) -> None:
        log = self.root / f"driver-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tierfs",
                    "csi",
                    "--endpoint",
                    self.endpoint,
                    "--node-id",
                    "gke-node-1",
                    "--mount-dir",
                    str(self.mount_dir),
                    "--state-dir",
                    str(self.state_dir),
                    "--ram-dir",
                    str(ram_dir or self.ram_dir),
                    *extra,
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.channel = grpc.insecure_channel(self.endpoint)
        grpc.channel_ready_future(self.channel).result(timeout=30)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.identity.Probe(pb2.ProbeRequest(), timeout=10).ready.value:
                return
            time.sleep(0.1)
        raise AssertionError(f"driver not ready:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.channel.close()
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        self.proc = None
        return code

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def wait_log(self, text: str, timeout: float = 30) -> str:
        """Wait until the current driver's log holds ``text``; returns that log."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.logs[-1].read_text(errors="replace")
            if text in current:
                return current
            assert time.monotonic() < deadline, f"{text!r} not logged:\n{self.log()}"
            time.sleep(0.05)

    def daemon_pid(self) -> int:
        return int((self.ram_dir / "store" / "daemon.pid").read_text().split()[0])

    # -- stubs
    @property
    def identity(self) -> pb2_grpc.IdentityStub:
        return pb2_grpc.IdentityStub(self.channel)

    @property
    def node(self) -> pb2_grpc.NodeStub:
        return pb2_grpc.NodeStub(self.channel)

    # -- kubelet's side of an ephemeral inline volume
    def pod_volume(self, pod_uid: str, volume: str = "checkpoint") -> tuple[str, Path]:
        """Prepare the volume directory as kubelet does; returns (volume handle, target)."""
        vol_dir = self.kubelet / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / volume
        vol_dir.mkdir(parents=True, exist_ok=True)
        handle = "csi-" + hashlib.sha256((pod_uid + volume).encode()).hexdigest()
        (vol_dir / "vol_data.json").write_text(
            json.dumps(
                {
                    "specVolID": volume,
                    "driverName": DRIVER,
                    "volumeHandle": handle,
                    "volumeLifecycleMode": "Ephemeral",
                    "nodeName": "gke-node-1",
                }
            )
        )
        return handle, vol_dir / "mount"

    def publish(self, pod_uid: str, pod_name: str, attributes: dict[str, str]) -> Path:
        handle, target = self.pod_volume(pod_uid)
        context = {
            **attributes,
            "csi.storage.k8s.io/pod.name": pod_name,
            "csi.storage.k8s.io/pod.namespace": "default",
            "csi.storage.k8s.io/pod.uid": pod_uid,
            "csi.storage.k8s.io/serviceAccount.name": "default",
            "csi.storage.k8s.io/ephemeral": "true",
        }
        cap = pb2.VolumeCapability(
            mount=pb2.VolumeCapability.MountVolume(),
            access_mode=pb2.VolumeCapability.AccessMode(
                mode=pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
            ),
        )
        self.node.NodePublishVolume(
            pb2.NodePublishVolumeRequest(
                volume_id=handle,
                target_path=str(target),
                volume_capability=cap,
                readonly=False,
                volume_context=context,
            ),
            timeout=60,
        )
        return target

    def unpublish(self, pod_uid: str) -> None:
        handle, target = self.pod_volume(pod_uid)
        self.node.NodeUnpublishVolume(
            pb2.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(target)), timeout=60
        )
        # kubelet then removes vol_data.json and the volume directory
        (target.parent / "vol_data.json").unlink()
        target.parent.rmdir()

    def cleanup(self) -> None:
        """Kill what is left, unmount everything this test mounted, remove its RAM store."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        try:
            daemon: int | None = self.daemon_pid()
        except (OSError, ValueError):
            daemon = None
        for entry in reversed(mounts.read_mountinfo()):
            if entry.mountpoint.startswith(str(self.kubelet) + "/"):
                try:
                    mounts.unmount(entry.mountpoint)
                except OSError:
                    pass
        if mounts.mounts_at(str(self.mount_dir)):
            tierfs("unmount", str(self.mount_dir), "--lazy", check=False)
        while mounts.mounts_at(str(self.mount_dir)):
            mounts.unmount(str(self.mount_dir))
        if daemon is not None:  # only if that pid is still this test's daemon
            try:
                cmdline = Path(f"/proc/{daemon}/cmdline").read_bytes()
                if str(self.ram_dir).encode() in cmdline:
                    os.kill(daemon, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        shutil.rmtree(self.ram_dir, ignore_errors=True)
        shutil.rmtree(self.sock_dir, ignore_errors=True)
