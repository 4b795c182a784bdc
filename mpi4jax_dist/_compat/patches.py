"""Every change this package makes to JAX itself, one function each.

Each docstring says why JAX's own behaviour does not serve, the JAX versions the
change is for, the tests that show it works and that it is still needed, when to
drop it, and the upstream change that would retire it: docs/replacements.rst writes
each out as an issue for JAX (with Python's, ``faults/failfast.py``), in one table.
Each is idempotent and chooses by the table of versions (``versions.py``), nowhere
else.

=============================  =========================================================
function                       what of JAX it changes
=============================  =========================================================
register_first                 the order of ``ClusterEnv._cluster_types``
disable_preemption_service     before 0.8.2: ``global_state``'s start of the service
publish_gloo_address           the CPU backend's factory (through ``jax.extend``)
cache_on_every_process         ``compiler.compile_or_get_cached`` and ``_cache_write``
reuse_runtime_tokens           ``dispatch.RuntimeTokenSet.get_token_input``
tokens_in_program              ``mlir.lower_jaxpr_to_module``, ``mlir.jaxpr_subcomp``
                               and ``dispatch.RuntimeTokenSet.block_until_ready``
=============================  =========================================================
"""

from __future__ import annotations

import inspect
import threading
import warnings

import jax
from jax._src import distributed as _distributed

from .extra import has_mpi4jax, mpi4jax_effect_if_imported
from .jax_api import (
    ClusterEnv,
    backends_initialized,
    cpu_collectives,
    distributed_runtime,
)
from .versions import JAX_VERSION, cache_write_params, since


def register_first(cls) -> None:
    """Move the ClusterEnv subclass ``cls`` to the front of JAX's detection order.

    Why: subclasses register themselves on definition, at the end of JAX's list, and
    ``jax.distributed.initialize()`` takes the first present: JAX's own are asked
    before ours. Under an MPI launch the MPI view is the truth (mpiexec inside a
    Slurm allocation leaves Slurm's variables of the Hydra proxies, which JAX's
    SlurmCluster reads as a world of other ranks), so ours is asked first. JAX's
    ``cluster_detection_method`` names one env, and is the user's argument.
    For: jax 0.6.0 to today (``ClusterEnv._cluster_types``, a list).
    Test: tests/unit/test_package.py's test_registered_first_under_own_name (ours first,
    once); tests/cluster/test_slurm_cluster.py's
    test_jax_alone_under_mpiexec_in_sbatch_is_not_one_world (what JAX's order does
    without it). Drop it when JAX lets a library put its cluster env first.
    Retired upstream by: a ``ClusterEnv.priority`` that cluster detection sorts by.
    """
    registry = ClusterEnv._cluster_types
    registry[:] = [cls] + [c for c in registry if c is not cls]


def disable_preemption_service() -> None:
    """Keep the next ``jax.distributed.initialize`` from starting JAX's preemption
    service, so that SIGTERM keeps its default action.

    Why: the service's notifier catches SIGTERM and only takes note of it, so the
    launcher's SIGTERM (after another rank's ``MPI_Abort``, or a job's end) would
    not end the process (docs/faults.rst, *When a rank fails*).
    For: jax 0.6.0 to 0.8.1, which start the service with no option to refuse it:
    the state's start of it becomes a no-op, as the option's False makes it later
    (``multihost_utils.reached_preemption_sync_point`` then raises, as there). From
    0.8.2, ``jax_enable_preemption_service`` is set: no patch.
    Test: tests/jobs/test_jax_compat.py's test_disable_preemption_service;
    tests/jobs/test_failfast.py's test_switch_off_brings_back_jax_behaviour (SIGTERM
    caught by JAX's notifier without it). Drop the patch when the floor reaches
    jax 0.8.2.
    Retired upstream by: jax 0.8.2's ``jax_enable_preemption_service`` (done).
    """
    if since("jax_enable_preemption_service"):
        jax.config.update("jax_enable_preemption_service", False)
        return
    _distributed.global_state.initialize_preemption_sync_manager = lambda: None


def _cpu_registration():
    """JAX's registration of its CPU backend's factory, or None."""
    from jax._src import xla_bridge

    return xla_bridge._backend_factories.get("cpu")


