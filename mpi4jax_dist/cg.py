"""Distributed conjugate gradients over a pluggable reduction: mpi4jax or psum.

CG is written once, over two things every rank supplies:

* a ``matvec`` on this rank's part of the vectors (it may communicate itself, e.g. a
  halo exchange), and
* a reduction of a *small vector of partial sums*: the dot products an iteration
  needs are computed locally, stacked, and summed over ranks in one call.

Two backends provide that reduction and the way the solve is compiled:

``"mpi4jax"``
    per-rank arrays; the solve is ``jax.jit`` of the loop and the reduction is
    ``mpi4jax.allreduce(partials, op=MPI.SUM, comm=comm)``. It needs the
    ``mpi4jax`` extra: without mpi4jax, asking for it raises an ImportError that
    names the extra.
``"psum"``
    global ``jax.Array``\\ s sharded along axis 0 over a 1-D mesh (default
    :func:`mpi4jax_dist.global_mesh`); the solve is ``jax.jit(shard_map(loop))`` and
    the reduction is ``lax.psum``. The user's ``matvec`` runs inside ``shard_map`` on
    the local block and communicates with ``lax.ppermute``/``lax.psum`` over the
    mesh axis.

Four variants, identical in exact arithmetic (same iterates, same iteration count):

================  ================================================  ==============
variant           recurrences                                       reductions/it
================  ================================================  ==============
``classic``       Hestenes-Stiefel: ``p.Ap``, then ``[r.z, r.r]``    2 (3 scalars)
``single``        Chronopoulos-Gear: ``[r.u, w.u, r.r]`` after the   1 (3 scalars)
                  matvec, ``w = A u`` carried
``pipelined``     Ghysels-Vanroose: ``[r.u, w.u, r.r]``,            1 (3 scalars)
                  independent of that iteration's matvec
                  ``n = A M w``, so the two can overlap where the
                  runtime allows it
``pipelined_nb``  ``pipelined``, its reduction non-blocking: the     1 (3 scalars)
                  ``mpi4jax`` backend posts it
                  (:func:`mpi4jax_dist.iallreduce`) before the
                  preconditioner and matvec and waits after them
================  ================================================  ==============

``pipelined_nb`` is where the overlap happens: on the ``mpi4jax`` backend the
iteration's ``MPI_Iallreduce`` is in flight while ``M w`` and ``A M w`` run, ordered so
by data dependencies in the compiled loop (:meth:`mpi4jax_dist.Request.overlap`); the
iterates are ``pipelined``'s (the same dot products, summed by ``MPI_Iallreduce``
instead of ``MPI_Allreduce``: the same to rounding, and bit for bit in the 2-rank
runs of the tests here).
How much of the reduction hides depends on the MPI's progress: see
:mod:`mpi4jax_dist._iallreduce` (``MPIR_CVAR_ASYNC_PROGRESS=1`` for MPICH). The
``psum`` backend has no non-blocking reduction: there ``pipelined_nb`` reduces
blocking, as ``pipelined`` does (XLA may still overlap independent work); so does
shape B (below), whose dot products need no reduction.

The whole solve is one jitted ``lax.while_loop``; :class:`CGInfo` says what it did.
Matvecs and residual replacements are counted at run time in the loop carry.
Reductions are counted in the program that ran: the first call with each input
signature compiles the solve ahead of time, :mod:`mpi4jax_dist._hlo` counts the
reductions in the compiled loop body (the dot products', the user's matvec's, after
XLA dropped or combined what it could) and in the replacement branch, and the solve
computes ``iterations x body + replacements x branch`` in that same program (the
call reuses the executable: nothing compiles twice). Outside the loop, the set-up
makes one reduction (fused with ``||b||``) and one to three matvecs, and the final
true-residual check one matvec and one reduction; none of these is counted.

Stability: ``pipelined`` propagates four more recurrences than ``single``, and its
recurrence residual drifts from the true one. It therefore does *residual
replacement*: every ``replace_every`` iterations (default
:data:`DEFAULT_REPLACE_EVERY`) it recomputes ``r = b - A x``, ``w = A M r``,
``s = A p`` and ``z = A M s`` from ``x`` and ``p`` (four extra matvecs, and the
reductions they make), which resets the gap. With ``replace_every=0`` there is none,
and the attainable accuracy is limited (Cools et al., SIAM J. Sci. Comput. 2018). On
the 2D Poisson problem of ``benchmarks/cg.py`` at 256 x 256, asked for
``tol=1e-12`` (830 iterations, 2 ranks), relative residuals:

==============================  ==========  ========
variant                         recurrence  true
==============================  ==========  ========
``classic``                     9.88e-13    9.88e-13
``single``                      9.88e-13    9.88e-13
``pipelined``, replacement off  9.91e-13    9.76e-12
``pipelined``, every 50         9.88e-13    9.88e-13
==============================  ==========  ========

from ``mpiexec -n 2 python benchmarks/cg.py --problems A --n 256 --tol 1e-12
--backends mpi4jax --replace-every 0 --repeat 1`` (the last row: the same without
``--replace-every 0``). The returned ``rel_residual`` is always the true one,
recomputed after the loop, so a gap is visible.

Every rank stops on the same test only if the reductions give every rank the same
bits, as with PETSc's KSP: the MPI standard advises implementations to, and ring
all-reduces (gloo's, NCCL's) hand every rank the same reduced chunks. Where that
failed, ranks could stop after different iteration counts and deadlock.

Performance: ``benchmarks/cg.py`` measures it (time per iteration of every backend
and variant, speedups over ``classic`` and over ``jax.scipy``'s ``cg``, the share of
an iteration spent reducing); this docstring quotes no timing that it cannot
reproduce. Without a preconditioner the vectors that would equal others
(``u = r``, ``q = s``, ``m = w``) are not carried.

The module is callable: ``mpi4jax_dist.cg(A, b, x0, tol=, atol=, maxiter=, M=)`` is
:func:`cg`, a drop-in for ``jax.scipy.sparse.linalg.cg`` over these variants, whose
vectors are the caller's (replicated by default: local dot products, no reduction
of its own; ``comm=``/``mesh=`` for split vectors).

Shape B, the stochastic-reconfiguration normal equations
``(J^T J / Ns + eps I) x = f`` with ``J`` split by samples across ranks and ``x``
replicated, is :func:`make_normal_solver`/:func:`solve_normal`: there the dot
products are local and each matvec makes one allreduce of an ``n_params`` vector.
"""

