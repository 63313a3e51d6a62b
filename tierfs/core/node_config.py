"""The node settings schema: one model for the flags, the YAML config file, the
CheckpointConfiguration and the CSI volume attributes.

:class:`NodeConfig` is that schema: each field is one setting, declared once
with its type, default, constraints and doc, and a :class:`~tierfs.core.schema.Where`
saying where it can be given. The ``tierfs mount``/``tierfs csi`` options
(:mod:`tierfs.cli.options`), the config-file keys (:data:`FILE_KEYS`), the
``CheckpointConfiguration`` spec (:mod:`tierfs.csi.crd`) and the CSI volume
attributes (:mod:`tierfs.csi.volume_context`) are derived from it; the README's
table is :func:`markdown_table` (``python -m tierfs.core.config`` prints it).

This module imports pydantic; :mod:`tierfs.core.config` re-exports its names lazily, so
the commands that need no settings (``tierfs --help``, ``status``, ``wait``) start
without it.

A config file (``tierfs mount --config FILE``) holds the same settings as
the flags; flags win. Keys are camelCase and, where they overlap with GKE's
``CheckpointConfiguration`` (``cloudStorageBucketName``,
``inMemoryVolumeSize``), named the same. Job parameters here are for generic
mode (no ``replicator.yaml``); a control file overrides them. Every size is
read by :func:`tierfs.core.sizes.parse_size` (Kubernetes quantities).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

from tierfs.core import schema, settings, sizes
from tierfs.core.config import (
    DEFAULT_SEAL_PATTERNS,
    MIN_SIZE,
    ConfigError,
    format_size,
    parse_hostport,
)
from tierfs.core.schema import NoBool, Where, origin_of

# ---------------------------------------------------------------- field types


def _size(value: Any, info: ValidationInfo) -> Any:
    """A size in bytes (:func:`tierfs.core.sizes.parse_size`; the strict Kubernetes
    form when the context says ``kubernetes``); :data:`MIN_SIZE` is checked with the
    whole config (a CRD's or a volume's size alone may be smaller)."""
    if value is None:
        return None
    strict = bool(isinstance(info.context, Mapping) and info.context.get("kubernetes"))
    try:
        return sizes.parse_size(value, origin_of(info), kubernetes=strict)
    except sizes.SizeError as exc:
        raise ConfigError(str(exc)) from None


def _hostport(value: str, info: ValidationInfo) -> str:
    parse_hostport(value, origin_of(info))
    return value


def _one_or_list(value: Any) -> Any:
    """A lone string where a list is expected is a list of one (``mountOptions: ro``)."""
    return [value] if isinstance(value, str) else value


def _comma_list(value: Any, info: ValidationInfo) -> Any:
    """``1,2`` -> ``[1, 2]``: a comma-separated list as ``--peer-ranks`` gives it."""
    if isinstance(value, str):
        items = [x.strip() for x in value.split(",") if x.strip()]
        return items or None
    return value


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


def _seal_patterns(value: list[str], info: ValidationInfo) -> list[str]:
    origin = origin_of(info)
    for pattern in value:
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"bad {origin} {pattern!r}: {exc}") from None
        if "step" not in compiled.groupindex:
            raise ConfigError(f"{origin} {pattern!r} needs a (?P<step>\\d+) group")
    return value


Size = Annotated[int | None, BeforeValidator(_size)]
HostPort = Annotated[str, AfterValidator(_hostport)]
Count = Annotated[int, NoBool]
Seconds = Annotated[float, NoBool]


class NodeConfig(BaseModel):
    """Everything one node daemon needs to know: the schema of a node's settings.

    Sizes are bytes, intervals seconds unless the name says otherwise. Each
    field's :class:`~tierfs.core.schema.Where` says where it can be given;
    its description is the ``--help`` text.

    Raises (on construction, :meth:`from_dict` and :func:`build_config`):
        pydantic.ValidationError / ConfigError: a value of the wrong type or range.
    """

    model_config = ConfigDict(extra="forbid", validate_default=False)

    mountpoint: Annotated[
        str,
        Field(description="The mount point (the MOUNTPOINT argument wins)."),
        Where(keys=("mountPoint",)),
    ] = ""
    ram_dir: Annotated[
        str,
        Field(
            description="[required unless --config sets ramDir] Directory on tmpfs that "
            "holds the bytes (created with mode 0700)."
        ),
        Where(flag="--ram-dir", keys=("ramDir",), metavar="DIR"),
    ] = ""
    size: Annotated[
        Size,
        Field(
            description="RAM budget, a Kubernetes quantity: 8Gi, 512Mi, bytes; 8G is "
            "8·10⁹ bytes; at least 1 MiB."
        ),
        Where(
            flag="--size",
            metavar="SIZE",
            keys=("inMemoryVolumeSize", "size"),
            crd="inMemoryVolumeSize",
            unit="bytes",
            default_doc="free space of the ram-dir's filesystem",
        ),
    ] = None
    mount_options: Annotated[
        list[str],
        BeforeValidator(_one_or_list),
        Field(
            default_factory=list,
            description="Mount options: allow_other, ro, noatime, attr_timeout=S, "
            "entry_timeout=S, no_passthrough, fsname=NAME, ...",
        ),
        Where(
            short="-o",
            dest="option",
            multiple=True,
            accumulate=True,
            metavar="OPT[,OPT...]",
            keys=("mountOptions",),
            crd="mountOptions",
        ),
    ]
    log_file: Annotated[
        str | None,
        Field(description="Daemon log."),
        Where(
            flag="--log-file",
            keys=("logFile",),
            metavar="FILE",
            default_doc="<ram-dir>/store/daemon.log",
        ),
    ] = None
    log_level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR"],
        BeforeValidator(_upper),
        Field(description="Daemon log level."),
        Where(flag="--log-level", keys=("logLevel",), crd="logLevel", default_doc="info"),
    ] = "INFO"
    # generic-mode job parameters (replicator.yaml overrides them)
    job: Annotated[
        str | None,
        Field(description="Job name for generic mode (no replicator.yaml)."),
        Where(flag="--job", keys=("job", "jobName")),
    ] = None
    node_rank: Annotated[
        Count,
        Field(ge=0, description="This node's rank (generic mode)."),
        Where(flag="--node-rank", keys=("nodeRank",)),
    ] = 0
    nodes: Annotated[
        Count,
        Field(ge=1, description="Number of nodes (generic mode)."),
        Where(flag="--nodes", keys=("nodes",)),
    ] = 1
    peers_per_node: Annotated[
        Count,
        Field(ge=0, description="Peers receiving each node's steps."),
        Where(flag="--peers-per-node", keys=("peersPerNode",)),
    ] = 0
    peer_ranks: Annotated[
        list[Annotated[Count, Field(ge=0)]] | None,
        BeforeValidator(_comma_list),
        Field(description="Explicit comma-separated peer ranks."),
        Where(flag="--peer-ranks", keys=("peerRanks",), list_sep=","),
    ] = None
    assume_data_parallelism: Annotated[
        Count | None,
        Field(ge=1, description="D: ranks form a D x (nodes/D) grid with identical columns."),
        Where(flag="--assume-data-parallelism", keys=("assumeDataParallelism",)),
    ] = None
    # jax-init-info.txt
    process_id: Annotated[
        Count | None,
        Field(ge=0, description="Process id for jax-init-info.txt."),
        Where(flag="--process-id", keys=("processId",), csi="jaxProcessId"),
    ] = None
    jax_coordinator: Annotated[
        HostPort | None,
        Field(description="JAX coordinator for jax-init-info.txt (MTC uses port 8476)."),
        Where(
            flag="--jax-coordinator",
            keys=("jaxCoordinator",),
            csi="jaxCoordinatorAddress",
            metavar="HOST:PORT",
        ),
    ] = None
    # sealing and retention
    seal_patterns: Annotated[
        list[str],
        BeforeValidator(_one_or_list),
        AfterValidator(_seal_patterns),
        Field(
            default_factory=lambda: list(DEFAULT_SEAL_PATTERNS),
            description="Top-level step names that seal (needs a (?P<step>\\d+) group); "
            "repeatable; replaces the default set.",
        ),
        Where(
            flag="--seal-pattern",
            dest="seal_pattern",
            multiple=True,
            metavar="REGEX",
            keys=("sealPatterns",),
        ),
    ]
    keep_local: Annotated[
        Count,
        Field(ge=1, description="Sealed steps kept in RAM."),
        Where(flag="--keep-local", keys=("keepLocal",), crd="keepLocal"),
    ] = 2
    # peer plane
    listen: Annotated[
        HostPort | None,
        Field(description="Peer gRPC listen address."),
        Where(flag="--listen", keys=("listen",), metavar="HOST:PORT"),
    ] = None
    advertise: Annotated[
        HostPort | None,
        Field(description="Address peers use to reach this node."),
        Where(flag="--advertise", keys=("advertise",), metavar="HOST:PORT", default_doc="--listen"),
    ] = None
    data_port: Annotated[
        Count,
        Field(
            ge=-1,
            le=65535,
            description="TCP port of the data lane, a stream beside gRPC that serves "
            "other nodes' file pulls with sendfile (on --listen's host; 0: any free "
            "port; -1: off, every byte over gRPC).",
        ),
        Where(flag="--data-port", keys=("dataPort",), metavar="PORT", default_doc="any free"),
    ] = 0
    coordinator: Annotated[
        HostPort | None,
        Field(
            description="Rank 0's peer address (static rendezvous); without it, nodes "
            "with --listen and --bucket find rank 0 through the bucket."
        ),
        Where(flag="--coordinator", keys=("coordinator",), metavar="HOST:PORT"),
    ] = None
    peer_token: Annotated[
        str | None,
        Field(repr=False, description="Shared secret on every peer call."),
        Where(flag="--peer-token", keys=("peerToken",), env=settings.PEER_TOKEN.name, secret=True),
    ] = None  # a secret: never in logs
    join_timeout: Annotated[
        Seconds,
        Field(
            ge=0, allow_inf_nan=False, description="Seconds a restore waits for every node to join."
        ),
        Where(flag="--join-timeout", keys=("joinTimeoutSeconds",), unit="s"),
    ] = 600.0
    gone_after: Annotated[
        Seconds | None,
        Field(
            gt=0,
            allow_inf_nan=False,
            description="Node-rank 0's coordinator declares a node gone for good when it "
            "sent no heartbeat for this long (off by default; see tierfs nodes gone).",
        ),
        Where(flag="--gone-after", keys=("goneAfterSeconds",), unit="s", default_doc="off"),
    ] = None
    heartbeat_group: Annotated[
        Count,
        Field(
            ge=1,
            description="Node ranks per heartbeat group: in a job of more nodes, each "
            "node's heartbeat goes through its group's leader (its lowest live node "
            "rank), which sends the group's heartbeats to the coordinator in one call.",
        ),
        Where(flag="--heartbeat-group", keys=("heartbeatGroupSize",)),
    ] = 100
    # durable plane
    bucket: Annotated[
        str | None,
        Field(description="GCS bucket for backups."),
        Where(
            flag="--bucket",
            keys=("cloudStorageBucketName", "bucket"),
            crd="cloudStorageBucketName",
            metavar="NAME[/PREFIX]",
        ),
    ] = None
    backup_interval_minutes: Annotated[
        Seconds | None,
        Field(
            gt=0,
            allow_inf_nan=False,
            description="Backup period (generic mode; replicator.yaml overrides).",
        ),
        Where(
            flag="--backup-interval-minutes",
            keys=("backupIntervalMinutes",),
            crd="backupIntervalMinutes",
            unit="min",
        ),
    ] = None
    backup_interval_steps: Annotated[
        Count | None,
        Field(ge=1, description="Back up every N steps."),
        Where(flag="--backup-interval-steps", keys=("backupIntervalSteps",)),
    ] = None
    # observability
    metrics_port: Annotated[
        Count | None,
        Field(ge=0, le=65535, description="Serve Prometheus /metrics on this port."),
        Where(flag="--metrics-port", keys=("metricsPort",)),
    ] = None

    @model_validator(mode="after")
    def _across(self, info: ValidationInfo) -> NodeConfig:
        """Checks of the whole config: rank and peer ranks below the node count, the
        data-parallel degree dividing it, the RAM budget at least :data:`MIN_SIZE`."""
        ctx = info.context if isinstance(info.context, Mapping) else {}
        origins = ctx.get("origins") or {}
        if self.size is not None and self.size < MIN_SIZE:
            raise ConfigError(
                f"{origins.get('size', '--size')} {format_size(self.size)} is too small: "
                f"the RAM budget must be at least {format_size(MIN_SIZE)}"
            )
        if not self.node_rank < self.nodes:
            raise ConfigError(
                f"{origins.get('node_rank', 'node-rank')} must be in [0, {self.nodes}), "
                f"got {self.node_rank}"
            )
        # the same rules as replicator.yaml's (core/control.py): a value the cluster
        # cannot use is refused at mount, not logged by the peer tier forever
        for p in self.peer_ranks or ():
            if p >= self.nodes:
                raise ConfigError(
                    f"{origins.get('peer_ranks', '--peer-ranks')}: peer rank {p} must be "
                    f"< nodes {self.nodes}"
                )
        dp = self.assume_data_parallelism
        if dp is not None and self.nodes % dp:
            raise ConfigError(
                f"{origins.get('assume_data_parallelism', '--assume-data-parallelism')} "
                f"{dp} must divide nodes {self.nodes}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """Every setting by attribute name (JSON-ready; the peer token included)."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeConfig:
        """A config of :meth:`to_dict`'s form; unknown keys are ignored.

        Raises:
            ConfigError: a bad value, named by its attribute.
        """
        known = {k: v for k, v in data.items() if k in cls.model_fields}
        return schema.validate_model(cls, known, {k: k for k in known}, ConfigError)


