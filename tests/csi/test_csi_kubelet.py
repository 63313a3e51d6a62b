"""Kubelet emulation: `tierfs csi` as a process, called the way kubelet calls a CSI driver.

The sequence follows what kubelet does for a CSI ephemeral inline volume
(``volumes: [{name: checkpoint, csi: {driver: tierfs.csi.dev}}]``) when the
CSIDriver object says ``podInfoOnMount: true``: node-driver-registrar asks
GetPluginInfo, kubelet asks NodeGetInfo at registration; at pod start kubelet
creates ``pods/<uid>/volumes/kubernetes.io~csi/<volume>/``, writes
``vol_data.json`` there and calls NodePublishVolume with ``.../mount`` as
target_path, a ``csi-<sha256>`` volume handle and the ``csi.storage.k8s.io/*``
context keys; at pod end NodeUnpublishVolume.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
from conftest import SHM, is_mounted, tierfs
from csi_driver import DRIVER, Driver

from tierfs.csi import mounts
from tierfs.rpc import csi_pb2 as pb2


@pytest.fixture
def driver(tmp_path):
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root")
    d = Driver(tmp_path)
    yield d
    d.cleanup()


POD_UID = "0b7e5a7e-3c1d-4c1e-9d55-6f1c0b52aa01"
POD_NAME = "llama-slice-0-1-q8z2x"
ATTRS = {
    "jaxProcessId": "auto",
    "jaxProcessesPerJob": "2",
    "jaxCoordinatorAddress": "llama-slice-0-0.llama",
}


def test_registration_publish_restart_unpublish(driver):
    driver.start()
    info = driver.identity.GetPluginInfo(pb2.GetPluginInfoRequest(), timeout=10)
    assert info.name == DRIVER
    driver.wait_ready()
    st = os.stat(server_socket := driver.endpoint[len("unix://") :])
    assert oct(st.st_mode & 0o777) == "0o600", server_socket
    assert driver.node.NodeGetInfo(pb2.NodeGetInfoRequest(), timeout=10).node_id == "gke-node-1"
    assert (
        list(
            driver.identity.GetPluginCapabilities(
                pb2.GetPluginCapabilitiesRequest(), timeout=10
            ).capabilities
        )
        == []
    )

    target = driver.publish(
        POD_UID,
        POD_NAME,
        {**ATTRS, "csi.storage.k8s.io/serviceAccount.tokens": '{"x":{"token":"SA-TOKEN-xyz"}}'},
    )
    assert mounts.top_mount(str(target)).fstype == "fuse.tierfs"
    # the trainer's view: jax-init-info.txt, then plain file I/O
    assert (target / "jax-init-info.txt").read_text() == "1\nllama-slice-0-0.llama:8476\n"
    (target / "100.orbax-checkpoint-tmp").mkdir()
    (target / "100.orbax-checkpoint-tmp" / "state.bin").write_bytes(os.urandom(1 << 20))
    os.rename(target / "100.orbax-checkpoint-tmp", target / "100")
    data = (target / "100" / "state.bin").read_bytes()
    assert len(data) == 1 << 20
    assert (driver.ram_dir / "view" / "100" / "state.bin").read_bytes() == data  # in RAM store
    daemon = driver.daemon_pid()

    # the driver crashes (kill -9) and comes back: the daemon and the pod's mount live on
    driver.stop(signal.SIGKILL)
    assert (target / "100" / "state.bin").read_bytes() == data
    driver.start()
    driver.wait_ready()
    assert driver.daemon_pid() == daemon  # adopted, not mounted twice
    assert len([e for e in mounts.read_mountinfo() if e.mountpoint == str(driver.mount_dir)]) == 1
    # kubelet retries a publish it is unsure of: idempotent across the restart
    assert driver.publish(POD_UID, POD_NAME, ATTRS) == target

    # the driver is restarted cleanly (SIGTERM) with the volume still published
    assert driver.stop(signal.SIGTERM) == 0
    assert "leaving the node mount up" in driver.log()
    assert is_mounted(driver.mount_dir) and (target / "100" / "state.bin").exists()
    driver.start()
    driver.wait_ready()

    driver.unpublish(POD_UID)
    assert not target.exists() and mounts.mounts_at(str(target)) == []
    assert driver.stop(signal.SIGTERM) == 0
    assert not is_mounted(driver.mount_dir)  # nothing published: the node mount goes too
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(daemon, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("daemon still running after the driver stopped")
    log = driver.log()
    assert "SA-TOKEN-xyz" not in log and "<redacted>" in log


def test_container_restart_loses_no_checkpoint(driver):
    """Driver and daemon die together (a container restart); the RAM store survives.

    The pod's old bind mount is dead (ENOTCONN); the new driver mounts the
    same RAM store again, kubelet unpublishes the dead mount, and a new pod
    publishing the volume sees the checkpoint written before.
    """
    driver.start()
    driver.wait_ready()
    target = driver.publish(POD_UID, POD_NAME, {})
    (target / "7").mkdir()
    (target / "7" / "weights").write_bytes(b"w" * 65536)
    daemon = driver.daemon_pid()
    driver.stop(signal.SIGKILL)
    os.kill(daemon, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and mounts.is_dead(str(target)) is False:
        time.sleep(0.05)
    assert mounts.is_dead(str(target))

    driver.start()
    driver.wait_ready()
    assert driver.daemon_pid() != daemon
    driver.unpublish(POD_UID)  # the dead bind mount goes
    assert mounts.mounts_at(str(target)) == [] and not target.exists()
    new_uid = "0b7e5a7e-3c1d-4c1e-9d55-6f1c0b52aa02"
    target2 = driver.publish(new_uid, "llama-slice-0-1-n3w00", {})
    assert (target2 / "7" / "weights").read_bytes() == b"w" * 65536
    driver.unpublish(new_uid)
    assert driver.stop(signal.SIGTERM) == 0
    assert not is_mounted(driver.mount_dir)


def test_driver_remounts_a_daemon_that_died(driver):
    """The daemon alone is killed: the driver reaps it, mounts the RAM store again."""
    driver.start()
    driver.wait_ready()
    target = driver.publish(POD_UID, POD_NAME, {})
    (target / "12").mkdir()
    (target / "12" / "opt").write_bytes(b"o" * 4096)
    daemon = driver.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, driver.log()
        try:
            if (
                driver.daemon_pid() != daemon
                and driver.identity.Probe(pb2.ProbeRequest(), timeout=10).ready.value
            ):
                break
        except (OSError, ValueError, grpc.RpcError):
            pass
        time.sleep(0.1)
    assert not Path(f"/proc/{daemon}").exists()  # reaped, no zombie left
    assert "exited with status -9" in driver.log()
    assert mounts.is_dead(str(target))  # the pod's old mount stays dead until re-published
    driver.unpublish(POD_UID)
    target = driver.publish(POD_UID, POD_NAME, {})
    assert (target / "12" / "opt").read_bytes() == b"o" * 4096
    driver.unpublish(POD_UID)
    assert driver.stop(signal.SIGTERM) == 0
    assert not is_mounted(driver.mount_dir)


def test_node_mount_and_ram_dir_are_not_targets(driver):
    """Unpublish of --mount-dir used to unmount the node mount (the daemon exited,
    pods saw ENOTCONN, the driver remounted 2.4 s later); publish at
    --mount-dir/sub bind-mounted tierfs inside itself. Both, and the ram-dir,
    are INVALID_ARGUMENT now, and the daemon lives on."""
    driver.start()
    driver.wait_ready()
    target = driver.publish(POD_UID, POD_NAME, {})
    daemon = driver.daemon_pid()
    cap = pb2.VolumeCapability(
        mount=pb2.VolumeCapability.MountVolume(),
        access_mode=pb2.VolumeCapability.AccessMode(
            mode=pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
        ),
    )
    for path in (
        driver.mount_dir,
        driver.mount_dir / "sub",
        driver.ram_dir,
        driver.ram_dir / "view" / "x",
    ):
        with pytest.raises(grpc.RpcError) as exc:
            driver.node.NodeUnpublishVolume(
                pb2.NodeUnpublishVolumeRequest(volume_id="csi-x", target_path=str(path)), timeout=60
            )
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
        with pytest.raises(grpc.RpcError) as exc:
            driver.node.NodePublishVolume(
                pb2.NodePublishVolumeRequest(
                    volume_id="csi-x", target_path=str(path), volume_capability=cap
                ),
                timeout=60,
            )
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
    assert not (driver.mount_dir / "sub").exists() and not (driver.ram_dir / "view" / "x").exists()
    assert driver.daemon_pid() == daemon and not mounts.is_dead(str(target))
    assert len(mounts.mounts_at(str(driver.mount_dir))) == 1
    (target / "1").mkdir()  # the pod's volume never went away
    driver.unpublish(POD_UID)
    assert driver.stop(signal.SIGTERM) == 0


def test_adopted_daemon_with_other_options_is_warned_about(driver):
    """A restarted driver adopted the running daemon without comparing its
    configuration; now a difference from the driver's flags is a warning."""
    driver.start()
    driver.wait_ready()
    daemon = driver.daemon_pid()
    # Probe is ready once the mount answers; the driver writes its record of the
    # mount just after `tierfs mount` returned (a busy machine shows the gap)
    record_file = driver.state_dir / "node-mount.json"
    deadline = time.monotonic() + 30
    while not record_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    record = record_file.read_text()
    assert str(driver.ram_dir) in record
    driver.stop(signal.SIGKILL)
    driver.start()  # the same flags: adopted quietly
    driver.wait_ready()
    log = driver.wait_log(f"adopted the running tierfs daemon (pid {daemon})")
    assert "differs" not in log and "without a record" not in log

    driver.stop(signal.SIGKILL)
    other_ram = SHM / f"tierfs-test-other-{uuid.uuid4().hex[:8]}"
    try:
        driver.start("--keep-local", "5", ram_dir=other_ram)
        driver.wait_ready()
        log = driver.wait_log("differs from this driver's flags")
        assert f"ram-dir {driver.ram_dir} (this driver's: {other_ram})" in log
        assert "--keep-local 5" in log
        assert driver.daemon_pid() == daemon  # adopted, not replaced
        cap = pb2.VolumeCapability(
            mount=pb2.VolumeCapability.MountVolume(),
            access_mode=pb2.VolumeCapability.AccessMode(
                mode=pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
            ),
        )
        for ram in (driver.ram_dir, other_ram):  # both ram-dirs stay out of reach
            with pytest.raises(grpc.RpcError) as exc:
                driver.node.NodePublishVolume(
                    pb2.NodePublishVolumeRequest(
                        volume_id="v", target_path=str(ram / "x"), volume_capability=cap
                    ),
                    timeout=60,
                )
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert driver.stop(signal.SIGTERM) == 0
    finally:
        shutil.rmtree(other_ram, ignore_errors=True)


