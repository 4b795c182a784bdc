"""A pytest plugin that writes each test's seconds and CPU seconds, its own and its
finished children's (the jobs it started), one JSON line a test, to show where
CI's CPU goes:

    PYTHONPATH=tools PYTEST_ADDOPTS="-p cpu_by_test" CPU_BY_TEST=cpu.jsonl \
        bash tools/test.sh

Under pytest-xdist each worker writes its own tests; under mpiexec each rank. A
line: {"id", "wall", "self", "children", "python", "args"}; ``python`` and
``args`` tell the stages apart (another environment, --with-mpi). The ranks of a
job that MPI_Abort ended are not its children's: tools/reaped.py reaps them for
the stage, so that a stage's ``+ took`` line counts them and this file does not.
"""

import json
import os
import resource
import sys
import time

import pytest

OUT = os.environ.get("CPU_BY_TEST", "cpu_by_test.jsonl")


def _cpu(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.monotonic()
    own, children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    row = {
        "id": item.nodeid,
        "wall": round(time.monotonic() - start, 3),
        "self": round(_cpu(resource.RUSAGE_SELF) - own, 3),
        "children": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
        "python": sys.executable,
        "args": " ".join(sys.argv[1:])[:200],
    }
    with open(OUT, "a") as out:
        out.write(json.dumps(row) + "\n")
