"""What grows with the process count: rank 0's open files, and JAX's timeouts.

JAX's coordination service on rank 0 holds one TCP connection, so one file
descriptor, per process of the job, beside what the process already has open. With
the soft ``RLIMIT_NOFILE`` below that, gRPC logs "File descriptor limit reached.
Retrying." every second and every client fails with ``DEADLINE_EXCEEDED``, only
after ``initialization_timeout`` + 5 s. A soft limit of 1024 is common; NCCL raises
its soft limit to the hard one at start-up for the same reason, and so does rank 0
here, before its service starts (:func:`ensure_file_limit`).
"""

from __future__ import annotations

import logging
import math
import resource

logger = logging.getLogger("mpi4jax_dist")

# Files rank 0 has open besides the service's connections: Python's, JAX's and
# XLA's, gRPC's own (about 30 measured with jaxlib's service alone), MPI's (shared
# memory segments, sockets to the launcher) and its own client's connection.
FILE_MARGIN = 256


def files_needed(num_processes: int) -> int:
    """Open files rank 0 needs for a job of ``num_processes``: one connection each,
    plus :data:`FILE_MARGIN`."""
    return num_processes + FILE_MARGIN


def file_limits() -> tuple[int | None, int | None]:
    """Return this process's ``(soft, hard)`` open-file limits (None: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (
        None if soft == resource.RLIM_INFINITY else soft,
        None if hard == resource.RLIM_INFINITY else hard,
    )


def ensure_file_limit(num_processes: int) -> tuple[int, int | None] | None:
    """Raise the soft open-file limit to the hard one when it is below what a
    coordination service for ``num_processes`` needs.

    Returns:
        ``(old soft, new soft)`` when it was raised (logged once here), None when
        the soft limit was already enough.

    Raises:
        RuntimeError: even the hard limit is too low, naming both limits, the
            process count and the fix.
    """
    needed = files_needed(num_processes)
    soft, hard = file_limits()
    if soft is None or soft >= needed:
        return None
    if hard is not None and hard < needed:
        raise RuntimeError(
            f"rank 0 needs {needed} open files for JAX's coordination service "
            f"({num_processes} processes, one connection each, + {FILE_MARGIN} for "
            f"the rest), but its hard limit is {hard} (soft {soft}), and a process "
            f"cannot raise its own hard limit. Start the job where `ulimit -Hn` "
            f"shows at least {needed} (ask the site: limits.conf, or the batch "
            f"system's limit); `ulimit -n` shows the soft one."
        )
    hard_raw = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard_raw, hard_raw))
    logger.info(
        "mpi4jax_dist: raised rank 0's open-file limit from %d to %s (the hard "
        "limit): JAX's coordination service needs %d for %d processes.",
        soft,
        "unlimited" if hard is None else hard,
        needed,
        num_processes,
    )
    return soft, hard


# --- timeouts -------------------------------------------------------------------------

# JAX's defaults for jax.distributed.initialize.
JAX_TIMEOUTS = {"initialization_timeout": 300, "heartbeat_timeout_seconds": 100}
# What each process adds to them in mpi4jax_dist.initialize() (seconds): rank 0's
# service registers every process and relays the topology exchange, and receives
# P heartbeats per half period.
PER_PROCESS_S = {"initialization_timeout": 0.01, "heartbeat_timeout_seconds": 0.001}


def timeouts(num_processes: int) -> dict[str, int]:
    """Return the timeouts ``mpi4jax_dist.initialize()`` gives JAX for a job of
    ``num_processes``: JAX's defaults plus 10 ms (initialization) and 1 ms
    (heartbeat) per process, in whole seconds (below 100 processes JAX's own;
    P = 10^5: 1300 s and 200 s)."""
    return {
        name: default + int(num_processes * PER_PROCESS_S[name])
        for name, default in JAX_TIMEOUTS.items()
    }


# JAX's topology exchange at start-up: every process puts its local topology in
# rank 0's service, process 0 gets them all (each get waits at most the "local"
# timeout) and puts the global one, every process fetches it (within the "global"
# timeout, counted from its own put). Each platform JAX starts (CPU, and CUDA where
# the GPU plugin is installed) exchanges its own. JAX's defaults, in minutes:
JAX_TOPOLOGY_TIMEOUTS = {
    "jax_cpu_get_local_topology_timeout_minutes": 2,
    "jax_cpu_get_global_topology_timeout_minutes": 5,
}
# XLA's GPU client has the same 2 and 5 minutes, and JAX passes its plugin no
# option to change them (the plugin rejects unknown create options).
GPU_TOPOLOGY_TIMEOUTS_MINUTES = {"local": 2, "global": 5}
# Local topologies, in bytes: a CPU process's (one device) measured, 69-80 B at
# P = 2 and 4 and about 88 B at 4,096; a GPU process's estimated from the fields XLA's
# GPU client fills (a process id and boot id, about 40 B, and about 70 B per GPU).
CPU_LOCAL_TOPOLOGY_BYTES = 88
GPU_LOCAL_TOPOLOGY_BYTES = {"process": 40, "device": 70}
# The exchange's seconds: the fit that docs/benchmarks-scale.rst gives, with the
# command that makes it, under "The model" (of JAX's topology exchange, emulated at
# P = 64 to 4,096 with local topologies of 88 to 600 B, one 2-core host holding the
# service and all P clients, so an upper bound for a real rank 0; the runs are
# docs/benchmarks/topology_exchange-*.json, which tests/unit/test_topology_model.py
# refits). Terms: per process, per pair of processes, per byte the service sends
# (exchange_payload).
TOPOLOGY_FIT = {
    "whole": {
        "per_process_s": 7.546e-04,
        "per_pair_s": 3.652e-07,
        "per_byte_s": 1.340e-09,
    },
    "put_gather": {"per_process_s": 5.306e-04, "per_pair_s": 2.085e-07},
}
# The timeouts mpi4jax_dist.initialize() sets are this many times the model's
# estimate, and never below JAX's defaults.
TOPOLOGY_SAFETY = 2


def gpu_local_topology_bytes(gpus_per_process: int = 1) -> int:
    """The estimated local topology of a process driving this many GPUs."""
    sizes = GPU_LOCAL_TOPOLOGY_BYTES
    return sizes["process"] + sizes["device"] * gpus_per_process


def global_topology_bytes(num_processes: int, local_bytes: int) -> int:
    """Bytes of the global topology (a GlobalTopologyProto) of ``num_processes``
    local ones of ``local_bytes`` each: every local one is a length-delimited field
    1, a tag byte and the length's varint before it."""
    length = 1
    while local_bytes >> (7 * length):
        length += 1
    return num_processes * (1 + length + local_bytes)


