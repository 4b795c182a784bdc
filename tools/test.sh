#!/usr/bin/env bash
# Run every test, in three parts. First three lanes at once: in .venv (Python >=
# 3.12, the newest JAX) the suite serially (unit tests, and launch tests that start
# their own mpiexec; not the build's); beside it, on the oldest JAX that setup.cfg
# allows, the serial tests of what meets JAX and its runs with peers (mpiexec -n
# 2), then .venv's tests of the build's MPI compiler wrapper; and the launch tests
# under Open MPI's and Intel MPI's mpiexec. Then .venv's runs with peers, one at a
# time: under mpiexec -n 2 and, those that need more ranks, -n 4; the
# non-blocking and in-place allreduces under Open MPI and Intel MPI; beside them,
# the tests on a Slurm cluster of network namespaces (as root).
# The other environments than .venv run where tools/setup.sh built them (--all).
# Needs tools/setup.sh first.
# Every MPI run has a time limit: a hung rank fails the run, it does not stall it.
#
#   bash tools/test.sh          # what CI runs (.ci/run)
#   bash tools/test.sh --full   # and, under the other MPIs and JAX, the tests marked
#                               # variant too, and those marked full_only
#                               # (tests/util.py): before a release
set -euo pipefail

full=
case "${1:-}" in
    --full) full=1 ;;
    "") ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
               exit 0 ;;
    *) echo "tools/test.sh: unknown argument $1 (--full, or none)" >&2; exit 2 ;;
esac
# The stages of another MPI or JAX leave out the further cases of what their kept
# tests already run there (tests marked variant), unless --full.
not_variant=$([ -n "$full" ] || echo " and not variant")

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$here/.venv}
export PATH="$venv/bin:$PATH"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
cd "$here"

