"""Node configuration: CLI flags and the YAML config file.

A config file (``tierfs mount --config FILE``) holds the same settings as
the flags; flags win. Keys are camelCase and, where they overlap with GKE's
``CheckpointConfiguration`` (``cloudStorageBucketName``,
``inMemoryVolumeSize``), named the same. Job parameters here are for generic
mode (no ``replicator.yaml``); a control file overrides them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from tierfs.core import sizes
from tierfs.core.errors import ConfigurationError


class ConfigError(ConfigurationError, ValueError):
    """A setting is missing, malformed or out of range; the message names it."""


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes in a size (``8Gi`` = 8·2³⁰, ``8G`` = 8·10⁹, ``512Mi``, plain bytes), as
    :func:`tierfs.core.sizes.parse_size` reads it everywhere (Kubernetes quantity semantics).

    Raises:
        ConfigError: naming ``what`` and the value: unparsable, not positive or
            not a whole number of bytes.
    """
    try:
        return sizes.parse_size(text, what)
    except sizes.SizeError as exc:
        raise ConfigError(str(exc)) from None


#: smallest accepted RAM budget (bytes): less cannot hold a checkpoint of any use
MIN_SIZE = 1 << 20


def format_size(n: int) -> str:
    """Bytes as a short human string (``1.5 GiB``)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 as ``[::1]:PORT``).

    Raises:
        ConfigError: no port, or port out of range.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


DEFAULT_SEAL_PATTERNS = (
    r"^(?P<step>\d+)$",
    r"^step_(?P<step>\d+)$",
    r"^step=(?P<step>\d+)$",
    r"^checkpoint-(?P<step>\d+)$",
    r"^iter_(?P<step>\d+)$",
    r"^global_step(?P<step>\d+)$",
)


@dataclass
class NodeConfig:
    """Everything one node daemon needs to know.

    Sizes are bytes, intervals seconds unless the name says otherwise.
    """

    mountpoint: str = ""
    ram_dir: str = ""
    size: int | None = None
    mount_options: list[str] = field(default_factory=list)
    log_file: str | None = None
    log_level: str = "INFO"
    # generic-mode job parameters (replicator.yaml overrides them)
    job: str | None = None
    node_rank: int = 0
    nodes: int = 1
    peers_per_node: int = 0
    peer_ranks: list[int] | None = None
    assume_data_parallelism: int | None = None
    # jax-init-info.txt
    process_id: int | None = None
    jax_coordinator: str | None = None
    # sealing and retention
    seal_patterns: list[str] = field(default_factory=lambda: list(DEFAULT_SEAL_PATTERNS))
    keep_local: int = 2
    # peer plane
    listen: str | None = None
    advertise: str | None = None
    coordinator: str | None = None
    peer_token: str | None = field(default=None, repr=False)  # a secret: never in logs
    join_timeout: float = 600.0
    # durable plane
    bucket: str | None = None
    backup_interval_minutes: float | None = None
    backup_interval_steps: int | None = None
    # observability
    metrics_port: int | None = None

    def validate(self) -> None:
        """Check ranges and formats.

        Raises:
            ConfigError: naming the first bad setting.
        """
        if self.size is not None and self.size < MIN_SIZE:
            raise ConfigError(
                f"--size {format_size(self.size)} is too small: the RAM budget "
                f"must be at least {format_size(MIN_SIZE)}"
            )
        if self.nodes < 1:
            raise ConfigError(f"nodes must be >= 1, got {self.nodes}")
        if not 0 <= self.node_rank < self.nodes:
            raise ConfigError(f"node-rank must be in [0, {self.nodes}), got {self.node_rank}")
        if self.keep_local < 1:
            raise ConfigError(f"keep-local must be >= 1, got {self.keep_local}")
        if self.peers_per_node < 0:
            raise ConfigError("peers-per-node must be >= 0")
        for name in ("listen", "coordinator", "advertise"):
            value = getattr(self, name)
            if value:
                parse_hostport(value, f"--{name}")
        if self.jax_coordinator:
            parse_hostport(self.jax_coordinator, "--jax-coordinator")
        if self.process_id is not None and self.process_id < 0:
            raise ConfigError("process-id must be >= 0")
        for pattern in self.seal_patterns:
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"bad --seal-pattern {pattern!r}: {exc}") from None
            if "step" not in compiled.groupindex:
                raise ConfigError(f"--seal-pattern {pattern!r} needs a (?P<step>\\d+) group")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# config-file key -> NodeConfig attribute
FILE_KEYS = {
    "mountPoint": "mountpoint",
    "ramDir": "ram_dir",
    "inMemoryVolumeSize": "size",
    "size": "size",
    "mountOptions": "mount_options",
    "logFile": "log_file",
    "logLevel": "log_level",
    "job": "job",
    "jobName": "job",
    "nodeRank": "node_rank",
    "nodes": "nodes",
    "peersPerNode": "peers_per_node",
    "peerRanks": "peer_ranks",
    "assumeDataParallelism": "assume_data_parallelism",
    "processId": "process_id",
    "jaxCoordinator": "jax_coordinator",
    "sealPatterns": "seal_patterns",
    "keepLocal": "keep_local",
    "listen": "listen",
    "advertise": "advertise",
    "coordinator": "coordinator",
    "peerToken": "peer_token",
    "joinTimeoutSeconds": "join_timeout",
    "cloudStorageBucketName": "bucket",
    "bucket": "bucket",
    "backupIntervalMinutes": "backup_interval_minutes",
    "backupIntervalSteps": "backup_interval_steps",
    "metricsPort": "metrics_port",
}


def load_config_file(path: str, notes: list[str] | None = None) -> dict[str, Any]:
    """Read a YAML config file into NodeConfig attribute names.

    Sizes are parsed by :func:`parse_size`; a size with a bare decimal suffix
    (``8G`` = 8·10⁹ bytes) adds a line of :func:`tierfs.core.sizes.decimal_note` to
    ``notes`` if given.

    Raises:
        ConfigError: unreadable file, bad YAML, unknown keys, bad values.
    """
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        attr = FILE_KEYS.get(str(key))
        if attr is None:
            raise ConfigError(
                f"config file {path}: unknown key {key!r} (known: {', '.join(sorted(FILE_KEYS))})"
            )
        if attr == "size" and value is not None:
            what = f"{key} in {path}"
            parsed = parse_size(value, what)
            note = sizes.decimal_note(value, what)
            if note and notes is not None:
                notes.append(note)
            value = parsed
        if attr in ("mount_options", "seal_patterns") and isinstance(value, str):
            value = [value]
        out[attr] = value
    return out
