"""A sys.exit in one of several shapes, under mpi4jax_dist's sys.exit hook.

Usage: python exit_shapes.py SHAPE
The hook's abort is replaced by a line "ABORT <code>" and an exit with that code
(no MPI here), so that the test sees whether the hook judged that the SystemExit
ended the program; a normal end prints nothing more.
"""

import contextlib
import os
import sys

from mpi4jax_dist.faults import failfast


def fake_abort(what, lines, code):
    print(f"ABORT {code} {what}", flush=True)
    os._exit(code)


failfast._abort = fake_abort
failfast._state.original_exit = sys.exit
sys.exit = failfast._exit

shape = sys.argv[1]


def deep(n, code=3):
    if n == 0:
        sys.exit(code)
    deep(n - 1, code)


if shape == "module":
    sys.exit(3)
elif shape == "nested":
    deep(5)
elif shape == "string":
    sys.exit("bad input")
elif shape == "zero":
    sys.exit(0)
elif shape == "reraise_bare":
    try:
        deep(1)
    except SystemExit:
        print("cleaning up", flush=True)
        raise
elif shape == "reraise_named":

    def again():
        try:
            deep(1)
        except SystemExit as exc:
            raise exc

    again()
elif shape == "caught_at_module":
    try:
        deep(2, 2)
    except SystemExit:
        pass
    print("carried on", flush=True)
elif shape == "caught_in_function":

    def swallow():
        try:
            deep(2, 2)
        except SystemExit:
            pass

    swallow()
elif shape == "suppressed":
    with contextlib.suppress(SystemExit):
        deep(1, 2)
elif shape == "caught_then_zero":
    try:
        deep(1, 2)
    except SystemExit:
        pass
    sys.exit(0)
