"""safetensors files: the header parses and its tensors cover the file exactly.

The format (huggingface/safetensors, ``safetensors/src/tensor.rs``,
``SafeTensors::read_metadata`` and ``Metadata::validate``): an 8-byte
little-endian header length ``n`` (at most 100,000,000), ``n`` bytes of a JSON
object (tensor name -> ``{"dtype", "shape", "data_offsets": [begin, end]}``,
plus an optional ``"__metadata__"`` of strings), then the data buffer. Sorted by
offset the tensors must be contiguous from 0, each ``end - begin`` must be
``prod(shape) * bits(dtype) / 8``, and ``8 + n + last end`` must equal the file
size (else ``MetadataIncompleteBuffer``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tierfs.core.errors import StorageError
from tierfs.store.validators.model import Findings, ReadFailed, StepFiles, read_bytes

MAX_HEADER = 100_000_000

#: bits per element (safetensors ``Dtype::bitsize``)
#: a dtype name as safetensors writes them (``F32``, ``F8_E4M3``); a well-formed name
#: missing from DTYPE_BITS is a newer dtype (its contiguity is still checked)
_DTYPE_NAME = re.compile(r"[A-Z][A-Z0-9_]*")

DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class BadSafetensors(StorageError, ValueError):
    """The bytes are not a complete safetensors file (the message says why)."""


def parse_header(head: bytes, file_size: int) -> frozenset[str]:
    """Check a safetensors header against the file size; return its tensor names.

    Args:
        head: the file's first ``8 + n`` bytes (or fewer if the file is shorter).
        file_size: the file's size in bytes.

    Raises:
        BadSafetensors: the header is cut off, not JSON, or does not describe
            exactly ``file_size`` bytes.
    """
    if file_size < 8 or len(head) < 8:
        raise BadSafetensors(f"{file_size} bytes: shorter than the 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER:
        raise BadSafetensors(f"header length {n} is over safetensors' limit {MAX_HEADER}")
    if 8 + n > file_size or len(head) < 8 + n:
        raise BadSafetensors(f"header of {n} bytes is cut off ({file_size} bytes in the file)")
    try:
        header = json.loads(head[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadSafetensors(f"header is not JSON ({exc})"[:160]) from None
    if not isinstance(header, dict):
        raise BadSafetensors("header is not a JSON object")
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        spans.append((*_span(name, info), name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise BadSafetensors(f"tensor {name!r} starts at {begin}, expected {pos}")
        pos = end
    if 8 + n + pos != file_size:
        raise BadSafetensors(
            f"tensors end at byte {8 + n + pos} but the file has {file_size}"
            + (" (truncated)" if file_size < 8 + n + pos else "")
        )
    return frozenset(name for _, _, name in spans)


def _span(name: str, info: Any) -> tuple[int, int]:
    if not isinstance(info, dict):
        raise BadSafetensors(f"tensor {name!r} has no info object")
    offsets = info.get("data_offsets")
    shape = info.get("shape")
    dtype = info.get("dtype")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
    ):
        raise BadSafetensors(f"tensor {name!r} has no [begin, end] data_offsets")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise BadSafetensors(f"tensor {name!r} has offsets {begin}..{end}")
    if not isinstance(shape, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape
    ):
        raise BadSafetensors(f"tensor {name!r} has no shape")
    if not isinstance(dtype, str) or not _DTYPE_NAME.fullmatch(dtype):
        raise BadSafetensors(f"tensor {name!r} has no valid dtype ({dtype!r})")
    bits = DTYPE_BITS.get(dtype)
    if bits is not None:  # a dtype newer than this table: contiguity is still checked
        nbits = math.prod(shape) * bits
        if nbits % 8 or end - begin != nbits // 8:
            raise BadSafetensors(
                f"tensor {name!r} ({dtype} {shape}) needs {nbits // 8} bytes, "
                f"offsets give {end - begin}"
            )
    return begin, end


def check_safetensors_file(files: StepFiles, path: str, out: Findings) -> None:
    """Judge one ``*.safetensors`` file (the header only when the file is local)."""
    out.format("safetensors")
    out.checked.add(path)
    size = files.sizes[path]
    if size < 8:
        out.damaged(path, f"{size} bytes: a safetensors file starts with an 8-byte header length")
        return
    if not files.readable(path):
        return  # its holder judges the bytes; sizes alone say nothing more
    try:
        head = read_bytes(files, path, 0, 8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if n <= MAX_HEADER and 8 + n <= size:  # else parse_header says what is wrong
            head += read_bytes(files, path, 8, n)
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return
    try:
        out.tensor_names[path] = parse_header(head, size)
    except BadSafetensors as exc:
        out.damaged(path, f"not a loadable safetensors file: {exc}")
