"""Initialize under mpiexec and report, for the robustness tests.

argv: [late_rank [late_seconds]] ; environment decides the rest.
Prints one line "RESULT {json}" per rank.
"""

import json
import os
import sys
import time

import jax

import mpi4jax_dist
from mpi4jax_dist.launch import network

late_rank = int(sys.argv[1]) if len(sys.argv) > 1 else -1
late_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
timeout = int(os.environ.get("TEST_INIT_TIMEOUT", "60"))

from mpi4py import MPI  # noqa: E402  (MPI up before the late rank dawdles)

rank = MPI.COMM_WORLD.Get_rank()
if rank == late_rank:
    time.sleep(late_s)
t0 = time.perf_counter()
# The cause's time, for the tests' "fails fast" (tests/util.py's seconds_from).
print(f"INITIALIZING AT {time.monotonic():.3f}", flush=True)
jax.distributed.initialize(initialization_timeout=timeout)
elapsed = time.perf_counter() - t0
topo = mpi4jax_dist.topology()
host, port = topo.coordinator_address.rsplit(":", 1)
result = {
    "rank": rank,
    "process_index": jax.process_index(),
    "init_s": elapsed,
    "coordinator": topo.coordinator_address,
    "no_grpc_proxy": os.environ.get("no_grpc_proxy"),
    "http_proxy": os.environ.get("http_proxy"),
    "bind": os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"),
}
if rank == 0:
    result["answers_on_coordinator"] = network.accepts(host, int(port))
    other = network.routable_address()
    result["other_address"] = other
    result["answers_on_other"] = network.accepts(other, int(port))
print("RESULT " + json.dumps(result), flush=True)
