"""The allreduce implementations the benchmarks compare, and their checked pattern.

``allreduce.py`` times every record of :data:`IMPLS` and checks its results;
``memory.py`` measures their peak memory, a job per case. A record is one class,
registered under the name ``--impls`` takes; :class:`Allreduce` documents the
interface. Each rank loads :func:`pattern`, whose sum :func:`expected` differs
between indices and between ranks (made and checked by XLA for 2^31 elements and
more: :func:`device_pattern`, :func:`count_wrong_blocks`).
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

IMPLS = _harness.Registry("allreduce implementation")
DTYPES = ("float32", "float64", "int32", "int8")

# --- The checked pattern --------------------------------------------------------------

# Values the checks produce must be integers the dtype holds exactly: below 2^24 in
# float32 (24-bit significand), 2^53 in float64, 2^31 in int32, 2^7 in int8 (for
# benchmarks/memory.py's 2^31 + 16 elements per rank). Every partial sum
# of non-negative terms is at most the total, so any reduction order is exact.
EXACT_BELOW = {"float32": 2**24, "float64": 2**53, "int32": 2**31, "int8": 2**7}
# a(i), c(i) in [0, PATTERN_MAX] at most: enough distinct values that neighbouring
# indices almost never share S(i), small enough to be exact for many ranks.
PATTERN_MAX = 1023


def _largest(procs: int, limit: int) -> int:
    """Return the largest M with ``P S(i) < limit`` for ``a, c <= M`` (may be < 1)."""
    p = procs
    q = (p - 1) * p * (2 * p - 1) // 6  # sum_r r^2
    # P S(i) <= P (P M + M P (P - 1) / 2 + Q) = M P^2 (P + 1) / 2 + P Q
    return (limit - 1 - p * q) // (p * p * (p + 1) // 2)


def max_procs(dtype) -> int:
    """Return the most ranks whose checked values ``dtype`` holds exactly."""
    limit = EXACT_BELOW[np.dtype(dtype).name]
    low, high = 1, 2
    while _largest(high, limit) >= 1:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if _largest(mid, limit) >= 1 else (low, mid)
    return low


def pattern_bound(procs: int, dtype) -> int:
    """Return M, the bound of ``a(i)`` and ``c(i)`` in ``[0, M]`` for ``procs`` ranks,
    so that every checked value (up to ``P * S(i)``) is exact in the dtype;
    ``ValueError`` naming ``--dtype`` and the fix where not even ``M = 1`` is."""
    name = np.dtype(dtype).name
    bound = _largest(procs, EXACT_BELOW[name])
    if bound < 1:
        wider = (
            f"use --dtype float64 (exact up to {max_procs('float64')} ranks)"
            if name != "float64"
            else "use fewer ranks"
        )
        raise ValueError(
            f"--dtype {name}: the checked values are exact integers in {name} for "
            f"at most {max_procs(name)} ranks, not {procs}; {wider}"
        )
    return min(PATTERN_MAX, bound)


def _mix(index: np.ndarray) -> np.ndarray:
    """Return splitmix64 of ``index`` (uint64): the same on every rank."""
    z = index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _coefficients(n: int, procs: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Return ``a(i)`` and ``c(i)``, pseudo-random in ``[0, M]`` (int64)."""
    span = np.uint64(pattern_bound(procs, dtype) + 1)
    h = _mix(np.arange(n, dtype=np.uint64))
    a = (h % span).astype(np.int64)
    c = ((h >> np.uint64(32)) % span).astype(np.int64)
    return a, c


def pattern(n: int, rank: int, procs: int, dtype) -> np.ndarray:
    """Return rank ``rank``'s input ``e_r(i) = a(i) + c(i) r + r^2``.

    ``a`` and ``c`` come from a hash of ``i``, so that ``S(i)`` differs between
    indices (a permuted or broadcast result is wrong) and every rank contributes
    its own values (one rank's data, or P times one rank's, is wrong: the ``r^2``
    term keeps the middle rank of an odd P from matching ``S / P``).
    """
    a, c = _coefficients(n, procs, dtype)
    return (a + c * rank + rank * rank).astype(dtype)


