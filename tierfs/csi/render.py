"""Render the node DaemonSet of one ``CheckpointConfiguration`` (a pure function).

A ``CheckpointConfiguration`` (``checkpointing.tierfs.dev/v1``, cluster
scoped; the CRD is ``deploy/base/crd-checkpointconfiguration.yaml``) says
which nodes run tierfs and how: GKE's field names where they overlap
(``cloudStorageBucketName``, ``nodeSelector``, ``tolerations``,
``inMemoryVolumeSize``) plus tierfs's extras (``mountOptions``,
``keepLocal``, ``backupIntervalMinutes``, ``peerPort``, ``logLevel``,
``extraArgs``). :func:`render_node_daemonset` turns one into the DaemonSet
that runs ``tierfs csi`` with node-driver-registrar and livenessprobe on
those nodes. The operator (:mod:`tierfs.csi.operator`) applies it for every
configuration; without the operator, ``python -m tierfs.csi.render
CONFIG.yaml`` prints it (``deploy/node/daemonset.yaml`` is the render of
``deploy/examples/checkpointconfiguration.yaml``).
"""

from __future__ import annotations

import copy
import hashlib
import re
import sys
from collections.abc import Mapping
from typing import Any

from tierfs.core import settings, sizes
from tierfs.core.errors import ConfigurationError

API_GROUP = "checkpointing.tierfs.dev"
API_VERSION = f"{API_GROUP}/v1"
KIND = "CheckpointConfiguration"
DRIVER_NAME = settings.DRIVER_NAME.default
NAMESPACE = settings.NAMESPACE.default
NODE_SERVICE_ACCOUNT = "tierfs-node"
IMAGE = settings.IMAGE.default
REGISTRAR_IMAGE = "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
LIVENESSPROBE_IMAGE = "registry.k8s.io/sig-storage/livenessprobe:v2.15.0"

KUBELET_DIR = "/var/lib/kubelet"
RAM_DIR = "/var/lib/tierfs/ram"
STATE_DIR = "/var/lib/tierfs/state"
MOUNT_DIR = "/run/tierfs/mount"
#: host-network ports of the sidecars' /healthz (away from the 9808-9810 other drivers use)
HEALTH_PORT = 19809
REGISTRAR_HEALTH_PORT = 19810
CONFIG_LABEL = f"{API_GROUP}/configuration"

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class RenderError(ConfigurationError, ValueError):
    """The CheckpointConfiguration cannot be rendered; the message names the field."""


def quantity_bytes(text: str) -> int:
    """Bytes in ``spec.inMemoryVolumeSize``, a Kubernetes quantity (``50Gi``, ``512Mi``,
    ``8G`` = 8·10⁹, ``1024``): :func:`tierfs.core.sizes.parse_size` in its strict
    Kubernetes form, the same bytes ``tierfs mount --size`` gives the same text.

    Raises:
        RenderError: not a quantity of the CRD's pattern, zero, or not whole bytes.
    """
    try:
        return sizes.parse_size(text, "spec.inMemoryVolumeSize", kubernetes=True)
    except sizes.SizeError as exc:
        raise RenderError(str(exc)) from None


def short_name(name: str, limit: int) -> str:
    """``name`` if it has at most ``limit`` characters, else a prefix plus a hash of it.

    Keeps names and label values unique and within Kubernetes' 63-character limits.
    """
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-.')}-{digest}"


def daemonset_name(config_name: str) -> str:
    """The DaemonSet name of a configuration (``tierfs-node-<name>``, at most 63 chars)."""
    return "tierfs-node-" + short_name(config_name, 63 - len("tierfs-node-"))


