"""One file of a node's part from a backup round, against the real fake-gcs-server
(issue #14: the whole-step view fetches another rank's file on first read):
:meth:`tierfs.backup.download.Downloader.download_file` and
:meth:`tierfs.backup.tier.GcsTier.fetch_file` over a part uploaded the normal way."""

from __future__ import annotations

import os

import fake_ports
import pytest
import trio
from gcs_fixtures import make_shard

from tierfs.backup.bucket import GcsBackend, GcsSettings
from tierfs.backup.errors import ChecksumMismatch, GcsError
from tierfs.backup.tier import GcsTier
from tierfs.core.errors import FetchFailed

MiB = 1 << 20
R1 = "2026-12-02_12-00"
FILES: dict[str, bytes | str] = {
    "5/state/big.bin": os.urandom(3 * MiB + 17),  # a download of several reads
    "5/state/small.bin": b"rank 1's small file",
    "5/meta.json": b'{"step": 5}',
    "5/link": "->meta.json",
}


def settings() -> GcsSettings:
    return GcsSettings.from_env(chunk_size=MiB, threads=4)


@pytest.fixture
def uploaded(fake_gcs, tmp_path):
    """Node-rank 1's part of step 5 in round R1 of a two-node job, under a prefix."""
    spec = f"{fake_gcs.bucket}/pre"
    g = GcsBackend(spec, settings=settings())
    shard = make_shard(tmp_path / "n1", "job", 1, 5, FILES)
    g.upload_shard(shard, R1, nodes=2)
    return g, shard


def open_target(tmp_path, name: str = "out") -> int:
    return os.open(tmp_path / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)


def test_download_file_writes_that_file_from_offset_zero(uploaded, tmp_path):
    g, shard = uploaded
    fd = open_target(tmp_path)
    try:
        os.write(fd, b"junk")  # positional writes: the descriptor's offset stays
        seen: list[int] = []
        n = g.downloads.download_file(
            "job", R1, 1, 5, "5/state/big.bin", fd, on_bytes=seen.append
        )  # the round inspected here
        assert n == len(FILES["5/state/big.bin"]) == sum(seen)
        assert os.pread(fd, n + 1, 0) == FILES["5/state/big.bin"]
        assert os.lseek(fd, 0, os.SEEK_CUR) == 4
        # from the part's manifest alone (one GET, no listing)
        part = g.rounds.read_part("job", R1, 1, 5)
        assert part is not None and part.manifest.digest == shard.manifest.digest
        os.ftruncate(fd, 0)
        assert g.downloads.download_file("job", R1, 1, 5, "5/meta.json", fd, part=part) == 11
        assert os.pread(fd, 100, 0) == FILES["5/meta.json"]
        assert g.rounds.read_part("job", R1, 0, 5) is None  # rank 0 uploaded nothing
        for path in ("5/link", "5/state", "5/nothing"):  # not files of the part
            with pytest.raises(GcsError, match="is not a file"):
                g.downloads.download_file("job", R1, 1, 5, path, fd, part=part)
    finally:
        os.close(fd)


def test_an_object_whose_bytes_changed_is_refused_after_the_write(uploaded, tmp_path, fake_gcs):
    g, _shard = uploaded
    part = g.rounds.read_part("job", R1, 1, 5)
    assert part is not None
    name = g.spec.round_dir("job", R1) + part.objects["5/state/small.bin"]
    fake_gcs.client().bucket(fake_gcs.bucket).blob(name).upload_from_string(b"rank 1's small filE")
    fd = open_target(tmp_path)
    try:
        with pytest.raises(ChecksumMismatch, match="crc32c"):
            g.downloads.download_file("job", R1, 1, 5, "5/state/small.bin", fd, part=part)
    finally:
        os.close(fd)


def test_the_tier_fetches_a_file_and_refuses_a_missing_step(uploaded, tmp_path, fake_gcs):
    g, shard = uploaded
    job = fake_ports.FakeJob()
    tier = GcsTier(
        g.spec,
        catalog=fake_ports.catalog(),
        job=job,
        reporter=job,
        shards=None,  # type: ignore[arg-type]
        budget=fake_ports.FakeBudget(),
        settings=settings(),
    )
    fd = open_target(tmp_path)

    async def main() -> None:
        served = await tier.fetch_file("job", 1, 5, shard.manifest.digest, "5/state/small.bin", fd)
        assert served == f"bucket round {R1}"
        assert os.pread(fd, 100, 0) == FILES["5/state/small.bin"]
        with pytest.raises(FetchFailed, match="no backup round holds it"):
            await tier.fetch_file("job", 1, 6, "", "6/meta.json", fd)
        with pytest.raises(FetchFailed, match=f"bucket round {R1}: skipped"):
            await tier.fetch_file(
                "job", 1, 5, "", "5/meta.json", fd, skip=frozenset({f"bucket round {R1}"})
            )

    try:
        trio.run(main)
    finally:
        os.close(fd)
    assert tier.access.bucket_problem() is None
