"""Every public function under bad input: an error that names the argument and what
it takes, raised before anything waits on another rank.

The table runs serially where the check needs no MPI, and under
``mpiexec -n 2 python -m pytest --with-mpi`` where it does (a communicator, an MPI
op, the ranks' shapes compared).
"""

import numpy as np
import pytest
from util import all_ranks

import mpi4jax_dist


def _bfloat16_allreduce():
    import jax.numpy as jnp

    mpi4jax_dist.allreduce(jnp.ones(3, jnp.bfloat16))


def _bfloat16_iallreduce():
    import jax.numpy as jnp

    mpi4jax_dist.iallreduce(jnp.ones(3, jnp.bfloat16))


def _mpi():
    from mpi4py import MPI

    return MPI


# (name, call, exception, words the message must hold)
WITHOUT_MPI = [
    (
        "initialize(comm=42)",
        lambda: mpi4jax_dist.initialize(comm=42),
        TypeError,
        "mpi4jax_dist.initialize: comm must be an mpi4py intracommunicator",
    ),
    (
        "topology(comm='world')",
        lambda: mpi4jax_dist.topology(comm="world"),
        TypeError,
        "mpi4jax_dist.topology: comm must be an mpi4py intracommunicator",
    ),
    (
        "global_mesh(axis_name=3)",
        lambda: mpi4jax_dist.global_mesh(axis_name=3),
        TypeError,
        "global_mesh: axis_name must be a non-empty string",
    ),
    (
        "global_mesh(axis_type='diagonal')",
        lambda: mpi4jax_dist.global_mesh(axis_type="diagonal"),
        ValueError,
        "axis_type='diagonal': expected 'auto' or 'explicit'",
    ),
    (
        "to_global(mesh='x')",
        lambda: mpi4jax_dist.to_global(np.ones(4), mesh="x"),
        TypeError,
        "to_global: mesh must be a jax.sharding.Mesh",
    ),
    (
        "to_global(scalar)",
        lambda: mpi4jax_dist.to_global(3.0),
        ValueError,
        "to_global needs an array with a leading axis",
    ),
    (
        "to_global(object())",
        lambda: mpi4jax_dist.to_global(object()),
        TypeError,
        "to_global: local must be an array",
    ),
    (
        "to_local(numpy array)",
        lambda: mpi4jax_dist.to_local(np.ones(3)),
        TypeError,
        "to_local: global_array must be a jax.Array",
    ),
    (
        "allreduce(bfloat16)",
        _bfloat16_allreduce,
        TypeError,
        "mpi4jax_dist.allreduce cannot reduce bfloat16 arrays",
    ),
    (
        "iallreduce(bfloat16)",
        _bfloat16_iallreduce,
        TypeError,
        "mpi4jax_dist.iallreduce cannot reduce bfloat16 arrays",
    ),
    (
        "allreduce(site=3)",
        lambda: mpi4jax_dist.allreduce(np.ones(3, np.float32), site=3),
        TypeError,
        "mpi4jax_dist.allreduce: site must be a str, a name the ranks compare",
    ),
    (
        "iallreduce(site='')",
        lambda: mpi4jax_dist.iallreduce(np.ones(3, np.float32), site=" "),
        ValueError,
        "mpi4jax_dist.iallreduce: site must be a non-empty name; got ' '.",
    ),
    (
        "Request.wait(3)",
        lambda: mpi4jax_dist.Request.wait(3),
        TypeError,
        "mpi4jax_dist.Request.wait: req must be the mpi4jax_dist.Request",
    ),
    (
        "Request.test('req')",
        lambda: mpi4jax_dist.Request.test("req"),
        TypeError,
        "mpi4jax_dist.Request.test: req must be the mpi4jax_dist.Request",
    ),
    (
        "Request.overlap(None, fn)",
        lambda: mpi4jax_dist.Request.overlap(None, abs, 1.0),
        TypeError,
        "mpi4jax_dist.Request.overlap: req must be the mpi4jax_dist.Request",
    ),
]

