"""Every message the package gives a user is quoted in the documentation, and every
message quoted there is still one the code gives.

The documentation read is where a user looks a message up: docs/troubleshooting.rst
(by symptom), docs/configuration.rst (a variable's bad value, beside its row), and
the docstrings of the public API (argument errors, in each function's ``Raises``
section), as docs/api.rst renders them: the docstring of each object an
``autofunction``, ``autoclass`` or ``automodule`` directive there names, and of a
class's public methods, found with ``ast`` from the source (``from .x import name``
followed to the definition; nothing is imported).

The messages are read from the source each time, with ``ast`` for Python and
regular expressions for the C and C++ of ``mpi4jax_dist/_ffi`` (nothing is imported
or run). A message is what reaches the user through a *sink*: ``raise X(...)``
(``SystemExit`` included), ``warnings.warn``, a logger's ``warning``, ``error`` or
``critical``, ``sys.stderr.write`` and ``print(..., file=sys.stderr)``, argparse's
``parser.error``, ``pytest.skip``, a line the diagnostics add to their ``problems``
or ``warnings``, the ``(_ERROR, text)`` rank 0 broadcasts for every rank to raise,
and in C/C++ an ``ffi::Error`` (the error XLA raises), the ``std::runtime_error``
and ``std::invalid_argument`` that nanobind raises as ``RuntimeError`` and
``ValueError``, ``PyErr_SetString``, ``PyErr_Format`` and ``fprintf(stderr, ...)``.

A message is a template: its literal *chunks* (one string literal, or one constant
piece of an f-string, each whole) and *holes* (whatever is formatted in). Local
variables, module constants (``_config.COORDINATOR_PORT`` is spelt out) and the
strings that package functions return are followed; a function whose parameter ends
up in a message (``_give_up(what)``, ``check_supported(..., who=...)``) gives one
message per place it is called from, the argument filled in, so that the page
quotes what a user sees: ``... waiting for rank 0 to send the coordinator
address. ...``.

A quote is a paragraph of a ``.. code-block:: text``, on a page or in a docstring
(its ``Messages:`` section, after ``Raises:``: docs/conf.py makes it a section of
napoleon's, since a directive inside a ``Raises`` entry would be flattened into its
text), holes written as ``<...>``, with an
optional ``SomeError:`` (or the ``PROBLEM``/``WARNING`` of the diagnostics' report)
in front.

- Documented: some quoted paragraph, in any of those places, holds every chunk of
  the message of three words or more (its longest chunk where none has three),
  whitespace folded. So a new ``raise`` fails this test until it is quoted, while
  a short name formatted into a message may appear as a placeholder.
- Not stale: the literal text of each quoted paragraph, wherever it is, between its
  placeholders, occurs in that order in one message of the code (a placeholder may
  stand for any text, literal text never for a hole), so a reworded or removed
  message fails this test too.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import util

pytestmark = [util.serial_only, util.same_under_every_mpi]

ROOT = util.ROOT
PAGE = ROOT / "docs" / "troubleshooting.rst"
# The pages that quote messages, and the pages whose autodoc directives name the
# public API whose docstrings quote the argument errors.
PAGES = [PAGE, ROOT / "docs" / "configuration.rst"]
API_PAGES = [ROOT / "docs" / name for name in ("api.rst", "api-cg.rst")]


def api_text() -> str:
    """The API pages' text, one after the other."""
    return "\n".join(page.read_text() for page in API_PAGES)


FFI = ROOT / "mpi4jax_dist" / "_ffi"

# Source files whose messages are not for users, with the reason.
EXCLUDED_FILES = {
    # Generates the wrapper's C from mpi4jax_dist/_ffi/mpiabi_names.txt at build
    # time; its errors are about that file of the source tree, not about a setup.
    "conf/mpiabi_gen.py": "the build's code generator",
}
# Messages a user cannot cause (checks of the package's own invariants, or text
# that is Python's own), by file and a piece of the message, with the reason.
# Each entry must still match a message (test_allow_list_is_current).
EXCLUDED = {
    ("mpi4jax_dist/__init__.py", "has no attribute"): "Python's own AttributeError",
    (
        "mpi4jax_dist/launch/bootstrap.py",
        "before the bootstrap ran",
    ): "call order, internal",
    ("mpi4jax_dist/_ffi/cpu.cc", "the tie has"): "overlap binds equal arity",
    ("mpi4jax_dist/_ffi/allreduce.cc", "operand and result differ"): "XLA aliases",
    ("mpi4jax_dist/_ffi/allreduce.cc", "unknown op code"): "Python checks first",
    ("mpi4jax_dist/_ffi/allreduce.cc", "cannot reduce this element"): "as above",
    ("mpi4jax_dist/_ffi/iallreduce.cc", "but its wait returns"): "XLA's shapes",
    ("mpi4jax_dist/_ffi/module_common.cc", "MPI_Get_library_version"): "MPI bug",
    ("mpi4jax_dist/_ffi/stacks.c", "MPI_Get_library_version"): "MPI bug",
    ("mpi4jax_dist/_ffi/cuda.cc", "set_staging_bytes("): "_config validates first",
    ("mpi4jax_dist/_ffi/stacks.c", "start() first"): "call order, internal",
    ("mpi4jax_dist/_ffi/stacks.c", "a null address"): "the package's own reader",
}

