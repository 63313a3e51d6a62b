"""deploy/ validated offline: Kubernetes 1.32 schemas (strict), the CRD's own schema, kustomize.

No cluster exists here. Every built-in object is validated with
kubernetes-validate in strict mode (unknown fields are errors) against the
Kubernetes 1.32 OpenAPI schemas; CheckpointConfiguration objects against the
CRD's openAPIV3Schema with jsonschema (unknown fields rejected, as the API
server's strict field validation does); the JobSet against a schema of the
JobSet fields it uses (read from kubernetes-sigs/jobset's v1alpha2 Go types;
no JobSet schema ships in any package reachable here) while its embedded Job
template is validated as a batch/v1 Job by kubernetes-validate.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tierfs.csi import render, server
from tierfs.csi import volume_context as vc

K8S = "1.32.0"
ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRD_KINDS = {"CheckpointConfiguration", "JobSet"}


def load_docs(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def all_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in manifest_files() for d in load_docs(p)]


def k8s_validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S, strict=True)


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in all_docs() if d.get("kind") == kind]


def crd_schema() -> dict[str, Any]:
    [crd] = by_kind("CustomResourceDefinition")
    [version] = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """An OpenAPI v3 structural schema as a JSON schema that rejects unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
        ):
            out["additionalProperties"] = False
        if out.get("exclusiveMinimum") is True:  # OpenAPI 3.0 boolean form
            out["exclusiveMinimum"] = out.pop("minimum")
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def test_kubernetes_validate_has_132_schemas():
    import os

    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    assert {"v1.32.0-local", "v1.32.0-local-strict"} <= set(os.listdir(base))


def test_strict_validation_catches_unknown_fields():
    """A control: the validator used below does reject a misspelt field."""
    [ds] = by_kind("DaemonSet")
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["mountPropagaton"] = "Bidirectional"
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(bad)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_validates(path):
    docs = load_docs(path)
    assert docs, path
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # validated against their own schemas below
        k8s_validate(doc)


def test_cli_kubernetes_validate_strict():
    """The same check through the command the issue names."""
    # the console script installed next to this interpreter (CI runs the venv's
    # pytest without activating the venv, so it need not be on PATH)
    beside = Path(sys.executable).parent / "kubernetes-validate"
    exe = str(beside) if beside.exists() else shutil.which("kubernetes-validate")
    assert exe is not None, "kubernetes-validate is a test dependency"
    files = [str(p) for p, d in all_docs() if d["kind"] not in CRD_KINDS]
    proc = subprocess.run(
        [exe, "--strict", "-k", K8S, *sorted(set(files))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_example_checkpointconfiguration_matches_crd():
    schema = strict(crd_schema())
    [cpc] = by_kind("CheckpointConfiguration")
    jsonschema.validate(cpc, schema)
    for field, bad in [
        ("inMemoryVolumeSize", "fifty gigs"),
        ("peerPort", 70000),
        ("keepLocal", 0),
        ("unknownField", 1),
        ("cloudStorageBucketName", "gs://bucket"),
    ]:
        broken = copy.deepcopy(cpc)
        broken["spec"][field] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
    missing = copy.deepcopy(cpc)
    del missing["spec"]["inMemoryVolumeSize"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(missing, schema)


# The JobSet fields the example uses, typed as in kubernetes-sigs/jobset
# api/jobset/v1alpha2/jobset_types.go (JobSetSpec, ReplicatedJob, Network,
# FailurePolicy, SuccessPolicy, Coordinator); unknown fields are rejected.
JOBSET_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["replicatedJobs"],
            "properties": {
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "template"],
                        "properties": {
                            "name": {
                                "type": "string",
                                "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                            },
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "template": {"type": "object"},  # batch/v1 JobTemplateSpec: see below
                            "dependsOn": {"type": "array"},
                        },
                    },
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
                },
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {
                            "enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]
                        },
                        "rules": {"type": "array"},
                    },
                },
                "successPolicy": {
                    "type": "object",
                    "required": ["operator"],
                    "properties": {
                        "operator": {"enum": ["All", "Any"]},
                        "targetReplicatedJobs": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "coordinator": {"type": "object", "required": ["replicatedJob"]},
                "suspend": {"type": "boolean"},
                "managedBy": {"type": "string"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "startupPolicy": {"type": "object"},
                "volumeClaimPolicies": {"type": "array"},
            },
        },
    },
}


