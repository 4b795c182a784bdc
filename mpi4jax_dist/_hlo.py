"""Count the cross-process reductions of a loop in XLA's optimized HLO text.

``jax.jit(f).lower(*args).compile().as_text()`` prints the program that runs, after
XLA's passes have fused, hoisted, combined or dropped what they could. A solver that
reads its reductions from there reports what ran, not what it declared: a reduction
a user's ``matvec`` adds is seen, and one XLA drops is not counted.

The rules, in the order :func:`loop_reductions` applies them:

* **The loop** is the ``while`` instruction whose ``op_name`` metadata ends in
  ``<loop>/while``: a ``jax.named_scope(loop)`` around the ``lax.while_loop``. Without
  a name it is the only ``while`` of the program outside other loops (as in
  ``jax.scipy.sparse.linalg.cg``). Only loops reached from the entry computation
  without entering another loop's body qualify, so that a solve nested in a
  ``matvec`` is not taken for the outer one. None or several: ``LookupError``.
* **A reduction** is an instruction that combines values of several processes:
  ``all-reduce``, ``all-reduce-start`` (its ``-done`` half is the same reduction),
  ``reduce-scatter``, mpi4jax's custom calls for allreduce, reduce and scan, and
  this package's: :func:`mpi4jax_dist.allreduce`'s, and the start of
  :func:`mpi4jax_dist.iallreduce` (its test and wait complete the same reduction).
  Collectives that only move data are not: ``collective-permute``, ``all-gather``,
  ``all-to-all``, send/recv, mpi4jax's ``sendrecv`` (halo exchanges), broadcasts.
  An all-reduce that XLA combined from several independent ones (a tuple of
  operands) is one collective and counts once; mpi4jax's calls are never combined.
* **The walk** covers the loop's body and condition and everything they call:
  fusions, ``call``, custom calls' computations and ``async-start`` wrappers (their
  ``async-update``/``async-done`` halves are not walked again); an instruction that
  calls a computation runs it once per execution of its own.
* **A conditional marked** ``<branch>/cond`` (``jax.named_scope(branch)`` around the
  ``lax.cond``) is counted apart, in :attr:`LoopReductions.branch`, per execution of
  its reducing branch: the caller counts how often that branch runs. At most one of
  its branches may reduce (the other is expected to pass values through).
* **Any other conditional** counts once when all its branches reduce alike; when
  they differ, how many run depends on the data, and the count is in doubt.
* **A nested loop** counts its body times its trip count and its condition that
  plus one, when XLA knows the trip count (``known_trip_count``, as for a
  ``lax.fori_loop`` with static bounds); otherwise a nested loop that reduces puts
  the count in doubt.

A count in doubt is reported with its reasons (:attr:`LoopReductions.doubts`) rather
than guessed: the caller decides what to report (``mpi4jax_dist.cg`` reports -1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# mpi4jax's custom-call targets that combine values of several ranks; the names
# without "_ffi" are those of mpi4jax before its XLA FFI port.
MPI_REDUCTION_TARGETS = frozenset(
    f"mpi_{op}{suffix}"
    for op in ("allreduce", "reduce", "scan")
    for suffix in ("_ffi", "")
)
# This package's: the blocking allreduce, and the start of the non-blocking one
# (its "mpi4jax_dist_iallreduce_test" and "_wait" are the same reduction's later
# halves, like all-reduce-done, and are not counted).
MPI_REDUCTION_TARGETS |= {"mpi4jax_dist_allreduce", "mpi4jax_dist_iallreduce_start"}
REDUCTION_OPCODES = frozenset({"all-reduce", "all-reduce-start", "reduce-scatter"})
# Second halves of asynchronous pairs: the first half was counted and walked.
_SECOND_HALVES = frozenset(
    {"async-update", "async-done", "all-reduce-done", "reduce-scatter-done"}
)
_CALLEE_ROLES = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
)

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][\w.-]*)\(")
_OP_NAME = re.compile(r'op_name="(?P<value>(?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="(?P<value>[^"]*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(?P<n>\d+)"')
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_CALLEES = re.compile(
    r"\b(?P<role>" + "|".join(_CALLEE_ROLES) + r")=(?P<names>\{[^}]*\}|%?[\w.-]+)"
)


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: what the counting rules need of it."""

    name: str
    opcode: str
    op_name: str = ""
    target: str = ""  # custom_call_target of a custom-call
    trip_count: int | None = None  # XLA's known_trip_count of a while
    callees: dict = field(default_factory=dict)  # role -> [computation names]

    def calls(self, *roles: str) -> list[str]:
        """Return the computations this instruction calls in ``roles`` (all: none)."""
        roles = roles or _CALLEE_ROLES
        return [name for role in roles for name in self.callees.get(role, ())]

    @property
    def is_reduction(self) -> bool:
        if self.opcode == "custom-call":
            return self.target in MPI_REDUCTION_TARGETS
        return self.opcode in REDUCTION_OPCODES

    def scope(self) -> str:
        """Return the path component before the last of ``op_name``: the innermost
        ``named_scope`` the instruction's JAX operation ran under."""
        parts = self.op_name.split("/")
        return parts[-2] if len(parts) >= 2 else ""


