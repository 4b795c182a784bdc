"""How a solve is compiled and reduces: checks of the options, the two backends
(``mpi4jax``: per-rank arrays in ``jit``; ``psum``: global arrays in
``jit(shard_map)``), and :class:`Program`, which counts the reductions of the
solve's own loop in its traced program."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from .. import _compat
from ..ops import common
from . import counting
from .core import LOOP_SCOPE, REPLACE_SCOPE, VARIANTS

logger = logging.getLogger("mpi4jax_dist")

BACKENDS = ("mpi4jax", "psum")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(
            f"{name}={value!r} is not one of {', '.join(map(repr, choices))}."
        )


def check_options(backend, variant, replace_every, backends=BACKENDS):
    check_choice("backend", backend, backends)
    check_choice("variant", variant, VARIANTS)
    if not isinstance(replace_every, (int, np.integer)) or replace_every < 0:
        raise ValueError(
            f"replace_every={replace_every!r}: expected an int >= 0 (0: no residual "
            f"replacement)."
        )
    if backend == "mpi4jax":
        _compat.require_mpi4jax(
            'mpi4jax_dist.cg\'s backend="mpi4jax"',
            'backend="psum" runs without it.',
        )
        # Its reductions run on XLA's worker threads, as the allreduce's do.
        from mpi4py import MPI  # noqa: F401  (initializes MPI, as mpi4jax does)

        common.check_mpi('mpi4jax_dist.cg\'s backend="mpi4jax"')


def check_tol_maxiter(tol, maxiter, atol=0.0):
    if isinstance(tol, (int, float)) and not tol >= 0:
        raise ValueError(f"tol={tol!r}: expected a relative residual >= 0.")
    if isinstance(atol, (int, float)) and not atol >= 0:
        raise ValueError(f"atol={atol!r}: expected an absolute residual >= 0.")
    if isinstance(maxiter, (int, np.integer)) and maxiter < 0:
        raise ValueError(f"maxiter={maxiter!r}: expected an int >= 0.")


def mpi4jax_sum(comm):
    """Return the mpi4jax reduction: sum over the ranks of ``comm``, inside jit."""
    import mpi4jax
    from mpi4py import MPI

    def allreduce(x):
        return mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)

    return allreduce


def mpi4jax_overlap(comm):
    """Return the non-blocking mpi4jax-backend reduction: ``overlap(stacked, fn,
    *args) -> (summed, fn(*args))``, the sum over the ranks of ``comm`` in flight
    (``MPI_Iallreduce``) while ``fn`` runs, inside jit."""
    from mpi4py import MPI

    from ..ops import iallreduce

    def overlap(stacked, fn, *args):
        req = iallreduce.iallreduce(stacked, MPI.SUM, comm=comm)
        req, out = req.overlap(fn, *args)
        return req.wait(), out

    return overlap


def comm_size(comm):
    from mpi4py import MPI

    return (MPI.COMM_WORLD if comm is None else comm).Get_size()


def mesh_axis(mesh):
    """Return ``(mesh, axis_name)``, the mesh defaulting to the global one."""
    if mesh is None:
        from ..interop import global_mesh

        mesh = global_mesh()
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"mesh has axes {mesh.axis_names}; the psum backend needs a 1-D mesh "
            f"such as mpi4jax_dist.global_mesh()."
        )
    return mesh, mesh.axis_names[0]


def check_rows(name, array, mesh):
    size = mesh.devices.size
    if np.ndim(array) == 0 or np.shape(array)[0] % size:
        raise ValueError(
            f"{name} has shape {np.shape(array)}: the psum backend shards axis 0 "
            f"over the {size} devices of the mesh, so it must be a multiple of {size}."
        )


def check_like(name, array, like, like_name):
    if array is not None and np.shape(array) != np.shape(like):
        raise ValueError(
            f"{name} has shape {np.shape(array)} but {like_name} has shape "
            f"{np.shape(like)}; they must match."
        )


class ById:
    """Hashable by identity, for caching on objects such as communicators."""

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, ById) and other.obj is self.obj


def compile_solve(fn, backend, comm, mesh, in_layouts, out_layouts):
    """Return ``(program, mesh)``: ``fn(*args, counted, total, overlap)`` as a
    :class:`Program`.

    ``total(x)`` sums ``x`` over ranks: ``mpi4jax.allreduce`` in a ``jit`` of per-rank
    arrays, or ``lax.psum`` in a ``jit(shard_map)`` of global arrays whose layouts
    are ``"rows"`` (split along axis 0 over the mesh) or ``"same"`` (replicated).
    ``overlap`` is the non-blocking form of ``total``
    (:attr:`~mpi4jax_dist.solvers.core.Ops.overlap`), or None where the backend
    has none (psum). ``counted`` is the triple of loop reduction
    counts that :class:`Program` appends to every call's arguments.
    """
    counts = len(COUNT_FIELDS)

    def split(*args):
        return args[:-counts], args[-counts:]

    if backend == "mpi4jax":
        total, overlap = mpi4jax_sum(comm), mpi4jax_overlap(comm)

        def local(*args):
            args, counted = split(*args)
            return fn(*args, counted, total, overlap)

        return Program(jax.jit(local)), None
    mesh, axis = mesh_axis(mesh)
    specs = {"rows": PartitionSpec(axis), "same": PartitionSpec()}

    def sharded(*args):
        args, counted = split(*args)
        return fn(*args, counted, lambda x: lax.psum(x, axis), None)

    sharded = _compat.shard_map(
        sharded,
        mesh=mesh,
        in_specs=tuple(specs[layout] for layout in in_layouts)
        + (PartitionSpec(),) * counts,
        out_specs=tuple(specs[layout] for layout in out_layouts),
        check=False,  # the loop carries psum results: see _compat.shard_map
    )
    return Program(jax.jit(sharded)), mesh


COUNT_FIELDS = ("body", "branch", "condition")


def _is_traced(leaf):
    return isinstance(leaf, jax.core.Tracer)


def _leaf_signature(leaf):
    if isinstance(leaf, (bool, int, float, complex)):
        return type(leaf)  # weakly typed: one executable for every value
    # A tracer (a solve inside the caller's jit) has no sharding to ask for.
    traced = _is_traced(leaf)
    sharding = None if traced else getattr(leaf, "sharding", None)
    return np.shape(leaf), jnp.result_type(leaf), sharding


class Program:
    """A jitted solve that reports the reductions its own loop makes.

    The first call with each input signature traces the solve
    (``jax.make_jaxpr``), counts the reductions of its CG loop in the traced
    program (:func:`mpi4jax_dist.solvers.counting.loop_reductions`: the user's
    matvec's included) and keeps the counts; every call passes them as run-time
    int32 arguments, so that ``info.reductions`` is computed in the same program.
    Nothing compiles twice: the call compiles once, as any ``jit`` does. XLA never
    drops or combines an MPI reduction; it may combine independent ``psum`` calls,
    which the benchmarks count in the compiled program.
    """

    def __init__(self, jitted):
        self._jitted, self._counts = jitted, {}

    def _signature(self, args):
        leaves, tree = jax.tree.flatten(args)
        return tree, jax.config.jax_enable_x64, tuple(map(_leaf_signature, leaves))

    def loop_reductions(self, *args) -> counting.LoopReductions | None:
        """Return the reductions of the CG loop traced for ``args`` (None when the
        loop cannot be found), tracing it if needed."""
        key = self._signature(args)
        if key not in self._counts:
            zeros = (0,) * len(COUNT_FIELDS)
            try:
                traced = jax.make_jaxpr(self._jitted)(*args, *zeros)
                found = counting.loop_reductions(traced, LOOP_SCOPE, REPLACE_SCOPE)
            except LookupError as exc:
                logger.warning(
                    "mpi4jax_dist.cg: info.reductions is -1: the CG loop was not "
                    "found in the traced program (%s)",
                    exc,
                )
                found = None
            if found is not None and not found.exact:
                logger.warning(
                    "mpi4jax_dist.cg: info.reductions is -1: how many reductions "
                    "an iteration makes depends on the data: %s",
                    "; ".join(found.doubts),
                )
            self._counts[key] = found
        return self._counts[key]

    def __call__(self, *args):
        found = self.loop_reductions(*args)
        if found is None or not found.exact:
            counted = (-1, 0, 0)
        else:
            counted = (found.body, found.branch, found.condition)
        return self._jitted(*args, *counted)