WITH_MPI = [
    (
        "initialize(comm=MPI.COMM_NULL)",
        lambda: mpi4jax_dist.initialize(comm=_mpi().COMM_NULL),
        TypeError,
        "got MPI.COMM_NULL",
    ),
    (
        "allreduce(op='sum')",
        lambda: mpi4jax_dist.allreduce(np.ones(3, np.float32), op="sum"),
        TypeError,
        "mpi4jax_dist.allreduce: op must be one of MPI.SUM",
    ),
    (
        "allreduce(comm=42)",
        lambda: mpi4jax_dist.allreduce(np.ones(3, np.float32), comm=42),
        TypeError,
        "mpi4jax_dist.allreduce: comm must be an mpi4py intracommunicator",
    ),
    (
        "iallreduce(op='sum')",
        lambda: mpi4jax_dist.iallreduce(np.ones(3, np.float32), op="sum"),
        TypeError,
        "mpi4jax_dist.iallreduce: op must be one of MPI.SUM",
    ),
    (
        "iallreduce(comm=42)",
        lambda: mpi4jax_dist.iallreduce(np.ones(3, np.float32), comm=42),
        TypeError,
        "mpi4jax_dist.iallreduce: comm must be an mpi4py intracommunicator",
    ),
    (
        "iallreduce(float32, op=MPI.BAND)",
        lambda: mpi4jax_dist.iallreduce(np.ones(3, np.float32), op=_mpi().BAND),
        TypeError,
        "mpi4jax_dist.iallreduce cannot reduce float32 with MPI.BAND",
    ),
    (
        "iallreduce(comm=MPI.COMM_NULL)",
        lambda: mpi4jax_dist.iallreduce(np.ones(3), comm=_mpi().COMM_NULL),
        ValueError,
        "mpi4jax_dist.iallreduce: comm is MPI.COMM_NULL: a communicator freed "
        "(comm.Free()), or a Split of which this rank is in no group",
    ),
    (
        "allreduce(comm=MPI.COMM_NULL)",
        lambda: mpi4jax_dist.allreduce(np.ones(3), comm=_mpi().COMM_NULL),
        ValueError,
        "mpi4jax_dist.allreduce: comm is MPI.COMM_NULL: a communicator freed "
        "(comm.Free()), or a Split of which this rank is in no group",
    ),
    (
        "allreduce(op=MPI.MAXLOC)",
        lambda: mpi4jax_dist.allreduce(np.ones(3, np.float32), op=_mpi().MAXLOC),
        TypeError,
        "; got MPI.MAXLOC. User-defined ops",
    ),
]


# Serially only: under mpiexec these would start JAX's backend before the session's
# world fixture initializes JAX's distributed runtime.
@pytest.mark.mpi_skip
@pytest.mark.parametrize(
    "call, exception, words",
    [c[1:] for c in WITHOUT_MPI],
    ids=[c[0] for c in WITHOUT_MPI],
)
def test_bad_input_without_mpi(call, exception, words):
    with pytest.raises(exception) as caught:
        call()
    assert words in str(caught.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "call, exception, words", [c[1:] for c in WITH_MPI], ids=[c[0] for c in WITH_MPI]
)
def test_bad_input_with_mpi(world, call, exception, words):
    try:
        call()
        problem = "no error"
    except exception as err:
        problem = None if words in str(err) else f"message: {err}"
    except Exception as err:  # the wrong kind: shown on every rank
        problem = f"{type(err).__name__}: {err}"
    all_ranks(problem is None, problem)


@pytest.mark.mpi(min_size=2)
def test_a_freed_communicator_is_named_as_freed(world):
    """A communicator given to a call and freed since (mpi4py makes the object
    MPI.COMM_NULL) is named as freed, not as a Split's null."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    mpi4jax_dist.allreduce(np.ones(3, np.float32), comm=comm).block_until_ready()
    comm.Free()
    try:
        mpi4jax_dist.allreduce(np.ones(3, np.float32), comm=comm)
        problem = "no error"
    except ValueError as err:
        problem = None if "comm has been freed (comm.Free())" in str(err) else str(err)
    all_ranks(problem is None, problem)


@pytest.mark.mpi(min_size=2)
def test_to_global_refuses_shapes_that_differ_over_the_ranks(world):
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    rows = 2 if rank == 0 else 4
    try:
        mpi4jax_dist.to_global(np.zeros((rows, 2), np.float32))
        problem = "no error"
    except ValueError as err:
        expected = f"rank {rank} of {MPI.COMM_WORLD.Get_size()} has ({rows}, 2) float32"
        problem = None if expected in str(err) else str(err)
    all_ranks(problem is None, problem)
    # The same shapes pass; dtypes that differ are caught too (float64 would
    # become float32 without x64: int32 against float32).
    same = mpi4jax_dist.to_global(np.zeros((2, 2), np.float32))
    all_ranks(same.shape[0] == 2 * MPI.COMM_WORLD.Get_size(), str(same.shape))
    dtype = np.float32 if rank == 0 else np.int32
    try:
        mpi4jax_dist.to_global(np.zeros((2, 2), dtype))
        problem = "no error for differing dtypes"
    except ValueError as err:
        problem = None if "differ in shape or dtype" in str(err) else str(err)
    all_ranks(problem is None, problem)
    # check=False makes no collective and no check (for hot paths).
    try:
        mpi4jax_dist.to_global(np.zeros((rows, 2), np.float32), check=False)
        problem = None
    except ValueError as err:
        problem = f"check=False still checked: {err}"
    all_ranks(problem is None, problem)
