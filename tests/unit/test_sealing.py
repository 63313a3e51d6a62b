"""Seal rules (PROTOCOL.md section 3 and generic mode), without a mount."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierfs.node.sealing import SealCandidate, SealRules


@dataclass
class FakeView:
    """A view described by a dict: path -> 'dir' | 'file' | 'link' | file content (str)."""

    entries: dict[str, str] = field(default_factory=dict)
    others: set[str] = field(default_factory=set)  # other ranks' files (whole-step view)

    def is_dir(self, path: str) -> bool:
        return self.entries.get(path) == "dir"

    def exists(self, path: str) -> bool:
        return path in self.entries

    def read_text(self, path: str, limit: int = 256) -> str | None:
        v = self.entries.get(path)
        return None if v in (None, "dir", "link", "file") else v

    def is_other_rank(self, path: str) -> bool:
        return path in self.others

    def listdir(self, path: str) -> list[str]:
        prefix = f"{path}/" if path else ""
        return sorted(
            {
                p[len(prefix) :].split("/")[0]
                for p in self.entries
                if p.startswith(prefix) and p != path
            }
        )


def test_orbax_rename_into_digits_seals():
    rules = SealRules("orbax")
    view = FakeView({"5": "dir"})
    assert rules.on_rename("5.orbax-checkpoint-tmp", "5", True, False, view) == SealCandidate(
        5, "5", ("5",), "renamed into place"
    )


def test_orbax_temp_names_lock_files_and_inner_renames_never_seal():
    rules = SealRules("orbax")
    view = FakeView({"5.orbax-checkpoint-tmp": "dir"})
    assert rules.on_rename("x", "5.orbax-checkpoint-tmp", True, False, view) is None
    assert (
        rules.on_rename(
            "5.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp",
            "5.orbax-checkpoint-tmp/state",
            True,
            False,
            view,
        )
        is None
    )
    assert (
        rules.on_rename(
            "5/state/manifest.ocdbt.__lock", "5/state/manifest.ocdbt", False, False, view
        )
        is None
    )
    assert rules.on_release("5.orbax-checkpoint-tmp/commit_success.txt", view) is None


def test_renaming_a_marker_symlink_is_not_a_save():
    rules = SealRules("orbax")
    assert rules.on_rename("job-s5-n0-w0.restore", "5", False, True, FakeView()) is None
    assert (
        SealRules("pytorch.distributed").on_rename(
            "job-s5-n0-w0.restore", "step=5", False, True, FakeView()
        )
        is None
    )


def test_nemo_async_rename_and_sync_unfinished_removal():
    rules = SealRules("pytorch.distributed")
    view = FakeView({"step=7": "dir", "41": "dir"})
    assert rules.on_rename("step=42", "41", True, False, view).step == 41
    cand = rules.on_remove("step=7-unfinished", view)
    assert cand == SealCandidate(7, "step=7", ("step=7",), "-unfinished marker removed")
    # while the marker is still there nothing seals
    view.entries["step=8"] = "dir"
    view.entries["step=8-unfinished"] = "file"
    assert rules.on_remove("step=8-unfinished", view) is None
    # orbax does not know the NeMo convention
    assert SealRules("orbax").on_remove("step=7-unfinished", FakeView({"step=7": "dir"})) is None


def test_pytorch_files_seal_when_all_workers_exist():
    rules = SealRules("pytorch", job="job", rank=1, workers_per_node=2)
    view = FakeView({"job-s3-n1-w0.save": "file"})
    assert rules.on_release("job-s3-n1-w0.save", view) is None
    view.entries["job-s3-n1-w1.save"] = "file"
    cand = rules.on_release("job-s3-n1-w1.save", view)
    assert cand is not None and cand.step == 3
    assert cand.entries == ("job-s3-n1-w0.save", "job-s3-n1-w1.save")
    # another rank's or job's files are not ours
    assert rules.on_release("job-s3-n0-w0.save", view) is None
    assert rules.on_release("other-s3-n1-w0.save", view) is None


def test_generic_rename_into_pattern_and_temp_names():
    rules = SealRules("generic")
    view = FakeView({"checkpoint-500": "dir", "tmp-checkpoint-500": "dir"})
    assert rules.on_rename("tmp-checkpoint-500", "checkpoint-500", True, False, view).step == 500
    assert rules.on_rename("a", "tmp-checkpoint-500", True, False, view) is None
    assert rules.on_rename("a", "checkpoint-500.tmp", True, False, view) is None


def test_generic_marker_files():
    rules = SealRules("generic")
    view = FakeView({"step_10": "dir", "step_10/.metadata": "file", "other": "dir"})
    assert rules.on_release("step_10/.metadata", view).step == 10
    assert rules.on_release("step_10/commit_success.txt", view).name == "step_10"
    assert rules.on_release("other/.metadata", view) is None
    assert rules.on_release("step_10/sub/.metadata", view) is None


def test_generic_hf_trainer_checkpoint_saved_in_place_seals_on_trainer_state():
    """Regression (a new user's trial, stop 24): the HF Trainer writes ``checkpoint-N/`` in
    place (no temp directory, no rename), so it never sealed in generic mode; its last
    file, ``trainer_state.json``, is the marker now."""
    rules = SealRules("generic")
    view = FakeView(
        {
            "checkpoint-500": "dir",
            "checkpoint-500/model.safetensors": "file",
            "checkpoint-500/trainer_state.json": "file",
            "runs": "dir",
        }
    )
    assert rules.on_release("checkpoint-500/model.safetensors", view) is None
    cand = rules.on_release("checkpoint-500/trainer_state.json", view)
    assert cand == SealCandidate(
        500, "checkpoint-500", ("checkpoint-500",), "marker trainer_state.json"
    )
    assert rules.on_release("runs/trainer_state.json", view) is None
    assert rules.on_release("tmp-checkpoint-500/trainer_state.json", view) is None
    assert [c.name for c in rules.scan(view)] == ["checkpoint-500"]


def test_generic_trackers_megatron_and_deepspeed():
    rules = SealRules("generic")
    view = FakeView(
        {
            "iter_0000500": "dir",
            "latest_checkpointed_iteration.txt": "500\n",
            "global_step20": "dir",
            "latest": "global_step20",
        }
    )
    cand = rules.on_release("latest_checkpointed_iteration.txt", view)
    assert cand == SealCandidate(
        500,
        "iter_0000500",
        ("iter_0000500", "latest_checkpointed_iteration.txt"),
        "tracker latest_checkpointed_iteration.txt",
    )
    cand = rules.on_release("latest", view)
    assert cand is not None and (cand.step, cand.entries) == (20, ("global_step20", "latest"))
    view.entries["latest_checkpointed_iteration.txt"] = "release"
    assert rules.on_release("latest_checkpointed_iteration.txt", view) is None


def test_custom_patterns():
    rules = SealRules("generic", patterns=[r"^ckpt_(?P<step>\d+)_final$"])
    view = FakeView({"ckpt_7_final": "dir"})
    assert rules.on_rename("x", "ckpt_7_final", True, False, view).step == 7
    assert rules.on_rename("x", "checkpoint-7", True, False, view) is None


def test_scan_after_restart():
    view = FakeView(
        {"3": "dir", "4": "dir", "5.orbax-checkpoint-tmp": "dir", "job-s2-n0-w0.restore": "link"}
    )
    assert [c.step for c in SealRules("orbax").scan(view)] == [3, 4]
    view = FakeView(
        {
            "checkpoint-10": "dir",
            "checkpoint-10/.metadata": "file",
            "checkpoint-20": "dir",
            "step=5": "dir",
            "step=6": "dir",
            "step=6-unfinished": "file",
        }
    )
    assert [c.name for c in SealRules("generic").scan(view)] == ["step=5", "checkpoint-10"]