def expected(n: int, procs: int, dtype, reductions: int = 1) -> np.ndarray:
    """Return what ``reductions`` chained allreduces of :func:`pattern` give:
    ``S(i) = P a(i) + c(i) P (P - 1) / 2 + sum_r r^2``, times ``P`` per extra one."""
    a, c = _coefficients(n, procs, dtype)
    p = procs
    s = p * a + c * (p * (p - 1) // 2) + (p - 1) * p * (2 * p - 1) // 6
    return (s * p ** (reductions - 1)).astype(dtype)


def count_wrong(result, want: np.ndarray) -> int:
    """Return how many elements of ``result`` differ from ``want`` (all of them
    when the shape is not ``want``'s)."""
    result = np.asarray(result)
    if result.shape != want.shape:
        return want.size
    return int(np.count_nonzero(result != want))


# The same pattern computed by XLA, for messages of 2^31 elements and more: NumPy
# builds 2^31 uint64 hashes as 16 GiB temporaries (about 80 s a rank here); XLA
# fuses the hash into one pass that writes only the result (2 s).
BLOCK = 1 << 26  # elements per block of a check


def _device_values(start, n: int, rank, procs: int, dtype, reductions: int):
    """Traced: elements ``start .. start + n`` of :func:`pattern` (``reductions``
    0) or of :func:`expected`, as NumPy computes them (call under x64)."""
    import jax.numpy as jnp
    from jax import lax

    i = lax.iota(jnp.uint64, n) + start
    z = i + jnp.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> jnp.uint64(30))) * jnp.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> jnp.uint64(27))) * jnp.uint64(0x94D049BB133111EB)
    h = z ^ (z >> jnp.uint64(31))
    span = jnp.uint64(pattern_bound(procs, dtype) + 1)
    a = (h % span).astype(jnp.int64)
    c = ((h >> jnp.uint64(32)) % span).astype(jnp.int64)
    if reductions == 0:
        return (a + c * rank + rank * rank).astype(dtype)
    p = procs
    s = p * a + c * (p * (p - 1) // 2) + (p - 1) * p * (2 * p - 1) // 6
    return (s * p ** (reductions - 1)).astype(dtype)


def device_pattern(n: int, rank: int, procs: int, dtype):
    """Return :func:`pattern` as a JAX array on the default device, computed there
    (equal to NumPy's, element for element)."""
    import jax

    from mpi4jax_dist import _compat

    dtype = np.dtype(dtype).name
    with _compat.enable_x64(True):
        make = jax.jit(lambda r: _device_values(0, n, r, procs, dtype, 0))
        return make(np.int64(rank))


def count_wrong_blocks(result, n: int, procs: int, dtype) -> int:
    """Return how many elements of ``result`` (NumPy, or anything
    ``np.asarray`` takes without a copy) differ from :func:`expected`; the
    expected values are made by XLA a block at a time, so that a check of 2^31
    elements costs one block of memory."""
    import jax.numpy as jnp

    from mpi4jax_dist import _compat

    result = np.asarray(result)
    if result.shape != (n,):
        return n
    wrong = 0
    with _compat.enable_x64(True):
        for start in range(0, n, BLOCK):
            block = result[start : start + BLOCK]
            wrong += int(
                _count_block(len(block), procs, np.dtype(dtype).name)(
                    jnp.asarray(block), np.uint64(start)
                )
            )
    return wrong


@functools.cache
def _count_block(size: int, procs: int, dtype: str):
    import jax
    import jax.numpy as jnp

    def count(block, start):
        want = _device_values(start, size, 0, procs, dtype, 1)
        return jnp.sum(block != want, dtype=jnp.int64)

    return jax.jit(count)


# --- Implementations ------------------------------------------------------------------


class Allreduce:
    """One allreduce implementation: the interface every record of IMPLS has.

    Args (of the constructor):
        n: elements per rank.
        dtype: a NumPy dtype from :data:`DTYPES`.
        comm: the mpi4py communicator of the job (every rank constructs).

    Construction allocates the buffers and, for JAX, compiles ahead of time
    (``jax.jit(f).lower(...).compile()``), so that neither the timing nor the memory
    figures include compilation. Then:

    - ``load(array)``: make this rank's ``n`` elements the input; returns when it
      is in place and ``array`` is no longer held.
    - ``call()``: one allreduce of the loaded input; blocks until done. The input
      is held (out-of-place implementations leave it as it was).
    - ``loop(k)``: ``x <- allreduce(x)`` ``k`` times from the loaded input, in one
      dispatch; blocks. ``k`` is a runtime value: the same executable runs any k.
    - ``result()``: this rank's result of the last ``call`` or ``loop``, a NumPy
      array of ``n`` elements, valid until the next ``load``, ``call`` or ``loop``
      (it may be a view of the implementation's own buffer).
    - ``around(block)``: ``block`` (a timed block of calls or a loop) as it is
      timed; a variant that turns a setting on for its own blocks wraps it.

    ``call`` and ``loop`` may overwrite the loaded input (in-place ones do): load
    again before a check. Class attribute ``uses_jax`` says whether results live on
    JAX devices (benchmarks/memory.py then asks the device for its memory);
    ``transport`` names what carries the data (``"mpi"``, or ``"xla"`` for XLA's
    own collectives): cases are timed round-robin within one transport at a time;
    ``in_place`` says whether the result is written over the input (no second
    buffer), the table's ``in-place`` column.
    """

    uses_jax = False
    transport = "mpi"
    in_place = False

    def __init__(self, n: int, dtype, comm):
        self.n, self.dtype, self.comm = n, np.dtype(dtype), comm

    def load(self, array: np.ndarray) -> None:
        raise NotImplementedError

    def call(self) -> None:
        raise NotImplementedError

    def loop(self, k: int) -> None:
        raise NotImplementedError

    def result(self) -> np.ndarray:
        raise NotImplementedError

    def around(self, block):
        return block


@IMPLS.register("mpi4py")
class Mpi4py(Allreduce):
    """``Comm.Allreduce(x, y)`` on NumPy buffers, out of place: the floor."""

    def __init__(self, n, dtype, comm):
        super().__init__(n, dtype, comm)
        from mpi4py import MPI

        self.sum = MPI.SUM
        # The timed input is all zeros. (np.zeros of a large array maps zero pages
        # without touching them: the checks and the warm-up touch them first.)
        self.x = np.zeros(n, self.dtype)
        self.y = np.zeros(n, self.dtype)
        self.out = self.x

    def load(self, array):
        np.copyto(self.x, array)
        self.out = None  # the last result is dropped, as the JAX ones drop theirs

    def call(self):
        # A fresh result buffer per call, as a functional API (and JAX) pays.
        self.out = np.empty_like(self.x)
        self.comm.Allreduce(self.x, self.out, op=self.sum)

    def loop(self, k):
        x, y = self.x, self.y
        for _ in range(k):
            self.comm.Allreduce(x, y, op=self.sum)
            x, y = y, x
        # The last result is in x: it is the input of the next loop.
        self.x, self.y, self.out = x, y, x

    def result(self):
        return self.out


@IMPLS.register("mpi4py_inplace")
class Mpi4pyInplace(Mpi4py):
    """``Comm.Allreduce(MPI.IN_PLACE, x)``: no result buffer at all."""

    in_place = True

    def __init__(self, n, dtype, comm):
        Allreduce.__init__(self, n, dtype, comm)
        from mpi4py import MPI

        self.sum, self.in_place = MPI.SUM, MPI.IN_PLACE
        self.x = np.zeros(n, self.dtype)
        self.out = self.x

    def load(self, array):
        np.copyto(self.x, array)

    def call(self):
        self.comm.Allreduce(self.in_place, self.x, op=self.sum)

    def loop(self, k):
        for _ in range(k):
            self.comm.Allreduce(self.in_place, self.x, op=self.sum)


class JaxAllreduce(Allreduce):
    """Shared by the JAX implementations: ``one(x)`` and ``chain(x, k)`` (a
    ``fori_loop``), compiled ahead of time (``executables``) and called through
    ``jax.jit``. Subclasses define :meth:`reduce`, :meth:`wrap` (jit with the
    sharding), :meth:`input_spec`, :meth:`to_device` and :meth:`to_host`; may
    define :meth:`extra_args` and :meth:`operand` (memory.py's intermediates)."""

    uses_jax = True

    def __init__(self, n, dtype, comm):
        super().__init__(n, dtype, comm)
        import jax
        import jax.numpy as jnp

        self.jax = jax
        spec = self.input_spec()
        trips = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.scalar_sharding())
        self.extra = self.extra_args()

        def one(x, *extra):
            return self.reduce(self.operand(x, *extra))

        def chain(x, k, *extra):
            start = self.operand(x, *extra)
            return jax.lax.fori_loop(0, k, lambda _, v: self.reduce(v), start)

        # Compiled ahead of time, but called through jit: jax 0.10's executables
        # from .compile() drop the effect token on their second call when the
        # program has ordered effects (mpi4jax's do): "Execution supplied 2
        # arguments but compiled program expected 3". jit dispatch reuses the
        # executable compiled here (benchmarks/memory.py counts compilations
        # during the measured call to show it).
        self._one = self.wrap(one, 1)
        self._chain = self.wrap(chain, 2)
        self.executables = {
            "one": self._one.lower(spec, *self.extra).compile(),
            "chain": self._chain.lower(spec, trips, *self.extra).compile(),
        }
        self._trips = {}
        self.x = self.to_device(np.zeros(n, self.dtype))
        self.y = self.x

    def extra_args(self) -> tuple:
        return ()

    def operand(self, x, *extra):
        return x

    def scalar_sharding(self):
        return None

    def trip_count(self, k: int):
        """Return ``k`` as the executable's int32 argument (made once per k)."""
        if k not in self._trips:
            self._trips[k] = self.jax.device_put(np.int32(k))
        return self._trips[k]

    def load(self, array):
        self.x = self.y = None  # free the old buffers first
        self.x = self.to_device(np.asarray(array, self.dtype))
        self.x.block_until_ready()
        # jaxlib holds the host array until the next dispatch after the copy
        # (at 64 MiB RSS stayed 64 MiB higher until then): release it now, not
        # inside the measured call (benchmarks/memory.py).
        self.jax.device_put(np.zeros(1)).block_until_ready()

    def call(self):
        self.y = None
        self.y = self._one(self.x, *self.extra)
        self.y.block_until_ready()

    def loop(self, k):
        self.y = None
        self.y = self._chain(self.x, self.trip_count(k), *self.extra)
        self.y.block_until_ready()

    def result(self):
        return self.to_host(self.y)


