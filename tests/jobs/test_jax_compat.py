"""Serial: the table of JAX versions in ``_jax_compat``, true of the JAX installed,
and the functions that choose by it.

CI runs this on the oldest JAX that setup.cfg allows and on the newest: a row whose
version is wrong fails at one end or the other.
"""

import importlib.util
import inspect
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import util
from jax._src import config as jax_config

from mpi4jax_dist import _compat

# JAX in this process alone: before any JAX world of an mpiexec session exists.
pytestmark = util.serial_only


def _has_shard_map() -> bool:
    found = getattr(jax, "shard_map", None)
    return found is not None and "check_vma" in inspect.signature(found).parameters


def _has_heartbeat_timeout() -> bool:
    client = _compat.distributed_runtime().get_distributed_runtime_client
    takes = "heartbeat_timeout:" in (client.__doc__ or "")
    return takes and _compat.initialize_accepts("heartbeat_timeout_seconds")


def _has_coordinator_port() -> bool:
    method = _compat.ClusterEnv.get_coordinator_address
    return "override_coordinator_port" in inspect.signature(method).parameters


def _cache_write_takes_no_host_callbacks() -> bool:
    from jax._src import compiler

    own = getattr(compiler._cache_write, "jax_original", compiler._cache_write)
    return "host_callbacks" not in inspect.signature(own).parameters


def _extend_adds_to_trace_context() -> bool:
    """Whether importing jax.extend makes the trace context longer (in a fresh
    interpreter: this one has imported it)."""
    code = (
        "from jax._src import config\n"
        "n = len(config.trace_context())\n"
        "import jax.extend\n"
        "print(len(config.trace_context()) > n)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=util.clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1] == "True"


# Each row of CHANGES, asked of the installed JAX itself.
PROBES = {
    "jax.shard_map": _has_shard_map,
    "jaxlib._jax": lambda: importlib.util.find_spec("jaxlib._jax") is not None,
    "jax_cpu_collectives_implementation": lambda: hasattr(
        jax_config, "DEFAULT_CPU_COLLECTIVES_IMPL"
    ),
    "heartbeat_timeout_seconds": _has_heartbeat_timeout,
    "jax.enable_x64": lambda: hasattr(jax, "enable_x64"),
    "override_coordinator_port": _has_coordinator_port,
    "jax.monitoring.unregister_event_duration_listener": lambda: hasattr(
        jax.monitoring, "unregister_event_duration_listener"
    ),
    "jax_enable_preemption_service": lambda: hasattr(
        jax.config, "jax_enable_preemption_service"
    ),
    "cache host callbacks": _cache_write_takes_no_host_callbacks,
    "jax.extend registers trace context": _extend_adds_to_trace_context,
    "jax_oneapi_visible_devices": lambda: (
        "jax_oneapi_visible_devices" in jax.config.values
    ),
}


def test_every_row_has_a_probe():
    assert PROBES.keys() == _compat.CHANGES.keys()


@pytest.mark.parametrize("change", sorted(_compat.CHANGES))
def test_row_is_true_of_this_jax(change):
    first = ".".join(map(str, _compat.CHANGES[change]))
    assert _compat.since(change) == PROBES[change](), (
        f"jax {jax.__version__}: the table says {change} came in {first}, but this "
        f"JAX {'has' if PROBES[change]() else 'lacks'} it"
    )


def _docstring_rows() -> dict:
    """Return ``{version: text}`` of the table in the module's docstring."""
    rows: dict = {}
    version = None
    for line in _compat.__doc__.splitlines():
        if line.startswith("="):
            version = None
            continue
        match = re.match(r"(\d+\.\d+\.\d+)\s+(.*)", line)
        if match:
            version = match.group(1)
            rows[version] = match.group(2)
        elif version is not None and line.strip():
            rows[version] += " " + line.strip()
    return rows


def test_docstring_table_is_the_table():
    rows = _docstring_rows()
    floor = ".".join(map(str, _compat.FLOOR))
    firsts = {".".join(map(str, v)) for v in _compat.CHANGES.values()}
    assert set(rows) == firsts | {floor}
    for change, version in _compat.CHANGES.items():
        assert change in rows[".".join(map(str, version))], change


def test_floor_is_setup_cfgs():
    """The floor here is the floor in install_requires, and this JAX is above it."""
    text = (util.ROOT / "setup.cfg").read_text()
    match = re.search(r"^\s*jax\s*>=\s*([0-9.]+)", text, re.MULTILINE)
    assert match, "no jax>=X in setup.cfg"
    assert _compat.parse_version(match.group(1)) == _compat.FLOOR
    assert _compat.JAX_VERSION >= _compat.FLOOR
    assert _compat.COORDINATOR_ADDRESS_KWARGS[0][0] == _compat.FLOOR
    assert _compat.CACHE_WRITE_PARAMS[0][0] == _compat.FLOOR


def test_cache_write_params_are_this_jaxs():
    """The wrapper of cache_on_every_process hands on what this JAX's own
    _cache_write takes (else it would leave JAX's rule in place: rank 1 caches
    nothing, as with JAX 0.11 before the table knew its change)."""
    from jax._src import compiler

    own = getattr(compiler._cache_write, "jax_original", compiler._cache_write)
    assert tuple(inspect.signature(own).parameters) == _compat.cache_write_params()


def test_since_compares_versions():
    first = _compat.CHANGES["jax.enable_x64"]
    assert _compat.since("jax.enable_x64", first)
    assert _compat.since("jax.enable_x64", (first[0] + 1, 0, 0))
    assert not _compat.since("jax.enable_x64", _compat.FLOOR)


def test_enable_x64():
    import jax.numpy as jnp

    before = jnp.asarray(np.int64(1)).dtype
    with _compat.enable_x64(True):
        assert jnp.asarray(np.int64(1)).dtype == jnp.int64
    with _compat.enable_x64(False):
        assert jnp.asarray(np.int64(1)).dtype == jnp.int32
    assert jnp.asarray(np.int64(1)).dtype == before


def test_unregister_event_duration_listener():
    heard = []

    def listen(event, duration, **kwargs):
        heard.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    _compat.unregister_event_duration_listener(listen)
    jax.monitoring.record_event_duration_secs("/mpi4jax_dist/test", 1.0)
    assert heard == []


def test_runtime_client_takes_the_heartbeat():
    """A client is made (not connected) with the heartbeat of this JAX's kind."""
    runtime = _compat.distributed_runtime()
    client = runtime.get_distributed_runtime_client(
        "127.0.0.1:1",
        0,
        shutdown_on_destruction=False,
        **_compat.runtime_heartbeat(100),
    )
    del client


def test_shard_map_psum():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.local_devices()[:1]), ("x",))
    f = _compat.shard_map(
        lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()
    )
    assert np.asarray(jax.jit(f)(jax.numpy.arange(3.0))).tolist() == [0.0, 1.0, 2.0]


