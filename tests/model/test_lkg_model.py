"""A reference model of "the last known good step" (issue #12 item 3).

A Hypothesis state machine drives the node's real sealing, catalog, replica
transfer, backup and restore-choice code on temporary RAM stores and the
in-memory bucket (tests/support/fake_bucket.py) -- no mount, no process, no
network -- and checks every restore against a small pure model of what the
world holds:

* real code: :class:`tierfs.store.shards.ShardStore` (snapshot, commit, verify,
  load), :class:`tierfs.node.catalog.ShardCatalog`, the replica data path
  (:func:`tierfs.replication.transfer.iter_chunks` into a
  :class:`~tierfs.replication.transfer.ShardReceiver`, which checks every chunk
  and file, then ``commit``), :class:`tierfs.backup.bucket.GcsBackend`
  (upload_shard, inspect_round, restore_shard) and :meth:`tierfs.backup.tier.
  GcsTier.read_bucket` on the fake bucket, :func:`tierfs.cluster.restore_choice.
  choose_restore` with the coordinator's bad-copy loop (a node whose sources
  all fail reports them bad with a note; the step is chosen again);
* model: per (rank, step) the generations sealed (their bytes are a pure
  function of rank, step and generation); per holder (a node, a backup round)
  which generation of which (rank, step) it holds and whether its bytes are
  still intact.

Invariants after every restore:

1. the chosen step is the newest step with a complete good copy (every rank
   in some node's RAM or a backup round usable for it: a round holding a part
   of every rank, or one sharing a part with the RAM copies -- the rule of
   docs/SEMANTICS.md and tierfs/cluster/restore_choice.py);
2. every rank's restored bytes are exactly the bytes of a generation sealed
   for (rank, step) and the shard verifies;
3. a copy found bad is really damaged (no good copy is ever thrown away);
4. an older step or nothing comes with a reason (``problems``), and "fresh"
   only when nothing of the job exists anywhere.

Invariant 1 is checked exactly while no (rank, step) has copies of two
generations alive (after a write-after-seal, the old generation's replicas and
round parts stay until replaced, and which generation wins is a policy choice
of restore_choice, not of this model); then only its upper bound holds (the
step has a good copy of every rank).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import fake_bucket as fb
import fake_ports
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tierfs.backup.tier import GcsTier
from tierfs.cluster.restore_choice import FRESH, OLDER, RESTORED, choose_restore
from tierfs.core.types import Holding
from tierfs.node.catalog import ShardCatalog
from tierfs.replication.transfer import ShardReceiver, iter_chunks
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore

JOB = "job"
STEPS = (1, 2, 3)
#: round names far after every seal time, so no round counts as superseded by a seal
ROUND_BASE = "2099-01-01_00-"


def content(rank: int, step: int, gen: int) -> dict[str, bytes]:
    """The bytes rank ``rank`` saves for ``step`` in generation ``gen`` (pure)."""
    head = f"rank={rank} step={step} gen={gen}\n".encode()
    return {
        f"model-{rank}.bin": head * (3 + (rank + step + gen) % 5),
        "opt/state.bin": bytes([rank, step, gen]) * (50 + 7 * rank),
    }


def read_shard(shard: Shard) -> dict[str, bytes]:
    top = os.path.join(shard.data, str(shard.key.step))
    out = {}
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, top)] = f.read()
    return out


def damage_file(path: str, sealed_first_byte: int) -> None:
    """Make the file's first byte differ from the sealed one (twice stays damaged)."""
    with open(path, "r+b") as f:
        f.write(bytes([sealed_first_byte ^ 0xFF]))


@dataclass
class Node:
    """One simulated node: a RAM store, its shard store and catalog."""

    root: str
    ram: RamStore = field(init=False)
    shards: ShardStore = field(init=False)
    catalog: ShardCatalog = field(init=False)

    def __post_init__(self) -> None:
        self.ram = RamStore(self.root)
        self.shards = ShardStore(self.ram)
        self.catalog = ShardCatalog(self.shards, keep_local=100)


class LkgMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="lkg-model-")
        self.nodes_n = 0
        self.nodes: list[Node] = []
        self.server = fb.FakeGcs()
        #: uploads give up quickly under a persistent fault; reads have time (a busy machine)
        self.backend = fb.backend(self.server, deadline=0.2)
        self.reader = fb.backend(self.server, deadline=30.0)
        self.tier = GcsTier(
            self.backend.spec,
            catalog=fake_ports.catalog(),
            job=fake_ports.FakeJob(),
            reporter=fake_ports.FakeJob(),
            shards=None,  # type: ignore[arg-type]
            budget=fake_ports.FakeBudget(),
            settings=fb.fast_settings(30.0),
        )
        self.tier.access.backend = self.reader  # the seam: get_backend() returns the fake's
        # ---- the model
        self.gen: dict[tuple[int, int], int] = {}  # (rank, step) -> current generation
        self.sealed: dict[tuple[int, int], set[int]] = {}  # generations ever sealed
        #: holder (node index or round name) -> (rank, step) -> (generation, intact)
        self.copies: dict[Any, dict[tuple[int, int], tuple[int, bool]]] = {}
        self.round_no = 0
        self.last_round_step = 0
        self.node_no = 0
        self.restores = 0

    def teardown(self) -> None:
        self.server.clear_faults()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ setup

    @initialize(n=st.integers(2, 3))
    def start(self, n: int) -> None:
        self.nodes_n = n
        for i in range(n):
            self.nodes.append(self._new_node())
            self.copies[i] = {}

    def _new_node(self) -> Node:
        self.node_no += 1
        return Node(os.path.join(self.tmp, f"node{self.node_no}"))

    def started(self) -> bool:
        return self.nodes_n > 0

    # ------------------------------------------------------------------ rules

    @precondition(started)
    @rule(
        step=st.sampled_from(STEPS),
        ranks=st.one_of(st.just({0, 1, 2}), st.sets(st.integers(0, 2), min_size=1)),
    )
    def seal(self, step: int, ranks: set[int]) -> None:
        """Ranks save ``step`` and it seals (ranks not in ``ranks`` have not yet)."""
        for r in sorted(ranks):
            if r >= self.nodes_n:
                continue
            node = self.nodes[r]
            key = ShardKey(JOB, r, step)
            if key in node.catalog:
                continue
            g = self.gen.setdefault((r, step), 0)
            shard = fb.seal(node.ram, JOB, r, step, content(r, step, g))
            shard.verified = True  # the seal just computed the checksums from these files
            node.catalog.add(shard)
            node.catalog.sealed(shard)
            self.sealed.setdefault((r, step), set()).add(g)
            self.copies[r][(r, step)] = (g, True)

    @precondition(started)
    @rule(rank=st.integers(0, 2), step=st.sampled_from(STEPS))
    def write_after_seal(self, rank: int, step: int) -> None:
        """A sealed step of ``rank`` is written again: the seal is withdrawn at once
        (the old shard leaves the catalog); the new bytes seal with the next seal."""
        if rank >= self.nodes_n:
            return
        node = self.nodes[rank]
        key = ShardKey(JOB, rank, step)
        if key not in node.catalog:
            return
        node.catalog.drop(key, "a sealed file was opened for writing")
        assert key not in node.catalog and not os.path.exists(node.shards.path_of(key))
        self.gen[(rank, step)] += 1
        del self.copies[rank][(rank, step)]

    @precondition(started)
    @rule(src=st.integers(0, 2), step=st.sampled_from(STEPS), dst=st.integers(0, 2))
    def replicate(self, src: int, step: int, dst: int) -> None:
        """Node ``src`` sends its own shard of ``step`` to node ``dst`` through the
        checked receiving path; a damaged source is refused by the receiver."""
        if src >= self.nodes_n or dst >= self.nodes_n or src == dst:
            return
        key = ShardKey(JOB, src, step)
        shard = self.nodes[src].catalog.get(key)
        if shard is None:
            return
        target = self.nodes[dst]
        inc = target.ram.new_incoming(f"pull-{src}-{step}")
        rx = ShardReceiver(inc, shard.manifest)
        try:
            for path, offset, data, crc in iter_chunks(shard.data, shard.manifest.files):
                rx.chunk(path, offset, data, crc)
            manifest = rx.finish()
        except Exception:
            rx.abort()
            g, intact = self.copies[src][(src, step)]
            assert not intact, "the receiver refused an intact copy"
            return
        g, intact = self.copies[src][(src, step)]
        assert intact, "the receiver accepted a damaged copy"
        copy = target.shards.commit(inc, manifest, verified=True)
        target.catalog.add(copy)
        self.copies[dst][(src, step)] = (g, True)

    @precondition(started)
    @rule(
        step=st.sampled_from(STEPS),
        faults=st.lists(
            st.sampled_from(["none", "503-once", "reset-once", "down", "corrupt", "no-pointer"]),
            min_size=3,
            max_size=3,
        ),
    )
    def back_up(self, step: int, faults: list[str]) -> None:
        """A backup round of ``step``: each node uploads its own shard, under a fault
        (``down``, ``corrupt`` and ``no-pointer`` make its part fail)."""
        if step < self.last_round_step:
            return  # rounds back up steps in order (a smaller step later is a rollback)
        self.round_no += 1
        rnd = f"{ROUND_BASE}{self.round_no:02d}"
        self.last_round_step = step
        self.copies[rnd] = {}
        for r in range(self.nodes_n):
            shard = self.nodes[r].catalog.get(ShardKey(JOB, r, step))
            if shard is None:
                continue
            fault = faults[r]
            if fault == "503-once":
                self.server.inject("status", "put", status=503, times=1)
            elif fault == "reset-once":
                self.server.inject("reset", "put", times=1)
            elif fault == "down":
                self.server.inject("status", None, status=503, times=None)
            elif fault == "corrupt":
                self.server.inject("corrupt_write", "put", "/D", times=None)
                self.server.inject("corrupt_write", "put", ".data", times=None)
            elif fault == "no-pointer":
                self.server.inject("status", "put", ".meta", status=403, times=None)
            g, intact = self.copies[r][(r, step)]
            try:
                self.backend.upload_shard(shard, rnd, nodes=self.nodes_n)
                ok = True
            except Exception:
                ok = False
            finally:
                self.server.clear_faults()
            if fault in ("down", "corrupt", "no-pointer") and shard.manifest.files:
                assert not ok, f"an upload under {fault!r} succeeded"
            if ok:
                # a damaged RAM copy may be uploaded (the bucket checks the bytes it
                # receives against the manifest's crc32c): only intact ones succeed
                assert intact, "a damaged RAM copy was backed up"
                self.copies[rnd][(r, step)] = (g, True)

    @precondition(started)
    @rule(where=st.sampled_from(["ram", "bucket"]), node=st.integers(0, 2), data=st.data())
    def damage(self, where: str, node: int, data: st.DataObject) -> None:
        """A bit flips in a shard in a node's RAM, or rots in a backup round's part."""
        if where == "ram":
            self.corrupt_ram(node, data)
        elif any(isinstance(h, str) and c for h, c in self.copies.items()):
            self.rot_in_bucket(data)

    def rot_in_bucket(self, data: st.DataObject) -> None:
        """Bit rot at rest in one object of a backup round's part."""
        parts = sorted((h, k) for h, c in self.copies.items() if isinstance(h, str) for k in c)
        rnd, (rank, step) = data.draw(st.sampled_from(parts))
        prefix = f"{JOB}/{rnd}/"
        names = [
            n
            for n in self.server.objects()
            if n.startswith(prefix) and not n.endswith((".meta", ".json"))
        ]
        info = self.reader.inspect_round(JOB, rnd)
        part = info.parts[(rank, step)]
        assert part.backup is not None
        own = sorted(prefix + o for o in part.backup.objects.values())
        assert set(own) <= set(names)
        self.server.rot("bkt", own[0])
        g, _ = self.copies[rnd][(rank, step)]
        self.copies[rnd][(rank, step)] = (g, False)

    def corrupt_ram(self, node: int, data: st.DataObject) -> None:
        """A bit flips in one file of a shard held in a node's RAM."""
        if node >= self.nodes_n or not self.copies[node]:
            return
        rank, step = data.draw(st.sampled_from(sorted(self.copies[node])))
        shard = self.nodes[node].catalog[ShardKey(JOB, rank, step)]
        files = sorted(f.path for f in shard.manifest.files if f.kind == "file" and f.size)
        path = data.draw(st.sampled_from(files))
        g, _ = self.copies[node][(rank, step)]
        sealed = content(rank, step, g)[path.split("/", 1)[1]]
        damage_file(os.path.join(shard.data, path), sealed[0])
        self.copies[node][(rank, step)] = (g, False)

    @precondition(started)
    @rule(how=st.sampled_from(["ram", "node", "daemon"]), node=st.integers(0, 2))
    def lose(self, how: str, node: int) -> None:
        """A node loses its RAM, is replaced, or its daemon restarts (RAM kept)."""
        {"ram": self.lose_ram, "node": self.lose_node, "daemon": self.restart_daemon}[how](node)

    def lose_ram(self, node: int) -> None:
        """The node reboots with its tmpfs gone: the daemon finds an empty store."""
        if node >= self.nodes_n:
            return
        n = self.nodes[node]
        shutil.rmtree(n.ram.root)
        fresh = Node(n.root)
        assert fresh.shards.load() == {}
        self.nodes[node] = fresh
        self.copies[node] = {}

    def lose_node(self, node: int) -> None:
        """The machine is replaced: a new node with an empty RAM store takes its rank."""
        if node >= self.nodes_n:
            return
        shutil.rmtree(self.nodes[node].root, ignore_errors=True)
        self.nodes[node] = self._new_node()
        self.copies[node] = {}

    def restart_daemon(self, node: int) -> None:
        """The daemon restarts with its RAM kept: the catalog is loaded from the store
        and every shard verified again (a damaged one is dropped)."""
        if node >= self.nodes_n:
            return
        n = self.nodes[node]
        fresh = Node(n.root)
        for key, shard in sorted(fresh.shards.load().items()):
            problems = fresh.shards.verify(shard)
            _g, intact = self.copies[node][(key.rank, key.step)]
            assert (not problems) == intact, (key, problems)
            if problems:
                fresh.shards.remove(shard)
                del self.copies[node][(key.rank, key.step)]
            else:
                fresh.catalog.add(shard)
        assert {(k.rank, k.step) for k in fresh.catalog} == set(self.copies[node])
        self.nodes[node] = fresh

    # ------------------------------------------------------------------ restore

    def inventories(self) -> dict[int, list[Holding]]:
        return {
            i: [
                Holding(
                    s.key.rank,
                    s.key.step,
                    s.verified,
                    s.manifest.digest,
                    s.bytes,
                    s.manifest.name,
                    created=s.manifest.created,
                )
                for s in n.catalog.shards_of(JOB)
            ]
            for i, n in enumerate(self.nodes)
        }

    def _fetch(self, rank: int, holder: Any, step: int) -> Shard:
        """Bring ``rank``'s shard of ``step`` from ``holder`` to node ``rank``, verified;
        raises on a bad copy (nothing is left behind)."""
        node = self.nodes[rank]
        key = ShardKey(JOB, rank, step)
        if holder == rank:
            shard = node.catalog[key]
            problems = node.shards.verify(shard)
            if problems:
                raise ValueError(problems[0])
            return shard
        if isinstance(holder, int):
            src = self.nodes[holder].catalog[key]
            inc = node.ram.new_incoming(f"pull-{rank}-{step}")
            rx = ShardReceiver(inc, src.manifest)
            try:
                for path, offset, data, crc in iter_chunks(src.data, src.manifest.files):
                    rx.chunk(path, offset, data, crc)
                manifest = rx.finish()
            except Exception:
                rx.abort()
                raise
            shard = node.shards.commit(inc, manifest, verified=True)
        else:
            shard = self.reader.restore_shard(node.shards, JOB, holder, rank, step)
        node.catalog.add(shard)
        return shard

    @precondition(started)
    @rule()
    def restore(self) -> None:
        """Every node restores: decide, fetch from the decision's sources in order,
        report bad copies, decide again (as the coordinator's round does)."""
        self.restores += 1
        view = self.tier.read_bucket(JOB, self.nodes_n, depth=100)
        assert view.error is None, view.error
        bad: set[tuple[Any, int, int]] = set()
        notes: list[str] = []
        fetched: list[Shard] = []
        for _ in range(40):
            choice = choose_restore(self.nodes_n, self.inventories(), bad, view, notes)
            if choice.step is None:
                break
            got: dict[int, Shard] = {}
            for r in range(self.nodes_n):
                holders = list(choice.holders.get(r, ()))
                holders.sort(key=lambda h: (h != r, (h - r) % self.nodes_n))
                for holder in [*holders, *choice.rounds.get(r, ())]:
                    try:
                        got[r] = self._fetch(r, holder, choice.step)
                        fetched.append(got[r])
                        break
                    except Exception as exc:
                        # 3. a copy found bad is really damaged; a node drops it
                        where = self.copies[holder][(r, choice.step)]
                        assert not where[1], f"good copy {(holder, r, choice.step)} found bad"
                        if isinstance(holder, int):
                            self.nodes[holder].catalog.drop(
                                ShardKey(JOB, r, choice.step), "checksum mismatch"
                            )
                            del self.copies[holder][(r, choice.step)]
                        bad.add((holder, r, choice.step))
                        notes.append(f"node-rank {r}: bad copy at {holder}: {exc}")
                if r not in got:
                    break
            if len(got) == self.nodes_n:
                break
        else:
            raise AssertionError("no decision after 40 rounds")
        self.check(choice, got if choice.step is not None else {}, bad, fetched)

    # ------------------------------------------------------------------ the model

    def good(self) -> set[tuple[Any, int, int]]:
        return {
            (h, r, s)
            for h, held in self.copies.items()
            for (r, s), (_g, intact) in held.items()
            if intact
        }

    def complete(self, step: int, good: set[tuple[Any, int, int]]) -> bool:
        """Every rank has a good copy of ``step`` in RAM or in a round usable for it."""
        everyone = set(range(self.nodes_n))
        ram = {r for h, r, s in good if s == step and isinstance(h, int)}
        needed = everyone - ram
        if not needed:
            return True
        rounds = [h for h in self.copies if isinstance(h, str)]
        held = {n: {r for (r, s) in self.copies[n] if s == step} for n in rounds}
        ok = {n: {r for h, r, s in good if h == n and s == step} for n in rounds}
        linked = {n for n in rounds if ok[n] & ram}
        usable = {n for n in rounds if held[n] == everyone or n in linked}
        if any(needed <= ok[n] for n in usable):
            return True
        return all(any(r in ok[n] for n in linked) for r in needed)

    def ambiguous(self) -> bool:
        """Some (rank, step) has copies of two generations alive."""
        gens: dict[tuple[int, int], set[int]] = {}
        for held in self.copies.values():
            for key, (g, _intact) in held.items():
                gens.setdefault(key, set()).add(g)
        return any(len(g) > 1 for g in gens.values())

    def check(
        self,
        choice: Any,
        got: dict[int, Shard],
        bad: set[tuple[Any, int, int]],
        fetched: list[Shard],
    ) -> None:
        good = self.good()
        event(f"restore: step {choice.step}, {len(bad)} bad, {len(fetched)} fetched")
        event(f"restore with {sum(len(c) for c in self.copies.values())} copies")
        steps = sorted({s for _h, _r, s in good}, reverse=True)
        newest = next((s for s in steps if self.complete(s, good)), None)
        anything = any(self.copies.values()) or bool(self.server.objects())
        if self.ambiguous():
            if choice.step is not None:
                assert self.complete(choice.step, good) or self.complete_any_gen(choice.step)
        else:
            # 1. the newest step with a complete good copy
            assert choice.step == newest, (choice.step, newest, choice.reason, choice.problems)
        existing = max((s for held in self.copies.values() for (_r, s) in held), default=None)
        if choice.step is None:
            # 4. nothing: fresh only when nothing exists anywhere; else a reason
            assert (choice.outcome == FRESH) == (not anything), (choice.outcome, anything)
            assert choice.reason
            if anything:
                assert choice.problems or choice.reason.startswith("no step"), choice
            return
        assert choice.outcome in (RESTORED, OLDER)
        if existing is not None and choice.step < existing:
            # 5. an older step than one that exists: said in the outcome and the problems
            assert choice.outcome == OLDER, (choice.step, existing, choice.outcome)
            assert choice.problems, f"step {choice.step} < {existing} without a reason"
        if choice.outcome == OLDER:
            assert choice.problems, choice
        # 2. the restored bytes are a sealed generation's, and verify
        for r, shard in got.items():
            assert shard.key == ShardKey(JOB, r, choice.step)
            body = read_shard(shard)
            gens = [
                g
                for g in self.sealed.get((r, choice.step), ())
                if content(r, choice.step, g) == body
            ]
            assert gens, f"rank {r} restored bytes never sealed for step {choice.step}"
            assert self.nodes[r].shards.verify(shard) == []
        # every copy a node fetched (also for a decision replaced later) is now held
        for shard in fetched:
            r, s = shard.key.rank, shard.key.step
            body = read_shard(shard)
            gens = [g for g in self.sealed.get((r, s), ()) if content(r, s, g) == body]
            assert gens, f"rank {r} fetched bytes never sealed for step {s}"
            self.copies[r][(r, s)] = (gens[0], True)

    def complete_any_gen(self, step: int) -> bool:
        return all(
            any((r, step) in held and held[(r, step)][1] for held in self.copies.values())
            for r in range(self.nodes_n)
        )

    @invariant()
    def catalogs_match_the_model(self) -> None:
        for i, n in enumerate(self.nodes):
            assert {(k.rank, k.step) for k in n.catalog} == set(self.copies.get(i, {}))


LkgMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    # no "explain" phase: its line tracing makes a failing run take minutes
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_last_known_good = LkgMachine.TestCase
