"""Imported at start-up by every Python of the tests' jobs (tests/util.py's
clean_env puts this folder on PYTHONPATH): at exit, after every atexit handler
(the package's, JAX's; this one, registered first, runs last), gc.freeze() spares
CPython's finalization its last garbage collections over JAX's heap.

Those collections are 0.45 of the 2.1 CPU-s of a process that imports JAX and runs
one jitted call (medians of 5, 2026-12-08), and the tests start about a thousand
such ranks. Nothing of the package runs in them: its exit handling is its atexit
handler and its signal and exception hooks, which run before. What is skipped is
the finalizers of objects in reference cycles still alive at exit, which CPython
does not promise to run anyway. The tests of a plain exit as users meet it run
without this (clean_env(full_exit=True)): the examples' job scripts, and a job's
normal end with fail-fast on. Being first on PYTHONPATH, this module stands in for
a sitecustomize that the Python itself may ship (Debian's does) in the jobs alone.
"""

import atexit
import gc

atexit.register(gc.freeze)
