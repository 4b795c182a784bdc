"""A release by probing whose coordinator never listens: the job must end.

Rank 0 stands in for a coordinator that never comes up (it sleeps); the other ranks
probe its port with a 2 s deadline, then abort the job naming what they waited for.
"""

import socket
import time

from mpi4py import MPI

from mpi4jax_dist.launch import bootstrap

comm = MPI.COMM_WORLD
with socket.socket() as sock:  # a port that nothing listens on once closed
    sock.bind(("127.0.0.1", 0))
    port = comm.bcast(sock.getsockname()[1])
topo = bootstrap.Topology(
    rank=comm.rank,
    size=comm.size,
    local_rank=comm.rank,
    local_size=comm.size,
    node_index=0,
    num_nodes=1,
    coordinator_address=f"127.0.0.1:{port}",
    launcher="test",
)
made = bootstrap.Bootstrap(comm=comm, timeout_s=2, topology=topo, release_mode="probe")
if comm.rank == 0:
    time.sleep(120)
else:
    made.release()
    print("RELEASED without a coordinator", flush=True)