from __future__ import annotations

import functools
import logging
import operator
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from . import _allreduce, _extras, _hlo, _jax_compat

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

logger = logging.getLogger("mpi4jax_dist")

BACKENDS = ("mpi4jax", "psum")
#: Residual replacement period of the pipelined variant (0 turns it off).
DEFAULT_REPLACE_EVERY = 50

# The named scopes that mark, in the compiled program, the CG loop and the residual
# replacement's conditional: where _hlo looks for the reductions that ran.
_LOOP_SCOPE = "mpi4jax_dist_cg_loop"
_REPLACE_SCOPE = "mpi4jax_dist_cg_replacement"


class CGInfo(NamedTuple):
    """What a solve did; every field is a JAX scalar, the same on every rank.

    Attributes:
        iterations: iterations made (int32).
        rel_residual: ``||b - A x|| / ||b||`` recomputed from the returned ``x``
            after the loop (``||b - A x||`` when ``b`` is zero).
        recurrence_residual: the same from the recurrence the loop stopped on.
        reductions: collective reductions made inside the loop, the matvec's
            included: the reductions in the compiled loop body (read from the
            program that ran; inside a caller's ``jit``, from the traced one)
            times the iterations, plus those of the residual replacement branch
            times the replacements made. The drop-in :func:`cg` counts only
            reductions that communicate (over more than one process). -1 where
            the program does not fix how many run per iteration (a logged warning
            says why).
        matvecs: matvecs made inside the loop (pipelined residual replacement adds
            four every ``replace_every`` iterations).
        converged: True when the loop stopped because the recurrence residual
            reached ``tol`` (not ``maxiter``, nor a breakdown to inf/NaN).
    """

    iterations: jax.Array
    rel_residual: jax.Array
    recurrence_residual: jax.Array
    reductions: jax.Array
    matvecs: jax.Array
    converged: jax.Array


# ---------------------------------------------------------------------------------
# The CG body, shared by every backend and by shape B


class _Ops(NamedTuple):
    """The operations a CG iteration is written over.

    ``counts`` is the int32 vector ``[matvecs, replacements]`` carried by the loop;
    reductions are not counted here but read from the compiled loop (:class:`_Program`).
    """

    matvec: Callable
    inv_diag: jax.Array | None  # Jacobi; None: no preconditioner
    reduce: Callable | None  # sums partial sums over ranks; None: already global
    # overlap(stacked, fn, *args) -> (summed, fn(*args)): the reduction in flight
    # while fn runs (non-blocking); None: reduce, then run fn.
    overlap: Callable | None = None
    precond_fn: Callable | None = None  # M as a function (the drop-in's M=)

    @property
    def preconditioned(self) -> bool:
        return self.inv_diag is not None or self.precond_fn is not None

    def precond(self, v):
        """Return ``M^-1 v``: ``v`` itself without a preconditioner."""
        if self.precond_fn is not None:
            return self.precond_fn(v)
        return v if self.inv_diag is None else self.inv_diag * v

    def apply(self, v, counts):
        """Return ``A v`` and ``counts`` with this matvec added."""
        return self.matvec(v), counts + jnp.array([1, 0], jnp.int32)

    def sum(self, partials):
        """Return the partial sums stacked and summed over ranks, in one reduction."""
        stacked = jnp.stack(partials)
        return stacked if self.reduce is None else self.reduce(stacked)

    def sum_overlapping(self, partials, fn, *args):
        """Return ``(self.sum(partials), fn(*args))``, the reduction in flight while
        ``fn`` runs where the backend has a non-blocking one (``overlap``)."""
        if self.overlap is None or self.reduce is None:
            return self.sum(partials), fn(*args)
        return self.overlap(jnp.stack(partials), fn, *args)


