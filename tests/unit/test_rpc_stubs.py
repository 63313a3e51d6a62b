"""tierfs/rpc's protobuf/gRPC modules are generated at build time, never at run time.

* the installed modules are what the .proto files compile to now (a stale
  install -- a .proto changed, no ``make install`` since -- fails here);
* importing the daemon, the CSI driver and the coordinator loads no
  grpcio-tools, and the package's run-time requirements do not name it;
* a source checkout without generated modules raises an ImportError that
  says how to get them;
* a wheel built from the sources carries the modules and their .pyi stubs.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

import tierfs
from tierfs import rpc
from tierfs.rpc import csi_pb2, csi_pb2_grpc, peer_pb2, peer_pb2_grpc

PACKAGE_ROOT = Path(tierfs.__file__).resolve().parent.parent  # holds tierfs/
RPC_DIR = Path(rpc.__file__).resolve().parent
REPO = Path(__file__).resolve().parents[2]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
MODULES = {"peer": (peer_pb2, peer_pb2_grpc), "csi": (csi_pb2, csi_pb2_grpc)}


def _compile(proto: str, out: Path) -> descriptor_pb2.FileDescriptorProto:
    """``tierfs/rpc/<proto>`` compiled by grpcio-tools now, as a FileDescriptorProto."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"--proto_path={PACKAGE_ROOT}",
            f"--proto_path={well_known}",
            f"--descriptor_set_out={out}",
            str(RPC_DIR / proto),
        ]
    )
    assert rc == 0, f"protoc failed on {proto}"
    (fd,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    # the Python generator embeds descriptors without the json_name protoc fills in
    messages = list(fd.message_type)
    while messages:
        m = messages.pop()
        messages.extend(m.nested_type)
        for f in m.field:
            f.ClearField("json_name")
    return fd


@pytest.mark.parametrize("name", sorted(MODULES))
def test_installed_modules_are_what_the_proto_files_compile_to(name, tmp_path):
    pb2, pb2_grpc = MODULES[name]
    fresh = _compile(f"{name}.proto", tmp_path / f"{name}.pb")
    installed = descriptor_pb2.FileDescriptorProto.FromString(pb2.DESCRIPTOR.serialized_pb)
    assert installed.name == fresh.name == f"tierfs/rpc/{name}.proto"
    assert installed == fresh, (
        f"tierfs/rpc/{name}_pb2.py is stale: {name}.proto changed since the install; "
        "run `make install`"
    )
    assert pb2_grpc.__name__ == f"tierfs.rpc.{name}_pb2_grpc"
    for suffix in GENERATED_SUFFIXES:
        assert (RPC_DIR / f"{name}{suffix}").is_file(), f"{name}{suffix} missing"


def test_the_wire_keeps_its_package_names():
    assert peer_pb2.DESCRIPTOR.package == "tierfs.peer.v1"
    assert csi_pb2.DESCRIPTOR.package == "csi.v1"
    assert set(peer_pb2.DESCRIPTOR.services_by_name) == {"Peer", "Coordinator", "SyncRelay"}
    assert set(csi_pb2.DESCRIPTOR.services_by_name) == {"Identity", "Node"}


def test_nothing_compiles_protos_at_run_time():
    """The daemon's, the CSI driver's and the CLI's modules import with grpc_tools
    unimportable, and no run-time requirement of tierfs names grpcio-tools."""
    code = (
        "import sys\n"
        "sys.modules['grpc_tools'] = None  # any import of it raises ImportError\n"
        "import tierfs.cli.main, tierfs.cluster.coordinator, tierfs.csi.server\n"
        "import tierfs.replication.peer\n"
        "import tierfs.node.agreement, tierfs.node.restorer\n"
        "from tierfs.cluster.coordinator import Coordinator\n"
        "from tierfs.cluster.servicer import CoordinatorServicer\n"
        "CoordinatorServicer(Coordinator())\n"
        "assert not any(m.startswith('grpc_tools.') for m in sys.modules), sorted(sys.modules)\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    runtime = [r for r in importlib.metadata.requires("tierfs") or () if "extra ==" not in r]
    assert not [r for r in runtime if r.lower().startswith(("grpcio-tools", "mypy"))], runtime
    assert any(r.startswith("grpcio") for r in runtime) and any(
        r.startswith("protobuf") for r in runtime
    ), runtime


def _copy_sources(dst: Path) -> None:
    """The files a build reads, without generated modules and caches."""
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    shutil.copytree(
        REPO / "tierfs",
        dst / "tierfs",
        ignore=shutil.ignore_patterns("__pycache__", *(f"*{s}" for s in GENERATED_SUFFIXES)),
    )


def test_a_checkout_without_generated_modules_says_how_to_get_them(tmp_path):
    """Regression for the move to build-time stubs: a bare ModuleNotFoundError for
    ``tierfs.rpc.peer_pb2`` would not tell a developer to run the install."""
    _copy_sources(tmp_path)
    assert not list((tmp_path / "tierfs" / "rpc").glob("*_pb2*"))
    # the checkout's tierfs comes first on sys.path, as in a source tree (the
    # editable install's finder only answers what the path does not)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tierfs, sys; print(tierfs.__file__, file=sys.stderr)\n"
            "from tierfs.rpc import wire",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert proc.returncode == 1
    assert str(tmp_path / "tierfs" / "__init__.py") in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: tierfs.rpc.csi_pb2, tierfs.rpc.csi_pb2_grpc, "
        "tierfs.rpc.peer_pb2, tierfs.rpc.peer_pb2_grpc missing: "
    ), proc.stderr
    assert "Run `make install` (or `pip install -e .`)" in last, last


@pytest.mark.slow
def test_a_wheel_carries_the_generated_modules_and_stubs(tmp_path):
    """``pip wheel`` of the sources (no build isolation: the test extras hold the
    build requirements) generates the modules into the wheel, not the source tree."""
    src = tmp_path / "src"
    src.mkdir()
    _copy_sources(src)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("tierfs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for proto in ("peer", "csi"):
        assert f"tierfs/rpc/{proto}.proto" in names
        for suffix in GENERATED_SUFFIXES:
            assert f"tierfs/rpc/{proto}{suffix}" in names, sorted(
                n for n in names if n.startswith("tierfs/rpc/")
            )
    # a wheel build generates into its build directory only
    assert not list((src / "tierfs" / "rpc").glob("*_pb2*"))
    # and what it carries imports and is the same wire
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    code = (
        "import sys, tierfs.rpc as r\n"
        "from tierfs.rpc import peer_pb2, csi_pb2\n"
        "print(r.__file__)\n"
        "sys.stdout.buffer.write(peer_pb2.DESCRIPTOR.serialized_pb.hex().encode() + b' ')\n"
        "sys.stdout.buffer.write(csi_pb2.DESCRIPTOR.serialized_pb.hex().encode())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(unpacked)),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    where, descriptors = proc.stdout.split("\n", 1)
    assert where == str(unpacked / "tierfs" / "rpc" / "__init__.py")
    peer_hex, csi_hex = descriptors.split()
    assert bytes.fromhex(peer_hex) == peer_pb2.DESCRIPTOR.serialized_pb
    assert bytes.fromhex(csi_hex) == csi_pb2.DESCRIPTOR.serialized_pb
