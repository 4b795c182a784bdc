"""Shape B, the stochastic-reconfiguration normal equations
``(J^T J / Ns + eps I) x = f`` with ``J`` split by samples over ranks and ``x``
replicated: the dot products are local, each matvec makes one allreduce."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
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


def _check_reduce_dtype(reduce_dtype):
    if reduce_dtype is None:
        return None
    dtype = jnp.dtype(reduce_dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r}: expected a floating dtype such as "
            f"jnp.float32."
        )
    return dtype


class NormalSolver:
    """A compiled shape-B CG; see :func:`make_normal_solver`."""

    def __init__(
        self, backend, variant, jacobi, reduce_dtype, comm, mesh, replace_every
    ):
        self.backend, self.variant, self.comm = backend, variant, comm
        self.jacobi, self.reduce_dtype = jacobi, reduce_dtype
        replaces = VARIANT_RECORDS[variant].replaces
        self.replace_every = replace_every if replaces else 0

        def local(J, f, x0, eps, num_samples, tol, maxiter, counted, total, overlap):
            # The dot products are local here: nothing to overlap (``overlap``
            # unused), every variant reduces in its matvec, blocking.
            dtype = jnp.result_type(J, f)

            def matvec(v, narrow=reduce_dtype):
                # This rank's samples' share of J^T J v. Written (J v) J: XLA on CPU
                # computes J.T @ (J @ v) slower; benchmarks/sr.py times both forms
                # (solve_normal against the drop-in with the user's A).
                part = (J @ v) @ J
                if narrow is not None:
                    part = part.astype(narrow)
                return total(part).astype(dtype) / num_samples + eps * v

            diag = None
            if jacobi:
                diag = total(jnp.sum(J * J, axis=0)) / num_samples + eps
            # The dots are local (x is replicated); each matvec makes one reduction.
            ops = core.Ops(matvec, core.inverse(diag), None)
            check = ops._replace(matvec=functools.partial(matvec, narrow=None))
            return core.run(
                ops,
                variant,
                self.replace_every,
                f.astype(dtype),
                x0,
                tol,
                maxiter,
                counted,
                check_ops=check,
            )

        self._solve, self.mesh = compile_solve(
            local,
            backend,
            comm,
            mesh,
            in_layouts=("rows",) + ("same",) * 6,
            out_layouts=("same", "same"),
        )

    def __call__(self, J, f, eps, x0=None, *, tol=1e-5, maxiter=200, num_samples=None):
        """Solve ``(J^T J / Ns + eps I) x = f``; see :func:`solve_normal`."""
        check_tol_maxiter(tol, maxiter)
        n = np.shape(J)[1] if np.ndim(J) == 2 else None
        if n is None or np.shape(f) not in ((n,), (n, 1)):
            raise ValueError(
                f"J has shape {np.shape(J)} and f {np.shape(f)}: expected J of shape "
                f"(samples, params) and f of shape (params,) or (params, 1)."
            )
        check_like("x0", x0, f, "f")
        eps = _check_eps(eps, n)
        shape = np.shape(f)
        if len(shape) == 2:  # a column, as some codes keep f: solved as a vector
            f = jnp.reshape(f, (n,))
            x0 = None if x0 is None else jnp.reshape(x0, (n,))
        if self.backend == "psum":
            check_rows("J", J, self.mesh)
        if num_samples is None:
            num_samples = np.shape(J)[0]
            if self.backend == "mpi4jax":
                num_samples *= comm_size(self.comm)
        if self.reduce_dtype is not None:
            dtype = jnp.result_type(J, f)
            if self.reduce_dtype.itemsize > dtype.itemsize:
                raise ValueError(
                    f"reduce_dtype={self.reduce_dtype.name} is wider than the "
                    f"working dtype {dtype.name}: to iterate in float64, call "
                    f'jax.config.update("jax_enable_x64", True) before creating J '
                    f"and f, and pass them as float64."
                )
            if self.reduce_dtype == dtype:
                logger.info(
                    "mpi4jax_dist.cg: reduce_dtype=%s equals the working dtype; "
                    "reductions are not narrowed (is jax_enable_x64 off?)",
                    dtype.name,
                )
        x, info = self._solve(J, f, x0, eps, num_samples, tol, maxiter)
        return jnp.reshape(x, shape), info


def _check_eps(eps, n):
    """Return the diagonal shift ``eps`` as a scalar or an ``(n,)`` vector."""
    shape = np.shape(eps)
    if shape not in ((), (n,), (n, 1)):
        raise ValueError(
            f"eps has shape {shape}: expected a scalar, or one shift per parameter "
            f"of shape ({n},)."
        )
    if not isinstance(eps, jax.core.Tracer) and not np.all(np.asarray(eps) > 0):
        raise ValueError(
            f"eps must be > 0 (every entry of a vector eps): J^T J / Ns alone is "
            f"singular when there are fewer samples than parameters; got "
            f"min(eps) = {np.min(np.asarray(eps))}."
        )
    return jnp.reshape(eps, (n,)) if shape else eps


def make_normal_solver(
    *,
    backend: str = "mpi4jax",
    variant: str = "classic",
    jacobi: bool = False,
    reduce_dtype=None,
    comm=None,
    mesh=None,
    replace_every: int = DEFAULT_REPLACE_EVERY,
) -> NormalSolver:
    """Return a compiled CG for ``(J^T J / Ns + eps I) x = f``, to call many times.

    Each matvec makes one allreduce of an ``n_params`` vector
    (``sum over ranks of J_r^T (J_r v)``); the dot products need none, since ``x``
    and ``f`` are replicated. ``info.reductions`` counts those allreduces. Every
    variant therefore makes one reduction per iteration here; ``single`` and
    ``pipelined`` only change how the vector updates fuse.

    Narrowed reductions and ``pipelined`` (or ``pipelined_nb``) do not mix: its extra
    recurrences amplify the float32 error of the matvec, so the true residual stalls
    near ``1e-5`` and can then grow while the recurrence still decreases (measured
    on small problems; ``classic`` and ``single`` reach ``1e-8`` there). A warning
    is logged.

    Args:
        backend: ``"mpi4jax"`` (``J`` is this rank's samples) or ``"psum"`` (``J``
            a global array sharded by rows over ``mesh``; ``f`` and ``x0``
            replicated).
        variant: ``"classic"``, ``"single"``, ``"pipelined"`` or
            ``"pipelined_nb"`` (here the same as ``"pipelined"``: the dot products
            need no reduction); all make one reduction per iteration here, in the
            matvec.
        jacobi: precondition with the diagonal ``sum(J**2, 0) / Ns + eps``
            (one more allreduce of ``n_params`` floats per solve, outside the loop).
        reduce_dtype: dtype the partial ``J^T J v`` is reduced in (e.g.
            ``jnp.float32`` to halve the bytes while iterating in float64, which
            needs ``jax.config.update("jax_enable_x64", True)`` before ``J`` and
            ``f`` are created). Default: the working dtype. The matvec is then
            accurate to about float32's precision, so ask for ``tol`` no smaller
            than about ``1e-6``.
        comm: mpi4py communicator (mpi4jax backend).
        mesh: 1-D mesh (psum backend).
        replace_every: residual replacement period of ``pipelined``.

    Returns:
        A :class:`NormalSolver`: ``solver(J, f, eps, x0=None, *, tol=1e-5,
        maxiter=200, num_samples=None)`` returns ``(x, info)``.

    Raises:
        ValueError: unknown ``backend``/``variant`` (the messages of
            :func:`cg`), or ``reduce_dtype`` not a floating dtype.
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the
            message names the ``mpi4jax`` extra).

    Messages:
        .. code-block:: text

            ValueError: reduce_dtype=<value>: expected a floating dtype such
            as jnp.float32.

            mpi4jax_dist.cg: variant=<variant> with reduce_dtype=<dtype> is unstable
            below a relative residual of about 1e-5; use 'classic' or 'single'.
    """
    check_options(backend, variant, replace_every)
    reduce_dtype = _check_reduce_dtype(reduce_dtype)
    # The variants with residual replacement are the pipelined ones, whose extra
    # recurrences amplify the narrowed matvec's error.
    if reduce_dtype is not None and VARIANT_RECORDS[variant].replaces:
        logger.warning(
            "mpi4jax_dist.cg: variant=%r with reduce_dtype=%s is unstable "
            "below a relative residual of about 1e-5; use 'classic' or 'single'.",
            variant,
            reduce_dtype.name,
        )
    return NormalSolver(
        backend, variant, bool(jacobi), reduce_dtype, comm, mesh, replace_every
    )


@functools.lru_cache(maxsize=32)
def _cached_normal_solver(
    backend, variant, jacobi, reduce_dtype, comm, mesh, replace_every
):
    return make_normal_solver(
        backend=backend,
        variant=variant,
        jacobi=jacobi,
        reduce_dtype=reduce_dtype,
        comm=comm.obj,
        mesh=mesh,
        replace_every=replace_every,
    )


def solve_normal(
    J,
    f,
    eps,
    *,
    backend: str = "mpi4jax",
    variant: str = "classic",
    x0=None,
    tol: float = 1e-5,
    maxiter: int = 200,
    jacobi: bool = False,
    reduce_dtype=None,
    num_samples: int | None = None,
    comm=None,
    mesh=None,
    replace_every: int = DEFAULT_REPLACE_EVERY,
):
    """Solve the SR normal equations ``(J^T J / Ns + eps I) x = f`` by CG.

    Args:
        J: the Jacobian, samples x params: this rank's samples (mpi4jax backend) or
            a global array sharded by rows over the mesh (psum backend).
        f: the right-hand side, ``(params,)`` or ``(params, 1)``, the same on every
            rank; ``x`` comes back in its shape.
        eps: the diagonal shift, > 0: a scalar, or a vector of shape ``(params,)``
            (one shift per parameter, ``(J^T J / Ns + diag(eps)) x = f``).
        backend: ``"mpi4jax"`` or ``"psum"``.
        variant: ``"classic"``, ``"single"``, ``"pipelined"`` or
            ``"pipelined_nb"``.
        x0: warm start, e.g. the previous solution (default zero).
        tol: relative residual to stop at.
        maxiter: most iterations.
        jacobi: Jacobi preconditioning; see :func:`make_normal_solver`.
        reduce_dtype: dtype of the reductions, e.g. ``jnp.float32`` while
            iterating in float64; see :func:`make_normal_solver`.
        num_samples: ``Ns``, the total number of samples (default the rows of
            ``J`` times the ranks for mpi4jax, the rows of the global ``J`` for
            psum).
        comm: mpi4py communicator (mpi4jax backend).
        mesh: 1-D mesh (psum backend).
        replace_every: residual replacement period of ``pipelined``.

    Returns:
        ``(x, info)``: ``x`` replicated, ``(params,)``, and a :class:`CGInfo`.

    Raises:
        ValueError: unknown ``backend``/``variant`` (the messages of
            :func:`cg`), shapes that do not fit, a shift ``eps`` not positive,
            ``reduce_dtype`` wider than the working dtype or not floating (as
            :func:`make_normal_solver`).
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the
            message names the ``mpi4jax`` extra).

    Messages:
        .. code-block:: text

            ValueError: J has shape <shape> and f <shape>: expected J of
            shape (samples, params) and f of shape (params,) or (params, 1).

            ValueError: eps has shape <shape>: expected a scalar, or one
            shift per parameter of shape (<n>,).

            ValueError: eps must be > 0 (every entry of a vector eps): J^T J
            / Ns alone is singular when there are fewer samples than
            parameters; got min(eps) = <value>.

            ValueError: reduce_dtype=<dtype> is wider than the working dtype
            <dtype>: to iterate in float64, call
            jax.config.update("jax_enable_x64", True) before creating J and
            f, and pass them as float64.
    """
    check_options(backend, variant, replace_every)
    solver = _cached_normal_solver(
        backend,
        variant,
        bool(jacobi),
        _check_reduce_dtype(reduce_dtype),
        ById(comm),
        mesh,
        replace_every,
    )
    return solver(J, f, eps, x0, tol=tol, maxiter=maxiter, num_samples=num_samples)