@IMPLS.register("mpi4jax")
class Mpi4jax(JaxAllreduce):
    """``mpi4jax.allreduce`` inside ``jax.jit`` on this rank's own array."""

    def reduce(self, v):
        import mpi4jax
        from mpi4py import MPI

        return mpi4jax.allreduce(v, op=MPI.SUM, comm=self.comm)

    def wrap(self, f, arity):
        return self.jax.jit(f)

    def input_spec(self):
        return self.jax.ShapeDtypeStruct((self.n,), self.dtype)

    def to_device(self, array):
        return self.jax.device_put(array)

    def to_host(self, array):
        return np.asarray(array)


@IMPLS.register("mpi4jax_dist")
class Mpi4jaxDist(Mpi4jax):
    """``mpi4jax_dist.allreduce`` inside ``jax.jit(..., donate_argnums=0)``: XLA
    hands the handler one buffer, reduced in place; as with ``mpi4py_inplace`` the
    result becomes the next input (the checks load again)."""

    # Its handler counts its calls and whether it got one buffer
    # (mpi4jax_dist._ffi's stats): benchmarks/memory.py reports them.
    extension = True
    in_place = True

    def reduce(self, v):
        from mpi4py import MPI

        import mpi4jax_dist

        return mpi4jax_dist.allreduce(v, MPI.SUM, comm=self.comm)

    def wrap(self, f, arity):
        return self.jax.jit(f, donate_argnums=0)

    def load(self, array):
        super().load(array)
        # jaxlib wraps a 64-byte aligned NumPy array without a copy; XLA cannot
        # donate memory it does not own, and then copied the input to a new
        # buffer in the call (seen on one rank in four). A copy of a JAX array
        # is XLA's own, made without compiling anything.
        self.x = self.jax.device_put(self.x, may_alias=False)
        self.x.block_until_ready()

    def call(self):
        x, self.x, self.y = self.x, None, None
        self.x = self.y = self._one(x, *self.extra)
        self.y.block_until_ready()

    def loop(self, k):
        x, self.x, self.y = self.x, None, None
        self.x = self.y = self._chain(x, self.trip_count(k), *self.extra)
        self.y.block_until_ready()