# Places that pass on a message made elsewhere, by file and source text: they
# give no text of their own to quote.
RELAYS = {
    # Rank 0's error, broadcast and raised on every rank: the (_ERROR, text) that
    # Bootstrap._choose_coordinator returns, or rank 0's bad setting.
    ("mpi4jax_dist/launch/bootstrap.py", "raise failfast.JobError(text)"),
    ("mpi4jax_dist/launch/bootstrap.py", "raise failfast.JobValueError(text)"),
    # limits.ensure_file_limit's RuntimeError, quoted from there.
    ("mpi4jax_dist/launch/bootstrap.py", "return (_ERROR, str(err))"),
    # _config.first_bad_setting's error, in a one-process run: the readers' own.
    ("mpi4jax_dist/launch/cluster.py", "raise ValueError(bad)"),
}

# How deep a message is followed through function calls, and how many variants
# (alternatives of an ``if``, of several assignments) one expression may have.
MAX_DEPTH = 6
MAX_VARIANTS = 64


# --- templates --------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """A parameter of the function the template was read in, not yet filled in."""

    name: str


HOLE = None  # whatever is formatted in
Template = tuple  # of str (a chunk), Param or HOLE


def fold(text: str) -> str:
    """Whitespace folded to single spaces, ends stripped; rST's ``x`` → x."""
    return " ".join(text.replace("``", "").split())


def words(chunk: str) -> int:
    return sum(1 for w in chunk.split() if re.search("[A-Za-z]", w))


def product(*alternatives: list[Template]) -> list[Template]:
    """Every concatenation of one alternative of each, at most MAX_VARIANTS."""
    out = {}
    for combo in itertools.product(*alternatives):
        out.setdefault(tuple(itertools.chain(*combo)), None)
        if len(out) == MAX_VARIANTS:
            break
    return list(out)


@dataclass(frozen=True)
class Message:
    path: str  # relative to the repository, POSIX
    line: int
    kind: str  # RuntimeError, RuntimeWarning, log.warning, stderr, ...
    parts: Template
    # Where the functions that filled in its parameters were called: "path:line".
    via: tuple = field(default=(), compare=False)

    @property
    def chunks(self) -> list[str]:
        return [fold(p) for p in self.parts if isinstance(p, str) and fold(p)]

    @property
    def required(self) -> list[str]:
        """The chunks the page must quote: those of three words or more, else the
        longest."""
        long = [c for c in self.chunks if words(c) >= 3]
        return long or sorted(self.chunks, key=len)[-1:]

    def render(self, hole: str = "<...>") -> str:
        text, last_hole = "", False
        for part in self.parts:
            if isinstance(part, str):
                text, last_hole = text + part, False
            elif not last_hole:
                text, last_hole = text + hole, True
        return " ".join(text.split())

    def where(self) -> str:
        called = f", called from {' <- '.join(self.via)}" if self.via else ""
        return f"{self.path}:{self.line} ({self.kind}{called}): {self.render()}"


# --- Python -----------------------------------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(eq=False)
class Func:
    """A function (or a module's top-level code, ``<module>``) and what the
    evaluation needs of it."""

    module: Module
    qualname: str
    node: ast.AST
    parent: Func | None = None
    cls: str | None = None
    params: list[str] = field(default_factory=list)
    defaults: dict = field(default_factory=dict)
    nested: dict = field(default_factory=dict)
    bindings: dict = field(default_factory=dict)  # name -> [(line, kind, value)]

    def own_nodes(self) -> Iterable[ast.AST]:
        """The nodes of this function's body, not of functions defined in it."""
        pruned = _SCOPES if self.node_is_module else _SCOPES + (ast.ClassDef,)
        stack = [n for n in reversed(self.node.body) if not isinstance(n, pruned)]
        while stack:
            node = stack.pop()
            yield node
            children = ast.iter_child_nodes(node)
            stack.extend(reversed([c for c in children if not isinstance(c, pruned)]))

    @property
    def node_is_module(self) -> bool:
        return isinstance(self.node, ast.Module)

    def returns(self) -> list[ast.AST]:
        return [
            n.value
            for n in self.own_nodes()
            if isinstance(n, ast.Return)
            and n.value is not None
            and not (isinstance(n.value, ast.Constant) and n.value.value is None)
        ]


@dataclass(eq=False)
class Module:
    path: str
    dotted: str
    tree: ast.Module
    functions: dict = field(default_factory=dict)  # qualname -> Func
    classes: set = field(default_factory=set)
    constants: dict = field(default_factory=dict)  # name -> expression
    modules: dict = field(default_factory=dict)  # alias -> dotted module
    imported: dict = field(default_factory=dict)  # name -> (dotted module, name)
    top: Func | None = None


