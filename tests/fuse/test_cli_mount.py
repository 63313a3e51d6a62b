"""The ``tierfs mount`` / ``tierfs unmount`` contract (issue 2), through the real CLI."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import SHM, TIERFS, is_mounted, remove_ram_dir, tierfs
from fs_helpers import as_user, err

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def ram_dir():
    d = SHM / f"tierfs-cli-{uuid.uuid4().hex[:10]}"
    yield d
    remove_ram_dir(d)


@pytest.fixture
def cleanup():
    """Mountpoints registered here are unmounted after the test, whatever happened."""
    paths: list[Path] = []
    yield paths
    for p in paths:
        if is_mounted(p):
            subprocess.run([*TIERFS, "unmount", "--lazy", str(p)], capture_output=True, check=False)
            if is_mounted(p):
                subprocess.run(["umount", "-l", str(p)], capture_output=True, check=False)


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Assert exit status 1 and a single non-empty stderr line containing ``needles``."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_mountpoint_missing(tmp_path, ram_dir):
    proc = tierfs("mount", str(tmp_path / "nope"), "--ram-dir", str(ram_dir), check=False)
    one_line_error(proc, str(tmp_path / "nope"), "does not exist")


def test_mountpoint_not_a_directory(tmp_path, ram_dir):
    (tmp_path / "file").write_text("x")
    proc = tierfs("mount", str(tmp_path / "file"), "--ram-dir", str(ram_dir), check=False)
    one_line_error(proc, "not a directory")


def test_mountpoint_not_empty(tmp_path, ram_dir):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "something").write_text("x")
    proc = tierfs("mount", str(tmp_path / "mnt"), "--ram-dir", str(ram_dir), check=False)
    one_line_error(proc, "not empty")
    assert not is_mounted(tmp_path / "mnt")


def test_already_mounted(make_mount, tmp_path):
    m = make_mount()
    proc = tierfs("mount", str(m.path), "--ram-dir", str(tmp_path / "other-ram"), check=False)
    one_line_error(proc, "already mounted")
    assert (m.path / ".tierfs" / "status.json").exists()  # the first mount is untouched


@pytest.mark.parametrize(
    ("size", "why"),
    [
        ("12XB", "unknown suffix"),
        ("lots", "not a size"),
        ("-5GiB", "negative"),
        ("0", "positive"),
        ("1.2.3G", "not a size"),
        ("", "empty"),
        ("8g", "did you mean G?"),
        ("1.5", "whole number of bytes"),
    ],
)
def test_size_unparsable(tmp_path, ram_dir, size, why):
    (tmp_path / "mnt").mkdir()
    proc = tierfs(
        "mount", str(tmp_path / "mnt"), "--ram-dir", str(ram_dir), "--size", size, check=False
    )
    one_line_error(proc, "--size", why)
    assert not is_mounted(tmp_path / "mnt")
    assert not ram_dir.exists()


@pytest.mark.parametrize(
    ("name", "value"), [("TIERFS_GCS_TICK", "fast"), ("TIERFS_GCS_THREADS", "0")]
)
def test_bad_environment_variable_fails_the_mount(tmp_path, ram_dir, name, value):
    """Regression: a malformed TIERFS_* value was silently replaced by its default."""
    (tmp_path / "mnt").mkdir()
    proc = tierfs(
        "mount",
        str(tmp_path / "mnt"),
        "--ram-dir",
        str(ram_dir),
        check=False,
        env=dict(os.environ, **{name: value}),
    )
    one_line_error(proc, f"{name}={value!r}")
    assert not is_mounted(tmp_path / "mnt")
    assert not ram_dir.exists()


@pytest.mark.parametrize(
    "opt",
    [
        "bogus",
        "allow_other,frobnicate",
        "attr_timeout=abc",
        "entry_timeout=-1",
        "attr_timeout=inf",
        "attr_timeout=nan",
        "entry_timeout=1e30",
        "entry_timeout=-inf",
        "negative_timeout=nan",
        "max_read=0",
        "allow_other,no_default_permissions",
        "no_default_permissions,allow_root",
    ],
)
def test_unknown_or_bad_mount_option(tmp_path, ram_dir, opt):
    """Regression (inf, nan, 1e30): accepted, then every stat failed with EIO
    (the timeout did not fit the reply). Regression (issue 13): no_default_permissions
    with allow_other let every user chmod and write every other user's files."""
    (tmp_path / "mnt").mkdir()
    proc = tierfs("mount", str(tmp_path / "mnt"), "--ram-dir", str(ram_dir), "-o", opt, check=False)
    line = one_line_error(proc)
    bad = opt.split(",")[-1]
    assert bad in line, line
    assert not is_mounted(tmp_path / "mnt")
    assert not ram_dir.exists()  # options are checked before anything is created