def publish_gloo_address(address: str) -> bool:
    """Make JAX's CPU client give its Gloo collectives ``address``; return whether
    this JAX allows it. Must run before the CPU backend exists.

    Why: JAX makes Gloo's TCP collectives without an address, and Gloo then
    publishes the one its host name resolves to (127.0.1.1 on Debian-like hosts: no
    other node reaches it). jaxlib's ``make_gloo_tcp_collectives`` takes a
    ``hostname`` and JAX's CPU backend factory takes ready ``collectives``, so the
    factory is wrapped and registered again with JAX's public
    ``jax.extend.backend.register_backend_factory`` (its priority and the rest
    kept): where the collectives are gloo and a distributed client exists when the
    CPU backend is made, Gloo gets ``address``; otherwise JAX's own factory runs as
    it would. For: jax 0.6.0 to today. Test: tests/jobs/test_jax_compat.py's
    test_publish_gloo_address (the address reaches Gloo);
    tests/cluster/test_slurm_cluster.py's
    test_jax_alone_gloo_fails_across_debian_style_nodes (without it, the first
    collective across nodes fails). Drop it when JAX gives Gloo an address the
    other nodes reach, or takes one.
    Retired upstream by: JAX options passed on as ``make_gloo_tcp_collectives``'
    ``hostname`` and ``interface``, which jaxlib takes already.
    """
    from jax.extend.backend import register_backend_factory

    registration = _cpu_registration()
    if registration is None or backends_initialized():
        return False
    own = registration.factory
    original = getattr(own, "jax_factory", own)  # ours already: wrap JAX's again
    if "collectives" not in inspect.signature(original).parameters:
        return False

    def make_cpu_client(**kwargs):
        client = _distributed.global_state.client
        if kwargs or client is None or cpu_collectives() != "gloo":
            return original(**kwargs)
        gloo = distributed_runtime().make_gloo_tcp_collectives(
            distributed_client=client, hostname=address
        )
        return original(collectives=gloo)

    make_cpu_client.jax_factory = original
    make_cpu_client.gloo_address = address
    register_backend_factory(
        "cpu",
        make_cpu_client,
        priority=registration.priority,
        fail_quietly=registration.fail_quietly,
        experimental=registration.experimental,
        c_api=registration.c_api,
    )
    return True


def published_gloo_address() -> str | None:
    """Return the address :func:`publish_gloo_address` gave Gloo, or None."""
    registration = _cpu_registration()
    return getattr(registration.factory, "gloo_address", None) if registration else None


# Whether the program being compiled on this thread runs on this process's devices
# alone (set by cache_on_every_process's wrapper of compile_or_get_cached).
_compiling = threading.local()


def cache_on_every_process() -> bool:
    """Let every process write the persistent compilation cache entries of the
    programs that run on its devices alone; return whether this JAX allows it.

    Why: JAX's ``compiler._cache_write`` writes only where
    ``distributed.global_state.process_id == 0``, made for SPMD programs that every
    process compiles alike: process 0's entry serves all. A program of one
    process's devices (an mpi4jax code's per-rank ``jit``) is another key on every
    process, as the key holds the device assignment (stripped on GPU only), so
    after ``jax.distributed.initialize`` the other processes' programs are never
    written and never found. Wrapped here: ``compile_or_get_cached`` notes whether
    the devices are all of one process, and ``_cache_write`` then writes on any
    process (:func:`_write_cache_entry`, JAX's own less the process check).
    Programs over several processes keep JAX's rule.
    For: jax 0.6.0 to today: a JAX whose ``_cache_write`` takes other parameters
    than ``versions.cache_write_params`` says keeps its own rule (False).
    Test: tests/jobs/test_compilation_cache.py's
    test_every_rank_hits_the_cache_on_the_second_run, and
    test_jax_rule_alone_leaves_rank_1_without_entries (JAX's rule alone: rank 1
    misses every time). Drop it when JAX writes on every process the entries of
    programs that no other process compiles.
    Retired upstream by: ``_cache_write`` keeping its ``process_id != 0`` check for
    programs with ``is_multi_process`` only (computed in ``compile_or_get_cached``).
    """
    from jax._src import compiler

    if hasattr(compiler._cache_write, "jax_original"):
        return True
    own_compile = compiler.compile_or_get_cached
    own_write = compiler._cache_write
    compile_params = inspect.signature(own_compile).parameters
    write_params = tuple(inspect.signature(own_write).parameters)
    if "devices" not in compile_params or write_params != cache_write_params():
        return False  # another JAX: its own rule stays
    bind = inspect.signature(own_compile).bind
    bind_write = inspect.signature(own_write).bind

    def compile_or_get_cached(*args, **kwargs):
        devices = bind(*args, **kwargs).arguments["devices"]
        flat = getattr(devices, "flat", devices)
        previous = getattr(_compiling, "one_process", False)
        _compiling.one_process = len({d.process_index for d in flat}) == 1
        try:
            return own_compile(*args, **kwargs)
        finally:
            _compiling.one_process = previous

    def cache_write(*args, **kwargs):
        if _distributed.global_state.process_id == 0 or not getattr(
            _compiling, "one_process", False
        ):
            return own_write(*args, **kwargs)
        return _write_cache_entry(**bind_write(*args, **kwargs).arguments)

    compile_or_get_cached.jax_original = own_compile
    cache_write.jax_original = own_write
    compiler.compile_or_get_cached = compile_or_get_cached
    compiler._cache_write = cache_write
    return True


