"""mpi4jax_dist: ``jax.distributed.initialize()`` that works under any MPI launcher.

``import mpi4jax_dist`` registers an mpi4py-based cluster environment with JAX, asked
before JAX's own, so that a plain ``jax.distributed.initialize()`` finds the
coordinator, the process count and the process id from MPI, with
``jax.process_index()`` equal to the MPI rank. ``allreduce`` reduces arrays in
place and with counts above 2**31, through a compiled XLA FFI handler loaded on its
first call. Importing does not initialize MPI or a JAX backend. This module defines
the public API.
"""

from __future__ import annotations

# Before anything imports jax: MPI4JAX_DIST_CPU_COLLECTIVES=mpi must reach jaxlib's
# MPItrampoline as it loads.
from . import _cpu_collectives

_cpu_collectives.prepare()

from . import _cluster, _iallreduce, _jax_compat  # noqa: E402
from ._allreduce import allreduce  # noqa: E402
from ._api import initialize, topology  # noqa: E402
from ._iallreduce import Request, iallreduce  # noqa: E402
from ._topology import Topology  # noqa: E402
from .interop import global_mesh, to_global, to_local  # noqa: E402

__all__ = [
    "Request",
    "Topology",
    "allreduce",
    "cg",
    "global_mesh",
    "iallreduce",
    "initialize",
    "to_global",
    "to_local",
    "topology",
]

__version__ = "0.1.0"

# The one side effect of importing: JAX asks our cluster env first.
_jax_compat.register_first(_cluster.Mpi4jaxDistCluster)
# JAX's trace context whole before user code is traced, not completed by our
# first call's imports (which would make every jit traced before compile again).
_jax_compat.complete_trace_context()


def __getattr__(name):
    # mpi4jax_dist.cg on first use: most users only want the cluster env, and
    # importing the solvers costs as much again as the rest of the package.
    if name == "cg":
        import importlib

        return importlib.import_module(".cg", __name__)
    # wait, test and overlap, deprecated for Request's methods: generic names at
    # the package's top level (a function named test, imported into a user's
    # test module, is what pytest collects). They warn on access, not on call:
    # once per `from mpi4jax_dist import wait` (not once per call in a loop),
    # pointing at the line that names them, also where the name is only imported
    # or handed on; and the functions need no warning wrapper of their own.
    if name in _iallreduce.DEPRECATED:
        import sys

        caller = sys._getframe(1).f_code
        # `from mpi4jax_dist import wait` reaches here twice: first from
        # importlib's _handle_fromlist (hasattr: is it a submodule?), then from
        # the import statement itself, which warns, at the user's line.
        if not (
            caller.co_name == "_handle_fromlist" and "importlib" in caller.co_filename
        ):
            import warnings

            old, new = _iallreduce.DEPRECATED[name]
            warnings.warn(
                f"mpi4jax_dist.{old} is deprecated: use {new}, a method of the "
                f"mpi4jax_dist.Request that mpi4jax_dist.iallreduce returns.",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(_iallreduce, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