def _dot(a, b):
    # Real for complex vectors too (Hermitian A), as jax.scipy's cg takes it.
    d = jnp.vdot(a, b)
    return d.real if jnp.iscomplexobj(d) else d


def _inverse(diag):
    return None if diag is None else 1 / diag


# Without a preconditioner these vectors equal others bit for bit (u = M r = r, and
# so q = s, m = w): the loop does not carry them, and XLA merges their recurrences.
_ALIASES = {"u": "r", "q": "s", "m": "w"}


def _pack(ops, st):
    """Return the loop carry of the state ``st``: without the aliases when M = I."""
    if ops.preconditioned:
        return st
    return {k: v for k, v in st.items() if k not in _ALIASES}


def _unpack(ops, st):
    """Return the state of the loop carry ``st``: with the aliases when M = I."""
    if ops.preconditioned:
        return st
    return {**st, **{k: st[v] for k, v in _ALIASES.items() if v in st}}


def _next_coefficients(gamma, delta, gamma_old, alpha_old):
    """Chronopoulos-Gear's ``(alpha, beta)`` from ``r.u``, ``w.u`` and the last ones."""
    beta = gamma / gamma_old
    return gamma / (delta - beta * gamma / alpha_old), beta


def _classic_init(ops, x, r, bb, counts):
    z = ops.precond(r)
    bb, rz, rr = ops.sum([bb, _dot(r, z), _dot(r, r)])
    return {"x": x, "r": r, "p": z, "rz": rz, "rr": rr}, bb, counts


def _classic_step(ops, b, st, k, counts, replace_every):
    q, counts = ops.apply(st["p"], counts)
    (pq,) = ops.sum([_dot(st["p"], q)])
    alpha = st["rz"] / pq
    x = st["x"] + alpha * st["p"]
    r = st["r"] - alpha * q
    z = ops.precond(r)
    rz, rr = ops.sum([_dot(r, z), _dot(r, r)])
    p = z + (rz / st["rz"]) * st["p"]
    return {"x": x, "r": r, "p": p, "rz": rz, "rr": rr}, counts


def _single_init(ops, x, r, bb, counts):
    u = ops.precond(r)
    w, counts = ops.apply(u, counts)
    parts = [bb, _dot(r, u), _dot(w, u), _dot(r, r)]
    bb, gamma, delta, rr = ops.sum(parts)
    zero = jnp.zeros_like(r)
    st = {
        "x": x,
        "r": r,
        "u": u,
        "w": w,
        "p": zero,
        "s": zero,
        "gamma": gamma,
        "alpha": gamma / delta,
        "beta": jnp.zeros_like(gamma),
        "rr": rr,
    }
    return st, bb, counts


def _single_step(ops, b, st, k, counts, replace_every):
    alpha, beta = st["alpha"], st["beta"]
    p = st["u"] + beta * st["p"]
    s = st["w"] + beta * st["s"]  # s = A p
    x = st["x"] + alpha * p
    r = st["r"] - alpha * s
    u = ops.precond(r)
    w, counts = ops.apply(u, counts)
    gamma, delta, rr = ops.sum([_dot(r, u), _dot(w, u), _dot(r, r)])
    alpha, beta = _next_coefficients(gamma, delta, st["gamma"], alpha)
    st = {
        "x": x,
        "r": r,
        "u": u,
        "w": w,
        "p": p,
        "s": s,
        "gamma": gamma,
        "alpha": alpha,
        "beta": beta,
        "rr": rr,
    }
    return st, counts


def _pipelined_init(ops, x, r, bb, counts):
    st, bb, counts = _single_init(ops, x, r, bb, counts)
    m = ops.precond(st["w"])
    n, counts = ops.apply(m, counts)
    zero = jnp.zeros_like(r)
    return {**st, "m": m, "n": n, "q": zero, "z": zero}, bb, counts


def _replace_residual(ops, b, x, p, counts):
    """Recompute ``r, u, w, s, q, z`` from ``x`` and ``p`` (four matvecs), and count
    the replacement."""
    counts = counts + jnp.array([0, 1], jnp.int32)
    ax, counts = ops.apply(x, counts)
    r = b - ax
    u = ops.precond(r)
    w, counts = ops.apply(u, counts)
    s, counts = ops.apply(p, counts)
    q = ops.precond(s)
    z, counts = ops.apply(q, counts)
    return (r, u, w, s, q, z), counts


