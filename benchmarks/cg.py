"""Distributed CG: mpi4jax against shard_map/psum, classic against one reduction.

    mpiexec -n N python benchmarks/cg.py [--n GRID] [--samples S --params P]
        [--problems A,B] [--repeat R] [--json PATH] [--plot PATH.png]

Problem A: the 2D 5-point Poisson operator (Dirichlet) on an ``n x n`` grid, rows
split in blocks of ``n / N`` grid rows, halo exchange in the matvec, ``b = A x_true``
with a known random ``x_true``. Problem B: the stochastic-reconfiguration normal
equations ``(J^T J / Ns + eps I) x = f`` with a synthetic Jacobian (``S`` samples
split across ranks, ``P`` parameters, column scales ``1/sqrt(1+j)``), ``f = J^T e /
Ns``, checked against a dense SciPy solve (Woodbury form) on rank 0.

Every backend x variant of :mod:`mpi4jax_dist.cg` runs, with the floor (classic CG
in mpi4py + NumPy) and references: ``jax.scipy.sparse.linalg.cg`` on global arrays
sharded over ``global_mesh()`` (what a JAX user tries first; XLA inserts the
collectives), and for B the hand-written ``mpi4jax.allreduce(J.T @ (J @ x))`` inside
``jax.scipy.sparse.linalg.cg``. All in float64, no preconditioner.

Timing: every method of a problem is compiled and run once (not timed); then
``--repeat`` rounds time each method once in turn (round-robin, so that a drifting
machine load touches all alike), each solve after a barrier and ended by
``block_until_ready``; a solve's time is the slowest rank's; t/iter is the median
over rounds divided by the iterations made (set-up and the final residual check
included). Residual and error are recomputed here in NumPy for every method alike.
Share reducing = reductions per iteration x the median time of one reduction of that
payload, timed as a jitted loop of ``REDUCE_LOOP`` back-to-back reductions with the
same mechanism (mpi4jax.allreduce, psum in shard_map, or mpi4py Allreduce), over
t/iter: an estimate of the latency, without the waiting for slower ranks that a
real iteration adds.

Where the ranks fill the cores, run with ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``:
NumPy's BLAS threads otherwise spin against the other ranks and the floor's dot
products slow down several-fold (the header and the JSON record these variables).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

FLOOR = "mpi4py+numpy"
JAX_SCIPY = "jax.scipy"
HAND = "mpi4jax+jax.scipy"
REDUCE_LOOP = 200  # reductions per timed loop for the share estimate
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "XLA_FLAGS",
)


# ---------------------------------------------------------------------------------
# Problem A: 2D Poisson in row blocks


def stencil(u, above, below, xp):
    """Return the 5-point Laplacian ``4u - neighbours`` of the row block ``u``.

    ``above``/``below`` are the grid rows just outside the block (zeros at the
    Dirichlet boundary); ``xp`` is numpy or jax.numpy.
    """
    zero = xp.zeros_like(u[:, :1])
    up = xp.concatenate([above[None], u[:-1]])
    down = xp.concatenate([u[1:], below[None]])
    left = xp.concatenate([zero, u[:, :-1]], axis=1)
    right = xp.concatenate([u[:, 1:], zero], axis=1)
    return 4 * u - up - down - left - right


class Poisson:
    """The Poisson problem on ``n x n``, this rank's ``n / size`` grid rows."""

    def __init__(self, n: int, comm, seed: int = 0):
        if n % comm.size:
            raise ValueError(f"--n {n} must be a multiple of the {comm.size} ranks.")
        self.n, self.comm, self.seed = n, comm, seed
        self.rows = n // comm.size
        self.row0 = comm.rank * self.rows
        grid = self.x_true_rows(self.row0 - 1, self.row0 + self.rows + 1)
        self.x_true = grid[1:-1].reshape(-1)
        self.b = stencil(grid[1:-1], grid[0], grid[-1], np).reshape(-1)
        self.size = n * n

    def x_true_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the known solution (zero outside the grid)."""
        rows = [
            (
                np.random.default_rng([self.seed, i]).standard_normal(self.n)
                if 0 <= i < self.n
                else np.zeros(self.n)
            )
            for i in range(start, stop)
        ]
        return np.stack(rows)

    def numpy_matvec(self):
        """The floor's matvec: halo rows through mpi4py ``Sendrecv``."""
        from mpi4py import MPI

        comm, n = self.comm, self.n
        up = comm.rank - 1 if comm.rank > 0 else MPI.PROC_NULL
        down = comm.rank + 1 if comm.rank < comm.size - 1 else MPI.PROC_NULL
        above, below = np.zeros(n), np.zeros(n)

        def matvec(v):
            u = v.reshape(-1, n)
            comm.Sendrecv(np.ascontiguousarray(u[-1]), down, 0, above, up, 0)
            comm.Sendrecv(np.ascontiguousarray(u[0]), up, 1, below, down, 1)
            return stencil(u, above, below, np).reshape(-1)

        return matvec

    def mpi4jax_matvec(self):
        """The mpi4jax backend's matvec: halo rows through ``mpi4jax.sendrecv``."""
        import jax.numpy as jnp
        import mpi4jax
        from mpi4py import MPI

        comm, n, rank, size = self.comm, self.n, self.comm.rank, self.comm.size
        up = rank - 1 if rank > 0 else MPI.PROC_NULL
        down = rank + 1 if rank < size - 1 else MPI.PROC_NULL

        def matvec(v):
            u = v.reshape(-1, n)
            above = mpi4jax.sendrecv(u[-1], u[-1], up, down, comm=comm)
            below = mpi4jax.sendrecv(u[0], u[0], down, up, comm=comm)
            # A receive from PROC_NULL leaves the buffer undefined: zero it.
            if rank == 0:
                above = jnp.zeros_like(above)
            if rank == size - 1:
                below = jnp.zeros_like(below)
            return stencil(u, above, below, jnp).reshape(-1)

        return matvec

    def shard_matvec(self, mesh):
        """The psum backend's matvec, inside shard_map: halos by ``lax.ppermute``."""
        import jax.numpy as jnp
        from jax import lax

        axis, size, n = mesh.axis_names[0], mesh.devices.size, self.n
        to_next = [(i, i + 1) for i in range(size - 1)]
        to_previous = [(i + 1, i) for i in range(size - 1)]

        def matvec(v):
            u = v.reshape(-1, n)
            above = lax.ppermute(u[-1], axis, to_next)  # zeros on the first block
            below = lax.ppermute(u[0], axis, to_previous)
            return stencil(u, above, below, jnp).reshape(-1)

        return matvec

    def global_matvec(self):
        """The matvec on the global sharded vector (XLA partitions it)."""
        import jax.numpy as jnp

        n = self.n

        def matvec(v):
            zero = jnp.zeros((n,), v.dtype)
            return stencil(v.reshape(n, n), zero, zero, jnp).reshape(-1)

        return matvec


