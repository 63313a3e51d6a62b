"""Build step of tierfs: generate the protobuf and gRPC modules of tierfs/rpc.

Everything else about the package is declared in pyproject.toml; this file
only adds the ``build_rpc`` command to setuptools' ``build``, so every build
-- ``pip install .``, ``pip install -e .`` (what ``make install`` runs),
``pip wheel .``, ``python -m build`` -- turns each ``tierfs/rpc/NAME.proto``
into four modules:

* ``NAME_pb2.py`` and ``NAME_pb2_grpc.py``: the messages and the gRPC
  stubs/servicer bases (grpcio-tools' protoc and its gRPC plugin);
* ``NAME_pb2.pyi`` and ``NAME_pb2_grpc.pyi``: their type stubs (mypy-protobuf).

Both tools are build requirements only ([build-system] requires); nothing is
compiled at run time and nothing generated is committed. A wheel build writes
the modules into the build directory; an editable install writes them next
to the .proto files in the source tree (where the editable install imports
them from). The versions of grpcio-tools pinned in pyproject.toml decide the
oldest grpcio and protobuf the generated code runs with (it checks both at
import), so the runtime floors in [project] dependencies follow that pin.
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent
RPC_PACKAGE = "tierfs/rpc"
#: the generated modules of one NAME.proto, as suffixes of NAME
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def protos() -> list[Path]:
    """The .proto files of tierfs/rpc, sorted (absolute paths)."""
    return sorted((ROOT / RPC_PACKAGE).glob("*.proto"))


def outputs(out: Path) -> list[Path]:
    """The files :func:`generate` writes under ``out`` (a directory holding ``tierfs/``)."""
    return [out / RPC_PACKAGE / (p.stem + s) for p in protos() for s in SUFFIXES]


def generate(out: Path) -> list[Path]:
    """Compile every tierfs/rpc .proto into ``out``/tierfs/rpc; return the files written.

    The .proto files are named relative to the source root, so the generated
    modules import each other as ``tierfs.rpc.NAME_pb2`` and their descriptors
    are named ``tierfs/rpc/NAME.proto``. ``google/protobuf/*.proto`` imports
    resolve against the copies grpcio-tools ships.

    Raises:
        RuntimeError: grpcio-tools or mypy-protobuf is missing, or protoc failed
            (its messages are on stderr).
    """
    try:
        import grpc_tools
        import mypy_protobuf  # noqa: F401  (the protoc plugins below run it)
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError(
            f"building tierfs needs grpcio-tools and mypy-protobuf ({exc}); pip installs "
            "them from pyproject.toml's [build-system] requires, so with "
            "--no-build-isolation install them first"
        ) from exc
    wanted = protos()
    if not wanted:
        raise RuntimeError(f"no .proto files in {ROOT / RPC_PACKAGE}")
    (out / RPC_PACKAGE).mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(prefix="tierfs-protoc-") as tmp:
        # protoc runs plugins as executables; these run mypy-protobuf with the
        # interpreter (and so the build environment) of this build
        plugins = []
        for name, entry in (("protoc-gen-mypy", "main"), ("protoc-gen-mypy_grpc", "grpc")):
            script = Path(tmp) / name
            code = f"import sys; from mypy_protobuf.main import {entry}; sys.exit({entry}())"
            script.write_text(
                f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)}\n"
            )
            script.chmod(0o755)
            plugins.append(f"--plugin={name}={script}")
        args = [
            "grpc_tools.protoc",
            f"--proto_path={ROOT}",
            f"--proto_path={well_known}",
            *plugins,
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out=quiet:{out}",
            f"--mypy_grpc_out=quiet:{out}",
            *map(str, wanted),
        ]
        rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed (exit {rc}) on {', '.join(p.name for p in wanted)}")
    written = outputs(out)
    missing = [str(p) for p in written if not p.is_file()]
    if missing:
        raise RuntimeError(f"protoc did not write {', '.join(missing)}")
    return written


class build_rpc(Command):
    """``setup.py build_rpc``: the generated modules of tierfs/rpc (a ``build`` sub-command).

    Follows setuptools' sub-command protocol: in a wheel build the files go to
    ``build_lib``; with ``editable_mode`` (``pip install -e``) into the source
    tree.
    """

    description = "generate tierfs/rpc's protobuf/gRPC modules and their .pyi stubs"
    user_options: ClassVar[list[tuple[str, str | None, str]]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _build_lib(self) -> Path:
        return Path(self.build_lib or "build/lib")

    def run(self) -> None:
        generate(ROOT if self.editable_mode else self._build_lib())

    def get_outputs(self) -> list[str]:
        return [str(p) for p in outputs(self._build_lib())]

    def get_output_mapping(self) -> dict[str, str]:
        if not self.editable_mode:
            return {}
        return {
            str(b): str(s) for b, s in zip(outputs(self._build_lib()), outputs(ROOT), strict=True)
        }

    def get_source_files(self) -> list[str]:
        return [str(p.relative_to(ROOT)) for p in protos()]


class build_with_rpc(build):
    """setuptools' ``build`` with :class:`build_rpc` after ``build_py``.

    After it, because ``build_py`` copies whatever modules the source tree
    holds (an earlier editable install's, maybe stale) and this overwrites them.
    """

    sub_commands: ClassVar = [*build.sub_commands, ("build_rpc", None)]


setup(cmdclass={"build": build_with_rpc, "build_rpc": build_rpc})