def test_example_jobset():
    [js] = by_kind("JobSet")
    jsonschema.validate(js, JOBSET_SCHEMA)
    name = js["metadata"]["name"]
    for rjob in js["spec"]["replicatedJobs"]:
        # the embedded Job template, as the Job the JobSet controller creates from it
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": f"{name}-{rjob['name']}-0",
                **rjob["template"].get("metadata", {}),
            },
            "spec": rjob["template"]["spec"],
        }
        k8s_validate(job)
        pod = rjob["template"]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        csi = volumes["checkpoint"]["csi"]
        assert csi["driver"] == server.DEFAULT_DRIVER_NAME
        assert set(csi["volumeAttributes"]) <= set(vc.TIERFS_ATTRIBUTES)
        mounts = [
            m
            for c in pod["containers"]
            for m in c.get("volumeMounts", [])
            if m["name"] == "checkpoint"
        ]
        assert mounts and all(not m.get("readOnly") for m in mounts)
        # every pod of the JobSet gets a distinct JAX process id, process 0 is the coordinator
        per_job = rjob["template"]["spec"]["parallelism"]
        assert int(csi["volumeAttributes"]["jaxProcessesPerJob"]) == per_job
        ids = set()
        for job_index in range(rjob.get("replicas", 1)):
            for pod_index in range(per_job):
                pod_name = f"{name}-{rjob['name']}-{job_index}-{pod_index}-x7k2p"
                info = vc.jax_init_info({**csi["volumeAttributes"], vc.POD_NAME: pod_name})
                ids.add(info.process_id)
                assert info.port == 8476
        assert ids == set(range(rjob.get("replicas", 1) * per_job))
        subdomain = js["spec"].get("network", {}).get("subdomain", name)
        assert (
            csi["volumeAttributes"]["jaxCoordinatorAddress"]
            == f"{name}-{js['spec']['replicatedJobs'][0]['name']}-0-0.{subdomain}"
        )


def test_csidriver():
    [drv] = by_kind("CSIDriver")
    assert drv["metadata"]["name"] == server.DEFAULT_DRIVER_NAME == render.DRIVER_NAME
    assert drv["spec"]["attachRequired"] is False
    assert drv["spec"]["podInfoOnMount"] is True
    assert drv["spec"]["volumeLifecycleModes"] == ["Ephemeral"]
    assert drv["spec"]["fsGroupPolicy"] == "None"


def test_node_daemonset_is_the_render_of_the_example(monkeypatch):
    """deploy/node/daemonset.yaml is generated; regenerate it (see deploy/kustomization.yaml)."""
    monkeypatch.chdir(ROOT)
    text = (DEPLOY / "node" / "daemonset.yaml").read_text()
    assert text == render.render_file("deploy/examples/checkpointconfiguration.yaml")
    [cpc] = by_kind("CheckpointConfiguration")
    [ds] = by_kind("DaemonSet")
    assert ds == render.render_node_daemonset(cpc)