class Package:
    """The modules parsed, their functions indexed, their call sites known."""

    def __init__(self, sources: dict[str, str]):
        self.modules: dict[str, Module] = {}
        for path, text in sources.items():
            dotted = (
                path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            )
            module = Module(path, dotted, ast.parse(text, filename=path))
            self._index(module)
            self.modules[dotted] = module
        self.callers: dict[int, list] = {}
        for module in self.modules.values():
            for fn in [module.top, *module.functions.values()]:
                for node in fn.own_nodes():
                    if isinstance(node, ast.Call):
                        target = self.resolve(node.func, fn)
                        if target is not None:
                            self.callers.setdefault(id(target), []).append((fn, node))

    # -- indexing

    def _index(self, module: Module) -> None:
        package = (
            module.dotted
            if module.path.endswith("__init__.py")
            else (module.dotted.rpartition(".")[0])
        )
        module.top = self._func(module, "<module>", module.tree, None, None)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    name = alias.asname or alias.name
                    module.modules[name] = f"{base}.{alias.name}"
                    module.imported[name] = (base, alias.name)
        for node in module.tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                for target in targets:
                    if isinstance(target, ast.Name):
                        module.constants[target.id] = node.value

        def visit(body, prefix, parent, cls):
            for node in body:
                if isinstance(node, ast.ClassDef):
                    module.classes.add(node.name)
                    visit(node.body, f"{prefix}{node.name}.", parent, node.name)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = self._func(module, prefix + node.name, node, parent, cls)
                    if parent is not None:
                        parent.nested[node.name] = fn
                    visit(node.body, f"{fn.qualname}.", fn, cls)

        visit(module.tree.body, "", None, None)

    def _func(self, module, qualname, node, parent, cls) -> Func:
        fn = Func(module, qualname, node, parent, cls)
        if not isinstance(node, ast.Module):
            args = node.args
            positional = args.posonlyargs + args.args
            fn.params = [a.arg for a in positional + args.kwonlyargs]
            fn.params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
            for arg, default in zip(
                positional[::-1], args.defaults[::-1], strict=False
            ):
                fn.defaults[arg.arg] = default
            for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
                if default is not None:
                    fn.defaults[arg.arg] = default
        for n in fn.own_nodes():
            for name, kind, value in _bindings(n):
                fn.bindings.setdefault(name, []).append((n.lineno, kind, value))
        if qualname != "<module>":
            module.functions[qualname] = fn
        return fn

    # -- resolving names

    def resolve(self, func: ast.AST, fn: Func) -> Func | None:
        """The package function a call's ``func`` names, or None."""
        module = fn.module
        if isinstance(func, ast.Name):
            scope = fn
            while scope is not None:
                if func.id in scope.nested:
                    return scope.nested[func.id]
                scope = scope.parent
            if func.id in module.functions:
                return module.functions[func.id]
            if func.id in module.imported:
                other = self.modules.get(module.imported[func.id][0])
                return (
                    other.functions.get(module.imported[func.id][1]) if other else None
                )
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls") and fn.cls:
                return module.functions.get(f"{fn.cls}.{func.attr}")
            if owner in module.classes:
                return module.functions.get(f"{owner}.{func.attr}")
            other = self.modules.get(module.modules.get(owner, ""))
            if other is not None:
                return self.function(other, func.attr)
        return None

    def function(self, module: Module, name: str) -> Func | None:
        """The function ``module.name``, also where a package re-exports it
        (``_config.cuda_aware_source`` is ``_config/ops.py``'s)."""
        if name in module.functions or name not in module.imported:
            return module.functions.get(name)
        base, own = module.imported[name]
        other = self.modules.get(base)
        return other.functions.get(own) if other is not None else None

    def constant(self, module: Module, name: str, depth: int) -> list[Template] | None:
        if name in module.constants:
            return self.ev(module.constants[name], module.top, {}, depth + 1)
        if name in module.imported:
            other = self.modules.get(module.imported[name][0])
            if other is not None and module.imported[name][1] in other.constants:
                return self.constant(other, module.imported[name][1], depth + 1)
        return None

    # -- evaluating an expression into templates

    def ev(self, node, fn: Func, env: dict, depth: int = 0) -> list[Template]:
        if depth > MAX_DEPTH:
            return [(HOLE,)]
        if isinstance(node, ast.Constant):
            return [(node.value,)] if isinstance(node.value, str) else [(HOLE,)]
        if isinstance(node, ast.JoinedStr):
            return product(*[self._formatted(v, fn, env, depth) for v in node.values])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return product(
                self.ev(node.left, fn, env, depth), self.ev(node.right, fn, env, depth)
            )
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            args = (
                node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
            )
            return self.percent(node.left, args, fn, env, depth)
        if isinstance(node, ast.IfExp):
            both = self.ev(node.body, fn, env, depth) + self.ev(
                node.orelse, fn, env, depth
            )
            return list(dict.fromkeys(both))[:MAX_VARIANTS]
        if isinstance(node, ast.Name):
            return self._name(node, fn, env, depth)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            other = self.modules.get(fn.module.modules.get(node.value.id, ""))
            if other is not None:
                return self.constant(other, node.attr, depth) or [(HOLE,)]
        if isinstance(node, ast.Call) and _dotted(node.func) is None:
            format_ = node.func  # "...".format(...): the fields are holes
            if isinstance(format_, ast.Attribute) and format_.attr == "format":
                text = format_.value
                if isinstance(text, ast.Constant) and isinstance(text.value, str):
                    pieces = re.split(r"\{[^{}]*\}", text.value)
                    return [tuple(x for p in pieces for x in (HOLE, p))[1:]]
        if isinstance(node, ast.Call):
            target = self.resolve(node.func, fn)
            if target is not None:
                inner = self.bind(target, node, fn, env, depth)
                out = []
                for value in target.returns():
                    out += self.ev(value, target, inner, depth + 1)
                return list(dict.fromkeys(out))[:MAX_VARIANTS] or [(HOLE,)]
        return [(HOLE,)]

    def _formatted(self, value, fn, env, depth) -> list[Template]:
        if isinstance(value, ast.Constant):
            return [(value.value,)]
        inner = self.ev(value.value, fn, env, depth)
        if value.format_spec is None and value.conversion in (-1, ord("s")):
            return inner
        if value.format_spec is None and value.conversion == ord("r"):
            return [
                (repr(t[0]),) if len(t) == 1 and isinstance(t[0], str) else (HOLE,)
                for t in inner
            ]
        return [(HOLE,)]

    def _name(self, node: ast.Name, fn: Func, env: dict, depth: int) -> list[Template]:
        name = node.id
        scope = fn
        while scope is not None:
            bound = [b for b in scope.bindings.get(name, []) if b[0] < node.lineno]
            if scope is not fn:  # a closure: what the enclosing function assigned
                bound = scope.bindings.get(name, [])
            groups = []
            for _, kind, value in bound:
                if kind == "assign":
                    groups.append(
                        [self.ev(value, scope, env if scope is fn else {}, depth + 1)]
                    )
                elif kind == "aug" and groups:
                    groups[-1].append(
                        self.ev(value, scope, env if scope is fn else {}, depth + 1)
                    )
            if groups:
                out = [t for g in groups for t in product(*g)]
                if scope is fn and name in env:
                    out = env[name] + out
                return list(dict.fromkeys(out))[:MAX_VARIANTS]
            if bound:  # bound by a for, with, unpacking...: unknown
                return [(HOLE,)]
            if scope is fn and name in env:
                return env[name]
            if name in scope.params:
                return [(HOLE,)]
            scope = scope.parent
        return self.constant(fn.module, name, depth) or [(HOLE,)]

    def percent(self, fmt, args, fn, env, depth) -> list[Template]:
        """``fmt % args`` (and a logger's ``fmt, *args``): %s filled, others holes."""
        out = []
        for template in self.ev(fmt, fn, env, depth):
            if len(template) != 1 or not isinstance(template[0], str):
                out.append((HOLE,))
                continue
            pieces = re.split(r"(%[-#0 +]*(?:\*|\d+)?(?:\.\d+)?[a-zA-Z%])", template[0])
            alternatives, values = [], iter(args)
            for piece in pieces:
                if not piece.startswith("%") or len(piece) < 2:
                    alternatives.append([(piece,)] if piece else [()])
                elif piece == "%%":
                    alternatives.append([("%",)])
                else:
                    value = next(values, None)
                    if piece == "%s" and value is not None:
                        alternatives.append(self.ev(value, fn, env, depth))
                    else:
                        alternatives.append([(HOLE,)])
            out += product(*alternatives)
        return out

    def bind(
        self, target: Func, call: ast.Call, fn: Func, env: dict, depth: int
    ) -> dict:
        """The values of ``target``'s parameters at ``call`` (made in ``fn``)."""
        params = list(target.params)
        by_instance = (
            isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id in ("self", "cls")
        )
        inner = {}
        if by_instance and params:
            inner[params.pop(0)] = [(HOLE,)]
        for param, arg in zip(params, call.args, strict=False):
            if isinstance(arg, ast.Starred):
                break
            inner[param] = self.ev(arg, fn, env, depth + 1)
        for keyword in call.keywords:
            if keyword.arg in target.params:
                inner[keyword.arg] = self.ev(keyword.value, fn, env, depth + 1)
        for param in target.params:
            if param not in inner:
                default = target.defaults.get(param)
                inner[param] = (
                    [(HOLE,)]
                    if default is None
                    else self.ev(default, target.module.top, {}, depth + 1)
                )
        return inner

    # -- the messages

    def sinks(self):
        """``(path, node, kind, messages)`` for every place that gives the user a
        message; ``messages`` is empty where none could be read."""
        for module in self.modules.values():
            for fn in [module.top, *module.functions.values()]:
                env = {p: [(Param(p),)] for p in fn.params}
                for node in fn.own_nodes():
                    for kind, templates in self._sink(node, fn, env):
                        found = [
                            Message(module.path, node.lineno, kind, filled, via)
                            for template in templates
                            for filled, via in self._fill(fn, template, 0, {id(fn)})
                        ]
                        yield module.path, node, kind, [
                            m for m in found if _meaningful(m)
                        ]

    def messages(self) -> list[Message]:
        return list(dict.fromkeys(m for *_, found in self.sinks() for m in found))

    def _fill(self, fn: Func, template: Template, depth: int, seen: set) -> list:
        """``(template, call sites)`` with ``fn``'s parameters filled in at each
        place that calls ``fn`` (holes where nothing does)."""
        if not any(isinstance(p, Param) for p in template):
            return [(template, ())]
        out = []
        if depth < MAX_DEPTH:
            for caller, call in self.callers.get(id(fn), []):
                if id(caller) in seen:
                    continue
                env = self.bind(
                    fn, call, caller, {p: [(Param(p),)] for p in caller.params}, 0
                )
                pieces = [
                    env.get(p.name, [(HOLE,)]) if isinstance(p, Param) else [(p,)]
                    for p in template
                ]
                site = f"{caller.module.path}:{call.lineno}"
                for filled in product(*pieces):
                    more = self._fill(caller, filled, depth + 1, seen | {id(caller)})
                    out += [(t, (site, *via)) for t, via in more]
        return out or [
            (tuple(HOLE if isinstance(p, Param) else p for p in template), ())
        ]

    def _sink(self, node, fn: Func, env: dict):
        """``(kind, templates)`` for each message ``node`` gives the user."""
        if isinstance(node, ast.Raise) and node.exc is not None:
            yield from self._raised(node.exc, fn, env, 0)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            first = node.value.elts[0] if node.value.elts else None
            if isinstance(first, ast.Name) and first.id == "_ERROR":  # _topology
                yield "RuntimeError", self.ev(node.value.elts[1], fn, env)
        if not isinstance(node, ast.Call):
            return
        func, args = node.func, node.args
        dotted = _dotted(func)
        keywords = {k.arg: k.value for k in node.keywords}
        if dotted == "warnings.warn" and args:
            category = args[1] if len(args) > 1 else keywords.get("category")
            yield _dotted(category) or "UserWarning", self.ev(args[0], fn, env)
        elif dotted == "sys.stderr.write" and args:
            yield "stderr", self.ev(args[0], fn, env)
        elif (
            dotted == "print" and args and _dotted(keywords.get("file")) == "sys.stderr"
        ):
            yield "stderr", self.ev(args[0], fn, env)
        elif dotted in ("pytest.skip", "pytest.fail", "pytest.exit") and args:
            yield dotted, self.ev(args[0], fn, env)
        elif dotted == "pytest.mark.skip" and "reason" in keywords:
            yield dotted, self.ev(keywords["reason"], fn, env)
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and args
        ):
            owner, attr = func.value.id, func.attr
            if "log" in owner and attr in ("warning", "error", "critical", "exception"):
                yield f"log.{attr}", self.percent(args[0], args[1:], fn, env, 0)
            elif owner in ("parser", "cli") and attr == "error":
                yield "usage", self.ev(args[0], fn, env)
            elif owner in ("problems", "warnings") and attr == "append":
                yield f"--check {owner}", self.ev(args[0], fn, env)

    def _raised(self, exc, fn: Func, env: dict, depth: int):
        if not isinstance(exc, ast.Call) or depth > MAX_DEPTH:
            return  # raise err: raised again, said where it was made
        target = self.resolve(exc.func, fn)
        if target is not None:  # a function that returns the exception
            inner = self.bind(target, exc, fn, env, depth)
            for value in target.returns():
                yield from self._raised(value, target, inner, depth + 1)
        elif exc.args:
            yield _dotted(exc.func) or "exception", self.ev(exc.args[0], fn, env, depth)