def _write_cache_entry(
    cache_key, compile_time_secs, module_name, backend, executable, host_callbacks=()
) -> None:
    """JAX's ``_cache_write`` less its ``process_id != 0`` check: JAX's other
    conditions (no host callbacks before jax 0.11, since when programs with them are
    cached; the minimum compile time; the minimum entry size is checked by the
    write itself)."""
    from jax._src import compilation_cache, compiler

    if host_callbacks:
        return  # before jax 0.11: baked into the executable, never cached
    if compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
        return
    try:
        compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs)
        )
    except Exception as err:
        check = getattr(compiler, "_should_raise_persistent_cache_error", None)
        # Older JAX (0.6.0) has no such function: the option alone decides.
        if check(err) if check else jax.config.jax_raise_persistent_cache_errors:
            raise
        warnings.warn(
            f"Error writing persistent compilation cache entry for "
            f"'{module_name}': {type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=2,
        )


# The JAX minors whose suites (the ordering, desync, fail-fast and iallreduce
# tests, mpi4jax's calls mixed with ours) ran with the runtime token reused: on
# others JAX's own path stays. Add a minor when its sweep row passes with it.
TOKEN_REUSE_RAN = ((0, 6), (0, 12))


def reuse_runtime_tokens(enabled: bool = True) -> bool:
    """Hand an ordered-effect program the last one's runtime token as it is, where
    it already sits on the program's one device; return whether that is in force.

    Why: on every call of a program with an ordered effect (mpi4jax's, which the
    package's ops share) JAX's ``RuntimeTokenSet.get_token_input`` (jax 0.6.0 to
    today) ``device_put`` s the last token onto a ``Mesh``/``NamedSharding`` built
    afresh, and the token's shard handler first waits for the last program to end
    and then copies an empty array to the device: half of a 4-byte call's 220 µs
    (docs/design.rst, the compiled op's *Dispatch*). Returning the token as it is
    keeps program order (the runtime waits on the token buffer as on any input)
    and gives up only where the last program's error is raised: at the next
    ``block_until_ready`` instead of the next dispatch (jax#25671).
    For: the JAX minors in :data:`TOKEN_REUSE_RAN`; programs over one device per
    process (several devices keep JAX's resharding). Test:
    tests/jobs/test_jax_compat.py's test_the_runtime_token_is_handed_on_as_it_is (same
    token, same results; with the switch off, JAX's own method and a new token each
    call). Drop it when JAX's own method returns the token it holds (the change in
    docs/design.rst, ready to send).
    Retired upstream by: ``get_token_input`` returning the token it holds where it
    already sits on the call's one device. Idempotent; ``enabled=False``
    (``MPI4JAX_DIST_TOKEN_REUSE=0``) restores JAX's method.
    """
    from jax._src import core, dispatch

    tokens = dispatch.RuntimeTokenSet
    current = tokens.get_token_input
    original = getattr(current, "jax_original", current)
    if not enabled or JAX_VERSION[:2] not in TOKEN_REUSE_RAN:
        tokens.get_token_input = original
        return False
    if current is not original:
        return True

    def get_token_input(self, eff, devices):
        token = self.current_tokens.get(eff)
        if isinstance(token, core.Token) and len(devices) == 1:
            buf = token._buf
            if not buf.is_deleted() and buf.devices() == {devices[0]}:
                return token
        return original(self, eff, devices)

    get_token_input.jax_original = original
    tokens.get_token_input = get_token_input
    return True


# --- mpi4jax's ordering token made inside a one-device CPU program --------------

_in_program = {"main": threading.local(), "lowered": False, "drain": None}


# The JAX minors whose whole suite ran with tokens_in_program on (CI: the oldest
# and the newest; the rows between are tools/jax_sweep.sh's).
TOKENS_IN_PROGRAM_RAN = ((0, 6), (0, 12))


