"""End-to-end launches: real ``mpiexec`` jobs (and plain ``python`` runs), no mocks.

Every test starts its own processes through the scripts in tests/scripts/, which
print one ``RESULT {json}`` line per rank; the tests parse those lines and assert.
They run only in the serial session (``python -m pytest``), never inside an MPI job.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
import textwrap

import psutil
import pytest
import util
from util import skip_in_mpi_job

pytestmark = [util.every_mpi, util.same_under_every_jax]

TIMEOUT = 120  # seconds per job; jobs take a few seconds even oversubscribed
README = util.ROOT / "README.rst"


def _env(**extra) -> dict:
    return util.clean_env(**extra)


def _results(proc, n: int, key: str) -> dict:
    """Return ``{rank: result}`` from the RESULT lines, one per rank (checked)."""
    lines = util.result_texts(proc.stdout)
    shown = f"\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert len(lines) == n, f"expected {n} RESULT lines, got {len(lines)}{shown}"
    results = [json.loads(line) for line in lines]
    by_rank = {r[key]: r for r in results}
    assert sorted(by_rank) == list(
        range(n)
    ), f"ranks by {key}: {sorted(by_rank)}{shown}"
    return by_rank


def _run(script, n: int, *args, key: str = "topo_rank", **kwargs) -> dict:
    """Run ``script`` on ``n`` ranks; return ``{rank: result}`` keyed by ``key``."""
    kwargs.setdefault("env", _env())
    proc = util.run_mpi(script, n, *args, timeout=TIMEOUT, **kwargs)
    return _results(proc, n, key)


def _check_world(result: dict, index: int, count: int) -> None:
    """Assert one process's view of a world of ``count`` processes, a CPU each."""
    assert result["process_index"] == index
    assert result["process_count"] == count
    assert result["device_count"] == count
    assert result["local_device_count"] == 1
    assert result["device_process_indices"] == list(range(count))
    assert result["jax_coordinator"] == result["topo_coordinator_address"]
    # Computations that need every process of the world.
    assert result["allgather"] == list(range(count))
    assert result["mesh_process_order"] == list(range(count))
    assert result["global_shape"] == [count]
    assert result["global_sum"] == count * (count + 1) / 2
    assert result["psum"] == [count * (count + 1) / 2]
    assert result["roundtrip"] is True


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _layout(hosts: str, n: int | None = None) -> list[tuple[int, int, int]]:
    """Return ``(node_index, local_rank, local_size)`` per rank for MPICH's -hosts:
    each host gets its count of consecutive ranks, round after round until ``n``
    (default: one round)."""
    counts = [int(entry.rpartition(":")[2]) for entry in hosts.split(",")]
    n = sum(counts) if n is None else n
    nodes: list[int] = []
    while len(nodes) < n:
        for node, count in enumerate(counts):
            nodes += [node] * count
    nodes = nodes[:n]
    return [
        (node, nodes[:rank].count(node), nodes.count(node))
        for rank, node in enumerate(nodes)
    ]


# --- 1. plain jax.distributed.initialize() on one node -----------------------------

_plain_cache: dict = {}


def _plain(n: int) -> dict:
    if n not in _plain_cache:
        _plain_cache[n] = _run("launch_plain.py", n, "jax")
    return _plain_cache[n]


@skip_in_mpi_job
@pytest.mark.parametrize(
    "n", [pytest.param(1, marks=util.variant), 2, pytest.param(4, marks=util.variant)]
)
def test_plain_initialize_one_node(n):
    results = _plain(n)
    addresses = {r["topo_coordinator_address"] for r in results.values()}
    assert len(addresses) == 1, addresses
    host, port = _host_port(addresses.pop())
    assert host == "127.0.0.1" and 1 <= port <= 65535
    for rank, r in results.items():
        assert (r["mpi_rank"], r["mpi_size"]) == (rank, n)
        assert (r["topo_rank"], r["topo_size"]) == (rank, n)
        assert (r["topo_local_rank"], r["topo_local_size"]) == (rank, n)
        assert (r["topo_node_index"], r["topo_num_nodes"]) == (0, 1)
        assert r["topo_launcher"] == util.expected_launcher()
        _check_world(r, rank, n)


