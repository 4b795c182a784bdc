#!/usr/bin/env bash
# Every JAX minor release, checked: a fresh environment per minor (its newest
# patch, from setup.cfg's floor to the newest that pip serves), the checks of what
# meets JAX in each, and one table (version x check -> pass or FAIL, seconds).
#
#   bash tools/jax_sweep.sh                  # every minor, and the other Pythons' rows
#   bash tools/jax_sweep.sh 0.11 0.12        # those minors only
#   bash tools/jax_sweep.sh py3.13           # that Python's row only
#   JSON=results/jax_sweep.json bash tools/jax_sweep.sh
#
# Each minor runs on one Python (PYTHON, default the first >= 3.12 that
# tools/find_python.sh finds, as for .venv: the JAX version is what differs from
# row to row), with MPICH from PyPI, mpi4py and mpi4jax, each environment made by
# tools/setup.sh (VENV=.venv-sweep/pyX.Y-jaxV JAX=V: pinned, this package built
# from a copy of the tree against that jaxlib; pip's cache shares the downloads).
# Three more rows run other Pythons, each with the newest JAX pip serves it
# (found the same way; skipped, with a line, where there is none): Python 3.13 and
# 3.11 (whose last JAX is 0.10), with the whole serial suite as well, and Python
# 3.10, setup.cfg's floor. The
# checks, each a pytest run of its own (a job of 2 ranks for those under mpiexec):
#   launch       tests/jobs/test_launch.py: plain jax.distributed.initialize() under
#                mpiexec, process index = rank, the launchers' variables
#   compat       tests/jobs/test_jax_compat.py: the table of JAX versions, true of this
#                JAX; every function traced once around the first calls
#   cache        tests/jobs/test_compilation_cache.py: every rank hits the persistent
#                cache on a second run
#   in-place     mpiexec -n 2 pytest --with-mpi tests/peers/test_inplace_allreduce.py
#   fail-safe    tests/peers/test_iallreduce.py and tests/jobs/test_fail_safe.py (jobs whose
#                requests or communicators are misused), then mpiexec -n 2
#                pytest --with-mpi tests/peers/test_iallreduce.py
#   cg           mpiexec -n 2 pytest --with-mpi tests/peers/test_cg_dropin.py
#   serial       (the rows of Python 3.13 and 3.11 only) python -m pytest: the
#                serial suite
# Every run has a time limit. Each check's output is kept in
# .venv-sweep/logs/<row>-<check>.log. Exits 1 when any setup or check failed.
# About 5 minutes a minor on a 2-core machine (2 of them setting up).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
# shellcheck source=tools/find_python.sh
source "$here/tools/find_python.sh"
root=${SWEEP_DIR:-$here/.venv-sweep}
logs=$root/logs
mkdir -p "$logs"
export JAX_PLATFORMS=cpu MPI4JAX_NO_WARN_JAX_VERSION=1

python=${PYTHON:-$(find_python 3.12)} || {
    echo "jax_sweep.sh: no Python >= 3.12 here: the sweep runs on python3" \
        "($(python_version python3)), up to the newest JAX it gets"
    python=python3
}
# Print the newest patch of each JAX minor that pip serves the Python $1, from
# setup.cfg's floor up, oldest first. pip resolves each minor with that Python
# (`pip download --no-deps "jax==0.8.*"`): `pip index versions` also lists
# releases whose Requires-Python excludes it (pip 23 on Python 3.10 listed 0.10.2).
floor=$(sed -n 's/^ *jax *>= *\([0-9.]*\).*/\1/p' setup.cfg)
jax_versions() {
    "$1" - "$floor" <<'EOF'
import pathlib, re, subprocess, sys, tempfile
pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
out = subprocess.run(
    [*pip, "index", "versions", "jax"], capture_output=True, text=True, check=True
).stdout
listed = re.search(r"Available versions: (.*)", out).group(1).split(", ")
key = lambda v: tuple(int(x) for x in v.split("."))
minors = {
    ".".join(v.split(".")[:2])
    for v in listed
    if re.fullmatch(r"[0-9.]+", v) and key(v) >= key(sys.argv[1])
}
for minor in sorted(minors, key=key):
    with tempfile.TemporaryDirectory() as folder:
        got = subprocess.run(
            [*pip, "download", "-q", "--no-deps", "-d", folder, f"jax=={minor}.*"],
            capture_output=True,
        )
        wheels = list(pathlib.Path(folder).glob("jax-*.whl"))
    if got.returncode == 0 and wheels:
        print(wheels[0].name.split("-")[1])  # none for this Python: left out
EOF
}
versions=$(jax_versions "$python") || {
    echo "jax_sweep.sh: pip index versions jax failed" >&2
    exit 2
}
# A row is asked for when no argument is given, or when one names it (its JAX
# minor, or pyX.Y for another Python's row).
wanted() {
    [ "$#" -eq 1 ] && return 0
    local name=$1 arg
    shift
    for arg in "$@"; do
        [ "$arg" = "$name" ] && return 0
    done
    return 1
}