@dataclass(frozen=True)
class Module:
    """An HLO module: its computations by name, and the entry computation's name."""

    computations: dict  # name -> [Instruction]
    entry: str


def _opcode(rest: str) -> str:
    """Return the opcode of an instruction's right-hand side ``shape opcode(...)``."""
    if rest.startswith("("):  # a tuple shape, which may hold spaces and parens
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.partition(" ")[2]
    match = _OPCODE.match(rest)
    return match["opcode"] if match else ""


def _instruction(name: str, rest: str) -> Instruction:
    op_name = _OP_NAME.search(rest)
    target = _TARGET.search(rest)
    trip = _TRIP_COUNT.search(rest)
    callees = {}
    # Quoted strings (op_name, backend_config JSON) could hold "body=" and the like.
    for match in _CALLEES.finditer(_QUOTED.sub('""', rest)):
        names = match["names"].strip("{}").split(",")
        callees[match["role"]] = [n.strip().lstrip("%") for n in names if n.strip()]
    return Instruction(
        name=name,
        opcode=_opcode(rest),
        op_name=op_name["value"] if op_name else "",
        target=target["value"] if target else "",
        trip_count=int(trip["n"]) if trip else None,
        callees=callees,
    )


def parse(text: str) -> Module:
    """Return the :class:`Module` of HLO text (``Compiled.as_text()``).

    Raises:
        ValueError: the text holds no entry computation.
    """
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and "->" in line:
                current = computations.setdefault(header["name"], [])
                if line.startswith("ENTRY"):
                    entry = header["name"]
            continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            current.append(_instruction(match["name"], match["rest"]))
    if entry is None:
        raise ValueError(
            "no ENTRY computation in this text: expected XLA's HLO text, such as "
            "jax.jit(f).lower(*args).compile().as_text()."
        )
    return Module(computations, entry)


@dataclass(frozen=True)
class _Count:
    """Reductions per execution of a computation: outside marked conditionals, in
    their reducing branches, and why either may be wrong."""

    outside: int = 0
    marked: int = 0
    doubts: tuple = ()

    def __add__(self, other: _Count) -> _Count:
        return _Count(
            self.outside + other.outside,
            self.marked + other.marked,
            self.doubts + other.doubts,
        )

    def times(self, n: int) -> _Count:
        return _Count(self.outside * n, self.marked * n, self.doubts)

    @property
    def any(self) -> bool:
        return bool(self.outside or self.marked)


