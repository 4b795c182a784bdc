"""Count the cross-process reductions of a solve's loop in its traced program (a
jaxpr), for ``CGInfo.reductions``: what the program will reduce, the user's matvec
included, without compiling it apart.

A reduction is a primitive of :data:`MPI_REDUCTION_PRIMITIVES` (mpi4jax's and this
package's; a transposed allreduce is the identity) or of
:data:`AXIS_REDUCTION_PRIMITIVES` over named mesh axes. The walk enters every
sub-program a primitive runs once (``jit``, custom derivatives, ``shard_map``), the
solve of a ``custom_linear_solve``, a ``scan``'s body times its length, and a
``cond`` whose branches reduce alike; a ``while`` that reduces, or a ``cond`` whose
branches differ, puts the count in doubt (reported, never guessed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    ``Comm`` (``comm``); None is mpi4jax's default, a clone of COMM_WORLD."""
    comm = getattr(comm, "wrapped", getattr(comm, "comm", comm))
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm.Get_size()


def reductions(
    jaxpr, axis_sizes=None, *, only_communicating: bool = True
) -> tuple[int, tuple]:
    """Return ``(count, doubts)``: the reductions one run of ``jaxpr`` makes, and
    why the count may be wrong (empty: exact).

    A reduction is a primitive of :data:`MPI_REDUCTION_PRIMITIVES` (not
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


def loop_reductions(
    jaxpr, loop: str, branch: str | None = None, *, only_communicating: bool = False
) -> LoopReductions:
    """Count the reductions of one loop of a traced program: the ``while`` traced under
    ``jax.named_scope(loop)`` (outside other loops), and in its body a ``cond``
    traced under ``jax.named_scope(branch)`` counted apart per run of its reducing
    branch. What is counted is :func:`reductions`'s.

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
    """The walk of :func:`reductions` and :func:`loop_reductions`."""

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