def _meaningful(message: Message) -> bool:
    return any(re.search("[A-Za-z]", c) for c in message.chunks)


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _bindings(node):
    """``(name, kind, value)`` for each name ``node`` binds: ``assign`` (``x =``),
    ``aug`` (``x +=``) or ``other`` (a for, with, unpacking, except, import...)."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                if node.value is not None:
                    yield target.id, "assign", node.value
            else:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        yield n.id, "other", None
    elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        if isinstance(node.op, ast.Add):
            yield node.target.id, "aug", node.value
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
        targets = [node.target] if isinstance(node, (ast.For, ast.AsyncFor)) else []
        targets += [i.optional_vars for i in getattr(node, "items", [])]
        for n in (n for t in targets if t is not None for n in ast.walk(t)):
            if isinstance(n, ast.Name):
                yield n.id, "other", None
    elif isinstance(node, ast.NamedExpr):
        yield node.target.id, "other", None
    elif isinstance(node, ast.ExceptHandler) and node.name:
        yield node.name, "other", None


def python_sources() -> dict[str, str]:
    paths = sorted((ROOT / "mpi4jax_dist").rglob("*.py"))
    paths += [ROOT / "pytest_mpi4jax_dist.py", ROOT / "setup.py"]
    paths += sorted((ROOT / "conf").glob("*.py"))  # the build's machinery
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in paths}


# --- C and C++ ----------------------------------------------------------------------

_C_SINK = re.compile(
    r"\b(ffi::Error(?:::\w+)?|std::runtime_error|std::invalid_argument"
    r"|PyErr_SetString|PyErr_Format|fprintf)\s*\("
)
_C_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_C_CONSTANT = re.compile(
    r'constexpr\s+const\s+char\s*\*\s*(\w+)\s*=\s*("(?:[^"\\]|\\.)*")\s*;'
)
_PRINTF = re.compile(r"%[-#0 +]*(?:\*|\d+)?(?:\.\d+)?(?:hh|h|ll|l|z|j|t|L)?[a-zA-Z%]")


def _c_literal(token: str) -> str:
    """A C string literal's text, escapes decoded (UTF-8 text kept)."""
    return token[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")


def _strip_c_comments(text: str) -> str:
    """Comments blanked (newlines kept), strings and characters left alone."""
    out, i = [], 0
    pattern = re.compile(
        r'//[^\n]*|/\*.*?\*/|"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'', re.S
    )
    for match in pattern.finditer(text):
        out.append(text[i : match.start()])
        token = match.group()
        out.append(re.sub(r"[^\n]", " ", token) if token[0] == "/" else token)
        i = match.end()
    return "".join(out) + text[i:]


def _c_call_args(text: str, start: int) -> str:
    """The text between the parenthesis at ``start`` and its match."""
    depth, i = 0, start
    while i < len(text):
        if text[i] == '"':
            i = _C_STRING.match(text, i).end()
            continue
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
        i += 1
    return text[start + 1 :]


def c_messages(sources: dict[str, str]) -> list[Message]:
    constants = {}
    for text in sources.values():
        for name, literal in _C_CONSTANT.findall(text):
            constants[name] = _c_literal(literal)
    found = []
    for path, text in sources.items():
        code = _strip_c_comments(text)
        for match in _C_SINK.finditer(code):
            args = _c_call_args(code, match.end() - 1)
            if match.group(1) == "fprintf" and not args.lstrip().startswith("stderr"):
                continue
            printf = match.group(1) in ("PyErr_Format", "fprintf")
            line = code.count("\n", 0, match.start()) + 1
            kind = match.group(1)
            for parts in _c_templates(args, constants, printf):
                message = Message(path, line, kind, parts)
                if _meaningful(message):
                    found.append(message)
    return list(dict.fromkeys(found))


def _c_templates(args: str, constants: dict, printf: bool) -> list[Template]:
    """The argument text as templates: adjacent literals are one chunk, a known
    ``constexpr const char*`` its value, ``(c ? "a" : "b")`` two variants, anything
    else a hole."""
    tokens, i = [], 0  # (the code before it, a literal), adjacent literals joined
    for match in _C_STRING.finditer(args):
        glue, literal = args[i : match.start()], _c_literal(match.group())
        if tokens and not glue.strip():
            tokens[-1] = (tokens[-1][0], tokens[-1][1] + literal)
        else:
            tokens.append((glue, literal))
        i = match.end()
    tail = args[i:]
    variants = [[]]
    k = 0
    while k < len(tokens):
        glue, literal = tokens[k]
        if (
            k + 1 < len(tokens)
            and glue.rstrip().endswith("?")
            and tokens[k + 1][0].strip() == ":"
        ):
            variants = [v + [t[1]] for v in variants for t in tokens[k : k + 2]]
            k += 2
            continue
        if k == 0:  # after the exception, the error code or the stream
            glue = glue.rsplit(",", 1)[-1]
        name = re.sub(r"std::string|[()+\s]", "", glue)
        head = [constants[name]] if name in constants else [HOLE] if name else []
        body = [literal]
        if printf:
            pieces = re.split(_PRINTF, literal)
            body = [x for p in pieces for x in (HOLE, p) if x != ""][1:]
        variants = [v + head + body for v in variants]
        k += 1
    if not printf and re.sub(r"[()+\s]", "", tail):
        variants = [v + [HOLE] for v in variants]
    return list(dict.fromkeys(tuple(v) for v in variants))


def c_sources() -> dict[str, str]:
    paths = sorted(p for ext in ("*.cc", "*.h", "*.c") for p in FFI.glob(ext))
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in paths}


