"""The drop-in for ``jax.scipy.sparse.linalg.cg``: :func:`cg`, over the variants,
its vectors the caller's (replicated, or split with ``comm=``/``mesh=``)."""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from .. import _compat
from . import core, counting
from .backends import (
    check_choice,
    check_options,
    check_rows,
    check_tol_maxiter,
    comm_size,
    mesh_axis,
    mpi4jax_overlap,
    mpi4jax_sum,
)
from .core import DEFAULT_REPLACE_EVERY, VARIANT_RECORDS

logger = logging.getLogger("mpi4jax_dist")

#: Where :func:`cg`'s vectors live, and so how it sums its dot products.
DROP_IN_BACKENDS = ("local", "mpi4jax", "psum")
# What comm= and mesh= say about the drop-in's vectors (for its messages).
_SPLIT_BY = {
    "comm": "row blocks over the communicator's ranks",
    "mesh": "global arrays sharded over the mesh",
}


def _operator(name, op):
    """Return the linear operator ``op`` as a function, as jax.scipy's cg takes it:
    a function, a square 2-D array, or an object with ``@`` and a square shape."""
    if callable(op):
        return op
    shape = getattr(op, "shape", None)
    if shape is None or not hasattr(op, "__matmul__"):
        raise TypeError(
            f"{name}={op!r} is not a linear operator: pass a function "
            f"v -> {name} v, or a square 2-D array."
        )
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(
            f"{name} has shape {tuple(shape)}: a linear operator given as an array "
            f"must be a square matrix, or pass a function v -> {name} v."
        )
    if isinstance(op, (np.ndarray, jax.Array)):
        return functools.partial(jnp.dot, op, precision=lax.Precision.HIGHEST)
    return functools.partial(operator.matmul, op)


def _drop_in_backend(backend, comm, mesh):
    """Return the backend: as given, or ``"mpi4jax"`` with ``comm``, ``"psum"`` with
    ``mesh``, else ``"local"``; refuse a ``comm`` or ``mesh`` it would not use."""
    if backend is None:
        if comm is not None and mesh is not None:
            raise ValueError(
                "comm= (vectors split over MPI ranks, backend 'mpi4jax') and mesh= "
                "(global arrays sharded over a mesh, backend 'psum') exclude each "
                "other: pass one."
            )
        backend = (
            "mpi4jax" if comm is not None else "psum" if mesh is not None else None
        )
        backend = backend or "local"
    check_choice("backend", backend, DROP_IN_BACKENDS)
    for name, value, owner in (("comm", comm, "mpi4jax"), ("mesh", mesh, "psum")):
        if value is not None and backend != owner:
            raise ValueError(
                f"{name}= is for backend={owner!r}, not {backend!r}: {name}= says "
                f"how the vectors are split ({_SPLIT_BY[name]}), which "
                f"backend={backend!r} does not take; drop {name}= or pass "
                f"backend={owner!r}."
            )
    return backend


def _check_x0(x0, b):
    if x0 is None:
        return
    if jax.tree.structure(x0) != jax.tree.structure(b):
        raise ValueError(
            f"x0 and b must have the same tree structure: x0 is "
            f"{jax.tree.structure(x0)}, b is {jax.tree.structure(b)}."
        )
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(x0)]
    if shapes != [np.shape(leaf) for leaf in jax.tree.leaves(b)]:
        raise ValueError(
            f"x0's arrays have shapes {shapes} but b's "
            f"{[np.shape(leaf) for leaf in jax.tree.leaves(b)]}; they must match."
        )


class _DropIn(NamedTuple):
    """What :func:`cg`'s solve needs besides the operator and the right-hand side."""

    variant: str
    replace_every: int
    tol: float
    atol: float
    maxiter: int
    M: Callable | None
    x0: object  # a pytree like b, or None
    reduce: Callable | None  # sums over ranks; None: the dot products are local
    overlap: Callable | None
    axis_sizes: dict | None  # the mesh's axes, for counting psums in A and M


def _traced_reductions(fn, like, axis_sizes):
    """Return ``(count, doubts)`` of ``fn(like)``'s traced program."""
    spec = jax.ShapeDtypeStruct(np.shape(like), jnp.result_type(like))
    return counting.reductions(jax.make_jaxpr(fn)(spec), axis_sizes)


