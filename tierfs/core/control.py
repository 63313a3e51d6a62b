"""The control protocol of GKE multi-tier checkpointing, as files in the mount root.

Everything here is pure or does one small atomic file operation, so it can be
unit-tested without a mount. The contract is PROTOCOL.md (sections 1, 2, 4,
5) and what the real clients do (docs/CLIENTS.md): Orbax's
``initialize_multi_tier_checkpointing``/``ReplicatorCheckpointManager`` and
the NeMo helper ``high_scale_ckpt_utils.py``.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import string
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tierfs.core.errors import ProtocolError

REPLICATOR_YAML = "replicator.yaml"
REPLICATOR_ERRORS = "replicator.errors"
REPLICATOR_FAILED = "replicator.failed"
REPLICATOR_PRERESTORE = "replicator.prerestore"
JAX_INIT_INFO = "jax-init-info.txt"
#: entries that survive the cleanup done when a new replicator.yaml arrives
KEPT_ON_CLEANUP = frozenset({REPLICATOR_YAML, JAX_INIT_INFO, ".tierfs"})

FRAMEWORKS = ("orbax", "pytorch.distributed", "pytorch")
#: framework name of generic mode (no control file; seal rules from the config)
GENERIC = "generic"

MARKER_RE = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<node>\d+)-w(?P<worker>\d+)\.restore$")
SAVE_FILE_RE = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<node>\d+)-w(?P<worker>\d+)\.save$")


class ControlError(ProtocolError, ValueError):
    """A ``replicator.yaml`` the node cannot act on; the message is one line for
    ``replicator.failed``."""


#: largest ``replicator.yaml`` read, in bytes (real ones are a few hundred)
MAX_CONTROL_BYTES = 1 << 20
#: longest job name, in bytes: markers (``<job>-s<step>-n<node>-w<w>.restore``)
#: and their temporary names must stay within NAME_MAX (255)
MAX_JOB_NAME = 128


class _ControlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases (``*name``).

    Neither Orbax nor the NeMo helper writes anchors; an alias, on the other
    hand, lets a few hundred bytes expand to gigabytes ("billion laughs").
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed", event.start_mark
            )
        return super().compose_node(parent, index)


def read_control(path: str) -> str:
    """Read ``replicator.yaml`` without following a symlink or blocking on a FIFO.

    Args:
        path: the file in the view (the daemon's side of the mount).

    Returns:
        Its text (invalid UTF-8 replaced).

    Raises:
        FileNotFoundError: it is gone (consumed or renamed away meanwhile).
        ControlError: a symlink, directory, FIFO or other non-regular file, or
            larger than :data:`MAX_CONTROL_BYTES`: a client writes a regular file
            (PROTOCOL.md section 2), and the daemon runs as root, so it never
            reads what a link points at.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ControlError("replicator.yaml is a symbolic link; write a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "not a regular file"
            )
            raise ControlError(f"replicator.yaml is {kind}; write a regular file")
        if st.st_size > MAX_CONTROL_BYTES:
            raise ControlError(
                f"replicator.yaml is {st.st_size} bytes; the limit is {MAX_CONTROL_BYTES}"
            )
        chunks, total = [], 0
        while total <= MAX_CONTROL_BYTES:
            data = os.read(fd, MAX_CONTROL_BYTES + 1 - total)
            if not data:
                break
            chunks.append(data)
            total += len(data)
        if total > MAX_CONTROL_BYTES:
            raise ControlError(f"replicator.yaml is over {MAX_CONTROL_BYTES} bytes")
        return b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def load_replicator_yaml(path: str, env: dict[str, str] | None = None) -> JobSpec | None:
    """:func:`read_control` then :func:`parse_replicator_yaml` (blocking: call it in a
    worker thread). Raises what both raise."""
    return parse_replicator_yaml(read_control(path), env)


@dataclass(frozen=True)
class JobSpec:
    """A job as ``replicator.yaml`` (or generic-mode flags) describes it.

    Attributes:
        name: ``job-name``; prefix of marker names and the job's bucket directory.
        framework: ``orbax``, ``pytorch.distributed``, ``pytorch`` or ``generic``.
        node_rank: 0 <= rank < nodes, stable across restarts.
        nodes: number of nodes.
        peer_ranks: explicit receivers of this node's steps, or None.
        peers_per_node: number of receivers when ranks are not given.
        assume_data_parallelism: D for a D x (nodes/D) grid with identical columns.
        backup_interval_minutes, backup_interval_steps: GCS backup period.
        workers_per_node: ``w`` indices (``pytorch`` framework only).
        master_port: coordinator port hint.
        warnings: one line per unknown key (for ``replicator.errors``).
    """

    name: str
    framework: str
    node_rank: int
    nodes: int
    peer_ranks: tuple[int, ...] | None = None
    peers_per_node: int = 0
    assume_data_parallelism: int | None = None
    backup_interval_minutes: float | None = None
    backup_interval_steps: int | None = None
    workers_per_node: int = 1
    master_port: int = 4242
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "framework": self.framework,
            "node_rank": self.node_rank,
            "nodes": self.nodes,
            "peer_ranks": list(self.peer_ranks) if self.peer_ranks is not None else None,
            "peers_per_node": self.peers_per_node,
            "assume_data_parallelism": self.assume_data_parallelism,
            "backup_interval_minutes": self.backup_interval_minutes,
            "backup_interval_steps": self.backup_interval_steps,
            "workers_per_node": self.workers_per_node,
            "master_port": self.master_port,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        pr = d.get("peer_ranks")
        return cls(
            name=d["name"],
            framework=d["framework"],
            node_rank=int(d["node_rank"]),
            nodes=int(d["nodes"]),
            peer_ranks=tuple(pr) if pr is not None else None,
            peers_per_node=int(d.get("peers_per_node") or 0),
            assume_data_parallelism=d.get("assume_data_parallelism"),
            backup_interval_minutes=d.get("backup_interval_minutes"),
            backup_interval_steps=d.get("backup_interval_steps"),
            workers_per_node=int(d.get("workers_per_node") or 1),
            master_port=int(d.get("master_port") or 4242),
        )


def _var_names(value: Any) -> list[str]:
    """The ``$VAR``/``${VAR}`` names a value refers to (recursively in lists)."""
    if isinstance(value, str):
        return [
            m.group("named") or m.group("braced")
            for m in string.Template.pattern.finditer(value)
            if m.group("named") or m.group("braced")
        ]
    if isinstance(value, list):
        return [n for v in value for n in _var_names(v)]
    return []


def expand_vars(value: Any, env: dict[str, str]) -> Any:
    """Expand ``$VAR``/``${VAR}`` in strings (recursively in lists); unknown vars stay as is."""
    if isinstance(value, str):
        return string.Template(value).safe_substitute(env)
    if isinstance(value, list):
        return [expand_vars(v, env) for v in value]
    return value


def _as_int(key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise ControlError(f"{key} must be an integer, got {value!r}")
    integral_float = isinstance(value, float) and value.is_integer()
    integral_str = isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value)
    if isinstance(value, int) or integral_float or integral_str:
        result = int(value)
    else:
        raise ControlError(f"{key} must be an integer, got {value!r}")
    if result < minimum:
        raise ControlError(f"{key} must be >= {minimum}, got {result}")
    return result


def _as_number(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ControlError(f"{key} must be a number, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ControlError(f"{key} must be a number, got {value!r}") from None
    if not result > 0:
        raise ControlError(f"{key} must be > 0, got {value!r}")
    return result


def _required(data: Any) -> Any:
    if isinstance(data, dict):
        for key in ("job-name", "framework", "node-rank", "nodes"):
            if key not in data or data[key] is None or data[key] == "":
                raise ControlError(f"replicator.yaml is missing required key {key!r}")
    return data


def _job_name(value: Any) -> str:
    name = str(value).strip()
    if (
        not name
        or "/" in name
        or name in (".", "..")
        or any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name)
    ):
        raise ControlError(f"job-name {value!r} is not a valid name")
    if len(name.encode()) > MAX_JOB_NAME:
        raise ControlError(
            f"job-name is {len(name.encode())} bytes long; the limit is "
            f"{MAX_JOB_NAME} (restore markers must fit in a file name)"
        )
    return name


def _framework(value: Any) -> str:
    framework = str(value).strip()
    if framework not in FRAMEWORKS:
        raise ControlError(
            f"unknown framework {framework!r} (expected one of {', '.join(FRAMEWORKS)})"
        )
    return framework


def _int_of(key: str, minimum: int = 0) -> BeforeValidator:
    return BeforeValidator(lambda v: _as_int(key, v, minimum))


def _nodes_of(info: ValidationInfo) -> int | None:
    nodes = info.data.get("nodes")
    return nodes if isinstance(nodes, int) else None


class ReplicatorYaml(BaseModel):
    """The model of ``replicator.yaml`` (PROTOCOL.md section 2; GKE MTC's keys).

    Keys are the file's (``job-name``, ``node-rank``...); values arrive after
    ``$VAR`` expansion; integers may be strings. Every validator raises
    :class:`ControlError` with the one line ``replicator.failed`` gets; unknown keys
    are kept (``model_extra``) for the warnings. :meth:`job_spec` makes the
    :class:`JobSpec` (explicit ``peer-ranks`` win over ``peers-per-node``).
    """

    # built on first use: a daemon starts without paying for a model it may not need yet
    model_config = ConfigDict(extra="allow", frozen=True, defer_build=True)

    job_name: Annotated[str, BeforeValidator(_job_name), Field(alias="job-name")]
    framework: Annotated[str, BeforeValidator(_framework)]
    nodes: Annotated[int, _int_of("nodes", 1)]
    node_rank: Annotated[int, Field(alias="node-rank")]
    peer_ranks: Annotated[list[int] | None, Field(alias="peer-ranks")] = None
    peers_per_node: Annotated[int | None, Field(alias="peers-per-node")] = None
    assume_data_parallelism: Annotated[int | None, Field(alias="assume-data-parallelism")] = None
    workers_per_node: Annotated[
        int, _int_of("workers-per-node", 1), Field(alias="workers-per-node")
    ] = 1
    master_port: Annotated[int, Field(alias="master-port")] = 4242
    backup_interval_minutes: Annotated[float | None, Field(alias="backup-interval-minutes")] = None
    backup_interval_steps: Annotated[int | None, Field(alias="backup-interval-steps")] = None

    @model_validator(mode="before")
    @classmethod
    def check_required(cls, data: Any) -> Any:
        """The four keys MTC always writes are there and not empty."""
        return _required(data)

    @field_validator("node_rank", mode="before")
    @classmethod
    def check_rank(cls, value: Any, info: ValidationInfo) -> int:
        rank = _as_int("node-rank", value)
        nodes = _nodes_of(info)
        if nodes is not None and rank >= nodes:
            raise ControlError(f"node-rank {rank} must be < nodes {nodes}")
        return rank

    @field_validator("peer_ranks", mode="before")
    @classmethod
    def check_peer_ranks(cls, value: Any, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, list):
            # PROTOCOL.md: a list (flow `[1, 2]` or block style). A scalar (`0`, `'[0]'`,
            # `1,2`) is not one, whatever it spells: refused like any malformed value.
            raise ControlError(f"peer-ranks must be a list of ranks such as [1, 2], got {value!r}")
        ranks = [_as_int("peer-ranks", p) for p in value]
        nodes = _nodes_of(info)
        for p in ranks:
            if nodes is not None and p >= nodes:
                raise ControlError(f"peer rank {p} must be < nodes {nodes}")
        return ranks

    @field_validator("peers_per_node", mode="before")
    @classmethod
    def check_peers_per_node(cls, value: Any) -> int | None:
        return None if value is None else _as_int("peers-per-node", value)

    @field_validator("assume_data_parallelism", mode="before")
    @classmethod
    def check_data_parallelism(cls, value: Any, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        dp = _as_int("assume-data-parallelism", value, minimum=1)
        nodes = _nodes_of(info)
        if nodes is not None and nodes % dp:
            raise ControlError(f"assume-data-parallelism {dp} must divide nodes {nodes}")
        return dp

    @field_validator("master_port", mode="before")
    @classmethod
    def check_master_port(cls, value: Any) -> int:
        port = _as_int("master-port", value, minimum=1)
        if port > 65535:
            raise ControlError(f"master-port {port} is out of range")
        return port

    @field_validator("backup_interval_minutes", mode="before")
    @classmethod
    def check_minutes(cls, value: Any) -> float | None:
        return None if value is None else _as_number("backup-interval-minutes", value)

    @field_validator("backup_interval_steps", mode="before")
    @classmethod
    def check_steps(cls, value: Any) -> int | None:
        return None if value is None else _as_int("backup-interval-steps", value, minimum=1)

    def job_spec(self, unset: Sequence[str] = ()) -> JobSpec:
        """The :class:`JobSpec`, with one warning per unknown key (ten at most, then a
        count), per ``$VAR`` in ``unset`` and for own or repeated peer ranks."""
        rank = self.node_rank
        peer_ranks = (
            tuple(dict.fromkeys(p for p in self.peer_ranks if p != rank))
            if self.peer_ranks is not None
            else None
        )
        unknown = list(self.model_extra or {})
        warnings = tuple(f"replicator.yaml: unknown key {k!r} ignored" for k in unknown[:10])
        if len(unknown) > 10:
            warnings += (f"replicator.yaml: {len(unknown) - 10} more unknown keys ignored",)
        warnings += tuple(
            f"replicator.yaml: ${name} is not set in the node daemon's environment; used literally"
            for name in unset
        )
        if peer_ranks is not None and len(peer_ranks) < len(self.peer_ranks or []):
            warnings += (
                f"replicator.yaml: peer-ranks lists this node's own rank {rank} or a "
                "rank twice; ignored",
            )
        return JobSpec(
            name=self.job_name,
            framework=self.framework,
            node_rank=rank,
            nodes=self.nodes,
            peer_ranks=peer_ranks,
            peers_per_node=self.peers_per_node
            if self.peers_per_node is not None
            else (len(peer_ranks) if peer_ranks is not None else 0),
            assume_data_parallelism=self.assume_data_parallelism,
            backup_interval_minutes=self.backup_interval_minutes,
            backup_interval_steps=self.backup_interval_steps,
            workers_per_node=self.workers_per_node,
            master_port=self.master_port,
            warnings=warnings,
        )


#: the keys of ``replicator.yaml`` tierfs reads (others produce a warning)
KNOWN_KEYS = frozenset(str(f.alias or name) for name, f in ReplicatorYaml.model_fields.items())


def parse_replicator_yaml(text: str, env: dict[str, str] | None = None) -> JobSpec | None:
    """Parse the content of ``replicator.yaml`` (through :class:`ReplicatorYaml`).

    Accepts what Orbax writes (flow lists, no trailing newline) and what the
    NeMo helper writes (block style); ``$VAR`` references are expanded from
    ``env``; integers may arrive as strings. If both ``peer-ranks`` and
    ``peers-per-node`` are given, the explicit ranks win (the NeMo helper
    sends both; docs/CLIENTS.md section 4).

    Returns:
        The job, or None for an empty file (PROTOCOL.md section 2: reset).

    Raises:
        ControlError: bad YAML (aliases included), not a mapping, missing key,
            a job-name over :data:`MAX_JOB_NAME` bytes, unknown framework,
            rank outside [0, nodes), negative or non-integer numbers.
    """
    if not text.strip():
        return None
    try:
        raw = yaml.load(text, Loader=_ControlLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ControlError(f"replicator.yaml is not valid YAML: {detail}") from None
    except RecursionError:
        raise ControlError("replicator.yaml is not valid YAML: nested too deeply") from None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ControlError(f"replicator.yaml must be a mapping, got {type(raw).__name__}")
    env = dict(os.environ if env is None else env)
    unset = sorted({name for v in raw.values() for name in _var_names(v) if name not in env})
    data = {str(k): expand_vars(v, env) for k, v in raw.items()}
    try:
        model = ReplicatorYaml.model_validate(data)
    except ValidationError as exc:
        raise _control_error(exc) from None
    return model.job_spec(unset)


def _control_error(exc: ValidationError) -> ControlError:
    """The first error of a :class:`ReplicatorYaml` validation as one ControlError."""
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ControlError):
        return cause
    key = ".".join(str(p) for p in err["loc"]) or "replicator.yaml"
    return ControlError(f"replicator.yaml: {key}: {err['msg']}")


def marker_name(job: str, step: int, node: int, worker: int = 0) -> str:
    """``<job>-s<step>-n<node>-w<worker>.restore`` (PROTOCOL.md section 4)."""
    return f"{job}-s{step}-n{node}-w{worker}.restore"


def parse_marker(name: str) -> tuple[str, int, int, int] | None:
    """(job, step, node, worker) of a marker name, or None."""
    m = MARKER_RE.match(name)
    if not m:
        return None
    return m["job"], int(m["step"]), int(m["node"]), int(m["worker"])


def prerestore_text(step: int | None, backup: str | None = None) -> str:
    """Content of ``replicator.prerestore``: a YAML mapping with sorted keys, never empty.

    ``{}`` when there is nothing to restore (step None or 0); ``restore-backup``
    names the GCS round when the data comes from the bucket.
    """
    if not step:
        return "{}\n"
    data: dict[str, Any] = {"restore-step": int(step)}
    if backup:
        data["restore-backup"] = backup
    return yaml.safe_dump(data, sort_keys=True, default_flow_style=False)


def jax_init_info_text(process_id: int, coordinator: str) -> str:
    """Content of ``jax-init-info.txt``: ``<process_id>\\n<host>:<port>\\n``."""
    return f"{int(process_id)}\n{coordinator}\n"


def atomic_write(directory: str, name: str, data: bytes, mode: int = 0o644) -> str:
    """Write ``directory/name`` through a temp name and a rename; returns the path.

    Raises:
        OSError: from the underlying calls (ENOSPC, EACCES...).
    """
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tierfs-tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


def error_line(message: str, *, job: str | None = None, rank: int | None = None) -> str:
    """One line for ``replicator.errors``/``replicator.failed``: UTC time, context, message."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    ctx = f"job={job} node={rank}" if job is not None else "tierfs"
    flat = " ".join(str(message).split())
    return f"{stamp} {ctx}: {flat}\n"


def append_line(directory: str, name: str, line: str) -> None:
    """Append one line to ``directory/name`` (created if missing)."""
    fd = os.open(
        os.path.join(directory, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
    )
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
