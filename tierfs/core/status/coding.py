"""The JSON coding the status types share: the object type, the format error and the
lenient readers (a key missing or of the wrong kind becomes a default, never an error)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierfs.core.errors import ProtocolError

__all__ = ["JsonObject", "StatusFormatError", "obj", "objs", "strs", "with_optional"]

#: a JSON object as ``json.loads`` returns it
JsonObject = dict[str, Any]


class StatusFormatError(ProtocolError, ValueError):
    """A status (or a part of it) that is not a JSON object (a ``ValueError``, as a
    JSON decoding error is: readers catch both in one ``except ValueError``)."""


def obj(data: object, what: str) -> Mapping[str, Any]:
    """``data`` as a JSON object; raises :class:`StatusFormatError` if it is none."""
    if not isinstance(data, Mapping):
        raise StatusFormatError(f"{what} is not a JSON object: {type(data).__name__}")
    return data


def objs(data: object) -> list[Mapping[str, Any]]:
    """The JSON objects of a list (anything else in it, or a non-list, is dropped)."""
    if not isinstance(data, list | tuple):
        return []
    return [d for d in data if isinstance(d, Mapping)]


def strs(data: object) -> tuple[str, ...]:
    return tuple(str(x) for x in data) if isinstance(data, list | tuple) else ()


def with_optional(out: JsonObject, **optional: Any) -> JsonObject:
    """``out`` plus the ``optional`` keys whose value is not None (keys today's JSON
    has only in some states)."""
    out.update({k: v for k, v in optional.items() if v is not None})
    return out