# ---------------------------------------------------------------------------------
# Problem B: SR normal equations with a synthetic Jacobian


class Jacobian:
    """``(J^T J / Ns + eps I) x = f``: this rank's ``samples / size`` rows of J."""

    def __init__(self, samples: int, params: int, eps: float, comm, seed: int = 1):
        from mpi4py import MPI

        if samples % comm.size:
            raise ValueError(
                f"--samples {samples} must be a multiple of the {comm.size} ranks."
            )
        self.samples, self.params, self.eps, self.comm = samples, params, eps, comm
        self.seed = seed
        rows = samples // comm.size
        self.J, e = self.rows(comm.rank * rows, (comm.rank + 1) * rows)
        self.f = np.empty(params)
        comm.Allreduce(self.J.T @ e / samples, self.f, op=MPI.SUM)
        self.size = params

    def rows(self, start: int, stop: int):
        """Rows ``start:stop`` of J and of the per-sample weights ``e``."""
        scale = 1 / np.sqrt(1 + np.arange(self.params))
        gens = [np.random.default_rng([self.seed, i]) for i in range(start, stop)]
        J = np.stack([g.standard_normal(self.params) for g in gens]) * scale
        e = np.array([g.standard_normal() for g in gens])
        return J, e

    def reference(self) -> np.ndarray:
        """SciPy's solution on rank 0 (Woodbury form), broadcast to every rank."""
        import scipy.linalg

        x = None
        if self.comm.rank == 0:
            J, _ = self.rows(0, self.samples)
            ns, eps = self.samples, self.eps
            if ns < self.params:
                # (eps + J^T J/Ns)^-1 = (I - J^T (Ns eps + J J^T)^-1 J) / eps
                K = J @ J.T + ns * eps * np.eye(ns)
                x = (
                    self.f - J.T @ scipy.linalg.solve(K, J @ self.f, assume_a="pos")
                ) / eps
            else:
                A = J.T @ J / ns + eps * np.eye(self.params)
                x = scipy.linalg.solve(A, self.f, assume_a="pos")
        return self.comm.bcast(x, root=0)

    def numpy_matvec(self):
        from mpi4py import MPI

        J, out = self.J, np.empty(self.params)

        def matvec(v):
            self.comm.Allreduce(J.T @ (J @ v), out, op=MPI.SUM)
            return out / self.samples + self.eps * v

        return matvec


