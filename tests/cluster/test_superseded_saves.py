"""#16 sixth trial N2: a node's whole-step view of a step saved again by another node
count showed files of the earlier save.

A new user's trial renumbered a job twice; one node's view of a re-saved step listed
``__3_0.distcp`` of the earlier 4-node save (DCP ignores it, a loader that globs sees
it). The node's own part under its current rank was the earlier 4-node save's, and it
anchored the node's view of the step (its writer count and its own files), and a
replica of that save held on the node filled another rank's file with the earlier
bytes. A restore now drops the parts of the restored step that its save cannot hold
(``ShardKeeper.superseded``), taking their files out of the view first.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from conftest import tierfs
from mtc_clients import wait_for
from peer_cluster import Cluster
from test_elastic import dcp, elastic, files, holds, own_manifest, restart, save_files, whole

pytestmark = pytest.mark.slow

T = TypeVar("T")


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def listing(c: Cluster, i: int, step: int) -> list[str]:
    try:
        return sorted(os.listdir(c.root(i) / f"checkpoint-{step}"))
    except OSError as exc:
        return [f"<{exc}>"]


def contents(c: Cluster, i: int, step: int) -> dict[str, str]:
    """Every file of node ``i``'s view of ``step``: name -> md5 of its bytes (read
    through the mount: another rank's file is fetched)."""
    top = c.root(i) / f"checkpoint-{step}"
    out = {}
    for name in sorted(os.listdir(top)):
        try:
            out[name] = md5((top / name).read_bytes())
        except OSError as exc:
            out[name] = f"<{exc.strerror}>"
    return out