def _drop_in_counted(setup, mv, precond, flat_b):
    """Return ``(body, branch, condition)``: the reductions that communicate per
    iteration, per residual replacement and per loop test, read from the traced
    programs of ``A`` and ``M`` and of the dot products' reduction.

    No separate compile (inside the caller's ``jit`` that would double the
    caller's compile time): an MPI reduction is never dropped by XLA, and a
    reduction over one process (``COMM_SELF``, a mesh axis of one device) is not
    counted. An iteration applies ``A`` and ``M`` once each and reduces its dot
    products ``reductions_by_design`` times; a residual replacement applies ``A``
    four times and ``M`` twice, and reduces no dot product.
    """
    a, doubts = _traced_reductions(mv, flat_b, setup.axis_sizes)
    m, more = (0, ())
    if precond is not None:
        m, more = _traced_reductions(precond, flat_b, setup.axis_sizes)
    dots = 0
    if setup.reduce is not None:
        dots, _ = _traced_reductions(setup.reduce, jnp.zeros(3, flat_b.dtype), None)
        dots *= VARIANT_RECORDS[setup.variant].reductions_by_design
    if doubts or more:
        logger.warning(
            "mpi4jax_dist.cg: info.reductions is -1: how many reductions A or M "
            "makes depends on the data: %s",
            "; ".join(doubts + more),
        )
        return (-1, 0, 0)
    return (a + m + dots, 4 * a + 2 * m, 0)


def _drop_in_solve(setup, matvec, b):
    """``custom_linear_solve``'s solve: CG on ``b`` flattened into one vector."""
    flat_b, unravel = jax.flatten_util.ravel_pytree(b)

    def flat(fn):
        return lambda v: jax.flatten_util.ravel_pytree(fn(unravel(v)))[0]

    mv = flat(matvec)
    precond = None if setup.M is None else flat(setup.M)
    x0 = None
    if setup.x0 is not None:
        x0 = jax.flatten_util.ravel_pytree(setup.x0)[0]
    ops = core.Ops(mv, None, setup.reduce, setup.overlap, precond_fn=precond)
    counted = _drop_in_counted(setup, mv, precond, flat_b)
    x, info = core.run(
        ops,
        setup.variant,
        setup.replace_every,
        flat_b,
        x0,
        setup.tol,
        setup.maxiter,
        counted,
        atol=setup.atol,
    )
    return unravel(x), info


def _linear_solve(A, b, setup, symmetric):
    solve = functools.partial(_drop_in_solve, setup)
    return lax.custom_linear_solve(
        A, b, solve=solve, transpose_solve=solve, symmetric=symmetric, has_aux=True
    )