# ---------------------------------------------------------------------------------
# Measuring


def slowest_median(comm, run, repeat):
    """Return (median over runs of the slowest rank's seconds, last output).

    One untimed run first; then ``repeat`` runs, each after a barrier.
    """
    import jax
    from mpi4py import MPI

    out = jax.block_until_ready(run())  # compilation and warm-up: not timed
    times = []
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        out = jax.block_until_ready(run())
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times), out


def numpy_cg(matvec, b, comm, tol, maxiter, dots_global):
    """The floor: classic unpreconditioned CG; returns (x, iterations, reductions)."""
    from mpi4py import MPI

    def dot(a, c):
        if not dots_global:
            return float(a @ c)
        return comm.allreduce(float(a @ c), op=MPI.SUM)

    reductions = 0
    x, r = np.zeros_like(b), b.copy()
    p = r.copy()
    bb = rr = dot(r, r)
    k = 0
    while k < maxiter and rr > tol * tol * bb:
        q = matvec(p)
        alpha = rr / dot(p, q)
        x += alpha * p
        r -= alpha * q
        rr, rr_old = dot(r, r), rr
        p = r + (rr / rr_old) * p
        reductions += 2 if dots_global else 0
        k += 1
    return x, k, reductions


class ReductionTimer:
    """Seconds one reduction of a given payload takes, per mechanism, cached."""

    def __init__(self, comm, mesh):
        self.comm, self.mesh, self.cache = comm, mesh, {}

    def __call__(self, mechanism: str, count: int, dtype) -> float:
        key = (mechanism, count, np.dtype(dtype).name)
        if key not in self.cache:
            self.cache[key] = getattr(self, "_" + mechanism)(count, np.dtype(dtype))
        return self.cache[key]

    def _mpi4py(self, count, dtype):
        from mpi4py import MPI

        buf, out = np.ones(count, dtype), np.empty(count, dtype)

        def run():
            for _ in range(REDUCE_LOOP):
                self.comm.Allreduce(buf, out, op=MPI.SUM)
            return out

        return slowest_median(self.comm, run, 5)[0] / REDUCE_LOOP

    def _mpi4jax(self, count, dtype):
        import jax
        import jax.numpy as jnp
        import mpi4jax
        from jax import lax
        from mpi4py import MPI

        scale = 1.0 / self.comm.size
        loop = jax.jit(
            lambda v: lax.fori_loop(
                0,
                REDUCE_LOOP,
                lambda i, v: mpi4jax.allreduce(v, op=MPI.SUM, comm=self.comm) * scale,
                v,
            )
        )
        v = jnp.ones(count, dtype)
        return slowest_median(self.comm, lambda: loop(v), 5)[0] / REDUCE_LOOP

    def _psum(self, count, dtype):
        import jax
        import jax.numpy as jnp
        from jax import lax
        from jax.sharding import PartitionSpec

        from mpi4jax_dist import _jax_compat

        axis, size = self.mesh.axis_names[0], self.mesh.devices.size

        def body(v):
            return lax.fori_loop(
                0, REDUCE_LOOP, lambda i, v: lax.psum(v, axis) * (1.0 / size), v
            )

        loop = jax.jit(
            _jax_compat.shard_map(
                body,
                mesh=self.mesh,
                in_specs=PartitionSpec(),
                out_specs=PartitionSpec(),
                check=False,
            )
        )
        v = jnp.ones(count, dtype)
        return slowest_median(self.comm, lambda: loop(v), 5)[0] / REDUCE_LOOP