class _Walker:
    def __init__(self, module: Module, branch: str | None):
        self.module, self.branch, self.memo = module, branch, {}

    def computation(self, name: str) -> _Count:
        if name not in self.memo:
            total = _Count()
            for instruction in self.module.computations.get(name, ()):
                total = total + self.instruction(instruction)
            self.memo[name] = total
        return self.memo[name]

    def instruction(self, ins: Instruction) -> _Count:
        if ins.opcode in _SECOND_HALVES:
            return _Count()
        if ins.opcode == "while":
            return self.loop(ins)
        if ins.opcode == "conditional":
            return self.conditional(ins)
        total = _Count(outside=int(ins.is_reduction))
        for callee in ins.calls():
            total = total + self.computation(callee)
        return total

    def loop(self, ins: Instruction) -> _Count:
        body = _Count()
        for name in ins.calls("body"):
            body = body + self.computation(name)
        condition = _Count()
        for name in ins.calls("condition"):
            condition = condition + self.computation(name)
        if ins.trip_count is not None:
            return body.times(ins.trip_count) + condition.times(ins.trip_count + 1)
        total = body + condition
        if total.any:
            total = total + _Count(
                doubts=(
                    f"a loop without a known trip count reduces ({ins.name}, "
                    f"{ins.op_name or 'no op_name'})",
                )
            )
        return total

    def conditional(self, ins: Instruction) -> _Count:
        branches = [
            self.computation(name)
            for name in ins.calls(
                "branch_computations", "true_computation", "false_computation"
            )
        ]
        if not branches:
            return _Count()
        doubts = tuple(d for b in branches for d in b.doubts)
        where = f"{ins.name}, {ins.op_name or 'no op_name'}"
        if self.branch is not None and ins.scope() == self.branch:
            reducing = [b for b in branches if b.any]
            if len(reducing) > 1:
                doubts += (f"more than one branch of {where} reduces",)
            most = max(b.outside + b.marked for b in branches)
            return _Count(marked=most, doubts=doubts)
        first = branches[0]
        if any(
            (b.outside, b.marked) != (first.outside, first.marked) for b in branches
        ):
            doubts += (f"the branches of {where} reduce differently",)
        return _Count(first.outside, first.marked, doubts)


@dataclass(frozen=True)
class LoopReductions:
    """The reductions of one loop of a compiled program.

    Attributes:
        body: per execution of the loop body, outside marked conditionals.
        branch: per execution of a marked conditional's reducing branch.
        condition: per evaluation of the loop condition (iterations + 1 of them).
        doubts: why the counts may be wrong; empty when they are exact.
    """

    body: int
    branch: int
    condition: int
    doubts: tuple = ()

    @property
    def exact(self) -> bool:
        return not self.doubts

    def total(self, iterations, branch_runs=0):
        """Return the reductions made by ``iterations`` iterations in which the
        marked branch ran ``branch_runs`` times (plain ints or JAX scalars)."""
        return (
            iterations * self.body
            + branch_runs * self.branch
            + (iterations + 1) * self.condition
        )


def _top_level_loops(module: Module) -> list[Instruction]:
    """Return the ``while`` instructions reached from the entry computation without
    entering another loop."""
    loops, seen, stack = [], set(), [module.entry]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for ins in module.computations.get(name, ()):
            if ins.opcode == "while":
                loops.append(ins)
            else:
                stack.extend(ins.calls())
    return loops


def loop_reductions(
    text: str, loop: str | None = None, branch: str | None = None
) -> LoopReductions:
    """Count the reductions of one loop in HLO text (module docstring: the rules).

    Args:
        text: XLA's HLO text, e.g. ``jax.jit(f).lower(*a).compile().as_text()``.
        loop: the ``jax.named_scope`` around the ``lax.while_loop``; None: the only
            loop of the program outside other loops.
        branch: the ``jax.named_scope`` around a ``lax.cond`` in the loop whose
            reducing branch is counted apart; None: none is.

    Returns:
        A :class:`LoopReductions`.

    Raises:
        LookupError: no such loop, or more than one.
        ValueError: ``text`` is not HLO text.
    """
    module = parse(text)
    loops = _top_level_loops(module)
    if loop is not None:
        loops = [ins for ins in loops if ins.scope() == loop]
    if len(loops) != 1:
        what = "loops" if loop is None else f"loops marked {loop!r}"
        found = ", ".join(f"{ins.name} ({ins.op_name})" for ins in loops) or "none"
        raise LookupError(
            f"expected one top-level while loop in the program, found {what}: "
            f"{found}."
        )
    walker = _Walker(module, branch)
    (ins,) = loops
    body, condition = _Count(), _Count()
    for name in ins.calls("body"):
        body = body + walker.computation(name)
    for name in ins.calls("condition"):
        condition = condition + walker.computation(name)
    doubts = body.doubts + condition.doubts
    if condition.marked:
        doubts += ("a marked conditional sits in the loop condition",)
    return LoopReductions(body.outside, body.marked, condition.outside, doubts)


