"""The machinery of the node's settings schema: where a setting is given, and the
messages of bad values.

A node setting is one field of a pydantic model (:class:`tierfs.core.config.NodeConfig`):
its name, type, default, constraints and doc are the field's; a :class:`Where`
in its ``Annotated`` metadata says where it can be given: a ``tierfs mount`` /
``tierfs csi`` flag, config-file keys, a ``CheckpointConfiguration`` spec field,
a CSI volume attribute, a ``TIERFS_*`` variable. Everything else is derived
from that one declaration: the click options (:mod:`tierfs.cli.options`), the
config-file key table, the CRD fields (:mod:`tierfs.csi.crd`), the README
table (:func:`markdown_table`).

A bad value is one line naming how it was given (its *origin*: ``--keep-local``,
``keepLocal in /etc/tierfs.yaml``, ``spec.keepLocal``, ``volume attribute
jaxProcessId``) and what it must be (:func:`error_message`). Field validators
find their origin in the validation context (:func:`origin_of`).

Pure: no I/O; pydantic is the only dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, TypeAdapter, ValidationError, ValidationInfo
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticUndefined

from tierfs.core.config import ConfigError

__all__ = [
    "ConfigError",
    "NoBool",
    "SettingField",
    "Where",
    "error_message",
    "fields_of",
    "origin_of",
    "parse_value",
    "validate_model",
]

M = TypeVar("M", bound=BaseModel)


#: how a secret's value appears in an error
REDACTED = "<redacted>"


@dataclass(frozen=True)
class Where:
    """Where a node setting can be given (``Annotated`` metadata of a model field).

    Attributes:
        flag: the ``tierfs mount``/``tierfs csi`` option (``--keep-local``), or None.
        short: a short flag instead of ``flag`` (``-o``).
        dest: the click parameter name (default: the field name).
        metavar: the flag's metavar in ``--help``.
        multiple: the flag repeats (its values are a list).
        list_sep: a flag value is a ``list_sep``-separated list (``--peer-ranks 1,2``).
        accumulate: flag values are appended to the config file's, not replacing them.
        keys: config-file keys, the first is the one documented; more are aliases.
        crd: the ``CheckpointConfiguration`` spec field, or None.
        csi: the CSI volume attribute, or None.
        env: the ``TIERFS_*`` variable read when neither a flag nor a key gives it.
        unit: ``bytes``, ``s``, ``min`` or ``""``.
        default_doc: how ``--help`` and the README show the default (else the default).
        secret: the value never appears in an error or a log.
    """

    flag: str | None = None
    short: str | None = None
    dest: str | None = None
    metavar: str | None = None
    multiple: bool = False
    list_sep: str | None = None
    accumulate: bool = False
    keys: tuple[str, ...] = ()
    crd: str | None = None
    csi: str | None = None
    env: str | None = None
    unit: str = ""
    default_doc: str | None = None
    secret: bool = False


@dataclass(frozen=True)
class SettingField:
    """One field of a settings model as the derived places see it.

    Attributes:
        name: the model attribute.
        where: where it can be given.
        doc: one or more sentences (the field's description), ending with a period.
        default: the default value (None when it has none or it is None).
        info: the pydantic field.
    """

    name: str
    where: Where
    doc: str
    default: Any
    info: FieldInfo

    @property
    def dest(self) -> str:
        """The click parameter name."""
        return self.where.dest or self.name

    @property
    def option(self) -> str | None:
        """The flag as written (``--size``, ``-o``), or None."""
        return self.where.short or self.where.flag

    def shown_default(self) -> str | None:
        """The default as ``--help`` and the README show it, or None (no default worth
        showing: unset, empty, a list)."""
        if self.where.default_doc is not None:
            return self.where.default_doc
        value = self.default
        if value is None or value == "" or isinstance(value, (list, tuple, bool)):
            return None
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    def help(self) -> str:
        """The ``--help`` text: the doc with the default (and the variable read when the
        flag is not given) before its last period."""
        shown = self.shown_default()
        extras = [f"default: {shown}"] if shown is not None else []
        if self.where.env:
            extras.append(f"or ${self.where.env}")
        if not extras:
            return self.doc
        return f"{self.doc.removesuffix('.')} ({'; '.join(extras)})."


@cache
def _fields_cached(model: type[BaseModel]) -> tuple[SettingField, ...]:
    out = []
    for name, info in model.model_fields.items():
        where = next((m for m in info.metadata if isinstance(m, Where)), None)
        if where is None:
            continue
        default = None if info.default is PydanticUndefined else info.default
        if info.default_factory is not None:
            default = info.default_factory()  # type: ignore[call-arg]
        out.append(SettingField(name, where, info.description or "", default, info))
    return tuple(out)


def fields_of(model: type[BaseModel]) -> tuple[SettingField, ...]:
    """The settings of ``model`` (its fields with a :class:`Where`), in declaration order."""
    return _fields_cached(model)


def origin_of(info: ValidationInfo) -> str:
    """How the value being validated was given (``--size``, ``size in FILE``), from the
    validation context (``{"origins": {field: origin}, "origin": default}``); the field
    name when there is no context."""
    ctx = info.context if isinstance(info.context, Mapping) else {}
    origins = ctx.get("origins") or {}
    if info.field_name is not None and info.field_name in origins:
        return str(origins[info.field_name])
    return str(ctx.get("origin") or info.field_name or "value")


def _no_bool(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{origin_of(info)} must be a number, got {value!r}")
    return value


#: a number field that refuses ``true``/``false`` (pydantic's lax mode reads them as 1/0)
NoBool = BeforeValidator(_no_bool)


def _shown(value: Any, secret: bool) -> str:
    if secret:
        return REDACTED
    return repr(value) if isinstance(value, str) else str(value)


_PHRASES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "missing": lambda c: "is required",
    "int_parsing": lambda c: "must be an integer",
    "int_type": lambda c: "must be an integer",
    "int_from_float": lambda c: "must be an integer",
    "float_parsing": lambda c: "must be a number",
    "float_type": lambda c: "must be a number",
    "finite_number": lambda c: "must be a finite number",
    "string_type": lambda c: "must be a string",
    "bool_type": lambda c: "must be true or false",
    "bool_parsing": lambda c: "must be true or false",
    "list_type": lambda c: "must be a list",
    "dict_type": lambda c: "must be a mapping",
    "literal_error": lambda c: f"must be one of {c.get('expected')}",
    "greater_than_equal": lambda c: f"must be >= {c.get('ge')}",
    "greater_than": lambda c: f"must be > {c.get('gt')}",
    "less_than_equal": lambda c: f"must be <= {c.get('le')}",
    "less_than": lambda c: f"must be < {c.get('lt')}",
    "extra_forbidden": lambda c: "is not a known key",
}


def error_message(
    err: ErrorDetails, origin: str, *, secret: bool = False, item: bool = False
) -> str:
    """One line for one pydantic error of a value given as ``origin``.

    A ``ValueError`` raised by a validator carries its own whole message (validators
    name their origin through :func:`origin_of`); any other error becomes
    ``<origin> must be <what>, got <value>`` (a secret's value redacted).

    Args:
        err: one of ``ValidationError.errors()``.
        origin: ``--keep-local``, ``keepLocal in FILE``, ``spec.keepLocal``.
        secret: never show the value.
        item: the error is about one item of a list (its index is named).
    """
    ctx = err.get("ctx") or {}
    if err["type"] == "value_error" and "error" in ctx:
        return str(ctx["error"])
    phrased = _PHRASES.get(err["type"])
    phrase = phrased(ctx) if phrased is not None else err["msg"].lower()
    where = origin
    if item:
        index = next((p for p in reversed(err["loc"]) if isinstance(p, int)), None)
        if index is not None:
            where = f"{origin}[{index}]"
    if err["type"] == "missing":
        return f"{where} {phrase}"
    return f"{where} {phrase}, got {_shown(err['input'], secret)}"


def validate_model(
    model: type[M],
    data: Mapping[str, Any],
    origins: Mapping[str, str],
    error: Callable[[str], Exception],
    context: Mapping[str, Any] | None = None,
) -> M:
    """``model`` of ``data`` (field names as keys).

    Args:
        origins: field name -> how it was given, for the messages.
        error: makes the exception raised (``ConfigError``, ``RenderError``...).
        context: more validation context (e.g. ``{"kubernetes": True}``).

    Raises:
        what ``error`` makes: naming the first bad setting by its origin.
    """
    try:
        return model.model_validate(dict(data), context={**(context or {}), "origins": origins})
    except ValidationError as exc:
        raise error(_first_message(model, exc, origins)) from None


def _first_message(model: type[BaseModel], exc: ValidationError, origins: Mapping[str, str]) -> str:
    secrets = {f.name for f in fields_of(model) if f.where.secret}
    err = exc.errors()[0]
    loc = err["loc"]
    name = str(loc[0]) if loc else ""
    origin = origins.get(name, name)
    return error_message(err, origin, secret=name in secrets, item=len(loc) > 1)


@cache
def _adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    info = model.model_fields[name]
    annotated: Any = Annotated[info.annotation, *info.metadata]
    return TypeAdapter(annotated)


def parse_value(
    model: type[BaseModel],
    name: str,
    value: Any,
    origin: str,
    error: Callable[[str], Exception],
    context: Mapping[str, Any] | None = None,
) -> Any:
    """One setting's value, validated by its field's type and constraints alone
    (what a CRD field or a CSI volume attribute gives for it).

    Raises:
        what ``error`` makes: ``<origin> must be ..., got ...``.
    """
    secret = any(f.where.secret for f in fields_of(model) if f.name == name)
    try:
        return _adapter(model, name).validate_python(
            value, context={**(context or {}), "origin": origin}
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        raise error(error_message(err, origin, secret=secret, item=bool(err["loc"]))) from None


def markdown_table(model: type[BaseModel]) -> str:
    """The README's table of ``model``'s settings: flag, config-file keys,
    CheckpointConfiguration field, CSI volume attribute, variable, default, unit, doc."""

    def code(*names: str | None) -> str:
        shown = [f"`{n}`" for n in names if n]
        return ", ".join(shown) or "-"

    lines = [
        "| flag | config file | CheckpointConfiguration | CSI volume attribute "
        "| default | unit | meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in fields_of(model):
        w = f.where
        flag = code(f.option) if not w.env else f"{code(f.option)} (or `${w.env}`)"
        crd = code(f"spec.{w.crd}" if w.crd else None)
        default = f.shown_default()
        lines.append(
            f"| {flag} | {code(*w.keys)} | {crd} | {code(w.csi)} | "
            f"{default if default is not None else '-'} | {w.unit or '-'} | "
            f"{f.doc.replace('|', '&#124;')} |"
        )
    return "\n".join(lines) + "\n"
