"""Distributed conjugate gradients over a pluggable reduction: mpi4jax or psum.

Called, the module is the drop-in for ``jax.scipy.sparse.linalg.cg``:
``mpi4jax_dist.cg(A, b, x0=None, *, tol=1e-5, atol=0.0, maxiter=None, M=None)``
(:func:`cg`), which returns ``(x, info)``. :func:`solve` and :func:`make_solver`
solve ``A x = b`` on vectors split over ranks, :func:`solve_normal` and
:func:`make_normal_solver` the normal equations ``(J^T J / Ns + eps I) x = f``.

Two backends: ``"mpi4jax"`` (per-rank arrays, ``jax.jit`` of the loop, the dot
products summed by ``mpi4jax.allreduce``; the ``mpi4jax`` extra) and ``"psum"``
(global arrays sharded along axis 0 over a 1-D mesh, ``jax.jit(shard_map(loop))``,
``lax.psum``). Four variants, identical in exact arithmetic:

================  ==================================================  ==========
variant           recurrences                                         reductions
================  ==================================================  ==========
``classic``       Hestenes-Stiefel: ``p.Ap``, then ``[r.z, r.r]``     2 per it.
``single``        Chronopoulos-Gear: ``[r.u, w.u, r.r]`` after the    1 per it.
                  matvec
``pipelined``     Ghysels-Vanroose: the reduction independent of      1 per it.
                  that iteration's matvec, with residual replacement
                  every ``replace_every`` iterations
``pipelined_nb``  ``pipelined``, its reduction non-blocking on the    1 per it.
                  ``mpi4jax`` backend (``mpi4jax_dist.iallreduce``),
                  in flight while the preconditioner and matvec run
================  ==================================================  ==========

The whole solve is one jitted ``lax.while_loop``; :class:`CGInfo` says what it did.
docs/design.rst, *Conjugate gradients*, gives the stability of the pipelined
variants and how the reductions are counted.
"""

from __future__ import annotations

import sys
import types

from .solvers.backends import BACKENDS
from .solvers.core import (
    DEFAULT_REPLACE_EVERY,
    REDUCTIONS_PER_ITERATION,
    SCALARS_PER_ITERATION,
    VARIANT_RECORDS,
    VARIANTS,
    CGInfo,
    Variant,
)
from .solvers.distributed import Solver, make_solver, solve
from .solvers.dropin import DROP_IN_BACKENDS, cg
from .solvers.normal import NormalSolver, make_normal_solver, solve_normal

__all__ = [
    "BACKENDS",
    "CGInfo",
    "DEFAULT_REPLACE_EVERY",
    "DROP_IN_BACKENDS",
    "NormalSolver",
    "REDUCTIONS_PER_ITERATION",
    "SCALARS_PER_ITERATION",
    "Solver",
    "VARIANTS",
    "VARIANT_RECORDS",
    "Variant",
    "cg",
    "make_normal_solver",
    "make_solver",
    "solve",
    "solve_normal",
]


class _CallableModule(types.ModuleType):
    """``mpi4jax_dist.cg(A, b, ...)`` where ``jax.scipy.sparse.linalg.cg(A, b, ...)``
    stood: the module, called, is :func:`cg`."""

    def __call__(self, *args, **kwargs):
        return cg(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