# --- the page -----------------------------------------------------------------------


# What may stand before a message on the page: the exception's name, or the prefix
# of python -m mpi4jax_dist's report lines.
_PREFIX = re.compile(
    r"^(?:\w+(?:Error|Warning|Exception|Exit|Interrupt): "
    r"|(?:PROBLEM|WARNING) (?:rank <[^<>]*>: )?)"
)


@dataclass(frozen=True)
class Quote:
    line: int
    text: str  # folded
    where: str = ""  # the page or the docstring, for the reports

    @property
    def body(self) -> str:
        """Without what may stand before the message (:data:`_PREFIX`)."""
        return _PREFIX.sub("", self.text)


def quotes(page: str, where: str = "", first_line: int = 1) -> list[Quote]:
    """The paragraphs of the page's ``.. code-block:: text`` directives (a page, or
    a docstring whose first line is ``first_line`` of its file)."""
    lines = page.splitlines() + [""]

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    def quote(start: int, paragraph: list[str]) -> Quote:
        line = start + first_line - 1
        return Quote(line, fold(" ".join(paragraph)), f"{where}:{line}")

    found, i = [], 0
    while i < len(lines):
        directive = re.match(r"(\s*)\.\. code-block:: text\s*$", lines[i])
        i += 1
        if not directive:
            continue
        level = len(directive.group(1))
        while lines[i].strip().startswith(":") and indent(lines[i]) > level:
            i += 1  # the directive's options
        paragraph, start = [], i
        while i < len(lines) and (not lines[i].strip() or indent(lines[i]) > level):
            if lines[i].strip():
                start = start if paragraph else i + 1
                paragraph.append(lines[i])
            elif paragraph:
                found.append(quote(start, paragraph))
                paragraph = []
            i += 1
        if paragraph:
            found.append(quote(start, paragraph))
    return found