def _spec(cpc: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if cpc.get("apiVersion") != API_VERSION or cpc.get("kind") != KIND:
        raise RenderError(
            f"expected {API_VERSION} {KIND}, got {cpc.get('apiVersion')} {cpc.get('kind')}"
        )
    name = (cpc.get("metadata") or {}).get("name") or ""
    if not _NAME.match(name) or len(name) > 253:
        raise RenderError(f"metadata.name {name!r} is not a DNS subdomain name")
    spec = cpc.get("spec")
    if not isinstance(spec, Mapping):
        raise RenderError("spec is required")
    if not spec.get("inMemoryVolumeSize"):
        raise RenderError("spec.inMemoryVolumeSize is required")
    return name, dict(spec)


def node_args(spec: Mapping[str, Any], driver_name: str = DRIVER_NAME) -> list[str]:
    """The ``tierfs csi`` arguments for a configuration's spec.

    Raises:
        RenderError: a field of the wrong type or out of range.
    """
    size = quantity_bytes(spec["inMemoryVolumeSize"])
    args = [
        "csi",
        "--endpoint=$(CSI_ENDPOINT)",
        "--node-id=$(NODE_NAME)",
        f"--driver-name={driver_name}",
        f"--mount-dir={MOUNT_DIR}",
        f"--state-dir={STATE_DIR}",
        f"--ram-dir={RAM_DIR}",
        f"--size={size}",
        "--resize-ram-volume",
    ]
    bucket = spec.get("cloudStorageBucketName")
    if bucket:
        if not isinstance(bucket, str) or bucket.startswith("gs://"):
            raise RenderError(
                "spec.cloudStorageBucketName must be a bucket name "
                "(NAME or NAME/PREFIX, without gs://)"
            )
        args.append(f"--bucket={bucket}")
    for opt in spec.get("mountOptions") or []:
        if not isinstance(opt, str) or not opt or " " in opt:
            raise RenderError(f"spec.mountOptions: bad option {opt!r}")
        args += ["-o", opt]
    keep = spec.get("keepLocal")
    if keep is not None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise RenderError("spec.keepLocal must be an integer >= 1")
        args.append(f"--keep-local={keep}")
    minutes = spec.get("backupIntervalMinutes")
    if minutes is not None:
        if not isinstance(minutes, (int, float)) or isinstance(minutes, bool) or minutes <= 0:
            raise RenderError("spec.backupIntervalMinutes must be a positive number")
        args.append(f"--backup-interval-minutes={minutes}")
    port = spec.get("peerPort")
    if port is not None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise RenderError("spec.peerPort must be a port number")
        args += [f"--listen=0.0.0.0:{port}", f"--advertise=$(NODE_IP):{port}"]
    level = spec.get("logLevel")
    if level is not None:
        if level not in _LOG_LEVELS:
            raise RenderError(f"spec.logLevel must be one of {', '.join(_LOG_LEVELS)}")
        args.append(f"--log-level={level}")
    for extra in spec.get("extraArgs") or []:
        if not isinstance(extra, str):
            raise RenderError("spec.extraArgs must be strings")
        args.append(extra)
    return args


def render_node_daemonset(
    cpc: Mapping[str, Any],
    *,
    image: str = IMAGE,
    namespace: str = NAMESPACE,
    driver_name: str = DRIVER_NAME,
    registrar_image: str = REGISTRAR_IMAGE,
    livenessprobe_image: str = LIVENESSPROBE_IMAGE,
) -> dict[str, Any]:
    """The node DaemonSet (apps/v1) that serves ``cpc``'s nodes.

    Pure: the same configuration always gives the same object; nothing is
    read from the cluster or the environment. The RAM tier is a
    memory-backed emptyDir whose ``sizeLimit`` is ``spec.inMemoryVolumeSize``
    and tierfs's ``--size`` is the same number of bytes; ``--resize-ram-volume``
    lets the driver shrink that tmpfs to the budget where the kubelet mounted it
    larger (so the kernel enforces the budget and passthrough stays on). If the configuration
    carries ``metadata.uid`` (it came from the API server), the DaemonSet is
    owned by it, so deleting the configuration deletes the DaemonSet.

    Args:
        cpc: a ``checkpointing.tierfs.dev/v1`` ``CheckpointConfiguration`` as a dict.
        image: the tierfs image.
        namespace: where the DaemonSet lives (the node ServiceAccount's namespace).
        driver_name: the CSI driver name (the CSIDriver object's name).
        registrar_image, livenessprobe_image: the sidecar images.

    Raises:
        RenderError: naming the first invalid field.
    """
    name, spec = _spec(cpc)
    size = spec["inMemoryVolumeSize"]
    quantity_bytes(size)
    labels = {
        "app.kubernetes.io/name": "tierfs",
        "app.kubernetes.io/component": "node",
        CONFIG_LABEL: short_name(name, 63),
    }
    node_selector = {"kubernetes.io/os": "linux"}
    selector = spec.get("nodeSelector") or {}
    if not isinstance(selector, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        raise RenderError("spec.nodeSelector must map strings to strings")
    node_selector.update(selector)
    tolerations = spec.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        raise RenderError("spec.tolerations must be a list of tolerations")
    plugin_dir = f"{KUBELET_DIR}/plugins/{driver_name}"
    metadata: dict[str, Any] = {
        "name": daemonset_name(name),
        "namespace": namespace,
        "labels": dict(labels),
    }
    uid = (cpc.get("metadata") or {}).get("uid")
    if uid:
        metadata["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": name,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    node_container = {
        "name": "tierfs",
        "image": image,
        "args": node_args(spec, driver_name),
        "env": [
            {"name": "CSI_ENDPOINT", "value": "unix:///csi/csi.sock"},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        ],
        "securityContext": {"privileged": True},
        "ports": [{"name": "healthz", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "healthz"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 5,
        },
        # Ready = Probe says ready = the node's tierfs mount answers
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": "healthz"},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
        },
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            {
                "name": "kubelet-pods",
                "mountPath": f"{KUBELET_DIR}/pods",
                "mountPropagation": "Bidirectional",
            },
            {"name": "ram", "mountPath": RAM_DIR},
            {"name": "state", "mountPath": STATE_DIR},
        ],
    }
    registrar = {
        "name": "node-driver-registrar",
        "image": registrar_image,
        "args": [
            "--v=2",
            "--csi-address=/csi/csi.sock",
            f"--kubelet-registration-path={plugin_dir}/csi.sock",
            f"--http-endpoint=:{REGISTRAR_HEALTH_PORT}",
        ],
        "ports": [
            {"name": "registrar-hz", "containerPort": REGISTRAR_HEALTH_PORT, "protocol": "TCP"}
        ],
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "registrar-hz"},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
            "timeoutSeconds": 15,
        },
        "resources": {"requests": {"cpu": "10m", "memory": "20Mi"}},
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            {"name": "registration-dir", "mountPath": "/registration"},
        ],
    }
    liveness = {
        "name": "liveness-probe",
        "image": livenessprobe_image,
        "args": [
            "--csi-address=/csi/csi.sock",
            f"--health-port={HEALTH_PORT}",
            "--probe-timeout=3s",
        ],
        "resources": {"requests": {"cpu": "10m", "memory": "20Mi"}},
        "volumeMounts": [{"name": "plugin-dir", "mountPath": "/csi"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            # a new pod would end the FUSE mount under running trainers: roll by hand
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "serviceAccountName": NODE_SERVICE_ACCOUNT,
                    "hostNetwork": True,
                    "dnsPolicy": "ClusterFirstWithHostNet",
                    "terminationGracePeriodSeconds": 30,
                    "nodeSelector": node_selector,
                    "tolerations": copy.deepcopy(tolerations),
                    "containers": [node_container, registrar, liveness],
                    "volumes": [
                        {
                            "name": "plugin-dir",
                            "hostPath": {"path": plugin_dir, "type": "DirectoryOrCreate"},
                        },
                        {
                            "name": "registration-dir",
                            "hostPath": {
                                "path": f"{KUBELET_DIR}/plugins_registry",
                                "type": "Directory",
                            },
                        },
                        {
                            "name": "kubelet-pods",
                            "hostPath": {"path": f"{KUBELET_DIR}/pods", "type": "Directory"},
                        },
                        {"name": "ram", "emptyDir": {"medium": "Memory", "sizeLimit": size}},
                        {"name": "state", "emptyDir": {"sizeLimit": "16Mi"}},
                    ],
                },
            },
        },
    }


HEADER = (
    "# Generated by `python -m tierfs.csi.render {source}`; do not edit.\n"
    "# It is the node DaemonSet of that CheckpointConfiguration (the operator\n"
    "# renders the same object for every configuration in the cluster).\n"
)


def render_file(path: str) -> str:
    """Render the DaemonSet of the CheckpointConfiguration in ``path`` as YAML text.

    Raises:
        RenderError: the file holds no valid CheckpointConfiguration.
        OSError: it cannot be read.
    """
    import yaml

    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    configs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(configs) != 1:
        raise RenderError(f"{path}: expected one {KIND}, found {len(configs)}")
    ds = render_node_daemonset(configs[0])
    return HEADER.format(source=path) + yaml.safe_dump(ds, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    """``python -m tierfs.csi.render CONFIG.yaml``: print the node DaemonSet."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tierfs.csi.render CHECKPOINTCONFIGURATION.yaml", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render_file(args[0]))
    except (RenderError, OSError) as exc:
        print(f"tierfs render: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
