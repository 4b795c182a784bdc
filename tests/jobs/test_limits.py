"""What grows with the process count (``mpi4jax_dist.launch.limits``): open files, JAX's
timeouts, and what the diagnostics say about a planned job size."""

import json
import subprocess
import sys

import pytest
import util

from mpi4jax_dist import _compat
from mpi4jax_dist.launch import api, limits

pytestmark = [util.skip_in_mpi_job, util.same_under_every_jax]


def test_timeouts_grow_with_the_process_count():
    assert limits.timeouts(2) == limits.JAX_TIMEOUTS  # JAX's own below 100
    assert limits.timeouts(1000) == {
        "initialization_timeout": 310,
        "heartbeat_timeout_seconds": 101,
    }
    assert limits.timeouts(100_000) == {
        "initialization_timeout": 1300,
        "heartbeat_timeout_seconds": 200,
    }


def test_topology_timeouts_grow_with_the_square_of_the_process_count():
    local = "jax_cpu_get_local_topology_timeout_minutes"
    glob = "jax_cpu_get_global_topology_timeout_minutes"
    assert limits.topology_timeouts(1000) == limits.JAX_TOPOLOGY_TIMEOUTS
    assert limits.topology_timeouts(10_000) == limits.JAX_TOPOLOGY_TIMEOUTS
    assert limits.topology_timeouts(100_000) == {local: 72, glob: 165}
    for procs in (2, 5000, 30_000, 100_000, 300_000):
        minutes = limits.topology_timeouts(procs)
        assert minutes[glob] > minutes[local]  # JAX's rule
        model = limits.topology_exchange_s(procs)
        assert 60 * minutes[glob] >= limits.TOPOLOGY_SAFETY * model["whole"]


_RAISE_CONFIG = """
import jax
from mpi4jax_dist import _compat
from mpi4jax_dist.launch import limits
local = "jax_cpu_get_local_topology_timeout_minutes"
glob = "jax_cpu_get_global_topology_timeout_minutes"
if not hasattr(jax.config, local):
    print("absent", _compat.raise_config_defaults(
        limits.topology_timeouts(100_000), limits.JAX_TOPOLOGY_TIMEOUTS))
    raise SystemExit
jax.config.update(glob, 7)  # the user's own
applied = _compat.raise_config_defaults(
    limits.topology_timeouts(100_000), limits.JAX_TOPOLOGY_TIMEOUTS)
print(sorted(applied.items()), getattr(jax.config, local), getattr(jax.config, glob))
"""


def test_topology_timeouts_are_raised_only_where_the_user_set_none():
    """In a fresh interpreter: JAX's default is raised, the user's 7 min is kept
    (a JAX without the options gets nothing)."""
    proc = util.run_command(
        [sys.executable, "-c", _RAISE_CONFIG], env=util.clean_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    if proc.stdout.startswith("absent"):
        assert proc.stdout.split() == ["absent", "{}"]
    else:
        assert proc.stdout.split("]")[1].split() == ["72", "7"], proc.stdout
        assert "('jax_cpu_get_local_topology_timeout_minutes', 72)" in proc.stdout


def test_initialize_fills_in_only_what_the_caller_left_out():
    arguments = api.jax_arguments(100_000, {"initialization_timeout": 5})
    assert arguments["initialization_timeout"] == 5  # the caller's
    if _compat.since("heartbeat_timeout_seconds"):
        assert arguments["heartbeat_timeout_seconds"] == 200
    else:  # not an argument of this JAX's initialize: not passed
        assert "heartbeat_timeout_seconds" not in arguments
    assert arguments["cluster_detection_method"] == "mpi4jax_dist"


def _limit_script(soft, hard, procs):
    return (
        "import resource\n"
        "from mpi4jax_dist.launch import limits\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "try:\n"
        f"    print('RAISED', limits.ensure_file_limit({procs}))\n"
        "except RuntimeError as err:\n"
        "    print('ERROR', err)\n"
        "print('NOW', resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )


@pytest.mark.parametrize(
    "soft, hard, procs, expected",
    [
        (100, 2000, 300, ["RAISED (100, 2000)", "NOW (2000, 2000)"]),
        (1000, 2000, 300, ["RAISED None", "NOW (1000, 2000)"]),
        (100, 400, 300, ["ERROR rank 0 needs 556 open files", "NOW (100, 400)"]),
    ],
)
def test_soft_limit_raised_hard_limit_reported(soft, hard, procs, expected):
    proc = subprocess.run(
        [sys.executable, "-c", _limit_script(soft, hard, procs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout + proc.stderr
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start), proc.stdout


def test_diagnostics_judge_a_planned_job_size():
    proc = util.run_mpi(
        ["-m", "mpi4jax_dist"],
        2,
        "--json",
        "--procs",
        "100000",
        check=False,
        nofile=(1024, 4096),
    )
    assert proc.returncode == 1  # initialize would fail: a problem
    report = json.loads(
        proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1]
    )
    scale = report["scale"]
    assert scale["open_files"] == {"soft": 1024, "hard": 4096, "needed": 100256}
    assert scale["timeouts"]["mpi4jax_dist.initialize"] == limits.timeouts(100_000)
    # 88 B from each process to process 0, 90 B per pair of processes back.
    assert scale["topology_exchange_bytes"] == 88 * 10**5 + 90 * 10**10
    assert scale["topology_timeouts_minutes"]["mpi4jax_dist.initialize"] == (
        limits.topology_timeouts(100_000)
    )
    assert any(
        "hard open-file limit, 4096, is below the 100256" in p
        for p in report["problems"]
    ), report["problems"]
    assert any("topology exchange relays about 900 GB" in w for w in scale["warnings"])
    assert any(
        "jax_cpu_get_global_topology_timeout_minutes=165" in w
        for w in scale["warnings"]
    ), scale["warnings"]
    gpu = [w for w in scale["warnings"] if "JAX's CUDA plugin" in w]
    assert len(gpu) == 1 and "may take about 87 min" in gpu[0], scale["warnings"]
    assert "set JAX_PLATFORMS=cuda" in gpu[0]
    assert scale["gpu_topology_exchange"]["xla_timeouts_minutes"] == {
        "local": 2,
        "global": 5,
    }


def test_the_gpu_exchange_warning_starts_where_the_model_exceeds_xla_5_minutes():
    """The CUDA plugin's exchange at one GPU per process: within XLA's fixed 5 min
    at 10^4 processes by the model, beyond it at 3 x 10^4."""
    model = limits.topology_exchange_s
    gpu_bytes = limits.gpu_local_topology_bytes(1)
    assert model(10_000, gpu_bytes)["whole"] < 300 < model(30_000, gpu_bytes)["whole"]
    quiet = limits.report(10_000)["warnings"]
    assert not any("CUDA plugin" in w for w in quiet), quiet
    loud = limits.report(30_000)["warnings"]
    assert any("CUDA plugin" in w for w in loud), loud
