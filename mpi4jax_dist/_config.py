"""Every environment variable mpi4jax_dist reads, parsed and validated in one place.

Precedence everywhere: an explicit argument, then the variable, then the default.
Values that make no sense raise a ``ValueError`` naming the variable, the value and
the fix; where ignoring a value is safe, a ``RuntimeWarning`` says so instead.

Launcher variables (``PMI_RANK`` and friends) are read through :func:`environ` and
interpreted in ``launch/detect.py``; this module only owns the ones that configure us.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping

DISABLE = "MPI4JAX_DIST_DISABLE"
ONE_PROCESS = "MPI4JAX_DIST_ONE_PROCESS"
CPU_COLLECTIVES = "MPI4JAX_DIST_CPU_COLLECTIVES"
# Read by jaxlib's MPItrampoline when jaxlib loads, and by JAX's config.
TRAMPOLINE_LIB = "MPITRAMPOLINE_LIB"
JAX_CPU_COLLECTIVES = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
FAIL_FAST = "MPI4JAX_DIST_FAIL_FAST"
CACHE_EVERY_PROCESS = "MPI4JAX_DIST_CACHE_EVERY_PROCESS"
# JAX's own variable for its preemption service (which catches SIGTERM): set to a
# true value, it tells us the user wants JAX's preemption handling.
JAX_PREEMPTION = "JAX_ENABLE_PREEMPTION_SERVICE"
INTERFACE = "MPI4JAX_DIST_INTERFACE"
COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
PLATFORMS = "JAX_PLATFORMS"
BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"
PROXY = "MPI4JAX_DIST_PROXY"
# Variables that make gRPC send the coordinator's traffic through a proxy, and the
# one that exempts hosts from it (read by gRPC alone, so nothing else changes).
PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")
NO_GRPC_PROXY = "no_grpc_proxy"
# What decides MPI's thread level: Cray MPICH caps what MPI_Init_thread provides
# at MPICH_MAX_THREAD_SAFETY (single, funneled, serialized or multiple; unset:
# below multiple), and mpi4py asks for mpi4py.rc.thread_level, which
# MPI4PY_RC_THREAD_LEVEL sets (default multiple).
THREAD_LEVEL_VARIABLES = ("MPICH_MAX_THREAD_SAFETY", "MPI4PY_RC_THREAD_LEVEL")
# Which accelerators this process may see, in the order we look at them.
VISIBLE_DEVICES = (
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)

# Intel GPUs (Level Zero): which devices a process sees, and whether a device is a
# tile (FLAT, the default) or a whole GPU (COMPOSITE; COMBINED as COMPOSITE here).
ZE_AFFINITY_MASK = "ZE_AFFINITY_MASK"
ZE_HIERARCHY = "ZE_FLAT_DEVICE_HIERARCHY"
ZE_HIERARCHIES = ("FLAT", "COMPOSITE", "COMBINED")

_TRUE = ("1", "true", "yes", "on", "t", "y")
_FALSE = ("0", "false", "no", "off", "f", "n", "")


def environ() -> Mapping[str, str]:
    """Return the process environment (the one place that touches ``os.environ``)."""
    return os.environ


def get_bool(name: str, default: bool = False, env: Mapping[str, str] | None = None):
    """Return a strict boolean variable; warn and use ``default`` on anything else.

    Ignoring a malformed value is safe for our switches, so this warns rather than
    raising: a job does not die over ``MPI4JAX_DIST_DISABLE=maybe``.
    """
    env = environ() if env is None else env
    value = env.get(name)
    if value is None:
        return default
    folded = value.strip().lower()
    if folded in _TRUE:
        return True
    if folded in _FALSE:
        return False
    warnings.warn(
        f"{name}={value!r} is not a boolean; expected one of "
        f"{', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}. Using {name}={int(default)}.",
        RuntimeWarning,
        stacklevel=2,
    )
    return default


def disabled(env: Mapping[str, str] | None = None) -> bool:
    """Return True when ``MPI4JAX_DIST_DISABLE`` turns automatic detection off."""
    return get_bool(DISABLE, False, env)


def one_process(env: Mapping[str, str] | None = None) -> bool:
    """Return True unless ``MPI4JAX_DIST_ONE_PROCESS=0`` (or
    ``MPI4JAX_DIST_DISABLE``) turns off the one-process world a plain ``python
    script.py`` gets from ``jax.distributed.initialize()``."""
    return not disabled(env) and get_bool(ONE_PROCESS, True, env)


def cpu_collectives(env: Mapping[str, str] | None = None) -> str | None:
    """Return ``"mpi"`` or ``"gloo"`` from ``MPI4JAX_DIST_CPU_COLLECTIVES``, or None
    (unset: JAX's own choice, gloo under ``jax.distributed``)."""
    env = environ() if env is None else env
    value = env.get(CPU_COLLECTIVES, "").strip().lower()
    if value in ("", "default"):
        return None
    if value not in ("mpi", "gloo"):
        raise ValueError(
            f"{CPU_COLLECTIVES}={env.get(CPU_COLLECTIVES)!r}: expected mpi (JAX's "
            f"cross-process collectives on CPU over MPI) or gloo (over TCP, JAX's "
            f"default); unset it for JAX's default."
        )
    return value


def trampoline_lib(env: Mapping[str, str] | None = None) -> str | None:
    """Return the library ``MPITRAMPOLINE_LIB`` names for jaxlib's MPItrampoline."""
    env = environ() if env is None else env
    return env.get(TRAMPOLINE_LIB) or None


def fail_fast(env: Mapping[str, str] | None = None) -> bool:
    """Return True unless ``MPI4JAX_DIST_FAIL_FAST=0`` turns off what makes a
    failing rank end the job (see ``faults/failfast.py``)."""
    return get_bool(FAIL_FAST, True, env)


def cache_every_process(env: Mapping[str, str] | None = None) -> bool:
    """Return True unless ``MPI4JAX_DIST_CACHE_EVERY_PROCESS=0`` keeps JAX's rule
    for the persistent compilation cache: only process 0 writes entries, also for
    the programs no other process compiles (see
    ``_compat.cache_on_every_process``)."""
    return get_bool(CACHE_EVERY_PROCESS, True, env)


def jax_preemption_requested(env: Mapping[str, str] | None = None) -> bool:
    """Return True when ``JAX_ENABLE_PREEMPTION_SERVICE`` asks for JAX's preemption
    service (and with it JAX's SIGTERM handler) by name."""
    return get_bool(JAX_PREEMPTION, False, env)


def interface(env: Mapping[str, str] | None = None) -> str | None:
    """Return the network interface named by ``MPI4JAX_DIST_INTERFACE``, if any."""
    env = environ() if env is None else env
    value = env.get(INTERFACE, "").strip()
    return value or None


def parse_port(value, name: str) -> int:
    """Return ``value`` as a TCP port number, or raise naming ``name``."""
    try:
        port = int(str(value).strip())
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(
            f"{name}={value!r} is not a TCP port; expected an integer from 1 to "
            f"65535 (or unset it to let rank 0 choose a free port)."
        )
    return port


def coordinator_port(override=None, env: Mapping[str, str] | None = None) -> int | None:
    """Return the coordinator port: ``override`` (what JAX passes), else the variable.

    JAX reads ``JAX_COORDINATOR_PORT`` itself and hands it to the cluster env as
    ``override_coordinator_port`` (jax >= 0.8.1); older versions do not, so the
    variable is read here as well.
    """
    env = environ() if env is None else env
    if override not in (None, ""):
        return parse_port(override, COORDINATOR_PORT)
    value = env.get(COORDINATOR_PORT)
    if value in (None, ""):
        return None
    return parse_port(value, COORDINATOR_PORT)


def split_host_port(address: str, name: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) and validate it, naming ``name``."""
    host, sep, port = str(address).strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host:
        raise ValueError(
            f"{name}={address!r} is not of the form host:port "
            f"(for example 10.0.0.1:1234 or [fd00::1]:1234)."
        )
    return host, parse_port(port, name)


def coordinator_address(env: Mapping[str, str] | None = None) -> str | None:
    """Return a validated ``JAX_COORDINATOR_ADDRESS``, or None when unset."""
    env = environ() if env is None else env
    value = env.get(COORDINATOR_ADDRESS)
    if not value:
        return None
    split_host_port(value, COORDINATOR_ADDRESS)
    return value.strip()


def local_device_ids(env: Mapping[str, str] | None = None) -> list[int] | None:
    """Return ``JAX_LOCAL_DEVICE_IDS`` as a list of ints, or None when unset."""
    env = environ() if env is None else env
    value = env.get(LOCAL_DEVICE_IDS, "").strip()
    if not value:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise ValueError(
            f"{LOCAL_DEVICE_IDS}={value!r} is not a comma-separated list of device "
            f"numbers (for example 0 or 0,1)."
        ) from None


def platforms(env: Mapping[str, str] | None = None) -> list[str]:
    """Return the platforms ``JAX_PLATFORMS`` asks for (lower case), maybe empty."""
    env = environ() if env is None else env
    value = env.get(PLATFORMS, "") or env.get("JAX_PLATFORM_NAME", "")
    return [p.strip().lower() for p in value.split(",") if p.strip()]


def visible_devices(
    env: Mapping[str, str] | None = None,
) -> tuple[str, list[str]] | None:
    """Return ``(variable, entries)`` for the first ``*_VISIBLE_DEVICES`` set, or None.

    ``-1`` or an empty value hides every device (CUDA's convention): no entries.
    """
    env = environ() if env is None else env
    for name in VISIBLE_DEVICES:
        value = env.get(name)
        if value is None:
            continue
        entries = [e.strip() for e in value.split(",") if e.strip()]
        if entries and entries[0] == "-1":
            entries = []
        return name, entries
    return None


def level_zero_mask(
    env: Mapping[str, str] | None = None,
) -> list[tuple[int, int | None]] | None:
    """Return ``ZE_AFFINITY_MASK`` as ``(device, tile)`` pairs (tile None for a
    whole device), or None when unset or empty (Level Zero: every device visible).

    Raises:
        ValueError: an entry is neither a device (``3``) nor a device's tile
            (``0.1``).
    """
    env = environ() if env is None else env
    value = env.get(ZE_AFFINITY_MASK, "")
    if not value.strip():
        return None
    entries = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", part)
        if match is None:
            raise ValueError(
                f"{ZE_AFFINITY_MASK}={value!r}: {part.strip()!r} is not a device "
                f"(3) or a device's tile (0.1); expected a comma-separated list of "
                f"them, such as 0.0 or 0.0,0.1 or 3."
            )
        device, tile = match.groups()
        entries.append((int(device), None if tile is None else int(tile)))
    return entries


def level_zero_hierarchy(env: Mapping[str, str] | None = None) -> str:
    """Return ``ZE_FLAT_DEVICE_HIERARCHY`` in upper case: ``FLAT`` (the default),
    ``COMPOSITE`` or ``COMBINED``.

    Raises:
        ValueError: another value.
    """
    env = environ() if env is None else env
    value = env.get(ZE_HIERARCHY, "").strip()
    if value.upper() in ("",) + ZE_HIERARCHIES:
        return value.upper() or "FLAT"
    raise ValueError(
        f"{ZE_HIERARCHY}={value!r} is not FLAT (the default: each tile of an Intel "
        f"GPU is a device), COMPOSITE (each GPU is one device) or COMBINED."
    )


def thread_level_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return those of ``THREAD_LEVEL_VARIABLES`` that are set, with their values."""
    env = environ() if env is None else env
    return {name: env[name] for name in THREAD_LEVEL_VARIABLES if name in env}


def proxies_set(env: Mapping[str, str] | None = None) -> list[str]:
    """Return the names of the proxy variables set (any case): ``["HTTP_PROXY"]``."""
    env = environ() if env is None else env
    wanted = {v.lower() for v in PROXY_VARIABLES}
    return sorted(k for k, v in env.items() if k.lower() in wanted and v.strip())


# Variables that are proxy settings; JAX's proxy check names every variable with
# "_proxy" in its name, so launcher variables such as Intel MPI's
# HYDRA_BSTRAP_PROXY_ID (Hydra's bootstrap proxy, a process) set it off too.
PROXY_SETTINGS = PROXY_VARIABLES + ("all_proxy", "ftp_proxy", "no_proxy", NO_GRPC_PROXY)


def false_proxy_alarms(env: Mapping[str, str] | None = None) -> list[str]:
    """Return the variables JAX's proxy check would name that are not proxy
    settings (any case), when no proxy setting is set; else an empty list."""
    env = environ() if env is None else env
    named = [k for k in env if "_proxy" in k.lower()]
    settings = {v.lower() for v in PROXY_SETTINGS}
    if any(k.lower() in settings for k in named):
        return []
    return sorted(named)


def keep_proxy(env: Mapping[str, str] | None = None) -> bool:
    """Return True when ``MPI4JAX_DIST_PROXY=keep`` asks us not to touch proxies."""
    env = environ() if env is None else env
    value = env.get(PROXY, "").strip().lower()
    if value not in ("", "keep", "exempt"):
        warnings.warn(
            f"{PROXY}={env[PROXY]!r}: expected 'keep' (leave proxies alone) or "
            f"'exempt' (the default: add the coordinator to no_grpc_proxy).",
            RuntimeWarning,
            stacklevel=2,
        )
    return value == "keep"


def exempt_from_proxy(host: str) -> list[str] | None:
    """Add ``host`` to ``no_grpc_proxy`` when a proxy variable would catch it.

    Returns the proxy variables that made it necessary, or None when nothing changed
    (no proxy set, ``MPI4JAX_DIST_PROXY=keep``, or ``host`` already exempt).
    """
    env = os.environ
    found = proxies_set(env)
    if not found or keep_proxy(env):
        return None
    # gRPC reads no_grpc_proxy, else no_proxy: start from what it would have used,
    # so that the user's own exemptions still hold for every gRPC channel.
    current = next(
        (
            env[k]
            for k in (NO_GRPC_PROXY, NO_GRPC_PROXY.upper(), "no_proxy", "NO_PROXY")
            if env.get(k)
        ),
        "",
    )
    hosts = [h.strip() for h in current.split(",") if h.strip()]
    if host in hosts:
        return None
    env[NO_GRPC_PROXY] = ",".join(hosts + [host])
    return found


def default_bind_address(address: str):
    """Bind JAX's coordination service to ``address`` unless the user chose one.

    JAX binds it to every interface (``[::]:port``) by default, and gRPC there asks
    for no credentials. JAX reads ``JAX_COORDINATOR_BIND_ADDRESS`` after cluster
    detection, so it is set here; returns a function that takes it back once JAX has
    read it (child processes must not inherit a port of ours), or None.
    """
    if os.environ.get(BIND_ADDRESS):
        return None
    os.environ[BIND_ADDRESS] = address

    def restore():
        if os.environ.get(BIND_ADDRESS) == address:
            del os.environ[BIND_ADDRESS]

    return restore


ALLREDUCE_CHUNK_BYTES = "MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES"
# 64 MiB: measured with 1 GiB float32 messages on 2 ranks, MPI's scratch memory
# falls from 0.50 of the message to 0.03 at no cost in time.
DEFAULT_ALLREDUCE_CHUNK_BYTES = 64 << 20
_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def allreduce_chunk_bytes(env: Mapping[str, str] | None = None) -> int:
    """Return the most bytes ``mpi4jax_dist.allreduce`` hands to one MPI call.

    ``MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES`` (default 64 MiB) bounds the scratch
    memory MPI allocates for a reduction (about one chunk, instead of up to the
    whole message): the message is reduced chunk by chunk. ``0`` means one call
    for the whole message (``MPI_Allreduce_c`` where the MPI has MPI-4's
    large-count calls, else calls of at most ``INT_MAX`` elements, which apply
    whatever this is set to). Plain bytes or with a binary unit: ``16777216``,
    ``16M``, ``16MiB``, ``1G``. It is read when a call is compiled, and must be
    the same on every rank (each chunk is a collective of its own).

    Raises:
        ValueError: the value is not a non-negative size.
    """
    env = environ() if env is None else env
    value = env.get(ALLREDUCE_CHUNK_BYTES, "").strip()
    if not value:
        return DEFAULT_ALLREDUCE_CHUNK_BYTES
    size = _parse_bytes(value)
    if size is None:
        raise ValueError(
            f"{ALLREDUCE_CHUNK_BYTES}={value!r} is not a size in bytes; expected a "
            f"non-negative integer with an optional unit (67108864, 64M, 64MiB), "
            f"or 0 for one MPI call per message."
        )
    return size


def _parse_bytes(value: str) -> int | None:
    """Return ``"64M"``, ``"64MiB"``, ``"67108864"`` as bytes, or None."""
    match = re.fullmatch(r"(\d+)\s*(?:([kmg])(?:i?b)?|b)?", value.strip().lower())
    if match is None:
        return None
    return int(match.group(1)) * _BYTE_UNITS[match.group(2) or ""]


STAGING_BYTES = "MPI4JAX_DIST_STAGING_BYTES"
# 64 MiB, as the chunk: two halves of 32 MiB, each copied in about a millisecond
# over PCIe 4 or 5 (25 to 50 GB/s) while MPI reduces the other, so that a copy's
# fixed cost (microseconds) is lost in it; and little enough to pin once per
# process and keep.
DEFAULT_STAGING_BYTES = 64 << 20
# Each half must hold one element of the largest type (complex128, 16 bytes).
MIN_STAGING_BYTES = 32


def staging_bytes(env: Mapping[str, str] | None = None) -> int:
    """Return the pinned host memory the CUDA allreduce stages through, in bytes.

    Without CUDA-aware MPI, ``mpi4jax_dist.allreduce`` on a GPU copies the message
    to the host and back through one pinned buffer of
    ``MPI4JAX_DIST_STAGING_BYTES`` (default 64 MiB), whatever the message's size
    and ``MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES``: its two halves take turns, one
    copied while MPI reduces the other. The buffer is allocated on the first
    staged call and kept until exit (freeing pinned memory synchronizes the
    whole device); a second one only while two calls run at once. Units as for
    the chunk size (``64M``, ``1GiB``). Read once per process, when the CUDA
    handler is loaded (the first allreduce compiled for a GPU).

    Raises:
        ValueError: the value is not a size of at least 32 bytes.
    """
    env = environ() if env is None else env
    value = env.get(STAGING_BYTES, "").strip()
    if not value:
        return DEFAULT_STAGING_BYTES
    size = _parse_bytes(value)
    if size is None or size < MIN_STAGING_BYTES:
        raise ValueError(
            f"{STAGING_BYTES}={value!r} is not a size in bytes of at least "
            f"{MIN_STAGING_BYTES} (two elements of the largest type); expected an "
            f"integer with an optional unit, such as 67108864, 64M or 64MiB, or "
            f"unset it for 64 MiB."
        )
    return size


CUDA_AWARE_MPI = "MPI4JAX_DIST_CUDA_AWARE_MPI"
# mpi4jax's own switch for the same thing, honoured when ours is unset: one
# program's mpi4jax calls and ours then treat device memory alike.
MPI4JAX_CUDA_AWARE_MPI = "MPI4JAX_USE_CUDA_MPI"


def cuda_aware_mpi(env: Mapping[str, str] | None = None) -> str:
    """Return ``"off"``, ``"on"`` or ``"force"``: whether the CUDA allreduce hands
    MPI device memory.

    On GPUs, ``mpi4jax_dist.allreduce`` hands MPI the device buffer itself
    (CUDA-aware MPI) when this is ``"on"`` and the MPI library says it reads
    device memory (``MPIX_Query_cuda_support``), or when it is ``"force"``
    where the MPI cannot say (Open MPI without its CUDA extension, Intel MPI,
    MPICH before 4.1: an MPI without CUDA support crashes on a device pointer,
    so trust is asked for by name). An MPI that says it cannot read device
    memory is refused either way, when the call is compiled. Otherwise (the
    default) it stages the buffer through pinned host memory
    (``MPI4JAX_DIST_STAGING_BYTES``), which works with every MPI.

    ``MPI4JAX_DIST_CUDA_AWARE_MPI``: ``force``, or a boolean (``1``: on, ``0``:
    off). When it is unset, mpi4jax's ``MPI4JAX_USE_CUDA_MPI`` (a boolean) decides;
    else off. Read when a call is compiled; set it alike on every rank.
    """
    env = environ() if env is None else env
    ours = env.get(CUDA_AWARE_MPI, "").strip().lower()
    if ours == "force":
        return "force"
    if ours and ours not in _TRUE + _FALSE:
        warnings.warn(
            f"{CUDA_AWARE_MPI}={env[CUDA_AWARE_MPI]!r} is none of force, 1 (on) or "
            f"0 (off); staging through host memory ({CUDA_AWARE_MPI}=0).",
            RuntimeWarning,
            stacklevel=2,
        )
        return "off"
    if ours:
        on = ours in _TRUE
    else:
        on = get_bool(MPI4JAX_CUDA_AWARE_MPI, False, env)
    return "on" if on else "off"


def cuda_aware_source(env: Mapping[str, str] | None = None) -> str:
    """Return the setting that :func:`cuda_aware_mpi` followed, for messages:
    ``"MPI4JAX_DIST_CUDA_AWARE_MPI='1'"``, or mpi4jax's variable when ours is
    unset."""
    env = environ() if env is None else env
    name = CUDA_AWARE_MPI if env.get(CUDA_AWARE_MPI, "").strip() else None
    name = name or MPI4JAX_CUDA_AWARE_MPI
    return f"{name}={env.get(name, '')!r}"


CHECKS = "MPI4JAX_DIST_CHECKS"


def checks(env: Mapping[str, str] | None = None) -> bool:
    """Return whether each compiled ``allreduce`` and ``iallreduce`` is checked
    against the other ranks' calls before it returns (default on).

    Every call carries a header of what it is (blocking or not, op, dtype, element
    count, its number on the communicator) that MPI reduces with the data, in one
    message up to 16 KiB and beside it above: ranks that disagree fail on every
    rank with one report naming each side, instead of returning wrong values.
    ``MPI4JAX_DIST_CHECKS=0`` leaves the header out. Read when a call is
    compiled; set it alike on every rank.
    """
    return get_bool(CHECKS, True, env)


TOKEN_REUSE = "MPI4JAX_DIST_TOKEN_REUSE"


def token_reuse(env: Mapping[str, str] | None = None) -> bool:
    """Return whether an ordered-effect program (the package's ops, mpi4jax's)
    gets the last one's runtime token as it is (default on, on the JAX versions
    it ran on: :func:`mpi4jax_dist._compat.reuse_runtime_tokens`), which halves a
    jitted call's dispatch. ``MPI4JAX_DIST_TOKEN_REUSE=0`` keeps JAX's own path,
    which waits for the last program before it dispatches the next."""
    return get_bool(TOKEN_REUSE, True, env)


TOKENS_IN_PROGRAM = "MPI4JAX_DIST_TOKENS_IN_PROGRAM"


def tokens_in_program(env: Mapping[str, str] | None = None) -> bool:
    """Return whether a one-device CPU program makes mpi4jax's tokens inside
    itself instead of taking JAX's runtime tokens, and so gets JAX's C++ dispatch
    (default off, a prototype: :func:`mpi4jax_dist._compat.tokens_in_program`)."""
    return get_bool(TOKENS_IN_PROGRAM, False, env)


# --- hangs: stacks on demand and the collective timeout (faults/hangs.py) ----------

STACKS = "MPI4JAX_DIST_STACKS"
HANG_DIR = "MPI4JAX_DIST_HANG_DIR"
COLLECTIVE_TIMEOUT = "MPI4JAX_DIST_COLLECTIVE_TIMEOUT"
HANG_TIMEOUT = "MPI4JAX_DIST_HANG_TIMEOUT"


def stacks_on_signal(env: Mapping[str, str] | None = None) -> bool:
    """Return whether ``SIGUSR1`` makes each rank print its threads' Python stacks
    (default on; ``MPI4JAX_DIST_STACKS=0`` leaves the signal alone)."""
    return get_bool(STACKS, True, env)


def hang_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Return the folder each rank writes its stacks to (``rank-N.txt``), or None
    (``MPI4JAX_DIST_HANG_DIR`` unset or empty: stderr, each line prefixed with the
    rank)."""
    env = environ() if env is None else env
    return env.get(HANG_DIR, "").strip() or None


def collective_timeout(env: Mapping[str, str] | None = None) -> float | None:
    """Return ``MPI4JAX_DIST_COLLECTIVE_TIMEOUT`` in seconds, or None (off).

    The longest any of the package's collectives (``allreduce``, ``iallreduce``'s
    wait, the bootstrap's) waits; past it the job ends with a report of who was
    missing. Unset, empty or ``0``: off.

    Raises:
        ValueError: the value is not a non-negative number of seconds.
    """
    return _seconds(
        COLLECTIVE_TIMEOUT,
        "how long a collective may wait (longer than the slowest rank's work "
        "between two collectives, e.g. 600)",
        env,
    )


def hang_timeout(env: Mapping[str, str] | None = None) -> float | None:
    """Return ``MPI4JAX_DIST_HANG_TIMEOUT`` in seconds, or None (off).

    How long the ranks of a job may all make no progress (no rank's main thread
    running Python) while they stand at different places, whatever they wait in,
    before the job is taken for hung: every rank's stacks, one report, the job
    ends. Unset, empty or ``0``: off.

    Raises:
        ValueError: the value is not a non-negative number of seconds.
    """
    return _seconds(
        HANG_TIMEOUT,
        "how long every rank may go without progress (longer than the longest "
        "step of the program, e.g. 900)",
        env,
    )


def _seconds(name: str, meaning: str, env: Mapping[str, str] | None) -> float | None:
    env = environ() if env is None else env
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
        wrong = (
            "is negative"
            if seconds < 0
            else "is not finite" if not math.isfinite(seconds) else None
        )
    except ValueError:
        wrong = "is not a number of seconds"
    if wrong:
        raise ValueError(
            f"{name}={value!r} {wrong}. Set it to {meaning}, or 0 or nothing to "
            f"turn it off."
        )
    return seconds or None
