"""Distributed CG on vectors split over ranks: :func:`make_solver` and
:func:`solve`, over either backend and every variant."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable

import numpy as np

from . import core
from .backends import (
    ById,
    check_like,
    check_options,
    check_rows,
    check_tol_maxiter,
    comm_size,
    compile_solve,
)
from .core import DEFAULT_REPLACE_EVERY, VARIANT_RECORDS

logger = logging.getLogger("mpi4jax_dist")


class Solver:
    """A compiled distributed CG for one matvec; see :func:`make_solver`."""

    def __init__(self, matvec, backend, variant, comm, mesh, replace_every):
        self.backend, self.variant, self.comm = backend, variant, comm
        record = VARIANT_RECORDS[variant]
        self.replace_every = replace_every if record.replaces else 0

        def local(b, x0, diag, tol, maxiter, counted, total, overlap):
            overlap = overlap if record.nonblocking else None
            ops = core.Ops(matvec, core.inverse(diag), total, overlap)
            return core.run(
                ops, variant, self.replace_every, b, x0, tol, maxiter, counted
            )

        self._solve, self.mesh = compile_solve(
            local,
            backend,
            comm,
            mesh,
            in_layouts=("rows", "rows", "rows", "same", "same"),
            out_layouts=("rows", "same"),
        )

    def __call__(self, b, x0=None, diag=None, *, tol=1e-8, maxiter=None):
        """Solve ``A x = b``; see :func:`solve` for the arguments."""
        check_tol_maxiter(tol, maxiter)
        check_like("x0", x0, b, "b")
        check_like("diag", diag, b, "b")
        if self.backend == "psum":
            check_rows("b", b, self.mesh)
            n = int(np.size(b))
        else:
            n = int(np.size(b)) * comm_size(self.comm)
        if maxiter is None:
            maxiter = 10 * n
        return self._solve(b, x0, diag, tol, maxiter)


def make_solver(
    matvec: Callable,
    *,
    backend: str = "mpi4jax",
    variant: str = "classic",
    comm=None,
    mesh=None,
    replace_every: int = DEFAULT_REPLACE_EVERY,
    matvec_reductions: int | None = None,
) -> Solver:
    """Return a compiled CG for the SPD operator ``matvec``, to call many times.

    Building is cheap; the first call of each input shape compiles, and reads the
    reductions of the compiled loop (the matvec's included) for ``info.reductions``.
    :func:`solve` keeps solvers in a small cache keyed on the same arguments.

    Args:
        matvec: ``v_local -> (A v)_local`` on this rank's block (mpi4jax) or, inside
            ``shard_map``, on this device's block (psum). Traced once; it may
            communicate (``mpi4jax.sendrecv`` / ``lax.ppermute`` halo exchanges).
        backend: ``"mpi4jax"`` (per-rank arrays) or ``"psum"`` (global arrays
            sharded along axis 0 over ``mesh``).
        variant: ``"classic"``, ``"single"``, ``"pipelined"`` or ``"pipelined_nb"``
            (:mod:`mpi4jax_dist.cg`).
        comm: mpi4py communicator of the mpi4jax backend (default mpi4jax's, a
            clone of ``COMM_WORLD``).
        mesh: 1-D mesh of the psum backend (default
            :func:`mpi4jax_dist.global_mesh`); ``matvec`` sees its axis name.
        replace_every: residual replacement period of ``pipelined`` and
            ``pipelined_nb`` (0: none; see :mod:`mpi4jax_dist.cg` for the stability
            limit without it).
        matvec_reductions: deprecated and ignored: the reductions a ``matvec``
            makes are counted in the compiled loop.

    Returns:
        A :class:`Solver`: ``solver(b, x0=None, diag=None, *, tol, maxiter)``
        returns ``(x, info)`` as :func:`solve` does.

    Raises:
        ValueError: unknown ``backend`` or ``variant``, negative
            ``replace_every``, or a mesh that is not 1-D (the messages of
            :func:`cg`).
        TypeError: ``matvec`` is not callable.
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the
            message names the ``mpi4jax`` extra).

    Warns:
        DeprecationWarning: ``matvec_reductions`` is passed.

    Messages:
        .. code-block:: text

            TypeError: matvec=<value> is not callable.

            DeprecationWarning: matvec_reductions=<value> is deprecated and
            ignored: info.reductions counts the reductions in the compiled
            loop, the matvec's included. Drop the argument.
    """
    check_options(backend, variant, replace_every)
    _deprecate_matvec_reductions(matvec_reductions)
    if not callable(matvec):
        raise TypeError(f"matvec={matvec!r} is not callable.")
    logger.debug("mpi4jax_dist.cg: building a %s/%s solver", backend, variant)
    return Solver(matvec, backend, variant, comm, mesh, replace_every)


def _deprecate_matvec_reductions(matvec_reductions):
    # Kept one release so that callers who declared their matvec's reductions keep
    # working: the count they declared is now read from the compiled loop.
    if matvec_reductions is not None:
        warnings.warn(
            f"matvec_reductions={matvec_reductions!r} is deprecated and ignored: "
            f"info.reductions counts the reductions in the compiled loop, the "
            f"matvec's included. Drop the argument.",
            DeprecationWarning,
            stacklevel=3,
        )


@functools.lru_cache(maxsize=32)
def _cached_solver(matvec, backend, variant, comm, mesh, replace_every):
    return make_solver(
        matvec,
        backend=backend,
        variant=variant,
        comm=comm.obj,
        mesh=mesh,
        replace_every=replace_every,
    )


def solve(
    matvec: Callable,
    b,
    *,
    backend: str = "mpi4jax",
    variant: str = "classic",
    x0=None,
    diag=None,
    tol: float = 1e-8,
    maxiter: int | None = None,
    comm=None,
    mesh=None,
    replace_every: int = DEFAULT_REPLACE_EVERY,
    matvec_reductions: int | None = None,
):
    """Solve the distributed SPD system ``A x = b`` by (Jacobi-preconditioned) CG.

    Args:
        matvec: the local matvec; see :func:`make_solver`. Pass the same function
            object each call, or a new one compiles each time.
        b: the right-hand side: this rank's block (mpi4jax backend) or a global
            ``jax.Array`` sharded along axis 0 over the mesh (psum backend; build it
            with :func:`mpi4jax_dist.to_global`). Real floating point.
        backend: ``"mpi4jax"`` or ``"psum"``.
        variant: ``"classic"``, ``"single"``, ``"pipelined"`` or
            ``"pipelined_nb"``.
        x0: initial guess laid out like ``b`` (default zero).
        diag: the diagonal of ``A`` laid out like ``b``: Jacobi preconditioning
            (default none).
        tol: stop when the recurrence residual ``||r|| <= tol ||b||``.
        maxiter: most iterations (default ``10 *`` the global length of ``b``,
            assuming equal blocks on every rank for the mpi4jax backend).
        comm: mpi4py communicator (mpi4jax backend).
        mesh: 1-D mesh (psum backend).
        replace_every: residual replacement period of ``pipelined`` and
            ``pipelined_nb`` (0: none).
        matvec_reductions: deprecated and ignored (see :func:`make_solver`).

    Returns:
        ``(x, info)``: ``x`` laid out like ``b``, and a :class:`CGInfo`.

    Raises:
        ValueError: unknown ``backend``/``variant``, ``x0`` or ``diag`` shaped
            unlike ``b``, negative ``tol``/``maxiter``/``replace_every``, or
            (psum) a ``b`` whose rows do not split evenly over the mesh (the
            messages of :func:`cg`).
        TypeError: ``matvec`` is not callable (as :func:`make_solver`).
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the
            message names the ``mpi4jax`` extra).
    """
    check_options(backend, variant, replace_every)
    _deprecate_matvec_reductions(matvec_reductions)
    try:
        solver = _cached_solver(
            matvec, backend, variant, ById(comm), mesh, replace_every
        )
    except TypeError:  # an unhashable matvec: build without the cache
        solver = make_solver(
            matvec,
            backend=backend,
            variant=variant,
            comm=comm,
            mesh=mesh,
            replace_every=replace_every,
        )
    return solver(b, x0, diag, tol=tol, maxiter=maxiter)
