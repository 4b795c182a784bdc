"""docs/api.rst and docs/api-cg.rst hold what they say: their examples run, their
signatures are the code's.

Every ``.. code-block:: python`` of the pages is an example: under ``mpiexec -n 2
python -m pytest --with-mpi tests/peers/test_api_examples.py`` each runs on every rank,
in this process's JAX world (the ``world`` fixture) and a namespace of its own, so
that all of them cost one process per rank. An example that defines ``test_*``
functions (the pytest plugin's) has them called, with the fixtures they name. A
failure's traceback names the page's own line.

Every literal block (``::``) is a signature: a call (``mpi4jax_dist.x(...) ->
...``, or ``solver(...)`` for what ``make_solver`` returns) whose parameters,
their kinds and defaults must be the code's, or a ``class`` whose fields (and
defaults) or members must be. Those checks, and that every public name has a
section with both, run serially: ``python -m pytest tests/peers/test_api_examples.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import traceback
from typing import NamedTuple

import pytest
import util
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist import cg

PAGES = [util.ROOT / "docs" / name for name in ("api.rst", "api-cg.rst")]

# The names the page documents, each in a section headed ``name``.
NAMES = [n for n in mpi4jax_dist.__all__ if n != "cg"] + [
    "cg",
    "CGInfo",
    "solve",
    "make_solver",
    "solve_normal",
    "make_normal_solver",
    "Variant",
]
# What a call on the page names, where it is not ``mpi4jax_dist.<name>`` or
# ``mpi4jax_dist.cg.<name>``: the callable module, and the solvers' calls.
CALLS = {
    "mpi4jax_dist.cg": cg.cg,
    "solver": cg.Solver.__call__,
    "normal_solver": cg.NormalSolver.__call__,
}


class Block(NamedTuple):
    kind: str  # "python" (an example) or "literal" (a signature)
    line: int  # the page's line of the block's first line of code
    code: str  # dedented
    section: str  # the nearest heading above, without its ``
    page: str = "docs/api.rst"


def blocks(text: str, page: str = "docs/api.rst") -> list[Block]:
    """The page's ``.. code-block:: python`` and ``::`` blocks, in order."""
    lines = text.splitlines()
    found, section, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and re.fullmatch(r"([-~=])\1{3,}", lines[i + 1]):
            section = line.strip().strip("`")
        if line.strip() == ".. code-block:: python":
            kind = "python"
        elif line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            kind = "literal"
        else:
            i += 1
            continue
        start = i + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        end = start
        while end < len(lines) and (not lines[end].strip() or lines[end][0] == " "):
            end += 1
        body = "\n".join(lines[start:end]).rstrip()
        found.append(Block(kind, start + 1, textwrap.dedent(body), section, page))
        i = end
    return found


BLOCKS = [
    block for path in PAGES for block in blocks(path.read_text(), f"docs/{path.name}")
]
EXAMPLES = [b for b in BLOCKS if b.kind == "python"]
SIGNATURES = [b for b in BLOCKS if b.kind == "literal"]


def example_id(block: Block) -> str:
    return f"{block.section}:{block.line}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("example", EXAMPLES, ids=example_id)
def test_example_runs(example, world):
    # Padded to the page's line, under the page's name: a traceback quotes the page.
    page = util.ROOT / example.page
    code = compile("\n" * (example.line - 1) + example.code, str(page), "exec")
    namespace = {"__name__": f"api_example_{example.line}"}
    fixtures = {"jax_world": world}
    error = None
    try:
        exec(code, namespace)
        for name, test in list(namespace.items()):
            if name.startswith("test_") and callable(test):
                test(**{p: fixtures[p] for p in inspect.signature(test).parameters})
    except Exception:
        error = traceback.format_exc()
    all_ranks(error is None, f"the example at {example.page}:{example.line}:\n{error}")


# --- serially: the page against the code ------------------------------------------

_NO_DEFAULT = inspect.Parameter.empty


