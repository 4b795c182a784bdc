"""What the compiled ops read: the allreduce's chunk, the CUDA path's staging
buffer and CUDA-aware MPI, the checks, the runtime token's reuse (``ops/``)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from .env import _FALSE, _TRUE, environ, get_bool, warn_setting

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
        warn_setting(
            f"{CUDA_AWARE_MPI}={env[CUDA_AWARE_MPI]!r} is none of force, 1 (on) or "
            f"0 (off); staging through host memory ({CUDA_AWARE_MPI}=0)."
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
    rank with one report naming each side, instead of returning wrong values;
    and, rank 0's value for the job, the watchdog ends within seconds a job whose
    ranks all wait in calls MPI cannot match (:mod:`mpi4jax_dist.faults.standstill`).
    ``MPI4JAX_DIST_CHECKS=0`` leaves the header and that watchdog out. Read when a
    call is compiled; set it alike on every rank.
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
    """Return whether a one-device CPU program makes mpi4jax's ordering token
    inside itself instead of taking JAX's runtime token, and so gets JAX's C++
    dispatch (default on, on the JAX versions it ran on:
    :func:`mpi4jax_dist._compat.tokens_in_program`).
    ``MPI4JAX_DIST_TOKENS_IN_PROGRAM=0`` keeps JAX's runtime tokens."""
    return get_bool(TOKENS_IN_PROGRAM, True, env)
