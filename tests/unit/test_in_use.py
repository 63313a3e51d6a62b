"""tierfs.core.in_use: a file open or mapped elsewhere, told by a refused write lease."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import raw_map
from raw_map import RawMap

from tierfs.core import in_use


@pytest.fixture
def shm_file(tmp_path: Path) -> Path:
    """A 1 MiB file on tmpfs (the RAM store's file system)."""
    root = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    path = root / f"tierfs-in-use-{os.getpid()}-{tmp_path.name}"
    path.write_bytes(os.urandom(1 << 20))
    yield path
    path.unlink(missing_ok=True)


def ask(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        return in_use.open_elsewhere(fd)
    finally:
        os.close(fd)


def test_a_file_no_one_else_holds_is_free(shm_file: Path) -> None:
    assert ask(shm_file) is False
    assert ask(shm_file) is False  # the lease was given back


def test_an_open_descriptor_elsewhere_holds_it(shm_file: Path) -> None:
    fd = os.open(shm_file, os.O_RDONLY)
    try:
        assert ask(shm_file) is True
    finally:
        os.close(fd)
    assert ask(shm_file) is False


def test_a_map_whose_descriptor_is_closed_holds_it(shm_file: Path) -> None:
    """#14 trial 50: safetensors maps the file and closes the descriptor."""
    m = RawMap(shm_file)  # no descriptor left open
    try:
        assert ask(shm_file) is True
    finally:
        m.close()
    assert ask(shm_file) is False


def test_a_map_in_another_process_holds_it_and_the_proc_fallback_sees_it(
    shm_file: Path,
) -> None:
    code = (
        "import sys\n"
        "from raw_map import RawMap\n"
        "m = RawMap(sys.argv[1])\n"
        "print('mapped', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(shm_file)],
        env={**os.environ, "PYTHONPATH": os.path.dirname(raw_map.__file__)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
        assert ask(shm_file) is True
        st = shm_file.stat()
        assert in_use.mapped_by_a_process(st.st_dev, st.st_ino) is True
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    st = shm_file.stat()
    assert in_use.mapped_by_a_process(st.st_dev, st.st_ino) is False
    assert ask(shm_file) is False


def test_not_a_regular_file_is_an_error(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            in_use.open_elsewhere(fd)
    finally:
        os.close(fd)


def test_without_leases_the_proc_maps_answer(shm_file: Path, monkeypatch) -> None:
    """``fs.leases-enable=0`` (F_SETLEASE fails with EINVAL): lease_refused says it
    cannot tell, and open_elsewhere asks /proc/*/maps."""
    real = in_use.fcntl.fcntl

    def no_leases(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == in_use.fcntl.F_SETLEASE:
            raise OSError(errno.EINVAL, "leases off")
        return real(fd, cmd, arg)

    monkeypatch.setattr(in_use.fcntl, "fcntl", no_leases)
    fd = os.open(shm_file, os.O_RDWR)
    try:
        assert in_use.lease_refused(fd) is None
        assert in_use.open_elsewhere(fd) is False
        m = RawMap(shm_file)
        try:
            assert in_use.open_elsewhere(fd) is True
        finally:
            m.close()
    finally:
        os.close(fd)