def exchange_payload(num_processes: int, local_bytes: int) -> int:
    """The bytes rank 0's service sends in one platform's topology exchange: the P
    local topologies to process 0, and the global one to each of the P processes."""
    global_bytes = global_topology_bytes(num_processes, local_bytes)
    return num_processes * local_bytes + num_processes * global_bytes


def exchange_terms(num_processes: int, local_bytes: int) -> dict[str, float]:
    """The model's terms for one platform's exchange (see :data:`TOPOLOGY_FIT`)."""
    return {
        "per_process_s": num_processes,
        "per_pair_s": num_processes**2,
        "per_byte_s": exchange_payload(num_processes, local_bytes),
    }


def topology_exchange_s(
    num_processes: int, local_bytes: int = CPU_LOCAL_TOPOLOGY_BYTES
) -> dict[str, float]:
    """Return the model's seconds for one platform's topology exchange of
    ``num_processes`` (the CPU client's by default): ``put_gather`` (until process 0
    holds every local topology) and ``whole``."""
    terms = exchange_terms(num_processes, local_bytes)
    return {
        phase: sum(c * terms[name] for name, c in fit.items())
        for phase, fit in TOPOLOGY_FIT.items()
    }


def topology_timeouts(num_processes: int) -> dict[str, int]:
    """Return the topology-exchange timeouts (minutes) ``mpi4jax_dist.initialize()``
    sets where the user set none: twice the model's time, at least JAX's defaults
    (2 and 5 min), the global one above the local one as JAX requires. JAX's own
    up to about 10^4 processes; 72 and 165 min at 10^5."""
    model = topology_exchange_s(num_processes)
    local_name, global_name = JAX_TOPOLOGY_TIMEOUTS
    local = max(
        JAX_TOPOLOGY_TIMEOUTS[local_name],
        math.ceil(TOPOLOGY_SAFETY * model["put_gather"] / 60),
    )
    whole = max(
        JAX_TOPOLOGY_TIMEOUTS[global_name],
        local + 1,
        math.ceil(TOPOLOGY_SAFETY * model["whole"] / 60),
    )
    return {local_name: local, global_name: whole}


# --- what the diagnostics say ---------------------------------------------------------

SOMAXCONN = "/proc/sys/net/core/somaxconn"