# Each stage says what it ran and how long it took: CI's log then shows where the
# time goes.
# A stage whose time limit (timeout's exit 124, or 137 where -k killed it) ran out
# says so, with how long it ran, before the script ends.
# With the seconds, the CPU seconds of what the stage ran (its processes, once
# ended: a lane keeps less than a core busy, or more), from the children's times
# in /proc of a subshell that runs the stage alone (the shell's own would count a
# lane beside it that ended meanwhile), the orphans tools/reaped.py reaps included.
children_cpu() {
    local stat
    read -r stat </proc/$BASHPID/stat
    set -- ${stat##*) }
    cpu_ticks=$((${14} + ${15}))
}
# A command (not a function of this script) runs under tools/reaped.py, which
# reaps what it leaves (the ranks of a job MPI_Abort ended, which init would
# reap): their CPU then counts for the stage.
run() {
    echo "+ $*"
    local start=$SECONDS status=0 reaped=()
    if [ "$(type -t "$1")" = file ]; then
        reaped=("$venv/bin/python" "$here/tools/reaped.py")
    fi
    (
        status=0
        "${reaped[@]}" "$@" || status=$?
        children_cpu
        echo "+ took $((SECONDS - start)) s, $((cpu_ticks / $(getconf CLK_TCK))) s of CPU"
        exit "$status"
    ) || status=$?
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "tools/test.sh: the stage above ran out of its time limit after" \
            "$((SECONDS - start)) s (exit $status): run it alone, as printed after" \
            "its +, to see how long it takes on this machine" >&2
    fi
    return "$status"
}

# The code's own habits: black's layout and ruff's lint (versions pinned in setup.cfg).
run black --check --quiet .
run ruff check --quiet .
# The documentation, with every Sphinx warning an error (docs/conf.py).
run python -m sphinx -W --keep-going -q -b html docs docs/_build/html
# What the job looks like, first, so that a failing log shows the environment.
run timeout -k 10 300 mpiexec -n 2 python -m mpi4jax_dist --check

# The tree's modules compiled once, as pip compiles an installed package's: .venv
# runs the package from the tree (editable), every environment the tests from it,
# and where PYTHONDONTWRITEBYTECODE is set (as on these VMs) each process
# compiled them again: 80 ms of a rank's start (1.04 against 0.96 CPU-s for
# `import mpi4jax_dist`, medians of 8), some 1,000 rank starts a run.
compile_tree() { "$1" -m compileall -q -j 0 mpi4jax_dist tests benchmarks examples >/dev/null; }
run compile_tree python

# The oldest JAX that setup.cfg allows (tools/setup.sh --with-oldest-jax), on Python
# 3.11, installed from a copy of the tree: PYTHONSAFEPATH keeps the tree's package
# off sys.path. The JAX releases between it and .venv's, and the last JAX of Python
# 3.11, are tools/jax_sweep.sh's rows (by hand: docs/support.rst).
jaxmin=${VENV_JAXMIN:-$here/.venv-jaxmin}
in_jaxmin=(env PATH="$jaxmin/bin:$PATH" PYTHONSAFEPATH=1)

# 1. Three lanes at once: the jobs of a serial suite mostly wait out faults'
# timeouts (a launch stage alone keeps under one core busy); with three lanes the
# cores were 1.86 to 2.00 of 2 busy throughout (/proc/stat, 2026-12-07), so that
# CI's time is its CPU work. The lanes of another JAX and MPI run beside .venv's
# serial suite; their output is kept and shown when they end. (Four lanes, Open
# MPI's and Intel MPI's apart, were no faster, the first part 734 to 804 s, and
# their added load broke two timing checks: an Open MPI job that ends within 15 s
# took 15.9; 2026-12-07.)
# .venv's serial suite runs in two streams (pytest-xdist, a file to a stream): two
# made it 583 s alone against 903 in one. The other lanes' suites in two streams
# too were no faster (part 1 1,511 s against 1,494 to 1,585 in one; 2026-12-07):
# /proc/stat showed both cores busy from setup to the end of part 2, so that only
# less CPU work shortens CI, and their streams cost 10 to 40 CPU-s more a stage.
# Every lane's jobs oversubscribe the cores: each MPI's waiting ranks sleep rather
# than spin (tests/util.py's YIELD, which clean_env sets for the jobs the tests
# start; here MPICH's for the runs with peers beside the others). The jobs' Pythons
# skip CPython's last collections at exit (tests/quick_exit), a fifth of a short
# rank's CPU.
#
# tests/ holds a folder for each way its tests run: unit (one process), docs, peers
# (under mpiexec --with-mpi; serially too, where they also hold tests of one
# process), gpu (likewise, where a GPU is), jobs (each test starts its own
# mpiexec), packaging (builds), cluster (a Slurm cluster). Markers choose within:
# same_under_every_jax, every_mpi, same_under_every_mpi, more_ranks (tests/util.py).
#
# On the oldest JAX, the tests that meet what changes between JAX versions (not
# those marked same_under_every_jax: the launcher, network, limit and benchmark
# tests, whose JAX calls are those of the tests kept). Not the docs, nor the
# packaging: setup.sh built these environments' package from a copy of the tree
# against their JAX already, and .venv's run builds the sdist.
# The other MPIs (tools/setup.sh --with-openmpi, --with-intel-mpi), each running its
# own installed copy (its build is for its MPI; the tree's is .venv's):
# PYTHONSAFEPATH=1 keeps the tree's package off sys.path. They run the tests marked
# every_mpi (what differs between MPIs: the launcher, aborts, threads), less those
# whose check is the package's logic alone (same_under_every_mpi: a switch, a
# message).
ompi=${VENV_OMPI:-$here/.venv-ompi}
impi=${VENV_IMPI:-$here/.venv-impi}
in_ompi=(env PATH="$ompi/bin:$PATH" PYTHONSAFEPATH=1)
in_impi=(env PATH="$impi/bin:$PATH" PYTHONSAFEPATH=1)
if [ -x "$ompi/bin/python" ]; then
    in_impi+=(TEST_OTHER_MPI_PYTHON="$ompi/bin/python")
fi
other_mpi=(-m "every_mpi and not same_under_every_mpi$not_variant" tests/jobs)
# The lanes' limits are twice what their stages took on the slowest VM seen
# (2026-12-07: .venv's serial suite 1.7 times the CPU it took on the VMs before;
# JAX 0.6.0's 967 s, Open MPI's launch tests 743 s): a limit is there for a stage
# whose own jobs' limits failed, not to time it.
# A lane (a subshell of its own) runs each of its stages whatever the one before
# found, so that a failing log shows them all, and returns the first failure's
# status.
first_failure=0
also() { "$@" || { local status=$?; [ "$first_failure" -ne 0 ] || first_failure=$status; }; }
oldest_jax_lane() {
    if [ -x "$jaxmin/bin/python" ]; then
        also run compile_tree "$jaxmin/bin/python"
        also run "${in_jaxmin[@]}" timeout -k 10 2000 python -m pytest -q \
            -p no:cacheprovider -m "not same_under_every_jax$not_variant" \
            tests/unit tests/peers tests/gpu tests/jobs
        also run "${in_jaxmin[@]}" MPIR_CVAR_ENABLE_HEAVY_YIELD=1 timeout -k 10 900 \
            mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider \
            -m "not same_under_every_jax$not_variant"
    else
        echo "+ no $jaxmin: oldest-JAX stage not run (bash tools/setup.sh --with-oldest-jax)"
    fi
    # .venv's tests of the build's MPI compiler wrapper (one build of the extension
    # with a stand-in Cray cc) and of the sdist, the wheel and an install from them:
    # in the shortest lane (CI37: .venv's suite 727 s, this lane 601 before them).
    also run timeout -k 10 1200 python -m pytest -q -p no:cacheprovider \
        -m "${full:+full_only or }not full_only" tests/packaging
    return "$first_failure"
}
other_mpi_lane() {
    # Open MPI: the launch tests again under its own mpiexec, and each MPI's mpi4py
    # under the other's mpiexec: the mismatch must be caught.
    if [ -x "$ompi/bin/mpiexec" ]; then
        also run "${in_ompi[@]}" TEST_OTHER_MPI_PYTHON="$venv/bin/python" \
            timeout -k 10 1500 "$ompi/bin/python" -m pytest -q -p no:cacheprovider \
            "${other_mpi[@]}"
    else
        echo "+ no $ompi: Open MPI stage not run (bash tools/setup.sh --with-openmpi)"
    fi
    # Intel MPI: the launch tests under its mpiexec, Open MPI's mpi4py under it (to
    # be caught), and the bootstrap benchmark once at 2 ranks, printing its table;
    # in part 2 its non-blocking and in-place allreduces.
    if [ -x "$impi/bin/mpiexec" ]; then
        also run "${in_impi[@]}" timeout -k 10 1500 "$impi/bin/python" -m pytest -q \
            -p no:cacheprovider "${other_mpi[@]}"
        also run "${in_impi[@]}" timeout -k 10 600 "$impi/bin/python" \
            benchmarks/bootstrap.py --procs 2 --repeat 1
    else
        echo "+ no $impi: Intel MPI stage not run (bash tools/setup.sh --with-intel-mpi)"
    fi
    return "$first_failure"
}
# Lanes run beside the others, each one's output kept (start_beside LABEL
# COMMAND...) and shown with its exit status once it has ended (show_beside, which
# waits for every lane started, in order, and returns the first failure's status;
# nothing where none runs).
beside_pids=() beside_labels=() beside_logs=()
start_beside() {
    beside_labels+=("$1")
    shift
    beside_logs+=("$(mktemp)")
    "$@" >"${beside_logs[-1]}" 2>&1 &
    beside_pids+=("$!")
}
show_beside() {
    local i status=0 first=0
    for i in "${!beside_pids[@]}"; do
        status=0
        wait "${beside_pids[$i]}" || status=$?
        echo "+ ${beside_labels[$i]} (exit $status):"
        cat "${beside_logs[$i]}"
        rm -f "${beside_logs[$i]}"
        [ "$first" -ne 0 ] || first=$status
    done
    beside_pids=() beside_labels=() beside_logs=()
    return "$first"
}
start_beside "beside the stage above, the oldest JAX, then .venv's packaging" \
    oldest_jax_lane
start_beside "beside the stage above, Open MPI and Intel MPI" other_mpi_lane
# Where a stage fails, this script ends once those beside it have (each has its time
# limit), and shows what they found.
trap 'status=$?; show_beside || true; exit "$status"' EXIT

# In two streams (above), with Open MPI's Python at hand (tools/setup.sh
# --with-openmpi): under MPICH's mpiexec its mpi4py starts as singletons, which the
# package must catch. In two streams 730 to 800 s beside the stages above on
# 2026-12-07's first 2-core VM, 1,268 s on a slower one that evening; a limit of
# 2,600 s ends it if one of its jobs outlives its own limits.
other=()
if [ -x "$ompi/bin/python" ]; then
    other=(env TEST_OTHER_MPI_PYTHON="$ompi/bin/python")
fi
run "${other[@]}" timeout -k 10 2600 python -m pytest -n 2 --dist loadfile tests/unit \
    tests/docs tests/peers tests/gpu tests/jobs

trap - EXIT
beside_status=0
show_beside || beside_status=$?

# 3. Beside part 2 (whose runs keep both cores busy while the cluster's tests
# mostly wait out their faults' timeouts), a Slurm cluster of three nodes on this
# machine (tools/cluster.sh; root, since it makes network namespaces, a bridge and
# daemons): srun, sbatch and salloc with MPICH and Open MPI, examples/slurm.sh, JAX
# alone, the diagnostics, and the faults of a real cluster
# (tests/cluster/test_slurm_cluster.py), each case's seconds printed. Taken down
# again whatever happens.
cluster_stage() {
    trap 'bash tools/cluster.sh down >/dev/null 2>&1 || true' EXIT
    run bash tools/cluster.sh up 3
    run env "$(bash tools/cluster.sh env | sed 's/^export //')" VENV_OMPI="$ompi" \
        timeout -k 10 900 python -m pytest -q -p no:cacheprovider --durations=0 \
        tests/cluster
}
if [ "$(id -u)" -eq 0 ]; then
    start_beside "beside part 2, the Slurm cluster's tests" cluster_stage
    trap 'status=$?; show_beside || true; exit "$status"' EXIT
else
    echo "+ not root: Slurm cluster stage not run (bash tools/cluster.sh needs root)"
fi

# 2. The runs with peers, one at a time: each keeps both cores busy (a rank that
# waits polls MPI), and test_count_above_2_31 asks for 6 GiB free per rank.
# Under mpiexec every rank collects only the files with tests marked mpi
# (tests/conftest.py); at 4 ranks, only the tests whose check needs more than two
# ranks (marked more_ranks, tests/util.py): the rest would repeat the 2-rank run.
# Beside the cluster's jobs, MPICH's waiting ranks yield their cores (tests/util.py's
# YIELD).
export MPIR_CVAR_ENABLE_HEAVY_YIELD=${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}
run timeout -k 10 900 mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider
run timeout -k 10 900 mpiexec -n 4 python -m pytest --with-mpi -q -p no:cacheprovider \
    -m more_ranks

if [ -x "$ompi/bin/mpiexec" ]; then
    # The non-blocking and in-place allreduces built against Open MPI, whose MPI 3.1
    # has no MPI_Allreduce_c: counts above INT_MAX go in chunks there, and a
    # non-blocking one is refused. (Open MPI refuses root without the two
    # variables; elsewhere they change nothing.)
    run "${in_ompi[@]}" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        timeout -k 10 900 "$ompi/bin/mpiexec" --oversubscribe \
        -n 2 "$ompi/bin/python" -m pytest --with-mpi -q -p no:cacheprovider \
        -m "every_mpi$not_variant"
fi

if [ -x "$impi/bin/mpiexec" ]; then
    run "${in_impi[@]}" timeout -k 10 900 "$impi/bin/mpiexec" -n 2 \
        "$impi/bin/python" -m pytest --with-mpi -q -p no:cacheprovider \
        -m "every_mpi$not_variant"
fi

trap - EXIT
cluster_status=0
show_beside || cluster_status=$?

# A failure among the stages beside fails the run, after the others ran.
[ "$beside_status" -eq 0 ] || exit "$beside_status"
exit "$cluster_status"