def _until(read: Callable[[], T], want: T, timeout: float) -> T:
    """``read()`` once it equals ``want``, else the last value after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        seen = read()
        if seen == want or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def settle(c: Cluster, i: int, step: int, want: list[str], timeout: float = 60) -> list[str]:
    """Node ``i``'s listing of ``step`` once it equals ``want``, else the last one seen
    after ``timeout`` seconds."""
    return _until(lambda: listing(c, i, step), want, timeout)


def settled(c: Cluster, i: int, step: int, want: dict[str, str], timeout: float = 60) -> dict:
    """Node ``i``'s :func:`contents` of ``step`` once they equal ``want``, else the last
    seen after ``timeout`` seconds. The names alone do not tell a re-save from the
    earlier save (same names, other bytes), and while the other ranks' new parts
    travel a listing passes through the earlier names."""
    return _until(lambda: contents(c, i, step), want, timeout)


def test_a_node_rejoining_with_its_old_part_shows_only_the_newer_save_of_the_step(make_mount):
    """The F8 family without renumbering: 4 nodes save step 20; node 3 leaves with its
    RAM kept; the job restarts on 3 nodes and saves step 20 again (in place); node 3
    rejoins (the job restarts on 4 nodes), holding its part of the 4-node save of step
    20. Every node's view of step 20 must show exactly the 3-node save's files with
    their new bytes: never ``part-3.bin`` or old bytes of the 4-node save."""
    from tierfs.node.resave import RESAVE_GAP

    c = Cluster(make_mount, 4, node_args=elastic(4))
    save_files(c, 10, [0, 1, 2, 3])
    save_files(c, 20, [0, 1, 2, 3])
    for step in (10, 20):
        for i in range(4):
            wait_for(
                lambda i=i, s=step: any(holds(c, h, i, s) for h in range(4) if h != i),
                90,
                f"a replica of rank {i}'s step {step}",
            )
    for i in range(4):
        wait_for(
            lambda i=i: len(listing(c, i, 20)) == 5, 90, f"the whole 4-node step 20 on node {i}"
        )
    old = {i: contents(c, i, 20) for i in range(4)}
    assert all(old[i] == old[0] for i in range(4)), old

    # node 3 leaves, its RAM kept (its daemon stops; the ram-dir stays)
    c.mounts[3].unmount()
    restart(c, 3, [0, 1, 2])
    for i in range(3):
        w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
        assert w.returncode == 0, (i, w.stdout, w.stderr)
        assert w.stdout.startswith("restored step 20 "), w.stdout

    # the 3-node job saves step 20 again in place, a training interval later
    sealed = max(own_manifest(c, i, i, 20).sealed for i in range(3))  # type: ignore[union-attr]
    wait_for(lambda: time.time() > sealed + RESAVE_GAP + 0.5, RESAVE_GAP + 30, "the interval")
    new: dict[str, str] = {}
    for i in range(3):
        top = c.root(i) / "checkpoint-20"
        data = os.urandom(50_000)
        (top / f"part-{i}.bin").write_bytes(data)
        (top / "commit_success.txt").write_text("ok")
        new[f"part-{i}.bin"] = md5(data)
    new["commit_success.txt"] = md5(b"ok")
    for i in range(3):
        wait_for(
            lambda i=i: (m := own_manifest(c, i, i, 20)) is not None and m.nodes == 3,
            60,
            f"node {i}'s part of the 3-node save of step 20",
        )
    want = sorted(new)
    for i in range(3):
        assert settled(c, i, 20, new) == new, i

    # node 3 rejoins: the job restarts on 4 nodes, node 3 holding its 4-node part
    assert holds(c, 3, 3, 20)
    restart(c, 4, [0, 1, 2, 3])
    said = {}
    for i in range(4):
        w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
        said[i] = (w.returncode, w.stdout.strip(), w.stderr.strip()[-300:])
    for i in range(4):
        settled(c, i, 20, new)
    earlier = {h: name for name, h in old[0].items() if name != "commit_success.txt"}

    def which(name: str, h: str) -> str:
        if new.get(name) == h:
            return "new"
        return f"OLD 4-node save ({earlier[h]})" if h in earlier else h

    views = {i: {name: which(name, h) for name, h in contents(c, i, 20).items()} for i in range(4)}
    assert views == {i: {name: "new" for name in want} for i in range(4)}, said
    # the newest save restored, said as such (regression: every wait exited 2, "step 20
    # was saved again by 4 node(s) after the save restored", the earlier save named newer)
    assert {i: s[0] for i, s in said.items()} == dict.fromkeys(range(4), 0), said


def renumber(c: Cluster, ranks: dict[int, int], lost: tuple[int, ...] = ()) -> None:
    """The job restarts on ``len(ranks)`` nodes, mount i taking node-rank ``ranks[i]``
    (RAM kept; ``lost``: nodes lost with their RAM, mounted again empty); the new
    node-rank 0 first."""
    c.node_args = lambda i: elastic(len(ranks))(ranks[i])
    for i in ranks:
        if i not in lost:
            c.mounts[i].unmount()
    for i in sorted(ranks, key=ranks.__getitem__):
        c.mounts[i].args = c.args(i)
        c.remount(i)


def test_a_node_renumbered_back_to_its_rank_of_an_earlier_save_shows_the_newer_save(
    make_mount,
):
    """The trial's N2, renumbered twice: 4 nodes save step 20 with stock DCP; node 1 is
    lost; the job restarts on 3 renumbered nodes (node 3 -> rank 1) and saves step 20
    again; then it grows back to 4 nodes (node 1 replaced by an empty node, node 3 back
    to rank 3, where it holds its own part of the 4-node save). Every node's view of
    step 20 must show exactly the 3-node save's files and bytes: never
    ``__3_0.distcp`` or the 4-node save's ``.metadata`` / data files.

    (Renumbered within 3 nodes instead, node 2 -> rank 1 -> rank 2, the view is right:
    the restore fetches the 3-node save's rank-2 part over the stale one. The stale
    part anchors the view only when its rank is beyond the newest save's writers.)"""
    c = Cluster(make_mount, 4, node_args=elastic(4))
    assert dcp(c, "save", 20, [0, 1, 2, 3]) == ["SAVED"] * 4
    for i in range(4):
        wait_for(lambda i=i: whole(c, i, 20, 4), 90, f"the whole step 20 on node {i}")
    wait_for(lambda: holds(c, 0, 1, 20), 90, "rank 1's replica on node 0")
    old = {name: md5((c.root(0) / "checkpoint-20" / name).read_bytes()) for name in files(4)}

    c.lose(1)
    first = {0: 0, 3: 1, 2: 2}
    renumber(c, first)
    for i in first:
        w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
        assert w.returncode == 0, (i, w.stdout, w.stderr)
        assert whole(c, i, 20, 4), (i, listing(c, i, 20))
    by_rank = [0, 3, 2]
    assert dcp(c, "save", 20, by_rank, seed=1) == ["SAVED"] * 3
    for i in first:
        wait_for(lambda i=i: whole(c, i, 20, 3), 90, f"the 3-node step 20 on node {i}")
    # the new save's bytes, read on the node that wrote each file
    writer = {".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 3, "__2_0.distcp": 2}
    new = {n: md5((c.root(i) / "checkpoint-20" / n).read_bytes()) for n, i in writer.items()}
    assert all(new[n] != old[n] for n in new), (new, old)
    for i in first:
        assert contents(c, i, 20) == new, i
    for r, i in enumerate(by_rank):
        wait_for(
            lambda i=i, r=r: (m := own_manifest(c, i, r, 20)) is not None and m.nodes == 3,
            60,
            f"node {i}'s part of the 3-node save",
        )
        wait_for(
            lambda i=i, r=r: any(holds(c, h, r, 20) for h in by_rank if h != i),
            60,
            f"a replica of rank {r}'s 3-node part",
        )
    m = own_manifest(c, 3, 3, 20)
    assert m is not None and m.nodes == 4  # node 3 still holds its 4-node part (rank 3)

    # the job grows back to 4 nodes: node 1 replaced by an empty one, node 3 rank 3 again
    second = {0: 0, 1: 1, 2: 2, 3: 3}
    renumber(c, second, lost=(1,))
    said = {}
    for i in second:
        w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
        said[i] = (w.returncode, w.stdout.strip(), w.stderr.strip()[-300:])
    for i in second:
        settle(c, i, 20, files(3))

    def which(name: str, h: str) -> str:
        if new.get(name) == h:
            return "new"
        return "OLD 4-node save" if old.get(name) == h else h

    views = {i: {name: which(name, h) for name, h in contents(c, i, 20).items()} for i in second}
    assert views == {i: {name: "new" for name in files(3)} for i in second}, (said, c.logs())
