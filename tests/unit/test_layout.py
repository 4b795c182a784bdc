"""The package's shape: rooms by concern over a bottom layer, no import circle, no
upward import (tools/imports.py), few top-level modules, no long source file, class
or function."""

import importlib.util
import re
from pathlib import Path

import pytest
import util

pytestmark = [util.serial_only, util.same_under_every_mpi]


@pytest.fixture(scope="module")
def imports():
    spec = importlib.util.spec_from_file_location(
        "imports_tool", util.ROOT / "tools" / "imports.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_circle_and_no_upward_import(imports):
    edges = imports.graph()
    assert edges["mpi4jax_dist.launch.session"], "the graph reads no imports"
    assert imports.circles(edges) == []
    assert imports.upward(edges) == []


def test_every_room_has_a_layer(imports):
    rooms = {imports.room(m) for m in imports.modules()} - {None}
    placed = {r for layer in imports.LAYERS for r in layer}
    assert rooms == placed, sorted(rooms ^ placed)


def _fake_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "mpi4jax_dist" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_circle_through_a_function_level_import_is_found(imports, tmp_path):
    """Fault injection: ops imports launch inside a function, launch imports ops."""
    root = _fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "ops/__init__.py": "",
            "ops/a.py": "def f():\n    from ..launch import b\n",
            "launch/__init__.py": "",
            "launch/b.py": "from ..ops import a\n",
        },
    )
    edges = imports.graph(root)
    assert imports.circles(edges) == [["mpi4jax_dist.launch.b", "mpi4jax_dist.ops.a"]]
    assert ("mpi4jax_dist.ops.a", "mpi4jax_dist.launch.b") in imports.upward(edges)


def test_few_top_level_modules():
    package = util.ROOT / "mpi4jax_dist"
    top = sorted(
        {p.name for p in package.glob("*.py")} - {"__init__.py", "__main__.py"}
    )
    assert len(top) <= 8, top


# A path a comment or docstring names: the package's, the tests', conf's, tools'.
_NAMED = re.compile(
    r"\b((?:mpi4jax_dist|tests|conf|tools|benchmarks)/[\w/.-]*\w\.(?:py|h|c|cc|txt|sh))\b"
)


def test_paths_named_in_the_sources_exist():
    """A file the package's sources name (``mpi4jax_dist/faults/hangs.py`` in a
    comment of a C header, say) exists: a move must take its mentions along."""
    sources = [
        p
        for p in (util.ROOT / "mpi4jax_dist").rglob("*")
        if p.suffix in (".py", ".h", ".c", ".cc") and p.is_file()
    ]
    sources += list((util.ROOT / "conf").glob("*.py"))
    missing = []
    for path in sources:
        for named in _NAMED.findall(path.read_text()):
            if not (util.ROOT / named).exists():
                missing.append(f"{path.relative_to(util.ROOT)} names {named}")
    assert not missing, "\n".join(missing)


# No room grows past what one reads at a sitting (issue 49's bounds).
MAX_FILE_LINES = 600
MAX_DEF_LINES = 250


def _too_long(root: Path) -> list[str]:
    """The package's sources over MAX_FILE_LINES, and its Python classes and
    functions over MAX_DEF_LINES, as ``path: N lines`` lines."""
    import ast

    found = []
    for path in sorted((root / "mpi4jax_dist").rglob("*")):
        if path.suffix not in (".py", ".h", ".c", ".cc") or not path.is_file():
            continue
        text = path.read_text()
        name = path.relative_to(root)
        if (lines := len(text.splitlines())) > MAX_FILE_LINES:
            found.append(f"{name}: {lines} lines")
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if (lines := node.end_lineno - node.lineno + 1) > MAX_DEF_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_long_file_class_or_function():
    assert _too_long(util.ROOT) == []


def test_a_long_file_and_a_long_function_are_found(tmp_path):
    """Fault injection: a module of 601 lines, a function of 251."""
    body = "".join(f"    x{i} = {i}\n" for i in range(250))
    root = _fake_package(
        tmp_path,
        {"long.py": "\n" * 601, "ops/f.py": "def f():\n" + body},
    )
    assert _too_long(root) == [
        "mpi4jax_dist/long.py: 601 lines",
        "mpi4jax_dist/ops/f.py:1 f: 251 lines",
    ]
