"""mpi4jax_dist: ``jax.distributed.initialize()`` that works under any MPI launcher.

``import mpi4jax_dist`` registers an mpi4py-based cluster environment with JAX, asked
before JAX's own, so that a plain ``jax.distributed.initialize()`` takes the
coordinator, the process count and the process id from MPI, with
``jax.process_index()`` equal to the MPI rank. Importing does not initialize MPI or
a JAX backend. This module defines the public API.
"""

from __future__ import annotations

# Before anything imports jax: MPI4JAX_DIST_CPU_COLLECTIVES=mpi must reach jaxlib's
# MPItrampoline as it loads.
from . import _config
from .launch import detect as _detect

# A setting's warning (_config.SettingWarning) on rank 0 alone, from the first.
_config.setting_warnings_on_rank_0(_detect.launcher_rank(_config.environ()))

from . import xla_mpi  # noqa: E402

xla_mpi.prepare()

from . import _compat  # noqa: E402

# mpi4jax imported from here on prints its JAX-version warning on rank 0 alone.
_compat.one_version_warning(_detect.launcher_rank(_config.environ()))
from .interop import global_mesh, to_global, to_local  # noqa: E402
from .launch.api import initialize, topology  # noqa: E402
from .launch.bootstrap import Topology  # noqa: E402
from .launch.cluster import Mpi4jaxDistCluster  # noqa: E402
from .ops.allreduce import allreduce  # noqa: E402
from .ops.counts import op_counts  # noqa: E402
from .ops.iallreduce import iallreduce  # noqa: E402
from .ops.request import Request  # noqa: E402
from .timing.timeline import timeline  # noqa: E402

__all__ = [
    "Request",
    "Topology",
    "allreduce",
    "cg",
    "global_mesh",
    "iallreduce",
    "initialize",
    "op_counts",
    "timeline",
    "to_global",
    "to_local",
    "topology",
]

__version__ = "0.1.0"

# The one side effect of importing: JAX asks our cluster env first.
_compat.register_first(Mpi4jaxDistCluster)
# JAX's trace context whole before user code is traced, not completed by our
# first call's imports (which would make every jit traced before compile again).
_compat.complete_trace_context()


def __getattr__(name):
    # mpi4jax_dist.cg on first use: most users only want the cluster env, and
    # importing the solvers costs as much again as the rest of the package.
    if name == "cg":
        import importlib

        return importlib.import_module(".cg", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
