"""The node DaemonSet render (a pure function) and the optional operator around it."""

from __future__ import annotations

import copy
import http.server
import json
import logging
import threading
from typing import ClassVar

import kubernetes_validate
import pytest
import yaml

from tierfs.csi import render

MINIMAL = {
    "apiVersion": "checkpointing.tierfs.dev/v1",
    "kind": "CheckpointConfiguration",
    "metadata": {"name": "small"},
    "spec": {"inMemoryVolumeSize": "8Gi"},
}

FULL = {
    "apiVersion": "checkpointing.tierfs.dev/v1",
    "kind": "CheckpointConfiguration",
    "metadata": {"name": "gpu-a3", "uid": "5c1b7d1e-1111-4222-8333-444455556666", "generation": 3},
    "spec": {
        "cloudStorageBucketName": "ckpt-bucket/team-a",
        "nodeSelector": {"cloud.google.com/gke-nodepool": "a3-pool"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "inMemoryVolumeSize": "1.5Ti",
        "mountOptions": ["no_passthrough", "attr_timeout=2"],
        "keepLocal": 3,
        "backupIntervalMinutes": 12.5,
        "peerPort": 9000,
        "logLevel": "DEBUG",
        "extraArgs": ["--join-timeout=120"],
    },
}


def node_container(ds):
    return ds["spec"]["template"]["spec"]["containers"][0]


def volumes(ds):
    return {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("50Gi", 50 * 2**30),
        ("512Mi", 512 * 2**20),
        ("8G", 8 * 10**9),
        ("1.5Gi", 3 * 2**29),
        ("1024", 1024),
        ("2Ti", 2 * 2**40),
        ("100k", 100_000),
    ],
)
def test_quantity_bytes(text, expected):
    assert render.quantity_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "0", "8 Gi", "8GiB", "-1Gi", "1e9", "lots"])
def test_quantity_bytes_rejects(text):
    with pytest.raises(render.RenderError):
        render.quantity_bytes(text)


@pytest.mark.parametrize("cpc", [MINIMAL, FULL], ids=["minimal", "full"])
def test_render_is_pure_and_valid(cpc):
    before = copy.deepcopy(cpc)
    a = render.render_node_daemonset(cpc)
    b = render.render_node_daemonset(copy.deepcopy(cpc))
    assert a == b and cpc == before
    a["spec"]["template"]["spec"]["tolerations"].append({"key": "x"})
    assert cpc == before  # the output shares nothing mutable with the input
    kubernetes_validate.validate(render.render_node_daemonset(cpc), "1.32.0", strict=True)


def test_minimal_render():
    ds = render.render_node_daemonset(MINIMAL)
    assert ds["metadata"]["name"] == "tierfs-node-small"
    assert ds["metadata"]["namespace"] == "tierfs-system"
    assert "ownerReferences" not in ds["metadata"]
    args = node_container(ds)["args"]
    assert f"--size={8 * 2**30}" in args
    assert "--resize-ram-volume" in args  # the emptyDir is the driver's own: fit it
    assert not any(a.startswith(("--bucket", "--listen", "--keep-local")) for a in args)
    assert "-o" not in args
    assert volumes(ds)["ram"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert ds["spec"]["template"]["spec"]["tolerations"] == []


def test_full_render():
    ds = render.render_node_daemonset(
        FULL, image="reg.example/tierfs:9", namespace="ckpt", driver_name="tierfs.example.com"
    )
    args = node_container(ds)["args"]
    assert node_container(ds)["image"] == "reg.example/tierfs:9"
    assert ds["metadata"]["namespace"] == "ckpt"
    for expected in [
        "--bucket=ckpt-bucket/team-a",
        "--keep-local=3",
        "--backup-interval-minutes=12.5",
        "--listen=0.0.0.0:9000",
        "--advertise=$(NODE_IP):9000",
        "--log-level=DEBUG",
        "--join-timeout=120",
        "--driver-name=tierfs.example.com",
        f"--size={3 * 2**39}",
    ]:
        assert expected in args
    i = args.index("no_passthrough")
    assert args[i - 1] == "-o" and args[i + 1 : i + 3] == ["-o", "attr_timeout=2"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "cloud.google.com/gke-nodepool": "a3-pool",
    }
    assert spec["tolerations"] == FULL["spec"]["tolerations"]
    assert (
        volumes(ds)["plugin-dir"]["hostPath"]["path"]
        == "/var/lib/kubelet/plugins/tierfs.example.com"
    )
    registrar = spec["containers"][1]
    assert (
        "--kubelet-registration-path=/var/lib/kubelet/plugins/tierfs.example.com/csi.sock"
        in registrar["args"]
    )
    [owner] = ds["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "checkpointing.tierfs.dev/v1",
        "kind": "CheckpointConfiguration",
        "name": "gpu-a3",
        "uid": FULL["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


@pytest.mark.parametrize("name", ["a" * 51, "a" * 60 + "-b", "b" * 63, "c." * 100 + "d"])
def test_long_names_stay_valid_and_distinct(name):
    cpc = copy.deepcopy(MINIMAL)
    cpc["metadata"]["name"] = name
    ds = render.render_node_daemonset(cpc)
    assert len(ds["metadata"]["name"]) <= 63
    assert len(ds["metadata"]["labels"][render.CONFIG_LABEL]) <= 63
    kubernetes_validate.validate(ds, "1.32.0", strict=True)
    other = copy.deepcopy(cpc)
    other["metadata"]["name"] = name[:-1] + "z"
    assert render.render_node_daemonset(other)["metadata"]["name"] != ds["metadata"]["name"]


def _broken(path: str, value):
    cpc = copy.deepcopy(FULL)
    *parents, last = path.split(".")
    node = cpc
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return cpc


@pytest.mark.parametrize(
    "path, value",
    [
        ("kind", "ConfigMap"),
        ("apiVersion", "checkpointing.gke.io/v1"),
        ("metadata.name", "Bad_Name"),
        ("spec", KeyError),
        ("spec.inMemoryVolumeSize", KeyError),
        ("spec.inMemoryVolumeSize", "50 gigs"),
        ("spec.cloudStorageBucketName", "gs://bucket"),
        ("spec.mountOptions", ["a b"]),
        ("spec.keepLocal", 0),
        ("spec.keepLocal", True),
        ("spec.backupIntervalMinutes", -5),
        ("spec.peerPort", 70000),
        ("spec.logLevel", "TRACE"),
        ("spec.extraArgs", [1]),
        ("spec.nodeSelector", {"a": 1}),
        ("spec.tolerations", ["x"]),
    ],
)
def test_invalid_configurations(path, value):
    with pytest.raises(render.RenderError):
        render.render_node_daemonset(_broken(path, value))


def test_render_command(tmp_path, capsys):
    f = tmp_path / "cpc.yaml"
    f.write_text(yaml.safe_dump(FULL))
    assert render.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Generated by")
    assert yaml.safe_load(out) == render.render_node_daemonset(FULL)
    assert render.main([]) == 2
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**MINIMAL, "spec": {}}))
    assert render.main([str(tmp_path / "bad.yaml")]) == 1
    assert "inMemoryVolumeSize" in capsys.readouterr().err


