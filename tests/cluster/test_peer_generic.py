"""Generic mode (no control file): job parameters from flags, restore under original names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tierfs
from peer_cluster import Cluster, flip_byte, job_args, tree_hashes, wait_until

pytestmark = pytest.mark.slow

TRAIN = str(Path(__file__).resolve().parents[1] / "support" / "torch_train.py")


def generic(n: int):
    return job_args("hf", n)


def train(root: Path, until: int, seed: int) -> dict:
    proc = subprocess.run(
        [sys.executable, TRAIN, str(root), "--until", str(until), "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def replicated(c: Cluster, i: int, step: int) -> bool:
    return any(s["step"] == step and s["state"] == "replicated" for s in c.status(i)["steps"])


@pytest.mark.long
def test_torch_loop_resumes_after_a_node_loses_its_ram(make_mount):
    c = Cluster(make_mount, 2, node_args=generic(2))
    procs = [
        subprocess.Popen(
            [sys.executable, TRAIN, str(c.root(i)), "--until", "6", "--seed", str(i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        assert json.loads(out.strip().splitlines()[-1])["resumed_from"] is None
    for i in range(2):
        wait_until(lambda i=i: replicated(c, i, 6), 60, f"node {i}'s step 6 to be replicated")
    before = tree_hashes(c.root(1) / "checkpoint-6")
    assert set(before) == {"model.pt", "optimizer.pt", "trainer_state.json"}
    c.lose(1)
    c.remount(1)
    # the mount returns before the cluster agreed on a step; `tierfs wait` waits for it
    # (a trainer started right after the mount once began from scratch)
    waited = tierfs("wait", str(c.root(1)), "--timeout", "60")
    assert waited.stdout.strip() == "restored step 6 from peer:0"
    assert tree_hashes(c.root(1) / "checkpoint-6") == before
    restore = c.status(1)["restore"]
    assert restore["step"] == 6 and restore["source"] == "peer:0"
    assert "checkpoint-6" in restore["created"]
    again = train(c.root(1), 8, seed=1)
    assert again["resumed_from"] == 6 and again["step"] == 8


@pytest.mark.parametrize("finder", ["holder", "reader"])
def test_corrupt_copy_caught_by_the_holder_falls_back_a_step(make_mount, monkeypatch, finder):
    """The live holder takes part in the restore round (summoned); with
    TIERFS_REVERIFY_AFTER=0 it verifies its copies first and discards the bad one;
    by default (the copy was checked when it arrived) the restarted node finds the bad
    bytes when it fetches them. Either way every node agrees on the older step."""
    if finder == "holder":
        monkeypatch.setenv("TIERFS_REVERIFY_AFTER", "0")
    c = Cluster(make_mount, 2, node_args=generic(2))
    for step in (2, 4):
        for i in range(2):
            tmp = c.root(i) / f"tmp-checkpoint-{step}"
            tmp.mkdir()
            (tmp / "weights.bin").write_bytes(os.urandom(300_000))
            (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
            os.rename(tmp, c.root(i) / f"checkpoint-{step}")
    for i in range(2):
        wait_until(lambda i=i: replicated(c, i, 4), 60, f"node {i}'s step 4 to be replicated")
    before = tree_hashes(c.root(1) / "checkpoint-2")
    flip_byte(c.mounts[0].ram_dir / "store/shards/hf/1/4/data/checkpoint-4/weights.bin")
    c.lose(1)
    c.remount(1)
    wait_until(lambda: c.status(1)["restore"].get("state") == "done", 60, "the restore")
    assert c.status(1)["restore"]["step"] == 2, c.logs()
    assert tree_hashes(c.root(1) / "checkpoint-2") == before
    assert not (c.root(1) / "checkpoint-4").exists()
    errors = c.errors(1)
    assert "step 4 lacks rank(s) [1]" in errors
    if finder == "holder":
        held = c.errors(0)
        assert "step 4 of rank 1 failed verification" in held and "crc32c" in held
        assert "node-rank 0 discarded its copy of step 4 of rank 1" in errors
    else:
        assert "the copy of step 4 of rank 1 on node-rank 0 is bad" in errors
        assert "crc32c" in errors
    survivor = c.status(0)["restore"]
    assert (survivor["state"], survivor["step"], survivor["summoned"]) == ("done", 2, True)


def test_bad_copies_found_at_a_restart_are_never_served_by_the_view(make_mount):
    """#16 fifth trial F6 and F7: node 1's own part of step 2 and its replica of rank 0
    each had a flipped byte. Its restart found both, restored its part verified from
    node 0 and said so (``restored step 2 from peer:0``, exit 0), but the view kept
    the hard links to the discarded copies: the mount served the corrupt bytes."""
    c = Cluster(make_mount, 2, node_args=generic(2))
    saved = {}
    for i in range(2):
        tmp = c.root(i) / "tmp-checkpoint-2"
        tmp.mkdir()
        saved[f"weights-{i}.bin"] = os.urandom(300_000)
        (tmp / f"weights-{i}.bin").write_bytes(saved[f"weights-{i}.bin"])
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
        os.rename(tmp, c.root(i) / "checkpoint-2")
    for i in range(2):
        wait_until(lambda i=i: replicated(c, i, 2), 60, f"node {i}'s step 2 to be replicated")
    # node 1 shows rank 0's file of the step (from the replica it holds)
    wait_until(lambda: (c.root(1) / "checkpoint-2" / "weights-0.bin").exists(), 60, "rank 0's file")
    shards = c.mounts[1].ram_dir / "store/shards/hf"
    flip_byte(shards / "1/2/data/checkpoint-2/weights-1.bin", 150_000)  # its own part
    flip_byte(shards / "0/2/data/checkpoint-2/weights-0.bin", 150_000)  # its replica
    c.mounts[1].unmount()
    c.remount(1)
    waited = tierfs("wait", str(c.root(1)), "--timeout", "60")
    assert waited.stdout.strip() == "restored step 2 from peer:0", c.logs()
    errors = c.errors(1)
    assert "step 2 of rank 1 failed verification" in errors, errors
    assert "step 2 of rank 0 failed verification" in errors, errors
    for name, data in saved.items():
        # the own file: linked back from the verified copy; rank 0's: fetched again
        got = wait_until(
            lambda name=name: _read(c.root(1) / "checkpoint-2" / name), 60, f"{name} shown"
        )
        assert got == data, f"{name} served with other bytes than saved\n" + c.logs()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def test_a_survivors_wait_after_a_node_loss_waits_for_the_round_not_its_fresh_start(
    make_mount,
):
    """#16 sixth trial N4 (a silent fresh start): the job started fresh, saved steps 2
    and 4, then node 1 was lost. ``tierfs wait`` on the survivor, started at once (as
    a scheduler restarts every worker), printed its restore at mount time, ``nothing
    to restore ... a fresh start`` with exit 0, while it held step 4. It now waits for
    the round the restarted node starts and prints that round's step."""
    from conftest import TIERFS

    c = Cluster(make_mount, 2, node_args=generic(2))
    for i in range(2):
        w = tierfs("wait", str(c.root(i)), "--timeout", "60")
        assert w.stdout.startswith("nothing to restore"), w.stdout
    for step in (2, 4):
        for i in range(2):
            tmp = c.root(i) / f"tmp-checkpoint-{step}"
            tmp.mkdir()
            (tmp / f"weights-{i}.bin").write_bytes(os.urandom(100_000))
            (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
            os.rename(tmp, c.root(i) / f"checkpoint-{step}")
    for i in range(2):
        wait_until(lambda i=i: replicated(c, i, 4), 60, f"node {i}'s step 4 to be replicated")
    c.lose(1)
    survivor = subprocess.Popen(
        [*TIERFS, "wait", str(c.root(0)), "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # (before, it printed the fresh start at once, long before node 1 is back)
        c.remount(1)
        out, err = survivor.communicate(timeout=150)
    finally:
        if survivor.poll() is None:
            survivor.kill()
    assert survivor.returncode == 0, (out, err, c.logs())
    assert out.strip() == "restored step 4 from local", (out, err)
    w = tierfs("wait", str(c.root(1)), "--timeout", "60")
    assert w.stdout.strip() == "restored step 4 from peer:0", w.stdout


def save_step(c: Cluster, step: int, nodes: list[int]) -> None:
    """Each of ``nodes`` saves its part of ``checkpoint-<step>/`` (temp dir, rename)."""
    for i in nodes:
        tmp = c.root(i) / f"tmp-checkpoint-{step}"
        tmp.mkdir()
        (tmp / f"weights-{i}.bin").write_bytes(os.urandom(100_000))
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        os.rename(tmp, c.root(i) / f"checkpoint-{step}")


def holds_own(c: Cluster, i: int, step: int) -> bool:
    """Node ``i``'s RAM store holds its own sealed part of ``step``."""
    return (c.mounts[i].ram_dir / f"store/shards/hf/{i}/{step}/manifest.json").exists()


def test_trainers_restarted_beside_running_daemons_get_one_new_round(make_mount):
    """#16 sixth trial N4, the remainder: node 0 was summoned into node 1's restore
    round (step 2) and kept running; the job saved step 4, node 0 sealed step 6 and
    node 1 died before its part of it; the scheduler restarted both trainers on the
    daemons that kept running. ``tierfs wait`` on node 0 printed its stale result,
    ``restored step 2 from local`` (exit 0), while node 1 had no round at all. Now
    each wait tells its daemon that a trainer starts: one new round, step 4 on both
    (exit 2, step 6 lacks rank 1), and node 0's part of step 6 is abandoned."""

    c = Cluster(make_mount, 2, node_args=generic(2))
    save_step(c, 2, [0, 1])
    for i in range(2):
        wait_until(lambda i=i: replicated(c, i, 2), 60, f"node {i}'s step 2 to be replicated")
    c.lose(1)
    c.remount(1)
    assert tierfs("wait", str(c.root(1)), "--timeout", "60").stdout.strip() == (
        "restored step 2 from peer:0"
    )
    wait_until(lambda: c.status(0)["restore"].get("summoned") is True, 60, "node 0 summoned")
    w0 = tierfs("wait", str(c.root(0)), "--timeout", "60")
    assert w0.stdout.strip() == "restored step 2 from local", w0.stdout
    save_step(c, 4, [0, 1])
    for i in range(2):
        wait_until(lambda i=i: replicated(c, i, 4), 60, f"node {i}'s step 4 to be replicated")
    save_step(c, 6, [0])  # node 1's trainer dies before its part of step 6
    wait_until(lambda: holds_own(c, 0, 6), 60, "node 0's part of step 6")
    outs = waits_at_once(c, [0, 1])
    for i, (code, out, err) in enumerate(outs):
        assert code == 2, (i, out, err, c.logs())  # an older step: said
        assert out.strip() == "restored step 4 from local", (i, out, err)
        assert "step 6 lacks rank(s) [1]" in err, (i, err)
    # one of the waits started the round (the other joined it, or was asked in first)
    assert any("a new restore round for the restarted trainer" in err for *_, err in outs), outs
    assert not holds_own(c, 0, 6), c.logs()  # abandoned: never a restore's candidate again


def waits_at_once(c: Cluster, nodes: list[int]) -> list[tuple[int, str, str]]:
    """``tierfs wait`` on ``nodes`` started together (a scheduler restarting every
    trainer); (exit code, stdout, stderr) of each."""
    from conftest import TIERFS

    procs = [
        subprocess.Popen(
            [*TIERFS, "wait", str(c.root(i)), "--timeout", "120"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in nodes
    ]
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=150)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def test_a_restart_where_only_one_node_saved_on_gets_one_step_everywhere(make_mount, monkeypatch):
    """#16 seventh trial C: both trainers started from step 2 (exit 0); node 0 then
    saved step 4 alone and every trainer crashed. Restarted together, node 0 opened a
    round (exit 2, step 4 lacks rank 1) while node 1, holding nothing newer, answered
    at once with its old result (exit 0): with ``tierfs wait && train`` only node 1's
    trainer started. A trainer start more than TIERFS_TRAINER_SAME_START seconds
    after the one that got the last result is a restart: every node takes part."""
    monkeypatch.setenv("TIERFS_TRAINER_SAME_START", "0")  # (with 3600 this test fails)
    c = Cluster(make_mount, 2, node_args=generic(2))
    save_step(c, 2, [0, 1])
    for i in range(2):
        wait_until(lambda i=i: replicated(c, i, 2), 60, f"node {i}'s step 2 to be replicated")
    c.lose(1)
    c.remount(1)
    first = waits_at_once(c, [0, 1])
    assert [(code, out.strip()) for code, out, _ in first] == [
        (0, "restored step 2 from local"),
        (0, "restored step 2 from peer:0"),
    ], (first, c.logs())
    save_step(c, 4, [0])  # node 1's trainer dies before its part of step 4
    wait_until(lambda: holds_own(c, 0, 4), 60, "node 0's part of step 4")
    # every trainer crashes and restarts (TIERFS_TRAINER_SAME_START=0: any later start
    # is a restart, not another local rank of the first)
    # node 1's trainer comes back first (it answered at once, before node 0's round)
    again = waits_at_once(c, [1]) + waits_at_once(c, [0])
    for i, (code, out, err) in enumerate(again):
        assert (code, out.strip()) == (2, "restored step 2 from local"), (i, again, c.logs())
        assert "step 4 lacks rank(s) [1]" in err, (i, err)
    assert not holds_own(c, 0, 4)


def test_a_step_sealed_while_its_peer_was_down_reaches_it_later(make_mount, monkeypatch):
    """Found by a user: a step whose replication failed while the peer was down
    stayed 'replicating' forever once a newer step had been sent."""
    monkeypatch.setenv("TIERFS_PEER_PUSH_PATIENCE", "2")
    c = Cluster(make_mount, 2, node_args=generic(2))
    c.mounts[1].unmount()
    for step in (1, 2):
        tmp = c.root(0) / f"tmp-checkpoint-{step}"
        tmp.mkdir()
        (tmp / "model.bin").write_bytes(os.urandom(10_000))
        os.rename(tmp, c.root(0) / f"checkpoint-{step}")
    wait_until(
        lambda: (
            {s["step"]: s["state"] for s in c.status(0)["steps"]}.get(1) == "replication failed"
        ),
        60,
        "step 1's replication to fail",
    )
    c.mounts[1].mount()
    for step in (1, 2):
        wait_until(
            lambda step=step: replicated(c, 0, step),
            60,
            f"step {step} to reach node 1 once it is back",
        )