def test_no_default_permissions_alone_lets_only_the_mounting_user_in(make_mount):
    """Without allow_other only the mounting user (root here) enters, so nothing is
    exposed by leaving the mode checks out; other users get EACCES from FUSE itself."""
    m = make_mount("-o", "no_default_permissions")
    (m.path / "f").write_bytes(b"root's")
    os.chmod(m.path / "f", 0o600)
    assert (m.path / "f").read_bytes() == b"root's"
    assert err(as_user, os.stat, str(m.path / "f")) == errno.EACCES


def test_largest_timeouts_work(make_mount):
    m = make_mount("-o", "attr_timeout=1e9,entry_timeout=1e9")
    (m.path / "f").write_bytes(b"x")
    assert (m.path / "f").stat().st_size == 1


def test_ram_dir_inside_the_mountpoint_is_refused(tmp_path):
    """Regression: the daemon waited on its own mount for 120 s and left it hung."""
    mnt = SHM / f"tierfs-cli-mnt-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    try:
        for ram in (mnt / "ram", mnt):
            proc = tierfs("mount", str(mnt), "--ram-dir", str(ram), check=False, timeout=20)
            one_line_error(proc, "must not be the mountpoint or inside it")
            assert not is_mounted(mnt)
    finally:
        shutil.rmtree(mnt, ignore_errors=True)


def test_mountpoint_inside_the_ram_dir_is_refused(tmp_path, ram_dir):
    (ram_dir / "view" / "x").mkdir(parents=True)
    proc = tierfs(
        "mount", str(ram_dir / "view" / "x"), "--ram-dir", str(ram_dir), check=False, timeout=20
    )
    one_line_error(proc, "must not be inside --ram-dir")


def test_ram_dir_inside_another_mounts_ram_dir_is_refused(make_mount, tmp_path):
    """Regression: --ram-dir <other ram-dir>/view mounted, and the second daemon's
    store/ and view/ appeared in the first mount's tree."""
    m = make_mount()
    for inner in (m.ram_dir / "view", m.ram_dir / "store" / "x"):
        (tmp_path / "mnt2").mkdir(exist_ok=True)
        proc = tierfs(
            "mount", str(tmp_path / "mnt2"), "--ram-dir", str(inner), check=False, timeout=20
        )
        one_line_error(proc, f"must not be inside the ram-dir {m.ram_dir} of another tierfs mount")
        assert not is_mounted(tmp_path / "mnt2")
    assert sorted(os.listdir(m.path)) == [".tierfs"]


def test_size_beyond_the_filesystem_is_a_warning(make_mount):
    m = make_mount("--size", "100TiB")
    assert "warning: --size 100.0 TiB is more than" in m.mount_stderr
    status = json.loads((m.path / ".tierfs" / "status.json").read_text())
    assert status["budget"]["mode"] == "native"


