"""The package on a real Slurm cluster, as its users run it: several nodes, each its
own network namespace, host name and /etc/hosts (Debian's: the node's own name on
127.0.1.1), on a private bridge, with one slurmd each (tools/cluster.sh).

Every launch case asserts one JAX world whose process index is the MPI rank, the
node-local ranks Slurm gave, a coordinator on the bridge (never loopback), Gloo on
each node's own bridge address, and a cross-node psum, global sum and
``process_allgather`` that are right; with ``--bytes``, that an MPI allreduce and a
JAX psum really crossed the bridge (each node's ``eth0`` counters), not shared
memory. Then JAX alone where it fails, the diagnostics, and the faults a real
cluster has.

tools/test.sh's cluster stage brings the cluster up (``bash tools/cluster.sh up
3``), runs this file with ``SLURM_CONF`` pointing at it, and takes it down. Where
no such cluster is up, every test here skips.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import util

CLUSTER_SH = util.ROOT / "tools" / "cluster.sh"
CONF = os.environ.get("SLURM_CONF", "")
STATE = Path(CONF).parent if CONF else None
PROGRAM = "tests/scripts/cluster_job.py"
VENV = Path(sys.executable).parent.parent
VENV_OMPI = Path(os.environ.get("VENV_OMPI", util.ROOT / ".venv-ompi"))
TIMEOUT = 240  # seconds for one job: a few seconds of JAX start-up per rank
BYTES = 4 << 20  # the allreduce and psum whose traffic is counted
# PyPI's MPICH (ch4:ucx) moves data between the namespaces through shared memory,
# as it would between processes of one node: its TCP netmod puts it on the network,
# as between real nodes. Open MPI takes TCP between nodes by itself.
MPICH_OVER_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def _written_by_cluster_sh() -> bool:
    try:
        return Path(CONF).read_text().startswith("# Written by tools/cluster.sh")
    except OSError:
        return False


pytestmark = [
    util.skip_in_mpi_job,
    pytest.mark.skipif(
        not _written_by_cluster_sh(),
        reason="needs the Slurm test cluster: bash tools/cluster.sh up, then "
        'eval "$(bash tools/cluster.sh env)" (tools/test.sh does both)',
    ),
]


def _node_addresses() -> dict[str, str]:
    """``{"node1": "10.77.0.11", ...}`` from slurm.conf's NodeAddr."""
    text = Path(CONF).read_text()
    return dict(re.findall(r"^NodeName=(\S+) NodeAddr=(\S+)", text, re.M))


def _bridge() -> ipaddress.IPv4Network:
    (controller,) = re.findall(
        r"^SlurmctldHost=\S+\((\S+)\)", Path(CONF).read_text(), re.M
    )
    return ipaddress.ip_network(f"{controller}/24", strict=False)


def _env(mpi: str = "mpich", **extra) -> dict:
    """The environment a user's shell has: the venv of ``mpi`` first on PATH, and
    Slurm's configuration (util.clean_env drops every SLURM_ variable)."""
    venv = VENV if mpi == "mpich" else VENV_OMPI
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no {venv}: bash tools/setup.sh --with-openmpi")
    env = util.clean_env(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_CONF=CONF
    )
    if mpi == "mpich":
        env.update(MPICH_OVER_TCP)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _srun(*args, env: dict, timeout: float = TIMEOUT):
    return util.run_command(
        ["srun", "--time=5", *map(str, args)], env=env, timeout=timeout
    )