def listen_backlog() -> int | None:
    """Return the kernel's cap on a listening socket's backlog, None if unknown."""
    try:
        with open(SOMAXCONN) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def topology_exchange_bytes(num_processes: int) -> int:
    """Return the bytes rank 0's service sends in JAX's CPU topology exchange (the
    emulation's services sent 0.1 to 9 % more: gRPC's framing, retransmissions)."""
    return exchange_payload(num_processes, CPU_LOCAL_TOPOLOGY_BYTES)


def report(num_processes: int) -> dict:
    """Return this process's limits against a job of ``num_processes``, and what
    will be hit (``problems``: initialize will fail; ``warnings``: it may be slow)."""
    soft, hard = file_limits()
    needed = files_needed(num_processes)
    backlog = listen_backlog()
    exchange = topology_exchange_bytes(num_processes)
    problems, warnings = [], []
    if hard is not None and hard < needed:
        problems.append(
            f"the hard open-file limit, {hard}, is below the {needed} that rank 0's "
            f"coordination service needs for {num_processes} processes: initialize "
            f"will fail (ulimit -Hn)."
        )
    elif soft is not None and soft < needed:
        warnings.append(
            f"the soft open-file limit, {soft}, is below {needed}: rank 0 raises it "
            f"to the hard limit ({hard or 'unlimited'}) at initialize."
        )
    if backlog is not None and num_processes > backlog:
        warnings.append(
            f"{num_processes} processes connect to rank 0, more than the listen "
            f"backlog ({backlog}, {SOMAXCONN}): dropped connection requests cost "
            f"1 s or more each."
        )
    if exchange > 10**9:
        warnings.append(
            f"JAX's topology exchange relays about {exchange / 1e9:.0f} GB through "
            f"rank 0 (about {exchange / num_processes**2:.0f} B per pair of "
            f"processes, per platform): use one process per node with all its "
            f"devices where the platform allows it."
        )
    model = topology_exchange_s(num_processes)
    jax_global = JAX_TOPOLOGY_TIMEOUTS["jax_cpu_get_global_topology_timeout_minutes"]
    if model["whole"] > 60 * jax_global:
        ours = topology_timeouts(num_processes)
        warnings.append(
            f"JAX's topology exchange may take about {model['whole'] / 60:.0f} min "
            f"for {num_processes} processes (a model measured on one 2-core host: "
            f"an upper bound), more than JAX's {jax_global} min: a plain "
            f"jax.distributed.initialize() may time out; mpi4jax_dist.initialize() "
            f"sets jax_cpu_get_local_topology_timeout_minutes="
            f"{ours['jax_cpu_get_local_topology_timeout_minutes']} and "
            f"jax_cpu_get_global_topology_timeout_minutes="
            f"{ours['jax_cpu_get_global_topology_timeout_minutes']}."
        )
    gpu = topology_exchange_s(num_processes, gpu_local_topology_bytes(1))
    gpu_limit = GPU_TOPOLOGY_TIMEOUTS_MINUTES["global"]
    if gpu["whole"] > 60 * gpu_limit:
        warnings.append(
            f"where each of the {num_processes} processes drives one GPU through "
            f"JAX's CUDA plugin, the plugin's own topology exchange may take about "
            f"{gpu['whole'] / 60:.0f} min (the same model), more than XLA's "
            f"{gpu_limit} min, which JAX has no option to raise: run one process "
            f"per node with all its GPUs (the exchange's time falls by about the "
            f"GPUs per node squared, over the growth of each local topology), and "
            f"set JAX_PLATFORMS=cuda so that the CPU backend exchanges no topology "
            f"of its own."
        )
    return {
        "processes": num_processes,
        "open_files": {"soft": soft, "hard": hard, "needed": needed},
        "listen_backlog": backlog,
        "timeouts": {
            "jax_defaults": dict(JAX_TIMEOUTS),
            "mpi4jax_dist.initialize": timeouts(num_processes),
        },
        "topology_exchange_bytes": exchange,
        "topology_exchange_s": model,
        "topology_timeouts_minutes": {
            "jax_defaults": dict(JAX_TOPOLOGY_TIMEOUTS),
            "mpi4jax_dist.initialize": topology_timeouts(num_processes),
        },
        "gpu_topology_exchange": {
            "local_bytes_estimated": gpu_local_topology_bytes(1),
            "seconds": gpu,
            "xla_timeouts_minutes": dict(GPU_TOPOLOGY_TIMEOUTS_MINUTES),
        },
        "problems": problems,
        "warnings": warnings,
    }
