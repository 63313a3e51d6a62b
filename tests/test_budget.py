"""RAM budget accounting without a mount (tierfs.fs.ramstore.Budget)."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from tierfs.fs.ramstore import Budget, RamStore

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
