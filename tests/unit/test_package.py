"""Serial: registration, import side effects, configuration, device rules, JAX shims."""

import inspect
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import util

import mpi4jax_dist
from mpi4jax_dist import _compat, _config
from mpi4jax_dist.launch import cluster, devices

# One process each (compiling, or a fresh interpreter): the serial session's.
pytestmark = util.serial_only


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (no launcher variables), with a timeout."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=util.clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_registered_first_under_own_name():
    registry = _compat.ClusterEnv._cluster_types
    assert registry[0] is cluster.Mpi4jaxDistCluster
    assert registry.count(cluster.Mpi4jaxDistCluster) == 1
    assert cluster.Mpi4jaxDistCluster.name == "mpi4jax_dist"
    assert not cluster.Mpi4jaxDistCluster.opt_in_only_method
    # JAX's own opt-in env keeps its name; ours must not shadow it.
    mpi4py_envs = [c for c in registry if _compat.cluster_name(c) == "mpi4py"]
    assert mpi4py_envs != [cluster.Mpi4jaxDistCluster]


def test_import_touches_neither_mpi_nor_backend():
    code = """
import json, sys
import mpi4jax_dist
from jax._src import xla_bridge
from jax._src.clusters import ClusterEnv
print(json.dumps({
    "mpi_imported": "mpi4py.MPI" in sys.modules,
    "mpi4jax_imported": "mpi4jax" in sys.modules,
    "backend": xla_bridge.backends_are_initialized(),
    "first": ClusterEnv._cluster_types[0].name,
    "present": ClusterEnv._cluster_types[0].is_env_present(),
    "mpi_after_present": "mpi4py.MPI" in sys.modules,
}))
"""
    result = json.loads(run_python(code).stdout.splitlines()[-1])
    assert result == {
        "mpi_imported": False,
        "mpi4jax_imported": False,
        "backend": False,
        "first": "mpi4jax_dist",
        "present": False,
        "mpi_after_present": False,
    }


def test_without_mpi4jax_what_needs_it_names_the_extra():
    # mpi4jax hidden, as if not installed (tests/packaging/test_packaging.py installs
    # without it): allreduce and cg's mpi4jax backend refuse before any MPI call,
    # naming the extra; the psum backend and the diagnostics' check run.
    code = """
import json, sys
sys.modules["mpi4jax"] = None
import mpi4jax_dist
from mpi4jax_dist import cg
from mpi4jax_dist.diagnostics.check import diagnose

errors = {}
for name, call in [
    ("allreduce", lambda: mpi4jax_dist.allreduce(1.0)),
    ("cg", lambda: cg.make_solver(lambda v: v)),
]:
    try:
        call()
    except ImportError as err:
        errors[name] = [type(err).__name__, err.name, str(err)]
mpi_imported = "mpi4py.MPI" in sys.modules
check = diagnose(True)["check"]  # initializes JAX: first
cg.make_solver(lambda v: v, backend="psum")
print(json.dumps({"errors": errors, "mpi_imported": mpi_imported, "check": check}))
"""
    result = json.loads(run_python(code).stdout.splitlines()[-1])
    fix = (
        'needs mpi4jax: pip install "mpi4jax_dist[mpi4jax]" (mpi4jax compiles '
        "against your MPI: put its mpicc first on PATH)"
    )
    assert result["errors"] == {
        "allreduce": [
            "ModuleNotFoundError",
            "mpi4jax",
            f"mpi4jax_dist.allreduce {fix}",
        ],
        "cg": [
            "ModuleNotFoundError",
            "mpi4jax",
            f'mpi4jax_dist.cg\'s backend="mpi4jax" {fix}. backend="psum" runs '
            "without it.",
        ],
    }
    assert result["mpi_imported"] is False
    check = result["check"]
    assert check["psum_correct"] is True
    assert check["allreduce_equals_psum"] is None
    assert check["mpi4jax"] == f"skipped: the comparison with mpi4jax.allreduce {fix}"