@IMPLS.register("mpi4jax_dist_unchecked")
class Mpi4jaxDistUnchecked(Mpi4jaxDist):
    """``mpi4jax_dist`` compiled with ``MPI4JAX_DIST_CHECKS=0``: no header checked
    against the other ranks' calls, so that one run shows what the checks cost
    (not among the defaults: ``--impls ...,mpi4jax_dist_unchecked``)."""

    def __init__(self, n, dtype, comm):
        from mpi4jax_dist import _config

        # Read when the calls are compiled: here, ahead of time.
        before = os.environ.get(_config.CHECKS)
        os.environ[_config.CHECKS] = "0"
        try:
            super().__init__(n, dtype, comm)
        finally:
            if before is None:
                del os.environ[_config.CHECKS]
            else:
                os.environ[_config.CHECKS] = before


@IMPLS.register("mpi4jax_dist_timeline")
class Mpi4jaxDistTimeline(Mpi4jaxDist):
    """``mpi4jax_dist`` with the timeline on for its own timed blocks (turned on
    and off around each, as ``around`` wraps them: in ``loop`` its fixed part),
    its events written to a temporary file, so that one run shows what the
    timeline costs (not among the defaults: ``--impls ...,mpi4jax_dist_timeline``)."""

    def __init__(self, n, dtype, comm):
        import tempfile

        from mpi4jax_dist import _ffi

        super().__init__(n, dtype, comm)
        self.events, self.module = tempfile.TemporaryFile(), _ffi.load()

    def around(self, block):
        from mpi4jax_dist.timing.timeline import CAPACITY

        def timed():
            self.module.timeline_start(self.events.fileno(), CAPACITY)
            try:
                block()
            finally:
                self.module.timeline_stop()

        return timed