def _sbatch(
    tmp_path, script: str, *options, args=(), env: dict, timeout: float = TIMEOUT
):
    """Submit ``script`` (a path, or the text of a batch script) with ``sbatch
    options script args``; return ``(state, exit code, stdout file's text, stderr
    file's text)`` once the job has ended."""
    if "\n" in script:
        path = tmp_path / "job.sh"
        path.write_text(script)
        script = str(path)
    out, err = tmp_path / "job.out", tmp_path / "job.err"
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--time=5",
            f"--output={out}",
            f"--error={err}",
            *map(str, options),
            script,
            *map(str, args),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=util.ROOT,
        check=False,
    )
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    # Polled: sbatch --wait returns tens of seconds after the job ends.
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
        state = re.search(r"JobState=(\S+)", shown)
        if state and state.group(1) not in (
            "PENDING",
            "RUNNING",
            "CONFIGURING",
            "COMPLETING",
        ):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env, timeout=60, check=False)
            pytest.fail(
                f"job {job_id} did not end in {timeout} s:\n{_read(out)}{_read(err)}"
            )
        time.sleep(0.5)
    code = re.search(r"ExitCode=(\d+):", shown).group(1)
    return state.group(1), int(code), _read(out), _read(err)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _results(stdout: str) -> list[dict]:
    return sorted(
        (json.loads(t) for t in util.result_texts(stdout)), key=lambda r: r["rank"]
    )


def _check_world(results, nodes: int, per_node: int, collectives: str = "gloo"):
    """Assert one right JAX world over ``nodes`` x ``per_node`` ranks, placed in
    blocks; with counted traffic, that it crossed the bridge."""
    n = nodes * per_node
    addresses = _node_addresses()
    assert [r["rank"] for r in results] == list(range(n)), results
    coordinators = {r["coordinator"] for r in results}
    assert len(coordinators) == 1, coordinators
    host = ipaddress.ip_address(coordinators.pop().rpartition(":")[0])
    assert host in _bridge() and not host.is_loopback, host
    # The nodes in rank order, whichever of the cluster's Slurm gave the job.
    order = list(dict.fromkeys(r["host"] for r in results))
    assert len(order) == nodes and set(order) <= set(addresses), order
    assert str(host) == addresses[order[0]]  # rank 0's node
    for r in results:
        node, local = divmod(r["rank"], per_node)
        name = order[node]
        assert r["host"] == name, r
        assert (r["process_index"], r["process_count"], r["size"]) == (
            r["rank"],
            n,
            n,
        ), r
        assert (r["node_index"], r["num_nodes"], r["local_rank"]) == (
            node,
            nodes,
            local,
        ), r
        assert r["allgather"] == list(range(n)), r
        assert r["psum"] == [n * (n + 1) / 2] and r["global_sum"] == n * (n + 1) / 2, r
        assert r["cpu_collectives"] == collectives, r
        if collectives == "gloo":
            assert r["gloo_address"] == addresses[name], r
    if "sent_by_mpi" in results[0]:
        _check_traffic(results, "sent_by_mpi")
        _check_traffic(results, "sent_by_psum")


def _check_traffic(results, key: str):
    """Each node sent at least half the message on its network during the step."""
    for r in results:
        assert r[key] >= BYTES // 2, f"{r['host']} sent {r[key]} B for {key}: {r}"


# --- launchers x MPIs x collectives -------------------------------------------------

RUN = f"python {PROGRAM} --bytes {BYTES}"
HYDRA = f"mpiexec -n $SLURM_NTASKS -ppn $SLURM_NTASKS_PER_NODE {RUN}"
PRRTE = f"mpirun -n $SLURM_NTASKS --map-by ppr:$SLURM_NTASKS_PER_NODE:node {RUN}"

# id, how, MPI, extra environment; each on 2 nodes of 2 ranks and 3 nodes of 1.
LAUNCHERS = [
    ("srun-pmi2-mpich", "srun --mpi=pmi2", "mpich", {}),
    ("srun-pmix-openmpi", "srun --mpi=pmix", "openmpi", {}),
    ("sbatch-mpirun-openmpi", "sbatch", "openmpi", {}),
    ("sbatch-mpiexec-mpich", "sbatch", "mpich", {}),
    ("salloc-mpiexec-mpich", "salloc", "mpich", {}),
]
SHAPES = [(2, 2), (3, 1)]
# JAX's CPU collectives over MPI (this package's wrapper of each MPI), 2 x 2.
OVER_MPI = {"MPI4JAX_DIST_CPU_COLLECTIVES": "mpi"}
LAUNCHES = [(*launcher, *shape) for launcher in LAUNCHERS for shape in SHAPES] + [
    ("srun-pmi2-mpich-mpi-collectives", "srun --mpi=pmi2", "mpich", OVER_MPI, 2, 2),
    ("srun-pmix-openmpi-mpi-collectives", "srun --mpi=pmix", "openmpi", OVER_MPI, 2, 2),
]