# --- the public API's docstrings ----------------------------------------------------

_AUTODOC = re.compile(r"^\.\. auto(function|class|module):: *(\S+)\s*$", re.M)


def _definition(dotted: str, package: Package, depth: int = 0):
    """(path, node) of the module, class or function ``dotted`` names, following
    the package's imports (``from .x import name``); None where the source does
    not define it."""
    if dotted in package.modules:
        module = package.modules[dotted]
        return module.path, module.tree
    owner, _, name = dotted.rpartition(".")
    module = package.modules.get(owner)
    if module is None or depth > MAX_DEPTH:
        return None
    for node in module.tree.body:
        defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if isinstance(node, defines) and node.name == name:
            return module.path, node
    if name in module.imported:
        origin, attr = module.imported[name]
        return _definition(f"{origin}.{attr}", package, depth + 1)
    return None


def api_docstrings(package: Package, api_page: str) -> list[tuple]:
    """(where, first line, docstring) of every object the API page renders with
    autodoc, and of each public method of its classes."""
    found = []
    for kind, dotted in _AUTODOC.findall(api_page):
        definition = _definition(dotted, package)
        assert definition is not None, f"api.rst: {dotted} is not in the source"
        path, node = definition
        nodes = [(dotted, node)]
        if kind == "class":
            nodes += [
                (f"{dotted}.{child.name}", child)
                for child in node.body
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not child.name.startswith("_")
            ]
        for name, each in nodes:
            doc = ast.get_docstring(each)
            if doc:
                first = each.body[0].lineno
                found.append((f"docstring of {name} ({path})", first, doc))
    return found