#: the settings of the schema, in declaration order
FIELDS = schema.fields_of(NodeConfig)

#: config-file key -> NodeConfig attribute
FILE_KEYS: dict[str, str] = {key: f.name for f in FIELDS for key in f.where.keys}


def markdown_table() -> str:
    """The README's table of the node settings (generated; a test keeps them equal)."""
    return schema.markdown_table(NodeConfig)


def load_config_file(path: str, notes: list[str] | None = None) -> dict[str, Any]:
    """Read a YAML config file into NodeConfig attribute names, each value validated.

    Sizes are parsed by :func:`parse_size`; a size with a bare decimal suffix
    (``8G`` = 8·10⁹ bytes) adds a line of :func:`tierfs.core.sizes.decimal_note` to
    ``notes`` if given.

    Raises:
        ConfigError: unreadable file, bad YAML, unknown keys, bad values (naming the
            key and the file).
    """
    values, _origins = read_config_file(path, notes)
    return values


def read_config_file(
    path: str, notes: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """:func:`load_config_file`, plus each attribute's origin (``keepLocal in PATH``).

    Raises:
        ConfigError: as :func:`load_config_file`.
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
    origins: dict[str, str] = {}
    for key, value in raw.items():
        attr = FILE_KEYS.get(str(key))
        if attr is None:
            raise ConfigError(
                f"config file {path}: unknown key {key!r} (known: {', '.join(sorted(FILE_KEYS))})"
            )
        origin = f"{key} in {path}"
        if value is not None:
            value = schema.parse_value(NodeConfig, attr, value, origin, ConfigError)
            note = sizes.decimal_note(raw[key], origin) if attr == "size" else None
            if note and notes is not None:
                notes.append(note)
        out[attr] = value
        origins[attr] = origin
    return out, origins


def build_config(
    flags: Mapping[str, Any],
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    notes: list[str] | None = None,
) -> NodeConfig:
    """The NodeConfig of flags over a config file over ``TIERFS_*`` fallbacks.

    Args:
        flags: click's parsed options by parameter name (None or ``()``: not given).
        config_file: the ``--config`` path, or None.
        env: where :attr:`~tierfs.core.schema.Where.env` fallbacks are read (default
            ``os.environ``, through :mod:`tierfs.core.settings`).
        notes: gets one line per size with a bare decimal suffix.

    Raises:
        ConfigError: naming the first bad setting by its flag or its key and file.
    """
    data: dict[str, Any] = {}
    origins: dict[str, str] = {}
    file_notes: list[str] = []
    if config_file:
        data, origins = read_config_file(config_file, file_notes)
    for f in FIELDS:
        value = flags.get(f.dest)
        if value is None or value == () or value == []:
            continue
        if f.where.multiple:
            value = list(value)
            if f.where.accumulate:
                value = list(data.get(f.name) or []) + value
        data[f.name] = value
        origins[f.name] = f.option or f.name
        if f.name == "size" and isinstance(value, (str, int)):
            file_notes = [n for n in [sizes.decimal_note(value, origins[f.name])] if n]
    for f in FIELDS:
        if f.where.env and data.get(f.name) is None:
            value = settings.BY_NAME[f.where.env].get(env)
            if value:
                data[f.name] = value
                origins[f.name] = f"environment variable {f.where.env}"
    if notes is not None:
        notes.extend(file_notes)
    return schema.validate_model(NodeConfig, data, origins, ConfigError)
