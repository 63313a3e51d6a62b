"""``--size`` as a tmpfs of the budget's size on the ram-dir (issue 13, part 1).

The kernel enforces the budget (ENOSPC, statfs) and file data keeps FUSE
passthrough; the tmpfs belongs to the ram-dir and outlives the daemon. The
policy is tested as a pure function, the tmpfs handling on real mounts.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import SHM, is_mounted, tierfs
from fs_helpers import err

from tierfs.cli.status import format_status
from tierfs.core import syscalls
from tierfs.store import ramtmpfs
from tierfs.store.ramtmpfs import Plan, RamDirFacts, plan

MiB = 1 << 20
GiB = 1 << 30


def facts(**kw) -> RamDirFacts:
    base = dict(
        mounted=None,
        capacity=12 * GiB,
        below=12 * GiB,
        used=0,
        fs_type="tmpfs",
        empty=True,
        root=True,
    )
    return RamDirFacts(**(base | kw))


@pytest.mark.parametrize(
    "f, size, action",
    [
        (facts(), None, "none"),  # no --size: the filesystem as it is
        (facts(), 64 * MiB, "mount"),  # the case --size is for
        (facts(), 12 * GiB, "none"),  # not below the filesystem
        (facts(), 20 * GiB, "none"),  # more than it: capped (cli warns)
        (facts(empty=False), 64 * MiB, "managed"),  # a store on a shared tmpfs
        (facts(root=False), 64 * MiB, "managed"),  # cannot mount
        (facts(fs_type="ext4"), 64 * MiB, "managed"),  # bytes were meant for a disk
        (facts(mounted="other"), 64 * MiB, "managed"),  # never stacked on another mount
        (facts(mounted="ours", capacity=64 * MiB), None, "reuse"),
        (facts(mounted="ours", capacity=64 * MiB), 64 * MiB, "reuse"),
        (facts(mounted="ours", capacity=64 * MiB), 128 * MiB, "resize"),
        (facts(mounted="ours", capacity=64 * MiB, used=8 * MiB), 32 * MiB, "resize"),
        (facts(mounted="ours", capacity=64 * MiB, used=40 * MiB), 32 * MiB, "managed"),
    ],
)
def test_plan(f, size, action):
    p = plan(f, size)
    assert p.action == action, p
    if action == "managed":
        assert "counts the budget itself" in p.reason and "\n" not in p.reason


def test_plan_sizes_are_whole_pages_and_capped_by_the_filesystem_below():
    assert plan(facts(), 100_000_000) == Plan(
        "mount", 99_999_744, plan(facts(), 100_000_000).reason
    )
    grown = plan(facts(mounted="ours", capacity=64 * MiB, below=1 * GiB), 4 * GiB)
    assert (grown.action, grown.size) == ("resize", 1 * GiB)


@pytest.fixture
def tmpfs_dir(tmp_path):
    """Factory: a fresh tmpfs of ``size`` mounted on a new directory (unmounted after)."""
    made: list[Path] = []

    def factory(size: str) -> Path:
        d = tmp_path / f"vol{len(made)}"
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True)
        made.append(d)
        return d

    yield factory
    for d in made:
        subprocess.run(["umount", "-l", str(d)], check=False)


def total(path: Path) -> int:
    return shutil.disk_usage(path).total


def test_fit_volume_shrinks_a_larger_ram_volume(tmpfs_dir):
    """The CSI driver's RAM volume, mounted larger than the budget by the kubelet."""
    vol = tmpfs_dir("256m")
    (vol / "old").write_bytes(b"k" * MiB)
    assert ramtmpfs.fit_volume(str(vol), 64 * MiB).startswith("resized the RAM volume")
    assert total(vol) == 64 * MiB
    assert (vol / "old").read_bytes() == b"k" * MiB  # the same tmpfs: nothing moved
    assert ramtmpfs.fit_volume(str(vol), 64 * MiB) == ""  # already the budget
    assert ramtmpfs.fit_volume(str(vol), 128 * MiB) == ""  # never grown (the kubelet's size)
    assert total(vol) == 64 * MiB


def test_fit_volume_keeps_a_volume_holding_more_than_the_budget(tmpfs_dir):
    vol = tmpfs_dir("64m")
    (vol / "data").write_bytes(b"d" * (20 * MiB))
    message = ramtmpfs.fit_volume(str(vol), 16 * MiB)
    assert "holds 20.0 MiB, more than the budget 16.0 MiB" in message
    assert total(vol) == 64 * MiB


