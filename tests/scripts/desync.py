"""Ranks that disagree on a collective (tests/jobs/test_desync.py).

Every rank first makes two matching jitted ``mpi4jax_dist.allreduce`` calls on
``COMM_WORLD`` (so that a check made only on a communicator's first call has
passed), prints ``READY``, then ``CASE`` decides what the ranks do; the ranks in
``ODD`` (default: the last) do the other thing:

- ``op``: SUM against MAX, of 4 float32;
- ``dtype``: int32 against float32, 4 each (the same bytes);
- ``bytes``: 4 float32 against 8 int16 (the same bytes);
- ``large``: ``LARGE`` (default 16384) float32 against twice as many;
- ``count``: 4 float32 against 8;
- ``order``: in one jit, ``a`` (SUM) then ``b`` (MAX) against ``b`` then ``a``;
- ``kind``: ``allreduce`` against ``iallreduce`` and its wait, of ``LARGE``
  float32 (default 4);
- ``setup``: the first call on a new communicator, the odd ranks in an mpi4py
  ``Barrier`` on the world instead;
- ``skip``: eager calls ``a``, ``b`` and ``c`` of 4 float32 (of ``x``, ``2 * x``,
  ``3 * x``), the odd ranks skipping ``b``: each rank prints ``VALUE <rank> <name>
  <values>`` for each call that returned;
- ``lines``: one call of 4 float32 (``LARGE`` elements) made at two lines, one
  for the odd ranks and one for the others, jitted (``EAGER=1``: not), of
  ``allreduce`` (``CALL=iallreduce``: ``iallreduce`` and its wait);
- ``cond``: in one jit, ``lax.cond`` on the rank with an allreduce in each branch
  (the odd ranks reduce ``2 * x``), both given ``site=SITE`` where it is set (the
  odd ranks' only, with ``SITE_ODD_ONLY=1``);
- ``agree``: every rank alike (the control);
- ``loop``: every rank alike, ``STEPS`` jitted steps of 4 calls each (small and
  large, blocking and not), printing ``BIG <rank> True`` where the large one kept
  its value.

With ``FILL_SITES=1`` the extension's table of places is full before the case
(its calls' places are then compared by key alone, and not named).

Each rank prints ``RESULT <rank> <values>`` for what it got, and ``DONE``. With
``AGAIN=1`` (and ``MPI4JAX_DIST_FAIL_FAST=0``) the case's error is caught
(``CAUGHT <rank>``) and one more allreduce made on the communicator:
``AGAIN <rank> ran`` or ``AGAIN <rank> refused: <error>``.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpi4jax_dist

jax.distributed.initialize()

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
odd_ranks = {int(r) for r in os.environ.get("ODD", str(size - 1)).split(",")}
odd = rank in odd_ranks
case = os.environ.get("CASE", "agree")


# Called as the user would, so that each report names the script's own lines.
allreduce = functools.partial(mpi4jax_dist.allreduce, op=MPI.SUM, comm=comm)


def partial_allreduce(on):
    return functools.partial(mpi4jax_dist.allreduce, op=MPI.SUM, comm=on)


def iallreduce(x, op=MPI.SUM):
    return mpi4jax_dist.iallreduce(x, op=op, comm=comm).wait()


warm = jax.jit(allreduce)
x = jnp.arange(4, dtype=jnp.float32) + rank
for _ in range(2):
    warm(x).block_until_ready()
if os.environ.get("FILL_SITES"):  # the extension's table of places full
    from mpi4jax_dist.ops import common

    for i in range(4096):
        common.extension().register_site(f"filler {i}", f"filler {i}")


def say(text):
    """One write a line: the ranks share the pipe, and print() writes the text and
    its newline apart, so two ranks' lines could run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


say(f"READY {rank}")


