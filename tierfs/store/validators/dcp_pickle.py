"""Reading a torch.distributed.checkpoint ``.metadata`` pickle without running it.

``FileSystemWriter.finish`` writes ``pickle.dump(Metadata)``
(torch/distributed/checkpoint/filesystem.py); ``storage_data`` maps each
``MetadataIndex`` to a ``_StorageInfo(relative_path, offset, length)``. Plain
``pickle.loads`` on user bytes would run whatever callable the bytes name, so
:class:`MetadataUnpickler` never returns a real class or function for a
global: every allowed global becomes an inert :class:`Placeholder` subclass
that only stores the arguments and state it is given, and globals outside the
modules DCP metadata uses (``torch.*``, ``pathlib``, a few value builtins) are
refused. torch is never imported, so this works whether or not torch is
installed, and no torch version's classes need to match.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierfs.core.errors import StorageError

#: value constructors that are safe to call with any arguments
_SAFE_BUILTINS: dict[str, Callable[..., Any]] = {
    "set": set,
    "frozenset": frozenset,
    "tuple": tuple,
    "list": list,
    "dict": dict,
    "int": int,
    "float": float,
    "complex": complex,
    "bool": bool,
    "str": str,
    "slice": slice,
}

#: module prefixes whose globals DCP metadata may name (as placeholders)
_PLACEHOLDER_MODULES = ("torch", "pathlib", "enum", "collections")


class UnsafeMetadata(StorageError, pickle.UnpicklingError):
    """The pickle names a global that DCP metadata never contains."""


class Placeholder:
    """An inert stand-in for a class named in the pickle.

    ``args`` holds constructor/reduce arguments, ``state`` the state given to
    ``__setstate__``; a dict state also becomes attributes (``__dict__``).
    """

    qualname = "?"
    args: tuple[Any, ...] = ()
    state: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Placeholder:
        obj = super().__new__(cls)
        obj.args = args  # NEWOBJ calls only __new__
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = state[0] if isinstance(state[0], dict) else state[1]  # (dict, slots)
        if isinstance(state, dict):
            for key, value in state.items():
                if isinstance(key, str) and not key.startswith("__"):
                    object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        return f"<{self.qualname} {self.__dict__!r}>"


def _placeholder(module: str, name: str) -> type[Placeholder]:
    return type(name, (Placeholder,), {"qualname": f"{module}.{name}"})


def _size(*args: Any) -> tuple[Any, ...]:
    """``torch.Size(seq)`` as a plain tuple."""
    return tuple(args[0]) if args else ()


def _layout(name: Any) -> str:
    """``torch.serialization._get_layout('torch.strided')`` as its name."""
    return str(name)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` (protocols 0/1), for placeholders only."""
    if not (isinstance(cls, type) and issubclass(cls, Placeholder)):
        raise UnsafeMetadata("copyreg._reconstructor of a non-placeholder")
    return cls()


def _bytes_of(value: Any = b"", *rest: Any) -> bytes:
    """``bytes``/``bytearray`` of existing bytes only (``bytearray(10**12)`` would allocate)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and rest and rest[0] in ("latin1", "latin-1"):
        return value.encode("latin-1")
    raise UnsafeMetadata("bytes() of something other than bytes")


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it for bytes (latin-1 only)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafeMetadata("_codecs.encode outside bytes pickling")
    return text.encode("latin-1")


class MetadataUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` whose globals are placeholders or value builtins."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._classes: dict[tuple[str, str], type[Placeholder]] = {}

    def find_class(self, module: str, name: str) -> Any:
        """Map a global to something inert.

        Raises:
            UnsafeMetadata: a global outside what DCP metadata uses.
        """
        if module == "builtins" and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        if (module, name) == ("torch", "Size"):
            return _size
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if (module, name) == ("copyreg", "_reconstructor"):
            return _reconstructor
        if (module, name) in (("_codecs", "encode"), ("codecs", "encode")):
            return _encode
        if module == "builtins" and name in ("bytes", "bytearray"):
            return _bytes_of
        if module == "collections" and name == "OrderedDict":
            return dict
        top = module.split(".", 1)[0]
        if top in _PLACEHOLDER_MODULES and name.isidentifier():
            key = (module, name)
            if key not in self._classes:
                self._classes[key] = _placeholder(module, name)
            return self._classes[key]
        raise UnsafeMetadata(f"names {module}.{name}, which DCP metadata never does")

    def persistent_load(self, pid: Any) -> Any:
        """DCP metadata has no persistent ids.

        Raises:
            UnsafeMetadata: always.
        """
        raise UnsafeMetadata("has a persistent id (a tensor pickle, not DCP metadata)")


@dataclass(frozen=True, slots=True)
class StorageRef:
    """One byte range ``.metadata`` names: file relative to the checkpoint dir, offset, length."""

    fqn: str
    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    """What the judgement needs from ``.metadata``.

    Attributes:
        refs: every storage entry, in pickle order.
        fqns: every state-dict key ``state_dict_metadata`` declares.
        version: ``Metadata.version`` (``"1.0.0"`` in torch 2.13), or None.
    """

    refs: tuple[StorageRef, ...]
    fqns: frozenset[str]
    version: str | None


class BadMetadata(StorageError, ValueError):
    """``.metadata`` is not a DCP ``Metadata`` pickle (the message says why)."""


def parse_metadata(data: bytes) -> DcpMetadata:
    """Parse ``.metadata`` bytes safely.

    Raises:
        BadMetadata: not a pickle, a refused global, or not shaped like DCP's
            ``Metadata`` (no ``storage_data`` dict of ``_StorageInfo``).
    """
    try:
        obj = MetadataUnpickler(data).load()
    except UnsafeMetadata as exc:
        raise BadMetadata(f"refused: {exc}") from None
    except RecursionError:
        raise BadMetadata("not a pickle (nested too deep)") from None
    except Exception as exc:  # any malformed pickle: EOFError, UnpicklingError, TypeError...
        raise BadMetadata(f"not a complete pickle ({type(exc).__name__}: {exc})"[:200]) from None
    if not isinstance(obj, Placeholder) or not obj.qualname.endswith(".Metadata"):
        raise BadMetadata(f"holds {type(obj).__name__}, not a DCP Metadata")
    storage = getattr(obj, "storage_data", None)
    if not isinstance(storage, dict):
        raise BadMetadata("has no storage_data mapping (not written by FileSystemWriter)")
    refs = []
    for key, info in storage.items():
        fqn = getattr(key, "fqn", None)
        path = getattr(info, "relative_path", None)
        offset = getattr(info, "offset", None)
        length = getattr(info, "length", None)
        if not (isinstance(path, str) and isinstance(offset, int) and isinstance(length, int)):
            raise BadMetadata(f"storage entry for {fqn!r} lacks relative_path/offset/length")
        if isinstance(offset, bool) or isinstance(length, bool):
            raise BadMetadata(f"storage entry for {fqn!r} has a boolean offset/length")
        refs.append(StorageRef(str(fqn), path, offset, length))
    sdm = getattr(obj, "state_dict_metadata", None)
    fqns = frozenset(k for k in sdm if isinstance(k, str)) if isinstance(sdm, dict) else frozenset()
    version = getattr(obj, "version", None)
    return DcpMetadata(tuple(refs), fqns, version if isinstance(version, str) else None)