def test_node_daemonset_wiring():
    [ds] = by_kind("DaemonSet")
    [cpc] = by_kind("CheckpointConfiguration")
    pod = ds["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    node = containers["tierfs"]
    assert node["args"][0] == "csi" and node["securityContext"]["privileged"] is True
    # kubelet's pod directory: the bind mounts must propagate back to the host
    mounts = {m["name"]: m for m in node["volumeMounts"]}
    assert mounts["kubelet-pods"]["mountPropagation"] == "Bidirectional"
    assert (
        volumes["kubelet-pods"]["hostPath"]["path"]
        == mounts["kubelet-pods"]["mountPath"]
        == "/var/lib/kubelet/pods"
    )
    # the RAM tier: tmpfs sized by the configuration, and tierfs's budget the same bytes
    ram = volumes["ram"]["emptyDir"]
    assert ram == {"medium": "Memory", "sizeLimit": cpc["spec"]["inMemoryVolumeSize"]}
    assert f"--size={render.quantity_bytes(ram['sizeLimit'])}" in node["args"]
    assert f"--ram-dir={mounts['ram']['mountPath']}" in node["args"]
    # the socket: one plugin directory shared by the driver and both sidecars
    plugin = volumes["plugin-dir"]["hostPath"]["path"]
    assert plugin == f"/var/lib/kubelet/plugins/{server.DEFAULT_DRIVER_NAME}"
    env = {e["name"]: e.get("value") for e in node["env"]}
    assert env["CSI_ENDPOINT"] == "unix:///csi/csi.sock"
    registrar = containers["node-driver-registrar"]
    assert "--csi-address=/csi/csi.sock" in registrar["args"]
    assert f"--kubelet-registration-path={plugin}/csi.sock" in registrar["args"]
    assert {m["mountPath"] for m in registrar["volumeMounts"]} == {"/csi", "/registration"}
    assert volumes["registration-dir"]["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"
    liveness = containers["liveness-probe"]
    port = next(int(a.split("=")[1]) for a in liveness["args"] if a.startswith("--health-port"))
    assert node["ports"][0]["containerPort"] == port
    assert node["livenessProbe"]["httpGet"]["port"] == node["ports"][0]["name"]
    # scheduling follows the configuration
    for k, v in cpc["spec"]["nodeSelector"].items():
        assert pod["nodeSelector"][k] == v
    assert pod["tolerations"] == cpc["spec"]["tolerations"]
    assert pod["serviceAccountName"] == by_kind("ServiceAccount")[0]["metadata"]["name"]
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"


def test_the_tierfs_csi_command_accepts_the_rendered_args(tmp_path):
    """Parse the DaemonSet's args with the real click command (no mount is started)."""
    from click.testing import CliRunner

    from tierfs.csi.cli import csi

    [ds] = by_kind("DaemonSet")
    args = [
        a.replace("$(CSI_ENDPOINT)", "unix:///csi/csi.sock")
        .replace("$(NODE_NAME)", "node-1")
        .replace("$(NODE_IP)", "10.0.0.1")
        for a in ds["spec"]["template"]["spec"]["containers"][0]["args"][1:]
    ]
    ctx = csi.make_context("csi", list(args))
    assert ctx.params["node_id"] == "node-1"
    assert ctx.params["ram_dir"] == "/var/lib/tierfs/ram"
    assert CliRunner().invoke(csi, ["--help"]).exit_code == 0


def _kustomize() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("neither kubectl nor kustomize is installed")
    return []


@pytest.mark.parametrize("overlay", ["", "operator", "examples"])
def test_kustomize_renders_and_validates(overlay):
    proc = subprocess.run(
        [*_kustomize(), str(DEPLOY / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    expected = {
        "": ["CSIDriver", "CustomResourceDefinition", "DaemonSet", "Namespace", "ServiceAccount"],
        "operator": [
            "CSIDriver",
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "Deployment",
            "Namespace",
            "Role",
            "RoleBinding",
            "ServiceAccount",
            "ServiceAccount",
        ],
        "examples": ["CheckpointConfiguration", "JobSet"],
    }[overlay]
    assert kinds == expected
    for doc in docs:
        if doc["kind"] == "CheckpointConfiguration":
            jsonschema.validate(doc, strict(crd_schema()))
        elif doc["kind"] == "JobSet":
            jsonschema.validate(doc, JOBSET_SCHEMA)
        else:
            k8s_validate(doc)
    images = [
        c["image"]
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert all(":" in i for i in images), images  # every image pinned to a tag


def _kustomize_resources(directory: Path) -> list[Path]:
    """The files a kustomization pulls in, following directory resources (no kubectl)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    files = []
    for res in k["resources"]:
        path = (directory / res).resolve()
        assert path.is_relative_to(directory.resolve()) or (path / "kustomization.yaml").exists()
        files += _kustomize_resources(path) if path.is_dir() else [path]
    return files


def test_kustomizations_cover_every_manifest_without_kubectl():
    """Independent of kubectl: every resource exists, and every manifest is installed somewhere."""
    used = set()
    for overlay in ("", "operator", "examples"):
        files = _kustomize_resources(DEPLOY / overlay)
        assert files and all(f.exists() for f in files)
        assert len(files) == len(set(files)), overlay
        used |= set(files)
    assert used == {p.resolve() for p in manifest_files()}


def test_operator_deployment_runs_the_operator_module():
    docs = [d for d in load_docs(DEPLOY / "operator" / "deployment.yaml")]
    [dep] = docs
    [c] = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["kopf", "run"] and "tierfs.csi.operator" in c["command"]
    import importlib.util

    assert importlib.util.find_spec("tierfs.csi.operator") is not None