def documented_quotes(
    pages: Iterable = PAGES,
    package: Package | None = None,
    api_page: str | None = None,
) -> list[Quote]:
    """Every quote: the pages', and the API docstrings'."""
    package = the_package() if package is None else package
    api_page = api_text() if api_page is None else api_page
    found = [q for p in pages for q in quotes(p.read_text(), f"docs/{p.name}")]
    for where, first, doc in api_docstrings(package, api_page):
        found += quotes(doc, where, first)
    return found


def _literal_pieces(quote: Quote) -> list[str]:
    return [fold(p) for p in re.split(r"<[^<>]*>", quote.body) if fold(p)]


# --- the checks ---------------------------------------------------------------------


def excluded(message: Message) -> bool:
    if message.path in EXCLUDED_FILES:
        return True
    return any(
        message.path == path and piece in message.render() for path, piece in EXCLUDED
    )


def undocumented(messages: list[Message], page_quotes: list[Quote]) -> list[Message]:
    """The messages no quoted paragraph holds every required chunk of."""
    texts = [q.text for q in page_quotes]
    return [
        m
        for m in messages
        if not excluded(m) and not any(all(c in t for c in m.required) for t in texts)
    ]


def stale(page_quotes: list[Quote], messages: list[Message]) -> list[Quote]:
    """The quoted paragraphs that are no message of the code."""
    rendered = [m.render(hole="\0") for m in messages]
    out = []
    for quote in page_quotes:
        pieces = _literal_pieces(quote)
        pattern = re.compile(".*?".join(re.escape(p) for p in pieces), re.S)
        if not pieces or not any(pattern.search(r) for r in rendered):
            out.append(quote)
    return out


@functools.cache
def the_package() -> Package:
    """The package's Python, parsed once for every test that reads it."""
    return Package(python_sources())


@functools.cache
def all_messages() -> list[Message]:
    return the_package().messages() + c_messages(c_sources())


# --- tests --------------------------------------------------------------------------


def test_extraction_finds_the_messages():
    """A broken extractor must not pass by finding nothing: enough messages, of
    every kind of sink, and known ones spelt out."""
    messages = all_messages()
    assert len(messages) > 100, len(messages)
    kinds = {m.kind for m in messages}
    for kind in (
        "RuntimeError",
        "RuntimeWarning",
        "SystemExit",
        "stderr",
        "log.critical",
        "log.warning",
        "usage",
        "--check problems",
        "pytest.skip",
        "ffi::Error::InvalidArgument",
        "fprintf",
    ):
        assert kind in kinds, (kind, sorted(kinds))
    paths = {m.path for m in messages}
    assert {
        "conf/mpiconfig.py",
        "conf/cudaconfig.py",
        "pytest_mpi4jax_dist.py",
        "mpi4jax_dist/_ffi/cpu.cc",
    } <= paths
    rendered = [m.render() for m in messages]
    # A parameter filled in from the caller, through three functions.
    assert any(
        r.startswith("mpi4jax_dist: rank <...> of <...>: gave up after <...> s waiting")
        and "rank 0 to send the coordinator address." in r
        for r in rendered
    )
    # A module constant of another module spelt out.
    assert any("Set JAX_COORDINATOR_PORT (or pass the port)" in r for r in rendered)
    # C++: a constant name and a ternary.
    assert any(
        r.startswith("mpi4jax_dist.iallreduce: the start made at") for r in rendered
    )
    assert any(": MPI is not initialized; import mpi4py.MPI" in r for r in rendered)


def test_every_message_is_documented():
    missing = undocumented(all_messages(), documented_quotes())
    assert not missing, (
        f"{len(missing)} message(s) the package gives are not quoted in "
        f"docs/troubleshooting.rst (with cause and fix), docs/configuration.rst (a "
        f"variable's bad value) or the Raises section of a public function's "
        f"docstring (an argument error): a paragraph of a '.. code-block:: text' "
        f"with every chunk below, holes as <...>:\n"
        + "\n".join(f"{m.where()}\n    chunks: {m.required}" for m in missing)
    )


def test_every_quoted_message_is_in_the_code():
    gone = stale(documented_quotes(), all_messages())
    assert not gone, (
        f"{len(gone)} quoted paragraph(s) are no message of the code any more "
        f"(reworded or removed?); placeholders <...> must stand where the code "
        f"formats a value in:\n" + "\n".join(f"{q.where}: {q.text}" for q in gone)
    )


def test_every_message_can_be_read():
    """A message built in a way the extraction cannot follow (``str.format``, a
    helper outside the package) would escape both checks: each place that gives
    the user a message must yield its text, or be a known relay."""
    package = the_package()
    unread = [
        f"{path}:{node.lineno}: {ast.unparse(node)}"
        for path, node, _, found in package.sinks()
        if not found and (path, ast.unparse(node)) not in RELAYS
    ]
    assert not unread, "no message text read at:\n" + "\n".join(unread)
    sinks = {(path, ast.unparse(node)) for path, node, *_ in package.sinks()}
    assert RELAYS <= sinks, RELAYS - sinks


def test_page_has_quotes():
    assert len(quotes(PAGE.read_text())) > 50


