"""The first thing a user does: mount, write, read, see status, unmount, mount again."""

from __future__ import annotations

import json
import os

from conftest import is_mounted, tierfs


def test_mount_write_read_unmount_remount(mount):
    p = mount.path / "hello.txt"
    p.write_bytes(b"hello tierfs\n")
    assert p.read_bytes() == b"hello tierfs\n"
    # the bytes live in the ram-dir's view on tmpfs
    assert (mount.view / "hello.txt").read_bytes() == b"hello tierfs\n"
    status = json.loads((mount.path / ".tierfs" / "status.json").read_text())
    assert status["pid"] == mount.pid()
    assert status["budget"]["total_bytes"] > 0
    mount.unmount()
    assert not is_mounted(mount.path)
    assert os.listdir(mount.path) == []
    mount.mount()
    assert (mount.path / "hello.txt").read_bytes() == b"hello tierfs\n"


def test_status_command(mount):
    out = tierfs("status", str(mount.path)).stdout
    assert "passthrough" in out
    # both tiers are listed, off here, and say why
    assert "peer       off (no --listen or --coordinator: a one-node cluster)" in out
    assert "gcs        off (no --bucket)" in out
    data = json.loads(tierfs("status", str(mount.path), "--json").stdout)
    assert data["mountpoint"] == str(mount.path)
