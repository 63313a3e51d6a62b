"""Steps as bytes for the validator tests: in-memory StepFiles, files on disk, and the
formats built by hand (DCP metadata pickles without torch, safetensors, zips)."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierfs.store.validators import StepFiles


def mem_step(
    name: str,
    blobs: Mapping[str, bytes],
    *,
    sizes: Mapping[str, int] | None = None,
    local: set[str] | None = None,
    holders: Mapping[str, int] | None = None,
    siblings: set[str] | frozenset[str] = frozenset(),
) -> StepFiles:
    """A step whose files are ``blobs`` (path -> bytes); ``sizes`` overrides sizes
    (files known from other ranks' manifests need no bytes)."""
    all_sizes = {p: len(b) for p, b in blobs.items()}
    all_sizes.update(sizes or {})

    def read(path: str, offset: int, length: int) -> bytes:
        if path not in blobs:
            raise FileNotFoundError(2, "No such file or directory", path)
        return blobs[path][offset : offset + length]

    return StepFiles(
        name=name,
        sizes=all_sizes,
        read=read,
        local=frozenset(blobs) if local is None else frozenset(local),
        holders=dict(holders or {}),
        siblings=frozenset(siblings),
    )


def disk_step(root: Path, name: str, extra: tuple[str, ...] = ()) -> StepFiles:
    """The step ``root/name`` (and top-level files ``extra``) as written on disk."""
    sizes: dict[str, int] = {}
    for d, _, fs in os.walk(root / name):
        for f in fs:
            p = Path(d) / f
            sizes[str(p.relative_to(root))] = p.stat().st_size
    for e in extra:
        sizes[e] = (root / e).stat().st_size
    siblings = frozenset(os.listdir(root)) - {name}

    def read(path: str, offset: int, length: int) -> bytes:
        with open(root / path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    return StepFiles(name=name, sizes=sizes, read=read, siblings=siblings)


# ---------------------------------------------------------------- DCP .metadata without torch


class _FakeGlobalPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Pickles classes carrying ``_fake = (module, name)`` under that global name."""

    def save_global(self, obj: Any, name: Any = None) -> None:
        fake = getattr(obj, "_fake", None)
        if fake is None:
            super().save_global(obj, name)
            return
        self.save(fake[0])
        self.save(fake[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def _fake(module: str, name: str) -> type:
    return type(name, (), {"_fake": (module, name)})


MD = "torch.distributed.checkpoint.metadata"
Metadata = _fake(MD, "Metadata")
MetadataIndex = _fake(MD, "MetadataIndex")
BytesStorageMetadata = _fake(MD, "BytesStorageMetadata")
StorageInfo = _fake("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def dcp_metadata(refs: list[tuple[str, str, int, int]], declare: list[str] | None = None) -> bytes:
    """A ``.metadata`` pickle shaped like DCP's: refs = (fqn, file, offset, length)."""
    md = Metadata()
    md.state_dict_metadata = {fqn: BytesStorageMetadata() for fqn in (declare or [])} or {
        r[0]: BytesStorageMetadata() for r in refs
    }
    storage = {}
    for fqn, path, offset, length in refs:
        key = MetadataIndex()
        key.fqn, key.offset, key.index = fqn, None, None
        info = StorageInfo()
        info.relative_path, info.offset, info.length = path, offset, length
        storage[key] = info
    md.storage_data = storage
    md.planner_data = {r[0]: (r[0],) for r in refs}
    md.version = "1.0.0"
    buf = io.BytesIO()
    _FakeGlobalPickler(buf, protocol=4).dump(md)
    return buf.getvalue()


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/tierfs-validator-pwned",))


def evil_pickle() -> bytes:
    """A pickle that would run a shell command if loaded with pickle.loads."""
    return pickle.dumps(_Evil())


# ---------------------------------------------------------------- safetensors, zips


def safetensors_bytes(
    tensors: Mapping[str, tuple[str, list[int], bytes]], meta: bool = True
) -> bytes:
    """A safetensors file: name -> (dtype, shape, data bytes), in the given order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}} if meta else {}
    pos, data = 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def torch_like_zip(prefix: str = "archive", payload: bytes = b"\x00" * 64) -> bytes:
    """A zip laid out like torch.save's (data.pkl, data/0, version), stored; the same
    arguments give the same bytes (members carry a fixed time, as torch.save's do)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in (
            ("data.pkl", pickle.dumps({"w": 1})),
            ("data/0", payload),
            ("version", b"3\n"),
        ):
            zf.writestr(zipfile.ZipInfo(f"{prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


def ocdbt_manifest(body: bytes = b"\x00" * 20) -> bytes:
    """Bytes shaped like a tensorstore OCDBT manifest (magic, length, body, crc32c)."""
    import google_crc32c

    length = 4 + 8 + len(body) + 4
    head = (0x0CDB3A2A).to_bytes(4, "big") + length.to_bytes(8, "little")
    crc = google_crc32c.value(head + body)
    return head + body + int(crc).to_bytes(4, "little")
