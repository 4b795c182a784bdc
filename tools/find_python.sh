# Sourced by tools/setup.sh and tools/jax_sweep.sh: find a Python interpreter by
# its version, on PATH or under pyenv.
#
#   find_python 3.12         # the first Python >= 3.12
#   find_python 3.11 3.11    # a Python 3.11
#
# Prints the interpreter's real path (sys.executable, not a pyenv shim) and
# returns 0, or prints nothing and returns 1. Asked in this order: python3 (the
# user's own), python3.N on PATH from the lowest N allowed up, then pyenv's
# versions (`pyenv versions --bare`, each by `PYENV_VERSION=V pyenv which
# python3`), oldest first: the lowest version that fits, so that a machine's
# choice is the same from run to run. Each candidate is run: a pyenv shim of a
# version not selected fails and is passed over.
find_python() {
    local min=$1 max=${2:-3.99} candidate version
    local -a candidates=(python3)
    local lo=${min#3.} hi=${max#3.} n
    for ((n = lo; n <= hi && n <= 20; n++)); do
        candidates+=("python3.$n")
    done
    if command -v pyenv >/dev/null 2>&1; then
        while read -r version; do
            candidate=$(PYENV_VERSION=$version pyenv which python3 2>/dev/null) \
                && candidates+=("$candidate")
        done < <(pyenv versions --bare 2>/dev/null | grep -E '^3\.[0-9]+\.[0-9]+$' \
            | sort -t. -k1,1n -k2,2n -k3,3n)
    fi
    for candidate in "${candidates[@]}"; do
        "$candidate" - "$min" "$max" 2>/dev/null <<'PY' && return 0
import sys
low, high = (tuple(map(int, v.split("."))) for v in sys.argv[1:3])
if not low <= sys.version_info[:2] <= high:
    sys.exit(1)
print(sys.executable)
PY
    done
    return 1
}

# Print "3.12.1" for the interpreter $1.
python_version() {
    "$1" -c 'import platform; print(platform.python_version())'
}
