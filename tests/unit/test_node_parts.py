"""The node agent's parts (tierfs/node: intake, sealer, keeper, jobcontrol,
restore_driver, steps, tasks) on their own: no mount, no process, no bucket.

The parts are built by the composition root (``build_node``) over a ram-dir in
``tmp_path`` or, for the intake, with recording fakes of its collaborators.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import time
from collections import deque
from collections.abc import Awaitable, Callable

import fake_ports
import trio
import trio.testing

from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.core.types import RestorePlan
from tierfs.daemon import NodeParts, build_node
from tierfs.node.intake import AgentEvents, Changed, EventIntake
from tierfs.node.jobstate import JobState
from tierfs.node.restore_driver import RestoreDriver
from tierfs.node.sealing import SealCandidate
from tierfs.node.steps import StepBook
from tierfs.node.tasks import TaskSpawner
from tierfs.node.view import ClientView, Published
from tierfs.store.ramstore import Budget, RamStore
from tierfs.store.shards import ShardKey
from tierfs.store.verdicts import eligibility

JOB = JobSpec("j", "generic", 0, 1)


def build(tmp_path: pathlib.Path, **options: object) -> NodeParts:
    config = NodeConfig(mountpoint=str(tmp_path / "m"), ram_dir=str(tmp_path / "r"), **options)
    store = RamStore(config.ram_dir)
    return build_node(config, store, Budget(store.root, 1 << 30, 0))


def write_step(parts: NodeParts, step: int) -> str:
    """A step directory ``<step>/`` with one file in the view; returns its file's path."""
    root = pathlib.Path(parts.view.root) / str(step)
    root.mkdir()
    path = root / "data.bin"
    path.write_bytes(b"x" * 100 + str(step).encode())
    return str(path)


def candidate(step: int, reason: str = "test") -> SealCandidate:
    return SealCandidate(step, str(step), (str(step),), reason)


def run_with_tasks(parts: NodeParts, body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body`` with the agent's task nursery open; waits for the spawned tasks."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            await body()
        parts.agent.tasks.nursery = None

    trio.run(main)


def seal(parts: NodeParts, *steps: int) -> None:
    async def body() -> None:
        for step in steps:
            parts.agent.sealer.schedule(candidate(step))
            await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)


# ---------------------------------------------------------------------- sealer


def test_the_sealer_seals_a_step_into_the_catalog_the_book_and_state_json(tmp_path):
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    write_step(parts, 10)
    seal(parts, 10)
    key = ShardKey("j", 0, 10)
    shard = parts.catalog.get(key)
    assert shard is not None and shard.manifest.name == "10"
    assert [f.path for f in shard.manifest.files if f.kind == "file"] == ["10/data.bin"]
    book = parts.agent.book
    assert book.view_steps == {"10": key} and book.pending == {}
    assert book.sealing_inos == {}  # unmarked once the snapshot is done
    assert set(parts.catalog.sealed_inos.values()) == {key}
    saved = (pathlib.Path(parts.agent.store.state_file)).read_text()
    assert '"10"' in saved


def test_a_candidate_whose_entry_vanished_is_forgotten_not_sealed(tmp_path):
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    seal(parts, 11)  # no directory 11 in the view
    assert ShardKey("j", 0, 11) not in parts.catalog
    assert parts.agent.book.pending == {}


def test_a_write_into_a_sealed_file_withdraws_the_seal_and_reseals_with_its_first_time(tmp_path):
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 10)
    seal(parts, 10)
    key = ShardKey("j", 0, 10)
    created = parts.catalog[key].manifest.created
    parts.agent.intake.write_opening(os.stat(path).st_ino)  # what the FUSE thread calls
    book = parts.agent.book
    assert key not in parts.catalog
    assert book.withdrawn_names == {"10": key} and book.withdrawn_created == {key: created}
    assert parts.agent.status().steps[0].state == "writing"

    async def body() -> None:
        parts.agent.sealer.retry_pending("10")  # the writer closed
        assert book.pending["10"].reason == "re-seal after write"
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)
    assert parts.catalog[key].manifest.created == created
    assert book.withdrawn_names == {} and book.withdrawn_created == {}


