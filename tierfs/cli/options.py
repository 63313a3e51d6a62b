"""The ``tierfs mount``/``tierfs csi`` options, derived from the node settings schema.

Each :class:`tierfs.core.node_config.NodeConfig` field with a flag becomes one click
option: its flag, metavar and ``--help`` text (the field's doc and default) come
from the schema, its click type from the field's type. Click defaults are never
set (a default would hide a ``--config`` value); the values are validated by
:func:`tierfs.core.node_config.build_config`, which names the flag. Integer and
number flags keep click's own type check, so a non-number is a usage error (exit 2)
as before.

The schema imports pydantic, which would double the start time of every command
(``tierfs --help``, ``status``, ``wait`` need no settings). So :func:`mount_options`
puts a placeholder among a command's parameters and :class:`SchemaCommand` turns it
into the options when the command is first parsed or shown.
"""

from __future__ import annotations

import importlib
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tierfs.core.config import LOG_LEVELS

if TYPE_CHECKING:
    from tierfs.core.schema import SettingField

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["SchemaCommand", "mount_options", "option_of", "schema_params"]


def _base_type(annotation: Any) -> Any:
    """The scalar type under ``Annotated[...]`` and ``X | None``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0]
        else:
            return annotation


def _click_type(f: SettingField, log_levels: tuple[str, ...]) -> Any:
    if f.name == "log_level":
        return click.Choice(log_levels, case_sensitive=False)
    if f.where.multiple or f.where.list_sep or f.where.unit == "bytes":
        return None  # text; the schema parses it
    base = _base_type(f.info.annotation)
    return base if base in (int, float) else None


def option_of(f: SettingField, log_levels: tuple[str, ...] = ()) -> click.Option:
    """The click option of one setting (it must have a flag)."""
    assert f.option is not None, f.name
    return click.Option(
        [f.option, f.dest],
        type=_click_type(f, log_levels),
        multiple=f.where.multiple,
        metavar=f.where.metavar,
        help=f.help(),
    )


def schema_params() -> list[click.Parameter]:
    """The options of every setting with a flag, plus ``--config`` after ``-o``, in the
    schema's order (imports the schema, and so pydantic)."""
    schema = importlib.import_module("tierfs.core.node_config")
    params: list[click.Parameter] = []
    for setting in schema.FIELDS:
        if setting.option is None:
            continue
        params.append(option_of(setting, LOG_LEVELS))
        if setting.name == "mount_options":
            params.append(
                click.Option(
                    ["--config"],
                    type=click.Path(dir_okay=False),
                    help="YAML config file (flags win).",
                )
            )
    return params


class _Placeholder(click.Option):
    """Where :class:`SchemaCommand` puts the schema's options."""

    def __init__(self) -> None:
        super().__init__(["--tierfs-settings-placeholder"], hidden=True, expose_value=False)


class SchemaCommand(click.Command):
    """A click command whose node-setting options are made on first use (see the module
    doc); otherwise a plain :class:`click.Command`."""

    @property
    def params(self) -> list[click.Parameter]:
        """The parameters, the placeholder replaced by :func:`schema_params`."""
        found = [i for i, p in enumerate(self._params) if isinstance(p, _Placeholder)]
        for i in reversed(found):
            self._params[i : i + 1] = schema_params()
        return self._params

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        self._params = list(value)


def mount_options(f: F) -> F:
    """Add the options shared by ``tierfs mount`` and ``tierfs csi`` to a click command
    function (the command must be made with ``cls=SchemaCommand``)."""
    existing: list[click.Parameter] = list(getattr(f, "__click_params__", []))
    f.__click_params__ = [*existing, _Placeholder()]  # type: ignore[attr-defined]
    return f
