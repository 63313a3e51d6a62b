"""numpy ``.npy`` files: the header parses and the data it describes is all there.

The format (numpy ``numpy/lib/format.py``, ``read_magic`` and
``_read_array_header``; NEP 1): ``\\x93NUMPY``, a major/minor version byte pair,
the header length (2 bytes little-endian for version 1, 4 for 2 and 3), then a
Python dict literal with ``descr``, ``fortran_order`` and ``shape``. The data
follows: ``prod(shape) * itemsize`` bytes (``np.load`` fails on fewer, and a
memmap of a short file raises). Object arrays (pickled) and structured dtypes
are judged by their header only. numpy is not imported: the header is read
with :func:`ast.literal_eval` (literals only).
"""

from __future__ import annotations

import ast
import math
import re

from tierfs.core.errors import StorageError
from tierfs.store.validators.model import Findings, ReadFailed, StepFiles, read_bytes

MAGIC = b"\x93NUMPY"
#: numpy's own limit on the header (``_MAX_HEADER_SIZE``, raised with allow_pickle)
MAX_HEADER = 1 << 20
_DESCR = re.compile(r"^[<>|=]?(?P<kind>[biufcmMSUVaO?])(?P<size>\d*)(\[\w+\])?$")


class BadNpy(StorageError, ValueError):
    """The bytes are not a complete ``.npy`` array (the message says why)."""


def data_bytes(header: dict[str, object]) -> int | None:
    """Bytes of data an ``.npy`` header describes, or None when not computable."""
    shape = header.get("shape")
    descr = header.get("descr")
    if not isinstance(shape, tuple) or not all(isinstance(x, int) and x >= 0 for x in shape):
        raise BadNpy("header has no shape tuple")
    if not isinstance(descr, str):
        return None  # structured dtype: a list of fields
    m = _DESCR.match(descr)
    if not m:
        raise BadNpy(f"header has an unknown descr {descr!r}")
    kind, size = m["kind"], m["size"]
    if kind == "?":
        item = 1
    elif not size:
        return None  # e.g. 'O' never reaches here; a bare 'S'/'V' has no size
    else:
        item = int(size) * (4 if kind == "U" else 1)
    return math.prod(shape) * item


def parse_npy_header(head: bytes) -> tuple[int, dict[str, object]]:
    """Parse the start of an ``.npy`` file: (offset of the data, header dict).

    Raises:
        BadNpy: not the magic, a cut-off or malformed header.
    """
    if len(head) < 10 or head[:6] != MAGIC:
        raise BadNpy("does not start with the .npy magic")
    major = head[6]
    if major == 1:
        hlen, start = int.from_bytes(head[8:10], "little"), 10
    elif major in (2, 3):
        if len(head) < 12:
            raise BadNpy("header length is cut off")
        hlen, start = int.from_bytes(head[8:12], "little"), 12
    else:
        raise BadNpy(f"unknown .npy version {major}")
    if hlen > MAX_HEADER:
        raise BadNpy(f"header of {hlen} bytes is over numpy's limit")
    text = head[start : start + hlen]
    if len(text) < hlen:
        raise BadNpy("header is cut off")
    try:
        header = ast.literal_eval(text.decode("utf-8" if major == 3 else "latin-1"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        raise BadNpy("header is not a dict literal") from None
    if not isinstance(header, dict) or not {"descr", "shape", "fortran_order"} <= set(header):
        raise BadNpy("header lacks descr, shape or fortran_order")
    return start + hlen, header


def check_npy_file(files: StepFiles, path: str, out: Findings) -> None:
    """Judge one ``.npy`` file (header and data length; header only when local)."""
    out.format("numpy")
    out.checked.add(path)
    size = files.sizes[path]
    if size < 10:
        out.damaged(path, f"{size} bytes: shorter than an .npy header")
        return
    if not files.readable(path):
        return
    try:
        first = read_bytes(files, path, 0, 12)
        hlen = int.from_bytes(first[8:10] if first[6:7] == b"\x01" else first[8:12], "little")
        head = first + read_bytes(files, path, 12, min(hlen, MAX_HEADER))
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return
    try:
        offset, header = parse_npy_header(head)
        need = data_bytes(header)
    except BadNpy as exc:
        out.damaged(path, f"not a loadable .npy file: {exc}")
        return
    if need is not None and size < offset + need:
        out.damaged(
            path, f"{size} bytes, the header describes {offset + need} (truncated array data)"
        )