# ---------------------------------------------------------------------------------
# The same question of a traced program (a jaxpr): what a function will reduce


# The primitives that combine values of several processes, by name. mpi4jax's and
# this package's carry their communicator (``comm``) and a ``transpose`` flag (a
# transposed allreduce is the identity); JAX's name mesh axes (``axes``).
MPI_REDUCTION_PRIMITIVES = frozenset(
    {
        "allreduce_mpi",
        "reduce_mpi",
        "scan_mpi",
        "mpi4jax_dist_allreduce",
        "mpi4jax_dist_iallreduce_start",
    }
)
AXIS_REDUCTION_PRIMITIVES = frozenset(
    f"{name}{suffix}"
    for name in ("psum", "psum_invariant", "pmax", "pmin", "reduce_scatter")
    + ("unreduced_psum", "unreduced_reduce_scatter")
    for suffix in ("", "_start")
)


def _is_jaxpr(value) -> bool:
    return hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns")


def _eqns(jaxpr):
    return jaxpr.eqns if hasattr(jaxpr, "eqns") else jaxpr.jaxpr.eqns


def _comm_size(comm) -> int:
    """The size of a primitive's ``comm`` parameter: an mpi4py communicator, or
    wrapped in mpi4jax's ``HashableMPIType`` (``wrapped``) or this package's
    ``_Comm`` (``comm``); None is mpi4jax's default, a clone of COMM_WORLD."""
    comm = getattr(comm, "wrapped", getattr(comm, "comm", comm))
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm.Get_size()


def jaxpr_reductions(
    jaxpr, axis_sizes=None, *, only_communicating: bool = True
) -> tuple[int, tuple]:
    """Return ``(count, doubts)``: the reductions one run of ``jaxpr`` makes, and
    why the count may be wrong (empty: exact).

    For code traced inside a caller's ``jit`` (:func:`mpi4jax_dist.cg.cg`), where
    compiling it apart to read the optimized HLO would double the caller's compile
    time. A reduction is a primitive of :data:`MPI_REDUCTION_PRIMITIVES` (not
    transposed) or of :data:`AXIS_REDUCTION_PRIMITIVES` over named mesh axes; with
    ``only_communicating`` only one over a communicator of more than one process,
    or over axes of more than one device (sizes from ``axis_sizes`` and from the
    ``shard_map`` it sits in; an axis of unknown size counts). The walk enters
    every sub-program a primitive runs once (``jit``, custom derivatives,
    ``shard_map``), the solve of a ``custom_linear_solve``, a ``scan``'s body times
    its length, and a ``cond`` whose branches reduce alike. A ``while`` or a
    ``cond`` whose branches differ that reduces puts the count in doubt. XLA never
    drops an MPI reduction (they have side effects); it may combine JAX's
    all-reduces, which this count does not see.
    """
    count = _JaxprWalk(only_communicating, None).run(jaxpr, axis_sizes)
    return count.outside, count.doubts


