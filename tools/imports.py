"""The import graph of mpi4jax_dist, read from its files (nothing is imported).

    python tools/imports.py            # the layers, each room's imports; exit 1 on
                                       # an import circle or an upward import
    python tools/imports.py --dot      # the module graph for Graphviz:
                                       # ... --dot | dot -Tsvg > imports.svg

Every ``import`` counts, also those inside functions. A *room* is a top-level
module or subpackage (``launch``, ``ops``, ``_config``...). ``LAYERS`` lists the
rooms bottom up: a room may import only rooms of its own layer or below it. The
package's ``__init__`` (the public API) and ``__main__`` sit on top and are left out,
as is a submodule importing its own package (``from .. import __version__``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mpi4jax_dist"

LAYERS = (
    ("_config", "_mpi", "_compat"),
    ("_ffi",),
    ("faults", "timing"),
    ("xla_mpi",),
    ("ops",),
    ("launch",),
    ("interop",),
    ("solvers", "cg"),
    ("diagnostics",),
)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, node) -> list[str]:
    """The dotted names an import statement of module ``name`` refers to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = name.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``."""
    mods = modules(root)
    edges = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(name, path, node):
                    # The longest module the name starts with: "a.b.c" of a
                    # module a.b is a.b's attribute c.
                    while target and target not in mods:
                        target = target.rpartition(".")[0]
                    if target and target != name and target != PACKAGE:
                        edges[name].add(target)
    return edges


def room(module: str) -> str | None:
    """``launch`` for ``mpi4jax_dist.launch.bootstrap``; None for the package's
    own ``__init__`` and ``__main__``."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return None
    return parts[1]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among modules: strongly connected components of more
    than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports from a room to a room of a higher layer (or of none)."""
    layer = {r: i for i, rooms in enumerate(LAYERS) for r in rooms}
    bad = []
    for source, targets in edges.items():
        a = room(source)
        if a is None:
            continue
        for target in targets:
            b = room(target)
            if b is not None and b != a and layer.get(b, 99) > layer.get(a, -1):
                bad.append((source, target))
    return sorted(bad)


def main(argv=None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cli.add_argument("--dot", action="store_true", help="print the graph for dot")
    args = cli.parse_args(argv)
    edges = graph()
    if args.dot:
        print("digraph mpi4jax_dist {\n  rankdir=BT; node [shape=box];")
        for source in sorted(edges):
            for target in sorted(edges[source]):
                print(f'  "{source}" -> "{target}";')
        print("}")
    else:
        rooms: dict[str, set[str]] = {}
        for source, targets in edges.items():
            a = room(source)
            if a is not None:
                rooms.setdefault(a, set()).update(
                    b for b in map(room, targets) if b not in (None, a)
                )
        for i, layer in enumerate(LAYERS):
            for name in layer:
                uses = ", ".join(sorted(rooms.get(name, ()))) or "-"
                print(f"layer {i}  {name:<12} imports {uses}")
        unplaced = sorted(set(rooms) - {r for layer in LAYERS for r in layer})
        for name in unplaced:
            print(f"not in LAYERS: {name}")
    problems = [f"import circle: {' <-> '.join(c)}" for c in circles(edges)]
    problems += [f"upward import: {a} -> {b}" for a, b in upward(edges)]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