def _pipelined_step(ops, b, st, k, counts, replace_every):
    # Loop rotated so that the reduction and the matvec it can hide behind sit
    # together at the end of the body, both on the freshly updated r, u, w.
    alpha, beta = st["alpha"], st["beta"]
    z = st["n"] + beta * st["z"]  # z = A q
    q = st["m"] + beta * st["q"]  # q = M s
    s = st["w"] + beta * st["s"]  # s = A p
    p = st["u"] + beta * st["p"]
    x = st["x"] + alpha * p
    r = st["r"] - alpha * s
    u = st["u"] - alpha * q  # u = M r
    w = st["w"] - alpha * z  # w = A u
    if replace_every:
        # Marked for _hlo: the reductions of this branch (those of the four
        # matvecs) are counted per replacement, not per iteration.
        with jax.named_scope(_REPLACE_SCOPE):
            vectors, counts = lax.cond(
                (k + 1) % replace_every == 0,
                lambda c: _replace_residual(ops, b, x, p, c),
                lambda c: ((r, u, w, s, q, z), c),
                counts,
            )
        r, u, w, s, q, z = vectors

    def precond_and_matvec(w, counts):  # independent of the reduction
        m = ops.precond(w)
        n, counts = ops.apply(m, counts)
        # w comes back too: the non-blocking form passes it in place through a
        # call that orders the matvec after the start, which would copy a w
        # used afterwards (see mpi4jax_dist.Request.overlap).
        return w, m, n, counts

    (gamma, delta, rr), (w, m, n, counts) = ops.sum_overlapping(
        [_dot(r, u), _dot(w, u), _dot(r, r)], precond_and_matvec, w, counts
    )
    alpha, beta = _next_coefficients(gamma, delta, st["gamma"], alpha)
    st = {
        "x": x,
        "r": r,
        "u": u,
        "w": w,
        "p": p,
        "s": s,
        "q": q,
        "z": z,
        "m": m,
        "n": n,
        "gamma": gamma,
        "alpha": alpha,
        "beta": beta,
        "rr": rr,
    }
    return st, counts


# ---------------------------------------------------------------------------------
# The variants: one record each


@dataclass(frozen=True)
class Variant:
    """One CG variant: its recurrences and what an iteration costs by design.

    Adding a variant is adding one record to :data:`VARIANT_RECORDS`: the solvers,
    :data:`VARIANTS`, the tests and ``benchmarks/cg.py`` derive from it.

    Attributes:
        name: the ``variant=`` value.
        init: ``init(ops, x, r, bb, counts) -> (state, bb, counts)``: the loop state
            from ``x`` and ``r = b - A x``; ``bb`` (the local ``b.b``) rides in its
            reduction and comes back summed.
        step: ``step(ops, b, state, k, counts, replace_every) -> (state, counts)``:
            iteration ``k``; ``state["rr"]`` is the recurrence's ``r.r``.
        reductions_by_design: collective reductions per iteration on distributed
            vectors (shape A) with a matvec that makes none: what
            ``info.reductions / info.iterations`` reads there.
        scalars: the scalars those reductions carry per iteration, in all.
        replaces: whether ``replace_every`` (residual replacement) applies.
        overlaps: whether an iteration's reduction is independent of its matvec,
            so that the two may overlap; XLA may then also combine a ``psum`` the
            matvec makes with the dot products' into one all-reduce (one
            collective, counted once).
        nonblocking: whether the ``mpi4jax`` backend posts that reduction
            non-blocking before the preconditioner and matvec and waits after them
            (:func:`mpi4jax_dist.iallreduce`, :meth:`~mpi4jax_dist.Request.overlap`,
            :meth:`~mpi4jax_dist.Request.wait`); the other backends reduce blocking.
    """

    name: str
    init: Callable
    step: Callable
    reductions_by_design: int
    scalars: int
    replaces: bool = False
    overlaps: bool = False
    nonblocking: bool = False


VARIANT_RECORDS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("classic", _classic_init, _classic_step, 2, 3),
        Variant("single", _single_init, _single_step, 1, 3),
        Variant(
            "pipelined",
            _pipelined_init,
            _pipelined_step,
            1,
            3,
            replaces=True,
            overlaps=True,
        ),
        Variant(
            "pipelined_nb",
            _pipelined_init,
            _pipelined_step,
            1,
            3,
            replaces=True,
            overlaps=True,
            nonblocking=True,
        ),
    )
}
VARIANTS = tuple(VARIANT_RECORDS)
#: Collective reductions per iteration by design, and the scalars they carry in all,
#: for a distributed-vector (shape A) solve whose matvec makes no reduction.
REDUCTIONS_PER_ITERATION = {
    n: v.reductions_by_design for n, v in VARIANT_RECORDS.items()
}
SCALARS_PER_ITERATION = {n: v.scalars for n, v in VARIANT_RECORDS.items()}