def sealed_with_metadata(tmp_path: pathlib.Path) -> tuple[NodeParts, str, pathlib.Path, ShardKey]:
    """A generic job's step 10 sealed with ``data.bin`` and DCP rank 0's ``.metadata``:
    (the parts, the data file's path, the marker's path, the part's key)."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    data = write_step(parts, 10)
    marker = pathlib.Path(data).parent / ".metadata"
    marker.write_bytes(b"old metadata")
    seal(parts, 10)
    return parts, data, marker, ShardKey("j", 0, 10)


def test_a_step_saved_again_in_place_seals_again_at_its_marker_not_at_its_first_file(tmp_path):
    """Regression (replay of the #16 trial, DCP saved again in place): rank 0's part was
    sealed after ``__0_0.distcp`` was rewritten, with the old ``.metadata`` in it, and
    again 40 ms later after the new ``.metadata``; a backup round took the first seal
    and its upload was stopped by the second. The re-seal now waits for the marker."""
    parts, data, marker, key = sealed_with_metadata(tmp_path)
    assert {f.path for f in parts.catalog[key].manifest.files} >= {"10/.metadata", "10/data.bin"}
    parts.agent.intake.write_opening(os.stat(data).st_ino)
    pathlib.Path(data).write_bytes(b"new data")
    book, sealer = parts.agent.book, parts.agent.sealer

    async def body() -> None:
        sealer.retry_pending("10")  # the data file's writer closed
        await trio.testing.wait_all_tasks_blocked()
        assert key not in parts.catalog  # not sealed with the old .metadata
        assert book.pending["10"].reason == "re-seal after write"
        sealer.retry_pending("10")  # more events meanwhile start no second waiter
        tmp = marker.with_name(".metadata.tmp")
        tmp.write_bytes(b"new metadata")
        os.rename(tmp, marker)
        assert book.rules is not None
        cand = book.rules.on_rename("10/.metadata.tmp", "10/.metadata", False, False, parts.view)
        assert cand is not None
        sealer.schedule(cand)

    run_with_tasks(parts, body)  # ends once the seal is done and no task waits
    files = {f.path: f for f in parts.catalog[key].manifest.files}
    assert files["10/.metadata"].size == len(b"new metadata")
    assert files["10/data.bin"].size == len(b"new data")


def test_a_dcp_save_in_place_that_removes_the_old_metadata_first_waits_for_the_new_one(
    tmp_path,
):
    """Regression (#16 F1 replay): DCP's ``FileSystemWriter(overwrite=True)`` removes the
    old ``.metadata`` before it writes. Rank 0's part then had no marker in its
    directory and was sealed at once without one (or with ``.metadata.tmp``); the other
    nodes showed that torn part and ``dcp.load`` failed with "metadata is None". And a
    change event arriving while the marker's seal ran replaced its candidate: the seal
    gave up and the re-seal waited out the 30 s grace, the old part shown meanwhile."""
    parts, data, marker, key = sealed_with_metadata(tmp_path)
    marker.unlink()  # set_up_storage_writer: rm_file(.metadata)
    parts.agent.intake.write_opening(os.stat(data).st_ino)
    pathlib.Path(data).write_bytes(b"new data")
    book, sealer, intake = parts.agent.book, parts.agent.sealer, parts.agent.intake

    async def body() -> None:
        sealer.retry_pending("10")  # the data file's writer closed
        await trio.testing.wait_all_tasks_blocked()
        assert key not in parts.catalog  # not sealed without its marker
        tmp = marker.with_name(".metadata.tmp")
        tmp.write_bytes(b"new metadata")
        os.rename(tmp, marker)
        assert book.rules is not None
        cand = book.rules.on_rename("10/.metadata.tmp", "10/.metadata", False, False, parts.view)
        assert cand is not None and cand.reason == "marker .metadata"
        sealer.schedule(cand)
        await intake.handle(Changed("10/.metadata"))  # while the marker's seal runs
        assert book.pending["10"] is cand

    run_with_tasks(parts, body)  # ends once the seal is done and no task waits
    files = {f.path: f for f in parts.catalog[key].manifest.files}
    assert files["10/.metadata"].size == len(b"new metadata")
    assert files["10/data.bin"].size == len(b"new data")
    assert sealer._deferred == {}


def test_a_file_changed_by_hand_in_a_step_with_a_marker_is_sealed_after_the_grace(tmp_path):
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    data = write_step(parts, 10)
    (pathlib.Path(data).parent / "commit_success.txt").write_bytes(b"ok")
    seal(parts, 10)
    key = ShardKey("j", 0, 10)
    parts.agent.intake.write_opening(os.stat(data).st_ino)
    pathlib.Path(data).write_bytes(b"fixed by hand")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            parts.agent.sealer.retry_pending("10")
            await trio.sleep(parts.agent.sealer.marker_grace - 1)
            assert key not in parts.catalog
        parts.agent.tasks.nursery = None  # the nursery waited for the seal (mock clock)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    files = {f.path: f for f in parts.catalog[key].manifest.files}
    assert files["10/data.bin"].size == len(b"fixed by hand")


def test_a_part_without_a_marker_of_its_own_is_sealed_again_at_once(tmp_path):
    # DCP's other ranks: no .metadata of their own (rank 0's, shown by the whole-step
    # view, is another rank's file), their data file is their last
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    data = write_step(parts, 10)
    seal(parts, 10)
    shown = pathlib.Path(data).parent / ".metadata"
    shown.write_bytes(b"rank 0's metadata")
    parts.view.foreign = lambda ino: ino == os.stat(shown).st_ino
    key = ShardKey("j", 0, 10)
    parts.agent.intake.write_opening(os.stat(data).st_ino)

    async def body() -> None:
        parts.agent.sealer.retry_pending("10")
        assert parts.agent.sealer._deferred == {}  # not waiting for a marker
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)
    assert key in parts.catalog


def test_a_step_dropped_by_retention_is_not_sealed_again_at_start(tmp_path):
    """Regression (#16 fourth trial F7): a 4-node step 10 whose snapshot --keep-local
    had dropped stayed in the mount; the daemon restarted for a 2-node job sealed it
    again "found at start" as a 2-node part, the newest by its directory's time, and
    retention then dropped the parts of step 20 that the restore had just taken."""
    parts = build(tmp_path, keep_local=1)
    parts.agent.control.set_job(JOB, "generic")
    for step in (10, 20):
        data = write_step(parts, step)
        (pathlib.Path(data).parent / "commit_success.txt").write_bytes(b"ok")
    seal(parts, 10, 20)
    k10, k20 = ShardKey("j", 0, 10), ShardKey("j", 0, 20)
    assert k10 not in parts.catalog and k20 in parts.catalog  # keep-local 1
    assert parts.agent.book.view_steps["10"] == k10
    os.utime(pathlib.Path(parts.view.root) / "10")  # the directory changed since (now)

    async def body() -> None:
        await parts.agent.sealer.reconcile()

    run_with_tasks(parts, body)
    assert k10 not in parts.catalog
    assert k20 in parts.catalog


# ---------------------------------------------------------------------- keeper


def test_retention_drops_the_oldest_step_unless_a_restore_runs(tmp_path):
    parts = build(tmp_path, keep_local=1)
    parts.agent.control.set_job(JOB, "generic")
    for step in (10, 20, 30):
        write_step(parts, step)
    seal(parts, 10, 20)
    assert sorted(k.step for k in parts.catalog) == [20]
    assert (pathlib.Path(parts.view.root) / "10").is_dir()  # generic mode hides nothing
    parts.state.restore_state = {"state": "planning"}
    seal(parts, 30)
    assert sorted(k.step for k in parts.catalog) == [20, 30]  # nothing dropped meanwhile


def test_the_restored_step_is_kept_until_the_job_saves_again(tmp_path):
    """Regression (#16 fourth trial F7): retention dropped the parts of the step the
    restore had just taken for steps that sorted newer by their seal time."""
    parts = build(tmp_path, keep_local=1)
    parts.agent.control.set_job(JOB, "generic")
    for step in (10, 20):
        write_step(parts, step)
    seal(parts, 10)
    k10, k20 = ShardKey("j", 0, 10), ShardKey("j", 0, 20)
    restored_at = parts.catalog[k10].manifest.created + 3600.0  # after every seal here
    parts.state.restore_state = {"state": "done", "step": 10, "at": restored_at}
    seal(parts, 20)  # "sealed" before the restore finished: an abandoned newer step
    assert k10 in parts.catalog and k20 in parts.catalog
    assert parts.agent.keeper.restored_pins() == {k10}
    # the job saved after the restore: plain --keep-local again
    parts.state.restore_state = {"state": "done", "step": 10, "at": 0.0}
    write_step(parts, 30)
    seal(parts, 30)
    assert sorted(k.step for k in parts.catalog) == [30]


def test_a_published_marker_pins_its_shard(tmp_path):
    parts = build(tmp_path)
    key = ShardKey("j", 0, 7)
    parts.view.published["j-s7"] = Published("j-s7", "7", key, "7")
    assert key in parts.agent.keeper.pinned()
    del parts.view.published["j-s7"]
    assert key not in parts.agent.keeper.pinned()


# ---------------------------------------------------------------------- intake


class Recorder:
    """Sealer, keeper, job control and restore driver as the intake sees them."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def schedule(self, cand: SealCandidate) -> None:
        self.calls.append(("schedule", cand.name))

    def retry_pending(self, top: str) -> None:
        self.calls.append(("retry", top))

    def withdraw(self, key: ShardKey, reason: str) -> None:
        self.calls.append(("withdraw", key))

    def drop_shard(self, key: ShardKey, reason: str) -> None:
        self.calls.append(("drop", key))

    def start_control(self) -> None:
        self.calls.append(("control",))

    async def materialize(self, name: str, pub: Published) -> None:
        self.calls.append(("materialize", name, pub.key))


def test_the_intake_routes_each_event_to_its_part(tmp_path):
    store = RamStore(str(tmp_path / "r"))
    view = ClientView(store)
    state = JobState()
    book = StepBook(store, state, view, {})
    tasks = TaskSpawner(deque())
    rec = Recorder()
    intake = EventIntake(store, book, view, fake_ports.catalog(), rec, rec, rec, rec, tasks)
    events = AgentEvents(intake)
    key = ShardKey("j", 0, 3)
    view.published["j-s3"] = Published("j-s3", "3.sib", key, "3")
    os.mkdir(os.path.join(store.view, "5"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            tasks.nursery = nursery
            events.renamed(b"tmp.yaml", b"replicator.yaml", stat.S_IFREG | 0o644)
            events.renamed(b"j-s3", b"3", stat.S_IFLNK | 0o777)
            events.released(b"5/a.bin", 17)
            events.released(None, 18)
            intake.close()
            await intake.process()

    trio.run(main)
    assert rec.calls[0] == ("control",)  # handled at once; materializing is a task
    assert sorted(rec.calls[1:], key=str) == [("materialize", "3", key), ("retry", "5")]
    assert "j-s3" not in view.published
    assert book.generation == {"tmp.yaml": 1, "replicator.yaml": 1, "j-s3": 1, "3": 1, "5": 1}


def test_a_removed_step_leaves_the_book(tmp_path):
    store = RamStore(str(tmp_path / "r"))
    view = ClientView(store)
    book = StepBook(store, JobState(), view, {})
    rec = Recorder()
    intake = EventIntake(
        store, book, view, fake_ports.catalog(), rec, rec, rec, rec, TaskSpawner(deque())
    )
    book.view_steps["4"] = ShardKey("j", 0, 4)
    book.pending["4"] = candidate(4)
    intake.post(Changed("4"))  # what the FUSE thread reports after an rmdir
    intake.close()
    trio.run(intake.process)
    assert book.view_steps == {} and book.pending == {} and rec.calls == []


# ---------------------------------------------------------------------- job control


def test_a_bad_yaml_is_reported_and_deleted_and_a_good_one_starts_the_restore(tmp_path):
    parts = build(tmp_path)
    control_part = parts.agent.control
    yaml = pathlib.Path(parts.view.root) / "replicator.yaml"
    started: list[JobSpec] = []

    async def restore(job: JobSpec) -> None:
        started.append(job)

    parts.agent.restores.restore = restore  # type: ignore[method-assign]

    async def consume() -> None:
        control_part.start_control()

    yaml.write_text("framework: orbax\nnode-rank: 0\nnodes: 1\n")
    run_with_tasks(parts, consume)
    failed = (pathlib.Path(parts.view.root) / "replicator.failed").read_text()
    assert "missing required key 'job-name'" in failed
    assert not yaml.exists() and parts.state.job is None and started == []

    yaml.write_text("job-name: train\nframework: orbax\nnode-rank: 1\nnodes: 2\n")
    run_with_tasks(parts, consume)
    job = parts.state.job
    assert job is not None and job.name == "train" and job.node_rank == 1
    assert parts.state.mode == "protocol" and parts.agent.book.rules is not None
    assert parts.state.restore_state["state"] == "cleanup"
    assert started == [job] and not yaml.exists()


def test_the_generic_job_follows_the_configuration(tmp_path):
    parts = build(tmp_path, job="run7", node_rank=2, nodes=4)
    job = parts.agent.control.generic_job()
    assert (job.name, job.framework, job.node_rank, job.nodes) == ("run7", "generic", 2, 4)
    parts.agent.control.set_job(None, "protocol")
    assert parts.state.mode == "none" and parts.agent.book.rules is None


# ---------------------------------------------------------------------- restore driver


def test_the_restore_outcome_and_its_lines(tmp_path):
    parts = build(tmp_path)
    reporter = fake_ports.FakeJob()
    driver = RestoreDriver(
        parts.state,
        parts.restorer,
        parts.view,
        parts.agent.book,
        parts.catalog,
        parts.agent.keeper,
        reporter,
        parts.agent.tasks,
    )
    nothing = driver.report_plan(RestorePlan(None, detail={}))
    assert nothing == {"outcome": "incomplete", "reason": "", "problems": []}
    assert reporter.errors == ["restore: nothing restored: no step is complete"]
    reporter.errors.clear()
    problems = ["rank 1 lost", "step 6 is incomplete"]  # the reason's line is not repeated
    older = RestorePlan(5, detail={"reason": "step 6 is incomplete", "problems": problems})
    assert driver.report_plan(older)["outcome"] == "restored"
    assert reporter.errors == [
        "restore: step 5 restored: step 6 is incomplete",
        "restore: rank 1 lost",
    ]


def test_a_summons_starts_one_generic_restore_at_a_time(tmp_path):
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    driver = parts.agent.restores
    assert parts.state.job is not None
    assert driver.start_generic(parts.state.job) is True
    assert parts.state.restore_state["state"] == "pending"
    assert driver.start_generic(parts.state.job) is False  # one at a time


def test_a_summons_before_the_start_up_restore_is_this_nodes_own_restore(tmp_path):
    """Regression (#16 sixth trial N1): a restarted node summoned before its own
    start-up restore began ran the round as a summoned survivor and never dropped its
    newer (abandoned) steps. A daemon's first generic restore is its own."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    driver = parts.agent.restores
    job = parts.state.job
    assert job is not None
    driver.summoned(job)  # the heartbeat's summons came first
    assert parts.state.restore_state == {
        "state": "pending",
        "since": parts.state.restore_state["since"],
        "summoned": False,
    }
    # after a restore ended, a summons is another node's round
    driver._generic_running, driver._fresh = False, False
    driver.summoned(job)
    assert parts.state.restore_state["summoned"] is True


# ---------------------------------------------------------------------- steps and tasks


def test_the_step_book_round_trips_through_state_json(tmp_path):
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "protocol")
    book = parts.agent.book
    write_step(parts, 10)
    book.view_steps.update({"10": ShardKey("j", 0, 10), "gone": ShardKey("j", 0, 9)})
    book.pending["20"] = candidate(20, "closed")
    parts.state.restore_state = {"state": "done", "step": 10}
    book.save()

    again = build(tmp_path)
    job = again.agent.book.load()
    assert job == JOB
    assert again.agent.book.view_steps == {"10": ShardKey("j", 0, 10)}  # "gone" is not there
    assert [c.name for c in again.agent.book.pending_at_start] == ["20"]
    assert again.state.restore_state == {"state": "done", "step": 10}


def test_a_failing_task_is_reported_and_not_fatal():
    errors: deque[str] = deque()
    tasks = TaskSpawner(errors)
    ran: list[str] = []

    async def boom() -> None:
        raise ValueError("bad")

    async def fine(word: str) -> None:
        ran.append(word)

    tasks.spawn(fine, "before")  # no nursery yet: nothing runs

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            tasks.nursery = nursery
            tasks.spawn(boom)
            tasks.spawn(fine, "after")

    trio.run(main)
    assert ran == ["after"]
    assert list(errors) == ["internal error in boom: bad"]


def test_a_restore_links_back_the_files_removed_from_a_sealed_step(tmp_path):
    """Regression (#15 new-user trial, jobs sd and sf): ``.metadata`` (or a shard) was
    removed from a sealed DCP step in the mount; the restore said ``restored step 20
    from local`` (exit 0) and ``dcp.load`` failed, the view keeping the step without
    the file. The restore now presents the step as sealed."""
    from tierfs.store.shards import ShardStore

    store = RamStore(str(tmp_path / "r"))
    view = ClientView(store)
    step = pathlib.Path(store.view) / "step_20"
    (step / "sub").mkdir(parents=True)
    (step / ".metadata").write_bytes(b"m" * 100)
    (step / "__0_0.distcp").write_bytes(b"d" * 300)
    (step / "sub" / "x.bin").write_bytes(b"x" * 7)
    shard = ShardStore(store).snapshot(
        store.view, ShardKey("j", 0, 20), "step_20", ["step_20"], "generic"
    )
    os.unlink(step / ".metadata")
    (step / "sub" / "x.bin").unlink()
    (step / "sub").rmdir()
    (step / "extra.txt").write_bytes(b"the client's")  # not the step's: left alone
    assert view.link_missing(shard) == ["step_20/.metadata", "step_20/sub"]
    assert (step / ".metadata").read_bytes() == b"m" * 100
    assert (step / "sub" / "x.bin").read_bytes() == b"x" * 7
    assert (step / "extra.txt").read_bytes() == b"the client's"
    assert view.link_missing(shard) == []  # whole: nothing to do
    # a step removed from the view comes back whole (as before)
    shutil.rmtree(step)
    assert view.link_missing(shard) == ["step_20"]
    assert sorted(os.listdir(step)) == [".metadata", "__0_0.distcp", "sub"]


def test_a_trainer_start_after_later_seals_starts_this_nodes_own_round(tmp_path):
    """#16 sixth trial N4, the remainder: a node summoned into a round that restored
    step 2 kept running; the job sealed step 4 here and restarted. ``tierfs wait``
    printed the stale ``restored step 2``; a trainer start now opens a new round in
    which this node is a restarted node (its newer steps are abandoned there)."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    driver = parts.agent.restores
    driver._fresh = False
    write_step(parts, 4)
    seal(parts, 4)
    parts.state.restore_state = {"state": "done", "step": 2, "at": 1.0, "summoned": True}
    parts.agent.trainer_start()  # what the open of .tierfs/restart for writing calls
    assert parts.state.restore_state["state"] == "pending"
    assert parts.state.restore_state["summoned"] is False
    answer = json.loads(parts.agent.restart_json())
    assert answer["action"] == "round" and "step 4" in answer["why"]
    # a second trainer start while that round runs joins it
    parts.agent.trainer_start()
    assert json.loads(parts.agent.restart_json())["action"] == "join"
    assert driver._waiting_start is not None


def test_a_trainer_start_after_a_summoned_round_abandons_the_newer_steps(tmp_path):
    """Summoned into another node's round that agreed on step 2, the node kept its step
    4 (its trainer might still run); its trainer starting now resumes from step 2, so
    step 4 is abandoned as a restarted node's would be."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    write_step(parts, 4)
    seal(parts, 4)
    key = ShardKey("j", 0, 4)
    assert key in parts.catalog
    parts.state.restore_state = {"state": "done", "step": 2, "at": 4e9, "summoned": True}
    parts.agent.trainer_start()
    assert key not in parts.catalog
    assert parts.state.restore_state["state"] == "done"  # no new round
    assert json.loads(parts.agent.restart_json())["action"] == "current"


def test_trainer_starts_of_one_burst_share_a_result_and_a_later_one_restarts(tmp_path):
    """#16 seventh trial C: local ranks of one start (seconds apart) get the settled
    result; a start SAME_START later is a restart of the job and opens a round, so a
    node without newer steps no longer answers apart from one that has them."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    driver = parts.agent.restores
    driver._fresh = False
    parts.state.restore_state = {"state": "done", "step": 2, "at": 100.0, "summoned": False}
    assert driver.trainer_start().action == "current"
    assert driver.trainer_start().action == "current"  # another local rank
    assert parts.state.restore_state["state"] == "done"
    assert driver._handed is not None
    driver._handed = (100.0, driver._handed[1] - 3600, frozenset())  # an hour ago
    assert driver.trainer_start().action == "round"
    assert parts.state.restore_state["state"] == "pending"


def test_a_step_waiting_for_its_seal_at_a_trainer_start_opens_a_round(tmp_path):
    """#16 seventh trial B: node 0 renamed step 20 into place while a file of it was
    still open, so its seal waited; its trainer start answered ``current`` with the
    old step 10 while node 1, which had sealed 20, opened a round. A pending seal of a
    newer step counts as written since the restore."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    driver = parts.agent.restores
    driver._fresh = False
    parts.state.restore_state = {"state": "done", "step": 10, "at": 100.0, "summoned": False}
    assert driver.trainer_start().action == "current"  # the first start: it stands
    parts.agent.book.pending["20"] = candidate(20)  # (within the same-start window)
    assert driver.trainer_start().action == "round"


def test_local_ranks_around_a_seal_that_completes_between_them_share_one_round(tmp_path):
    """#16 eighth trial D: rank A starts while step 20 waits for its seal (a round
    opens); the seal completes after the round; rank B, seconds later, gets the same
    result instead of opening a second round."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    driver = parts.agent.restores
    driver._fresh = False
    parts.state.restore_state = {"state": "done", "step": 10, "at": 100.0, "summoned": False}
    driver.trainer_start()  # the first start ever: it stands
    parts.agent.book.pending["20"] = candidate(20)
    driver._handed = (100.0, driver._handed[1] - 3600, frozenset())  # restarted later
    assert driver.trainer_start().action == "round"  # rank A
    # the round ends (step 10); step 20's seal completes after it
    del parts.agent.book.pending["20"]
    write_step(parts, 20)
    driver._generic_running = False
    parts.state.restore_state = {"state": "done", "step": 10, "at": time.time() - 1}
    assert driver._waiting_start is not None
    at = parts.state.restore_state["at"]
    driver._handed = (at, driver._waiting_start, driver._waiting_steps)
    driver._waiting_start = None
    seal(parts, 20)
    assert driver.trainer_start().action == "current"  # rank B: the same start


def dcp_files(parts: NodeParts, step: int) -> list[str]:
    """The DCP data files of this node's sealed part of ``step``."""
    files = parts.catalog[ShardKey("j", 0, step)].manifest.files
    return sorted(f.path for f in files if f.path.endswith(".distcp"))


def test_a_dcp_part_of_fewer_ranks_than_the_last_one_waits_for_the_other_ranks_file(tmp_path):
    """Regression (#14 trial 54 F4): with two ranks per node, rank 2's ``__2_0.distcp``
    closed before rank 3 had created ``__3_0.distcp``; the part was sealed with rank 2's
    file alone, replicated and logged "saved again" a moment later. Now a part of fewer
    of this node's ranks than its previous DCP part waits for the other's file."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    book, sealer, view = parts.agent.book, parts.agent.sealer, parts.view
    root = pathlib.Path(view.root)

    def closed(rel: str) -> SealCandidate:
        path = root / rel
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(rel.encode() * 100)
        book.generation[rel.partition("/")[0]] += 1  # as the close's event does
        assert book.rules is not None
        cand = book.rules.on_release(rel, view)
        assert cand is not None and cand.reason.startswith("DCP part")
        return cand

    async def body() -> None:
        for rel in ("10/__2_0.distcp", "10/__3_0.distcp"):
            sealer.schedule(closed(rel))  # no earlier DCP part: sealed at once
            await trio.testing.wait_all_tasks_blocked()
        sealer.schedule(closed("20/__2_0.distcp"))
        await trio.testing.wait_all_tasks_blocked()
        assert ShardKey("j", 0, 20) not in parts.catalog  # rank 3's file still to come
        assert "20" in sealer._deferred
        sealer.schedule(closed("20/__3_0.distcp"))
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)
    assert sealer._deferred == {}
    assert dcp_files(parts, 20) == ["20/__2_0.distcp", "20/__3_0.distcp"]
    assert dcp_files(parts, 10) == ["10/__2_0.distcp", "10/__3_0.distcp"]


def one_rank_fewer(tmp_path: pathlib.Path) -> tuple[NodeParts, SealCandidate]:
    """A node whose DCP part of step 10 had ranks 2 and 3 and whose part of step 20 has
    rank 2's file only (the job runs one rank per node now): (parts, the candidate of
    that file's close)."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    book, view = parts.agent.book, parts.view
    root = pathlib.Path(view.root)
    last = None
    for rel in ("10/__2_0.distcp", "10/__3_0.distcp", "20/__2_0.distcp"):
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(b"d" * 100)
        assert book.rules is not None
        last = book.rules.on_release(rel, view)
    assert last is not None
    return parts, last


def test_a_dcp_part_of_fewer_ranks_is_sealed_after_the_grace(tmp_path):
    """The count of the previous DCP part only delays a seal: a node that now runs one
    rank (the job restarted with fewer processes per node) seals after the grace."""
    parts, last = one_rank_fewer(tmp_path)
    book, sealer, view = parts.agent.book, parts.agent.sealer, parts.view
    root = pathlib.Path(view.root)
    assert book.rules is not None
    assert book.rules.awaits_ranks(last, view)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            sealer.schedule(last)
            await trio.sleep(sealer.ranks_grace - 1)
            assert ShardKey("j", 0, 20) not in parts.catalog
        parts.agent.tasks.nursery = None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert dcp_files(parts, 20) == ["20/__2_0.distcp"]
    (root / "30").mkdir()
    (root / "30/__2_0.distcp").write_bytes(b"e" * 100)
    nxt = book.rules.on_release("30/__2_0.distcp", view)
    assert nxt is not None and not book.rules.awaits_ranks(nxt, view)  # one rank now


def test_a_load_of_the_step_ends_the_wait_for_the_other_ranks_files(tmp_path):
    """Regression (#14 trial 58 H1): a job moved from 2 ranks per node to 1 on the same
    daemons; each node's first DCP part waited the whole rank grace (15 s) and the
    coordinator node's lookup of its file, waiting 10 s, answered ENOENT: ``dcp.load``
    failed after a save that succeeded. A lookup of ``.metadata`` by this node's client
    (a load began: the save returned on every rank) seals such a part at once; a
    candidate waiting for its marker is not concerned."""
    parts, last = one_rank_fewer(tmp_path)
    book, sealer, view = parts.agent.book, parts.agent.sealer, parts.view
    root = pathlib.Path(view.root)
    assert book.rules is not None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            sealer.schedule(last)
            await trio.sleep(1)
            sealer.save_done("10")  # another directory: nothing
            sealer.save_done("30")
            await trio.sleep(1)
            assert ShardKey("j", 0, 20) not in parts.catalog and "20" in sealer._deferred
            began = trio.current_time()
            sealer.save_done("20")
            with trio.fail_after(sealer.ranks_grace / 2):
                while ShardKey("j", 0, 20) not in parts.catalog:
                    await trio.sleep(0.01)
            assert trio.current_time() - began < sealer.ranks_grace / 2
            assert sealer._deferred == {} and book.pending == {}
        parts.agent.tasks.nursery = None

    trio.run(main)
    assert dcp_files(parts, 20) == ["20/__2_0.distcp"]
    # the node runs one rank now: neither a save of step 20 again nor of another step
    # waits for a second rank (#14 trial 58 L1: every re-save waited the grace again)
    (root / "30").mkdir()
    (root / "30/__2_0.distcp").write_bytes(b"e" * 100)
    for rel in ("20/__2_0.distcp", "30/__2_0.distcp"):
        cand = book.rules.on_release(rel, view)
        assert cand is not None and not book.rules.awaits_ranks(cand, view), rel


def test_the_step_directories_a_node_is_saving(tmp_path):
    """What the heartbeat reports up (#14 trial 54 F2): a step directory whose seal is
    still to come (here: waiting for the other rank's DCP file); files opened for
    writing are looked up in the namespace (none here: no mount), and forgotten once
    closed for longer than OPEN_GRACE."""
    from tierfs.node import intake as intake_mod

    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    book, sealer, view, intake = (
        parts.agent.book,
        parts.agent.sealer,
        parts.view,
        parts.agent.intake,
    )
    root = pathlib.Path(view.root)
    assert intake.saving() == []
    intake.write_opening(12345)
    assert 12345 in intake.write_opened
    assert intake.saving() == [] and 12345 in intake.write_opened  # its open may count soon
    intake.write_opened[12345] -= intake_mod.OPEN_GRACE + 1
    assert intake.saving() == [] and intake.write_opened == {}

    def closed(rel: str) -> SealCandidate:
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(b"d" * 100)
        assert book.rules is not None
        cand = book.rules.on_release(rel, view)
        assert cand is not None
        return cand

    for rel in ("10/__2_0.distcp", "10/__3_0.distcp"):
        cand = closed(rel)

        async def one(cand: SealCandidate = cand) -> None:
            sealer.schedule(cand)

        run_with_tasks(parts, one)  # its seal is done when the nursery ends
    assert intake.saving() == []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            sealer.schedule(closed("20/__2_0.distcp"))  # waits for rank 3's file
            assert intake.saving() == ["20"]
            await trio.sleep(1)
            assert intake.saving() == ["20"]
            sealer.schedule(closed("20/__3_0.distcp"))
        parts.agent.tasks.nursery = None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert intake.saving() == []
    assert dcp_files(parts, 20) == ["20/__2_0.distcp", "20/__3_0.distcp"]


def test_a_dcp_part_that_got_rank_0s_file_is_left_to_its_marker(tmp_path):
    """#14 trial 55 F4: on the node of ranks 0 and 1, rank 1's file closed before rank 0
    created its own; the part waited for the rank grace, then was sealed without
    ``.metadata`` (rank 3 was 15 s late), and the cross-rank judge wrote "step 54 is
    not loadable" to replicator.errors. A DCP part whose directory holds this node's
    file of rank 0 when its seal begins is left to ``.metadata``."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    book, sealer, view = parts.agent.book, parts.agent.sealer, parts.view
    root = pathlib.Path(view.root)
    (root / "20").mkdir()
    (root / "20/__1_0.distcp").write_bytes(b"d" * 100)
    assert book.rules is not None
    cand = book.rules.on_release("20/__1_0.distcp", view)
    assert cand is not None and cand.reason == "DCP part __1_0.distcp (no rank 0's file here)"
    (root / "20/__0_0.distcp").write_bytes(b"d" * 100)  # rank 0 created its file since

    async def body() -> None:
        sealer.schedule(cand)

    run_with_tasks(parts, body)
    assert ShardKey("j", 0, 20) not in parts.catalog and "20" not in book.pending
    (root / "20/.metadata").write_bytes(b"m")
    marker = book.rules.on_release("20/.metadata", view)
    assert marker is not None

    async def sealed() -> None:
        sealer.schedule(marker)

    run_with_tasks(parts, sealed)
    assert dcp_files(parts, 20) == ["20/__0_0.distcp", "20/__1_0.distcp"]


def test_a_recently_changed_step_directory_counts_as_being_saved(tmp_path):
    """#14 trial 55 F1: a save of a few milliseconds falls between two heartbeats; the
    step directories the client changed in the last RECENT s are reported too."""
    from tierfs.node import intake as intake_mod

    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    intake = parts.agent.intake
    intake.bump("20")
    intake.bump("notes")  # not a step directory
    assert intake.saving() == ["20"]
    intake.touched["20"] -= intake_mod.RECENT + 1
    assert intake.saving() == [] and "20" not in intake.touched


def two_ranks_part(tmp_path: pathlib.Path, data: bytes) -> NodeParts:
    """A node of ranks 2 and 3 whose view holds ``20/__2_0.distcp`` and
    ``20/__3_0.distcp`` (``data`` each), not sealed yet."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    root = pathlib.Path(parts.view.root)
    (root / "20").mkdir()
    for rank in (2, 3):
        (root / f"20/__{rank}_0.distcp").write_bytes(data)
    return parts


def test_a_close_handled_after_a_seal_that_took_its_file_does_not_seal_again(tmp_path):
    """Regression (#14, stop 50 CI, test_a_load_right_after_a_save_where_one_rank_seals_
    later_finds_every_file): two ranks per node; rank 3 closed ``__3_0.distcp`` while
    the seal of rank 2's close began, the seal took both files, and the close event,
    handled after it, sealed and replicated the same part a second time. A candidate
    of an entry unchanged since its seal is that seal; a change after it seals again."""
    parts = two_ranks_part(tmp_path, b"d" * 100)
    book, sealer, view = parts.agent.book, parts.agent.sealer, parts.view
    root = pathlib.Path(view.root)
    assert book.rules is not None
    first = book.rules.on_release("20/__2_0.distcp", view)
    late = book.rules.on_release("20/__3_0.distcp", view)
    assert first is not None and late is not None
    key = ShardKey("j", 0, 20)

    async def settled() -> None:  # the seal's snapshot runs in a worker thread
        with trio.fail_after(10):
            while book.pending:
                await trio.sleep(0.01)

    async def body() -> None:
        sealer.schedule(first)
        await settled()
        sealed = parts.catalog.get(key)
        assert sealed is not None
        sealer.schedule(late)  # no change since the seal: the same part
        await settled()
        assert parts.catalog.get(key) is sealed
        (root / "20/__3_0.distcp").write_bytes(b"e" * 100)
        book.generation["20"] += 1  # the close of a write bumps it (AgentEvents)
        sealer.schedule(late)
        await settled()
        again = parts.catalog.get(key)
        assert again is not None and again is not sealed

    run_with_tasks(parts, body)


def test_a_part_saved_again_waits_for_its_other_ranks_files_of_the_earlier_save(
    tmp_path, monkeypatch
):
    """Regression (#14 trial 59 H1, HIGH): two ranks per node, a step saved again in
    place (another save: its part was withdrawn). The part was sealed 8 ms after rank 3
    rewrote its file, with rank 2's file of the earlier save; the job was then killed
    and every load, the verdict and a restart took the mix of two saves. Such a part
    now waits for the other rank's file to be written again; if that never comes, it is
    sealed after the grace with a line in replicator.errors (a save cut short)."""
    from tierfs.node import resave

    parts = two_ranks_part(tmp_path, b"first save" * 10)
    book, sealer, view = parts.agent.book, parts.agent.sealer, parts.view
    root = pathlib.Path(view.root)
    assert book.rules is not None
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    first = parts.catalog[key]
    monkeypatch.setattr(resave, "RESAVE_GAP", 0.0)  # another save (as after a load)
    time.sleep(0.05)  # the earlier save's files are older than the new save's start
    three = root / "20/__3_0.distcp"
    parts.agent.intake.write_opening(three.stat().st_ino)  # withdraws the part
    assert key not in parts.catalog and book.earlier[key].began > 0
    three.write_bytes(b"second save" * 10)
    book.generation["20"] += 1
    late = book.rules.on_release("20/__3_0.distcp", view)
    assert late is not None
    lines: list[str] = []
    sealer.reporter = type("R", (), {"error": lambda self, m: lines.append(m)})()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            sealer.schedule(late)
            await trio.sleep(1)
            assert key not in parts.catalog and "20" in sealer._deferred  # rank 2 to come
            # rank 2 writes again: sealed at once with both files of the new save
            two = root / "20/__2_0.distcp"
            two.write_bytes(b"second save" * 10)
            book.generation["20"] += 1
            cand = book.rules.on_release("20/__2_0.distcp", view)
            assert cand is not None
            sealer.schedule(cand)
            with trio.fail_after(5):
                while key not in parts.catalog:
                    await trio.sleep(0.01)
        parts.agent.tasks.nursery = None

    trio.run(main)
    assert parts.catalog[key] is not first and lines == []
    assert sorted(
        f.path for f in parts.catalog[key].manifest.files if f.path.endswith(".distcp")
    ) == ["20/__2_0.distcp", "20/__3_0.distcp"]

    # the next save again is cut short: rank 3 writes, rank 2 never does
    second = parts.catalog[key]
    time.sleep(0.05)  # the earlier save's files are older than the new save's start
    parts.agent.intake.write_opening(three.stat().st_ino)
    three.write_bytes(b"third save" * 10)
    book.generation["20"] += 1
    cut = book.rules.on_release("20/__3_0.distcp", view)
    assert cut is not None

    async def grace() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            sealer.schedule(cut)
            await trio.sleep(sealer.ranks_grace - 1)
            assert key not in parts.catalog
        parts.agent.tasks.nursery = None

    trio.run(grace, clock=trio.testing.MockClock(autojump_threshold=0))
    assert parts.catalog[key] is not second  # sealed after the grace, and said
    assert len(lines) == 1 and "__2_0.distcp of the earlier save" in lines[0], lines
    # trial 60: and the part never loads: node-rank 0's verdict and a restore skip it
    cut_part = parts.catalog[key]
    unloadable, _ = eligibility(cut_part.manifest)
    assert unloadable.startswith("unfinished: 20/__2_0.distcp: of an earlier save"), unloadable
    assert "not loadable and not restored" in lines[0]

    # rank 2 was only late (past the grace): its write continues the save cut short,
    # which is now whole; rank 3's file is not taken for one of an earlier save
    time.sleep(0.05)
    two = root / "20/__2_0.distcp"
    parts.agent.intake.write_opening(two.stat().st_ino)
    two.write_bytes(b"third save" * 10)
    book.generation["20"] += 1
    came = book.rules.on_release("20/__2_0.distcp", view)
    assert came is not None

    async def late_rank() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            sealer.schedule(came)
            with trio.fail_after(5):
                while parts.catalog.get(key) in (None, cut_part):
                    await trio.sleep(0.01)
        parts.agent.tasks.nursery = None

    trio.run(late_rank)
    assert eligibility(parts.catalog[key].manifest)[0] == ""
    assert len(lines) == 1, lines