@skip_in_mpi_job
def test_initialize_after_plain_initialize_is_idempotent():
    """mpi4jax_dist.initialize() after a plain jax.distributed.initialize() that went
    through our env only checks and returns the same topology."""
    for r in _plain(2).values():
        assert r["reinit"] == "same"


# --- 2, 3. pretend nodes (MPICH fork launcher) --------------------------------------


@skip_in_mpi_job
@pytest.mark.parametrize(
    "hosts, n",
    [
        ("nodeA:2,nodeB:2", 4),
        pytest.param("nodeA:1,nodeB:2,nodeC:1", 4, marks=util.variant),
        # round-robin: a node's ranks not adjacent
        pytest.param("nodeA:1,nodeB:1,nodeC:1", 6, marks=util.variant),
    ],
)
def test_pretend_nodes(hosts, n):
    layout = _layout(hosts, n)
    results = _run("launch_plain.py", n, "jax", hosts=hosts)
    addresses = {r["topo_coordinator_address"] for r in results.values()}
    assert len(addresses) == 1, addresses
    host, _ = _host_port(addresses.pop())
    ip = ipaddress.ip_address(host)
    assert not ip.is_loopback, f"several nodes but a loopback coordinator {host}"
    mine = {
        a.address.split("%")[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
    }
    assert host in mine, f"coordinator {host} is not an address of this host: {mine}"
    for rank, r in results.items():
        node, local_rank, local_size = layout[rank]
        got = (r["topo_node_index"], r["topo_local_rank"], r["topo_local_size"])
        assert got == (node, local_rank, local_size), f"rank {rank}"
        assert r["topo_num_nodes"] == len(hosts.split(","))
        assert (r["topo_rank"], r["topo_size"]) == (rank, n)
        assert r["topo_launcher"] == util.expected_launcher()
        _check_world(r, rank, n)


# --- 3b. the release at every MPI thread level ----------------------------------------

THREAD_LEVELS = {"single": 0, "funneled": 1, "serialized": 2, "multiple": 3}


@skip_in_mpi_job
@pytest.mark.parametrize("level", sorted(THREAD_LEVELS, key=THREAD_LEVELS.get))
def test_release_at_each_thread_level(level):
    """Below THREAD_MULTIPLE no second thread may call MPI: the other ranks probe
    rank 0's port (on other nodes only their leader does) instead of waiting for
    rank 0's thread in an Ibarrier."""
    hosts = "nodeA:2,nodeB:2"
    results = _run(
        "launch_plain.py", 4, "jax", hosts=hosts, env=_env(MPI4PY_RC_THREAD_LEVEL=level)
    )
    expected = "thread" if level == "multiple" else "probe"
    for rank, r in results.items():
        assert r["thread_level"] == THREAD_LEVELS[level], f"rank {rank}"
        assert r["release"] == expected, f"rank {rank}: {r['release']}"
        assert (r["topo_node_index"], r["topo_num_nodes"]) == _layout(hosts)[rank][
            :1
        ] + (2,)
        _check_world(r, rank, 4)


# --- 4. ensembles: one JAX world per sub-communicator -------------------------------


@skip_in_mpi_job
def test_ensembles_of_two():
    results = _run("launch_ensemble.py", 4, "2", key="world_rank")
    groups: dict = {}
    for world_rank, r in results.items():
        assert r["color"] == world_rank // 2
        assert (r["comm_rank"], r["comm_size"]) == (world_rank % 2, 2)
        assert (r["topo_rank"], r["topo_size"]) == (r["comm_rank"], 2)
        assert (r["topo_node_index"], r["topo_num_nodes"]) == (0, 1)
        assert r["reinit"] == "same"  # initialize(comm=comm) again
        assert r["topology_comm"] == "same"  # topology(comm) after initialize(comm=)
        _check_world(r, r["comm_rank"], 2)
        groups.setdefault(r["color"], set()).add(r["topo_coordinator_address"])
    assert sorted(groups) == [0, 1]
    assert all(len(a) == 1 for a in groups.values()), groups
    assert groups[0] != groups[1], f"both groups share a coordinator: {groups}"


@skip_in_mpi_job
def test_topology_with_subcommunicator_twice():
    results = _run("launch_topology_comm.py", 4, key="world_rank")
    for r in results.values():
        assert r["first_size"] == 2
        assert r["again"] == "same"


# --- 5. the README's usage example ----------------------------------------------------

_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\.[ \t]+code-block::[ \t]*python[ \t]*$")


def python_blocks(text: str) -> list[str]:
    """Return the contents of the ``.. code-block:: python`` blocks of an RST text."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _DIRECTIVE.match(lines[i])
        i += 1
        if not match:
            continue
        indent = len(match["indent"].expandtabs())
        body = []
        while i < len(lines):
            line = lines[i]
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break
            body.append(line)
            i += 1
        # Directive options (":linenos:" ...) come first, up to the first blank line.
        while body and body[0].strip().startswith(":"):
            body.pop(0)
        blocks.append(textwrap.dedent("\n".join(body)).strip("\n") + "\n")
    return blocks


def readme_example(text: str) -> str | None:
    """Return the first python code block that imports mpi4jax_dist, or None."""
    return next((b for b in python_blocks(text) if "import mpi4jax_dist" in b), None)


@skip_in_mpi_job
def test_readme_block_extraction():
    text = textwrap.dedent("""\
        Title
        =====

        .. code-block:: python

           import jax  # no mpi4jax_dist here

        Usage:

        .. code-block:: python
           :caption: hello.py

           import mpi4jax_dist
           import jax

           def f():
               return 1

        After the block.

        .. code-block:: python

           import mpi4jax_dist  # a later one
        """)
    assert python_blocks(text)[0] == "import jax  # no mpi4jax_dist here\n"
    assert readme_example(text) == (
        "import mpi4jax_dist\nimport jax\n\ndef f():\n    return 1\n"
    )
    assert readme_example("no code here\n") is None


@util.same_under_every_mpi
@skip_in_mpi_job
def test_readme_example_runs(tmp_path):
    text = README.read_text() if README.exists() else ""
    code = readme_example(text)
    if code is None:
        pytest.skip(
            "README.rst has no `.. code-block:: python` block containing "
            "`import mpi4jax_dist` yet"
        )
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    proc = util.run_mpi(script, 2, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0


@util.same_under_every_mpi
@skip_in_mpi_job
def test_hello_example_runs():
    """examples/hello.py, the usage example with a psum, on two ranks."""
    proc = util.run_mpi(
        util.ROOT / "examples" / "hello.py", 2, timeout=TIMEOUT, env=_env()
    )
    for rank in (0, 1):
        assert f"rank {rank}: mpi4jax [" in proc.stdout, proc.stdout


# --- 6, 7. where our env must not answer a plain jax.distributed.initialize() --------

_NO_ENV = "ValueError: coordinator_address should be defined."


@util.same_under_every_mpi
@skip_in_mpi_job
def test_without_launcher_one_process_off():
    """``python script.py`` with ``MPI4JAX_DIST_ONE_PROCESS=0``: plain JAX init fails
    as without any cluster env (neither of ours is present, and MPI is not started by
    asking); mpi4jax_dist.initialize() gives a one-process world (MPI singleton).
    With the switch on, tests/jobs/test_one_process.py."""
    cmd = [sys.executable, str(util.SCRIPTS / "launch_no_env.py")]
    proc = util.run_command(cmd, env=_env(MPI4JAX_DIST_ONE_PROCESS=0), timeout=TIMEOUT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    (r,) = _results(proc, 1, "topo_rank").values()
    assert r["plain"] == _NO_ENV
    assert r["initialized_after_plain"] is False
    assert r["mpi_imported_after_plain"] is False
    assert r["explicit"] == "initialized"
    assert (r["topo_rank"], r["topo_size"]) == (0, 1)
    assert (r["topo_local_rank"], r["topo_local_size"]) == (0, 1)
    assert (r["topo_node_index"], r["topo_num_nodes"]) == (0, 1)
    assert r["topo_launcher"] == "mpi"
    assert _host_port(r["topo_coordinator_address"])[0] == "127.0.0.1"
    assert (r["process_index"], r["process_count"], r["device_count"]) == (0, 1, 1)


@util.same_under_every_mpi
@skip_in_mpi_job
def test_disabled_under_mpiexec():
    """MPI4JAX_DIST_DISABLE=1: a plain jax.distributed.initialize() is not ours (JAX's
    ValueError on every rank); asking by name, mpi4jax_dist.initialize(), still works.
    """
    results = _run("launch_no_env.py", 2, env=_env(MPI4JAX_DIST_DISABLE=1))
    addresses = {r["topo_coordinator_address"] for r in results.values()}
    assert len(addresses) == 1, addresses
    for rank, r in results.items():
        assert r["plain"] == _NO_ENV, f"rank {rank}"
        assert r["initialized_after_plain"] is False
        assert r["mpi_imported_after_plain"] is False
        assert r["explicit"] == "initialized"
        assert (r["topo_rank"], r["topo_size"]) == (rank, 2)
        assert r["topo_launcher"] == util.expected_launcher()
        assert (r["process_index"], r["process_count"], r["device_count"]) == (
            rank,
            2,
            2,
        )


BAD_TIMEOUT = "MPI4JAX_DIST_COLLECTIVE_TIMEOUT='abc' is not a number of seconds"


@util.same_under_every_mpi
@pytest.mark.parametrize(
    "variable, value, n, message",
    [
        ("MPI4JAX_DIST_COLLECTIVE_TIMEOUT", "abc", 4, BAD_TIMEOUT),
        ("JAX_COORDINATOR_PORT", "99999", 2, "JAX_COORDINATOR_PORT='99999' is not"),
        (
            "MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES",
            "lots",
            2,
            "MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES='lots' is not a size in bytes",
        ),
        (
            "MPI4JAX_DIST_INTERFACE",
            "eth9",
            4,
            "MPI4JAX_DIST_INTERFACE='eth9' names no network interface on",
        ),
    ],
    ids=["timeout", "port", "chunk", "interface"],
)
def test_a_setting_bad_on_every_rank_is_printed_once(variable, value, n, message):
    """Rank 0 rules the job's settings (those read where they are used too, such
    as the allreduce's chunk size): its bad value goes to every rank in the
    bootstrap's broadcast, every rank raises it, and only rank 0 prints it, as
    one line that names the variable and the fix, where there were n tracebacks
    through JAX's frames; every rank exits with status 1. ``-X dev`` gives rank
    0's traceback."""
    env = util.clean_env(**{variable: value})
    code = ["-c", "import jax, mpi4jax_dist; jax.distributed.initialize()"]
    proc = util.run_mpi(code, n, env=env, check=False, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if message in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mpi4jax_dist: " + message), lines
    assert "python -X dev" in lines[0], lines
    assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr
    if variable == "MPI4JAX_DIST_INTERFACE":  # each host checks its own
        assert f"So on {n} of {n} ranks: name an interface" in lines[0], lines
    if variable != "MPI4JAX_DIST_COLLECTIVE_TIMEOUT":
        return
    dev = util.run_mpi(["-X", "dev", *code], 2, env=env, check=False, timeout=120)
    assert dev.returncode != 0
    assert dev.stderr.count("Traceback (most recent call last)") == 1, dev.stderr
    assert "mpi4jax_dist.faults.failfast.JobValueError: " + BAD_TIMEOUT in dev.stderr


@util.same_under_every_mpi
def test_a_setting_bad_on_another_rank_than_0_is_not_used():
    """Rank 0's value rules the job: rank 3's own bad value, where rank 0's is
    good, is never used (as no value of another rank is), and the job starts."""
    code = (
        "import os, jax, mpi4jax_dist\n"
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 3:\n"
        "    os.environ['MPI4JAX_DIST_COLLECTIVE_TIMEOUT'] = 'abc'\n"
        "jax.distributed.initialize()\n"
        "print('STARTED', flush=True)\n"
    )
    proc = util.run_mpi(["-c", code], 4, env=util.clean_env(), timeout=120)
    assert proc.stdout.count("STARTED") == 4, proc.stdout + proc.stderr


@util.same_under_every_mpi
@pytest.mark.parametrize("where", ["alone", "mpiexec"])
def test_a_setting_warning_is_shown_once_at_the_user_s_line(tmp_path, where):
    """A value the package reads otherwise than written (here fail-fast's switch,
    read as the job starts) warns once for the job, alone or under mpiexec -n 4 (it
    did on every rank), at the user's line that led to it (the initialize), not at
    the package's own."""
    script = tmp_path / "job.py"
    script.write_text("import jax\nimport mpi4jax_dist\njax.distributed.initialize()\n")
    env = util.clean_env(MPI4JAX_DIST_FAIL_FAST="maybe")
    if where == "alone":
        proc = util.run_command([sys.executable, str(script)], env=env, timeout=120)
    else:
        proc = util.run_mpi(script, 4, env=env, timeout=120)
    said = "MPI4JAX_DIST_FAIL_FAST='maybe' is not a boolean"
    lines = [line for line in proc.stderr.splitlines() if said in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script}:3: SettingWarning: "), lines
    assert "mpi4jax_dist/" not in proc.stderr, proc.stderr


@util.same_under_every_mpi
def test_an_interface_one_rank_cannot_use_is_named_once():
    """Rank 2 alone names an interface its host lacks: rank 0 says so in one line,
    with how many ranks, and every rank ends (none waits for the others)."""
    code = (
        "import os, jax, mpi4jax_dist\n"
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 2:\n"
        "    os.environ['MPI4JAX_DIST_INTERFACE'] = 'eth9'\n"
        "jax.distributed.initialize()\n"
    )
    proc = util.run_mpi(["-c", code], 4, env=util.clean_env(), check=False, timeout=120)
    assert proc.returncode != 0
    said = (
        "mpi4jax_dist: MPI4JAX_DIST_INTERFACE names no usable interface on 1 of 4 "
        "ranks (rank 0 names none)"
    )
    assert proc.stderr.count(said) == 1, proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr


MPI4JAX_WARNING = "The latest supported JAX version with this release of mpi4jax"


@util.same_under_every_mpi
def test_mpi4jax_s_version_warning_is_printed_by_rank_0_only():
    """mpi4jax imported after the bootstrap: its JAX-version warning (where this
    JAX is newer than it knows) once for the job, not once per rank."""
    pytest.importorskip("mpi4jax")
    code = "import jax, mpi4jax_dist; jax.distributed.initialize(); import mpi4jax"
    env = util.clean_env()
    env.pop("MPI4JAX_NO_WARN_JAX_VERSION", None)
    alone = util.run_command([sys.executable, "-c", code], env=env, timeout=120)
    once = alone.stderr.count(MPI4JAX_WARNING)  # 1 where it warns here, else 0
    proc = util.run_mpi(["-c", code], 4, env=env, timeout=120)
    assert proc.stderr.count(MPI4JAX_WARNING) == once, proc.stderr