CHECKS=(launch compat cache in-place fail-safe cg serial)
# The commands of a check, one per line, run in order in the row's environment.
check_commands() {
    local mpi="timeout -k 10 600 mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider"
    local serial="timeout -k 10 900 python -m pytest -q -p no:cacheprovider"
    case "$1" in
        launch) echo "$serial tests/jobs/test_launch.py" ;;
        compat) echo "$serial tests/jobs/test_jax_compat.py" ;;
        cache) echo "$serial tests/jobs/test_compilation_cache.py" ;;
        in-place) echo "$mpi tests/peers/test_inplace_allreduce.py" ;;
        fail-safe) echo "$serial tests/peers/test_iallreduce.py tests/jobs/test_fail_safe.py"
            echo "$mpi tests/peers/test_iallreduce.py" ;;
        cg) echo "$mpi tests/peers/test_cg_dropin.py" ;;
        serial) echo "$serial" ;;
    esac
}

# Rows: "python-version python jax checks...".
rows=()
for version in $versions; do
    wanted "$(cut -d. -f1,2 <<<"$version")" "$@" || continue
    rows+=("$(python_version "$python") $python $version ${CHECKS[*]:0:6}")
done
for other in "3.13:${CHECKS[*]}" "3.11:${CHECKS[*]}" "3.10:${CHECKS[*]:0:6}"; do
    pyver=${other%%:*}
    wanted "py$pyver" "$@" || continue
    if ! py=$(find_python "$pyver" "$pyver"); then
        echo "jax_sweep.sh: no Python $pyver here: its row not run"
        continue
    fi
    newest=$(jax_versions "$py" | tail -n 1)
    rows+=("$(python_version "$py") $py $newest ${other#*:}")
done
[ "${#rows[@]}" -gt 0 ] || { echo "jax_sweep.sh: no row matches $*" >&2; exit 2; }

results=$root/results.txt  # one line per check: label jax check status seconds
: >"$results"
failed=0
for row in "${rows[@]}"; do
    read -r pyver py jax checks <<<"$row"
    label="py${pyver%.*}-jax$jax"
    venv=$root/$label
    echo "== $label: setting up $venv"
    start=$SECONDS
    # The checks import the environment's copy of the package: PYTHONSAFEPATH=1
    # keeps the tree off sys.path. Python 3.10 has no PYTHONSAFEPATH, and imports
    # the tree's package: there it is installed editable, its extension built in
    # the tree under that Python's own name (cpython-310), beside the others.
    install=copy
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || install=editable
    if VENV=$venv PYTHON=$py JAX=$jax MPI=mpich INSTALL=$install bash tools/setup.sh \
        >"$logs/$label-setup.log" 2>&1; then
        status=pass
    else
        status=FAIL
        failed=1
    fi
    echo "$label $jax $pyver setup $status $((SECONDS - start))" | tee -a "$results"
    [ "$status" = pass ] || continue
    # What setup.sh resolved: Python, jax, jaxlib, mpi4py, mpi4jax, the MPI.
    sed -n "s|^setup.sh: ready: $venv: |$label env |p" "$logs/$label-setup.log" \
        >>"$results"
    for check in $checks; do
        start=$SECONDS
        status=pass
        while read -r command; do
            # shellcheck disable=SC2086  # a command line, split on purpose
            env PATH="$venv/bin:$PATH" PYTHONSAFEPATH=1 $command \
                >>"$logs/$label-$check.log" 2>&1 || status=FAIL
        done < <(check_commands "$check")
        [ "$status" = pass ] || failed=1
        echo "$label $jax $pyver $check $status $((SECONDS - start))" | tee -a "$results"
    done
done

# The table, and the JSON where asked.
"$python" - "$results" "${JSON:-}" "${CHECKS[@]}" <<'EOF'
import datetime, json, pathlib, platform, sys
results, json_path, checks = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
for line in pathlib.Path(results).read_text().splitlines():
    label, kind, rest = line.split(" ", 2)
    if kind == "env":
        rows[label]["environment"] = rest
        continue
    jax, python, check, status, seconds = [kind, *rest.split()]
    row = rows.setdefault(label, {"jax": jax, "python": python, "checks": {}})
    row["checks"][check] = {"status": status, "seconds": int(seconds)}
columns = ["setup", *checks]
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
print(f"# JAX sweep, {date}, {platform.machine()}: each cell pass/FAIL and seconds")
print(f"{'python':8}{'jax':10}" + "".join(f"{c:>12}" for c in columns))
for row in rows.values():
    cells = []
    for column in columns:
        found = row["checks"].get(column)
        cells.append(f"{found['status']} {found['seconds']:>4}" if found else "-")
    print(f"{row['python']:8}{row['jax']:10}" + "".join(f"{c:>12}" for c in cells))
for row in rows.values():
    print(f"#   {row.get('environment', row['jax'] + ': setup failed')}")
if json_path:
    path = pathlib.Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": date, "rows": list(rows.values())}, indent=1))
EOF
if [ "$failed" -ne 0 ]; then
    echo "jax_sweep.sh: FAILED: see $logs"
fi
exit "$failed"
