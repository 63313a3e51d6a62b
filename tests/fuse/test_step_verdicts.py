"""Issue #15 through a real mount: a step renamed into place that its framework could not
load (a shard truncated to 0 bytes, no commit record) is never restored while an older
complete step exists, and ``replicator.errors`` and ``tierfs status`` say why."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest
from conftest import tierfs
from mtc_clients import nemo_write_yaml, ocdbt_manifest, orbax_yaml, wait_for
from step_bytes import dcp_metadata


def status(d: Path) -> dict:
    return json.loads((d / ".tierfs" / "status.json").read_text())


def wait_sealed(d: Path, step: int) -> None:
    def sealed() -> bool:
        return any(s["step"] == step and s["state"] != "writing" for s in status(d)["steps"])

    wait_for(sealed, 60, f"step {step} sealed")


def put(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def orbax_files(shard: bytes, commit: bool) -> dict[str, bytes]:
    meta: dict = {"item_handlers": {"state": "PyTreeCheckpointHandler"}}
    if commit:
        meta["commit_timestamp_nsecs"] = 1
    out = {
        "_CHECKPOINT_METADATA": json.dumps(meta).encode(),
        "state/_METADATA": b'{"tree_metadata": {}, "use_ocdbt": true}',
        "state/manifest.ocdbt": ocdbt_manifest(b"m" * 30),
        "state/ocdbt.process_0/manifest.ocdbt": ocdbt_manifest(b"p" * 30),
        "state/ocdbt.process_0/d/shard0": shard,
    }
    if commit:
        out["commit_success.txt"] = b"Checkpoint commit was successful"
    return out


SHARD = os.urandom(5000)


def dcp_files(shard: bytes) -> dict[str, bytes]:
    return {
        ".metadata": dcp_metadata([("model.w", "__0_0.distcp", 0, len(SHARD))]),
        "__0_0.distcp": shard,
    }


def save_renamed(d: Path, step: int, files: dict[str, bytes], tmp_suffix: str) -> None:
    """Write ``<step><tmp_suffix>/`` and rename it to ``<step>`` (the framework's final step)."""
    tmp = d / f"{step}{tmp_suffix}"
    put(tmp, files)
    os.rename(tmp, d / str(step))


def restore_marker(d: Path) -> str:
    marker = wait_for(lambda: glob.glob(str(d / "*.restore")), 60, "a restore marker")
    return os.path.basename(sorted(marker)[0])


def errors(d: Path) -> str:
    p = d / "replicator.errors"
    return p.read_text() if p.exists() else ""


def check_named(d: Path, reason: str) -> None:
    """``replicator.errors`` and ``tierfs status`` name step 200's reason, the seal-time
    line once."""
    text = errors(d)
    assert reason in text, text
    seal_line = "step 200 (200, "
    assert text.count(seal_line) <= 1, text
    out = tierfs("status", str(d)).stdout
    assert reason in out, out


def test_orbax_truncated_uncommitted_step_is_not_restored(make_mount):
    m = make_mount()
    d = m.path
    (d / "replicator.yaml").write_text(orbax_yaml("job", 0, 1))
    assert restore_marker(d) == "job-s0-n0-w0.restore"  # a fresh start
    os.unlink(d / "job-s0-n0-w0.restore")
    save_renamed(d, 100, orbax_files(SHARD, commit=True), ".orbax-checkpoint-tmp")
    wait_sealed(d, 100)
    save_renamed(d, 200, orbax_files(b"", commit=False), ".orbax-checkpoint-tmp")
    wait_sealed(d, 200)
    reason = "damaged: 200/state/ocdbt.process_0/d/shard0"
    wait_for(lambda: "step 200 (200, orbax) is not loadable" in errors(d), 60, "seal line")
    assert reason in errors(d) or "unfinished: 200/_CHECKPOINT_METADATA" in errors(d)
    m.kill9()
    m.mount()
    (d / "replicator.errors").unlink(missing_ok=True)
    (d / "replicator.yaml").write_text(orbax_yaml("job", 0, 1))
    assert restore_marker(d) == "job-s100-n0-w0.restore"
    restore = status(d)["restore"]
    assert restore["step"] == 100 and "step 200 is not loadable" in restore["reason"]
    check_named(d, "step 200 is not loadable")
    os.replace(d / "job-s100-n0-w0.restore", d / "100")
    assert (d / "100" / "state" / "ocdbt.process_0" / "d" / "shard0").read_bytes() == SHARD


def test_dcp_truncated_shard_is_not_restored_in_pytorch_distributed_mode(make_mount):
    m = make_mount()
    d = m.path
    nemo_write_yaml(d, "job", 0, 1)
    wait_for(lambda: not (d / "replicator.yaml").exists(), 60, "yaml consumed")
    save_renamed(d, 100, dcp_files(SHARD), ".tmp")
    wait_sealed(d, 100)
    save_renamed(d, 200, dcp_files(b""), ".tmp")
    wait_sealed(d, 200)
    wait_for(lambda: "step 200 (200, dcp) is not loadable" in errors(d), 60, "seal line")
    assert "damaged: 200/__0_0.distcp" in errors(d)
    m.kill9()
    m.mount()
    (d / "replicator.errors").unlink(missing_ok=True)
    for marker in glob.glob(str(d / "*.restore")):
        os.unlink(marker)
    nemo_write_yaml(d, "job", 0, 1)
    assert restore_marker(d) == "job-s100-n0-w0.restore"
    assert status(d)["restore"]["step"] == 100
    check_named(d, "step 200 is not loadable: damaged: 200/__0_0.distcp")
    # an older step than one written: tierfs wait says so in its exit code too
    waited = tierfs("wait", str(d), "--timeout", "60", check=False)
    assert (waited.returncode, waited.stdout.strip()) == (2, "restored step 100 from local"), (
        waited.stderr
    )
    assert "warning: step 100 is not the newest step written" in waited.stderr
    assert "step 200 is not loadable: damaged: 200/__0_0.distcp" in waited.stderr
    accepted = tierfs("wait", str(d), "--accept-older", "--timeout", "60", check=False)
    assert (accepted.returncode, accepted.stdout) == (0, waited.stdout), accepted.stderr
    assert "step 200 is not loadable" in accepted.stderr


def test_generic_mode_names_the_step_that_would_not_load(make_mount):
    m = make_mount()
    d = m.path
    save_renamed(d, 100, dcp_files(SHARD), ".tmp")
    wait_sealed(d, 100)
    save_renamed(d, 200, dcp_files(b""), ".tmp")
    wait_sealed(d, 200)
    wait_for(lambda: "step 200 (200, dcp) is not loadable" in errors(d), 60, "seal line")
    check_named(d, "damaged: 200/__0_0.distcp")
    assert "step 100" not in errors(d)
    loads = {s["step"]: s.get("loads") for s in status(d)["steps"]}
    assert loads[100] == "yes (dcp)"
    assert loads[200].startswith("no: damaged: 200/__0_0.distcp"), loads
    table = tierfs("status", str(d)).stdout
    assert "loads" in table and "yes (dcp)" in table, table
    # the verdict lives in the manifest on disk: a restarted daemon keeps it
    m.kill9()
    m.mount()
    manifests = {
        int(Path(p).parent.name): json.loads(Path(p).read_text())
        for p in glob.glob(str(m.ram_dir / "store" / "shards" / "*" / "0" / "*" / "manifest.json"))
    }
    assert manifests[100]["verdict"]["state"] == "complete"
    assert manifests[200]["verdict"]["state"] == "incomplete"
    assert [p["kind"] for p in manifests[200]["verdict"]["problems"]] == ["damaged"]


@pytest.mark.parametrize(
    ("tracker", "dirname", "text"),
    [
        ("latest_checkpointed_iteration.txt", "iter_{:07d}", "{}"),
        ("latest", "global_step{}", "global_step{}"),
    ],
    ids=["megatron", "deepspeed"],
)
def test_a_tracker_rewritten_for_the_next_step_leaves_the_step_before_sealed(
    make_mount, tracker, dirname, text
):
    """Regression (a new user's trial): Megatron and DeepSpeed rewrite their tracker file
    in place for every save. It was hard-linked into the previous step's snapshot, so the
    rewrite withdrew that step's seal ("a sealed file was opened for writing"): only the
    newest step was ever sealed, with nothing older to fall back on."""
    m = make_mount()
    d = m.path
    for step in (100, 200):
        part = d / dirname.format(step) / "mp_rank_00"
        part.mkdir(parents=True)
        (part / "model_optim_rng.pt").write_bytes(os.urandom(2000))
        (d / tracker).write_text(text.format(step))  # in place, as both frameworks do
        wait_sealed(d, step)
    states = {s["step"]: s["state"] for s in status(d)["steps"]}
    assert states[100] != "writing" and states[200] != "writing", states
    assert "a sealed file was opened for writing" not in m.log()
    # each snapshot keeps the tracker as it named its own step
    for step in (100, 200):
        (kept,) = glob.glob(str(m.ram_dir / "store" / "shards" / "*" / "0" / str(step)))
        assert (Path(kept) / "data" / tracker).read_text() == text.format(step)


def hf_trainer_checkpoint(d: Path, step: int, cut: bool) -> None:
    """What ``transformers.Trainer._save_checkpoint`` leaves in ``checkpoint-<step>/``, written
    in place in its order (model, optimizer, scheduler, RNG state, then
    ``trainer_state.json``), with the real safetensors and torch writers; ``cut``: the model
    file is cut short (a node that lost power mid-save)."""
    import numpy as np
    import torch
    from safetensors.numpy import save_file

    ckpt = d / f"checkpoint-{step}"
    ckpt.mkdir()
    weights = {"w": np.arange(4096, dtype=np.float32) * step}
    save_file(weights, str(ckpt / "model.safetensors"))
    if cut:
        os.truncate(ckpt / "model.safetensors", 1000)
    (ckpt / "config.json").write_text('{"model_type": "tiny"}')
    torch.save({"state": {0: torch.ones(64) * step}}, ckpt / "optimizer.pt")
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    torch.save({"python": step}, ckpt / "rng_state.pth")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_hf_trainer_checkpoint_saved_in_place_seals_and_a_cut_model_does_not_load(make_mount):
    """Regression (a new user's trial, stop 24): an HF Trainer ``checkpoint-N/`` written in
    place never sealed in generic mode, so it was neither replicated nor backed up and no
    verdict was given. Now ``trainer_state.json`` seals it and the validators judge it."""
    m = make_mount()
    d = m.path
    hf_trainer_checkpoint(d, 100, cut=False)
    wait_sealed(d, 100)
    hf_trainer_checkpoint(d, 200, cut=True)
    wait_sealed(d, 200)
    wait_for(lambda: "step 200 (checkpoint-200, " in errors(d), 60, "seal line")
    check_named(d, "damaged: checkpoint-200/model.safetensors")
    loads = {s["step"]: s.get("loads") for s in status(d)["steps"]}
    assert loads[100].startswith("yes"), loads
    assert loads[200].startswith("no: damaged: checkpoint-200/model.safetensors"), loads


def test_a_change_to_a_step_dropped_by_retention_does_not_seal_it_again(make_mount):
    """Regression (CI under load, test_dcp_training_loop_resumes_from_the_newest_step): a
    late change event of step 1, whose snapshot retention had dropped, sealed it again as
    the newest step (retention counts seal times), so retention dropped step 3."""
    m = make_mount("--keep-local", "2")
    d = m.path

    def save(step: int) -> None:
        put(d / f"tmp-checkpoint-{step}", {"model.bin": os.urandom(3000) + bytes([step])})
        os.rename(d / f"tmp-checkpoint-{step}", d / f"checkpoint-{step}")
        wait_sealed(d, step)

    def held() -> set[int]:
        return {s["step"] for s in status(d)["steps"] if s["state"] != "writing"}

    for step in (1, 2, 3):
        save(step)
    wait_for(lambda: held() == {2, 3}, 60, "step 1 dropped by retention")
    (d / "checkpoint-1" / "extra.json").write_text("{}")  # a change after its seal
    save(4)
    assert held() == {3, 4}, status(d)["steps"]
    assert "sealed step 1" not in m.log().split("dropping shard")[-1], m.log()[-3000:]