def cg(
    A,
    b,
    x0=None,
    *,
    tol: float = 1e-5,
    atol: float = 0.0,
    maxiter: int | None = None,
    M=None,
    variant: str = "classic",
    backend: str | None = None,
    comm=None,
    mesh=None,
    replace_every: int = DEFAULT_REPLACE_EVERY,
):
    """Solve ``A x = b`` by CG: ``jax.scipy.sparse.linalg.cg``'s call, and ``info``.

    A drop-in: ``mpi4jax_dist.cg(A, b, x0=x0, tol=1e-5, atol=0.0, maxiter=200)``
    (the module is callable) takes what ``jax.scipy.sparse.linalg.cg`` takes and
    means the same: ``A`` and ``M`` functions (or square matrices), ``b`` and ``x0``
    pytrees, stop once ``||b - A x|| <= max(tol ||b||, atol)`` by the recurrence or
    after ``maxiter`` iterations (default ``10 x`` the length of ``b``), jittable,
    and differentiable the same way (``lax.custom_linear_solve``: the derivative
    is another solve). Where JAX returns ``None`` it returns a :class:`CGInfo`.

    Its vectors are the caller's, as in JAX's. By default (``backend="local"``)
    they are whole on every rank, replicated or on one process, and the dot
    products are local: the solver adds no reduction of its own, and an ``A``
    that sums over ranks (``mpi4jax.allreduce`` of ``J_r^T (J_r v)`` in a
    stochastic-reconfiguration solve) makes the one reduction per iteration.
    ``comm=`` says the vectors are this rank's blocks of vectors split over the
    ranks of ``comm``; the dot products are then summed over it with mpi4jax
    (``backend="mpi4jax"``). ``mesh=`` says ``b`` and ``x0`` are global arrays
    sharded along axis 0 over that 1-D mesh, and ``A`` and ``M`` run inside
    ``shard_map`` on the blocks (``backend="psum"``).

    ``info.reductions`` counts the reductions that communicate (over more than one
    process) in the iterations made: those of ``A`` and ``M``, read from their
    traced programs, and the dot products' with ``comm``/``mesh``; it costs no
    compile of its own (:func:`_drop_in_counted`).

    Args:
        A: ``v -> A v`` on a pytree like ``b``, Hermitian positive definite, or a
            square matrix.
        b: the right-hand side: an array or a pytree of arrays.
        x0: initial guess like ``b`` (default zero).
        tol: relative tolerance on the residual's norm.
        atol: absolute tolerance on the residual's norm.
        maxiter: most iterations (default ``10 *`` the length of ``b``: per rank
            times the ranks of ``comm`` with ``backend="mpi4jax"``).
        M: preconditioner, ``v -> M v`` approximating ``A^-1`` (or a matrix).
        variant: ``"classic"`` (JAX's recurrences; iterates equal to JAX's cg),
            ``"single"``, ``"pipelined"`` or ``"pipelined_nb"`` (:mod:`mpi4jax_dist.cg`;
            with local dot products they differ in how the vector updates fuse,
            not in reductions).
        backend: ``"local"``, ``"mpi4jax"`` or ``"psum"``; default from ``comm``
            and ``mesh``.
        comm: mpi4py communicator over which the vectors are split (default
            ``COMM_WORLD`` when ``backend="mpi4jax"``).
        mesh: 1-D mesh over which ``b`` is sharded (default
            :func:`mpi4jax_dist.global_mesh` when ``backend="psum"``).
        replace_every: residual replacement period of the pipelined variants.

    Returns:
        ``(x, info)``: ``x`` like ``b``, and a :class:`CGInfo`.

    Raises:
        ValueError: unknown ``variant``/``backend``, negative
            ``tol``/``atol``/``maxiter``/``replace_every``, ``comm`` or ``mesh``
            with a backend that does not use it, ``b`` or ``x0`` unlike ``b``, a
            non-square matrix, or (psum) a mesh that is not 1-D or rows that do
            not split over it.
        TypeError: ``A`` or ``M`` is neither a function nor a matrix.
        ImportError: ``backend="mpi4jax"`` without mpi4jax (names the extra).

    Messages:
        .. code-block:: text

            ValueError: <backend | variant>=<value> is not one of <choices>.

            ValueError: replace_every=<value>: expected an int >= 0 (0: no
            residual replacement).

            ValueError: tol=<value>: expected a relative residual >= 0.

            ValueError: atol=<value>: expected an absolute residual >= 0.

            ValueError: maxiter=<value>: expected an int >= 0.

            ValueError: comm= (vectors split over MPI ranks, backend
            'mpi4jax') and mesh= (global arrays sharded over a mesh, backend
            'psum') exclude each other: pass one.

            ValueError: <comm or mesh>= is for backend=<backend>, not
            <backend>: <comm or mesh>= says how the vectors are split (<row
            blocks over the communicator's ranks, or global arrays sharded
            over the mesh>), which backend=<backend> does not take; drop
            <comm or mesh>= or pass backend=<backend>.

            ValueError: b=<value> holds no array: expected an array or a
            pytree.

            ValueError: x0 and b must have the same tree structure: x0 is
            <tree>, b is <tree>.

            ValueError: <x0's arrays have shapes S but b's S | x0 has shape
            S but b has shape S>; they must match.

            ValueError: A has shape <shape>: a linear operator given as an
            array must be a square matrix, or pass a function v -> A v.

            ValueError: mesh has axes <axes>; the psum backend needs a 1-D
            mesh such as mpi4jax_dist.global_mesh().

            ValueError: b has shape <shape>: the psum backend shards axis 0
            over the <n> devices of the mesh, so it must be a multiple of
            <n>.

            TypeError: A=<value> is not a linear operator: pass a function v
            -> A v, or a square 2-D array.
    """
    backend = _drop_in_backend(backend, comm, mesh)
    check_options(backend, variant, replace_every, DROP_IN_BACKENDS)
    check_tol_maxiter(tol, maxiter, atol)
    A = _operator("A", A)
    M = None if M is None else _operator("M", M)
    leaves = jax.tree.leaves(b)
    if not leaves:
        raise ValueError(f"b={b!r} holds no array: expected an array or a pytree.")
    _check_x0(x0, b)
    symmetric = not any(jnp.iscomplexobj(leaf) for leaf in leaves)
    record = VARIANT_RECORDS[variant]
    replace_every = replace_every if record.replaces else 0
    if backend == "mpi4jax" and comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    if maxiter is None:
        ranks = comm_size(comm) if backend == "mpi4jax" else 1
        maxiter = 10 * ranks * sum(int(np.size(leaf)) for leaf in leaves)
    setup = _DropIn(variant, replace_every, tol, atol, maxiter, M, x0, None, None, None)
    if backend == "mpi4jax" and comm.Get_size() > 1:
        overlap = mpi4jax_overlap(comm) if record.nonblocking else None
        setup = setup._replace(reduce=mpi4jax_sum(comm), overlap=overlap)
    if backend != "psum":
        return _linear_solve(A, b, setup, symmetric)

    mesh, axis = mesh_axis(mesh)
    for leaf in leaves:
        check_rows("b", leaf, mesh)
    rows = PartitionSpec(axis)
    reduce = (lambda x: lax.psum(x, axis)) if mesh.devices.size > 1 else None

    def sharded(b, x0):
        inner = setup._replace(x0=x0, reduce=reduce, axis_sizes=dict(mesh.shape))
        return _linear_solve(A, b, inner, symmetric)

    sharded = _compat.shard_map(
        sharded,
        mesh=mesh,
        in_specs=(rows, rows),
        out_specs=(rows, PartitionSpec()),
        check=False,  # the loop carries psum results: see _compat.shard_map
    )
    return jax.jit(sharded)(b, x0)