def tokens_in_program(enabled: bool = True) -> bool:
    """Lower a one-device CPU program's main function so that the tokens of
    mpi4jax's ordered effect (the package's ops carry it) are made inside it
    (``create_token`` at entry, dropped at return), and build its executable with
    that effect in neither its ordered nor its unordered effects; return whether
    that is in force.

    Why: JAX refuses its C++ dispatch for any program with effects
    (``pjit._get_fastpath_data``), and for ordered ones adds runtime tokens to its
    inputs and outputs; a 4-byte jitted allreduce then costs ~15x ``jit(v + 1)``.
    Inside the program nothing changes: JAX still threads the effect's token
    through every effectful equation, loops, conds and nested calls included.
    Across programs, order rests on PJRT CPU: a program launched on a device waits
    for the last one launched there (``stream_event_map``'s last enqueue event) as
    it waited for its token before. ``jax.effects_barrier()`` (and JAX's exit
    clean-up, which calls it) no longer sees these programs through tokens: once
    one was lowered, it also runs an empty program on each local CPU device and
    waits for it (PJRT's launch order again: per dispatching thread, as JAX's
    runtime tokens are).
    For: the JAX minors in :data:`TOKENS_IN_PROGRAM_RAN`; CPU programs over one
    device (``num_partitions == 1``), in processes with one CPU device (PJRT
    orders launches per device: with two, programs on two devices crossed their
    allreduces), whose ordered effects include mpi4jax's; any other ordered
    effect in the program keeps its runtime token. Tests:
    tests/jobs/test_tokens_in_program.py (no runtime token, no ordered effect, JAX's
    C++ dispatch; programs dispatched back to back never cross across ranks; the
    barrier waits; two CPU devices and ``enabled=False`` keep JAX's convention)
    and every ordering test of the suite, run with it on. Drop it when JAX gives
    programs whose ordered effects need no runtime token (an effect ordered
    within a program only) its C++ dispatch.
    Retired upstream by: an effect type set ordered within a program only, whose
    token the lowering makes at entry and which the executable's effects leave out.
    Idempotent; ``enabled=False`` (``MPI4JAX_DIST_TOKENS_IN_PROGRAM=0``) restores
    JAX's functions (read before the first lowering: executables already built keep
    their convention).
    """
    from jax._src import dispatch
    from jax._src.interpreters import mlir

    state = _in_program
    current = (
        mlir.lower_jaxpr_to_module,
        mlir.jaxpr_subcomp,
        dispatch.RuntimeTokenSet.block_until_ready,
    )
    originals = tuple(getattr(f, "jax_original", f) for f in current)
    lower_module, subcomp, block = originals
    if not enabled:
        mlir.lower_jaxpr_to_module, mlir.jaxpr_subcomp = lower_module, subcomp
        dispatch.RuntimeTokenSet.block_until_ready = block
        return False
    if current != originals:
        return True
    if JAX_VERSION[:2] not in TOKENS_IN_PROGRAM_RAN or not has_mpi4jax():
        return False

    def lower_jaxpr_to_module(*args, ordered_effects, **kwargs):
        # Looked up here, not when patching: the bootstrap patches before any
        # program imports mpi4jax, and this imports nothing.
        effect = mpi4jax_effect_if_imported()
        platforms = tuple(kwargs.get("platforms") or ())
        # One CPU device in the process: PJRT orders launches per device, where
        # JAX's token also ordered one device's programs after another's.
        mine = (
            effect is not None
            and effect in ordered_effects
            and platforms == ("cpu",)
            and kwargs.get("num_partitions", 1) == 1
            and len(jax.local_devices(backend="cpu")) == 1
        )
        if not mine:
            return lower_module(*args, ordered_effects=ordered_effects, **kwargs)
        # The caller (pxla's lowering) returns this very list as the
        # executable's ordered effects: removed here, it is removed there.
        ordered_effects.remove(effect)
        state["main"].pending = effect
        try:
            result = lower_module(*args, ordered_effects=ordered_effects, **kwargs)
        finally:
            state["main"].pending = None
        state["lowered"] = True
        return result

    def jaxpr_subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs):
        # The first subcomputation of a module lowered above is its main
        # function's body: its token for the effect starts there.
        main = state["main"]
        effect = getattr(main, "pending", None)
        if effect is not None:
            main.pending = None
            if effect in jaxpr.effects and effect not in tokens.effects():
                tokens = mlir.TokenSet(
                    {**dict(tokens.items()), effect: mlir.hlo.create_token()}
                )
        return subcomp(ctx, jaxpr, name_stack, tokens, *args, **kwargs)

    def block_until_ready(self):
        try:
            block(self)
        finally:
            if state["lowered"]:
                _drain_cpu_devices()

    wrappers = (lower_jaxpr_to_module, jaxpr_subcomp, block_until_ready)
    for new, old in zip(wrappers, originals, strict=True):
        new.jax_original = old
    mlir.lower_jaxpr_to_module = lower_jaxpr_to_module
    mlir.jaxpr_subcomp = jaxpr_subcomp
    dispatch.RuntimeTokenSet.block_until_ready = block_until_ready
    return True


def _drain_cpu_devices() -> None:
    """Run an empty program on each local CPU device and wait for it: PJRT CPU
    starts it after the last program launched there ends."""
    import jax.numpy as jnp

    if _in_program["drain"] is None:
        _in_program["drain"] = jax.jit(lambda: jnp.zeros((), jnp.bool_))
    for device in jax.local_devices(backend="cpu"):
        with jax.default_device(device):
            _in_program["drain"]().block_until_ready()