def test_present_under_faked_launcher_and_disable_switch():
    code = """
import mpi4jax_dist, sys
from mpi4jax_dist.launch.cluster import Mpi4jaxDistCluster as C
print(C.is_env_present(), "mpi4py.MPI" in sys.modules)
"""
    launch = {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0"}
    assert run_python(code, **launch).stdout.split() == ["True", "False"]
    assert run_python(code, MPI4JAX_DIST_DISABLE="1", **launch).stdout.split() == [
        "False",
        "False",
    ]
    # A malformed switch warns, names the variable, and keeps the default (on).
    proc = run_python(code, MPI4JAX_DIST_DISABLE="maybe", **launch)
    assert proc.stdout.split() == ["True", "False"]


def test_present_once_mpi_initialized_in_process():
    code = """
import mpi4jax_dist
from mpi4jax_dist.launch.cluster import Mpi4jaxDistCluster as C
before = C.is_env_present()
from mpi4py import MPI
print(before, C.is_env_present())
"""
    assert run_python(code).stdout.split() == ["False", "True"]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("", False),
    ],
)
def test_bool_values(value, expected):
    assert _config.get_bool("X_FLAG", not expected, {"X_FLAG": value}) is expected


def test_bool_malformed_warns_naming_variable():
    with pytest.warns(RuntimeWarning, match="MPI4JAX_DIST_DISABLE='maybe'"):
        assert _config.disabled({"MPI4JAX_DIST_DISABLE": "maybe"}) is False


@pytest.mark.parametrize("value", ["http", "0", "70000", "12.5", "-1"])
def test_bad_port_names_variable(value):
    with pytest.raises(ValueError, match=f"JAX_COORDINATOR_PORT='{value}'"):
        _config.coordinator_port(env={"JAX_COORDINATOR_PORT": value})


def test_port_precedence():
    env = {"JAX_COORDINATOR_PORT": "1234"}
    assert _config.coordinator_port(None, env) == 1234
    assert _config.coordinator_port("4321", env) == 4321
    assert _config.coordinator_port(None, {}) is None


@pytest.mark.parametrize("value", ["10.0.0.1", "host:", ":123", "host:port"])
def test_bad_coordinator_address_names_variable(value):
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS"):
        _config.coordinator_address({"JAX_COORDINATOR_ADDRESS": value})


@pytest.mark.parametrize(
    "value, host, port",
    [
        ("10.0.0.1:1234", "10.0.0.1", 1234),
        ("[fd00::1]:99", "fd00::1", 99),
        ("node-7.cluster:65535", "node-7.cluster", 65535),
    ],
)
def test_good_coordinator_address(value, host, port):
    assert _config.split_host_port(value, "X") == (host, port)


NO_GPU_DIR = "/nonexistent-nvidia-dir"

