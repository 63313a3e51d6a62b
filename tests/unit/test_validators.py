"""Per-format step validators (issue #15) over in-memory steps: each layout of the issue."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct

import numpy as np
import pytest
from step_bytes import (
    dcp_metadata,
    evil_pickle,
    mem_step,
    ocdbt_manifest,
    safetensors_bytes,
    torch_like_zip,
)

from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.validators import Kind, StepFiles, judge_step, step_files_from_manifests
from tierfs.store.validators.dcp_pickle import BadMetadata, parse_metadata


def kinds(v) -> set[tuple[Kind, str]]:
    return {(p.kind, p.path) for p in v.problems}


# ------------------------------------------------------------------ DCP


def dcp_two_ranks() -> tuple[bytes, dict[str, int]]:
    md = dcp_metadata([("w", "__0_0.distcp", 0, 100), ("w2", "__1_0.distcp", 0, 80)])
    return md, {"step_10/__0_0.distcp": 100, "step_10/__1_0.distcp": 80}


def test_dcp_two_ranks_complete_across_parts():
    md, sizes = dcp_two_ranks()
    step = mem_step(
        "step_10",
        {"step_10/.metadata": md, "step_10/__0_0.distcp": b"\x01" * 100},
        sizes=sizes,
        holders={"step_10/__1_0.distcp": 1},
    )
    v = judge_step(step)
    assert (v.format, v.complete, v.unknown_layout, v.problems) == ("dcp", True, False, ())
    assert v.summary() == "step step_10 (dcp): complete"


def test_dcp_rank0_alone_misses_rank1_shard_not_damaged():
    md, _ = dcp_two_ranks()
    step = mem_step("step_10", {"step_10/.metadata": md, "step_10/__0_0.distcp": b"\x01" * 100})
    v = judge_step(step)
    assert not v.complete and v.part_ok
    assert kinds(v) == {(Kind.MISSING, "step_10/__1_0.distcp")}
    assert "names it for 'w2'" in v.reasons[0]


def test_dcp_rank1_alone_misses_metadata_of_rank0():
    v = judge_step(mem_step("step_10", {"step_10/__1_0.distcp": b"\x01" * 80}))
    assert (v.format, v.complete, v.part_ok) == ("dcp", False, True)
    assert kinds(v) == {(Kind.MISSING, "step_10/.metadata")}
    assert "rank 0" in v.reasons[0]


def test_dcp_metadata_held_by_another_node_is_unreadable_here():
    md, sizes = dcp_two_ranks()
    step = mem_step(
        "step_10",
        {"step_10/__1_0.distcp": b"\x01" * 80},
        sizes={**sizes, "step_10/.metadata": len(md)},
        holders={"step_10/.metadata": 0},
    )
    v = judge_step(step)
    assert kinds(v) == {(Kind.UNREADABLE, "step_10/.metadata")}
    assert "(rank 0)" in v.reasons[0]


def test_dcp_shard_truncated_to_zero_bytes_is_damaged():
    md, sizes = dcp_two_ranks()
    sizes["step_10/__1_0.distcp"] = 0
    v = judge_step(mem_step("step_10", {"step_10/.metadata": md}, sizes=sizes))
    assert not v.complete and not v.part_ok
    assert kinds(v) == {(Kind.DAMAGED, "step_10/__1_0.distcp")}
    assert "0 bytes" in v.reasons[0] and "bytes up to 80" in v.reasons[0]


def test_dcp_short_shard_is_damaged():
    md, sizes = dcp_two_ranks()
    sizes["step_10/__0_0.distcp"] = 99
    v = judge_step(mem_step("step_10", {"step_10/.metadata": md}, sizes=sizes))
    assert kinds(v) == {(Kind.DAMAGED, "step_10/__0_0.distcp")}


def test_dcp_without_metadata_and_with_tmp_only():
    v = judge_step(
        mem_step(
            "step_500", {"step_500/__0_0.distcp": b"x" * 10, "step_500/.metadata.tmp": b"x" * 5}
        )
    )
    assert kinds(v) == {(Kind.MISSING, "step_500/.metadata")}
    assert "did not finish" in v.reasons[0]


@pytest.mark.parametrize(
    "data, why",
    [
        (b"", "0 bytes"),
        (b"not a pickle at all", "not a DCP Metadata pickle"),
        (pickle.dumps({"a": 1}), "not a DCP Metadata"),
        (evil_pickle(), "refused"),
    ],
)
def test_dcp_bad_metadata_is_damaged(data, why):
    v = judge_step(mem_step("s", {"s/.metadata": data, "s/__0_0.distcp": b"x"}))
    assert kinds(v) == {(Kind.DAMAGED, "s/.metadata")}
    assert why in v.reasons[0]


def test_evil_pickle_never_runs():
    marker = "/tmp/tierfs-validator-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    with pytest.raises(BadMetadata, match="refused"):
        parse_metadata(evil_pickle())
    assert not os.path.exists(marker)


def test_dcp_metadata_cut_off_is_damaged():
    md, _ = dcp_two_ranks()
    v = judge_step(mem_step("s", {"s/.metadata": md[: len(md) // 2]}, sizes={}))
    assert kinds(v) == {(Kind.DAMAGED, "s/.metadata")}


def test_dcp_unsafe_relative_path_is_damaged():
    md = dcp_metadata([("w", "../escape.distcp", 0, 1)])
    v = judge_step(mem_step("s", {"s/.metadata": md, "s/__0_0.distcp": b"x"}))
    assert kinds(v) == {(Kind.DAMAGED, "s/.metadata")} and "unsafe" in v.reasons[0]


def test_dcp_declared_key_without_storage_is_damaged():
    md = dcp_metadata([("w", "__0_0.distcp", 0, 1)], declare=["w", "lost"])
    v = judge_step(mem_step("s", {"s/.metadata": md, "s/__0_0.distcp": b"x"}))
    assert kinds(v) == {(Kind.DAMAGED, "s/.metadata")} and "'lost'" in v.reasons[0]


def test_dcp_without_collectives_needs_each_ranks_metadata():
    md0 = dcp_metadata([("a", "__0_0.distcp", 0, 4)])
    blobs = {"s/__0.metadata": md0, "s/__0_0.distcp": b"x" * 4, "s/__1_0.distcp": b"y" * 4}
    v = judge_step(mem_step("s", blobs))
    assert kinds(v) == {(Kind.MISSING, "s/__1.metadata")}
    blobs["s/__1.metadata"] = dcp_metadata([("b", "__1_0.distcp", 0, 4)])
    assert judge_step(mem_step("s", blobs)).complete


def test_dcp_nested_checkpoint_dirs_are_each_judged():
    md = dcp_metadata([("w", "__0_0.distcp", 0, 4)])
    blobs = {"s/weights/.metadata": md, "s/weights/__0_0.distcp": b"x" * 4}
    blobs["s/optim/__0_0.distcp"] = b"x"
    v = judge_step(mem_step("s", blobs))
    assert kinds(v) == {(Kind.MISSING, "s/optim/.metadata")}


# ------------------------------------------------------------------ safetensors


def st_file() -> bytes:
    return safetensors_bytes(
        {
            "a": ("F32", [2, 3], struct.pack("<6f", *range(6))),
            "b": ("BF16", [4], b"\x00" * 8),
            "c": ("I64", [], b"\x00" * 8),
        }
    )


def test_safetensors_complete_and_names_recorded():
    v = judge_step(mem_step("100", {"100/model.safetensors": st_file()}))
    assert (v.format, v.complete) == ("safetensors", True)


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda b: b"", "0 bytes"),
        (lambda b: b[:5], "5 bytes"),
        (lambda b: b[:20], "cut off"),
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\x00", "the file has"),
        (lambda b: b[:8] + b"[" + b[9:], "not JSON"),
        (lambda b: struct.pack("<Q", 200_000_000) + b[8:], "over safetensors' limit"),
    ],
)
def test_safetensors_damage(mutate, why):
    v = judge_step(mem_step("100", {"100/model.safetensors": mutate(st_file())}))
    assert kinds(v) == {(Kind.DAMAGED, "100/model.safetensors")}
    assert why in v.reasons[0]


def test_safetensors_wrong_tensor_size_and_gap():
    bad = safetensors_bytes({"a": ("F32", [3], b"\x00" * 8)})
    v = judge_step(mem_step("1", {"1/m.safetensors": bad}))
    assert "needs 12 bytes" in v.reasons[0]
    header = json.dumps({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}).encode()
    gap = struct.pack("<Q", len(header)) + header + b"\x00" * 4
    v = judge_step(mem_step("1", {"1/m.safetensors": gap}))
    assert "starts at 2, expected 0" in v.reasons[0]


def test_safetensors_unknown_dtype_judged_by_contiguity_only():
    ok = safetensors_bytes({"a": ("F12_FUTURE", [3], b"\x00" * 5)})
    assert judge_step(mem_step("1", {"1/m.safetensors": ok})).complete


@pytest.mark.parametrize("dtype", [b'" F3"', b'"F3 "', b'"f32"', b'"F-2"'])
def test_safetensors_malformed_dtype_is_damage(dtype):
    # a byte flipped in a dtype name (Hypothesis found ' F16', which safetensors
    # refuses) is damage, not a dtype newer than the table
    good = st_file()
    bad = good.replace(b'"F32"', dtype, 1)
    assert len(bad) == len(good)
    v = judge_step(mem_step("1", {"1/m.safetensors": bad}))
    assert kinds(v) == {(Kind.DAMAGED, "1/m.safetensors")}
    assert "no valid dtype" in v.reasons[0]


def test_safetensors_remote_shard_judged_by_size_only():
    v = judge_step(mem_step("1", {}, sizes={"1/m.safetensors": 1000}))
    assert v.complete and v.format == "safetensors"
    v = judge_step(mem_step("1", {}, sizes={"1/m.safetensors": 0}))
    assert kinds(v) == {(Kind.DAMAGED, "1/m.safetensors")}


# ------------------------------------------------------------------ torch.save, numpy


def test_torch_save_zip_complete_and_corrupt():
    good = torch_like_zip()
    assert judge_step(mem_step("s", {"s/model.pt": good})).format == "torch.save"
    assert judge_step(mem_step("s", {"s/model.pt": good})).complete
    for bad, why in [
        (b"", "0 bytes"),
        (good[:-10], "central directory"),
        (good[: len(good) // 2], "central directory"),
        (good[:4] + good[4:].replace(b"PK\x03\x04", b"JUNK"), "no local header"),
        (b"hello world", "neither a zip"),
    ]:
        v = judge_step(mem_step("s", {"s/model.pt": bad}))
        assert kinds(v) == {(Kind.DAMAGED, "s/model.pt")}, (bad[:8], v.reasons)
        assert why in v.reasons[0]


def test_zip_without_data_pkl_is_not_torch_save():
    buf = io.BytesIO()
    import zipfile

    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("a.txt", b"x")
    v = judge_step(mem_step("s", {"s/x.pth": buf.getvalue()}))
    assert "without data.pkl" in v.reasons[0]


def test_legacy_torch_pickle_and_foreign_bin():
    v = judge_step(mem_step("s", {"s/old.pt": pickle.dumps({"a": 1}, protocol=2)}))
    assert v.complete and "legacy" in v.notes[0]
    v = judge_step(mem_step("s", {"s/raw.bin": b"\x01\x02\x03"}))
    assert v.unknown_layout and v.complete


def test_npy_complete_and_truncated():
    buf = io.BytesIO()
    np.save(buf, np.arange(100, dtype=np.float32))
    good = buf.getvalue()
    assert judge_step(mem_step("s", {"s/a.npy": good})).complete
    v = judge_step(mem_step("s", {"s/a.npy": good[:-4]}))
    assert kinds(v) == {(Kind.DAMAGED, "s/a.npy")} and "truncated" in v.reasons[0]
    v = judge_step(mem_step("s", {"s/a.npy": b""}))
    assert kinds(v) == {(Kind.DAMAGED, "s/a.npy")}
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert judge_step(mem_step("s", {"s/o.npy": obj.getvalue()})).complete


def test_npz_complete_and_cut():
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(10), b=np.ones(3))
    assert judge_step(mem_step("s", {"s/a.npz": buf.getvalue()})).complete
    v = judge_step(mem_step("s", {"s/a.npz": buf.getvalue()[:-30]}))
    assert kinds(v) == {(Kind.DAMAGED, "s/a.npz")}


# ------------------------------------------------------------------ Orbax


def orbax_step(commit: bool = True, ts: bool = True) -> dict[str, bytes]:
    meta = {
        "item_handlers": {
            "state": "orbax.checkpoint._src.handlers.standard_checkpoint_handler."
            "StandardCheckpointHandler"
        },
        "init_timestamp_nsecs": 1,
        "commit_timestamp_nsecs": 2 if ts else None,
    }
    blobs = {
        "100/_CHECKPOINT_METADATA": json.dumps(meta).encode(),
        "100/state/_METADATA": b'{"tree_metadata": {}, "use_ocdbt": true}',
        "100/state/_sharding": b"{}",
        "100/state/array_metadatas/process_0": b'{"array_metadatas": []}',
        "100/state/manifest.ocdbt": ocdbt_manifest(),
        "100/state/d/0123": b"x" * 40,
        "100/state/ocdbt.process_0/manifest.ocdbt": ocdbt_manifest(b"\x01" * 30),
        "100/state/ocdbt.process_0/d/abcd": b"y" * 300,
    }
    if commit:
        blobs["100/commit_success.txt"] = b"Checkpoint commit was successful to /x/100"
    return blobs


def test_orbax_complete_with_and_without_commit_success():
    assert judge_step(mem_step("100", orbax_step())).complete
    v = judge_step(mem_step("100", orbax_step(commit=False)))
    assert v.complete and v.format == "orbax"
    assert "commit_timestamp_nsecs" in v.notes[0]


def test_orbax_never_finalized():
    v = judge_step(mem_step("100", orbax_step(commit=False, ts=False)))
    assert kinds(v) == {(Kind.UNFINISHED, "100/_CHECKPOINT_METADATA")}


@pytest.mark.parametrize(
    "path, data, kind, why",
    [
        ("100/state/ocdbt.process_0/d/abcd", b"", Kind.DAMAGED, "OCDBT data file"),
        ("100/state/manifest.ocdbt", b"", Kind.DAMAGED, "0 bytes"),
        ("100/state/_METADATA", b'{"tree', Kind.DAMAGED, "not JSON"),
        ("100/_CHECKPOINT_METADATA", b"", Kind.DAMAGED, "0 bytes"),
        ("100/state/other.bin", b"", Kind.DAMAGED, "0 bytes in an Orbax step"),
    ],
)
def test_orbax_damage(path, data, kind, why):
    blobs = orbax_step()
    blobs[path] = data
    v = judge_step(mem_step("100", blobs))
    assert (kind, path) in kinds(v), v.reasons
    assert any(why in r for r in v.reasons)


def test_orbax_step_with_the_empty_backup_marker_is_complete():
    """Regression (fault campaign, seed 19): newer Orbax writes an empty
    ``_BACKUP_REQUESTED`` into the step (MTC's "back this step up"); the step was
    judged damaged and an older step restored."""
    blobs = orbax_step()
    blobs["100/_BACKUP_REQUESTED"] = b""
    v = judge_step(mem_step("100", blobs))
    assert v.complete, v.reasons


def test_orbax_manifest_checksum_and_length():
    blobs = orbax_step()
    m = bytearray(blobs["100/state/manifest.ocdbt"])
    m[14] ^= 0xFF
    blobs["100/state/manifest.ocdbt"] = bytes(m)
    assert "crc32c" in judge_step(mem_step("100", blobs)).reasons[0]
    blobs["100/state/manifest.ocdbt"] = ocdbt_manifest()[:-1]
    assert "header says" in judge_step(mem_step("100", blobs)).reasons[0]


def test_orbax_missing_parts():
    blobs = orbax_step()
    del blobs["100/state/manifest.ocdbt"]
    blobs["100/state/ocdbt.process_2/manifest.ocdbt"] = ocdbt_manifest()
    v = judge_step(mem_step("100", blobs))
    assert kinds(v) == {
        (Kind.MISSING, "100/state/manifest.ocdbt"),
        (Kind.MISSING, "100/state/ocdbt.process_1"),
    }
    blobs = orbax_step()
    for p in [p for p in blobs if p.startswith("100/state/")]:
        del blobs[p]
    blobs["100/other/x"] = b"1"
    v = judge_step(mem_step("100", blobs))
    assert (Kind.MISSING, "100/state") in kinds(v)


def test_orbax_rank1_part_alone_misses_primary_files():
    blobs = {
        "100/state/ocdbt.process_1/manifest.ocdbt": ocdbt_manifest(),
        "100/state/ocdbt.process_1/d/ff": b"z" * 10,
    }
    v = judge_step(mem_step("100", blobs))
    assert v.part_ok and not v.complete
    assert (Kind.MISSING, "100/_CHECKPOINT_METADATA") in kinds(v)


def test_orbax_inner_temp_item_is_unfinished():
    blobs = orbax_step()
    blobs["100/extra.orbax-checkpoint-tmp-5/metadata"] = b"{}"
    v = judge_step(mem_step("100", blobs))
    assert (Kind.UNFINISHED, "100/extra.orbax-checkpoint-tmp-5/metadata") in kinds(v)


# ------------------------------------------------------------------ HF sharded


def hf_step() -> dict[str, bytes]:
    s1 = safetensors_bytes({"a": ("U8", [4], b"1234")})
    s2 = safetensors_bytes({"b": ("U8", [2], b"12")})
    index = {
        "metadata": {"total_size": 6},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    return {
        "checkpoint-5/model.safetensors.index.json": json.dumps(index).encode(),
        "checkpoint-5/model-00001-of-00002.safetensors": s1,
        "checkpoint-5/model-00002-of-00002.safetensors": s2,
        "checkpoint-5/trainer_state.json": b'{"global_step": 5}',
    }


def test_hf_sharded_complete():
    v = judge_step(mem_step("checkpoint-5", hf_step()))
    assert (v.format, v.complete) == ("hf-sharded+safetensors", True)


def test_hf_index_names_absent_shard():
    blobs = hf_step()
    del blobs["checkpoint-5/model-00002-of-00002.safetensors"]
    v = judge_step(mem_step("checkpoint-5", blobs))
    assert kinds(v) == {(Kind.MISSING, "checkpoint-5/model-00002-of-00002.safetensors")}
    assert "maps 1 tensors (e.g. 'b')" in v.reasons[0]


def test_hf_shard_lacking_tensor_and_total_size():
    blobs = hf_step()
    blobs["checkpoint-5/model-00002-of-00002.safetensors"] = safetensors_bytes(
        {"c": ("U8", [2], b"12")}
    )
    v = judge_step(mem_step("checkpoint-5", blobs))
    assert "lacks 1 tensors" in v.reasons[0]
    blobs = hf_step()
    index = json.loads(blobs["checkpoint-5/model.safetensors.index.json"])
    index["metadata"]["total_size"] = 10**9
    blobs["checkpoint-5/model.safetensors.index.json"] = json.dumps(index).encode()
    assert "fewer than its total_size" in judge_step(mem_step("checkpoint-5", blobs)).reasons[0]


def test_json_of_known_layout_must_parse():
    blobs = hf_step()
    blobs["checkpoint-5/trainer_state.json"] = b""
    v = judge_step(mem_step("checkpoint-5", blobs))
    assert kinds(v) == {(Kind.DAMAGED, "checkpoint-5/trainer_state.json")}


# ------------------------------------------------------------------ Megatron, DeepSpeed


def test_megatron_tracker_and_legacy_dir():
    blobs = {
        "latest_checkpointed_iteration.txt": b"100",
        "iter_0000100/mp_rank_00/model_optim_rng.pt": torch_like_zip(),
    }
    v = judge_step(mem_step("iter_0000100", blobs))
    assert v.complete and v.format == "megatron+torch.save"
    blobs["latest_checkpointed_iteration.txt"] = b"200"
    v = judge_step(mem_step("iter_0000100", blobs))
    assert kinds(v) == {(Kind.MISSING, "iter_0000200")}
    blobs["latest_checkpointed_iteration.txt"] = b""
    assert not judge_step(mem_step("iter_0000100", blobs)).complete
    del blobs["latest_checkpointed_iteration.txt"]
    blobs["iter_0000100/mp_rank_01/distrib_optim.pt"] = torch_like_zip()
    v = judge_step(mem_step("iter_0000100", blobs))
    assert kinds(v) == {(Kind.MISSING, "iter_0000100/mp_rank_01/model_optim_rng.pt")}


def test_megatron_torch_dist_without_dcp_metadata():
    blobs = {
        "iter_0000100/metadata.json": b'{"sharded_backend": "torch_dist"}',
        "iter_0000100/common.pt": torch_like_zip(),
    }
    v = judge_step(mem_step("iter_0000100", blobs))
    assert kinds(v) == {(Kind.MISSING, "iter_0000100/.metadata")}


def test_deepspeed_latest_and_tag_dir():
    blobs = {
        "latest": b"global_step100",
        "global_step100/mp_rank_00_model_states.pt": torch_like_zip(),
        "global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt": torch_like_zip(),
        "global_step100/zero_pp_rank_2_mp_rank_00_optim_states.pt": torch_like_zip(),
    }
    v = judge_step(mem_step("global_step100", blobs))
    assert kinds(v) == {(Kind.MISSING, "global_step100/zero_pp_rank_1_mp_rank_00_optim_states.pt")}
    blobs["global_step100/zero_pp_rank_1_mp_rank_00_optim_states.pt"] = torch_like_zip()
    v = judge_step(mem_step("global_step100", blobs))
    assert v.complete and "deepspeed" in v.format
    blobs["latest"] = b"global_step200\n"
    assert kinds(judge_step(mem_step("global_step100", blobs))) == {
        (Kind.MISSING, "global_step200")
    }
    blobs["latest"] = b"global_step100"
    blobs["global_step100/zero_pp_rank_1_mp_rank_00_optim_states.pt"] = b""
    v = judge_step(mem_step("global_step100", blobs))
    assert kinds(v) == {(Kind.DAMAGED, "global_step100/zero_pp_rank_1_mp_rank_00_optim_states.pt")}


# ------------------------------------------------------------------ markers, unknown layouts


def test_nemo_unfinished_marker_beside_the_step():
    md = dcp_metadata([("w", "__0_0.distcp", 0, 4)])
    blobs = {"step=5/weights/.metadata": md, "step=5/weights/__0_0.distcp": b"x" * 4}
    assert judge_step(mem_step("step=5", blobs)).complete
    v = judge_step(mem_step("step=5", blobs, siblings={"step=5-unfinished"}))
    assert kinds(v) == {(Kind.UNFINISHED, "step=5-unfinished")}
    assert v.format == "nemo+dcp"


def test_temp_names_are_unfinished():
    for name in ("100.orbax-checkpoint-tmp-3", "tmp-checkpoint-5"):
        v = judge_step(mem_step(name, {f"{name}/model.safetensors": st_file()}))
        assert kinds(v) == {(Kind.UNFINISHED, name)}


def test_unknown_layout_keeps_the_rename_rule():
    v = judge_step(mem_step("200", {"200/blob.dat": b"", "200/notes.json": b""}))
    assert (v.unknown_layout, v.complete, v.format) == (True, True, "unknown")


def test_issue_layout_zero_byte_shard_beside_good_step():
    """Steps 100/ complete and 200/ renamed in with one shard truncated to 0 bytes."""
    good = {"100/model.safetensors": st_file(), "100/optimizer.pt": torch_like_zip()}
    bad = {"200/model.safetensors": b"", "200/optimizer.pt": torch_like_zip()}
    assert judge_step(mem_step("100", good)).complete
    v = judge_step(mem_step("200", bad))
    assert kinds(v) == {(Kind.DAMAGED, "200/model.safetensors")}
    assert v.summary().startswith("step 200 (safetensors+torch.save) is not loadable: ")


def test_read_errors_are_unreadable_not_crashes():
    def read(path: str, offset: int, length: int) -> bytes:
        raise OSError(5, "Input/output error")

    step = StepFiles("s", {"s/.metadata": 10, "s/m.safetensors": 100}, read=read)
    v = judge_step(step)
    assert kinds(v) == {(Kind.UNREADABLE, "s/.metadata"), (Kind.UNREADABLE, "s/m.safetensors")}


def test_reasons_are_capped():
    blobs = {f"s/m{i}.safetensors": b"" for i in range(30)}
    v = judge_step(mem_step("s", blobs))
    assert len(v.problems) == 30 and len(v.reasons) == 21
    assert v.reasons[-1] == "... and 10 more problems"


# ------------------------------------------------------------------ from manifests


def test_step_files_from_two_ranks_manifests():
    md, _ = dcp_two_ranks()

    def entry(path: str, size: int) -> FileEntry:
        return FileEntry(path, "file", size, crc32c=0)

    m0 = Manifest(
        "job",
        0,
        10,
        "step_10",
        "generic",
        (
            FileEntry("step_10", "dir"),
            entry("step_10/.metadata", len(md)),
            entry("step_10/__0_0.distcp", 100),
        ),
    )
    m1 = Manifest(
        "job",
        1,
        10,
        "step_10",
        "generic",
        (FileEntry("step_10", "dir"), entry("step_10/__1_0.distcp", 80)),
    )
    blobs = {"step_10/.metadata": md}
    files = step_files_from_manifests(
        [m1, m0], local_ranks=[0], read=lambda p, o, n: blobs[p][o : o + n]
    )
    assert files.name == "step_10" and files.holders["step_10/__1_0.distcp"] == 1
    assert files.readable("step_10/.metadata") and not files.readable("step_10/__1_0.distcp")
    assert files.dirs == frozenset({"step_10"})
    assert judge_step(files).complete
    only0 = step_files_from_manifests([m0], local_ranks=[0], read=files.read)
    assert kinds(judge_step(only0)) == {(Kind.MISSING, "step_10/__1_0.distcp")}


def test_metadata_pickle_cannot_allocate_through_bytearray():
    bomb = b"\x80\x02cbuiltins\nbytearray\nq\x00J\x00\x00\x00@\x85q\x01Rq\x02."  # bytearray(2**30)
    with pytest.raises(BadMetadata, match="refused"):
        parse_metadata(bomb)


def test_dir_reader_reads_ranges_and_refuses_links(tmp_path):
    from tierfs.store.validators import dir_reader

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "m.safetensors").write_bytes(st_file())
    (tmp_path / "s" / "link.pt").symlink_to(tmp_path / "s" / "m.safetensors")
    read = dir_reader(str(tmp_path))
    assert read("s/m.safetensors", 8, 4) == st_file()[8:12]
    with pytest.raises(OSError):
        read("s/link.pt", 0, 4)
    with pytest.raises(OSError):
        read("../etc/passwd", 0, 4)
    sizes = {"s/m.safetensors": len(st_file()), "s/link.pt": 10}
    v = judge_step(StepFiles("s", sizes, read))
    assert kinds(v) == {(Kind.UNREADABLE, "s/link.pt")}


def test_step_files_with_a_reader_per_local_part():
    md, _ = dcp_two_ranks()
    m0 = Manifest(
        "j",
        0,
        10,
        "step_10",
        "generic",
        (FileEntry("step_10/.metadata", "file", len(md), crc32c=0),),
    )
    m1 = Manifest(
        "j", 1, 10, "step_10", "generic", (FileEntry("step_10/__1_0.distcp", "file", 80, crc32c=0),)
    )
    m2 = Manifest(
        "j",
        2,
        10,
        "step_10",
        "generic",
        (FileEntry("step_10/__0_0.distcp", "file", 100, crc32c=0),),
    )
    calls = []

    def reader(rank, blob):
        def read(path, offset, length):
            calls.append((rank, path))
            return blob[offset : offset + length]

        return read

    files = step_files_from_manifests([m0, m1, m2], readers={1: reader(1, md)})
    assert kinds(judge_step(files)) == {(Kind.UNREADABLE, "step_10/.metadata")}
    files = step_files_from_manifests([m0, m1, m2], readers={0: reader(0, md)})
    assert judge_step(files).complete and calls == [(0, "step_10/.metadata")]
