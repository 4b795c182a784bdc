"""A node that cannot reach the coordinator's port: the job must end, naming it.

Rank 0 stands in for a coordinator that listens but never answers (its accept
queue full: further connection requests go unanswered, as behind a firewall that
drops them). Rank 1 plays the leader of another node, with a 2 s timeout: in
``thread`` mode it connects once, as after a release; in ``probe`` mode it probes
until the deadline. Either way it must abort the job, naming its host and the
address.
"""

import socket
import sys
import time

from mpi4py import MPI

from mpi4jax_dist.launch import bootstrap

mode = sys.argv[1]
comm = MPI.COMM_WORLD
if comm.rank == 0:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    held = socket.create_connection(server.getsockname())  # fills the queue
port = comm.bcast(server.getsockname()[1] if comm.rank == 0 else None)
topo = bootstrap.Topology(
    rank=comm.rank,
    size=comm.size,
    local_rank=0,
    local_size=1,
    node_index=comm.rank,
    num_nodes=comm.size,
    coordinator_address=f"127.0.0.1:{port}",
    launcher="test",
)
made = bootstrap.Bootstrap(comm=comm, timeout_s=2, topology=topo, release_mode=mode)
if comm.rank == 0:
    time.sleep(120)
elif mode == "thread":
    made._release.check_reachable()
    print("REACHED a coordinator that does not answer", flush=True)
else:
    made.release()
    print("RELEASED by a coordinator that does not answer", flush=True)