HEADER = (
    f"# {'problem':<7} {'backend':<17} {'variant':<14} {'iters':>6} {'rel.res':>9} "
    f"{'error':>9} {'t/iter':>10} {'red/it':>6} {'counted':>7} {'B/iter':>8} "
    f"{'reducing':>8}"
)
UNITS = (
    f"# {'':<7} {'':<17} {'':<14} {'':>6} {'':>9} {'':>9} {'[us]':>10} "
    f"{'design':>6} {'':>7} {'[bytes]':>8} {'[%]':>8}"
)


def format_row(r):
    counted = (
        "-"
        if r["reductions_per_iter_counted"] is None
        else (f"{r['reductions_per_iter_counted']:.2f}")
    )
    share = "-" if r["reduce_share"] is None else f"{100 * r['reduce_share']:.0f}"
    return (
        f"  {r['problem']:<7} {r['backend']:<17} {r['variant']:<14} "
        f"{r['iterations']:>6} {r['rel_residual']:>9.2e} {r['error']:>9.2e} "
        f"{r['t_iter_s'] * 1e6:>10.1f} {r['reductions_per_iter']:>6} {counted:>7} "
        f"{r['bytes_per_iter']:>8} {share:>8}"
    )


class Bench:
    """Runs and records the methods of one benchmark invocation."""

    def __init__(self, args, comm, mesh):
        self.args, self.comm, self.mesh = args, comm, mesh
        self.results, self.queue = [], []
        self.timer = ReductionTimer(comm, mesh)

    def say(self, text):
        if self.comm.rank == 0:
            print(text, flush=True)

    def record(
        self,
        problem,
        backend,
        variant,
        *,
        t_solve,
        iterations,
        x_local,
        check,
        design,
        counted,
        bytes_per_iter,
        mechanism,
        payload_dtype,
        extra=None,
    ):
        """Check ``x_local`` with ``check`` and add one result row."""
        rel_residual, error = check(np.asarray(x_local, dtype=np.float64))
        count = bytes_per_iter // max(design, 1) // np.dtype(payload_dtype).itemsize
        t_iter = t_solve / max(iterations, 1)
        share = None
        if mechanism is not None and design:
            one = self.timer(mechanism, max(count, 1), payload_dtype)
            share = design * one / t_iter
        row = {
            "problem": problem,
            "backend": backend,
            "variant": variant,
            "iterations": int(iterations),
            "rel_residual": float(rel_residual),
            "error": float(error),
            "t_iter_s": t_iter,
            "t_solve_s": t_solve,
            "reductions_per_iter": design,
            "reductions_per_iter_counted": (
                None if counted is None else counted / max(iterations, 1)
            ),
            "bytes_per_iter": int(bytes_per_iter),
            "reduce_share": share,
            "reduce_timing": mechanism,
        }
        row.update(extra or {})
        self.results.append(row)
        self.say(format_row(row))
        return row

    # Measuring: every method of a problem round-robin ------------------------------

    def add(self, run, finish):
        """Queue a method: ``run()`` solves, ``finish(t_solve, output)`` records."""
        self.queue.append((run, finish))

    def measure(self):
        """Time the queued methods round-robin, then record them in order.

        Each method is compiled and run once first (not timed). Then each of
        ``--repeat`` rounds times every method once: barrier, solve,
        ``block_until_ready``, the slowest rank's wall. A drifting machine load thus
        touches every method alike; each method's time is its median over rounds.
        """
        import jax
        from mpi4py import MPI

        outputs = [jax.block_until_ready(run()) for run, _ in self.queue]
        times = [[] for _ in self.queue]
        for _ in range(self.args.repeat):
            for i, (run, _) in enumerate(self.queue):
                self.comm.Barrier()
                t0 = time.perf_counter()
                outputs[i] = jax.block_until_ready(run())
                elapsed = time.perf_counter() - t0
                times[i].append(self.comm.allreduce(elapsed, op=MPI.MAX))
        for (_, finish), samples, output in zip(
            self.queue, times, outputs, strict=True
        ):
            finish(statistics.median(samples), output)
        self.queue = []

    # The three kinds of methods, shared by both problems ---------------------------

    def add_floor(self, problem, prob, check, dots_global):
        matvec = prob.numpy_matvec()
        b = prob.b if problem == "A" else prob.f
        tol, maxiter = self.tol, self.maxiter

        def finish(t, output):
            x, k, reductions = output
            self.record(
                problem,
                FLOOR,
                "classic",
                t_solve=t,
                iterations=k,
                x_local=x,
                check=check,
                design=2 if dots_global else 1,
                counted=reductions + (0 if dots_global else k),
                mechanism="mpi4py",
                bytes_per_iter=16 if dots_global else 8 * prob.size,
                payload_dtype=np.float64,
            )

        self.add(
            lambda: numpy_cg(matvec, b, self.comm, tol, maxiter, dots_global), finish
        )

    def add_ours(
        self,
        problem,
        backend,
        label,
        solve,
        check,
        design,
        nbytes,
        payload_dtype,
        extra=None,
    ):
        from mpi4jax_dist import to_local

        def finish(t, output):
            x, info = output
            self.record(
                problem,
                backend,
                label,
                t_solve=t,
                iterations=int(info.iterations),
                x_local=to_local(x) if backend == "psum" else x,
                check=check,
                design=design,
                counted=int(info.reductions),
                bytes_per_iter=nbytes,
                mechanism=backend,
                payload_dtype=payload_dtype,
                extra={
                    "rel_residual_info": float(info.rel_residual),
                    "converged": bool(info.converged),
                    **(extra or {}),
                },
            )

        self.add(solve, finish)

    def add_jax_cg(
        self, problem, backend, make, args_, check, design, nbytes, mechanism, to_numpy
    ):
        """Queue a ``jax.scipy.sparse.linalg.cg`` reference; iterations counted apart.

        ``make(counter)`` returns the jitted solve; with a counter, its matvec calls
        it through ``jax.debug.callback``, in an untimed run after the timed ones (on
        rank 0 every matvec fires it: one for the initial residual, one per
        iteration).
        """
        import jax

        solve = make(None)

        def finish(t, x):
            calls = [0]

            def count():
                calls[0] += 1

            jax.block_until_ready(make(count)(*args_))
            iterations = self.comm.bcast(calls[0] - 1, root=0)
            self.record(
                problem,
                backend,
                "cg",
                t_solve=t,
                iterations=iterations,
                x_local=to_numpy(x),
                check=check,
                design=design,
                counted=None,
                bytes_per_iter=nbytes,
                mechanism=mechanism,
                payload_dtype=np.float64,
            )

        self.add(lambda: solve(*args_), finish)

    # Problems ------------------------------------------------------------------

    def problem_a(self):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from mpi4jax_dist import cg, to_global, to_local

        args, comm, mesh = self.args, self.comm, self.mesh
        prob = Poisson(args.n, comm)
        self.tol = tol = args.tol
        self.maxiter = maxiter = args.maxiter or 10 * args.n * args.n
        floor_matvec = prob.numpy_matvec()
        norms = self._norms(prob.b, prob.x_true)

        def check(x):
            r = prob.b - floor_matvec(x)
            return self._ratio(r, norms[0]), self._ratio(x - prob.x_true, norms[1])

        self.say(
            f"# A: 2D Poisson {args.n} x {args.n}, {prob.rows} grid rows per "
            f"rank, tol {self.tol:g}, maxiter {self.maxiter}"
        )
        self.add_floor("A", prob, check, dots_global=True)
        b_local = jnp.asarray(prob.b)
        b_global = to_global(b_local, mesh)
        for backend in cg.BACKENDS:
            if backend == "mpi4jax":
                matvec, b = prob.mpi4jax_matvec(), b_local
            else:
                matvec, b = prob.shard_matvec(mesh), b_global
            for variant in cg.VARIANTS:
                solver = cg.make_solver(
                    matvec, backend=backend, variant=variant, comm=comm, mesh=mesh
                )
                solve = functools.partial(solver, b, tol=tol, maxiter=maxiter)
                self.add_ours(
                    "A",
                    backend,
                    variant,
                    solve,
                    check,
                    cg.REDUCTIONS_PER_ITERATION[variant],
                    8 * cg.SCALARS_PER_ITERATION[variant],
                    np.float64,
                )

        rows = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
        global_matvec = prob.global_matvec()

        def make(counter):
            def matvec(v):
                if counter is not None:
                    jax.debug.callback(counter)
                return global_matvec(v)

            return jax.jit(
                lambda b: jax.scipy.sparse.linalg.cg(
                    matvec, b, tol=tol, maxiter=maxiter
                )[0],
                out_shardings=rows,
            )

        self.add_jax_cg(
            "A",
            JAX_SCIPY,
            make,
            (b_global,),
            check,
            2,
            16,
            "psum",
            lambda x: np.asarray(to_local(x)),
        )
        self.measure()

    def problem_b(self):
        import jax
        import jax.numpy as jnp
        import mpi4jax
        from jax.sharding import NamedSharding, PartitionSpec
        from mpi4py import MPI

        from mpi4jax_dist import cg, to_global

        args, comm, mesh = self.args, self.comm, self.mesh
        prob = Jacobian(args.samples, args.params, args.eps, comm)
        self.tol, self.maxiter = tol, maxiter = args.tol_b, args.maxiter_b
        x_ref = prob.reference()
        floor_matvec = prob.numpy_matvec()
        f_norm, ref_norm = np.linalg.norm(prob.f), np.linalg.norm(x_ref)

        def check(x):
            r = prob.f - floor_matvec(x)
            return np.linalg.norm(r) / f_norm, np.linalg.norm(x - x_ref) / ref_norm

        P, Ns, eps = args.params, args.samples, args.eps
        self.say(
            f"# B: (J^T J/Ns + eps I) x = f, Ns {Ns} samples ({Ns // comm.size} "
            f"per rank) x {P} params, eps {eps:g}, tol {self.tol:g}, maxiter "
            f"{self.maxiter}"
        )
        self.say(
            "# mpi4jax_dist.cg computes J^T J v as (J @ v) @ J; the references "
            "keep J.T @ (J @ v) as users write it (2.4x slower in XLA on CPU)"
        )
        self.add_floor("B", prob, check, dots_global=False)
        J_local, f = jnp.asarray(prob.J), jnp.asarray(prob.f)
        J_global = to_global(J_local, mesh)
        cases = [(v, None) for v in cg.VARIANTS] + [("classic", "float32")]
        for backend in cg.BACKENDS:
            J = J_local if backend == "mpi4jax" else J_global
            for variant, narrow in cases:
                solver = cg.make_normal_solver(
                    backend=backend,
                    variant=variant,
                    reduce_dtype=narrow,
                    comm=comm,
                    mesh=mesh,
                )
                payload = np.dtype(narrow or np.float64)
                solve = functools.partial(solver, J, f, eps, tol=tol, maxiter=maxiter)
                self.add_ours(
                    "B",
                    backend,
                    variant + ("/f32red" if narrow else ""),
                    solve,
                    check,
                    1,
                    payload.itemsize * P,
                    payload,
                    extra={"reduce_dtype": payload.name},
                )

        replicated = NamedSharding(mesh, PartitionSpec())

        def make_global(counter):
            def matvec(J, v):
                if counter is not None:
                    jax.debug.callback(counter)
                return J.T @ (J @ v) / Ns + eps * v

            return jax.jit(
                lambda J, f: jax.scipy.sparse.linalg.cg(
                    lambda v: matvec(J, v), f, tol=tol, maxiter=maxiter
                )[0],
                out_shardings=replicated,
            )

        from mpi4jax_dist import to_local

        self.add_jax_cg(
            "B",
            JAX_SCIPY,
            make_global,
            (J_global, f),
            check,
            1,
            8 * P,
            "psum",
            lambda x: np.asarray(to_local(x)),
        )

        def make_hand(counter):
            def matvec(J, v):
                if counter is not None:
                    jax.debug.callback(counter)
                return (
                    mpi4jax.allreduce(J.T @ (J @ v), op=MPI.SUM, comm=comm) / Ns
                    + eps * v
                )

            return jax.jit(
                lambda J, f: jax.scipy.sparse.linalg.cg(
                    lambda v: matvec(J, v), f, tol=tol, maxiter=maxiter
                )[0]
            )

        # Every rank counts its own matvecs here; rank 0's count is broadcast.
        self.add_jax_cg(
            "B", HAND, make_hand, (J_local, f), check, 1, 8 * P, "mpi4jax", np.asarray
        )
        self.measure()

    # Helpers --------------------------------------------------------------------

    def _norms(self, *vectors):
        return [self._ratio(v, 1.0) for v in vectors]

    def _ratio(self, v, norm):
        from mpi4py import MPI

        return np.sqrt(self.comm.allreduce(float(v @ v), op=MPI.SUM)) / norm

    def speedups(self):
        """Add t/iter and solve-time speedups over classic; print them per backend."""
        lines = []
        for problem in ("A", "B"):
            for backend in ("mpi4jax", "psum"):
                mine = {
                    r["variant"]: r
                    for r in self.results
                    if r["problem"] == problem and r["backend"] == backend
                }
                if "classic" not in mine:
                    continue
                base = mine["classic"]
                parts = []
                for variant in ("single", "pipelined"):
                    if variant in mine:
                        row = mine[variant]
                        row["speedup_vs_classic"] = base["t_iter_s"] / row["t_iter_s"]
                        row["solve_speedup_vs_classic"] = (
                            base["t_solve_s"] / row["t_solve_s"]
                        )
                        parts.append(
                            f"{variant} {row['speedup_vs_classic']:.2f}x "
                            f"({row['solve_speedup_vs_classic']:.2f}x)"
                        )
                lines.append(
                    f"# speedup over classic, t/iter (solve): {problem} "
                    f"{backend}: " + ", ".join(parts)
                )
        for line in lines:
            self.say(line)


