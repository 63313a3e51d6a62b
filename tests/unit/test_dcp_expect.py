"""tierfs.node.dcp_expect: which missing names of a DCP step a lookup waits for (#14
trial 53 B1: stock save, barrier and load, one rank's part sealed later)."""

from __future__ import annotations

import pytest

from tierfs.node.dcp_expect import EXPECT_FOR, DirLook, expect_left, may_wait

NOW = 1_000_000.0


def look(own: dict[str, float] | None = None, placed: dict[str, float] | None = None) -> DirLook:
    return DirLook(own or {}, placed or {})


def test_only_dcp_names_may_wait():
    assert may_wait(".metadata") and may_wait("__1_0.distcp") and may_wait("__12_3.distcp")
    for name in (
        "__1.metadata",
        "model.safetensors",
        "x.distcp",
        "__1_0.distcp.tmp",
        ".metadata.tmp",
    ):
        assert not may_wait(name), name


def test_metadata_beside_own_data_just_written_waits_also_before_the_seal():
    """(a): rank 1's node still checksums its big file; rank 1 loads after the barrier."""
    left = expect_left(".metadata", look({"__1_0.distcp": NOW - 2}), NOW)
    assert left == pytest.approx(EXPECT_FOR - 2)


@pytest.mark.parametrize(
    "d, why",
    [
        (look(), "a new step directory: the save's own check at its start"),
        (look({"__0_0.distcp": NOW}), "the coordinator rank writes .metadata itself"),
        (look({"__1_0.distcp": NOW, "__0_0.distcp": NOW}), "coordinator's data here"),
        (look({"__1_0.distcp": NOW - EXPECT_FOR - 1}), "written long ago"),
        (look({"__1_0.distcp": NOW}, {".metadata": NOW - 100}), "an earlier .metadata here"),
        (look({"model.pt": NOW}), "not a DCP step"),
    ],
)
def test_metadata_is_not_waited_for(d, why):
    assert expect_left(".metadata", d, NOW) is None, why


def test_another_ranks_data_file_beside_a_newer_metadata_waits():
    """(b): .metadata placed, rank 1's part not known yet on node 2."""
    d = look({"__2_0.distcp": NOW - 3}, {".metadata": NOW - 1, "__0_0.distcp": NOW - 1})
    assert expect_left("__1_0.distcp", d, NOW) == pytest.approx(EXPECT_FOR - 1)
    own_meta = look({".metadata": NOW - 1, "__0_0.distcp": NOW - 2})  # on rank 0's node
    assert expect_left("__1_0.distcp", own_meta, NOW) == pytest.approx(EXPECT_FOR - 1)


@pytest.mark.parametrize(
    "d, why",
    [
        (look({"__2_0.distcp": NOW}), "no .metadata: the save is not finished (a create)"),
        (
            look({"__2_0.distcp": NOW}, {".metadata": NOW - 5}),
            "an older .metadata: the step saved again in place, this node's create",
        ),
        (look({"__2_0.distcp": NOW - 20}, {".metadata": NOW - EXPECT_FOR - 1}), "long ago"),
        (look({"__2_0.distcp": NOW}, {".metadata": NOW, "__1_0.distcp": NOW}), "already there"),
        # regression (CI, 7 December 2026): a copy in name order (cp -r, rsync) writes
        # .metadata first; the create of its first data file waited 10 s
        (look({".metadata": NOW}), "no own data file yet: this node creates one"),
        (look({}, {".metadata": NOW}), "no own data file here: not part of the save"),
    ],
)
def test_a_data_file_is_not_waited_for(d, why):
    assert expect_left("__1_0.distcp", d, NOW) is None, why
