"""The CG recurrences, written once over the operations every rank supplies
(:class:`Ops`: a matvec, a preconditioner, and a reduction of a small vector of
partial sums), the variants that order them, and the one loop that drives them
(docs/design.rst, *Conjugate gradients*)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .counting import LoopReductions

#: Residual replacement period of the pipelined variants (0 turns it off).
DEFAULT_REPLACE_EVERY = 50

# The named scopes that mark, in the traced and compiled program, the CG loop and
# the residual replacement's conditional: where the reductions are counted.
LOOP_SCOPE = "mpi4jax_dist_cg_loop"
REPLACE_SCOPE = "mpi4jax_dist_cg_replacement"


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

    Messages:
        .. code-block:: text

            mpi4jax_dist.cg: info.reductions is -1: the CG loop was not found in
            the traced program (<reason, such as: expected one top-level while
            loop marked name in the traced program, found n>)

            mpi4jax_dist.cg: info.reductions is -1: how many reductions an
            iteration makes depends on the data: <why>

            mpi4jax_dist.cg: info.reductions is -1: how many reductions A or M
            makes depends on the data: <why>
    """

    iterations: jax.Array
    rel_residual: jax.Array
    recurrence_residual: jax.Array
    reductions: jax.Array
    matvecs: jax.Array
    converged: jax.Array


class Ops(NamedTuple):
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


def dot(a, b):
    # Real for complex vectors too (Hermitian A), as jax.scipy's cg takes it.
    d = jnp.vdot(a, b)
    return d.real if jnp.iscomplexobj(d) else d


def inverse(diag):
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
    bb, rz, rr = ops.sum([bb, dot(r, z), dot(r, r)])
    return {"x": x, "r": r, "p": z, "rz": rz, "rr": rr}, bb, counts


def _classic_step(ops, b, st, k, counts, replace_every):
    q, counts = ops.apply(st["p"], counts)
    (pq,) = ops.sum([dot(st["p"], q)])
    alpha = st["rz"] / pq
    x = st["x"] + alpha * st["p"]
    r = st["r"] - alpha * q
    z = ops.precond(r)
    rz, rr = ops.sum([dot(r, z), dot(r, r)])
    p = z + (rz / st["rz"]) * st["p"]
    return {"x": x, "r": r, "p": p, "rz": rz, "rr": rr}, counts


def _single_init(ops, x, r, bb, counts):
    u = ops.precond(r)
    w, counts = ops.apply(u, counts)
    parts = [bb, dot(r, u), dot(w, u), dot(r, r)]
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
    gamma, delta, rr = ops.sum([dot(r, u), dot(w, u), dot(r, r)])
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
        # Marked: the reductions of this branch (those of the four matvecs) are
        # counted per replacement, not per iteration.
        with jax.named_scope(REPLACE_SCOPE):
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
        [dot(r, u), dot(w, u), dot(r, r)], precond_and_matvec, w, counts
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


def run(
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
    state, bb, _ = record.init(ops, x, r, dot(b, b), counts)
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

    # Marked: this loop's body is where the reductions are counted.
    with jax.named_scope(LOOP_SCOPE):
        k, st, counts = lax.while_loop(cond, body, (jnp.int32(0), state, counts))
    x = st["x"]
    check_ops = ops if check_ops is None else check_ops
    ax, _ = check_ops.apply(x, counts)
    (rr_true,) = check_ops.sum([dot(b - ax, b - ax)])

    def relative(rr):
        return jnp.sqrt(rr / jnp.where(bb > 0, bb, 1))

    per = LoopReductions(*(jnp.asarray(c, jnp.int32) for c in counted))
    info = CGInfo(
        iterations=k,
        rel_residual=relative(rr_true),
        recurrence_residual=relative(st["rr"]),
        reductions=jnp.where(per.body < 0, -1, per.total(k, counts[1])),
        matvecs=counts[0],
        converged=st["rr"] <= threshold,
    )
    return x, info
