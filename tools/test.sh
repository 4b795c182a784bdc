#!/usr/bin/env bash
# Run every test: serially (unit tests, and launch tests that start their own mpiexec),
# then with peers under mpiexec -n 2 and -n 4. Needs tools/setup.sh first.
# Every MPI run has a time limit: a hung rank fails the run, it does not stall it.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$here/.venv}
export PATH="$venv/bin:$PATH"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
cd "$here"

run() { echo "+ $*"; "$@"; }

# What the job looks like, first, so that a failing log shows the environment.
run timeout -k 10 300 mpiexec -n 2 python -m mpi4jax_dist --check
run timeout -k 10 1200 python -m pytest
for n in 2 4; do
    run timeout -k 10 900 mpiexec -n "$n" python -m pytest --with-mpi -q -p no:cacheprovider
done
