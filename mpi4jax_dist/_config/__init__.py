"""Every environment variable mpi4jax_dist reads, parsed and validated in one place.

Precedence everywhere: an explicit argument, then the variable, then the default.
Values that make no sense raise a ``ValueError`` naming the variable, the value and
the fix; where ignoring a value is safe, a ``RuntimeWarning`` says so instead.

Launcher variables (``PMI_RANK`` and friends) are read through :func:`environ` and
interpreted in ``launch/detect.py``; this package only owns the ones that configure
us, in one module of each concern: ``env`` (the environment, boolean switches),
``launch`` (the cluster envs, the coordinator, the CPU collectives), ``devices``
(which devices a process sees), ``faults`` (fail-fast, stacks, timeouts),
``diagnostics`` (the timeline), ``ops`` (what a compiled call reads) and
``proxies``. Callers import the package
(``from mpi4jax_dist import _config``) and use the names gathered here
(``_config.COLLECTIVE_TIMEOUT``, ``_config.collective_timeout()``).
"""

from .devices import (  # noqa: F401
    LOCAL_DEVICE_IDS,
    PLATFORMS,
    VISIBLE_DEVICES,
    ZE_AFFINITY_MASK,
    ZE_HIERARCHIES,
    ZE_HIERARCHY,
    level_zero_hierarchy,
    level_zero_mask,
    local_device_ids,
    platforms,
    visible_devices,
)
from .diagnostics import STATUS_DIR, TIMELINE, status_dir, timeline_dir  # noqa: F401
from .env import (  # noqa: F401
    SettingWarning,
    environ,
    get_bool,
    setting_warnings_on_rank_0,
    warn_at_user_line,
    warn_setting,
)
from .faults import (  # noqa: F401
    COLLECTIVE_TIMEOUT,
    DEFAULT_HANG_TIMEOUT_S,
    FAIL_FAST,
    HANG_DIR,
    HANG_TIMEOUT,
    JAX_PREEMPTION,
    STACKS,
    collective_timeout,
    fail_fast,
    hang_dir,
    hang_timeout,
    hang_timeout_set,
    jax_preemption_requested,
    stacks_on_signal,
)
from .launch import (  # noqa: F401
    BIND_ADDRESS,
    CACHE_EVERY_PROCESS,
    COORDINATOR_ADDRESS,
    COORDINATOR_PORT,
    CPU_COLLECTIVES,
    DISABLE,
    INTERFACE,
    JAX_CPU_COLLECTIVES,
    ONE_PROCESS,
    THREAD_LEVEL_VARIABLES,
    TRAMPOLINE_LIB,
    cache_every_process,
    coordinator_address,
    coordinator_port,
    cpu_collectives,
    default_bind_address,
    disabled,
    interface,
    one_process,
    parse_port,
    split_host_port,
    thread_level_settings,
    trampoline_lib,
)
from .ops import (  # noqa: F401
    ALLREDUCE_CHUNK_BYTES,
    CHECKS,
    CUDA_AWARE_MPI,
    DEFAULT_ALLREDUCE_CHUNK_BYTES,
    DEFAULT_STAGING_BYTES,
    MIN_STAGING_BYTES,
    MPI4JAX_CUDA_AWARE_MPI,
    STAGING_BYTES,
    TOKEN_REUSE,
    TOKENS_IN_PROGRAM,
    allreduce_chunk_bytes,
    checks,
    cuda_aware_mpi,
    cuda_aware_source,
    staging_bytes,
    token_reuse,
    tokens_in_program,
)
from .proxies import (  # noqa: F401
    NO_GRPC_PROXY,
    PROXY,
    PROXY_SETTINGS,
    PROXY_VARIABLES,
    caught_by_proxy,
    exempt_from_proxy,
    false_proxy_alarms,
    keep_proxy,
    proxies_set,
)


def first_bad_setting(env=None) -> str | None:
    """Return the error of the first of the variables read where they are used
    (the coordinator port; the allreduce's chunk and staging sizes) whose value
    is bad, or None. The bootstrap asks on every rank and rank 0's answer rules
    for the job, as for the fault settings: a bad value every rank shares ends
    the job once, at its start, instead of on every rank where it is used.

    The switches are read here too, whether or not the job uses them: a value
    none of them can take warns (:class:`SettingWarning`) as the job starts,
    alone or under a launcher, on rank 0 alone."""
    for read in (coordinator_port, allreduce_chunk_bytes, staging_bytes):
        try:
            read(env=env)
        except ValueError as err:
            return str(err)
    for switch in (
        fail_fast,
        stacks_on_signal,
        cache_every_process,
        cuda_aware_mpi,
        token_reuse,
        tokens_in_program,
        keep_proxy,
    ):
        switch(env=env)
    return None
