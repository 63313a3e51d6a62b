"""The ``volume_context`` of a tierfs CSI volume: the keys tierfs reads, and redaction.

Kubelet fills ``NodePublishVolumeRequest.volume_context`` (CSI spec,
"NodePublishVolume", field 8) with the pod's ``volumeAttributes`` and, because
the CSIDriver object sets ``podInfoOnMount: true``, with
``csi.storage.k8s.io/pod.name``, ``pod.namespace``, ``pod.uid``,
``serviceAccount.name`` and ``csi.storage.k8s.io/ephemeral``. With
``tokenRequests`` it also carries ``csi.storage.k8s.io/serviceAccount.tokens``,
a bearer token: that one, and the ``secrets`` map (a ``csi_secret`` field,
spec "Secrets Requirements"), must never be logged. :func:`redacted` is the
only form in which a context reaches a log line or an error message.

Volume attributes tierfs understands (see docs/KUBERNETES.md):

``jaxProcessId``
    This pod's JAX process id (integer >= 0), or ``auto``: derive it from the
    JobSet pod name ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<suffix>``
    as ``jobIndex * jaxProcessesPerJob + podIndex``.
``jaxProcessesPerJob``
    Pods per child Job (the Job's ``parallelism``); needed by ``auto`` when
    the JobSet has more than one child Job.
``jaxCoordinatorAddress``
    ``HOST`` or ``HOST:PORT`` of JAX process 0 (default port 8476, as MTC).

When both a process id and a coordinator are given, NodePublishVolume writes
``jax-init-info.txt`` (``<process_id>\\n<host>:<port>\\n``, PROTOCOL.md §1)
into the mount root, atomically.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from tierfs.core import node_config as config
from tierfs.core import schema
from tierfs.core.errors import ConfigurationError


def _attribute(setting: str) -> str:
    """The CSI volume attribute of a node setting, as the schema declares it."""
    name = next(f.where.csi for f in config.FIELDS if f.name == setting)
    assert name is not None, setting
    return name


#: the settings the schema lets a volume give (``--process-id``, ``--jax-coordinator``)
ATTR_PROCESS_ID = _attribute("process_id")
ATTR_COORDINATOR = _attribute("jax_coordinator")
#: a volume's own attribute (no node setting): pods per child Job for ``auto``
ATTR_PROCESSES_PER_JOB = "jaxProcessesPerJob"
TIERFS_ATTRIBUTES = (ATTR_PROCESS_ID, ATTR_PROCESSES_PER_JOB, ATTR_COORDINATOR)

#: keys kubelet adds (podInfoOnMount, ephemeral volumes, tokenRequests)
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_UID = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
SERVICE_ACCOUNT_TOKENS = "csi.storage.k8s.io/serviceAccount.tokens"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"

#: MTC's JAX coordinator port (high-scale-checkpointing-controller --coordinator-port)
DEFAULT_COORDINATOR_PORT = 8476

#: a key naming any of these is treated as a secret
_SENSITIVE = re.compile(
    r"token|secret|password|passwd|credential|private|apikey|api-key", re.IGNORECASE
)
REDACTED = "<redacted>"

# JobSet pod names: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<5 random chars>
_JOBSET_POD = re.compile(r"^.+-(?P<job>\d+)-(?P<pod>\d+)-[a-z0-9]{5}$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?$")


class ContextError(ConfigurationError, ValueError):
    """A tierfs volume attribute is malformed; the message names the key (never a secret)."""


def is_sensitive(key: str) -> bool:
    """True if the value under ``key`` must not be logged (tokens, secrets, passwords)."""
    return key == SERVICE_ACCOUNT_TOKENS or bool(_SENSITIVE.search(key))


def redacted(context: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``context`` safe to log: sensitive values replaced by ``<redacted>``."""
    return {k: (REDACTED if is_sensitive(k) else v) for k, v in sorted(context.items())}


def comparable(context: Mapping[str, str]) -> dict[str, str]:
    """The part of ``context`` that defines a publish (CSI spec: P1 = P2 except secrets).

    Service-account tokens are left out: kubelet mints new ones for every call.
    """
    return {k: v for k, v in sorted(context.items()) if k != SERVICE_ACCOUNT_TOKENS}


