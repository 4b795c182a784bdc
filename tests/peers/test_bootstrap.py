"""The bootstrap with peers (mpiexec -n 2 and 4, python -m pytest --with-mpi): the
topology, the counts of its collectives, initialize, the global mesh, psum and
to_global.

Every rank runs every test; asserts gather the outcome first, so that one failing
rank does not leave the others waiting in the next collective.
"""

import numpy as np
import pytest
import util
from util import all_ranks

import mpi4jax_dist
from mpi4jax_dist.launch import bootstrap, waits

pytestmark = pytest.mark.mpi(min_size=2)


@util.more_ranks  # local ranks 2 and 3 beside 0 and 1 on one node
def test_topology_matches_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    topo = mpi4jax_dist.topology()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    expected = (comm.rank, comm.size, node.rank, node.size)
    node.Free()
    got = (topo.rank, topo.size, topo.local_rank, topo.local_size)
    all_ranks(got == expected, f"{got} != {expected}")
    addresses = comm.allgather(topo.coordinator_address)
    all_ranks(len(set(addresses)) == 1, f"coordinators differ: {addresses}")
    all_ranks(topo.num_nodes == 1 and topo.node_index == 0, str(topo))
    all_ranks(topo.coordinator_address.startswith("127.0.0.1:"), str(topo))
    all_ranks(topo.launcher == "mpich-hydra" or topo.launcher != "mpi", topo.launcher)


# The bootstrap's budget: at most five communicating calls compute the topology and
# the coordinator, each with a payload of at most 1024 bytes per rank.
TOPOLOGY_CALLS = 5
PAYLOAD_BYTES = 1024


def bootstrap_problems(calls) -> list[str]:
    """Return what breaks the bootstrap's budget in ``calls`` (as recorded)."""
    problems = [
        f"{c.name}: not a call we know the cost of"
        for c in calls
        if c.kind == "unknown"
    ]
    arrival = [c.name for c in calls if c.phase == "arrival"]
    if arrival != ["Idup"]:
        problems.append(f"arrival makes {arrival}, expected one Idup")
    topology = [
        c
        for c in calls
        if c.phase == "topology" and c.kind in ("collective", "unknown")
    ]
    if not 0 < len(topology) <= TOPOLOGY_CALLS:
        problems.append(
            f"{len(topology)} communicating calls compute the topology: "
            f"{[c.name for c in topology]}"
        )
    problems += [
        f"{c.name} hands MPI {c.bytes_per_rank} bytes"
        for c in calls
        if c.bytes_per_rank is None or c.bytes_per_rank > PAYLOAD_BYTES
    ]
    # Where the MPI itself needs O(P) bytes per rank, the record must say so: a
    # split in MPICH (Intel MPI is its code) and Open MPI's general Split; Open
    # MPI's node split sends O(1) bytes (the locality it holds already).
    openmpi = util.mpi_family() == "openmpi"
    problems += [
        f"{c.name} does not say what the MPI adds: {c.mpi_adds!r}"
        for c in calls
        if c.name.startswith("Split")
        and ("O(log P)" if openmpi and c.name == "Split_type" else "O(P)")
        not in c.mpi_adds
    ]
    return problems


def test_bootstrap_calls_counted_as_they_ran():
    from mpi4py import MPI

    mpi4jax_dist.topology()
    calls = bootstrap.current().log.calls
    # Every rank makes the same collectives (local calls differ: leaders free
    # their split).
    before_release = [
        (c.name, c.phase, c.bytes_per_rank)
        for c in bootstrap.collectives()
        if c.phase != "release"
    ]
    lists = MPI.COMM_WORLD.allgather(before_release)
    all_ranks(all(m == lists[0] for m in lists), f"ranks disagree: {lists}")
    problems = bootstrap_problems(calls)
    all_ranks(not problems, f"{problems} in {calls}")
    names = [c.name for c in bootstrap.collectives() if c.phase == "topology"]
    expected = ["Split_type", "Iexscan", "Iallreduce", "Ibcast", "Ibcast"]
    all_ranks(names == expected, f"{names}")


class ExtraBroadcast(bootstrap.Bootstrap):
    """A bootstrap with one collective more than it needs: what the count must see."""

    def _node_numbers(self, comm, node, local_rank, unusable, deadline):
        spare = np.zeros(1)
        waits.wait(comm.Ibcast(spare, root=0), deadline, "a broadcast nobody needs")
        return super()._node_numbers(comm, node, local_rank, unusable, deadline)


class ExtraBarrier(bootstrap.Bootstrap):
    """A bootstrap calling an MPI function the cost table does not know."""

    def _node_numbers(self, comm, node, local_rank, unusable, deadline):
        comm.Barrier()
        return super()._node_numbers(comm, node, local_rank, unusable, deadline)


def close(made: bootstrap.Bootstrap) -> None:
    """Free what a bootstrap that will not release still holds."""
    held = made._release
    for comm in (held.private, held.node):
        if comm is not None:
            comm.Free()
    if held.reservation is not None:
        held.reservation.close()


@pytest.mark.parametrize(
    "cls, caught",
    [
        (bootstrap.Bootstrap, None),
        (ExtraBroadcast, "6 communicating calls compute the topology"),
        (ExtraBarrier, "Barrier: not a call we know the cost of"),
    ],
)
def test_an_added_collective_is_counted(cls, caught):
    from mpi4py import MPI

    made = cls(comm=MPI.COMM_WORLD, timeout_s=60)
    try:
        topo = made.run()
    finally:
        close(made)
    all_ranks(topo.size == MPI.COMM_WORLD.size, str(topo))
    problems = bootstrap_problems(made.log.calls)
    if caught is None:
        all_ranks(not problems, str(problems))
    else:
        all_ranks(any(caught in p for p in problems), f"not caught: {problems}")


