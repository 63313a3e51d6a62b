"""Real checkpoint clients through a real mount (issue 2): bytes compared exactly.

Each client saves into the mount and loads back; loaded tensors are compared
bit for bit, files the client writes deterministically are compared byte for
byte with the same save on plain tmpfs, and every file read through the mount
equals its backing file in the RAM store.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
from fs_helpers import MODES, mount_mode


@pytest.fixture(params=MODES)
def fs(request, make_mount):
    return mount_mode(make_mount, request.param)


@pytest.fixture
def ref():
    d = Path("/dev/shm") / f"tierfs-ref-{uuid.uuid4().hex[:10]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def same_tree_bytes(mounted: Path, view: Path) -> list[str]:
    """Every file under ``mounted`` has the bytes of its backing file under ``view``."""
    names = sorted(str(p.relative_to(mounted)) for p in mounted.rglob("*") if p.is_file())
    assert names
    for rel in names:
        assert digest(mounted / rel) == digest(view / rel), rel
    return names


def _torch_state():
    import torch

    g = torch.Generator().manual_seed(1234)
    w = torch.randn(1024, 1024, generator=g)  # 4 MiB
    return {
        "model": {
            "embed.weight": torch.randn(4096, 512, generator=g).to(torch.bfloat16),  # 4 MiB
            "layer.weight": w,
            "layer.weight_t": w.t(),  # a non-contiguous view sharing storage
            "layer.bias": torch.randn(1024, generator=g).half(),
            "mask": torch.rand(3000, generator=g) > 0.5,
            "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        },
        "optim": {
            "step": torch.tensor(12345, dtype=torch.int64),
            "exp_avg": torch.randn(777, 3, generator=g, dtype=torch.float64),
        },
        "meta": {"epoch": 3, "name": "run-1", "lr": 3e-4},
    }


def _assert_bitwise_equal(a, b) -> None:
    import torch

    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    else:
        assert a == b


def test_torch_save_load(fs, ref):
    import torch

    state = _torch_state()
    torch.save(state, fs.path / "ckpt.pt")
    loaded = torch.load(fs.path / "ckpt.pt", weights_only=True)
    _assert_bitwise_equal(state, loaded)
    # shared storage survives the round trip
    assert (
        loaded["model"]["layer.weight_t"].untyped_storage().data_ptr()
        == loaded["model"]["layer.weight"].untyped_storage().data_ptr()
    )
    mapped = torch.load(fs.path / "ckpt.pt", weights_only=True, mmap=True)
    _assert_bitwise_equal(state, mapped)
    del mapped
    assert digest(fs.path / "ckpt.pt") == digest(fs.view / "ckpt.pt")
    # a checkpoint written elsewhere loads the same through the mount, and back out
    torch.save(state, ref / "ckpt.pt")
    shutil.copyfile(ref / "ckpt.pt", fs.path / "copied.pt")
    assert digest(fs.path / "copied.pt") == digest(ref / "ckpt.pt")
    _assert_bitwise_equal(state, torch.load(fs.path / "copied.pt", weights_only=True))
    # saving through a file object (the usual "open(path, 'wb')" pattern) and overwrite
    with open(fs.path / "ckpt.pt", "wb") as f:
        torch.save({"small": torch.arange(5)}, f)
    assert torch.equal(torch.load(fs.path / "ckpt.pt", weights_only=True)["small"], torch.arange(5))


def test_torch_distributed_checkpoint_single_process(fs, ref):
    import torch
    import torch.distributed.checkpoint as dcp

    state = _torch_state()
    tensors = {"model": state["model"], "optim": state["optim"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(tensors, checkpoint_id=str(fs.path / "step_100"))
        dcp.save(tensors, checkpoint_id=str(ref / "step_100"))
        names = same_tree_bytes(fs.path / "step_100", fs.view / "step_100")
        assert ".metadata" in names
        for name in names:
            if name != ".metadata":  # .metadata carries a random save id
                assert digest(fs.path / "step_100" / name) == digest(ref / "step_100" / name)
        target = {
            "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {k: torch.zeros_like(v) for k, v in state["optim"].items()},
        }
        dcp.load(target, checkpoint_id=str(fs.path / "step_100"))
    # the transposed view is loaded as its own tensor: compare values, not storage
    for group in ("model", "optim"):
        for k, v in tensors[group].items():
            got = target[group][k]
            assert got.dtype == v.dtype and got.shape == v.shape
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
            ), k


def test_safetensors_save_and_mmap_load(fs, ref):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    state = {k: v.contiguous() for k, v in _torch_state()["model"].items() if k != "layer.weight_t"}
    meta = {"format": "pt"}  # one key: safetensors writes several in random order
    save_file(state, str(fs.path / "model.safetensors"), metadata=meta)
    save_file(state, str(ref / "model.safetensors"), metadata=meta)
    assert digest(fs.path / "model.safetensors") == digest(ref / "model.safetensors")
    assert digest(fs.path / "model.safetensors") == digest(fs.view / "model.safetensors")
    with safe_open(str(fs.path / "model.safetensors"), framework="pt") as f:  # mmap
        assert f.metadata() == meta
        assert sorted(f.keys()) == sorted(state)
        for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            _assert_bitwise_equal(state[k], f.get_tensor(k))
        part = f.get_slice("layer.weight")[10:20, 5:7]
        assert torch.equal(part, state["layer.weight"][10:20, 5:7])
    _assert_bitwise_equal(state, load_file(str(fs.path / "model.safetensors")))
    with safe_open(str(fs.path / "model.safetensors"), framework="numpy") as f:
        assert np.array_equal(f.get_tensor("layer.bias"), state["layer.bias"].numpy())


def test_numpy_memmap_and_open_memmap(fs, ref):
    from numpy.lib.format import open_memmap

    rng = np.random.default_rng(7)
    data = rng.standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB
    for root in (fs.path, ref):
        mm = np.memmap(root / "raw.bin", mode="w+", dtype=np.float32, shape=data.shape)
        mm[:] = data
        mm[5, :] = 0.5
        mm.flush()
        del mm
        om = open_memmap(root / "arr.npy", mode="w+", dtype=np.int32, shape=(1000, 333))
        om[:] = np.arange(333_000, dtype=np.int32).reshape(1000, 333)
        om.flush()
        del om
        np.save(root / "plain.npy", data[::2])
        rw = np.load(root / "plain.npy", mmap_mode="r+")
        rw[0, :4] = [1, 2, 3, 4]
        rw.flush()
        del rw
    for name in ("raw.bin", "arr.npy", "plain.npy"):
        assert digest(fs.path / name) == digest(ref / name), name
        assert digest(fs.path / name) == digest(fs.view / name), name
    expect = data.copy()
    expect[5, :] = 0.5
    ro = np.memmap(fs.path / "raw.bin", mode="r", dtype=np.float32, shape=data.shape)
    assert np.array_equal(ro, expect)
    del ro
    loaded = np.load(fs.path / "arr.npy", mmap_mode="r")
    assert isinstance(loaded, np.memmap)
    assert np.array_equal(loaded, np.arange(333_000, dtype=np.int32).reshape(1000, 333))
    del loaded
    plain = np.load(fs.path / "plain.npy", mmap_mode="c")  # copy-on-write: no change on disk
    plain[1, :] = -1
    del plain
    assert digest(fs.path / "plain.npy") == digest(ref / "plain.npy")
    assert os.path.getsize(fs.path / "plain.npy") == os.path.getsize(ref / "plain.npy")
