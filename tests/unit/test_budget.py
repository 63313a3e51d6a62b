"""RAM budget accounting without a mount (tierfs.store.ramstore.Budget)."""

from __future__ import annotations

import errno
import os
import shutil
import time

import pytest

from tierfs.store.ramstore import Budget, RamStore

MiB = 1 << 20


def _fill(path, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(b"\1" * nbytes)


def test_native_usage_survives_other_programs_freeing_a_shared_tmpfs(tmp_path):
    """Regression: with 200 MiB of someone else's file deleted after the daemon
    started, status showed 0 bytes used."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    foreign = os.path.join(base, f"foreign-{os.getpid()}")
    store = RamStore(os.path.join(base, f"budget-{os.getpid()}"))
    try:
        _fill(foreign, 32 * MiB)
        budget = Budget(store.root, None, store.usage(), recount=store.usage)
        assert budget.native
        _fill(os.path.join(store.view, "ours"), 8 * MiB)
        os.unlink(foreign)
        budget.recount()
        assert 8 * MiB <= budget.used() < 9 * MiB
        assert budget.size == budget.used() + budget.free()
    finally:
        if os.path.exists(foreign):
            os.unlink(foreign)
        shutil.rmtree(store.root, ignore_errors=True)


def test_managed_budget_counts_only_the_store(tmp_path):
    store = RamStore(str(tmp_path / "ram"))
    budget = Budget(store.root, 4 * MiB, store.usage(), recount=store.usage)
    assert budget.mode == "managed" and budget.size == 4 * MiB
    budget.check_growth(3 * MiB)
    with pytest.raises(OSError) as info:
        budget.check_growth(2 * MiB)
    assert info.value.errno == errno.ENOSPC
    assert budget.wants_recount  # a refusal asks for a fresh count soon
    _fill(os.path.join(store.view, "x"), 1 * MiB)
    budget.recount()  # the count replaces the granted-but-unwritten growth
    assert MiB <= budget.used() < 2 * MiB
    assert not budget.wants_recount
    budget.check_growth(2 * MiB)
    assert budget.statfs().blocks * budget.statfs().bsize == 4 * MiB


@pytest.fixture
def shm_ram():
    """A ram-dir on tmpfs (directories allocate no blocks there, as in production)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if base is None:
        pytest.skip("no /dev/shm")
    path = os.path.join(base, f"budget-{os.getpid()}-{time.monotonic_ns()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_managed_frees_count_at_once_and_survive_a_racing_count(shm_ram):
    """Regression: freed bytes only came back at the next count (seconds of ENOSPC)."""
    store = RamStore(shm_ram)
    budget = Budget(store.root, 8 * MiB, store.usage(), recount=store.usage)
    base = budget.used()
    _fill(os.path.join(store.view, "a"), 2 * MiB)
    _fill(os.path.join(store.view, "b"), 2 * MiB)
    budget.recount()
    assert budget.used() == base + 4 * MiB
    st = os.stat(os.path.join(store.view, "a"))
    os.unlink(os.path.join(store.view, "a"))
    budget.release(st.st_blocks * 512, st.st_ino)
    assert budget.used() == base + 2 * MiB  # at once, no count needed
    budget.recount()
    assert budget.used() == base + 2 * MiB  # and the next count agrees

    # an object freed while a count runs: subtracted only if the count saw it
    def counting_while_b_goes(seen: set[int]) -> int:
        total = store.usage(seen)  # sees b
        st = os.stat(os.path.join(store.view, "b"))
        os.unlink(os.path.join(store.view, "b"))
        budget.release(st.st_blocks * 512, st.st_ino)
        budget.release(MiB, 123456789)  # something the count never saw
        return total

    budget._recount = counting_while_b_goes
    budget.recount()
    assert budget.used() == base


def test_files_unlinked_while_open_keep_counting_until_dropped(shm_ram):
    """Regression: a count could not see open-unlinked files, so they were not counted."""
    store = RamStore(shm_ram)
    budget = Budget(store.root, 8 * MiB, store.usage(), recount=store.usage)
    base = budget.used()
    path = os.path.join(store.view, "orphan")
    _fill(path, 3 * MiB)
    fd = os.open(path, os.O_RDONLY)
    ino = os.fstat(fd).st_ino
    os.unlink(path)
    budget.hold_orphan(ino, fd)
    budget.recount()
    assert budget.used() == base + 3 * MiB and budget.orphans() == 1
    with pytest.raises(OSError) as info:
        budget.check_growth(6 * MiB)
    assert info.value.errno == errno.ENOSPC
    budget.drop_orphan(ino)  # the last handle closed
    assert budget.used() == base and budget.orphans() == 0
    budget.check_growth(6 * MiB)


def test_emptied_trash_frees_budget_and_skips_the_grace_when_needed(shm_ram):
    """A snapshot dropped by retention goes to the trash; its room must come back
    before the next step needs it, not after the 30 s grace and the next count."""
    store = RamStore(shm_ram)
    budget = Budget(store.root, 8 * MiB, store.usage(), recount=store.usage)
    store.attach_budget(budget)
    base = budget.used()
    snap = os.path.join(store.store, "shards", "s1")
    os.makedirs(os.path.join(snap, "data"))
    _fill(os.path.join(snap, "data", "w"), 3 * MiB)
    kept = os.path.join(store.view, "still-linked")
    _fill(kept, MiB)
    os.link(kept, os.path.join(snap, "data", "linked"))  # the view keeps this one
    budget.recount()
    assert budget.used() == base + 4 * MiB
    store.to_trash(snap)
    # plenty of room: the trash keeps its grace (and nothing is released)
    assert store.empty_trash() == 0
    assert budget.used() == base + 4 * MiB
    budget.check_growth(2 * MiB)  # free is now 2 MiB: less than the trash's 3 MiB
    deadline = time.monotonic() + 5  # the reclaimer thread wakes on to_trash; help it
    while os.listdir(store.trash) and time.monotonic() < deadline:
        store.empty_trash()
        time.sleep(0.01)
    assert os.listdir(store.trash) == []
    assert budget.used() == base + 3 * MiB  # 2 granted + the file the view still holds
    assert os.path.exists(kept)


def test_a_snapshot_dropped_before_the_client_deletes_its_copy_frees_at_once(shm_ram):
    """Regression (CI: test_managed_budget_holds_keep_local_plus_one_sealed_steps got
    ENOSPC): retention dropped step 1's snapshot into the trash while the client's
    copy still linked its files, so the reclaimer found nothing freeable; the
    client's rmtree a moment later woke nobody, and the bytes sat out the 30 s
    grace while the next step's writes were refused."""
    from tierfs.fuse.inodes import ROOT_ID
    from tierfs.fuse.namespace import Namespace

    store = RamStore(shm_ram)
    budget = Budget(store.root, 8 * MiB, store.usage(), recount=store.usage)
    store.attach_budget(budget)
    ns = Namespace(store.view, budget, reserved=frozenset())
    step = os.path.join(store.view, "checkpoint-1")
    os.mkdir(step)
    _fill(os.path.join(step, "model.pt"), 5 * MiB)
    snap = os.path.join(store.shards, "job", "0", "1")
    os.makedirs(snap)
    os.link(os.path.join(step, "model.pt"), os.path.join(snap, "model.pt"))  # the seal
    budget.recount()
    base = budget.used()
    store.to_trash(snap)  # retention drops it first: the view still links the file
    deadline = time.monotonic() + 20
    while store._trashed.is_set():  # the reclaimer took the wake-up ...
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with store._trash_lock:  # ... and finished its pass: nothing was freeable
        assert os.listdir(store.trash) != []
    parent, _ = ns.lookup(ROOT_ID, b"checkpoint-1")
    ns.unlink(parent.nodeid, b"model.pt")  # then the client deletes its copy
    deadline = time.monotonic() + 20  # well below the 30 s grace the bug waited for
    while budget.used() > base - 5 * MiB:
        assert time.monotonic() < deadline, "the dropped snapshot's bytes never came back"
        time.sleep(0.01)
    assert os.listdir(store.trash) == []
    budget.check_growth(7 * MiB)  # room for the next step