@pytest.mark.parametrize(
    "how, mpi, extra, nodes, per_node",
    [pytest.param(*case[1:], id=f"{case[0]}-{case[4]}x{case[5]}") for case in LAUNCHES],
)
def test_one_world(tmp_path, how, mpi, extra, nodes, per_node):
    env = _env(mpi, **extra)
    shape = (f"--nodes={nodes}", f"--ntasks-per-node={per_node}")
    if how.startswith("srun"):
        proc = _srun(*shape, how.split()[1], *RUN.split(), env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        stdout = proc.stdout
    elif how == "sbatch":
        launch = HYDRA if mpi == "mpich" else PRRTE
        state, code, stdout, stderr = _sbatch(
            tmp_path, f"#!/bin/bash\n{launch}\n", *shape, env=env
        )
        assert (state, code) == ("COMPLETED", 0), stdout + stderr
    else:  # mpiexec on the login host, in an allocation: Hydra starts srun
        launch = HYDRA.replace("$SLURM_NTASKS_PER_NODE", str(per_node)).replace(
            "$SLURM_NTASKS", str(nodes * per_node)
        )
        proc = util.run_command(
            ["salloc", "--time=5", *shape, *launch.split()], env=env, timeout=TIMEOUT
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        stdout = proc.stdout
    results = _results(stdout)
    _check_world(
        results, nodes, per_node, extra.get("MPI4JAX_DIST_CPU_COLLECTIVES", "gloo")
    )
    launcher = {"srun --mpi=pmi2": "slurm-pmi", "srun --mpi=pmix": "slurm-pmix"}.get(
        how, "mpich-hydra" if mpi == "mpich" else "openmpi"
    )
    assert {r["launcher"] for r in results} == {launcher}


def test_traffic_check_catches_shared_memory(tmp_path):
    """The traffic check can fail: PyPI's MPICH left to itself moves the
    allreduce between the namespaces through shared memory."""
    env = _env("mpich")
    for name in MPICH_OVER_TCP:
        env.pop(name)
    proc = _srun(
        "--nodes=2",
        "--ntasks-per-node=1",
        "--mpi=pmi2",
        "python",
        PROGRAM,
        "--mpi-only",
        "--bytes",
        BYTES,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with pytest.raises(AssertionError, match="sent"):
        _check_traffic(_results(proc.stdout), "sent_by_mpi")


def test_job_script_as_users_submit_it(tmp_path):
    """examples/slurm.sh, unchanged, with Open MPI (its default srun --mpi=pmix):
    the site's placeholders and a node size that fits here on sbatch's command
    line, the program as its argument. Its diagnostics run first."""
    state, code, stdout, stderr = _sbatch(
        tmp_path,
        str(util.ROOT / "examples" / "slurm.sh"),
        "--account=test",
        "--partition=debug",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        args=("python", "tests/scripts/job_program.py"),
        env=_env("openmpi"),
    )
    assert (state, code) == ("COMPLETED", 0), stdout + stderr
    assert stdout.startswith("2 nodes, 2 tasks per node, 4 tasks"), stdout
    first = stdout.index("RESULT ")
    for line in (
        "launcher      slurm-pmix",
        "check         psum correct: True",
        "mpi4jax.allreduce == psum: True",
    ):
        assert (
            0 <= stdout.find(line) < first
        ), f"{line!r} not before the program:\n{stdout}"
    results = _results(stdout)
    assert [
        (
            r["rank"],
            r["process_index"],
            r["node_index"],
            r["local_rank"],
            r["cuda_visible_devices"],
        )
        for r in results
    ] == [(0, 0, 0, 0, "0"), (1, 1, 0, 1, "1"), (2, 2, 1, 0, "0"), (3, 3, 1, 1, "1")]


# --- JAX alone, where it fails --------------------------------------------------------


def test_jax_alone_under_mpiexec_in_sbatch_is_not_one_world(tmp_path):
    """The same batch script as sbatch-mpiexec-mpich above, without ``import
    mpi4jax_dist``: JAX's Slurm detection reads the Hydra proxies' SLURM_PROCID
    (0, 0, 1, 1) and SLURM_NTASKS (2), and by a race either aborts (two processes
    register as one task) or makes two worlds of two."""
    launch = HYDRA.replace(RUN, f"python {PROGRAM} --alone")
    state, code, stdout, stderr = _sbatch(
        tmp_path,
        f"#!/bin/bash\n{launch}\n",
        "--nodes=2",
        "--ntasks-per-node=2",
        env=_env(),
    )
    results = _results(stdout)
    one_world = (state, code) == ("COMPLETED", 0) and [
        (r.get("process_index"), r.get("process_count")) for r in results
    ] == [(rank, 4) for rank in range(4)]
    assert not one_world, stdout + stderr
    # Two processes register as one task (0 or 1): JAX's service refuses the
    # second's incarnation, and the job aborts.
    crashed = (state, code) != ("COMPLETED", 0) and "incarnation" in stderr + stdout
    two_worlds = any(r.get("process_count") == 2 for r in results)
    assert crashed or two_worlds, stdout + stderr
    print(
        "crashed" if crashed else "two worlds",
        [r.get("process_index") for r in results],
    )


def test_jax_alone_gloo_fails_across_debian_style_nodes():
    """Under srun, JAX's own Slurm detection makes the right world, but its Gloo
    publishes what each node's name resolves to, 127.0.1.1: the first collective
    across nodes fails (the ranks that wait on the others only after Gloo's
    connection timeout, so the job is stopped once one rank reports)."""
    env = _env()
    cmd = [
        "srun",
        "--time=5",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--mpi=pmi2",
        "python",
        PROGRAM,
        "--alone",
        "--allgather",
    ]
    with _running(cmd, env) as proc:
        line = _wait_for_line(proc, "RESULT ", 120)
    result = json.loads(line.split("RESULT ", 1)[1])
    assert result["process_count"] == 2, result
    assert "Gloo" in result["error"] and "127.0.1.1" in result["error"], result


# --- diagnostics -------------------------------------------------------------------


def _check_report(report, nodes: int, per_node: int, launcher: str):
    assert report["problems"] == [], report["problems"]
    assert report["launcher"] == launcher
    assert report["topology"]["ranks_per_node"] == {
        str(k): list(range(k * per_node, (k + 1) * per_node)) for k in range(nodes)
    }
    assert report["check"]["psum_correct"] is True
    assert report["check"]["gloo_address"] == _node_addresses()["node1"]
    host = report["topology"]["coordinator_address"].rpartition(":")[0]
    assert ipaddress.ip_address(host) in _bridge()


def test_diagnostics_under_srun():
    proc = _srun(
        "--nodes=3",
        "--ntasks-per-node=1",
        "--mpi=pmi2",
        "python",
        "-m",
        "mpi4jax_dist",
        "--check",
        "--json",
        env=_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_report(json.loads(proc.stdout), 3, 1, "slurm-pmi")  # all of stdout
    assert "[Gloo]" in proc.stderr  # jaxlib's own lines, kept out of the JSON


def test_diagnostics_under_mpiexec_in_sbatch(tmp_path):
    launch = HYDRA.replace(RUN, "python -m mpi4jax_dist --check --json")
    state, code, stdout, stderr = _sbatch(
        tmp_path,
        f"#!/bin/bash\n{launch}\n",
        "--nodes=2",
        "--ntasks-per-node=2",
        env=_env(),
    )
    assert (state, code) == ("COMPLETED", 0), stdout + stderr
    _check_report(json.loads(stdout), 2, 2, "mpich-hydra")


# --- faults a real cluster has -------------------------------------------------------


@contextlib.contextmanager
def _running(cmd, env):
    """Start ``cmd``; on leaving, stop it and the job step it made."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=util.ROOT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        subprocess.run(
            ["scancel", "--quiet", "--signal=KILL", f"--user={os.getuid()}"],
            env=env,
            timeout=60,
            check=False,
        )
        _wait_idle()


def _wait_for_line(proc, marker: str, timeout: float) -> str:
    """Return the first line of ``proc``'s output that contains ``marker``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return line
    pytest.fail(f"no {marker!r} in {timeout} s:\n{''.join(seen)}")


def _wait_idle(timeout: float = 90):
    """Wait until every node is idle again; a node that was cut off is resumed
    (Slurm would take it back only at its next ping of the node)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split("\n")
        states = dict(row.split() for row in rows if row.strip())
        if states and all(s == "idle" for s in states.values()):
            return
        for node, state in states.items():
            if state.startswith("down"):
                subprocess.run(
                    ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                    env=_env(),
                    timeout=60,
                    check=False,
                )
        time.sleep(1)
    pytest.fail(f"nodes not idle after {timeout} s: {states}")


def _on_node(node: str, *cmd):
    subprocess.run(["bash", str(CLUSTER_SH), "on", node, *cmd], check=True, timeout=60)


@contextlib.contextmanager
def _firewall(node: str, hook: str, rule: str):
    """One nftables rule in ``node``'s network namespace, for the test's length."""
    _on_node(node, "nft", "add", "table", "inet", "m4jd_fault")
    try:
        _on_node(
            node,
            "nft",
            "add",
            "chain",
            "inet",
            "m4jd_fault",
            "c",
            f"{{ type filter hook {hook} priority 0 ; }}",
        )
        _on_node(node, "nft", "add", "rule", "inet", "m4jd_fault", "c", *rule.split())
        yield
    finally:
        _on_node(node, "nft", "delete", "table", "inet", "m4jd_fault")


COORDINATOR_PORT = 29411  # fixed, so that a firewall rule can name it


def _srun_behind(node: str, hook: str, rule: str, *args, env: dict):
    """``srun args`` while ``rule`` holds on ``node`` (:func:`_firewall`); return
    the CompletedProcess and the seconds it took."""
    with _firewall(node, hook, rule):
        start = time.monotonic()
        proc = _srun(*args, env=env)
        return proc, time.monotonic() - start


def test_node_network_down_mid_job_ends_the_job():
    """node2's link goes down while the job calls collectives: JAX's coordination
    service misses node2's heartbeats (10 s here) and ends the job."""
    cmd = [
        "srun",
        "--time=5",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--mpi=pmi2",
        "python",
        PROGRAM,
        "--hold",
        "200",
        "--heartbeat",
        "10",
    ]
    with _running(cmd, _env()) as proc:
        lines = [_wait_for_line(proc, "HOLDING", 120) for _ in range(4)]
        assert len(lines) == 4
        subprocess.run(["ip", "link", "set", "m4jd-v2", "down"], check=True)
        cut = time.monotonic()
        try:
            output, _ = proc.communicate(timeout=120)
            ended = time.monotonic() - cut
        finally:
            subprocess.run(["ip", "link", "set", "m4jd-v2", "up"], check=True)
    assert proc.returncode != 0, output
    assert ended < 90, f"the job ended {ended:.0f} s after the cut:\n{output}"
    assert (
        "The following tasks are unhealthy (stopped sending heartbeats)" in output
    ), output
    cause = next(line for line in output.splitlines() if "unhealthy" in line)
    print(f"ended {ended:.1f} s after node2's link went down: {cause[-200:]}")


def test_firewall_dropping_the_coordinators_port_names_the_node():
    """node2 drops what it sends to the coordinator's port: the job ends within
    the reach timeout, naming node2 and the address, not after JAX's 300 s."""
    proc, took = _srun_behind(
        "node2",
        "output",
        f"tcp dport {COORDINATOR_PORT} drop",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--mpi=pmi2",
        *RUN.split(),
        env=_env(JAX_COORDINATOR_PORT=COORDINATOR_PORT),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    node1, node2 = _node_addresses()["node1"], _node_addresses()["node2"]
    line = (
        f"node2 ({node2}) cannot reach JAX's coordinator at "
        f"{node1}:{COORDINATOR_PORT}, where rank 0's service listens: no answer in "
        f"20 s."
    )
    assert line in output, output
    assert took < 90, f"{took:.0f} s"
    print(f"ended in {took:.1f} s: {line}")


def test_dead_proxy_on_one_node_only(tmp_path):
    """node2's environment names a proxy that does not answer: the package exempts
    the coordinator on every rank, so the job works."""
    wrapper = tmp_path / "proxy_on_node2.sh"
    wrapper.write_text(
        '#!/bin/bash\n[ "$(hostname)" = node2 ] && export '
        'http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9\nexec "$@"\n'
    )
    wrapper.chmod(0o755)
    proc = _srun(
        "--nodes=2",
        "--ntasks-per-node=2",
        "--mpi=pmi2",
        wrapper,
        *RUN.split(),
        env=_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(proc.stdout)
    _check_world(results, 2, 2)
    node1 = _node_addresses()["node1"]
    assert [(r["http_proxy"], r["no_grpc_proxy"]) for r in results] == [
        (None, None),
        (None, None),
        ("http://127.0.0.1:9", node1),
        ("http://127.0.0.1:9", node1),
    ]


def test_host_name_that_does_not_resolve():
    """Rank 0's node cannot resolve its own name: the coordinator and Gloo take
    the node's address from its interfaces and routes, not from its name."""
    hosts = STATE / "node1" / "hosts"
    saved = hosts.read_text()
    try:
        # In place: the node sees this file through a bind mount of its inode.
        with hosts.open("w") as f:
            f.write(
                "".join(
                    line
                    for line in saved.splitlines(True)
                    if not line.rstrip().endswith(" node1")
                )
            )
        proc = _srun(
            "--nodes=3", "--ntasks-per-node=1", "--mpi=pmi2", *RUN.split(), env=_env()
        )
    finally:
        with hosts.open("w") as f:
            f.write(saved)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(proc.stdout)
    _check_world(results, 3, 1)
    assert [r["host_resolves"] for r in results] == [False, True, True]


def test_diagnostics_report_a_collective_that_fails():
    """node1 refuses new connections from node2 but to the coordinator: Gloo
    cannot connect. --check does not crash: the ranks that fail report why, and
    the job ends once the others have hung in the psum for --timeout (10 s)."""
    rule = (
        f"ip saddr {_node_addresses()['node2']} tcp dport != {COORDINATOR_PORT} "
        "tcp flags syn / syn,ack reject with tcp reset"
    )
    proc, took = _srun_behind(
        "node1",
        "input",
        rule,
        "--nodes=2",
        "--ntasks-per-node=1",
        "--mpi=pmi2",
        "python",
        "-m",
        "mpi4jax_dist",
        "--check",
        "--timeout",
        "10",
        env=_env(JAX_COORDINATOR_PORT=COORDINATOR_PORT),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    line = next(line for line in output.splitlines() if "mpi4jax_dist --check:" in line)
    assert "JAX's psum across the 2 processes failed: JaxRuntimeError" in line, line
    assert "Gloo context initialization failed" in line, line
    assert "some rank was still in JAX's psum across the processes after 10 s" in line
    assert took < 90, f"{took:.0f} s"
    print(f"ended in {took:.1f} s: {line}")


# --- a hung job (mpi4jax_dist.faults.hangs) -----------------------------------------

STALL = "tests/scripts/stall.py"
# MPI's own way of waiting (util.SPIN): the cluster's nodes share this machine's
# cores, where a rank spinning in a blocking send once starved the rank it sent to.
STALL_ENV = {
    "MPI4JAX_NO_WARN_JAX_VERSION": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    **util.SPIN,
}


def test_a_rank_stalled_on_one_node_is_named_by_the_timeout():
    """Rank 3 (node2) sleeps while the others wait in a jitted allreduce: the job
    ends MPI4JAX_DIST_COLLECTIVE_TIMEOUT later, naming it, with its stacks."""
    env = _env(**STALL_ENV, MPI4JAX_DIST_COLLECTIVE_TIMEOUT=10)
    cmd = ["srun", "--time=5", "--nodes=2", "--ntasks-per-node=2", "--mpi=pmi2"]
    with _running([*cmd, "python", STALL], env) as proc:
        stalled = _wait_for_line(proc, "STALL", 120)
        assert stalled, "the job never stalled"
        since = time.time() - float(stalled.split()[1])
        output, _ = proc.communicate(timeout=120)
        ended = time.time() - float(stalled.split()[1])
    assert proc.returncode != 0, output
    line = next(x for x in output.splitlines() if "waited" in x and "call 4" in x)
    assert "in mpi4jax_dist.allreduce, call 4 on communicator 'MPI_COMM_WORLD'" in line
    assert "not entered by rank 3 (their last call there: 3)" in line, line
    assert "no answer" not in line, line  # every rank's watchdog answered rank 0
    assert re.search(
        r"^\[rank 3\] .*stall\.py\", line \d+ in stalled_compute$", output, re.M
    ), output
    assert 10 < ended < 60, ended
    print(
        f"ended {ended:.1f} s after rank 3 stalled ({since:.1f} s seen at once): "
        f"{line}"
    )


def test_a_rank_stalled_on_one_node_is_found_by_the_hang_timeout():
    """Rank 3 (node2) sleeps while the others wait in a psum over JAX's own
    collectives (Gloo across the nodes), which no timeout of the package's ops
    bounds: MPI4JAX_DIST_HANG_TIMEOUT ends the job, rank 3 named apart."""
    env = _env(**STALL_ENV, MODE="psum", MPI4JAX_DIST_HANG_TIMEOUT=10)
    cmd = ["srun", "--time=5", "--nodes=2", "--ntasks-per-node=2", "--mpi=pmi2"]
    with _running([*cmd, "python", STALL], env) as proc:
        stalled = _wait_for_line(proc, "STALL", 120)
        assert stalled, "the job never stalled"
        output, _ = proc.communicate(timeout=120)
        ended = time.time() - float(stalled.split()[1])
    assert proc.returncode != 0, output
    report = re.search(
        r"mpi4jax_dist: no rank of 4 made progress .*\n"
        r"  1 rank at stall\.py:\d+ in stalled_compute: .*: rank 3\n"
        r"  3 ranks at stall\.py:\d+ in <lambda>.*: ranks 0-2\n",
        output,
    )
    assert report, output
    assert 10 < ended < 60, ended
    print(f"ended {ended:.1f} s after rank 3 stalled:\n{report.group(0)}")


def test_scancel_signal_usr1_gives_every_rank_stacks(tmp_path):
    """``scancel --signal=USR1`` while rank 3 stalls: each rank writes rank-N.txt
    and the job goes on; ``--hangs`` names rank 3 apart."""
    name = f"stall-{os.getpid()}"
    env = _env(**STALL_ENV, MPI4JAX_DIST_HANG_DIR=tmp_path, STALL_S=200)
    cmd = [
        "srun",
        "--time=5",
        f"--job-name={name}",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--mpi=pmi2",
        "python",
        STALL,
    ]
    with _running(cmd, env) as proc:
        assert _wait_for_line(proc, "STALL", 120), "the job never stalled"
        time.sleep(2)  # the others are in the 4th call
        subprocess.run(
            ["scancel", "--signal=USR1", f"--name={name}", f"--user={os.getuid()}"],
            env=env,
            timeout=60,
            check=True,
        )
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank-*.txt"))) < 4:
            assert time.monotonic() < deadline, list(tmp_path.iterdir())
            time.sleep(0.2)
        assert proc.poll() is None, "the signal ended the job"
    summary = util.run_command(
        [sys.executable, "-m", "mpi4jax_dist", "--hangs", str(tmp_path)],
        env=env,
        timeout=60,
    )
    lines = summary.stdout.splitlines()
    assert lines[0] == f"mpi4jax_dist: stacks of 4 of 4 ranks in {tmp_path}", lines
    # When the stacks were taken, by the nodes' clocks, and how soon written.
    assert lines[1].startswith("dumped from ") and " each written within " in lines[1]
    assert lines[2].startswith("3 ranks at stall.py:") and lines[2].endswith(
        ": ranks 0-2"
    ), lines
    assert "in stalled_compute" in lines[3] and lines[3].endswith(": rank 3"), lines
    hosts = {
        re.search(r"^# host (\S+)", p.read_text(), re.M).group(1)
        for p in tmp_path.glob("rank-*.txt")
    }
    assert hosts == {"node1", "node2"}, hosts
    print("\n".join(lines[:4]))


# --- python -m mpi4jax_dist status (mpi4jax_dist.diagnostics.status) -----------------


def test_status_reaches_the_ranks_of_another_node_over_mpi(tmp_path):
    """A hung job on two nodes (rank 1 holds its GIL in C after 5 calls; rank 0
    waits in the 6th). Each rank's socket is in its host's folder; ``status``, run
    on rank 0's node (its namespaces), reaches rank 1 on the other node only
    through rank 0, which asks it over MPI across the bridge; rank 1's thread
    answers from C."""
    sockets = tmp_path / "status"
    env = _env(
        **STALL_ENV,
        MPI4JAX_DIST_STATUS_DIR=sockets,
        STOP=tmp_path / "stop",
        MODE="hang",
    )
    cmd = ["srun", "--time=5", "--nodes=2", "--ntasks-per-node=1", "--mpi=pmi2"]
    with _running([*cmd, "python", "tests/scripts/status_job.py"], env) as proc:
        deadline = time.monotonic() + 120
        while len(list(sockets.glob("*/*.sock"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no sockets"
            time.sleep(0.5)
        time.sleep(2.0)  # rank 1 reaches its 5th call and holds its GIL
        (rank_0_host,) = [p.parent.name for p in sockets.glob("*/*.0.sock")]
        (rank_1,) = sockets.glob("*/*.1.sock")
        assert rank_1.parent.name != rank_0_host
        status = [sys.executable, "-m", "mpi4jax_dist", "status", "--json"]
        asked = util.run_command(
            ["bash", str(CLUSTER_SH), "on", rank_0_host, *status], env=env, timeout=60
        )
        (tmp_path / "stop").touch()
        output, _ = proc.communicate(timeout=120)
    assert asked.returncode == 0, asked.stderr + output
    result = json.loads(asked.stdout)
    assert result["asked"] == 0 and result["missing"] == [], result
    assert result["fewest_calls"] == [1], result
    rank_0, rank_1 = result["ranks"]
    assert rank_0["host"] != rank_1["host"], result
    assert rank_0["call"].startswith("allreduce #6 SUM float32[1]"), rank_0
    assert rank_1["call"] == "" and rank_1["python"].startswith("status_job.py:")
    assert output.count("DONE") == 2, output
    print(f"answered in {result['took_s']:.2f} s: {rank_0['host']}, {rank_1['host']}")