def test_cpu_collectives():
    assert _compat.cpu_collectives() == "gloo"  # JAX's default, at every version


def test_cluster_name():
    assert _compat.cluster_name(_compat.ClusterEnv._cluster_types[0]) == (
        "mpi4jax_dist"
    )

    class Nameless:
        pass

    assert _compat.cluster_name(Nameless) is None


_PREEMPTION = """
import json
from mpi4jax_dist import _compat
before = _compat.preemption_service()
_compat.disable_preemption_service()
print(json.dumps([before, _compat.preemption_service()]))
"""


def test_disable_preemption_service():
    """On by default; off once disabled, with the option or, before it, without.
    (tests/jobs/test_failfast.py shows SIGTERM's handler gone under mpiexec.)"""
    proc = subprocess.run(
        [sys.executable, "-c", _PREEMPTION],
        env=util.clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(proc.stdout.splitlines()[-1]) == [True, False]


_GLOO = """
import json, sys
import jax
from mpi4jax_dist import _compat
published = _compat.publish_gloo_address(sys.argv[1])
again = _compat.publish_gloo_address(sys.argv[1])  # wraps JAX's factory again
jax.distributed.initialize()  # a world of one process: JAX makes Gloo
try:
    jax.devices()
    made = "made"
except Exception as err:
    made = f"{type(err).__name__}: {err}"
print(json.dumps([published, again, _compat.published_gloo_address(), made,
                  _compat.publish_gloo_address("127.0.0.1")]))
"""


@pytest.mark.parametrize(
    "address, made",
    [
        ("127.0.0.1", "made"),
        # Not this host's: Gloo cannot listen there, so the backend fails to be
        # made, which shows that the address reached Gloo (nothing is sent).
        ("192.0.2.1", "Cannot assign requested address"),
    ],
)
def test_publish_gloo_address(address, made):
    """Gloo gets the address once the CPU backend is made; not after."""
    proc = subprocess.run(
        [sys.executable, "-c", _GLOO, address],
        env=util.clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    published, again, seen, outcome, late = json.loads(proc.stdout.splitlines()[-1])
    assert (published, again, seen) == (True, True, address), proc.stderr
    assert made in outcome, outcome
    if made == "made":  # too late once the backend exists
        assert late is False


def test_functions_are_traced_once_around_the_first_calls():
    """A jit traced before the first allreduce, iallreduce and cg is not traced
    again after them, nor are they: the trace context (every jit's cache key) is
    whole once the package is imported (:func:`_compat.complete_trace_context`).
    """
    proc = util.run_mpi("trace_once.py", 2, timeout=120)
    for record in util.result_lines(proc, 2, "rank"):
        assert record["after"] == record["before"], record
        assert set(record["traces"].values()) == {1}, record


def test_an_import_after_tracing_traces_again():
    """What the test above guards against, on the JAX it runs with: where importing
    jax.extend adds to the trace context (the table's row), a jit traced before
    that import traces again on its next call, and not where it adds nothing."""
    code = (
        "import jax\n"
        "traces = []\n"
        "f = jax.jit(lambda v: traces.append(1) or v + 1)\n"
        "f(1.0)\n"
        "import jax.extend\n"
        "f(1.0)\n"
        "print(len(traces))\n"
    )
    proc = util.run_command(
        [sys.executable, "-c", code], env=util.clean_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    again = _compat.since("jax.extend registers trace context")
    assert proc.stdout.split()[-1] == ("2" if again else "1"), proc.stdout


_TOKENS = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from mpi4py import MPI
import mpi4jax_dist
from jax._src import dispatch
from mpi4jax_dist import _compat

step = jax.jit(lambda v: mpi4jax_dist.allreduce(v, MPI.SUM, comm=MPI.COMM_SELF) + 1)
x = step(jnp.zeros(3)).block_until_ready()  # compiles, and applies the setting
own = dispatch.RuntimeTokenSet.get_token_input
handed = []

def recording(self, eff, devices):
    handed.append(own(self, eff, devices))
    return handed[-1]

dispatch.RuntimeTokenSet.get_token_input = recording
held = []
for _ in range(3):
    (eff, token), = dispatch.runtime_tokens.current_tokens.items()
    held.append(token)
    x = step(x)
print(json.dumps({
    "patched": hasattr(own, "jax_original"),
    "same": [a is b for a, b in zip(handed, held)],
    "result": np.asarray(x).tolist(),
}))
"""


@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_runtime_token_is_handed_on_as_it_is(setting):
    """With MPI4JAX_DIST_TOKEN_REUSE=1 (the default) on a JAX it ran on, each call
    of an ordered-effect program gets the token the last call returned, the very
    object, and the same results; with 0, JAX's own method (a new token each
    call, made after waiting for the last program). With the token made inside
    the program (MPI4JAX_DIST_TOKENS_IN_PROGRAM, on by default) no runtime token
    is left to hand on: these programs keep one with it off."""
    env = util.clean_env(
        MPI4JAX_DIST_TOKEN_REUSE=setting, MPI4JAX_DIST_TOKENS_IN_PROGRAM="0"
    )
    proc = util.run_command([sys.executable, "-c", _TOKENS], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["result"] == [4.0, 4.0, 4.0], found
    reused = setting == "1" and jax.__version_info__[:2] in _compat.TOKEN_REUSE_RAN
    assert found["patched"] is reused, found
    assert found["same"] == [reused] * 3, found


MPI4JAX_WARNING = "The latest supported JAX version with this release of mpi4jax"


def test_mpi4jax_s_version_warning_is_printed_once_a_job():
    """mpi4jax warns at its import where JAX is newer than its release names: 12
    lines on every rank (120,000 at 10^4 ranks). Imported after the package, rank
    0 alone prints them; with ``-W default`` (the user chose which warnings to see)
    every rank does, as every rank did before."""
    pytest.importorskip("mpi4jax")
    code = ["-c", "import mpi4jax_dist, mpi4jax"]
    alone = subprocess.run(
        [sys.executable, *code],
        env=util.clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=util.ROOT,
    )
    assert alone.returncode == 0, alone.stderr
    if MPI4JAX_WARNING not in alone.stderr:
        pytest.skip("this mpi4jax does not warn with this JAX")
    job = util.run_mpi(code, 2, timeout=120)
    assert job.stderr.count(MPI4JAX_WARNING) == 1, job.stderr
    asked = util.run_mpi(["-W", "default", *code], 2, timeout=120)
    assert asked.stderr.count(MPI4JAX_WARNING) == 2, asked.stderr
