"""The ``tierfs mount``/``tierfs csi`` options, derived from the node settings schema.

Each :class:`tierfs.core.config.NodeConfig` field with a flag becomes one click
option: its flag, metavar and ``--help`` text (the field's doc and default) come
from the schema, its click type from the field's type. Click defaults are never
set (a default would hide a ``--config`` value); the values are validated by
:func:`tierfs.core.config.build_config`, which names the flag. Integer and number
flags keep click's own type check, so a non-number is a usage error (exit 2) as
before.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import click

from tierfs.core.config import FIELDS, LOG_LEVELS
from tierfs.core.schema import SettingField

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["mount_options", "option_of"]


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


def _click_type(f: SettingField) -> Any:
    if f.name == "log_level":
        return click.Choice(LOG_LEVELS, case_sensitive=False)
    if f.where.multiple or f.where.list_sep or f.where.unit == "bytes":
        return None  # text; the schema parses it
    base = _base_type(f.info.annotation)
    return base if base in (int, float) else None


def option_of(f: SettingField) -> click.Option:
    """The click option of one setting (it must have a flag)."""
    assert f.option is not None, f.name
    return click.Option(
        [f.option, f.dest],
        type=_click_type(f),
        multiple=f.where.multiple,
        metavar=f.where.metavar,
        help=f.help(),
    )


def _config_option() -> click.Option:
    return click.Option(
        ["--config"], type=click.Path(dir_okay=False), help="YAML config file (flags win)."
    )


def mount_options(f: F) -> F:
    """Add the options shared by ``tierfs mount`` and ``tierfs csi`` to a click command
    function (before ``@click.command``): every setting with a flag, plus ``--config``
    after ``-o``, in the schema's order."""
    params: list[click.Option] = []
    for setting in FIELDS:
        if setting.option is None:
            continue
        params.append(option_of(setting))
        if setting.name == "mount_options":
            params.append(_config_option())
    # click.option appends to __click_params__ and reverses them at command creation
    existing: list[click.Parameter] = list(getattr(f, "__click_params__", []))
    f.__click_params__ = existing + list(reversed(params))  # type: ignore[attr-defined]
    return f
