"""One rank of a training loop that saves with stock ``torch.distributed.checkpoint``
and loads every rank's tensors right after a barrier, step after step in one process
(no tierfs-specific code; #14 trial 53 B1).

Usage: dcp_race.py RANK WORLD PORT ROOT FIRST LAST BIG_MB

Each step N in FIRST..LAST: remove ``ROOT/checkpoint-(N-2)`` (the trainer's retention),
``dcp.save`` of ``r<rank>.small`` (256 KiB) into ``ROOT/checkpoint-N`` (rank 1 also
saves ``r1.big``, BIG_MB MiB, so its node seals its part later than the others),
``dist.barrier``, then ``dcp.load`` of every rank's ``.small`` tensor (each node reads
every other rank's file) compared with what was saved. Prints ``OK <steps>``, or
``LOAD_FAILED <step> <type> <why>`` per failed step and exits 3.

``$DCP_RACE_LATE`` = ``RANK:SECONDS``: that rank creates its file so much later than
the others, after the save's planning (with several ranks per node, its node seals a
part without its file first; #14 trial 54 F1).

``$DCP_RACE_SLOW`` = ``RANK:SECONDS``: that rank keeps each of its data files open so
much longer after writing it, as a rank with a much bigger part would (the coordinator
rank finishing more than 10 s after the others: #14 trial 54 F2).

``$DCP_RACE_REPEAT`` = ``N``: each step is saved N times in a row into the same
directory, with new values each time, each save followed by the barrier and the load
(a step saved again in place right after its load: #14 trial 55 F3).

``$DCP_RACE_NOLOAD`` = ``1``: with ``$DCP_RACE_REPEAT``, only the last save of each
step is followed by the barrier and the load (saves in a row: #14 trial 60 M1).

``$DCP_RACE_CUT`` = ``RANK``: the last save of the last step is cut short: that rank's
process dies (``os._exit``) before it writes its data file, the others' saves fail
(their data files written, no ``.metadata``); each prints ``CUT`` and exits 0 (a
trainer killed mid-save: #14 trial 60).
"""

import datetime
import io
import os
import shutil
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem


class Late(dcp.FileSystemWriter):
    """A stock writer whose rank creates its data file ``late`` seconds after the plan."""

    late = 0.0

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        time.sleep(self.late)
        return super().write_data(plan, planner)


class Cut(dcp.FileSystemWriter):
    """A stock writer whose rank dies after the save's planning, before it writes."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        print("CUT", flush=True)
        os._exit(0)


class SlowClose(io.FileIO):
    """A file whose close waits ``slow`` seconds first (DCP closes its data file
    itself, inside ``create_stream``)."""

    slow = 0.0

    def close(self) -> None:
        if not self.closed:
            time.sleep(self.slow)
        super().close()


class SlowFs(FileSystem):
    """The stock file system, keeping each data file open ``slow`` seconds after it
    was written (``.metadata`` is written at once)."""

    slow = 0.0

    @contextmanager
    def create_stream(self, path, mode):  # type: ignore[no-untyped-def]
        if "w" not in mode or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        raw = SlowClose(str(path), mode.replace("b", ""))
        raw.slow = self.slow
        with io.BufferedWriter(raw) as stream:
            yield stream


def small(step: int, rank: int, save: int = 0) -> torch.Tensor:
    seed = 10 * step + rank + 100_000 * save
    return torch.randn(1 << 16, generator=torch.Generator().manual_seed(seed))


def main() -> None:
    rank, world, port = map(int, sys.argv[1:4])
    root, first, last, big_mb = sys.argv[4], *map(int, sys.argv[5:8])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cut = int(os.environ.get("DCP_RACE_CUT", "-1"))
    # a cut save: the others learn of the dead rank within this time at the latest
    timeout = datetime.timedelta(seconds=60 if cut >= 0 else 1800)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    failed = []
    try:
        repeat = int(os.environ.get("DCP_RACE_REPEAT", "1"))
        noload = os.environ.get("DCP_RACE_NOLOAD") == "1"
        for step in range(first, last + 1):
            shutil.rmtree(os.path.join(root, f"checkpoint-{step - 2}"), ignore_errors=True)
            path = os.path.join(root, f"checkpoint-{step}")
            for save in range(repeat):
                state = {f"r{rank}.small": small(step, rank, save)}
                if rank == 1:
                    g = torch.Generator().manual_seed(step + 100_000 * save)
                    state["r1.big"] = torch.randn(big_mb << 18, generator=g)
                late_rank, _, late = os.environ.get("DCP_RACE_LATE", "-1:0").partition(":")
                writer = (Late if rank == int(late_rank) else dcp.FileSystemWriter)(path)
                writer.late = float(late)
                slow_rank, _, slow = os.environ.get("DCP_RACE_SLOW", "-1:0").partition(":")
                if rank == int(slow_rank):
                    writer.fs = SlowFs()
                    writer.fs.slow = float(slow)
                if cut >= 0 and step == last and save == repeat - 1:
                    if rank == cut:
                        writer = Cut(path)
                    try:
                        dcp.save(state, storage_writer=writer)
                    except BaseException:  # CheckpointException: the dead rank's part
                        pass
                    print("CUT", flush=True)
                    os._exit(0)
                dcp.save(state, storage_writer=writer)
                if noload and save < repeat - 1:
                    continue
                dist.barrier()
                want = {f"r{r}.small": small(step, r, save) for r in range(world)}
                got = {k: torch.zeros_like(v) for k, v in want.items()}
                try:
                    dcp.load(got, checkpoint_id=path)
                    bad = [k for k in want if not torch.equal(got[k], want[k])]
                    if bad:
                        raise ValueError(f"wrong values: {bad}")
                except BaseException as exc:  # CheckpointException is a BaseException
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    failed.append(
                        f"LOAD_FAILED {step}.{save} {type(exc).__name__} {str(exc)[-400:]}"
                    )
                dist.barrier()
    finally:
        dist.destroy_process_group()
    if failed:
        print("\n".join(failed), flush=True)
        sys.exit(3)
    print(f"OK {last - first + 1}", flush=True)


if __name__ == "__main__":
    main()