def test_fit_volume_ignores_what_is_not_a_tmpfs_mount_root(tmpfs_dir, tmp_path):
    vol = tmpfs_dir("64m")
    (vol / "sub").mkdir()
    assert ramtmpfs.fit_volume(str(vol / "sub"), 16 * MiB) == ""
    assert ramtmpfs.fit_volume(str(tmp_path), 16 * MiB) == ""
    assert total(vol) == 64 * MiB
    with pytest.raises(OSError) as info:
        syscalls.reconfigure(str(vol / "sub"), {"size": str(16 * MiB)})
    assert info.value.errno == errno.EINVAL


# ---------------------------------------------------------------- real mounts


def ram_mount(ram: Path) -> dict[str, str] | None:
    from tierfs.core.mounts import mount_entry

    return mount_entry(str(ram))


def status(m) -> dict:
    return json.loads((m.path / ".tierfs" / "status.json").read_text())


def fill(path: Path) -> tuple[int, int]:
    """Write 1 MiB blocks to ``path`` until an error; returns (bytes, errno)."""
    written = 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        while written < 4 * GiB:
            try:
                written += os.write(fd, b"\xab" * MiB)
            except OSError as exc:
                return written, exc.errno or -1
    finally:
        os.close(fd)
    return written, 0


def test_size_is_a_tmpfs_of_the_budget_with_passthrough_and_exact_enospc(make_mount):
    """Regression (issue 13): --size below /dev/shm counted bytes in the daemon and
    turned passthrough off (writes 0.5 of tmpfs, cold reads 0.4)."""
    m = make_mount("-o", "allow_other", "--size", "64MiB")
    entry = ram_mount(m.ram_dir)
    assert entry is not None and entry["fstype"] == "tmpfs" and entry["source"] == "tierfs-ram"
    assert "size=65536k" in entry["options"] and "mode=700" in entry["options"]
    assert "warning" not in m.mount_stderr
    st = status(m)
    assert st["passthrough"] is True
    assert st["budget"]["mode"] == "native" and st["budget"]["total_bytes"] == 64 * MiB
    assert total(m.path) == 64 * MiB
    # tierfs status names the budget (it said "no --size" for this mount)
    budget = [line for line in format_status(st) if line.startswith("budget")]
    assert budget == [
        "budget     64.0 MiB (--size, a tmpfs of that size: the kernel enforces it); passthrough on"
    ], budget
    keep = os.urandom(MiB)
    (m.path / "keep").write_bytes(keep)
    written, e = fill(m.path / "big")
    assert e == errno.ENOSPC, errno.errorcode.get(e)
    assert 60 * MiB <= written < 64 * MiB
    assert shutil.disk_usage(m.path).free < MiB
    assert (m.path / "keep").read_bytes() == keep
    assert (m.path / "big").stat().st_size == written
    os.unlink(m.path / "big")  # freed once the kernel forgets the inode: no count
    deadline = time.monotonic() + 10
    while shutil.disk_usage(m.path).free < 60 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shutil.disk_usage(m.path).free > 60 * MiB
    (m.path / "again").write_bytes(b"a" * (60 * MiB))
    assert os.kill(m.pid(), 0) is None


