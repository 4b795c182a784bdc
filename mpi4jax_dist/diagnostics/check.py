"""What mpi4jax_dist sees: the launcher, MPI, the topology per node, the coordinator,
proxies, versions and devices. A library function first; the CLI (``cli.py``) prints
it."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import time

from .. import _compat, _config, xla_mpi
from .._mpi import abort, mpi_library, thread_level_meaning, thread_level_name
from ..faults import failfast, hangs
from ..launch import bootstrap, detect, devices, limits

logger = logging.getLogger("mpi4jax_dist")

PACKAGES = ("mpi4jax_dist", "jax", "jaxlib", "mpi4py", "mpi4jax", "numpy")


def versions(packages=PACKAGES) -> dict:
    """Return ``{"python": Python's version, package: installed version or
    None}``."""
    found = {"python": platform.python_version()}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _mpiexec_version() -> tuple[str | None, str | None, bool]:
    """The ``mpiexec`` on PATH, else the one beside this Python (a virtual
    environment's, started by its full path): its path, what ``--version`` says,
    and whether it is on PATH."""
    path, on_path = shutil.which("mpiexec"), True
    if path is None:
        beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if not os.access(beside, os.X_OK):
            return None, None, False
        path, on_path = beside, False
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=20
        )
        text = (out.stdout + out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        text = f"could not run: {err}"
    return path, " ".join(" ".join(text.splitlines()[:3]).split()), on_path


def _family(text: str) -> str | None:
    """The MPI family an ``mpiexec --version`` or an MPI library string names:
    Open MPI 4's mpiexec says ``mpiexec (OpenRTE) 4.1.4``, 5's ``(Open MPI)``;
    MPICH's says ``HYDRA build details``."""
    low = (text or "").lower()
    aliases = {"hydra": "mpich", "openrte": "open mpi", "prrte": "open mpi"}
    names = (
        "open mpi",
        "openrte",
        "prrte",
        "intel",
        "mvapich",
        "cray",
        "mpich",
        "hydra",
    )
    for name in names:
        if name in low:
            return aliases.get(name, name)
    return None


# The MPI family of the launchers that belong to one (by launch.detect's names).
_LAUNCHER_FAMILY = {"openmpi": "open mpi", "mpich-hydra": "mpich", "intel-mpi": "intel"}


def diagnose(
    check: bool = False, procs: int | None = None, timeout_s: float | None = None
) -> dict:
    """Return a report of this job (collective: every rank must call it).

    Args:
        check: also initialize JAX and check one ``psum`` over
            :func:`global_mesh`, and compare one ``mpi4jax.allreduce`` with it
            (skipped, saying why, where mpi4jax is not installed: it is an extra).
        procs: judge rank 0's limits for a job of this many processes (default:
            this job's size), e.g. to plan a large job from a small one.
        timeout_s: how long the ranks wait for each other after the check's psum
            (default :data:`CHECK_TIMEOUT_S`); past it, a rank still in it hangs,
            and the job ends saying so.

    Returns:
        On every rank, a dict; ``problems`` lists what looks wrong (empty: fine).
    """
    from mpi4py import MPI

    env = _config.environ()
    info = detect.detect(env)
    problems: list[str] = []
    comm = MPI.COMM_WORLD
    topo = bootstrap.topology()
    library = mpi_library()
    mpiexec, mpiexec_version, on_path = _mpiexec_version()
    mpiexec_note = None
    if (
        on_path
        and mpiexec_version
        and _family(mpiexec_version)
        and _family(library)
        and (_family(mpiexec_version) != _family(library))
    ):
        mismatch = (
            f"mpiexec on PATH ({mpiexec}: {mpiexec_version}) looks like another MPI "
            f"than the one mpi4py uses ({library})"
        )
        started_by = _LAUNCHER_FAMILY.get(info.launcher if info else "")
        if started_by == _family(library):
            # This job's own launcher is the library's (mpiexec.mpich, say, where
            # Debian's plain mpiexec is Open MPI's): said, not a problem of it.
            mpiexec_note = (
                f"{mismatch}; this job's launcher ({info.launcher}) is not it"
            )
        else:
            problems.append(f"{mismatch}.")
    if info is None and comm.Get_size() == 1:
        problems.append(
            "size 1 and no launcher variables: started without mpiexec "
            "(or with one this package does not know)."
        )
    nodes = comm.gather((topo.node_index, topo.rank, topo.local_rank))
    # What each rank's devices will be (one small dict per rank, at rank 0).
    per_rank = devices.describe(topo.local_rank, topo.local_size, env)
    gathered = comm.gather(per_rank)
    vendor = MPI.get_vendor()
    report = {
        # None where no launcher variables were seen: nothing names the launcher.
        "launcher": info.launcher if info else None,
        "launcher_variables": info.variables if info else {},
        "mpi": {
            # ["MPICH", "4.0.2"]: mpi4py gives the version as a tuple.
            "vendor": [vendor[0], ".".join(map(str, vendor[1]))],
            "library": library,
            "standard": "{}.{}".format(*MPI.Get_version()),
            "thread_level": thread_level_name(MPI.Query_thread()),
            # What the level means for the compiled ops, and what set it.
            "thread_level_means": thread_level_meaning(MPI.Query_thread()),
            "thread_level_settings": _config.thread_level_settings(),
            "mpiexec": mpiexec,
            "mpiexec_version": mpiexec_version,
            "mpiexec_on_path": on_path,
            # The mismatch above, where the job's own launcher is the right one.
            "mpiexec_note": mpiexec_note,
        },
        "topology": {
            "size": topo.size,
            "num_nodes": topo.num_nodes,
            "coordinator_address": topo.coordinator_address,
            "release": bootstrap.current().release_mode,
        },
        # What the bootstrap asked of MPI, as recorded while it ran (this rank's).
        "bootstrap_calls": [
            {
                "name": c.name,
                "phase": c.phase,
                "bytes_per_rank": c.bytes_per_rank,
                "mpi_adds": c.mpi_adds,
            }
            for c in bootstrap.collectives()
        ],
        "proxy": {
            "variables": _config.proxies_set(env),
            "no_grpc_proxy": env.get(_config.NO_GRPC_PROXY),
            "keep": _config.keep_proxy(env),
        },
        "versions": versions(),
    }
    if gathered is not None:
        report["devices"] = [{"rank": r, **d} for r, d in enumerate(gathered)]
    if nodes is not None:
        per_node: dict[int, list[int]] = {}
        for node, rank, _ in sorted(nodes):
            per_node.setdefault(node, []).append(rank)
        report["topology"]["ranks_per_node"] = {str(k): v for k, v in per_node.items()}
    # Rank 0's limits, where JAX's coordination service runs.
    scale = limits.report(procs or topo.size)
    report["scale"] = scale
    if topo.rank == 0:
        problems += scale["problems"]
    if check:
        report["check"] = _check(topo, problems, timeout_s or CHECK_TIMEOUT_S)
    # After the check, which initializes JAX and with it the hooks.
    report["on_failure"] = failfast.report()
    report["on_hang"] = hangs.report()
    report["cpu_collectives"] = xla_mpi.report()
    all_problems = comm.allgather(problems)
    report["problems"] = [
        f"rank {r}: {p}" for r, ps in enumerate(all_problems) for p in ps
    ]
    return report


def _mpi4jax_unusable(problems: list[str]) -> str | None:
    """Return why this rank cannot compare with mpi4jax, or None when it can.

    Not installed is no problem (mpi4jax is an extra); installed but failing to
    import is one, added to ``problems``: an ImportError, or the RuntimeError
    mpi4jax raises when it was built against another MPI than mpi4py's ("MPI ABI
    incompatibility detected!"), which is reported, not raised.
    """
    if not _compat.has_mpi4jax():
        return _compat.mpi4jax_missing("the comparison with mpi4jax.allreduce")
    try:
        import mpi4jax  # noqa: F401
    except Exception as err:  # what the import raises is what --check reports
        error = " ".join(f"{type(err).__name__}: {err}".split())
        problems.append(
            f"mpi4jax is installed but does not import ({error}): rebuild it against "
            f"this MPI (pip install --no-binary mpi4jax --no-cache-dir "
            f"--force-reinstall --no-deps mpi4jax)"
        )
        return f"mpi4jax does not import: {error}"
    return None


# How long the ranks wait for each other after JAX's check before they give up on
# it: a collective that hangs (connections blocked between nodes) ends the job
# instead of holding it. A Gloo rank waiting for peers that never connect gives up
# after about 150 s (measured on the test cluster).
CHECK_TIMEOUT_S = 300


def _check(topo, problems: list[str], timeout_s: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec
    from mpi4py import MPI

    from .. import interop
    from ..launch import api

    comm = MPI.COMM_WORLD
    # Every rank calls mpi4jax.allreduce or none does: one rank alone in it would
    # wait for the others forever.
    unusable = comm.allgather(_mpi4jax_unusable(problems))
    api.initialize()
    local = jnp.arange(8, dtype=jnp.float32) + topo.rank
    expected = np.arange(8) * topo.size + sum(range(topo.size))
    result = {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "process_index": jax.process_index(),
        "gloo_address": _compat.published_gloo_address(),
    }
    try:
        mesh = interop.global_mesh()
        summed = jax.jit(
            _compat.shard_map(
                lambda a: jax.lax.psum(a, interop.DEFAULT_AXIS),
                mesh=mesh,
                in_specs=PartitionSpec(interop.DEFAULT_AXIS),
                out_specs=PartitionSpec(interop.DEFAULT_AXIS),
            )
        )(interop.to_global(local, mesh))
        by_psum = np.asarray(interop.to_local(summed))
    except Exception as err:  # a collective that fails is what --check is for
        error = " ".join(f"{type(err).__name__}: {err}".split())
        problems.append(f"JAX's psum across the {topo.size} processes failed: {error}")
        by_psum = None
        result["psum_error"] = error
    # The ranks compare notes only once every one of them is through the psum: a
    # rank that hangs in it ends the job, saying so, after timeout_s.
    _wait_for_all(comm, timeout_s, "JAX's psum across the processes", problems)
    if by_psum is not None and not np.array_equal(by_psum, expected):
        problems.append(f"psum {by_psum} != {expected}")
    result["psum_correct"] = by_psum is not None and bool(
        np.array_equal(by_psum, expected)
    )
    failed = [r for r, ok in enumerate(comm.allgather(by_psum is not None)) if not ok]
    skip = None
    if failed:
        skip = f"JAX's psum failed on ranks {failed}"
    elif any(unusable):
        rank = next(r for r, why in enumerate(unusable) if why)
        skip = unusable[topo.rank] or f"on rank {rank}, {unusable[rank]}"
    if skip is not None:
        # None, not False: nothing was compared.
        return {**result, "allreduce_equals_psum": None, "mpi4jax": f"skipped: {skip}"}
    import mpi4jax

    by_mpi4jax = np.asarray(jax.jit(lambda a: mpi4jax.allreduce(a, op=MPI.SUM))(local))
    if not np.array_equal(by_mpi4jax, expected):
        problems.append(f"mpi4jax.allreduce {by_mpi4jax} != {expected}")
    return {
        **result,
        "allreduce_equals_psum": bool(np.array_equal(by_mpi4jax, by_psum)),
        "mpi4jax": "compared",
    }


def _wait_for_all(comm, timeout_s: float, what: str, problems: list[str]) -> None:
    """Return once every rank of ``comm`` got here; past ``timeout_s``, say in one
    line which step some rank is still in, and this rank's ``problems``, and end
    the job (``MPI_Abort``)."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not request.Test():
        if time.monotonic() > deadline:
            logger.critical(
                "mpi4jax_dist --check: rank %d of %d: %ssome rank was still in %s "
                "after %g s: it hangs (connections between nodes blocked?); ending "
                "the job.",
                comm.Get_rank(),
                comm.Get_size(),
                "".join(f"{p}; " for p in problems),
                what,
                timeout_s,
            )
            abort(comm, 1)
        time.sleep(0.01)
