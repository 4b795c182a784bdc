"""What the compiled collectives did in this process: :func:`op_counts`."""

from __future__ import annotations

from .. import _ffi


def op_counts(*, reset: bool = False) -> dict[str, int]:
    """Return what the package's compiled ``allreduce`` and ``iallreduce`` did in
    this process since it started (or since the last ``reset``), counted by the
    handlers as they ran, on every platform whose extension is loaded.

    Args:
        reset: set every count to zero after reading them.

    Returns:
        A dict of ints: ``handler_calls`` (allreduce calls run),
        ``same_buffer_calls`` (of those, handed one buffer for operand and
        result; XLA copies an argument that is not donated into it first, so the
        result's address, not this count, says whether the caller's buffer was
        used),
        ``mpi_calls`` and ``large_count_calls`` (MPI reductions made, and of
        those with ``MPI_Count`` counts), ``max_call_count`` (the most elements
        one MPI call took), ``locked_sections`` (MPI calls under the lock of
        ``MPI_THREAD_SERIALIZED``; 0 under ``multiple``), and for ``iallreduce``
        ``iallreduce_starts``, ``..._large_count_starts`` (of those, with
        ``MPI_Count`` counts), ``..._waits``, ``..._done_before_wait`` (waits
        that found the reduction complete), ``..._wait_slack_ns`` (from posts to
        waits: the work overlapped), ``..._wait_blocked_ns`` (what the waits
        still waited), ``..._tests``, ``..._tests_done``, ``..._max_pending``;
        with the CUDA extension loaded also ``cuda_aware_calls``,
        ``staged_calls``, ``staged_chunks`` (through pinned host memory) and
        ``pinned_bytes``, ``pinned_peak_bytes`` (now, and the most at once).

    Raises:
        ImportError: the extension was built for another MPI than mpi4py's (as
            the first call of ``allreduce`` would).
    """
    modules = _ffi.loaded_extensions() or [_ffi.load()]
    counts: dict[str, int] = {}
    # The counts are the core's, one set a process that every module reads
    # (conf/builder.py): each module adds only the names it alone has (the CUDA
    # module's staging counts, the CPU module's iallreduce_*).
    for module in modules:
        counts.update((name, int(value)) for name, value in module.stats().items())
    if reset:
        for module in modules:
            module.reset_stats()
    return counts