def test_the_budget_tmpfs_outlives_unmount_and_kill9_and_is_found_again(make_mount):
    m = make_mount("-o", "allow_other", "--size", "64MiB")
    (m.path / "step_1").mkdir()
    (m.path / "step_1" / "w").write_bytes(b"w" * (5 * MiB))
    m.unmount()
    assert ram_mount(m.ram_dir) is not None  # `tierfs unmount` keeps the RAM store
    assert (m.ram_dir / "view" / "step_1" / "w").stat().st_size == 5 * MiB
    m.args = ["-o", "allow_other"]  # no --size: the tmpfs is used at its size
    m.mount()
    assert total(m.path) == 64 * MiB and status(m)["passthrough"] is True
    assert (m.path / "step_1" / "w").read_bytes() == b"w" * (5 * MiB)
    os.kill(m.pid(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while err(os.statvfs, m.path) != errno.ENOTCONN and time.monotonic() < deadline:
        time.sleep(0.05)
    m.args = ["-o", "allow_other", "--size", "64MiB"]
    m.mount()
    assert (m.path / "step_1" / "w").read_bytes() == b"w" * (5 * MiB)
    assert [e for e in open("/proc/self/mountinfo") if f" {m.ram_dir} " in e].__len__() == 1


def test_a_new_size_resizes_the_tmpfs_and_a_too_small_one_keeps_it(make_mount):
    m = make_mount("-o", "allow_other", "--size", "64MiB")
    (m.path / "data").write_bytes(b"d" * (40 * MiB))
    m.unmount()
    m.args = ["-o", "allow_other", "--size", "128MiB"]
    m.mount()
    assert total(m.path) == 128 * MiB and status(m)["passthrough"] is True
    m.unmount()
    m.args = ["-o", "allow_other", "--size", "32MiB"]  # below the 40 MiB it holds
    m.mount()
    assert "already holds 40." in m.mount_stderr and "counts the budget" in m.mount_stderr
    st = status(m)
    assert st["budget"]["mode"] == "managed" and st["passthrough"] is False
    assert total(m.path) == 32 * MiB
    assert total(m.ram_dir) == 128 * MiB  # kept as it was
    assert (m.path / "data").read_bytes() == b"d" * (40 * MiB)
    assert err((m.path / "more").write_bytes, b"m" * MiB) == errno.ENOSPC


def test_rm_rf_of_the_ram_dir_frees_its_bytes_and_umount_the_tmpfs(make_mount):
    """The README's story: unmount, then throw the RAM store away."""
    m = make_mount("-o", "allow_other", "--size", "64MiB")
    (m.path / "blob").write_bytes(b"b" * (30 * MiB))
    m.unmount()
    assert shutil.disk_usage(m.ram_dir).used >= 30 * MiB
    proc = subprocess.run(
        ["rm", "-rf", str(m.ram_dir)], capture_output=True, text=True, check=False
    )
    assert "Device or resource busy" in proc.stderr  # the mount point itself stays
    assert os.listdir(m.ram_dir) == []
    assert shutil.disk_usage(m.ram_dir).used == 0  # every byte is gone
    assert ramtmpfs.discard(str(m.ram_dir)) is True
    assert ram_mount(m.ram_dir) is None
    os.rmdir(m.ram_dir)
    assert ramtmpfs.discard(str(m.ram_dir)) is False


def test_a_ram_dir_that_holds_a_store_keeps_the_managed_budget(make_mount):
    """A store already on /dev/shm cannot move under a new mount (it would be hidden):
    tierfs counts bytes itself, and says so."""
    m = make_mount("-o", "allow_other")
    (m.path / "old").write_bytes(b"o" * MiB)
    m.unmount()
    m.args = ["-o", "allow_other", "--size", "64MiB"]
    m.mount()
    assert "the ram-dir is not empty" in m.mount_stderr
    assert ram_mount(m.ram_dir) is None
    st = status(m)
    assert st["budget"]["mode"] == "managed" and st["passthrough"] is False
    assert total(m.path) == 64 * MiB
    assert (m.path / "old").read_bytes() == b"o" * MiB


def test_a_ram_dir_in_use_is_refused_before_its_tmpfs_is_touched(make_mount, tmp_path):
    m = make_mount("-o", "allow_other", "--size", "64MiB")
    (tmp_path / "other").mkdir()
    proc = tierfs(
        "mount",
        str(tmp_path / "other"),
        "--ram-dir",
        str(m.ram_dir),
        "--size",
        "32MiB",
        check=False,
    )
    assert proc.returncode == 1 and "is in use by tierfs daemon" in proc.stderr
    assert total(m.ram_dir) == 64 * MiB
    assert not is_mounted(tmp_path / "other")


def test_a_missing_parent_gets_created_with_the_tmpfs(make_mount):
    ram = SHM / f"tierfs-test-{uuid.uuid4().hex[:10]}" / "deeper" / "ram"
    try:
        m = make_mount("-o", "allow_other", "--size", "16MiB", ram_dir=ram)
        assert total(m.path) == 16 * MiB and ram_mount(ram) is not None
        assert oct(os.stat(ram).st_mode & 0o777) == "0o700"
        m.unmount()
    finally:
        from conftest import remove_ram_dir

        remove_ram_dir(ram)
        shutil.rmtree(ram.parent.parent, ignore_errors=True)


def test_the_csi_driver_fits_its_ram_volume_to_the_budget(tmp_path, tmpfs_dir):
    """An emptyDir the kubelet mounted larger than inMemoryVolumeSize (older kubelets:
    half the node's memory) is resized, not covered by another mount: the kernel
    enforces the budget, passthrough stays on, and the volume stays the kubelet's."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root")
    from csi_driver import Driver

    vol = tmpfs_dir("256m")
    (tmp_path / "csi").mkdir()
    d = Driver(tmp_path / "csi")
    d.ram_dir = vol
    try:
        d.start("--size", "64MiB", "--resize-ram-volume")
        d.wait_ready()
        assert "resized the RAM volume" in d.log()
        assert total(vol) == 64 * MiB
        assert ram_mount(vol)["source"] == "tmpfs"  # the volume itself, nothing on top
        st = json.loads((d.mount_dir / ".tierfs" / "status.json").read_text())
        assert st["passthrough"] is True and st["budget"]["mode"] == "native"
        assert total(d.mount_dir) == 64 * MiB
        d.stop()
    finally:
        d.cleanup()