# ----------------------------------------------------------------------------- operator


class FakeApi:
    def __init__(self, fail: Exception | None = None) -> None:
        self.applied: list[dict] = []
        self.fail = fail

    def apply(self, obj):
        if self.fail:
            raise self.fail
        self.applied.append(obj)
        return obj


def test_reconcile_applies_the_render():
    from tierfs.csi import operator

    fake = FakeApi()
    status = operator.reconcile(
        FULL,
        fake,
        {"image": "img:1", "namespace": "tierfs-system", "driver_name": "tierfs.csi.dev"},
    )
    assert fake.applied == [render.render_node_daemonset(FULL, image="img:1")]
    assert status == {
        "daemonSet": "tierfs-system/tierfs-node-gpu-a3",
        "observedGeneration": 3,
        "error": "",
    }


def test_settings_from_env():
    from tierfs.csi import operator

    assert operator.settings_from_env({}) == {
        "image": render.IMAGE,
        "namespace": "tierfs-system",
        "driver_name": "tierfs.csi.dev",
    }
    assert operator.settings_from_env({"TIERFS_IMAGE": "x:1"})["image"] == "x:1"


def test_kopf_handler_writes_status(monkeypatch):
    kopf = pytest.importorskip("kopf")
    from tierfs.csi import operator

    log = logging.getLogger("test")
    fake = FakeApi()
    monkeypatch.setattr(operator, "_api", fake)
    monkeypatch.setenv("TIERFS_IMAGE", "tierfs:test")
    patch = kopf.Patch()
    operator.apply_configuration(body=FULL, patch=patch, logger=log)
    assert patch["status"]["daemonSet"] == "tierfs-system/tierfs-node-gpu-a3"
    assert node_container(fake.applied[0])["image"] == "tierfs:test"

    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError):
        operator.apply_configuration(
            body=_broken("spec.inMemoryVolumeSize", "x"), patch=patch, logger=log
        )
    assert "inMemoryVolumeSize" in patch["status"]["error"]

    monkeypatch.setattr(operator, "_api", FakeApi(fail=operator.ApiError(403, "forbidden")))
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError):
        operator.apply_configuration(body=FULL, patch=patch, logger=log)
    assert "403" in patch["status"]["error"]


class _Handler(http.server.BaseHTTPRequestHandler):
    requests: ClassVar[list[dict]] = []
    status = 200

    def do_PATCH(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).requests.append(
            {"path": self.path, "headers": dict(self.headers), "body": json.loads(body)}
        )
        payload = json.dumps(
            {"kind": "Status", "message": "nope"} if self.status >= 400 else json.loads(body)
        ).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_apiserver():
    _Handler.requests = []
    _Handler.status = 200
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Handler
    srv.shutdown()
    srv.server_close()


def test_server_side_apply_request(fake_apiserver):
    from tierfs.csi import operator

    url, handler = fake_apiserver
    client = operator.InClusterApi(server=url, token="T0KEN", ca_file=None, timeout=5)
    ds = render.render_node_daemonset(MINIMAL)
    assert client.apply(ds) == ds
    [req] = handler.requests
    assert req["path"] == (
        "/apis/apps/v1/namespaces/tierfs-system/daemonsets/tierfs-node-small"
        "?fieldManager=tierfs-operator&force=true"
    )
    assert req["headers"]["Content-Type"] == "application/apply-patch+yaml"
    assert req["headers"]["Authorization"] == "Bearer T0KEN"
    assert req["body"] == ds

    handler.status = 403
    with pytest.raises(operator.ApiError) as exc:
        client.apply(ds)
    assert exc.value.status == 403 and "nope" in str(exc.value)