def test_ram_dir_not_on_tmpfs_is_a_warning(tmp_path, cleanup):
    from tierfs.core.mounts import fs_type

    disk_dir = Path("/var/tmp") / f"tierfs-disk-{uuid.uuid4().hex[:8]}"
    if fs_type(str(disk_dir.parent)) in ("tmpfs", "ramfs"):
        pytest.skip("no disk-backed directory on this machine")
    (tmp_path / "mnt").mkdir()
    cleanup.append(tmp_path / "mnt")
    try:
        proc = tierfs("mount", str(tmp_path / "mnt"), "--ram-dir", str(disk_dir), check=False)
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(warnings) == 1 and "warning" in warnings[0] and "tmpfs" in warnings[0]
        assert is_mounted(tmp_path / "mnt")
        (tmp_path / "mnt" / "f").write_bytes(b"on disk")
        assert (disk_dir / "view" / "f").read_bytes() == b"on disk"
        tierfs("unmount", str(tmp_path / "mnt"))
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)


def test_tmpfs_ram_dir_gives_no_warning(tmp_path, ram_dir, cleanup):
    (tmp_path / "mnt").mkdir()
    cleanup.append(tmp_path / "mnt")
    proc = tierfs("mount", str(tmp_path / "mnt"), "--ram-dir", str(ram_dir))
    assert proc.stderr.strip() == ""
    assert proc.stdout.startswith(f"mounted {tmp_path / 'mnt'} ")  # and nothing else
    assert len(proc.stdout.splitlines()) == 1
    tierfs("unmount", str(tmp_path / "mnt"))


