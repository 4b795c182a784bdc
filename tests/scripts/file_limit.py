"""Initialize under mpiexec and report rank 0's open-file limits, for the tests of
the bootstrap's file-limit check. One line "RESULT {json}" per rank."""

import resource
import time

import jax
from launch_common import report

import mpi4jax_dist  # noqa: F401  (registers the cluster env)
from mpi4jax_dist.launch import bootstrap

before = resource.getrlimit(resource.RLIMIT_NOFILE)
# The cause's time, for the test's "at once" (tests/util.py's seconds_from).
print(f"INITIALIZING AT {time.monotonic():.3f}", flush=True)
jax.distributed.initialize(initialization_timeout=60)
report(
    rank=jax.process_index(),
    before=list(before),
    after=list(resource.getrlimit(resource.RLIMIT_NOFILE)),
    raised=bootstrap.current().file_limit_raised,
)