def metadata(args, comm) -> dict:
    import scipy

    meta = _harness.meta(
        comm,
        machine=platform.machine(),
        python=platform.python_version(),
        threads={name: os.environ.get(name) for name in THREAD_VARIABLES},
        args=vars(args),
        timing="median over --repeat solves of the slowest rank's wall time, "
        "compilation and one warm-up solve excluded; t_iter_s = that / "
        "iterations",
        reduce_share=f"reductions/iter x median time of one reduction of the "
        f"same payload in a jitted loop of {REDUCE_LOOP}, / t_iter",
    )
    meta["versions"]["scipy"] = scipy.__version__
    return meta


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = sorted({r["problem"] for r in results})
    fig, axes = plt.subplots(
        1, len(problems), figsize=(6 * len(problems), 4.5), squeeze=False
    )
    colors = {FLOOR: "0.5", "mpi4jax": "C0", "psum": "C1", JAX_SCIPY: "C2", HAND: "C3"}
    for ax, problem in zip(axes[0], problems, strict=True):
        rows = [r for r in results if r["problem"] == problem]
        labels = [f"{r['backend']}\n{r['variant']}" for r in rows]
        ax.bar(
            range(len(rows)),
            [r["t_iter_s"] * 1e6 for r in rows],
            color=[colors.get(r["backend"], "C4") for r in rows],
        )
        ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("time per iteration [us]")
        ax.set_title(f"problem {problem}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="A,B", help="comma-separated: A,B")
    parser.add_argument("--n", type=int, default=64, help="grid side of problem A")
    parser.add_argument(
        "--tol", type=float, default=1e-6, help="relative residual of problem A"
    )
    parser.add_argument(
        "--maxiter",
        type=int,
        default=None,
        help="iterations cap of problem A (default 10 n^2)",
    )
    parser.add_argument("--samples", type=int, default=2000, help="Ns of problem B")
    parser.add_argument("--params", type=int, default=10000, help="P of problem B")
    parser.add_argument("--eps", type=float, default=1e-4, help="shift of problem B")
    parser.add_argument(
        "--tol-b", type=float, default=1e-5, help="relative residual of problem B"
    )
    parser.add_argument(
        "--maxiter-b", type=int, default=200, help="iterations cap of problem B"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed solves each")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--plot", metavar="PATH", help="bar chart (PNG) here")
    args = parser.parse_args(argv)
    problems = [p.strip().upper() for p in args.problems.split(",") if p.strip()]
    bad = [p for p in problems if p not in ("A", "B")]
    if bad or not problems:
        parser.error(f"--problems {args.problems!r}: expected A, B or A,B")
    args.problems = problems
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import mpi4jax_dist

    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        mpi4jax_dist.initialize()
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        bench = Bench(args, comm, mpi4jax_dist.global_mesh())
        bench.say(
            f"# distributed CG, {comm.size} ranks, jax {jax.__version__} "
            f"({jax.default_backend()}), float64, no preconditioner"
        )
        bench.say(
            "# "
            + ", ".join(
                f"{name}={os.environ.get(name, '(unset)')}" for name in THREAD_VARIABLES
            )
        )
        bench.say(
            "# t/iter: median over rounds of the slowest rank's solve wall, "
            "compile excluded, / iterations; methods timed round-robin"
        )
        bench.say(
            f"# reducing: red/it (design) x one reduction of that payload, "
            f"timed in a jitted loop of {REDUCE_LOOP}, / t/iter"
        )
        bench.say(HEADER)
        bench.say(UNITS)
        if "A" in args.problems:
            bench.problem_a()
        if "B" in args.problems:
            bench.problem_b()
        bench.speedups()
        if comm.rank == 0:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(
                        {"meta": metadata(args, comm), "results": bench.results},
                        f,
                        indent=1,
                    )
            if args.plot:
                plot(bench.results, args.plot)
        comm.Barrier()
        return bench.results
    finally:
        jax.config.update("jax_enable_x64", x64)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