def test_api_docstrings_are_read():
    """Every autodoc directive of the API pages is found in the source,
    docstrings and methods included."""
    docs = api_docstrings(the_package(), api_text())
    names = {where.split()[2] for where, *_ in docs}
    assert {
        "mpi4jax_dist.initialize",
        "mpi4jax_dist.allreduce",
        "mpi4jax_dist.cg.cg",
        "mpi4jax_dist.Request.wait",
    } <= names, sorted(names)
    in_docstrings = [q for q in documented_quotes() if q.where.startswith("docstring")]
    assert len(in_docstrings) > 40, len(in_docstrings)


def test_allow_list_is_current():
    """Every exclusion still matches a message: the list cannot rot."""
    messages = all_messages()
    for path, piece in EXCLUDED:
        assert any(m.path == path and piece in m.render() for m in messages), (
            path,
            piece,
        )
    for path in EXCLUDED_FILES:
        assert (ROOT / path).is_file(), path


# --- the checks can fail --------------------------------------------------------------

_FAKE = """
from . import _config

NAME = "MPI4JAX_DIST_FROB"


def _give_up(what):
    logger.critical("mpi4jax_dist: rank %d: %s", 3, f"gave up waiting for {what}.")


def frob(x):
    if x:
        raise RuntimeError(f"{NAME}={x!r}: the frobnicator overheated; cool it.")
    _give_up("the frobnicator to cool down")
"""

_FAKE_PAGE = """
.. code-block:: text

   RuntimeError: MPI4JAX_DIST_FROB=<value>: the frobnicator overheated; cool it.

   mpi4jax_dist: rank <r>: gave up waiting for the frobnicator to warm up.
"""


def test_an_undocumented_raise_is_reported():
    messages = Package({"mpi4jax_dist/_fake.py": _FAKE}).messages()
    rendered = {m.render() for m in messages}
    assert rendered == {
        "MPI4JAX_DIST_FROB=<...>: the frobnicator overheated; cool it.",
        "mpi4jax_dist: rank <...>: gave up waiting for the frobnicator to cool down.",
    }
    missing = undocumented(messages, quotes(_FAKE_PAGE))
    assert [(m.path, m.line) for m in missing] == [("mpi4jax_dist/_fake.py", 8)]
    assert (
        undocumented(messages, quotes(_FAKE_PAGE.replace("warm up", "cool down"))) == []
    )


def test_an_unreadable_message_is_reported():
    source = (
        "import textwrap\n"
        "def frob(x):\n"
        "    raise ValueError('frob {} is {}'.format(x, 'hot'))\n"
        "def frob2(x):\n"
        "    raise ValueError(textwrap.dedent(x))\n"
    )
    sinks = list(Package({"mpi4jax_dist/_fake.py": source}).sinks())
    assert [m.render() for m in sinks[0][3]] == ["frob <...> is <...>"]
    assert [(node.lineno, found) for _, node, _, found in sinks[1:]] == [(5, [])]


def test_a_stale_quote_is_reported():
    messages = Package({"mpi4jax_dist/_fake.py": _FAKE}).messages()
    gone = stale(quotes(_FAKE_PAGE), messages)
    assert [q.text for q in gone] == [
        "mpi4jax_dist: rank <r>: gave up waiting for the frobnicator to warm up."
    ]
    # Literal text may not stand where the code formats a value in.
    literal = _FAKE_PAGE.replace("<value>", "'hot'")
    assert len(stale(quotes(literal), messages)) == 2


_FAKE_DOCUMENTED = _FAKE.replace(
    "def frob(x):\n",
    '''def frob(x):
    """Frobs.

    Raises:
        RuntimeError: x is hot:

            .. code-block:: text

                RuntimeError: MPI4JAX_DIST_FROB=<value>: the frobnicator melted.
    """
''',
)


def test_a_stale_quote_in_a_docstring_is_reported():
    sources = {
        "mpi4jax_dist/__init__.py": "from ._fake import frob\n",
        "mpi4jax_dist/_fake.py": _FAKE_DOCUMENTED,
    }
    api_page = "Frob\n----\n\n.. autofunction:: mpi4jax_dist.frob\n"
    package = Package(sources)
    found = documented_quotes([], package, api_page)
    assert [(q.where, q.text) for q in found] == [
        (
            "docstring of mpi4jax_dist.frob (mpi4jax_dist/_fake.py):19",
            "RuntimeError: MPI4JAX_DIST_FROB=<value>: the frobnicator melted.",
        )
    ]
    assert stale(found, package.messages()) == found
    fixed = dict(sources)
    fixed["mpi4jax_dist/_fake.py"] = _FAKE_DOCUMENTED.replace(
        "melted.", "overheated; cool it."
    )
    package = Package(fixed)
    found = documented_quotes([], package, api_page)
    assert stale(found, package.messages()) == []
    # and, quoted there, the raise counts as documented
    raised = [m for m in package.messages() if m.kind == "RuntimeError"]
    assert raised and undocumented(raised, found) == []


def test_c_messages_are_read():
    source = r"""
    constexpr const char* kName = "mpi4jax_dist.frob";
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string(kName) + ": the frob is " +
                      (hot ? "too hot" : "too cold") + // a comment "x"
                      "; let it be " "for a while.");
    PyErr_Format(PyExc_ValueError, "frob(%d): needs at least %zu frobs", n, m);
    """
    rendered = sorted(m.render() for m in c_messages({"x.cc": source}))
    assert rendered == [
        "frob(<...>): needs at least <...> frobs",
        "mpi4jax_dist.frob: the frob is too cold; let it be for a while.",
        "mpi4jax_dist.frob: the frob is too hot; let it be for a while.",
    ]
