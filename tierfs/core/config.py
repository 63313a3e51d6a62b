"""Node configuration: errors, sizes and addresses; the settings schema, lazily.

The schema of a node's settings (:class:`NodeConfig`, :data:`FIELDS`,
:data:`FILE_KEYS`, :func:`build_config`, :func:`load_config_file`,
:func:`markdown_table`) lives in :mod:`tierfs.core.node_config`, which imports
pydantic; the names are re-exported here on first use (PEP 562), so importing
this module (every command does) stays cheap. ``python -m tierfs.core.config``
prints the README's table of the settings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierfs.core import sizes
from tierfs.core.errors import ConfigurationError

if TYPE_CHECKING:
    from tierfs.core.node_config import (
        FIELDS,
        FILE_KEYS,
        NodeConfig,
        build_config,
        load_config_file,
        markdown_table,
        read_config_file,
    )

__all__ = [
    "DEFAULT_SEAL_PATTERNS",
    "FIELDS",
    "FILE_KEYS",
    "LOG_LEVELS",
    "MIN_SIZE",
    "ConfigError",
    "NodeConfig",
    "build_config",
    "format_size",
    "load_config_file",
    "markdown_table",
    "parse_hostport",
    "parse_size",
    "read_config_file",
]

#: the names :mod:`tierfs.core.node_config` defines
_SCHEMA_NAMES = frozenset(
    {
        "FIELDS",
        "FILE_KEYS",
        "NodeConfig",
        "build_config",
        "load_config_file",
        "markdown_table",
        "read_config_file",
    }
)


class ConfigError(ConfigurationError, ValueError):
    """A setting is missing, malformed or out of range; the message names it (by its
    flag, its key and file, its CRD field or its variable)."""


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
#: the daemon's log levels
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def __getattr__(name: str) -> Any:
    """The schema's names, from :mod:`tierfs.core.node_config` on first use."""
    if name in _SCHEMA_NAMES:
        return getattr(importlib.import_module("tierfs.core.node_config"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    import importlib

    print(importlib.import_module("tierfs.core.node_config").markdown_table(), end="")