def _cg(
    ops, variant, replace_every, b, x0, tol, maxiter, counted, check_ops=None, atol=0.0
):
    """Solve ``A x = b`` on local blocks; the one CG driver of every variant.

    The loop stops once the recurrence's ``||r||`` reaches ``max(tol ||b||, atol)``,
    after ``maxiter`` iterations, or at a breakdown to inf/NaN.

    ``counted`` is ``(body, branch, condition)``: the reductions per execution of the
    compiled loop's body, of its replacement branch and of its condition, read from
    the compiled program (body -1: unknown). ``check_ops`` (default ``ops``)
    computes the final true residual: shape B checks at full precision what it
    iterated on with narrowed reductions.
    """
    record = VARIANT_RECORDS[variant]
    counts = jnp.zeros(2, jnp.int32)  # [matvecs, replacements] made in the loop
    if x0 is None:
        x, r = jnp.zeros_like(b), b
    else:
        x = x0.astype(b.dtype)
        ax, _ = ops.apply(x, counts)
        r = b - ax
    state, bb, _ = record.init(ops, x, r, _dot(b, b), counts)
    state = _pack(ops, state)
    threshold = jnp.maximum(
        jnp.asarray(tol, bb.dtype) ** 2 * bb, jnp.asarray(atol, bb.dtype) ** 2
    )

    def cond(carry):
        k, st, _ = carry
        rr = st["rr"]
        return (k < maxiter) & (rr > threshold) & jnp.isfinite(rr)

    def body(carry):
        k, st, counts = carry
        st, counts = record.step(ops, b, _unpack(ops, st), k, counts, replace_every)
        return k + 1, _pack(ops, st), counts

    # Marked for _hlo: this loop's body is where the reductions are counted.
    with jax.named_scope(_LOOP_SCOPE):
        k, st, counts = lax.while_loop(cond, body, (jnp.int32(0), state, counts))
    x = st["x"]
    check_ops = ops if check_ops is None else check_ops
    ax, _ = check_ops.apply(x, counts)
    (rr_true,) = check_ops.sum([_dot(b - ax, b - ax)])

    def relative(rr):
        return jnp.sqrt(rr / jnp.where(bb > 0, bb, 1))

    per = _hlo.LoopReductions(*(jnp.asarray(c, jnp.int32) for c in counted))
    info = CGInfo(
        iterations=k,
        rel_residual=relative(rr_true),
        recurrence_residual=relative(st["rr"]),
        reductions=jnp.where(per.body < 0, -1, per.total(k, counts[1])),
        matvecs=counts[0],
        converged=st["rr"] <= threshold,
    )
    return x, info


# ---------------------------------------------------------------------------------
# Backends


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(
            f"{name}={value!r} is not one of {', '.join(map(repr, choices))}."
        )


def _check_options(backend, variant, replace_every, backends=BACKENDS):
    _check_choice("backend", backend, backends)
    _check_choice("variant", variant, VARIANTS)
    if not isinstance(replace_every, (int, np.integer)) or replace_every < 0:
        raise ValueError(
            f"replace_every={replace_every!r}: expected an int >= 0 (0: no residual "
            f"replacement)."
        )
    if backend == "mpi4jax":
        _extras.require_mpi4jax(
            'mpi4jax_dist.cg\'s backend="mpi4jax"',
            'backend="psum" runs without it.',
        )
        # Its reductions run on XLA's worker threads, as the allreduce's do.
        from mpi4py import MPI  # noqa: F401  (initializes MPI, as mpi4jax does)

        _allreduce._check_mpi('mpi4jax_dist.cg\'s backend="mpi4jax"')


def _check_tol_maxiter(tol, maxiter, atol=0.0):
    if isinstance(tol, (int, float)) and not tol >= 0:
        raise ValueError(f"tol={tol!r}: expected a relative residual >= 0.")
    if isinstance(atol, (int, float)) and not atol >= 0:
        raise ValueError(f"atol={atol!r}: expected an absolute residual >= 0.")
    if isinstance(maxiter, (int, np.integer)) and maxiter < 0:
        raise ValueError(f"maxiter={maxiter!r}: expected an int >= 0.")


def _mpi4jax_sum(comm):
    """Return the mpi4jax reduction: sum over the ranks of ``comm``, inside jit.

    Under a simulated latency (``MPI4JAX_DIST_SIMULATED_LATENCY_US``, read when
    traced) it is an :func:`mpi4jax_dist.iallreduce` and its wait back to back, so
    that the blocking variants pay the latency the non-blocking one may hide.
    """
    import mpi4jax
    from mpi4py import MPI

    from . import _config, _iallreduce

    def allreduce(x):
        if _config.simulated_latency_us() is not None:
            return _iallreduce.iallreduce(x, MPI.SUM, comm=comm).wait()
        return mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)

    return allreduce


def _mpi4jax_overlap(comm):
    """Return the non-blocking mpi4jax-backend reduction: ``overlap(stacked, fn,
    *args) -> (summed, fn(*args))``, the sum over the ranks of ``comm`` in flight
    (``MPI_Iallreduce``) while ``fn`` runs, inside jit."""
    from mpi4py import MPI

    from . import _iallreduce

    def overlap(stacked, fn, *args):
        req = _iallreduce.iallreduce(stacked, MPI.SUM, comm=comm)
        req, out = req.overlap(fn, *args)
        return req.wait(), out

    return overlap


