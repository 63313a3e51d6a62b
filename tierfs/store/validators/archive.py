"""Zip archives: ``torch.save`` files (and numpy ``.npz``), central directory readable.

``torch.save`` (default ``_use_new_zipfile_serialization=True``) writes a zip
through ``PyTorchStreamWriter`` (pytorch ``caffe2/serialize/inline_container.cc``):
``<archive>/data.pkl``, ``<archive>/data/<key>`` per storage, ``version``,
stored uncompressed; the central directory is written last, at ``close``, so a
cut-off file has none and ``torch.load`` fails ("failed finding central
directory"). ``numpy.savez`` writes a zip of ``.npy`` members the same way.
Older ``torch.save`` files (``_use_new_zipfile_serialization=False``) are a bare
pickle stream: only their presence and size are judged.

The rule: the end-of-central-directory record is found (zip64 too), the
central directory parses, every member's local header is where the directory
says and its data ends before the directory; a torch file has a ``data.pkl``.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

from tierfs.core.errors import StorageError
from tierfs.store.validators.model import Findings, ReadFailed, StepFiles, read_bytes

#: suffixes of files torch.save writes by convention (tierfs's pytorch mode: .save)
TORCH_STRICT = (".pt", ".pth", ".save")
#: suffixes that are torch.save zips when they start like one (HF pytorch_model.bin,
#: Lightning .ckpt), else another format this module does not judge
TORCH_LOOSE = (".bin", ".ckpt")
ZIP_MAGIC = b"PK\x03\x04"
LOCAL_HEADER = 30
#: the most central-directory bytes read to judge one archive
MAX_DIRECTORY_BYTES = 256 << 20


class _RangeFile(io.RawIOBase):
    """A read-only, seekable file over :func:`read_bytes` (for :mod:`zipfile`)."""

    def __init__(self, files: StepFiles, path: str) -> None:
        super().__init__()
        self._files = files
        self._path = path
        self._size = files.sizes[path]
        self._pos = 0
        self.read_total = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(22, "negative seek")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), max(0, self._size - self._pos))
        if self.read_total + want > MAX_DIRECTORY_BYTES:
            raise OSError(27, "archive directory too large to judge")
        try:
            data = read_bytes(self._files, self._path, self._pos, want) if want else b""
        except ReadFailed as exc:
            raise OSError(5, str(exc)) from None
        view[: len(data)] = data
        self._pos += len(data)
        self.read_total += len(data)
        return len(data)


class BadArchive(StorageError, ValueError):
    """The zip cannot be opened by a reader (the message says why)."""


def check_zip(files: StepFiles, path: str) -> list[str]:
    """Open the zip's central directory and check every member's placement.

    Returns:
        the member names.

    Raises:
        BadArchive: no central directory, or a member lies outside the file.
        ReadFailed: the bytes could not be read here.
    """
    raw = _RangeFile(files, path)
    try:
        with zipfile.ZipFile(raw) as zf:
            infos = zf.infolist()
            directory_start = getattr(zf, "start_dir", files.sizes[path])
    except zipfile.BadZipFile as exc:
        raise BadArchive(f"no readable zip central directory ({exc})") from None
    except (OSError, ValueError, EOFError) as exc:
        raise BadArchive(f"zip directory unreadable ({exc})") from None
    for info in infos:
        head = read_bytes(files, path, info.header_offset, LOCAL_HEADER)
        if len(head) < LOCAL_HEADER or head[:4] != ZIP_MAGIC:
            raise BadArchive(f"member {info.filename!r}: no local header at {info.header_offset}")
        name_len = int.from_bytes(head[26:28], "little")
        extra_len = int.from_bytes(head[28:30], "little")
        end = info.header_offset + LOCAL_HEADER + name_len + extra_len + info.compress_size
        if end > directory_start:
            raise BadArchive(
                f"member {info.filename!r} ends at byte {end}, past the directory at "
                f"{directory_start}"
            )
    return [info.filename for info in infos]


def check_torch_file(files: StepFiles, path: str, out: Findings) -> None:
    """Judge a ``torch.save`` file (by suffix; see :data:`TORCH_STRICT`)."""
    size = files.sizes[path]
    strict = path.endswith(TORCH_STRICT)
    if size == 0:
        out.format("torch.save")
        out.checked.add(path)
        out.damaged(path, "0 bytes: torch.load needs a zip archive (or a legacy pickle)")
        return
    if not files.readable(path):
        if strict:
            out.format("torch.save")
            out.checked.add(path)
        return
    try:
        magic = read_bytes(files, path, 0, 4)
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return
    if magic != ZIP_MAGIC:
        if not strict:
            return  # a .bin/.ckpt of another format: not judged here
        out.format("torch.save")
        out.checked.add(path)
        if magic[:1] == b"\x80":
            out.note(f"{path}: legacy (non-zip) torch.save pickle, judged by size only")
        else:
            out.damaged(path, "neither a zip archive nor a pickle: torch.load cannot read it")
        return
    out.format("torch.save")
    out.checked.add(path)
    try:
        names = check_zip(files, path)
    except BadArchive as exc:
        out.damaged(path, f"not a loadable torch.save archive: {exc}")
        return
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
        return
    if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        out.damaged(path, "zip archive without data.pkl: not a torch.save file")


def check_npz_file(files: StepFiles, path: str, out: Findings) -> None:
    """Judge a numpy ``.npz`` archive."""
    out.format("numpy")
    out.checked.add(path)
    if files.sizes[path] < 22:
        out.damaged(path, f"{files.sizes[path]} bytes: too short for a zip archive")
        return
    if not files.readable(path):
        return
    try:
        check_zip(files, path)
    except BadArchive as exc:
        out.damaged(path, f"not a loadable .npz archive: {exc}")
    except ReadFailed as exc:
        out.unreadable(path, str(exc))
