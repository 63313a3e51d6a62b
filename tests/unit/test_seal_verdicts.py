"""Issue #15 wired: the verdict judged at seal and kept in the manifest, a step that would
not load skipped by the restore choice, its reason said once -- no mount."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import fake_ports
import pytest
from mtc_clients import ocdbt_manifest
from step_bytes import dcp_metadata
from test_restorer import ONE, Node, shard

from tierfs.cluster.restore_choice import choose_restore
from tierfs.core.control import JobSpec
from tierfs.core.types import BucketPart, BucketView, Holding, WholeVerdict
from tierfs.node.catalog import ShardCatalog
from tierfs.node.restorer import own_rank_view
from tierfs.node.sealing import SealCandidate, SealRules
from tierfs.node.verdicts import SealVerdicts
from tierfs.store.manifest import Manifest, StepVerdict, VerdictProblem
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import ShardKey, ShardStore
from tierfs.store.verdicts import eligibility, judge_whole, loads_summary, step_loads

JOB = "train"


def write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def orbax_step(step: int, shard: bytes = b"w" * 4000, commit: bool = True) -> dict[str, bytes]:
    meta = {"item_handlers": {"state": "PyTreeCheckpointHandler"}}
    if commit:
        meta["commit_timestamp_nsecs"] = 1
    return {
        f"{step}/_CHECKPOINT_METADATA": json.dumps(meta).encode(),
        f"{step}/state/_METADATA": b'{"tree_metadata": {}, "use_ocdbt": true}',
        f"{step}/state/manifest.ocdbt": ocdbt_manifest(b"m" * 30),
        f"{step}/state/ocdbt.process_0/manifest.ocdbt": ocdbt_manifest(b"p" * 30),
        f"{step}/state/ocdbt.process_0/d/abc": shard,
    }


@pytest.fixture
def store(tmp_path):
    ram = RamStore(str(tmp_path / "ram"))
    return ram, ShardStore(ram)


def test_snapshot_records_the_verdict_and_it_survives_a_reload(store):
    ram, shards = store
    write(Path(ram.view), orbax_step(100))
    write(Path(ram.view), orbax_step(200, shard=b"", commit=False))
    good = shards.snapshot(ram.view, ShardKey(JOB, 0, 100), "100", ["100"], "orbax")
    bad = shards.snapshot(ram.view, ShardKey(JOB, 0, 200), "200", ["200"], "orbax")
    assert good.manifest.verdict == StepVerdict("complete", "orbax", ())
    v = bad.manifest.verdict
    assert v is not None and (v.state, v.format) == ("incomplete", "orbax")
    assert {(p.kind, p.path) for p in v.problems} == {
        ("damaged", "200/state/ocdbt.process_0/d/abc"),
        ("unfinished", "200/_CHECKPOINT_METADATA"),
    }
    # on disk beside the data, read back by a restarted daemon, digest unchanged
    doc = json.loads(Path(bad.path, "manifest.json").read_bytes())
    assert doc["verdict"]["state"] == "incomplete"
    loaded = shards.load()
    assert loaded[bad.key].manifest.verdict == v
    assert loaded[bad.key].manifest.digest == bad.manifest.digest
    assert Manifest.from_json(bad.manifest.to_json()) == bad.manifest
    unloadable, missing = eligibility(bad.manifest)
    assert unloadable.startswith("unfinished: 200/_CHECKPOINT_METADATA") or unloadable.startswith(
        "damaged: 200/state/ocdbt.process_0/d/abc"
    )
    assert missing == ""
    assert eligibility(good.manifest) == ("", "")


def test_unknown_layouts_keep_the_rename_rule(store):
    ram, shards = store
    write(Path(ram.view), {"7/blob.dat": b""})
    s = shards.snapshot(ram.view, ShardKey(JOB, 0, 7), "7", ["7"], "generic")
    assert s.manifest.verdict == StepVerdict("unknown_layout", "unknown", ())
    assert eligibility(s.manifest) == ("", "")


def test_a_dcp_part_without_rank_0_needs_another_rank_but_is_not_damaged(store):
    ram, shards = store
    write(Path(ram.view), {"step_10/__1_0.distcp": b"d" * 500})
    s = shards.snapshot(ram.view, ShardKey(JOB, 1, 10), "step_10", ["step_10"], "generic")
    v = s.manifest.verdict
    assert v is not None and v.state == "incomplete"
    assert [p.kind for p in v.problems] == ["missing"]
    assert v.reason(whole=False) == ""  # another rank's part may bring .metadata
    assert v.reason(whole=True).startswith("missing: step_10/.metadata")
    assert eligibility(s.manifest)[0] == ""
    assert eligibility(s.manifest)[1].startswith("missing: step_10/.metadata")


def test_a_part_sealed_with_files_of_an_earlier_save_never_loads(store):
    """#14 trial 60: a node of ranks 2 and 3, a save of the step cut short (rank 3 wrote
    its file again, rank 2 never did): the part's verdict says rank 2's file is of the
    earlier save, a fatal problem whatever the other ranks hold, so node-rank 0's
    verdict across ranks and the restore choice skip the step."""
    ram, shards = store
    write(Path(ram.view), {"30/__2_0.distcp": b"a" * 500, "30/__3_0.distcp": b"b" * 500})
    s = shards.snapshot(
        ram.view,
        ShardKey(JOB, 1, 30),
        "30",
        ["30"],
        "generic",
        earlier_files=["30/__2_0.distcp"],
    )
    v = s.manifest.verdict
    assert v is not None and (v.state, v.format) == ("incomplete", "dcp")
    assert [(p.kind, p.path) for p in v.problems] == [
        ("unfinished", "30/__2_0.distcp"),
        ("missing", "30/.metadata"),
    ]
    unloadable, _ = eligibility(s.manifest)
    assert unloadable.startswith("unfinished: 30/__2_0.distcp: of an earlier save of the step")
    assert loads_summary(v, whole=False).startswith("no: unfinished: 30/__2_0.distcp")  # type: ignore[union-attr]
    assert shards.load()[s.key].manifest.verdict == v  # kept on disk
    # across ranks: rank 0's part brings a .metadata naming both files, sizes right
    md = dcp_metadata([("a", "__2_0.distcp", 0, 500), ("b", "__3_0.distcp", 0, 500)])
    ram0 = RamStore(str(Path(ram.view).parent.parent / "ram0"))
    write(Path(ram0.view), {"30/.metadata": md})
    zero = ShardStore(ram0).snapshot(ram0.view, ShardKey(JOB, 0, 30), "30", ["30"], "generic")
    whole = judge_whole([zero.manifest, s.manifest], {0: zero.data, 1: s.data})
    assert whole is not None
    assert whole.unloadable.startswith("unfinished: 30/__2_0.distcp: of an earlier save"), whole


def test_a_damaged_dcp_shard_is_judged_against_the_metadata(store):
    ram, shards = store
    md = dcp_metadata([("w", "__0_0.distcp", 0, 1000)])
    write(Path(ram.view), {"300/.metadata": md, "300/__0_0.distcp": b""})
    s = shards.snapshot(ram.view, ShardKey(JOB, 0, 300), "300", ["300"], "pytorch.distributed")
    assert s.manifest.verdict is not None
    assert [(p.kind, p.path) for p in s.manifest.verdict.problems] == [
        ("damaged", "300/__0_0.distcp")
    ]


def test_status_says_in_a_few_words_whether_a_part_loads():
    assert loads_summary(None, whole=True) is None  # sealed before verdicts, or not judged
    assert loads_summary(StepVerdict("complete", "dcp"), whole=False) == "yes (dcp)"
    assert loads_summary(StepVerdict("unknown_layout"), whole=True) == (
        "rename rule (no known format)"
    )
    damaged = StepVerdict(
        "incomplete", "dcp", (VerdictProblem("damaged", "9/__0_0.distcp", "0 B"),)
    )
    assert loads_summary(damaged, whole=False) == "no: damaged: 9/__0_0.distcp: 0 B"
    needs = StepVerdict("incomplete", "dcp", (VerdictProblem("missing", "9/.metadata", "absent"),))
    assert loads_summary(needs, whole=True) == "no: missing: 9/.metadata: absent"
    # regression: "with the other ranks (missing: 9/.metadata: absent; ...)" read like
    # an error on every node but node-rank 0 (new-user trial)
    assert loads_summary(needs, whole=False) == (
        "part ok (dcp); the whole step: judged by node-rank 0 once its part is sealed "
        "(9/.metadata is in another rank's part)"
    )

    # node-rank 0 found no copy of a gone rank's part: never an "ok" (issue #16 trial)
    why = "rank 3's part: no copy found on a live node (asked for 40 s)"
    assert step_loads(needs, None, 4, why) == (
        "incomplete so far: part ok (dcp), rank 3's part: no copy found on a live node "
        "(asked for 40 s)"
    )
    assert step_loads(needs, None, 4) == loads_summary(needs, whole=False)
    # the rank declared gone: "never", not "so far" (stop 32 trial, finding 3)
    gone = (
        "rank 3's part: none (node-rank 3 declared gone): never complete for the 4-node "
        "job; restart the job with the smaller --nodes to restore later steps"
    )
    assert step_loads(needs, None, 4, gone) == f"incomplete: part ok (dcp), {gone}"
    assert step_loads(damaged, None, 4, why) == "no: damaged: 9/__0_0.distcp: 0 B"
    assert step_loads(needs, WholeVerdict(("a", "b"), "", "dcp"), 2, why) == (
        "yes (dcp, all 2 ranks)"
    )


def holding(step: int, rank: int = 0, unloadable: str = "", missing: str = "") -> Holding:
    return Holding(
        rank, step, True, f"d{rank}-{step}", 10, str(step), unloadable=unloadable, missing=missing
    )


def test_choose_restore_skips_a_step_that_would_not_load():
    why = "damaged: 200/x.safetensors: 0 bytes"
    c = choose_restore(1, {0: [holding(100), holding(200, unloadable=why)]})
    assert c.step == 100 and c.outcome == "older"  # tierfs wait exits 2
    line = f"step 200 is not loadable: {why} (rank 0's part)"
    assert line in c.reason and c.problems == (line,)
    # nothing older: nothing restored, the reason says why
    c = choose_restore(1, {0: [holding(200, unloadable=why)]})
    assert c.step is None and c.outcome == "incomplete" and line in c.reason


def test_missing_files_only_disqualify_a_one_node_step():
    miss = "missing: step_10/.metadata: absent"
    two = {0: [holding(10, 0), holding(5, 0)], 1: [holding(10, 1, missing=miss), holding(5, 1)]}
    assert choose_restore(2, two).step == 10  # rank 0's part may hold .metadata
    assert choose_restore(1, {0: [holding(10, missing=miss), holding(5)]}).step == 5
    # one rank's damaged part disqualifies the step for every rank
    two[1][0] = holding(10, 1, unloadable="damaged: step_10/__1_0.distcp: short")
    c = choose_restore(2, two)
    assert c.step == 5 and "step 10 is not loadable" in c.reason and "rank 1's part" in c.reason


def with_verdict(s, *problems: tuple[str, str, str]):
    v = StepVerdict("incomplete", "orbax", tuple(VerdictProblem(*p) for p in problems))
    return dataclasses.replace(s, manifest=dataclasses.replace(s.manifest, verdict=v))


def test_a_node_alone_restores_the_older_complete_step_and_says_why():
    s200 = with_verdict(shard(0, 200), ("damaged", "200/w.bin", "0 bytes"))
    s100 = shard(0, 100)
    node = Node(ONE, [s100, s200])
    plan = node.restore()
    assert (plan.step, plan.source, plan.shard) == (100, "local", s100)
    line = "step 200 is not loadable: damaged: 200/w.bin: 0 bytes"
    assert plan.detail["reason"] == f"step 100 is complete on this node ({line})"
    assert plan.detail["problems"] == [line]
    assert plan.detail["outcome"] == "older"
    assert node.store.verified == [s100.key]  # the unloadable step is not even read


def test_the_seal_reason_is_said_once(tmp_path):
    job = fake_ports.FakeJob(ONE)
    catalog = ShardCatalog(ShardStore(RamStore(str(tmp_path / "r"))), keep_local=3)
    SealVerdicts(catalog, job, job)
    bad = with_verdict(shard(0, 200), ("unfinished", "200/_CHECKPOINT_METADATA", "no commit"))
    catalog.add(bad)
    for _ in range(3):  # re-seals and retries of the same bytes
        catalog.sealed(bad)
    catalog.sealed(shard(0, 100))
    assert job.errors == [
        "step 200 (200, orbax) is not loadable: unfinished: 200/_CHECKPOINT_METADATA: "
        "no commit; it is not restored while an older complete step exists"
    ]
    # a part that only lacks another rank's file is not reported in a multi-node job
    two = fake_ports.FakeJob(dataclasses.replace(ONE, nodes=2))
    SealVerdicts(catalog, two, two)
    catalog.sealed(with_verdict(shard(0, 300), ("missing", "300/.metadata", "absent")))
    assert two.errors == []


class View:
    def __init__(self, tree: dict[str, list[str]]) -> None:
        self.tree = tree
        self.others: set[str] = set()  # other ranks' files of the whole-step view

    def is_dir(self, path: str) -> bool:
        return path in self.tree

    def exists(self, path: str) -> bool:
        return path in self.tree or any(
            path == f"{d}/{n}" for d, ns in self.tree.items() for n in ns
        )

    def read_text(self, path: str, limit: int = 256) -> str | None:
        return None

    def is_other_rank(self, path: str) -> bool:
        return path in self.others

    def listdir(self, path: str) -> list[str]:
        return self.tree.get(path, [])


def test_generic_mode_seals_a_dcp_part_of_a_node_without_rank_0():
    rules = SealRules("generic")
    node1 = View({"": ["step_10"], "step_10": ["__1_0.distcp"]})
    cand = rules.on_release("step_10/__1_0.distcp", node1)
    assert cand is not None and (cand.step, cand.name, cand.entries) == (
        10,
        "step_10",
        ("step_10",),
    )
    assert [c.step for c in rules.scan(node1)] == [10]
    # rank 0's node waits for .metadata, its marker
    node0 = View({"": ["step_10"], "step_10": ["__0_0.distcp"]})
    assert rules.on_release("step_10/__0_0.distcp", node0) is None
    assert rules.scan(node0) == []
    # rank 0's file placed by the whole-step view is not this node's (regression: a
    # step saved again into a directory showing rank 0's file never sealed on node 1)
    shown = View({"": ["step_10"], "step_10": ["__0_0.distcp", "__1_0.distcp"]})
    shown.others = {"step_10/__0_0.distcp"}
    cand = rules.on_release("step_10/__1_0.distcp", shown)
    assert cand is not None and cand.step == 10
    # a temp directory or another file never seals
    tmp = View({"": ["step_10.tmp"], "step_10.tmp": ["__1_0.distcp"]})
    assert rules.on_release("step_10.tmp/__1_0.distcp", tmp) is None
    assert rules.on_release("step_10/notes.txt", node1) is None
    assert SealRules("orbax").on_release("step_10/__1_0.distcp", node1) is None
    assert os.sep == "/"


def test_a_step_only_the_bucket_holds_is_judged_by_its_uploaded_verdict():
    """#15: a round's manifest carries the part's seal-time verdict; a step held only in
    the bucket that would not load is skipped too (it was restored before)."""
    why = "damaged: 20/__0_0.distcp: 0 bytes"
    bucket = BucketView(
        parts=(
            BucketPart("2026-12-02_10-20", 0, 20, "d20", unloadable=why),
            BucketPart("2026-12-02_10-10", 0, 10, "d10"),
        ),
        rounds=("2026-12-02_10-20", "2026-12-02_10-10"),
    )
    c = choose_restore(1, {0: []}, bucket=bucket)
    assert (c.step, c.backup, c.outcome) == (10, "2026-12-02_10-10", "older")
    assert f"step 20 is not loadable: {why} (rank 0's part)" in c.problems


def test_a_rank_deciding_alone_does_not_hold_another_ranks_file_against_its_part():
    """Regression: a node deciding alone for its rank of a multi-node job (no peer plane)
    read its part's `missing` (DCP `.metadata`, on rank 0) as final, as in a one-node job,
    and so would never restore a DCP step of rank 1 from the bucket."""
    miss = "missing: 20/.metadata: absent"
    parts = tuple(
        BucketPart("2026-12-02_10-20", r, 20, f"d{r}", missing=miss if r else "") for r in (0, 1)
    )
    view = own_rank_view(BucketView(parts=parts), JobSpec("j", "generic", 1, 2))
    assert [(p.rank, p.missing) for p in view.parts] == [(0, "")]
    assert choose_restore(1, {0: []}, bucket=view).step == 20


def test_a_dcp_part_waits_for_as_many_of_this_nodes_ranks_as_its_previous_one():
    """#14 trial 54 F4: the rule behind the sealer's wait (pure)."""
    rules = SealRules("generic")
    two = View({"": ["step_10"], "step_10": ["__2_0.distcp", "__3_0.distcp"]})
    first = rules.on_release("step_10/__2_0.distcp", two)
    assert first is not None and not rules.awaits_ranks(first, two)  # nothing earlier
    rules.on_release("step_10/__3_0.distcp", two)
    one = View({"": ["step_10", "step_20"], "step_20": ["__2_0.distcp"]})
    cand = rules.on_release("step_20/__2_0.distcp", one)
    assert cand is not None and rules.awaits_ranks(cand, one)
    # another rank's file shown by the whole-step view is not this node's rank
    shown = View({"": ["step_20"], "step_20": ["__2_0.distcp", "__1_0.distcp"]})
    shown.others = {"step_20/__1_0.distcp"}
    assert rules.awaits_ranks(cand, shown)
    both = View({"": ["step_20"], "step_20": ["__2_0.distcp", "__3_0.distcp"]})
    cand = rules.on_release("step_20/__3_0.distcp", both)
    assert cand is not None and not rules.awaits_ranks(cand, both)
    # a marker's candidate never waits for ranks
    marker = SealCandidate(20, "step_20", ("step_20",), "marker .metadata")
    assert not rules.awaits_ranks(marker, one)


def test_the_node_of_rank_0_counts_its_ranks_too():
    """On the node of ranks 0 and 1, rank 1's file closed before rank 0 created its own
    was a part without rank 0 (sealed at once, then again at ``.metadata``)."""
    rules = SealRules("generic")
    full = View({"": ["step_10"], "step_10": ["__0_0.distcp", "__1_0.distcp"]})
    assert rules.on_release("step_10/__1_0.distcp", full) is None  # rank 0's: .metadata
    assert rules.on_release("step_10/__0_0.distcp", full) is None
    early = View({"": ["step_20"], "step_20": ["__1_0.distcp"]})
    cand = rules.on_release("step_20/__1_0.distcp", early)
    assert cand is not None and rules.awaits_ranks(cand, early)