@pytest.mark.parametrize(
    ("size", "expect"),
    [
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("100000000", 100_000_000),
        ("64Mi", 64 * MiB),
        ("64M", 64 * 10**6),
        ("1.5Gi", 3 * GiB // 2),
    ],
)
def test_size_formats(make_mount, size, expect):
    """The budget is a tmpfs of that size (rounded down to pages) on the ram-dir.
    Sizes are Kubernetes quantities: ``64M`` is 64·10⁶ bytes, and says so."""
    if expect >= shutil.disk_usage(SHM).total:
        pytest.skip(f"{size} is more than /dev/shm can hold here")
    m = make_mount("--size", size)
    notes = [line for line in m.mount_stderr.splitlines() if "note:" in line]
    if size == "64M":
        assert notes == [
            "tierfs: note: --size 64M is 64000000 bytes = 61.04 MiB: M is 10^6 "
            "as in Kubernetes (older tierfs read 64M as 64 MiB); write 64Mi "
            "for 64 MiB"
        ]
    else:
        assert notes == []
    status = json.loads((m.path / ".tierfs" / "status.json").read_text())
    pages = expect - expect % 4096
    assert status["budget"] == status["budget"] | {"mode": "native", "total_bytes": pages}
    assert status["passthrough"] is True
    assert shutil.disk_usage(m.path).total == pages


def test_default_size_is_the_free_space_of_the_ram_dir(make_mount):
    m = make_mount()
    status = json.loads((m.path / ".tierfs" / "status.json").read_text())
    assert status["budget"]["mode"] == "native"
    free = shutil.disk_usage(m.ram_dir).free
    used = status["budget"]["used_bytes"]
    # total = what the store holds + what tmpfs can still take (others may write meanwhile)
    assert abs(status["budget"]["total_bytes"] - (free + used)) < 256 * MiB


def _wait(pred, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_foreground_stays_then_sigterm_unmounts(tmp_path, ram_dir, cleanup):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cleanup.append(mnt)
    proc = subprocess.Popen(
        [
            *TIERFS,
            "mount",
            str(mnt),
            "--ram-dir",
            str(ram_dir),
            "--foreground",
            "-o",
            "allow_other",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _wait(lambda: (mnt / ".tierfs" / "status.json").exists() or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()
        status = json.loads((mnt / ".tierfs" / "status.json").read_text())
        assert status["pid"] == proc.pid  # the daemon is this very process
        (mnt / "f").write_bytes(b"fg")
        time.sleep(0.3)
        assert proc.poll() is None  # still in the foreground
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert not is_mounted(mnt)
    assert os.listdir(mnt) == []
    assert (ram_dir / "view" / "f").read_bytes() == b"fg"
    assert not (ram_dir / "store" / "daemon.pid").exists()


def test_unmount_stops_the_daemon(make_mount):
    m = make_mount()
    pid = m.pid()
    proc = tierfs("unmount", str(m.path))
    assert proc.returncode == 0 and proc.stderr.strip() == ""
    assert not is_mounted(m.path)
    from tierfs.cli.main import pid_running

    assert not pid_running(pid)
    assert not (m.ram_dir / "store" / "daemon.pid").exists()


def test_unmount_of_something_not_mounted(tmp_path):
    one_line_error(tierfs("unmount", str(tmp_path), check=False), "not mounted")


def test_second_mount_of_the_same_ram_dir_is_refused(make_mount, tmp_path):
    m = make_mount()
    (tmp_path / "other").mkdir()
    proc = tierfs("mount", str(tmp_path / "other"), "--ram-dir", str(m.ram_dir), check=False)
    one_line_error(proc, "in use")
    assert not is_mounted(tmp_path / "other")


def test_sigterm_to_the_background_daemon_unmounts_cleanly(make_mount):
    """Regression: closing the channel under the waiting serve task raised
    trio.ClosedResourceError and the daemon died with a traceback."""
    m = make_mount()
    (m.path / "f").write_bytes(b"kept")
    pid = m.pid()
    os.kill(pid, signal.SIGTERM)
    from tierfs.cli.main import pid_running

    assert _wait(lambda: not pid_running(pid) and not is_mounted(m.path))
    assert "Traceback" not in m.log() and "daemon failed" not in m.log()
    assert "daemon stopped" in m.log()
    m.mount()
    assert (m.path / "f").read_bytes() == b"kept"


def test_peer_token_stays_off_the_daemons_command_line(tmp_path, ram_dir, cleanup):
    """Regression: the daemon got the whole config, peer token included, as
    ``--config-json`` in argv, where every local user can read it (ps)."""
    import grpc

    from tierfs.demo.emulator import free_port
    from tierfs.rpc import peer_pb2 as pb2
    from tierfs.rpc import peer_pb2_grpc as pb2_grpc

    secret = "SuperSecret123"
    port = free_port()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cleanup.append(mnt)
    tierfs(
        "mount",
        str(mnt),
        "--ram-dir",
        str(ram_dir),
        "--listen",
        f"127.0.0.1:{port}",
        "--coordinator",
        f"127.0.0.1:{port}",
        env=dict(os.environ, TIERFS_PEER_TOKEN=secret),
    )
    pid = int((ram_dir / "store" / "daemon.pid").read_text().split()[0])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"_daemon" in cmdline
    assert secret.encode() not in cmdline
    # the daemon got the token all the same: the peer service accepts it, and only it
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        peer = pb2_grpc.PeerStub(ch)
        reply = peer.Inventory(
            pb2.InventoryRequest(job="j"), metadata=(("x-tierfs-token", secret),), timeout=10
        )
        assert list(reply.shards) == []
        with pytest.raises(grpc.RpcError) as err:
            peer.Inventory(
                pb2.InventoryRequest(job="j"), metadata=(("x-tierfs-token", "wrong"),), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status = tierfs("status", str(mnt), "--json").stdout + tierfs("status", str(mnt)).stdout
    assert secret not in status
    tierfs("unmount", str(mnt))
    assert secret not in (ram_dir / "store" / "daemon.log").read_text()


def test_a_reused_daemon_pid_does_not_block_recovery(make_mount, tmp_path):
    """Regression: after kill -9 of the daemon, a new process that got its pid
    made `tierfs mount` refuse the ram-dir ("in use by tierfs daemon pid N")."""
    m = make_mount()
    (m.path / "f").write_bytes(b"kept")
    m.kill9()
    pid_file = m.ram_dir / "store" / "daemon.pid"
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        pid_file.write_text(f"{stranger.pid}\n{m.path}\n")  # the daemon's pid, reused
        m.mount()
        assert (m.path / "f").read_bytes() == b"kept"
        assert m.pid() != stranger.pid
    finally:
        stranger.kill()
        stranger.wait()
    # a process that holds the ram-dir open is still taken for a daemon
    m.unmount()
    holder = subprocess.Popen(
        [
            "python3",
            "-c",
            "import os, sys, time; "
            "os.open(sys.argv[1], os.O_RDONLY); print(flush=True); "
            "time.sleep(60)",
            str(m.ram_dir / "view"),
        ],
        stdout=subprocess.PIPE,
    )
    other = tmp_path / "other"
    other.mkdir()
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        pid_file.write_text(f"{holder.pid}\n{m.path}\n")
        proc = tierfs("mount", str(other), "--ram-dir", str(m.ram_dir), check=False)
        one_line_error(proc, "in use", str(holder.pid))
    finally:
        holder.kill()
        holder.wait()
        if is_mounted(other):
            tierfs("unmount", "--lazy", str(other), check=False)


def test_a_ram_dir_tierfs_creates_is_private(tmp_path, ram_dir, cleanup):
    """Regression: the ram-dir was created 0755, so any local user could read the
    checkpoints under <ram-dir>/view, bypassing the mount."""
    from fs_helpers import as_user, err

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cleanup.append(mnt)
    assert not ram_dir.exists()
    tierfs("mount", str(mnt), "--ram-dir", str(ram_dir / "deeper"), "-o", "allow_other")
    root = ram_dir / "deeper"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "store").stat().st_mode) == 0o700
    (mnt / "ckpt").write_bytes(b"weights")
    os.chmod(mnt / "ckpt", 0o644)
    assert err(as_user, Path.read_bytes, root / "view" / "ckpt") == errno.EACCES
    assert as_user(Path.read_bytes, Path("ckpt"), cwd=mnt) == b"weights"  # the mount lets in
    tierfs("unmount", str(mnt))
    # an existing ram-dir keeps the mode its owner gave it
    shared = ram_dir / "shared"
    shared.mkdir(mode=0o750)
    os.chmod(shared, 0o750)
    tierfs("mount", str(mnt), "--ram-dir", str(shared))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o750
    tierfs("unmount", str(mnt))


def test_status_prints_user_text_with_markup_characters_verbatim(make_mount):
    """Regression: an error line quoting ``job-name: "x[/bold]y"`` made `tierfs status`
    crash with rich.errors.MarkupError."""
    m = make_mount()
    (m.path / "replicator.yaml").write_text(
        'job-name: "x[/bold]y"\nframework: orbax\nnode-rank: 0\nnodes: 1\n'
    )
    assert _wait(
        lambda: (
            "x[/bold]y"
            in " ".join(
                json.loads(tierfs("status", str(m.path), "--json").stdout).get("errors", [])
            )
        )
    )
    proc = tierfs("status", str(m.path), check=False)
    assert proc.returncode == 0, proc.stderr
    assert "x[/bold]y" in proc.stdout and "MarkupError" not in proc.stderr


def test_status_table_cells_are_not_markup(capsys):
    from tierfs.cli.status import render_status

    render_status(
        {
            "mountpoint": "/m[/red]",
            "steps": [
                {
                    "step": 1,
                    "name": "step_1[/bold]",
                    "state": "sealed",
                    "bytes": 1,
                    "where": ["[b]x"],
                }
            ],
            "errors": ["[/i] broken"],
        }
    )
    out = capsys.readouterr().out
    for text in ("/m[/red]", "step_1[/bold]", "[b]x", "[/i] broken"):
        assert text in out, out


def test_mountpoint_given_through_a_symlink(tmp_path, ram_dir, cleanup):
    """Regression: `tierfs mount <symlink>` worked, but `tierfs unmount <symlink>`
    said "is not mounted" and status showed the symlink's path."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    cleanup.append(real)
    tierfs("mount", str(link), "--ram-dir", str(ram_dir))
    assert is_mounted(real)
    status = json.loads(tierfs("status", str(link), "--json").stdout)
    assert status["mountpoint"] == str(real)
    assert (ram_dir / "store" / "daemon.pid").read_text().split()[1] == str(real)
    (link / "f").write_bytes(b"x")
    tierfs("unmount", str(link))
    assert not is_mounted(real)
    assert (ram_dir / "view" / "f").read_bytes() == b"x"


@pytest.mark.parametrize("foreground", [False, True])
@pytest.mark.parametrize(
    ("log", "why"),
    [("/nonexistent/dir/log", "No such file or directory"), ("/tmp", "Is a directory")],
)
def test_unusable_log_file_is_a_one_line_error(tmp_path, ram_dir, log, why, foreground):
    """Regression: `--log-file /nonexistent/dir/log` printed a raw traceback."""
    (tmp_path / "mnt").mkdir()
    proc = tierfs(
        "mount",
        str(tmp_path / "mnt"),
        "--ram-dir",
        str(ram_dir),
        "--log-file",
        log,
        *(["-f"] if foreground else []),
        check=False,
        timeout=30,
    )
    one_line_error(proc, f"--log-file {log}", why)
    assert "Traceback" not in proc.stderr
    assert not is_mounted(tmp_path / "mnt")
    assert not ram_dir.exists()


def test_relative_log_file_is_relative_to_where_mount_ran(make_mount, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = make_mount("--log-file", "rel.log")
    (m.path / "f").write_bytes(b"x")
    assert "mounted" in (tmp_path / "rel.log").read_text()


@pytest.mark.parametrize("size", ["1", "4096", "1023KiB"])
def test_size_below_one_mib_is_refused(tmp_path, ram_dir, size, cleanup):
    """Regression: `--size 1` was accepted silently (every write then failed)."""
    (tmp_path / "mnt").mkdir()
    cleanup.append(tmp_path / "mnt")
    proc = tierfs(
        "mount", str(tmp_path / "mnt"), "--ram-dir", str(ram_dir), "--size", size, check=False
    )
    one_line_error(proc, "--size", "too small", "at least 1.0 MiB")
    assert not is_mounted(tmp_path / "mnt")
    assert not ram_dir.exists()


def test_size_below_what_the_ram_dir_holds_is_a_warning(make_mount):
    """Regression: a --size below the data already stored was accepted silently."""
    m = make_mount()
    (m.path / "old").write_bytes(b"\1" * (3 * MiB))
    m.unmount()
    m.args = ["--size", "2MiB"]
    m.mount()
    warnings = [line for line in m.mount_stderr.splitlines() if line.strip()]
    assert len(warnings) == 2, m.mount_stderr
    # the ram-dir holds a store on /dev/shm: no tmpfs of its own, tierfs counts
    assert "the ram-dir is not empty" in warnings[0] and "counts the budget" in warnings[0]
    assert "warning: --size 2.0 MiB is not more than the 3.0 MiB" in warnings[1]
    assert "ENOSPC" in warnings[1]
    with pytest.raises(OSError) as info:
        (m.path / "new").write_bytes(b"\2" * MiB)
    assert info.value.errno == errno.ENOSPC
    assert (m.path / "old").read_bytes() == b"\1" * (3 * MiB)
    m.unmount()
    m.args = ["--size", "1MiB"]  # the smallest budget mounts without other complaint
    m.mount()
    assert "too small" not in m.mount_stderr


def test_a_stopped_daemon_does_not_hang_status_wait_or_unmount(make_mount):
    """Regression (a new-user trial): with the daemon stopped (SIGSTOP), `tierfs status`,
    `tierfs wait --timeout 3` and `tierfs unmount` hung without limit (each opened
    .tierfs/status.json through the mount with no deadline), so wait never gave its
    documented exit 7 and unmount failed exactly when it is the cure."""
    m = make_mount()
    assert _wait(lambda: tierfs("status", str(m.path), "--json").returncode == 0)
    pid = m.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        proc = tierfs("wait", str(m.path), "--timeout", "3", check=False, timeout=120)
        assert proc.returncode == 7, proc.stderr
        assert "the tierfs daemon does not answer" in proc.stderr
        assert time.monotonic() - t0 < 60
        proc = tierfs("status", str(m.path), check=False, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "does not answer" in proc.stderr and "tierfs unmount" in proc.stderr
        proc = tierfs("unmount", str(m.path), "--timeout", "5", check=False, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "does not answer: aborting its connection" in proc.stderr
        assert not is_mounted(m.path)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _wait(
        lambda: (
            not os.path.exists(f"/proc/{pid}/cmdline")
            or not open(f"/proc/{pid}/cmdline", "rb").read()
        ),
        60,
    ), "the daemon did not exit once it ran again"


# --------------------------------------------------------------------------- #11 trial leftovers


def test_a_bad_mount_option_in_the_config_file_names_the_key_and_the_file(tmp_path, ram_dir):
    """Regression (#11 trial): `mountOptions: [bogus]` in a --config file failed with
    "bad mount option 'bogus'" and no word of where it came from."""
    (tmp_path / "mnt").mkdir()
    config = tmp_path / "node.yaml"
    config.write_text(f"ramDir: {ram_dir}\nmountOptions: [noatime, bogus]\n")
    proc = tierfs("mount", str(tmp_path / "mnt"), "--config", str(config), check=False)
    one_line_error(proc, f"mountOptions in {config}: bad mount option 'bogus'")
    assert not is_mounted(tmp_path / "mnt")
    # a bad option of -o is the command line's, as before
    config.write_text(f"ramDir: {ram_dir}\nmountOptions: [noatime]\n")
    proc = tierfs(
        "mount", str(tmp_path / "mnt"), "--config", str(config), "-o", "ro,bogus2", check=False
    )
    line = one_line_error(proc, "bad mount option 'bogus2'")
    assert "mountOptions in" not in line
    assert not is_mounted(tmp_path / "mnt")


def test_a_failed_mount_leaves_no_empty_log_file(tmp_path, ram_dir):
    """Regression (#11 trial): `tierfs mount --log-file L` that failed its checks (here: a
    mountpoint that is not empty) left an empty L behind; a log it did not create, and
    one the daemon wrote to, stay."""
    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "x").write_text("x")
    log = tmp_path / "daemon.log"
    proc = tierfs(
        "mount",
        str(tmp_path / "mnt"),
        "--ram-dir",
        str(ram_dir),
        "--log-file",
        str(log),
        check=False,
    )
    one_line_error(proc, "not empty")
    assert not log.exists()
    log.write_text("")  # the user's own (empty) file is not ours to remove
    proc = tierfs(
        "mount",
        str(tmp_path / "mnt"),
        "--ram-dir",
        str(ram_dir),
        "--log-file",
        str(log),
        check=False,
    )
    one_line_error(proc, "not empty")
    assert log.exists()


def test_a_busy_metrics_port_is_named(tmp_path, ram_dir, cleanup):
    """Regression (#11 trial): a --metrics-port another process listens on failed the
    mount with "mount failed: Address already in use", naming neither flag nor port."""
    import socket

    (tmp_path / "mnt").mkdir()
    cleanup.append(tmp_path / "mnt")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = tierfs(
            "mount",
            str(tmp_path / "mnt"),
            "--ram-dir",
            str(ram_dir),
            "--metrics-port",
            str(port),
            check=False,
        )
    assert proc.returncode == 1, proc.stderr
    # (a warning may come first, e.g. a ram-dir that is not on tmpfs)
    error = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1, proc.stderr
    assert f"mount failed: --metrics-port {port}: Address already in use" in error[0]
    assert not is_mounted(tmp_path / "mnt")