def _comm_size(comm):
    from mpi4py import MPI

    return (MPI.COMM_WORLD if comm is None else comm).Get_size()


def _mesh_axis(mesh):
    """Return ``(mesh, axis_name)``, the mesh defaulting to the global one."""
    if mesh is None:
        from .interop import global_mesh

        mesh = global_mesh()
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"mesh has axes {mesh.axis_names}; the psum backend needs a 1-D mesh "
            f"such as mpi4jax_dist.global_mesh()."
        )
    return mesh, mesh.axis_names[0]


def _check_rows(name, array, mesh):
    size = mesh.devices.size
    if np.ndim(array) == 0 or np.shape(array)[0] % size:
        raise ValueError(
            f"{name} has shape {np.shape(array)}: the psum backend shards axis 0 "
            f"over the {size} devices of the mesh, so it must be a multiple of {size}."
        )


def _check_like(name, array, like, like_name):
    if array is not None and np.shape(array) != np.shape(like):
        raise ValueError(
            f"{name} has shape {np.shape(array)} but {like_name} has shape "
            f"{np.shape(like)}; they must match."
        )


class _ById:
    """Hashable by identity, for caching on objects such as communicators."""

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _ById) and other.obj is self.obj


def _compile(fn, backend, comm, mesh, in_layouts, out_layouts):
    """Return ``(program, mesh)``: ``fn(*args, counted, total, overlap)`` as a
    :class:`_Program`.

    ``total(x)`` sums ``x`` over ranks: ``mpi4jax.allreduce`` in a ``jit`` of per-rank
    arrays, or ``lax.psum`` in a ``jit(shard_map)`` of global arrays whose layouts
    are ``"rows"`` (split along axis 0 over the mesh) or ``"same"`` (replicated).
    ``overlap`` is the non-blocking form of ``total`` (:attr:`_Ops.overlap`), or None
    where the backend has none (psum). ``counted`` is the triple of loop reduction
    counts that :class:`_Program` appends to every call's arguments.
    """
    counts = len(_COUNT_FIELDS)

    def split(*args):
        return args[:-counts], args[-counts:]

    if backend == "mpi4jax":
        total, overlap = _mpi4jax_sum(comm), _mpi4jax_overlap(comm)

        def local(*args):
            args, counted = split(*args)
            return fn(*args, counted, total, overlap)

        return _Program(jax.jit(local)), None
    mesh, axis = _mesh_axis(mesh)
    specs = {"rows": PartitionSpec(axis), "same": PartitionSpec()}

    def sharded(*args):
        args, counted = split(*args)
        return fn(*args, counted, lambda x: lax.psum(x, axis), None)

    sharded = _jax_compat.shard_map(
        sharded,
        mesh=mesh,
        in_specs=tuple(specs[layout] for layout in in_layouts)
        + (PartitionSpec(),) * counts,
        out_specs=tuple(specs[layout] for layout in out_layouts),
        check=False,  # the loop carries psum results: see _jax_compat.shard_map
    )
    return _Program(jax.jit(sharded)), mesh


_COUNT_FIELDS = ("body", "branch", "condition")


def _is_traced(leaf):
    return isinstance(leaf, jax.core.Tracer)


def _leaf_signature(leaf):
    if isinstance(leaf, (bool, int, float, complex)):
        return type(leaf)  # weakly typed: one executable for every value
    # A tracer (a solve inside the caller's jit) has no sharding to ask for.
    traced = _is_traced(leaf)
    sharding = None if traced else getattr(leaf, "sharding", None)
    return np.shape(leaf), jnp.result_type(leaf), sharding