@dataclass(frozen=True)
class JaxInitInfo:
    """What goes into ``jax-init-info.txt`` (PROTOCOL.md §1)."""

    process_id: int
    host: str
    port: int

    def render(self) -> bytes:
        """The file content: ``<process_id>\\n<host>:<port>\\n`` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.process_id}\n{host}:{self.port}\n".encode()


def _parse_int(key: str, value: str, minimum: int) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        raise ContextError(f"volume attribute {key} must be an integer, got {value!r}") from None
    if n < minimum:
        raise ContextError(f"volume attribute {key} must be >= {minimum}, got {n}")
    return n


def parse_process_id(value: str) -> int:
    """``jaxProcessId`` as a number: the schema's ``process_id`` (an integer >= 0).

    Raises:
        ContextError: ``volume attribute jaxProcessId must be ..., got ...``.
    """
    n: int = schema.parse_value(
        config.NodeConfig,
        "process_id",
        value.strip(),
        f"volume attribute {ATTR_PROCESS_ID}",
        ContextError,
    )
    return n


def parse_coordinator(value: str) -> tuple[str, int]:
    """Split ``HOST``, ``HOST:PORT``, ``[IPv6]:PORT`` or ``[IPv6]``; default port 8476.

    Raises:
        ContextError: empty host, bad characters or a port out of range.
    """
    text = value.strip()
    port = DEFAULT_COORDINATOR_PORT
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ContextError(f"volume attribute {ATTR_COORDINATOR}: bad address {value!r}")
            port = _parse_int(ATTR_COORDINATOR, rest[1:], 1)
        if not host or not re.fullmatch(r"[0-9A-Fa-f:.]+", host):
            raise ContextError(f"volume attribute {ATTR_COORDINATOR}: bad IPv6 host {value!r}")
    else:
        host, sep, p = text.rpartition(":")
        if not sep:
            host = text
        else:
            port = _parse_int(ATTR_COORDINATOR, p, 1)
        if not _HOST.match(host):
            raise ContextError(f"volume attribute {ATTR_COORDINATOR}: bad host in {value!r}")
    if port > 65535:
        raise ContextError(f"volume attribute {ATTR_COORDINATOR}: port {port} out of range")
    return host, port


def jax_init_info(context: Mapping[str, str]) -> JaxInitInfo | None:
    """The ``jax-init-info.txt`` a publish with ``context`` must write, or None.

    None when neither ``jaxProcessId`` nor ``jaxCoordinatorAddress`` is set.

    Raises:
        ContextError: only one of the two is set, a value is malformed, or
            ``auto`` cannot be resolved from the pod name.
    """
    raw_id = context.get(ATTR_PROCESS_ID, "").strip()
    raw_coord = context.get(ATTR_COORDINATOR, "").strip()
    if not raw_id and not raw_coord:
        return None
    if not raw_id or not raw_coord:
        raise ContextError(
            f"volume attributes {ATTR_PROCESS_ID} and {ATTR_COORDINATOR} must be given together"
        )
    host, port = parse_coordinator(raw_coord)
    if raw_id.lower() == "auto":
        pod = context.get(POD_NAME, "")
        m = _JOBSET_POD.match(pod)
        if not m:
            raise ContextError(
                f"{ATTR_PROCESS_ID}=auto needs a JobSet pod name "
                f"(<jobset>-<job>-<jobIndex>-<podIndex>-<suffix>) in {POD_NAME} "
                f"(CSIDriver podInfoOnMount: true), got {pod!r}"
            )
        job_index, pod_index = int(m.group("job")), int(m.group("pod"))
        per_job_raw = context.get(ATTR_PROCESSES_PER_JOB, "").strip()
        if per_job_raw:
            per_job = _parse_int(ATTR_PROCESSES_PER_JOB, per_job_raw, 1)
            if pod_index >= per_job:
                raise ContextError(
                    f"pod index {pod_index} of {pod!r} is not below "
                    f"{ATTR_PROCESSES_PER_JOB}={per_job}"
                )
        elif job_index > 0:
            raise ContextError(
                f"{ATTR_PROCESS_ID}=auto in child Job {job_index} needs {ATTR_PROCESSES_PER_JOB}"
            )
        else:
            per_job = 0
        process_id = job_index * per_job + pod_index
    else:
        process_id = parse_process_id(raw_id)
    return JaxInitInfo(process_id, host, port)
