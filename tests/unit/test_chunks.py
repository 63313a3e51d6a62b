"""Per-chunk crc32c (issue #14): combining chunk checksums, the manifest's chunks, the
chunk checker that verifies a copy as it streams in."""

from __future__ import annotations

import os
import random

import google_crc32c
import pytest

from tierfs.store.chunks import (
    ChunkChecker,
    ChunkMismatch,
    chunk_count,
    combine_chunks,
    crc32c_append,
    crc32c_combine,
)
from tierfs.store.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    crc32c_chunks,
    scan_tree,
)


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


def test_combine_matches_google_crc32c_over_random_splits() -> None:
    rng = random.Random(14)
    for _ in range(300):
        data = rng.randbytes(rng.randrange(0, 20000))
        cut = rng.randrange(0, len(data) + 1)
        a, b = data[:cut], data[cut:]
        assert crc32c_combine(crc(a), crc(b), len(b)) == crc(data)


def test_combine_of_many_pieces_and_edge_lengths() -> None:
    rng = random.Random(7)
    data = rng.randbytes(1 << 16)
    cuts = sorted(rng.sample(range(1, len(data)), 40))
    total = 0
    for lo, hi in zip([0, *cuts], [*cuts, len(data)], strict=True):
        total = crc32c_combine(total, crc(data[lo:hi]), hi - lo)
    assert total == crc(data)
    assert crc32c_combine(0x1234, 0, 0) == 0x1234
    assert crc32c_combine(0, crc(b"x"), 1) == crc(b"x")
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, -1)