class _Program:
    """A jitted solve that reports the reductions its own compiled loop makes.

    The first call with each input signature compiles the solve ahead of time
    (``lower(...).compile()``), counts the reductions of its CG loop in the
    optimized HLO (:func:`mpi4jax_dist._hlo.loop_reductions`) and keeps the counts;
    every call passes them as run-time int32 arguments, so that ``info.reductions``
    is computed in the same program. The call goes through ``jit``, which finds
    the executable that compilation made in its cache: nothing compiles twice
    (``Compiled.__call__`` itself refuses mpi4jax's ordered effects). Called inside
    the caller's own ``jit`` there is no program of the solve's own to read, and
    compiling one apart would double the caller's compile time: the loop is then
    counted in the traced program (:func:`mpi4jax_dist._hlo.jaxpr_loop_reductions`:
    the same reductions, before XLA could combine any psums).
    """

    def __init__(self, jitted):
        self._jitted, self._counts = jitted, {}

    def _signature(self, args):
        leaves, tree = jax.tree.flatten(args)
        return tree, jax.config.jax_enable_x64, tuple(map(_leaf_signature, leaves))

    def loop_reductions(self, *args) -> _hlo.LoopReductions | None:
        """Return the reductions of the CG loop compiled for ``args`` (None when
        the loop cannot be found), compiling it if needed."""
        key = self._signature(args)
        if key not in self._counts:
            zeros = (0,) * len(_COUNT_FIELDS)
            try:
                if any(map(_is_traced, jax.tree.leaves(args))):
                    # Inside the caller's jit: compiling the solve apart would
                    # double the caller's compile; count in the traced program.
                    traced = jax.make_jaxpr(self._jitted)(*args, *zeros)
                    found = _hlo.jaxpr_loop_reductions(
                        traced, _LOOP_SCOPE, _REPLACE_SCOPE
                    )
                else:
                    text = self._jitted.lower(*args, *zeros).compile().as_text()
                    found = _hlo.loop_reductions(text, _LOOP_SCOPE, _REPLACE_SCOPE)
            except LookupError as exc:
                logger.warning(
                    "mpi4jax_dist.cg: info.reductions is -1: the CG loop was not "
                    "found in the compiled program (%s)",
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


class Solver:
    """A compiled distributed CG for one matvec; see :func:`make_solver`."""

    def __init__(self, matvec, backend, variant, comm, mesh, replace_every):
        self.backend, self.variant, self.comm = backend, variant, comm
        record = VARIANT_RECORDS[variant]
        self.replace_every = replace_every if record.replaces else 0

        def local(b, x0, diag, tol, maxiter, counted, total, overlap):
            overlap = overlap if record.nonblocking else None
            ops = _Ops(matvec, _inverse(diag), total, overlap)
            return _cg(ops, variant, self.replace_every, b, x0, tol, maxiter, counted)

        self._solve, self.mesh = _compile(
            local,
            backend,
            comm,
            mesh,
            in_layouts=("rows", "rows", "rows", "same", "same"),
            out_layouts=("rows", "same"),
        )

    def __call__(self, b, x0=None, diag=None, *, tol=1e-8, maxiter=None):
        """Solve ``A x = b``; see :func:`solve` for the arguments."""
        _check_tol_maxiter(tol, maxiter)
        _check_like("x0", x0, b, "b")
        _check_like("diag", diag, b, "b")
        if self.backend == "psum":
            _check_rows("b", b, self.mesh)
            n = int(np.size(b))
        else:
            n = int(np.size(b)) * _comm_size(self.comm)
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
            (module docstring).
        comm: mpi4py communicator of the mpi4jax backend (default mpi4jax's, a
            clone of ``COMM_WORLD``).
        mesh: 1-D mesh of the psum backend (default
            :func:`mpi4jax_dist.global_mesh`); ``matvec`` sees its axis name.
        replace_every: residual replacement period of ``pipelined`` and
            ``pipelined_nb`` (0: none; see the module docstring for the stability
            limit without it).
        matvec_reductions: deprecated and ignored: the reductions a ``matvec``
            makes are counted in the compiled loop.

    Returns:
        A :class:`Solver`: ``solver(b, x0=None, diag=None, *, tol, maxiter)``
        returns ``(x, info)`` as :func:`solve` does.

    Raises:
        ValueError: unknown ``backend`` or ``variant``, negative ``replace_every``,
            or a mesh that is not 1-D.
        TypeError: ``matvec`` is not callable.
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the message
            names the ``mpi4jax`` extra).
    """
    _check_options(backend, variant, replace_every)
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
        ValueError: unknown ``backend``/``variant``, ``x0`` or ``diag`` shaped unlike
            ``b``, negative ``tol``/``maxiter``/``replace_every``, or (psum) a ``b``
            whose rows do not split evenly over the mesh.
        TypeError: ``matvec`` is not callable.
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the message
            names the ``mpi4jax`` extra).
    """
    _check_options(backend, variant, replace_every)
    _deprecate_matvec_reductions(matvec_reductions)
    try:
        solver = _cached_solver(
            matvec, backend, variant, _ById(comm), mesh, replace_every
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


# ---------------------------------------------------------------------------------
# The drop-in for jax.scipy.sparse.linalg.cg

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
    _check_choice("backend", backend, DROP_IN_BACKENDS)
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
    return _hlo.jaxpr_reductions(jax.make_jaxpr(fn)(spec), axis_sizes)


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
    ops = _Ops(mv, None, setup.reduce, setup.overlap, precond_fn=precond)
    counted = _drop_in_counted(setup, mv, precond, flat_b)
    x, info = _cg(
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
            ``"single"``, ``"pipelined"`` or ``"pipelined_nb"`` (module docstring;
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
        ValueError: unknown ``variant``/``backend``, ``comm`` or ``mesh`` with a
            backend that does not use it, ``x0`` unlike ``b``, a non-square matrix,
            negative ``tol``/``atol``/``maxiter``/``replace_every``, or (psum) rows
            that do not split over the mesh.
        TypeError: ``A`` or ``M`` is neither a function nor a matrix.
        ImportError: ``backend="mpi4jax"`` without mpi4jax (names the extra).
    """
    backend = _drop_in_backend(backend, comm, mesh)
    _check_options(backend, variant, replace_every, DROP_IN_BACKENDS)
    _check_tol_maxiter(tol, maxiter, atol)
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
        ranks = _comm_size(comm) if backend == "mpi4jax" else 1
        maxiter = 10 * ranks * sum(int(np.size(leaf)) for leaf in leaves)
    setup = _DropIn(variant, replace_every, tol, atol, maxiter, M, x0, None, None, None)
    if backend == "mpi4jax" and comm.Get_size() > 1:
        overlap = _mpi4jax_overlap(comm) if record.nonblocking else None
        setup = setup._replace(reduce=_mpi4jax_sum(comm), overlap=overlap)
    if backend != "psum":
        return _linear_solve(A, b, setup, symmetric)

    mesh, axis = _mesh_axis(mesh)
    for leaf in leaves:
        _check_rows("b", leaf, mesh)
    rows = PartitionSpec(axis)
    reduce = (lambda x: lax.psum(x, axis)) if mesh.devices.size > 1 else None

    def sharded(b, x0):
        inner = setup._replace(x0=x0, reduce=reduce, axis_sizes=dict(mesh.shape))
        return _linear_solve(A, b, inner, symmetric)

    sharded = _jax_compat.shard_map(
        sharded,
        mesh=mesh,
        in_specs=(rows, rows),
        out_specs=(rows, PartitionSpec()),
        check=False,  # the loop carries psum results: see _jax_compat.shard_map
    )
    return jax.jit(sharded)(b, x0)


class _CallableModule(types.ModuleType):
    """``mpi4jax_dist.cg`` is this module and, called, the drop-in :func:`cg`:
    ``mpi4jax_dist.cg(A, b, ...)`` where ``jax.scipy.sparse.linalg.cg(A, b, ...)``
    stood."""

    def __call__(self, *args, **kwargs):
        return cg(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


# ---------------------------------------------------------------------------------
# Shape B: (J^T J / Ns + eps I) x = f, J split by samples, x replicated


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
                # computes J.T @ (J @ v) slower; benchmarks/cg.py --problems B times
                # both forms and prints the ratio.
                part = (J @ v) @ J
                if narrow is not None:
                    part = part.astype(narrow)
                return total(part).astype(dtype) / num_samples + eps * v

            diag = None
            if jacobi:
                diag = total(jnp.sum(J * J, axis=0)) / num_samples + eps
            # The dots are local (x is replicated); each matvec makes one reduction.
            ops = _Ops(matvec, _inverse(diag), None)
            check = ops._replace(matvec=functools.partial(matvec, narrow=None))
            return _cg(
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

        self._solve, self.mesh = _compile(
            local,
            backend,
            comm,
            mesh,
            in_layouts=("rows",) + ("same",) * 6,
            out_layouts=("same", "same"),
        )

    def __call__(self, J, f, eps, x0=None, *, tol=1e-5, maxiter=200, num_samples=None):
        """Solve ``(J^T J / Ns + eps I) x = f``; see :func:`solve_normal`."""
        _check_tol_maxiter(tol, maxiter)
        n = np.shape(J)[1] if np.ndim(J) == 2 else None
        if n is None or np.shape(f) not in ((n,), (n, 1)):
            raise ValueError(
                f"J has shape {np.shape(J)} and f {np.shape(f)}: expected J of shape "
                f"(samples, params) and f of shape (params,) or (params, 1)."
            )
        _check_like("x0", x0, f, "f")
        eps = _check_eps(eps, n)
        shape = np.shape(f)
        if len(shape) == 2:  # a column, as some codes keep f: solved as a vector
            f = jnp.reshape(f, (n,))
            x0 = None if x0 is None else jnp.reshape(x0, (n,))
        if self.backend == "psum":
            _check_rows("J", J, self.mesh)
        if num_samples is None:
            num_samples = np.shape(J)[0]
            if self.backend == "mpi4jax":
                num_samples *= _comm_size(self.comm)
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
        ValueError: unknown ``backend``/``variant``, or ``reduce_dtype`` not a
            floating dtype.
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the message
            names the ``mpi4jax`` extra).
    """
    _check_options(backend, variant, replace_every)
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
        ValueError: unknown ``backend``/``variant``, shapes that do not fit,
            ``reduce_dtype`` wider than the working dtype or not floating.
        ImportError: ``backend="mpi4jax"`` without mpi4jax installed (the message
            names the ``mpi4jax`` extra).
    """
    _check_options(backend, variant, replace_every)
    solver = _cached_normal_solver(
        backend,
        variant,
        bool(jacobi),
        _check_reduce_dtype(reduce_dtype),
        _ById(comm),
        mesh,
        replace_every,
    )
    return solver(J, f, eps, x0, tol=tol, maxiter=maxiter, num_samples=num_samples)