def test_later_calls_must_ask_for_the_same_settings():
    from mpi4py import MPI

    topo = mpi4jax_dist.topology()
    port = int(topo.coordinator_address.rpartition(":")[2])
    first = bootstrap.Bootstrap(
        comm=MPI.COMM_WORLD, timeout_s=60, timeout_explicit=True, topology=topo
    )
    first.check_settings(comm=MPI.COMM_WORLD, port=port, timeout_s=60)
    with pytest.raises(RuntimeError, match="initialization_timeout=30 asked for"):
        first.check_settings(timeout_s=30)
    with pytest.raises(RuntimeError, match=f"coordinator port {port + 1} asked for"):
        first.check_settings(port=port + 1)
    with pytest.raises(RuntimeError, match="another communicator"):
        first.check_settings(comm=MPI.COMM_SELF)
    # A first call that asked for no timeout (JAX's default) takes a later one.
    default = bootstrap.Bootstrap(comm=MPI.COMM_WORLD, topology=topo)
    default.check_settings(timeout_s=30)
    assert (default.timeout_s, default.timeout_explicit) == (30, True)


@util.more_ranks  # JAX's process index is the rank for ranks beyond 0 and 1
def test_initialize_gives_mpi_rank(world):
    import jax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    got = (jax.process_index(), jax.process_count(), jax.device_count())
    all_ranks(got == (comm.rank, comm.size, comm.size), f"{got}")
    all_ranks(world == mpi4jax_dist.topology(), f"{world}")
    # Idempotent: a second call checks and returns the same topology.
    all_ranks(mpi4jax_dist.initialize() is world, "second initialize differs")


@util.more_ranks  # two ranks have one wrong order; four have 23
def test_global_mesh_in_rank_order(world):
    mesh = mpi4jax_dist.global_mesh()
    owners = [d.process_index for d in mesh.devices.flat]
    all_ranks(owners == list(range(world.size)), f"mesh order {owners}")
    assert mesh.axis_names == ("ranks",)


@util.more_ranks  # JAX's psum over more than a pair of processes
def test_psum_equals_mpi4jax_allreduce(world):
    import jax
    import jax.numpy as jnp
    import mpi4jax
    from jax.sharding import PartitionSpec as P
    from mpi4py import MPI

    from mpi4jax_dist import _compat

    mesh = mpi4jax_dist.global_mesh()
    local = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) * (world.rank + 1)

    summed = jax.jit(
        _compat.shard_map(
            lambda a: jax.lax.psum(a, "ranks"),
            mesh=mesh,
            in_specs=P("ranks"),
            out_specs=P("ranks"),
        )
    )(mpi4jax_dist.to_global(local, mesh))
    by_psum = np.asarray(mpi4jax_dist.to_local(summed))
    by_mpi4jax = np.asarray(jax.jit(lambda a: mpi4jax.allreduce(a, op=MPI.SUM))(local))
    expected = np.arange(6.0).reshape(2, 3) * sum(range(1, world.size + 1))
    all_ranks(np.array_equal(by_psum, by_mpi4jax), f"{by_psum} != {by_mpi4jax}")
    all_ranks(np.array_equal(by_psum, expected), f"{by_psum} != {expected}")


@util.more_ranks  # four row blocks in rank order
def test_to_global_and_back(world):
    import jax
    import jax.numpy as jnp

    local = jnp.full((3, 2), world.rank, dtype=jnp.int32)
    g = mpi4jax_dist.to_global(local)
    all_ranks(g.shape == (3 * world.size, 2), f"shape {g.shape}")
    # Row block r of the global array is rank r's data: its row sums say so.
    rows = jax.jit(lambda a: a.sum(axis=1), out_shardings=None)(g)
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
    expected = np.repeat(np.arange(world.size) * 2, 3)
    all_ranks(np.array_equal(every, expected), f"{every} != {expected}")
    back = np.asarray(mpi4jax_dist.to_local(g))
    all_ranks(np.array_equal(back, np.asarray(local)), f"{back}")


@util.more_ranks  # two rounds and more: a round a poll was the fault
def test_the_hang_timeout_s_reduction_runs_its_rounds_at_the_fast_poll():
    """The hang timeout's verdict, a reduction that moves a round only when both
    ranks of the round test it: at the watchdog's poll of a second, each round took
    a second (1 to 3 s at 4 ranks, about log2 P rounds), as long as rank 0 then
    waited before taking a reduction still pending for a rank whose watchdog cannot
    run (a false hang, seen in CI). Every rank posts when a period of the clock
    starts and tests at the fast poll after posting: the watchdog's own loop, on a
    communicator of its own, its main thread making progress (no report)."""
    import time

    from mpi4py import MPI

    from mpi4jax_dist.faults import watchdog as watchdogs

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("the watchdog calls MPI from its thread")
    comm = MPI.COMM_WORLD.Dup()
    watchdog = watchdogs.Watchdog(comm, hang_timeout_s=2)
    verdict, took = watchdog.verdict, []
    test = verdict.test

    def timed():
        result = test()
        if result is not None:
            took.append(time.monotonic() - verdict.posted_at)
        return result

    verdict.test = timed
    watchdog.start()
    end = time.monotonic() + 3 * watchdog.period_s
    while time.monotonic() < end:
        time.sleep(0.05)
    watchdog.stop()
    comm.Free()
    all_ranks(len(took) >= 3, f"{len(took)} reductions in 3 periods: {took}")
    all_ranks(max(took) < watchdogs.POLL_S / 2, f"seconds to complete: {took}")
