"""Count the cross-process reductions of a loop in XLA's optimized HLO text.

``jax.jit(f).lower(*args).compile().as_text()`` prints the program that runs, after
XLA's passes: a count read there is what ran (a reduction a user's ``matvec`` adds
is seen, one XLA drops is not). The rules of :func:`loop_reductions`:

* **The loop**: the ``while`` whose ``op_name`` ends in ``<loop>/while`` (a
  ``jax.named_scope(loop)`` around it), else the only ``while`` outside other
  loops (as in ``jax.scipy.sparse.linalg.cg``); none or several: ``LookupError``.
* **A reduction**: ``all-reduce``, ``all-reduce-start``, ``reduce-scatter``,
  mpi4jax's allreduce, reduce and scan custom calls, :func:`mpi4jax_dist.allreduce`
  and the start of :func:`mpi4jax_dist.iallreduce` (second halves are the same
  reduction). Collectives that only move data are not. An all-reduce XLA combined
  from several counts once.
* **The walk**: the loop's body and condition and all they call (fusions, calls,
  custom calls' computations, ``async-start``), once per execution of the caller.
* **A conditional marked** ``<branch>/cond`` counts apart, in
  :attr:`LoopReductions.branch`, per run of its one reducing branch; any other
  conditional counts once where its branches reduce alike, else the count is in
  doubt. **A nested loop** counts its body times XLA's ``known_trip_count`` (its
  condition once more); without one, a reducing nested loop puts it in doubt.

A count in doubt is reported with its reasons (:attr:`LoopReductions.doubts`), not
guessed: the caller decides (``mpi4jax_dist.cg`` reports -1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mpi4jax_dist.solvers.counting import LoopReductions

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
    """Return the :class:`Module` of HLO text (``Compiled.as_text()``);
    ``ValueError`` where it holds no entry computation."""
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