def run_case():
    if case == "op":
        out = jax.jit(lambda v: allreduce(v, op=MPI.MAX if odd else MPI.SUM))(x)
    elif case == "dtype":
        out = jax.jit(allreduce)(x.astype(jnp.int32) if odd else x)
    elif case == "bytes":
        out = jax.jit(allreduce)(jnp.arange(8, dtype=jnp.int16) if odd else x)
    elif case == "large":  # about the size up to which header and data go as one
        n = int(os.environ.get("LARGE", str(1 << 14)))
        out = jax.jit(allreduce)(jnp.ones(2 * n if odd else n, jnp.float32))
    elif case == "count":
        out = jax.jit(allreduce)(jnp.arange(8, dtype=jnp.float32) if odd else x)
    elif case == "order":
        a, b = x, 2 * x + 1

        def both(a, b):
            if odd:
                b = allreduce(b, op=MPI.MAX)
                a = allreduce(a)
            else:
                a = allreduce(a)
                b = allreduce(b, op=MPI.MAX)
            return a + b

        out = jax.jit(both)(a, b)
    elif case == "kind":  # of LARGE float32 (default 4)
        v = jnp.ones(int(os.environ.get("LARGE", "4")), jnp.float32)
        out = jax.jit(iallreduce if odd else allreduce)(v)
    elif case == "setup":  # a first call on a new communicator; the odd rank
        fresh = comm.Dup()  # waits in an mpi4py barrier instead
        if odd:
            comm.Barrier()
            out = x
        else:
            out = jax.jit(partial_allreduce(fresh))(x)
    elif case == "skip":  # eager calls, as a user's script makes them
        a = allreduce(x)  # skip: a
        say(f"VALUE {rank} a {np.asarray(a).tolist()}")
        if not odd:
            b = allreduce(2 * x)  # skip: b
            say(f"VALUE {rank} b {np.asarray(b).tolist()}")
        out = allreduce(3 * x)  # skip: c
        say(f"VALUE {rank} c {np.asarray(out).tolist()}")
    elif case == "lines":  # one call of one signature, made at two lines
        v = jnp.arange(int(os.environ.get("LARGE", "4")), dtype=jnp.float32) + rank
        run = (lambda f: f(v)) if os.environ.get("EAGER") else (lambda f: jax.jit(f)(v))
        start = functools.partial(mpi4jax_dist.iallreduce, comm=comm)
        if os.environ.get("CALL") == "iallreduce":
            if odd:
                out = run(lambda u: start(u).wait())  # lines: odd, iallreduce
            else:
                out = run(lambda u: start(u).wait())  # lines: others, iallreduce
        elif odd:
            out = run(lambda u: allreduce(u))  # lines: odd, allreduce
        else:
            out = run(lambda u: allreduce(u))  # lines: others, allreduce
    elif case == "cond":  # an allreduce in each branch of a cond on the rank
        named = {"site": os.environ["SITE"]} if os.environ.get("SITE") else {}
        evens = {} if os.environ.get("SITE_ODD_ONLY") else named

        def branches(v, r):
            return lax.cond(
                r % 2 == 1,
                lambda u: allreduce(2 * u, **named),  # cond: odd
                lambda u: allreduce(u, **evens),  # cond: even
                v,
            )

        out = jax.jit(branches)(x, rank)
    elif case == "agree":
        out = jax.jit(allreduce)(x)
    elif case == "loop":
        # Small messages (header and data in one) and large ones (in chunks, with
        # MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES below 128 KiB), blocking and not: a
        # step keeps the ranks' mean, which a wrong reduction would change.
        big = np.arange(1 << 15, dtype=np.float32) + rank

        @jax.jit
        def step(v, w):
            v = allreduce(v) / size
            v = allreduce(v, op=MPI.MAX)
            v = iallreduce(v, op=MPI.MIN)
            w = allreduce(w) / size
            return v, w

        out, w = x, big
        for _ in range(int(os.environ.get("STEPS", "100"))):
            out, w = step(out, w)
        mean = np.arange(1 << 15, dtype=np.float32) + (size - 1) / 2
        say(f"BIG {rank} {np.array_equal(np.asarray(w), mean)}")
    else:
        raise SystemExit(f"desync.py: CASE={case!r} is not one it knows")
    return out


if os.environ.get("AGAIN"):  # under MPI4JAX_DIST_FAIL_FAST=0: the error caught
    try:
        run_case()
    except Exception as exc:  # noqa: BLE001
        say(f"CAUGHT {rank} {type(exc).__name__}")
    try:
        jax.jit(allreduce)(x).block_until_ready()
        say(f"AGAIN {rank} ran")
    except Exception as exc:  # noqa: BLE001
        say(f"AGAIN {rank} refused: {exc}")
    raise SystemExit(0)
out = run_case()
values = np.asarray(out)
say(f"RESULT {rank} {values.dtype}{values.ravel().tolist()}")
say(f"DONE {rank}")
