"""The step validators (issue #15) on files written by the real clients: torch 2.13 DCP with
one and two ranks (gloo, two processes, a directory per rank as on a mount per node),
torch.save, safetensors, numpy, jax + orbax-checkpoint, an HF-style sharded index. Each
layout of the issue: the complete step passes, every damaged one fails with its reason,
and where it matters the real loader agrees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from step_bytes import disk_step, mem_step

from tierfs.demo.emulator import free_port
from tierfs.store.validators import Kind, StepFiles, judge_step

CLIENT = Path(__file__).resolve().parents[1] / "support" / "clients" / "dcp_ranks.py"

pytestmark = pytest.mark.slow


def kinds(v) -> set[tuple[Kind, str]]:
    return {(p.kind, p.path) for p in v.problems}


def run_ranks(mode: str, dirs: list[Path]) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(CLIENT), mode, str(r), str(len(dirs)), str(port), str(d)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, d in enumerate(dirs)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def union(parts: dict[int, Path], name: str) -> StepFiles:
    """The step as the coordinator knows it: every rank's files, bytes read where they are."""
    sizes, holders = {}, {}
    for rank, root in parts.items():
        for path, size in disk_step(root, name).sizes.items():
            sizes.setdefault(path, size)
            holders.setdefault(path, rank)

    def read(path: str, offset: int, length: int) -> bytes:
        with open(parts[holders[path]] / path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    return StepFiles(name, sizes, read, holders=holders)


# ------------------------------------------------------------------ DCP


@pytest.fixture(scope="module")
def dcp_two_nodes(tmp_path_factory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("dcp2")
    dirs = [base / "node0", base / "node1"]
    for d in dirs:
        d.mkdir()
    results = run_ranks("save", dirs)
    for r in results:
        assert r.returncode == 0 and "SAVED" in r.stdout, r.stderr[-3000:]
    return dict(enumerate(dirs))


def test_dcp_two_ranks_layout_and_verdicts(dcp_two_nodes, tmp_path):
    node0, node1 = dcp_two_nodes[0], dcp_two_nodes[1]
    assert sorted(os.listdir(node0 / "step_10")) == [".metadata", "__0_0.distcp"]
    assert sorted(os.listdir(node1 / "step_10")) == ["__1_0.distcp"]
    v = judge_step(union(dcp_two_nodes, "step_10"))
    assert (v.format, v.complete) == ("dcp", True), v.reasons
    # each node alone: node 1 lacks .metadata, node 0 lacks rank 1's shard; neither is damaged
    v1 = judge_step(disk_step(node1, "step_10"))
    assert kinds(v1) == {(Kind.MISSING, "step_10/.metadata")} and v1.part_ok
    v0 = judge_step(disk_step(node0, "step_10"))
    assert kinds(v0) == {(Kind.MISSING, "step_10/__1_0.distcp")} and v0.part_ok
    # the complete step loads on both ranks from one directory holding every part
    shared = tmp_path / "shared"
    shutil.copytree(node0, shared)
    shutil.copy(node1 / "step_10" / "__1_0.distcp", shared / "step_10")
    for r in run_ranks("load", [shared, shared]):
        assert r.returncode == 0 and "LOADED_OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_dcp_rank1_shard_truncated_to_zero_fails_and_dcp_load_agrees(dcp_two_nodes, tmp_path):
    shared = tmp_path / "shared"
    shutil.copytree(dcp_two_nodes[0], shared)
    (shared / "step_10" / "__1_0.distcp").write_bytes(b"")
    v = judge_step(disk_step(shared, "step_10"))
    assert kinds(v) == {(Kind.DAMAGED, "step_10/__1_0.distcp")}
    assert "0 bytes" in v.reasons[0]
    results = run_ranks("load", [shared, shared])
    assert any(r.returncode == 3 for r in results), [r.stdout for r in results]


def test_dcp_missing_metadata_and_tmp(dcp_two_nodes, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(dcp_two_nodes[0], root)
    shutil.copy(dcp_two_nodes[1] / "step_10" / "__1_0.distcp", root / "step_10")
    (root / "step_10" / ".metadata").rename(root / "step_10" / ".metadata.tmp")
    v = judge_step(disk_step(root, "step_10"))
    assert kinds(v) == {(Kind.MISSING, "step_10/.metadata")}
    assert "did not finish" in v.reasons[0]


@pytest.fixture(scope="module")
def dcp_one(tmp_path_factory) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp1")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 500, "cfg": {"lr": 1}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(root / "step_500"))
    return root


def test_dcp_single_process_complete_and_nemo_marker(dcp_one, tmp_path):
    v = judge_step(disk_step(dcp_one, "step_500"))
    assert (v.format, v.complete) == ("dcp", True), v.reasons
    root = tmp_path / "nemo"
    shutil.copytree(dcp_one / "step_500", root / "step=500")
    (root / "step=500-unfinished").touch()
    v = judge_step(disk_step(root, "step=500"))
    assert kinds(v) == {(Kind.UNFINISHED, "step=500-unfinished")}
    (root / "step=500-unfinished").unlink()
    assert judge_step(disk_step(root, "step=500")).complete


def test_dcp_metadata_parsed_without_importing_torch(dcp_one):
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[2]);"
        "from step_bytes import disk_step; from tierfs.store.validators import judge_step;"
        "v = judge_step(disk_step(Path(sys.argv[1]), 'step_500'));"
        "assert v.complete, v.reasons; assert 'torch' not in sys.modules; print('OK', v.notes[0])"
    )
    support = str(Path(__file__).resolve().parents[1] / "support")
    out = subprocess.run(
        [sys.executable, "-c", code, str(dcp_one), support],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
    assert "storage entries" in out.stdout


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_dcp_real_metadata_truncated_or_shard_cut_is_never_complete(dcp_one, data):
    step = disk_step(dcp_one, "step_500")
    blobs = {p: (dcp_one / p).read_bytes() for p in step.sizes}
    target = data.draw(st.sampled_from(sorted(blobs)))
    blobs[target] = blobs[target][: data.draw(st.integers(0, len(blobs[target]) - 1))]
    v = judge_step(mem_step("step_500", blobs))
    assert not v.complete and (Kind.DAMAGED, target) in kinds(v)


# ------------------------------------------------------------------ torch.save, safetensors, numpy


def test_torch_save_complete_truncated_and_corrupt_zip(tmp_path):
    import torch

    step = tmp_path / "checkpoint-5"
    step.mkdir()
    torch.save({"w": torch.randn(128, 64), "step": 5}, step / "model.pt")
    assert judge_step(disk_step(tmp_path, "checkpoint-5")).complete
    good = (step / "model.pt").read_bytes()
    cases = {
        "truncated": good[: len(good) // 2],
        "zero": b"",
        "corrupt_zip": good[: good.rindex(b"PK\x05\x06")] + b"XX\x05\x06" + good[-18:],
    }
    for label, blob in cases.items():
        (step / "model.pt").write_bytes(blob)
        v = judge_step(disk_step(tmp_path, "checkpoint-5"))
        assert kinds(v) == {(Kind.DAMAGED, "checkpoint-5/model.pt")}, (label, v.reasons)
        with pytest.raises(Exception):  # noqa: B017  torch.load agrees: it cannot read it
            torch.load(step / "model.pt", weights_only=True)


def test_safetensors_complete_and_cut_off_header(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    (tmp_path / "100").mkdir()
    path = tmp_path / "100" / "model.safetensors"
    save_file({"a": torch.randn(10, 10), "b": torch.zeros(3, dtype=torch.int64)}, path)
    assert judge_step(disk_step(tmp_path, "100")).format == "safetensors"
    assert judge_step(disk_step(tmp_path, "100")).complete
    good = path.read_bytes()
    n = int.from_bytes(good[:8], "little")
    for blob, why in [(good[: 8 + n // 2], "cut off"), (good[:-3], "truncated"), (b"", "0 bytes")]:
        path.write_bytes(blob)
        v = judge_step(disk_step(tmp_path, "100"))
        assert kinds(v) == {(Kind.DAMAGED, "100/model.safetensors")} and why in v.reasons[0]
        with pytest.raises(Exception):  # noqa: B017
            load_file(path)


def test_numpy_npy_and_npz(tmp_path):
    (tmp_path / "7").mkdir()
    np.save(tmp_path / "7" / "a.npy", np.arange(1000, dtype=np.float64).reshape(10, 100))
    np.savez(tmp_path / "7" / "b.npz", x=np.ones(5), y=np.zeros((2, 2)))
    mm = np.lib.format.open_memmap(tmp_path / "7" / "m.npy", "w+", np.int16, (64,))
    mm[:] = 3
    mm.flush()
    del mm
    assert judge_step(disk_step(tmp_path, "7")).complete
    a = tmp_path / "7" / "a.npy"
    a.write_bytes(a.read_bytes()[:-8])
    v = judge_step(disk_step(tmp_path, "7"))
    assert kinds(v) == {(Kind.DAMAGED, "7/a.npy")} and "truncated" in v.reasons[0]
    with pytest.raises(ValueError):
        np.load(a)


def test_hf_sharded_index_by_hand(tmp_path):
    import torch
    from safetensors.torch import save_file

    step = tmp_path / "checkpoint-500"
    step.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.randn(50, 8)},
        "model-00002-of-00002.safetensors": {
            "head.weight": torch.randn(8, 50),
            "head.b": torch.ones(8),
        },
    }
    weight_map, total = {}, 0
    for fname, tensors in shards.items():
        save_file(tensors, step / fname, metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (step / "model.safetensors.index.json").write_text(json.dumps(index))
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    v = judge_step(disk_step(tmp_path, "checkpoint-500"))
    assert (v.format, v.complete) == ("hf-sharded+safetensors", True), v.reasons
    (step / "model-00002-of-00002.safetensors").unlink()
    v = judge_step(disk_step(tmp_path, "checkpoint-500"))
    assert kinds(v) == {(Kind.MISSING, "checkpoint-500/model-00002-of-00002.safetensors")}
    assert "maps 2 tensors" in v.reasons[0]
    tmp = tmp_path / "tmp-checkpoint-600"
    shutil.copytree(step, tmp)
    assert (Kind.UNFINISHED, "tmp-checkpoint-600") in kinds(
        judge_step(disk_step(tmp_path, "tmp-checkpoint-600"))
    )


# ------------------------------------------------------------------ Orbax


@pytest.fixture(scope="module")
def orbax_steps(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("orbax")
    code = r"""
import sys, jax.numpy as jnp, orbax.checkpoint as ocp
mgr = ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(max_to_keep=5))
state = {"w": jnp.arange(256.0).reshape(16, 16), "b": jnp.ones(7), "n": 3}
for step in (100, 200):
    mgr.save(step, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
print("SAVED")
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(root / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0 and "SAVED" in out.stdout, out.stderr[-3000:]
    return root / "ckpt"


def restores(root: Path, step: int) -> bool:
    code = r"""
import sys, orbax.checkpoint as ocp
mgr = ocp.CheckpointManager(sys.argv[1])
try:
    mgr.restore(int(sys.argv[2]), args=ocp.args.StandardRestore())
except Exception as exc:
    print("FAILED", type(exc).__name__); sys.exit(3)
print("RESTORED")
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), str(step)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return out.returncode == 0 and "RESTORED" in out.stdout


def test_orbax_complete_and_commit_record_rules(orbax_steps, tmp_path):
    v = judge_step(disk_step(orbax_steps, "100"))
    assert (v.format, v.complete) == ("orbax", True), v.reasons
    root = tmp_path / "c"
    shutil.copytree(orbax_steps, root)
    # as orbax 0.11.x-0.12.1 leave a renamed step: no commit_success.txt anywhere
    for p in root.glob("200/**/commit_success.txt"):
        p.unlink()
    (root / "200" / "commit_success.txt").unlink(missing_ok=True)
    v = judge_step(disk_step(root, "200"))
    assert v.complete and any("commit_timestamp_nsecs" in n for n in v.notes), v.reasons
    meta_path = root / "200" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    meta["commit_timestamp_nsecs"] = None
    meta_path.write_text(json.dumps(meta))
    v = judge_step(disk_step(root, "200"))
    assert kinds(v) == {(Kind.UNFINISHED, "200/_CHECKPOINT_METADATA")}


def test_orbax_zero_byte_shard_fails_and_orbax_agrees(orbax_steps, tmp_path):
    root = tmp_path / "z"
    shutil.copytree(orbax_steps, root)
    data = sorted((root / "200").glob("default/**/d/*"))
    assert len(data) >= 2
    data[0].write_bytes(b"")
    v = judge_step(disk_step(root, "200"))
    rel = str(data[0].relative_to(root))
    assert kinds(v) == {(Kind.DAMAGED, rel)} and "0 bytes" in v.reasons[0]
    # one zeroed data file may hold nothing the restore reads; with all of them zeroed
    # (power loss before the page cache was written) Orbax fails too
    for p in data:
        p.write_bytes(b"")
    v = judge_step(disk_step(root, "200"))
    assert kinds(v) == {(Kind.DAMAGED, str(p.relative_to(root))) for p in data}
    assert judge_step(disk_step(root, "100")).complete
    assert restores(root, 100)
    assert not restores(root, 200)


def test_orbax_missing_manifest_and_tmp_name(orbax_steps, tmp_path):
    root = tmp_path / "m"
    shutil.copytree(orbax_steps, root)
    (root / "200" / "default" / "manifest.ocdbt").unlink()
    v = judge_step(disk_step(root, "200"))
    assert kinds(v) == {(Kind.MISSING, "200/default/manifest.ocdbt")}
    (root / "100").rename(root / "100.orbax-checkpoint-tmp-1")
    v = judge_step(disk_step(root, "100.orbax-checkpoint-tmp-1"))
    assert kinds(v) == {(Kind.UNFINISHED, "100.orbax-checkpoint-tmp-1")}


def test_corrupt_zip_central_directory_of_npz(tmp_path):
    (tmp_path / "3").mkdir()
    np.savez(tmp_path / "3" / "a.npz", x=np.arange(100))
    p = tmp_path / "3" / "a.npz"
    with zipfile.ZipFile(p) as zf:
        assert zf.namelist() == ["x.npy"]
    p.write_bytes(p.read_bytes()[:-40])
    assert kinds(judge_step(disk_step(tmp_path, "3"))) == {(Kind.DAMAGED, "3/a.npz")}