def jaxpr_loop_reductions(
    jaxpr, loop: str, branch: str | None = None, *, only_communicating: bool = False
) -> LoopReductions:
    """Count the reductions of one loop of a traced program, as
    :func:`loop_reductions` does in compiled HLO: the ``while`` traced under
    ``jax.named_scope(loop)`` (outside other loops), and in its body a ``cond``
    traced under ``jax.named_scope(branch)`` counted apart per run of its reducing
    branch. What is counted is :func:`jaxpr_reductions`'s.

    Raises:
        LookupError: no such loop, or more than one.
    """
    walk = _JaxprWalk(only_communicating, branch)
    loops = walk.loops(jaxpr, loop)
    if len(loops) != 1:
        raise LookupError(
            f"expected one top-level while loop marked {loop!r} in the traced "
            f"program, found {len(loops)}."
        )
    (eqn,) = loops
    body = walk.run(eqn.params["body_jaxpr"], None)
    condition = walk.run(eqn.params["cond_jaxpr"], None)
    doubts = body.doubts + condition.doubts
    if condition.marked:
        doubts += ("a marked conditional sits in the loop condition",)
    return LoopReductions(body.outside, body.marked, condition.outside, doubts)


@dataclass
class _JaxprCount:
    outside: int = 0
    marked: int = 0
    doubts: tuple = ()

    def add(self, other, times=1):
        self.outside += other.outside * times
        self.marked += other.marked * times
        self.doubts += other.doubts


class _JaxprWalk:
    """The walk of :func:`jaxpr_reductions` and :func:`jaxpr_loop_reductions`."""

    def __init__(self, only_communicating, branch):
        self.only_communicating, self.branch = only_communicating, branch

    def loops(self, jaxpr, scope):
        """The ``while`` equations traced under ``scope``, outside other loops."""
        found = []
        for eqn in _eqns(jaxpr):
            if eqn.primitive.name == "while":
                if scope in str(eqn.source_info.name_stack).split("/"):
                    found.append(eqn)
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if _is_jaxpr(sub):
                        found += self.loops(sub, scope)
        return found

    def _communicates(self, size):
        return size > 1 or not self.only_communicating

    def run(self, jaxpr, axis_sizes) -> _JaxprCount:
        axis_sizes = dict(axis_sizes or {})
        count = _JaxprCount()
        for eqn in _eqns(jaxpr):
            name, params = eqn.primitive.name, eqn.params
            if name in MPI_REDUCTION_PRIMITIVES:
                if not params.get("transpose", False):
                    count.outside += self._communicates(_comm_size(params.get("comm")))
            elif name in AXIS_REDUCTION_PRIMITIVES:
                axes = params.get("axes", params.get("axis_name", ()))
                axes = axes if isinstance(axes, (tuple, list)) else (axes,)
                named = [a for a in axes if not isinstance(a, int)]
                size = math.prod(axis_sizes.get(a, 2) for a in named)
                count.outside += bool(named) and self._communicates(size)
            elif name == "while":
                for key in ("cond_jaxpr", "body_jaxpr"):
                    inner = self.run(params[key], axis_sizes)
                    if inner.outside or inner.marked:
                        count.doubts += ("a while loop inside reduces",)
                    count.doubts += inner.doubts
            elif name == "cond":
                inner = [self.run(b, axis_sizes) for b in params["branches"]]
                sizes = sorted(c.outside + c.marked for c in inner)
                marked = self.branch is not None and self.branch in str(
                    eqn.source_info.name_stack
                ).split("/")
                if marked and len([c for c in sizes if c]) > 1:
                    count.doubts += ("more than one branch of a marked cond reduces",)
                elif not marked and len(set(sizes)) > 1:
                    count.doubts += ("a conditional's branches reduce differently",)
                if marked:
                    count.marked += sizes[-1]
                else:
                    count.outside += sizes[-1]
                count.doubts += sum((c.doubts for c in inner), ())
            elif name == "scan":
                count.add(self.run(params["jaxpr"], axis_sizes), params["length"])
            elif name == "linear_solve":
                count.add(self.run(params["jaxprs"].solve, axis_sizes))
            else:
                inner_sizes = axis_sizes
                mesh = params.get("mesh")
                if mesh is not None and hasattr(mesh, "shape"):
                    inner_sizes = {**axis_sizes, **dict(mesh.shape)}
                for value in params.values():
                    if _is_jaxpr(value):
                        count.add(self.run(value, inner_sizes))
        return count