class GlobalJax(JaxAllreduce):
    """Shared by psum and gspmd: a global array over ``mpi4jax_dist.global_mesh()``,
    the trip count replicated."""

    transport = "xla"

    def __init__(self, n, dtype, comm):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import mpi4jax_dist

        self.mesh = mpi4jax_dist.global_mesh()
        self.axis = self.mesh.axis_names[0]
        self.replicated = NamedSharding(self.mesh, P())
        super().__init__(n, dtype, comm)

    def scalar_sharding(self):
        return self.replicated

    def trip_count(self, k):
        if k not in self._trips:
            # Every process holds the same value: a global replicated scalar.
            self._trips[k] = self.jax.make_array_from_callback(
                (), self.replicated, lambda _: np.int32(k)
            )
        return self._trips[k]


@IMPLS.register("psum")
class Psum(GlobalJax):
    """``shard_map`` + ``lax.psum`` over the global array, one block per rank."""

    def reduce(self, v):
        return self.jax.lax.psum(v, self.axis)

    def wrap(self, f, arity):
        from jax.sharding import PartitionSpec as P

        from mpi4jax_dist import _compat

        # check=False: a fori_loop carrying psum's result fails the varying-
        # manual-axes check of current JAX (DESIGN.md section 6).
        specs = (P(self.axis), P())[:arity]
        return self.jax.jit(
            _compat.shard_map(f, mesh=self.mesh, in_specs=specs, out_specs=P(self.axis))
        )

    def input_spec(self):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return self.jax.ShapeDtypeStruct(
            (self.comm.Get_size() * self.n,),
            self.dtype,
            sharding=NamedSharding(self.mesh, P(self.axis)),
        )

    def to_device(self, array):
        import mpi4jax_dist

        return mpi4jax_dist.to_global(array, self.mesh)

    def to_host(self, array):
        import mpi4jax_dist

        return np.asarray(mpi4jax_dist.to_local(array))


@IMPLS.register("gspmd")
class Gspmd(GlobalJax):
    """A ``(P, n)`` global array sharded by rows; ``x.sum(axis=0)`` broadcast back,
    the collective left to XLA's partitioner."""

    def rows(self):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return NamedSharding(self.mesh, P(self.axis))

    def reduce(self, v):
        total = v.sum(axis=0, keepdims=True)
        return self.jax.lax.with_sharding_constraint(
            self.jax.numpy.broadcast_to(total, v.shape), self.rows()
        )

    def wrap(self, f, arity):
        return self.jax.jit(f, out_shardings=self.rows())

    def input_spec(self):
        return self.jax.ShapeDtypeStruct(
            (self.comm.Get_size(), self.n), self.dtype, sharding=self.rows()
        )

    def to_device(self, array):
        import mpi4jax_dist

        return mpi4jax_dist.to_global(array[None, :], self.mesh)

    def to_host(self, array):
        import mpi4jax_dist

        return np.asarray(mpi4jax_dist.to_local(array))[0]


# What a run measures unless --impls says otherwise: every implementation
# registered above (so after the last of them), but the variants that show what
# a setting costs.
VARIANTS = ("mpi4jax_dist_unchecked", "mpi4jax_dist_timeline")
DEFAULT_IMPLS = [name for name in IMPLS.names() if name not in VARIANTS]
