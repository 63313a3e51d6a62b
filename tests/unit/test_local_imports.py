"""The lower layers (tierfs/core, tierfs/store, tierfs/fuse) import at module level only.

A function-level import there would hide a dependency from import-linter (or
dodge an import cycle the layering forbids, #12); a module that must stay
light at start-up belongs higher up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tierfs

ROOT = Path(tierfs.__file__).parent
PACKAGES = ("core", "store", "fuse")


def local_imports(path: Path, base: Path = ROOT.parent) -> list[str]:
    """``path:line import`` for every import inside a function of ``path`` (relative to base)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import | ast.ImportFrom):
                found.append(f"{path.relative_to(base)}:{inner.lineno} {ast.unparse(inner)}")
    return found


def test_no_function_level_imports_in_the_lower_layers():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).glob("*.py"))]
    assert len(files) > 10
    assert [hit for p in files for hit in local_imports(p)] == []


def test_the_check_finds_a_function_level_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os\n\n\ndef f():\n    from tierfs.fuse import session\n\n\n"
        "class C:\n    async def g(self):\n        import resource\n"
    )
    assert local_imports(src, tmp_path) == [
        "m.py:5 from tierfs.fuse import session",
        "m.py:10 import resource",
    ]
