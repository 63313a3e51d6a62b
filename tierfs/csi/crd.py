"""The model of a ``CheckpointConfiguration``'s spec (``checkpointing.tierfs.dev/v1``).

Two kinds of fields (``deploy/base/crd-checkpointconfiguration.yaml`` is the
CRD; a test keeps its properties and this model equal):

- node settings (``inMemoryVolumeSize``, ``cloudStorageBucketName``,
  ``mountOptions``, ``keepLocal``, ``backupIntervalMinutes``, ``logLevel``):
  the fields whose :class:`~tierfs.core.schema.Where` in
  :class:`tierfs.core.config.NodeConfig` names them; each is validated by that
  setting's own type (a size in the strict Kubernetes form) and becomes that
  setting's flag of ``tierfs csi``;
- the DaemonSet's own: ``peerPort``, ``nodeSelector``, ``tolerations``, ``extraArgs``
  (:class:`PodFields`).

Unknown fields are ignored (the API server prunes them from a structural CRD's objects).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierfs.core import node_config as config
from tierfs.core import schema
from tierfs.core.errors import ConfigurationError
from tierfs.core.schema import NoBool, SettingField

__all__ = ["SETTINGS", "CrdError", "PodFields", "Spec", "parse_spec"]


class CrdError(ConfigurationError, ValueError):
    """A spec field is missing, of the wrong type or out of range; the message names it
    (``spec.keepLocal must be >= 1, got 0``)."""


#: the CRD fields that are node settings, in the order the CRD lists them
#: (and the DaemonSet's ``tierfs csi`` arguments follow)
_ORDER = (
    "inMemoryVolumeSize",
    "cloudStorageBucketName",
    "mountOptions",
    "keepLocal",
    "backupIntervalMinutes",
    "logLevel",
)
#: CRD field -> the node setting it gives
SETTINGS: dict[str, SettingField] = {
    f.where.crd: f
    for f in sorted(
        (f for f in config.FIELDS if f.where.crd), key=lambda f: _ORDER.index(f.where.crd or "")
    )
    if f.where.crd
}


class PodFields(BaseModel):
    """The spec fields of the DaemonSet itself (no node setting)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, defer_build=True)

    peer_port: Annotated[int | None, NoBool, Field(alias="peerPort", ge=1, le=65535)] = None
    node_selector: Annotated[dict[str, str], Field(alias="nodeSelector")] = {}
    tolerations: list[dict[str, Any]] = []
    extra_args: Annotated[list[str], Field(alias="extraArgs")] = []


@dataclass(frozen=True)
class Spec:
    """A validated spec.

    Attributes:
        name: ``metadata.name``.
        size_text: ``spec.inMemoryVolumeSize`` as written (the emptyDir's ``sizeLimit``).
        size: the same in bytes.
        settings: CRD field -> (the setting, the value as written), given fields only,
            in the CRD's order.
        pod: the DaemonSet's own fields.
    """

    name: str
    size_text: str
    size: int
    settings: tuple[tuple[SettingField, Any], ...]
    pod: PodFields

    def node_flags(self) -> list[str]:
        """The ``tierfs csi`` arguments of the node settings (``--size`` in bytes first)."""
        args = [f"--size={self.size}"]
        for setting, raw in self.settings:
            if setting.name == "size":
                continue
            flag = setting.option
            if setting.where.multiple:
                for item in raw:
                    args += [str(flag), str(item)]
            else:
                args.append(f"{flag}={raw}")
        return args


def _pod_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else "spec"
    return schema.error_message(err, f"spec.{field}", item=len(err["loc"]) > 1)


def _check_bucket(value: Any) -> None:
    if not isinstance(value, str) or value.startswith("gs://"):
        raise CrdError(
            "spec.cloudStorageBucketName must be a bucket name (NAME or NAME/PREFIX, without gs://)"
        )


def _check_mount_options(value: Any) -> None:
    for opt in value if isinstance(value, list) else [value]:
        if not isinstance(opt, str) or not opt or " " in opt:
            raise CrdError(f"spec.mountOptions: bad option {opt!r}")


def parse_spec(name: str, spec: Mapping[str, Any]) -> Spec:
    """Validate ``spec`` of the configuration ``name``.

    Raises:
        CrdError: naming the first bad field (``spec.inMemoryVolumeSize is required``).
    """
    if not spec.get("inMemoryVolumeSize"):
        raise CrdError("spec.inMemoryVolumeSize is required")
    given: list[tuple[SettingField, Any]] = []
    size = 0
    for field, setting in SETTINGS.items():
        raw = spec.get(field)
        if raw is None:
            continue
        if field == "cloudStorageBucketName":
            _check_bucket(raw)
        if field == "mountOptions":
            _check_mount_options(raw)
        value = schema.parse_value(
            config.NodeConfig,
            setting.name,
            raw,
            f"spec.{field}",
            CrdError,
            context={"kubernetes": True},
        )
        if setting.name == "size":
            size = int(value)
        given.append((setting, raw))
    try:
        pod = PodFields.model_validate({k: v for k, v in spec.items() if v is not None})
    except ValidationError as exc:
        raise CrdError(_pod_error(exc)) from None
    return Spec(name, str(spec["inMemoryVolumeSize"]), size, tuple(given), pod)
