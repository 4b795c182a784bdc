"""The program tests/cluster/test_slurm_cluster.py runs on the Slurm test cluster.

Each rank prints one ``RESULT {json}`` line: where it runs (host, MPI rank, the
package's topology), JAX's view of the world, the cross-process checks of
launch_common, and the bytes its node's network interface sent while one MPI
allreduce and one JAX psum of ``--bytes`` ran (``eth0`` of the node's namespace:
traffic that crossed the bridge, not shared memory).

``--mpi-only``: only the MPI allreduce and its traffic, no JAX.

``--alone``: JAX alone, without ``import mpi4jax_dist``: the world a user gets who
calls ``jax.distributed.initialize()`` with nothing else (JAX's own cluster
detection), with a short initialization timeout; with ``--allgather``, then one
``process_allgather`` across it.

``--hold S``: after the checks, print ``HOLDING`` and keep calling a collective
for S seconds (the test cuts a node's network meanwhile); ``--heartbeat T`` gives
initialize that heartbeat timeout.
"""

import argparse
import os
import socket
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--alone", action="store_true")
parser.add_argument("--allgather", action="store_true")
parser.add_argument("--mpi-only", action="store_true")
parser.add_argument("--bytes", type=int, default=0)
parser.add_argument("--hold", type=float, default=0)
parser.add_argument("--heartbeat", type=int, default=None)
args = parser.parse_args()

if not (args.alone or args.mpi_only):
    import mpi4jax_dist  # noqa: F401  (first: it may point jaxlib at MPI)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from launch_common import describe, report  # noqa: E402
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
fields = {
    "rank": comm.Get_rank(),
    "size": comm.Get_size(),
    "host": socket.gethostname(),
}
try:
    socket.getaddrinfo(fields["host"], None)
    fields["host_resolves"] = True
except OSError:
    fields["host_resolves"] = False


def sent() -> int:
    """Bytes this node's eth0 has sent (/proc/net/dev: this namespace's)."""
    return psutil.net_io_counters(pernic=True)["eth0"].bytes_sent


def node_traffic(step) -> int:
    """Bytes this node sent on its network while every rank ran ``step``."""
    comm.Barrier()
    before = sent()
    step()
    comm.Barrier()
    return sent() - before


def mpi_traffic() -> int:
    """Bytes this node sent during one MPI allreduce of ``--bytes``."""
    message = np.ones(args.bytes // 4, dtype=np.float32)
    out = np.empty_like(message)
    return node_traffic(lambda: comm.Allreduce(message, out))


if args.mpi_only:
    report(**fields, sent_by_mpi=mpi_traffic())
    sys.exit(0)

if args.alone:
    try:
        jax.distributed.initialize(initialization_timeout=30)
        fields.update(
            process_index=jax.process_index(), process_count=jax.process_count()
        )
        if args.allgather:
            from jax.experimental import multihost_utils

            me = np.array([jax.process_index()])
            gathered = multihost_utils.process_allgather(me)
            fields["allgather"] = np.asarray(gathered).reshape(-1).tolist()
    except Exception as err:
        fields["error"] = describe(err)
    report(**fields)
    sys.exit(0)

from launch_common import cross_process_checks  # noqa: E402

from mpi4jax_dist import _compat  # noqa: E402

kwargs = {} if args.heartbeat is None else {"heartbeat_timeout_seconds": args.heartbeat}
jax.distributed.initialize(**kwargs)
topo = mpi4jax_dist.topology()
fields.update(
    local_rank=topo.local_rank,
    node_index=topo.node_index,
    num_nodes=topo.num_nodes,
    coordinator=topo.coordinator_address,
    launcher=topo.launcher,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    cpu_collectives=_compat.cpu_collectives(),
    gloo_address=_compat.published_gloo_address(),
    http_proxy=os.environ.get("http_proxy"),
    no_grpc_proxy=os.environ.get("no_grpc_proxy"),
)
fields.update(cross_process_checks())
if args.bytes:
    fields["sent_by_mpi"] = mpi_traffic()
    message = np.ones(args.bytes // 4, dtype=np.float32)
    mesh = mpi4jax_dist.global_mesh()
    psum = jax.jit(
        _compat.shard_map(
            lambda x: jax.lax.psum(x, "ranks"),
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec("ranks"),
            out_specs=jax.sharding.PartitionSpec("ranks"),
        )
    )
    array = mpi4jax_dist.to_global(message, mesh)
    psum(array).block_until_ready()  # compiled and Gloo connected: not counted
    fields["sent_by_psum"] = node_traffic(lambda: psum(array).block_until_ready())
report(**fields)

if args.hold:
    import time

    from jax.experimental import multihost_utils

    print("HOLDING", flush=True)
    end = time.monotonic() + args.hold
    while time.monotonic() < end:
        multihost_utils.process_allgather(np.array([topo.rank]))
        time.sleep(0.1)
