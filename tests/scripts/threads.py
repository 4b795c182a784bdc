"""Programs of one process dispatched from two threads (tests/jobs/test_standstill.py).

Two jitted programs hold one ``mpi4jax_dist.allreduce`` each on ``COMM_WORLD``:
``f`` (of ``x``, whose sum is 2.0 a position) and ``g`` (of ``100 x``, 200.0).
Thread A dispatches ``f``; thread B dispatches ``g`` only once A's dispatch has
returned, so the process dispatched ``f`` first. Nothing orders programs of two
threads against each other (each thread's are ordered; JAX's runtime tokens and
PJRT's launch order are per thread). ``CASE``:

- ``same``: ``f`` and ``g`` make their call at one line (one call site), the odd rank
  dispatches ``DELAY_S`` (default 1) later, and on the others thread B
  dispatches once the record says ``f``'s call waits: their two programs wait
  in their allreduces at once;
- ``apart``: the odd rank makes ``f`` wait on a slow input (``SLOW_S``, default
  2): its ``g`` runs first, where the others ran ``f`` first;
- ``stream``: one thread dispatches ``f`` under
  ``jaxlib.xla_client.execution_stream_id(1)`` (its input slow on the odd rank,
  as ``apart``), then ``g`` under its own stream;
- ``serial``: thread B waits for ``f``'s result before dispatching (the control:
  ordered by the user).

Each rank prints ``RESULT <rank> <f's first value> <g's first value>`` and
``DONE``.
"""

import os
import threading
import time

import jax
import jax.numpy as jnp
from jax import lax

import mpi4jax_dist

jax.distributed.initialize()

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
odd = rank == size - 1
case = os.environ.get("CASE", "serial")


def work(v, trips):
    # Work in the program after its call: XLA:CPU then runs it on its own
    # threads, and the dispatch returns at once (a cheap program runs inline).
    w = jnp.broadcast_to(v[0], (1 << 14,))
    w = lax.fori_loop(0, trips, lambda i, u: jnp.sin(u) * 0 + u, w)
    return v + 0 * w[0]


def reduce_first(v):
    return work(mpi4jax_dist.allreduce(v, comm=comm), 100)


def reduce_second(v):
    return work(mpi4jax_dist.allreduce(v, comm=comm), 100)


f = jax.jit(reduce_first)
# same: two programs whose one call is made at one line (reduce_first's).
g = jax.jit(lambda v: reduce_first(v) * 1) if case == "same" else jax.jit(reduce_second)
x = jnp.ones(4, jnp.float32)
f(x).block_until_ready()  # compiled and the communicator set up, on every rank
g(x).block_until_ready()
print(f"READY {rank}", flush=True)


@jax.jit
def slow(v):
    # About SLOW_S seconds of work on the odd rank: f's input is late there.
    trips = int(float(os.environ.get("SLOW_S", "2")) * 1700) if odd else 0
    return work(v, trips)


results = {}
dispatched = threading.Event()


def thread_a():
    v = slow(x) if case == "apart" else x
    results["f"] = f(v)
    dispatched.set()


def thread_b():
    dispatched.wait()
    if case == "serial":
        results["f"].block_until_ready()
    if case == "same" and not odd:
        from mpi4jax_dist.faults import record

        while not any(call.waiting for call in record.calls()):
            time.sleep(0.01)
    results["g"] = g(100 * x)


if case == "same" and odd:
    time.sleep(float(os.environ.get("DELAY_S", "1")))
if case == "stream":
    from jaxlib import xla_client

    with xla_client.execution_stream_id(1):
        results["f"] = f(slow(x))
    results["g"] = g(100 * x)
else:
    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
got_f = float(results["f"][0])
got_g = float(results["g"][0])
print(f"RESULT {rank} {got_f} {got_g}", flush=True)
print(f"DONE {rank}", flush=True)