def test_combine_chunks_and_count() -> None:
    data = random.Random(3).randbytes(10_000)
    crcs = [crc(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    assert chunk_count(len(data), 4096) == 3 == len(crcs)
    assert chunk_count(0, 4096) == 0
    assert chunk_count(4096, 4096) == 1
    assert combine_chunks(crcs, len(data), 4096) == crc(data)


def test_crc32c_chunks_of_a_file_in_one_pass(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "f")
    data = random.Random(5).randbytes(3 * 1000 + 17)
    with open(path, "wb") as f:
        f.write(data)
    whole, size, crcs = crc32c_chunks(path, chunk=1000)
    assert (whole, size) == (crc(data), len(data))
    assert crcs == tuple(crc(data[i : i + 1000]) for i in range(0, len(data), 1000))


def test_scan_tree_records_chunks_only_for_files_of_several_chunks(tmp_path: object) -> None:
    root = str(tmp_path)
    os.mkdir(os.path.join(root, "5"))
    big = random.Random(9).randbytes((4 << 20) * 2 + 5)
    with open(os.path.join(root, "5", "big"), "wb") as f:
        f.write(big)
    with open(os.path.join(root, "5", "small"), "wb") as f:
        f.write(b"hello")
    files = {f.path: f for f in scan_tree(root, ["5"])}
    assert files["5/big"].crc32c == crc(big)
    assert files["5/big"].chunks == (
        crc(big[: 4 << 20]),
        crc(big[4 << 20 : 8 << 20]),
        crc(big[8 << 20 :]),
    )
    assert files["5/small"].chunks is None
    cache: dict = {}
    scan_tree(root, ["5"], cache=cache)
    again = {f.path: f for f in scan_tree(root, ["5"], cache=cache)}
    assert again["5/big"].chunks == files["5/big"].chunks


def _manifest(files: tuple[FileEntry, ...], chunk_size: int = 4) -> Manifest:
    return Manifest("j", 1, 5, "5", "generic", files, created=1.0, chunk_size=chunk_size)


def test_manifest_json_round_trip_keeps_chunks_and_digest() -> None:
    data = b"0123456789"
    entry = FileEntry(
        "5/a", "file", size=10, crc32c=crc(data), chunks=(crc(b"0123"), crc(b"4567"), crc(b"89"))
    )
    m = _manifest((FileEntry("5", "dir"), entry))
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert back.chunks_of(back.files[1]) == (4, entry.chunks)
    # the digest (content identity, dedup across versions) ignores chunk checksums
    plain = _manifest((FileEntry("5", "dir"), FileEntry("5/a", "file", size=10, crc32c=crc(data))))
    assert plain.digest == m.digest


def test_manifest_without_chunk_checksums_still_reads() -> None:
    old = (
        b'{"files":[{"kind":"file","path":"5/a","size":10,"crc32c":1,"mode":420}],'
        b'"format":"tierfs.store.manifest/1","framework":"generic","job":"j","name":"5",'
        b'"rank":0,"step":5}'
    )
    m = Manifest.from_json(old)
    assert m.chunk_size == 0 and m.files[0].chunks is None
    assert m.chunks_of(m.files[0]) is None


def test_chunks_of_a_file_of_one_chunk_is_its_crc() -> None:
    m = _manifest(
        (
            FileEntry("a", "file", size=3, crc32c=crc(b"abc")),
            FileEntry("e", "file", size=0, crc32c=0),
        )
    )
    assert m.chunks_of(m.files[0]) == (4, (crc(b"abc"),))
    assert m.chunks_of(m.files[1]) == (4, ())


@pytest.mark.parametrize(
    "chunks, why",
    [
        ((1, 2), "do not fit its size"),
        ((crc(b"0123"), crc(b"4567"), crc(b"88")), "do not make its crc32c"),
    ],
)
def test_manifest_refuses_inconsistent_chunk_checksums(chunks: tuple[int, ...], why: str) -> None:
    entry = FileEntry("5/a", "file", size=10, crc32c=crc(b"0123456789"), chunks=chunks)
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(_manifest((entry,)).to_json())


def test_old_reader_ignores_the_chunk_keys() -> None:
    """The chunk checksums are top-level keys: a file entry keeps its old keys only
    (an older daemon forbids unknown keys in a file entry)."""
    entry = FileEntry("a", "file", size=5, crc32c=crc(b"01234"), chunks=(crc(b"0123"), crc(b"4")))
    doc = _manifest((entry,)).to_json()
    assert b'"chunks":{"a":[' in doc
    assert b'"files":[{"crc32c":' in doc and b'"chunks":[' not in doc.split(b'"files"')[1]


# ---------------------------------------------------------------- the checker

DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes
CH = 1024
CRCS = [crc(DATA[i : i + CH]) for i in range(0, len(DATA), CH)]


def _written(out: list[tuple[int, list[bytes]]]) -> list[tuple[int, bytes]]:
    return [(off, b"".join(pieces)) for off, pieces in out]


def test_checker_hands_on_each_chunk_once_verified() -> None:
    c = ChunkChecker(len(DATA), CRCS, CH)
    got: list[tuple[int, bytes]] = []
    off = 0
    for size in (100, 924, 1, 3000, 5000, 1219):  # pieces across chunk boundaries
        got += _written(c.feed(off, DATA[off : off + size]))
        off += size
        assert c.verified == min(off - off % CH, len(DATA)) or c.verified == len(DATA)
    assert off == len(DATA) and c.verified == len(DATA)
    assert b"".join(d for _, d in got) == DATA
    assert [o for o, _ in got] == list(range(0, len(DATA), CH))


def test_checker_refuses_a_corrupt_middle_chunk_and_keeps_the_verified_prefix() -> None:
    bad = bytearray(DATA)
    bad[5 * CH + 7] ^= 0x01
    c = ChunkChecker(len(DATA), CRCS, CH)
    with pytest.raises(ChunkMismatch, match=r"chunk 5 \(offset 5120\)"):
        c.feed(0, bytes(bad))
    assert c.verified == 5 * CH  # chunks 0-4 were handed on, chunk 5 never
    # the next copy starts again from 0: verified chunks are checked, not handed on again
    out = _written(c.feed(0, DATA))
    assert [o for o, _ in out] == list(range(5 * CH, len(DATA), CH))
    assert c.verified == len(DATA)


def test_checker_refuses_gaps_and_excess() -> None:
    c = ChunkChecker(len(DATA), CRCS, CH)
    with pytest.raises(ChunkMismatch, match="offset 10"):
        c.feed(10, DATA[10:20])
    with pytest.raises(ChunkMismatch, match="more bytes"):
        c.feed(0, DATA + b"x")
    with pytest.raises(ValueError):
        ChunkChecker(len(DATA), CRCS[:-1], CH)


def test_checker_takes_the_callers_own_crc_of_a_whole_chunk_without_a_pass(monkeypatch) -> None:
    """A peer's chunk is one whole chunk whose crc32c the puller computed anyway (for
    the wire check): the checker compares that value with the manifest's instead of a
    second pass over the bytes (three passes per byte before); a value for anything
    but exactly one whole chunk is ignored, and a wrong one is refused."""
    passes: list[int] = []
    real = google_crc32c.extend

    def counted(crc: int, data: bytes) -> int:
        passes.append(len(data))
        return int(real(crc, data))

    monkeypatch.setattr("tierfs.store.chunks.google_crc32c.extend", counted)
    c = ChunkChecker(len(DATA), CRCS, CH)
    out: list[tuple[int, bytes]] = []
    for i, off in enumerate(range(0, len(DATA), CH)):
        piece = DATA[off : off + CH]
        out += _written(c.feed(off, piece, CRCS[i]))
    assert passes == [] and c.verified == len(DATA)
    assert b"".join(d for _, d in out) == DATA
    # a piece of a chunk: the value is not of a whole chunk, the bytes are checked
    c = ChunkChecker(len(DATA), CRCS, CH)
    c.feed(0, DATA[:100], crc(DATA[:100]))
    c.feed(100, DATA[100:CH], crc(DATA[100:CH]))
    assert passes == [100, CH - 100] and c.verified == CH
    # the caller's crc of other bytes than the manifest's: refused, nothing handed on
    bad = bytearray(DATA[CH : 2 * CH])
    bad[3] ^= 1
    with pytest.raises(ChunkMismatch, match="chunk 1"):
        c.feed(CH, bytes(bad), crc(bytes(bad)))
    assert c.verified == CH


@pytest.mark.parametrize("sizes", [(0, 10), (10, 0), (100, 200), (70_000, 70_000), (5, 1 << 20)])
def test_append_is_the_crc_of_the_whole_whichever_way_it_is_made(sizes) -> None:
    a, b = os.urandom(sizes[0]), os.urandom(sizes[1])
    assert crc32c_append(crc(a), b, crc(b)) == crc(a + b)