# (environment, local_rank, local_size, expected local_device_ids)
DEVICE_RULES = [
    ({}, 0, 4, None),  # no accelerator: CPU
    ({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0,1"}, 1, 2, None),
    ({"CUDA_VISIBLE_DEVICES": ""}, 0, 2, None),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, 0, 2, None),
    ({"CUDA_VISIBLE_DEVICES": "3"}, 2, 4, [0]),  # a wrapper gave each rank one GPU
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2, 4, [2]),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 1, 2, [2, 3]),  # a block each
    ({"ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 3, 8, [3]),
    ({"HIP_VISIBLE_DEVICES": "GPU-a,GPU-b"}, 0, 2, [0]),
    ({"JAX_LOCAL_DEVICE_IDS": "5"}, 0, 2, [5]),  # explicit wins
    ({"JAX_LOCAL_DEVICE_IDS": "1,3", "CUDA_VISIBLE_DEVICES": "0"}, 0, 2, [1, 3]),
    # Intel GPUs: ZE_AFFINITY_MASK as Aurora's wrappers set it, one tile a rank
    ({"ZE_AFFINITY_MASK": "7"}, 7, 12, [0]),  # FLAT (the default): tile 7
    ({"ZE_AFFINITY_MASK": "3.1", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}, 7, 12, [0]),
    ({"ZE_AFFINITY_MASK": "3"}, 3, 6, [0]),  # a whole GPU
    ({"ZE_AFFINITY_MASK": ""}, 0, 2, None),  # empty: Level Zero shows all: none named
    # every rank sees the node's 12 tiles (FLAT) or 6 GPUs (COMPOSITE)
    ({"ZE_AFFINITY_MASK": ",".join(map(str, range(12)))}, 5, 12, [5]),
    (
        {"ZE_AFFINITY_MASK": "0.0,0.1,1.0,1.1", "ZE_FLAT_DEVICE_HIERARCHY": "FLAT"},
        1,
        2,
        [2, 3],
    ),
    (
        {
            "ZE_AFFINITY_MASK": "0.0,0.1,1.0,1.1",
            "ZE_FLAT_DEVICE_HIERARCHY": "composite",
        },
        1,
        2,
        [1],  # two tiles of one GPU are that GPU: two devices
    ),
    ({"ZE_AFFINITY_MASK": "0,1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 1, 2, [2, 3]),
    ({"ZE_AFFINITY_MASK": "0.1", "JAX_PLATFORMS": "cpu"}, 0, 1, None),
    ({"ZE_AFFINITY_MASK": "0.1", "JAX_LOCAL_DEVICE_IDS": "4"}, 0, 1, [4]),
]


@pytest.mark.parametrize("env, local_rank, local_size, expected", DEVICE_RULES)
def test_local_device_ids_rules(env, local_rank, local_size, expected):
    assert devices.local_device_ids(local_rank, local_size, env, NO_GPU_DIR) == expected


def test_local_device_ids_uneven_warns():
    with pytest.warns(RuntimeWarning, match="JAX_LOCAL_DEVICE_IDS"):
        ids = devices.local_device_ids(
            0, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, NO_GPU_DIR
        )
    assert ids is None


def test_local_device_ids_count_driver_gpus(tmp_path):
    for i in range(4):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert devices.local_device_ids(3, 4, {}, str(tmp_path)) == [3]


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"ZE_AFFINITY_MASK": "gpu0"},
            "ZE_AFFINITY_MASK='gpu0': 'gpu0' is not a device",
        ),
        ({"ZE_AFFINITY_MASK": "0.0,,1"}, "ZE_AFFINITY_MASK='0.0,,1': '' is not"),
        ({"ZE_AFFINITY_MASK": "0.1.2"}, "'0.1.2' is not a device"),
        (
            {"ZE_AFFINITY_MASK": "0", "ZE_FLAT_DEVICE_HIERARCHY": "TILES"},
            "ZE_FLAT_DEVICE_HIERARCHY='TILES' is not FLAT",
        ),
    ],
)
def test_bad_level_zero_values_name_the_variable(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        devices.local_device_ids(0, 1, env, NO_GPU_DIR)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, (None, 0, None)),
        ({"CUDA_VISIBLE_DEVICES": "2"}, ("CUDA_VISIBLE_DEVICES", 1, [0])),
        ({"ZE_AFFINITY_MASK": "3.1"}, ("ZE_AFFINITY_MASK=3.1 (FLAT)", 1, [0])),
        (
            {"ZE_AFFINITY_MASK": " 0.0,0.1 ", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"},
            ("ZE_AFFINITY_MASK=0.0,0.1 (COMPOSITE)", 1, [0]),
        ),
        (
            {"JAX_LOCAL_DEVICE_IDS": "1", "ZE_AFFINITY_MASK": "0,1"},
            ("JAX_LOCAL_DEVICE_IDS=1", 2, [1]),
        ),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, ("CUDA_VISIBLE_DEVICES", 3, None)),
    ],
)
def test_describe_says_what_decided(env, expected):
    """What --check prints per rank: the setting that decided, how many devices it
    leaves, the ids JAX gets (the uneven case's warning is the bootstrap's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = devices.describe(1, 2, env, NO_GPU_DIR)
    assert (d["source"], d["visible"], d["local_device_ids"]) == expected


def test_bad_local_device_ids_names_variable():
    with pytest.raises(ValueError, match="JAX_LOCAL_DEVICE_IDS='a,b'"):
        devices.local_device_ids(0, 1, {"JAX_LOCAL_DEVICE_IDS": "a,b"}, NO_GPU_DIR)


@pytest.mark.parametrize(
    "text, version",
    [
        ("0.6.0", (0, 6, 0)),
        ("0.8.1", (0, 8, 1)),
        ("0.10.2", (0, 10, 2)),
        ("0.8.1.dev20251201", (0, 8, 1)),
        ("0.7", (0, 7, 0)),
        ("1.0.0rc1", (1, 0, 0)),
    ],
)
def test_parse_version(text, version):
    assert _compat.parse_version(text) == version


# (jax version, keyword arguments it passes to get_coordinator_address)
COORDINATOR_CALLS = [
    ((0, 6, 0), ("timeout_secs",)),
    ((0, 8, 0), ("timeout_secs",)),
    ((0, 8, 1), ("timeout_secs", "override_coordinator_port")),
    ((0, 10, 2), ("timeout_secs", "override_coordinator_port")),
]


@pytest.mark.parametrize("version, kwargs", COORDINATOR_CALLS)
def test_coordinator_call_of_each_version(version, kwargs):
    assert _compat.coordinator_address_kwargs(version) == kwargs
    # Our env accepts each version's call (calling it for real would bootstrap and
    # wait for a coordination service that this test does not start).
    method = cluster.Mpi4jaxDistCluster.get_coordinator_address
    inspect.signature(method).bind(**{k: None for k in kwargs})


def test_installed_jax_matches_a_row():
    assert _compat.JAX_VERSION >= _compat.COORDINATOR_ADDRESS_KWARGS[0][0]
    assert _compat.initialize_accepts("cluster_detection_method")


def test_public_api():
    assert sorted(mpi4jax_dist.__all__) == [
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


@pytest.mark.parametrize("name", ["http_proxy", "HTTPS_PROXY", "grpc_proxy"])
def test_proxy_exemption(monkeypatch, name):
    for var in (
        "http_proxy",
        "https_proxy",
        "grpc_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "GRPC_PROXY",
        "no_grpc_proxy",
        "NO_GRPC_PROXY",
        "MPI4JAX_DIST_PROXY",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert _config.exempt_from_proxy("10.0.0.1") is None  # no proxy: nothing to do
    assert _config.caught_by_proxy("10.0.0.1") == []
    monkeypatch.setenv(name, "http://proxy.example:3128")
    assert _config.caught_by_proxy("10.0.0.1") == [name]
    # The user's no_proxy, which gRPC reads when no_grpc_proxy is unset, carries over.
    monkeypatch.setenv("no_proxy", "localhost")
    assert _config.exempt_from_proxy("10.0.0.1") == [name]
    assert os.environ["no_grpc_proxy"] == "localhost,10.0.0.1"
    assert os.environ[name] == "http://proxy.example:3128"  # the user's, untouched
    assert _config.exempt_from_proxy("10.0.0.1") is None  # already exempt
    assert _config.caught_by_proxy("10.0.0.1") == []
    monkeypatch.setenv("MPI4JAX_DIST_PROXY", "keep")
    assert _config.exempt_from_proxy("10.0.0.2") is None
    assert _config.caught_by_proxy("10.0.0.2") == [name]  # kept: JAX's warning too
    assert os.environ["no_grpc_proxy"] == "localhost,10.0.0.1"
