"""state.json (tierfs/node/statefile.py): what a restarted daemon reads back (pure parts,
plus one file round trip in tmp_path)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

from tierfs.core.control import JobSpec
from tierfs.node import statefile
from tierfs.node.sealing import SealCandidate
from tierfs.node.view import Published
from tierfs.store.shards import ShardKey


def saved() -> statefile.SavedState:
    return statefile.SavedState(
        mode="protocol",
        job=JobSpec("train", "orbax", 1, 4),
        view_steps={"5": ShardKey("train", 1, 5)},
        published={
            "train-s5-n1-w0.restore": Published(
                "train-s5-n1-w0.restore", ".s5", ShardKey("train", 1, 5), "5"
            )
        },
        restore={"state": "barrier", "step": 5},
        pending=[SealCandidate(6, "6", ("6",), "renamed into place")],
    )


def test_a_saved_state_reads_back_the_same(tmp_path):
    statefile.save(str(tmp_path), saved())
    path = tmp_path / statefile.STATE_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text())["version"] == statefile.STATE_VERSION
    assert statefile.load(str(path)) == saved()


def test_the_file_format_is_unchanged():
    assert json.loads(statefile.encode(saved())) == {
        "version": 1,
        "mode": "protocol",
        "job": JobSpec("train", "orbax", 1, 4).to_dict(),
        "view_steps": {"5": ["train", 1, 5]},
        "published": {"train-s5-n1-w0.restore": [".s5", "train", 1, 5, "5"]},
        "restore": {"state": "barrier", "step": 5},
        "pending": {"6": [6, ["6"], "renamed into place"]},
    }


def test_a_generic_job_or_a_bad_one_is_not_kept(tmp_path):
    data = json.loads(statefile.encode(saved()))
    assert statefile.decode({**data, "mode": "generic"}).job is None
    broken = statefile.decode({**data, "job": {"name": "x"}})
    assert broken.job is None and broken.mode == "none"
    assert statefile.decode({**data, "pending": {"6": ["x", [], ""]}}).pending == []


def test_a_missing_or_garbled_file_is_the_empty_state(tmp_path):
    assert statefile.load(str(tmp_path / "none.json")) == statefile.SavedState()
    (tmp_path / "bad.json").write_text("[1, 2")
    assert statefile.load(str(tmp_path / "bad.json")) == statefile.SavedState()
    (tmp_path / "list.json").write_text("[1, 2]")
    assert statefile.load(str(tmp_path / "list.json")) == statefile.SavedState()


def test_abandoned_steps_are_kept_and_a_bad_entry_drops_them():
    gone = {"checkpoint-40": ShardKey("train", 1, 40)}
    data = json.loads(statefile.encode(dataclasses.replace(saved(), abandoned=gone)))
    assert data["abandoned"] == {"checkpoint-40": ["train", 1, 40]}
    assert statefile.decode(data).abandoned == gone
    assert statefile.decode({**data, "abandoned": {"x": ["train", "one", 40]}}).abandoned == {}
    assert statefile.decode({**data, "abandoned": ["x"]}).abandoned == {}
