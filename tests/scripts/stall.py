"""A job with one stalled rank (tests/jobs/test_hangs.py,
tests/cluster/test_slurm_cluster.py).

Every rank makes 3 jitted ``mpi4jax_dist.allreduce`` calls, prints ``READY``; then
rank ``STALL_RANK`` (default the last) prints ``STALL <epoch seconds>`` and sleeps
``STALL_S`` seconds in ``stalled_compute`` while the others wait, by ``MODE``: in a
4th call (``allreduce``, the default), on an ``iallreduce`` (``iallreduce``), in a
jitted ``mpi4jax.allreduce`` (``mpi4jax``), in a ``shard_map`` ``psum`` across the
processes, its first made together (``psum``: JAX's own CPU collectives), in
``multihost_utils.sync_global_devices`` (``sync``) or in an mpi4py
``comm.Barrier()`` (``barrier``). With ``GIL=1`` the stalled rank holds Python's
GIL instead of sleeping (a C call that never releases it: ``usleep`` through
``ctypes.PyDLL``); with ``GIL=thread`` a thread of its own holds the GIL while its
main thread waits in an allreduce on a duplicate of the world that no other rank
calls; with ``STOP=1`` it stops itself (``SIGSTOP``: not even C code of its own
runs). Prints ``DONE`` at the end.

Two jobs without a stalled rank, for the hang timeout's false alarms: ``MODE=steps``
(every rank makes short jitted steps for ``STALL_S`` seconds) and ``MODE=together``
(every rank sleeps ``STALL_S`` seconds at one line, then takes a step; with
``EARLY_S``, rank ``STALL_RANK`` wakes that much sooner and every rank exits
instead).
"""

import ctypes
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp

import mpi4jax_dist

jax.distributed.initialize()

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
alone = comm.Dup()  # GIL=thread: the stalled rank's call that nobody matches
rank, size = comm.Get_rank(), comm.Get_size()
stall = int(os.environ.get("STALL_RANK", size - 1))
mode = os.environ.get("MODE", "allreduce")

step = jax.jit(lambda x: mpi4jax_dist.allreduce(x, comm=comm) / size)


def overlapped(x):
    request = mpi4jax_dist.iallreduce(x, comm=comm)
    return request.wait()


def waits(mode):
    """What the ranks that do not stall wait in."""
    if mode in ("allreduce", "steps", "together"):
        return step
    if mode == "iallreduce":
        return jax.jit(overlapped)
    if mode == "mpi4jax":
        import mpi4jax

        return jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm) / size)
    if mode == "psum":
        from jax.sharding import PartitionSpec

        from mpi4jax_dist import _compat

        mesh = mpi4jax_dist.global_mesh()
        summed = jax.jit(
            _compat.shard_map(
                lambda a: jax.lax.psum(a, "ranks"),
                mesh=mesh,
                in_specs=PartitionSpec("ranks"),
                out_specs=PartitionSpec("ranks"),
            )
        )
        # The global array is made and summed once before the stall (to_global
        # checks the ranks' shapes with an MPI allreduce; the first psum makes
        # its communicator): the others then wait in the psum itself.
        made = {}

        def prepare(x):
            made["x"] = mpi4jax_dist.to_global(x, mesh)
            summed(made["x"]).block_until_ready()

        before_stall.append(prepare)
        return lambda x: mpi4jax_dist.to_local(summed(made["x"]))
    if mode == "sync":
        from jax.experimental import multihost_utils

        def sync(x):
            multihost_utils.sync_global_devices("stall")
            return x

        return sync
    if mode == "barrier":

        def barrier(x):
            comm.Barrier()
            return x

        return barrier
    raise SystemExit(f"stall.py: MODE={mode!r} is not one of the modes it knows")


before_stall = []  # what every rank does first, with the steps' result
later = waits(mode)
x = jnp.ones(4)
for _ in range(3):
    x = step(x)
x.block_until_ready()
for prepare in before_stall:
    prepare(x)
print(f"READY {rank}", flush=True)


def stalled_compute():
    seconds = float(os.environ.get("STALL_S", "600"))
    if os.environ.get("STOP") == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif os.environ.get("GIL") == "1":
        # usleep through the C API with the GIL held: no Python thread runs.
        ctypes.PyDLL(None).usleep(int(seconds * 1e6))
    elif os.environ.get("GIL") == "thread":

        def hold():
            time.sleep(1)  # the main thread is in the allreduce by then
            ctypes.PyDLL(None).usleep(int(seconds * 1e6))

        threading.Thread(target=hold, daemon=True).start()
        if mode == "psum":  # one psum the others make too, then one they never make
            for _ in range(2):
                later(x).block_until_ready()
        else:
            mpi4jax_dist.allreduce(jnp.ones(2), comm=alone).block_until_ready()
    else:
        time.sleep(seconds)


if mode == "steps":  # the same number of steps on every rank: 0.1 s each at least
    for _ in range(int(float(os.environ.get("STALL_S", "10")) * 10)):
        x = step(x).block_until_ready()
        time.sleep(0.1)
elif mode == "together" and os.environ.get("EARLY_S"):
    # Rank STALL_RANK wakes EARLY_S seconds sooner and goes to its exit while the
    # others sleep on; then no rank takes the last step.
    early = float(os.environ["EARLY_S"]) if rank == stall else 0.0
    time.sleep(float(os.environ["STALL_S"]) - early)
    print(f"DONE {rank}", flush=True)
    raise SystemExit(0)
elif mode == "together":
    stalled_compute()
elif rank == stall:
    print(f"STALL {time.time():.3f}", flush=True)
    stalled_compute()
x = later(x).block_until_ready()
print(f"DONE {rank}", flush=True)