def _page_parameters(args: ast.arguments) -> list[tuple]:
    """``(name, kind, default)`` of a signature on the page."""

    def value(node):
        return _NO_DEFAULT if node is None else ast.literal_eval(node)

    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    out = [
        (a.arg, "POSITIONAL_OR_KEYWORD", value(d))
        for a, d in zip(positional, defaults, strict=True)
    ]
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", _NO_DEFAULT))
    out += [
        (a.arg, "KEYWORD_ONLY", value(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", _NO_DEFAULT))
    return out


def _code_parameters(function, drop_self: bool) -> list[tuple]:
    params = list(inspect.signature(function).parameters.values())
    if drop_self:
        params = params[1:]
    return [(p.name, p.kind.name, p.default) for p in params]


def _resolve(dotted: str):
    if dotted in CALLS:
        return CALLS[dotted]
    for prefix, module in (("mpi4jax_dist.cg.", cg), ("mpi4jax_dist.", mpi4jax_dist)):
        if dotted.startswith(prefix) and "." not in dotted[len(prefix) :]:
            return getattr(module, dotted[len(prefix) :])
    raise AssertionError(f"names nothing public: {dotted}")


def _class(name: str):
    return getattr(mpi4jax_dist, name, None) or getattr(cg, name)


def check_signature(block: Block) -> list[str]:
    """What differs between a literal block of the page and the code."""
    if block.code.startswith("class "):
        return _check_class(ast.parse(block.code).body[0])
    problems = []
    # One call per unindented line, its continuation lines indented.
    for call in re.split(r"\n(?=\S)", block.code):
        match = re.match(r"([\w.]+)\(", call)
        assert match, f"{block.page}:{block.line}: not a call: {call!r}"
        dotted = match.group(1)
        tree = ast.parse("def f(" + call[match.end() :] + ": ...")
        page = _page_parameters(tree.body[0].args)
        code = _code_parameters(_resolve(dotted), dotted in ("solver", "normal_solver"))
        if page != code:
            problems.append(f"{dotted}: the page has {page}, the code {code}")
    return problems


def _check_class(node: ast.ClassDef) -> list[str]:
    cls = _class(node.name)
    fields = {
        n.target.id: _NO_DEFAULT if n.value is None else ast.literal_eval(n.value)
        for n in node.body
        if isinstance(n, ast.AnnAssign)
    }
    methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    if dataclasses.is_dataclass(cls):
        code = {
            f.name: _NO_DEFAULT if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)
        }
    elif hasattr(cls, "_fields"):  # a NamedTuple
        code = {f: cls._field_defaults.get(f, _NO_DEFAULT) for f in cls._fields}
    else:  # its public attributes and methods
        public = {n for n in dir(cls) if not n.startswith("_")}
        code = {n: _NO_DEFAULT for n in public if not callable(getattr(cls, n))}
        missing = sorted(public - set(code) - set(methods))
        if missing:
            return [f"{node.name}: the page lacks {missing}"]
    # A dataclass's or NamedTuple's fields in their order; other attributes in any.
    ordered = dataclasses.is_dataclass(cls) or hasattr(cls, "_fields")
    problems = []
    if (list(fields.items()) != list(code.items())) if ordered else fields != code:
        problems.append(f"{node.name}: the page has {fields}, the code {code}")
    for name, method in methods.items():
        page = _page_parameters(method.args)
        in_code = _code_parameters(getattr(cls, name), drop_self=False)
        if page != in_code:
            problems.append(
                f"{node.name}.{name}: the page has {page}, the code {in_code}"
            )
    return problems


@util.serial_only
@pytest.mark.parametrize("block", SIGNATURES, ids=example_id)
def test_signature_is_the_codes(block):
    problems = check_signature(block)
    assert not problems, f"{block.page}:{block.line}:\n" + "\n".join(problems)


@util.serial_only
def test_every_name_has_a_signature_and_an_example():
    kinds = {}
    for block in BLOCKS:
        kinds.setdefault(block.section, set()).add(block.kind)
    # allreduce's section is the page's "Allreduce".
    kinds["allreduce"] = kinds.get("Allreduce", set())
    lacking = {n: sorted({"literal", "python"} - kinds.get(n, set())) for n in NAMES}
    lacking = {n: what for n, what in lacking.items() if what}
    assert not lacking, f"docs/api.rst: sections that lack these blocks: {lacking}"
    # Self-contained, to paste: an example starts with its imports.
    unimported = [
        example.line
        for example in EXAMPLES
        if not isinstance(ast.parse(example.code).body[0], (ast.Import, ast.ImportFrom))
    ]
    assert not unimported, f"docs/api.rst: examples without imports first: {unimported}"


@util.serial_only
def test_a_changed_signature_is_found():
    """The check can fail: a parameter renamed, a default changed, a field lost."""

    def problems(code):
        return check_signature(Block("literal", 1, code, "x"))

    assert problems("mpi4jax_dist.topology(comm=None) -> Topology") == []
    assert problems("mpi4jax_dist.topology(communicator=None)")
    assert problems("mpi4jax_dist.to_global(local, mesh=None, *, check=False)")
    assert problems("class Topology:\n    rank: int\n    size: int")
    assert problems("class Request:\n    shape: tuple\n    dtype: object")
