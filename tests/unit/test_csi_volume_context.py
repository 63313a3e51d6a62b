"""Volume attributes: jax-init-info.txt parameters and redaction (pure functions)."""

from __future__ import annotations

import pytest

from tierfs.csi import mounts
from tierfs.csi import volume_context as vc


def info(**ctx: str) -> vc.JaxInitInfo | None:
    return vc.jax_init_info(ctx)


def test_nothing_asked_nothing_written():
    assert info() is None
    assert vc.jax_init_info({vc.POD_NAME: "x"}) is None


@pytest.mark.parametrize(
    "coord, host, port",
    [
        ("coord", "coord", 8476),
        ("coord.ns.svc:1234", "coord.ns.svc", 1234),
        ("10.0.0.7", "10.0.0.7", 8476),
        ("10.0.0.7:9", "10.0.0.7", 9),
        ("[fd00::1]", "fd00::1", 8476),
        ("[fd00::1]:80", "fd00::1", 80),
    ],
)
def test_coordinator_forms(coord, host, port):
    got = info(jaxProcessId="2", jaxCoordinatorAddress=coord)
    assert (got.process_id, got.host, got.port) == (2, host, port)


def test_render_matches_protocol():
    assert vc.JaxInitInfo(5, "h", 8476).render() == b"5\nh:8476\n"
    assert vc.JaxInitInfo(0, "fd00::1", 1).render() == b"0\n[fd00::1]:1\n"


@pytest.mark.parametrize(
    "pod, per_job, expected",
    [
        ("train-slice-0-0-abcde", "", 0),
        ("train-slice-0-3-abcde", "", 3),
        ("my-train-slice-1-0-abcde", "4", 4),
        ("my-train-slice-2-3-abcde", "4", 11),
    ],
)
def test_auto_process_id_from_jobset_pod_name(pod, per_job, expected):
    ctx = {"jaxProcessId": "auto", "jaxCoordinatorAddress": "c", vc.POD_NAME: pod}
    if per_job:
        ctx["jaxProcessesPerJob"] = per_job
    assert vc.jax_init_info(ctx).process_id == expected


@pytest.mark.parametrize(
    "ctx",
    [
        {"jaxProcessId": "1"},
        {"jaxCoordinatorAddress": "c"},
        {"jaxProcessId": "one", "jaxCoordinatorAddress": "c"},
        {"jaxProcessId": "-1", "jaxCoordinatorAddress": "c"},
        {"jaxProcessId": "1", "jaxCoordinatorAddress": "c:0"},
        {"jaxProcessId": "1", "jaxCoordinatorAddress": "c:70000"},
        {"jaxProcessId": "1", "jaxCoordinatorAddress": "bad host"},
        {"jaxProcessId": "1", "jaxCoordinatorAddress": "[zz::1]"},
        {"jaxProcessId": "auto", "jaxCoordinatorAddress": "c"},
        {"jaxProcessId": "auto", "jaxCoordinatorAddress": "c", vc.POD_NAME: "plain-pod"},
        {"jaxProcessId": "auto", "jaxCoordinatorAddress": "c", vc.POD_NAME: "t-s-1-0-abcde"},
        {
            "jaxProcessId": "auto",
            "jaxCoordinatorAddress": "c",
            "jaxProcessesPerJob": "2",
            vc.POD_NAME: "t-s-0-2-abcde",
        },
    ],
)
def test_malformed_attributes(ctx):
    with pytest.raises(vc.ContextError):
        vc.jax_init_info(ctx)


def test_redaction():
    ctx = {
        vc.SERVICE_ACCOUNT_TOKENS: "tok",
        "bucketToken": "t2",
        "clientSecret": "s",
        vc.POD_NAME: "pod",
        "jaxProcessId": "1",
    }
    red = vc.redacted(ctx)
    assert (
        red[vc.SERVICE_ACCOUNT_TOKENS] == red["bucketToken"] == red["clientSecret"] == vc.REDACTED
    )
    assert red[vc.POD_NAME] == "pod" and red["jaxProcessId"] == "1"
    assert vc.SERVICE_ACCOUNT_TOKENS not in vc.comparable(ctx)


def test_mount_flags():
    assert mounts.parse_flags(["ro,noexec", "nosuid"]) == (
        mounts.MS_RDONLY | mounts.MS_NOEXEC | mounts.MS_NOSUID
    )
    assert mounts.parse_flags(["rw", "bind", ""]) == 0
    with pytest.raises(ValueError, match="discard"):
        mounts.parse_flags(["discard"])
    # these were accepted and ignored: they would lift a flag of the node mount
    for flag in ("suid", "dev", "exec", "atime", "diratime", "strictatime", "ro,exec"):
        with pytest.raises(ValueError, match=f"'{flag.split(',')[-1]}' is not supported"):
            mounts.parse_flags([flag])


def test_mountinfo_unescapes(tmp_path):
    p = tmp_path / "mountinfo"
    p.write_text(
        "36 35 98:0 / /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
    )
    [e] = mounts.read_mountinfo(str(p))
    assert (e.mount_id, e.parent_id, e.device, e.mountpoint, e.fstype) == (
        36,
        35,
        "98:0",
        "/mnt/with space",
        "ext3",
    )
    assert "noatime" in e.options and not e.readonly