def test_probe_reports_a_mount_that_cannot_start(driver, tmp_path):
    """A ram-dir that cannot be created: Probe says FAILED_PRECONDITION, with the reason."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    driver.ram_dir = blocker / "ram"
    driver.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            driver.identity.Probe(pb2.ProbeRequest(), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "ram-dir" in exc.details()
            break
        assert time.monotonic() < deadline, driver.log()
        time.sleep(0.1)
    assert driver.stop(signal.SIGTERM) == 0


def test_csi_command_is_registered_and_checks_its_arguments():
    out = tierfs("--help").stdout
    assert "csi" in out
    assert "--node-id" in tierfs("csi", "--help").stdout
    for args, message in [
        (["--node-id", "n"], "--ram-dir is required"),
        (
            ["--node-id", "n", "--ram-dir", "/dev/shm/x", "--endpoint", "tcp://1.2.3.4:5"],
            "only unix sockets",
        ),
        (["--node-id", "n", "--ram-dir", "/dev/shm/x", "--driver-name", "-bad-"], "driver name"),
        (
            ["--node-id", "n", "--ram-dir", "/dev/shm/x", "--size", "8g"],
            "--size '8g': unknown suffix 'g'",
        ),
    ]:
        proc = tierfs("csi", *args, check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    proc = tierfs(
        "csi",
        "--node-id",
        "n",
        "--ram-dir",
        "/dev/shm/x",
        check=False,
        env=dict(os.environ, TIERFS_GCS_TIMEOUT="2 minutes"),
    )
    assert proc.returncode != 0 and "TIERFS_GCS_TIMEOUT='2 minutes'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("first", ["tierfs.cli.main", "tierfs.csi.cli"])
def test_either_import_order_registers_csi(first):
    """tierfs.cli.main imports tierfs.csi.cli while being imported; both orders must work."""
    code = (
        f"import {first}; import tierfs.cli.main as m, tierfs.csi.cli as c; "
        "assert m.main.commands['csi'] is c.csi"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
