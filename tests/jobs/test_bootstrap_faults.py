"""Launch tests of the bootstrap's failure handling, each mpiexec with a timeout."""

import json
import re
import socket
import sys
import time

import pytest
import util

pytestmark = [util.skip_in_mpi_job, util.every_mpi]


def results(stdout: str) -> list[dict]:
    rows = [json.loads(text) for text in util.result_texts(stdout)]
    return sorted(rows, key=lambda r: r["rank"])


@util.same_under_every_jax
def test_rank_that_never_arrives_ends_job_after_deadline():
    start = time.monotonic()
    proc = util.run_mpi(
        "robust_init.py",
        2,
        1,
        120,
        check=False,
        timeout=90,
        env=util.clean_env(TEST_INIT_TIMEOUT=3),
    )
    took = util.seconds_from("INITIALIZING", proc.stdout, start, time.monotonic())
    assert proc.returncode != 0
    assert "gave up after 3 s waiting for all 2 ranks to reach the bootstrap" in (
        proc.stderr + proc.stdout
    )
    assert took < 60, f"job took {took:.0f} s to end"


@util.same_under_every_jax
def test_probing_ranks_end_the_job_when_the_coordinator_never_listens():
    start = time.monotonic()
    proc = util.run_mpi("probe_deadline.py", 2, check=False, timeout=90)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert "RELEASED" not in proc.stdout
    assert (
        "rank 1 of 2: gave up after 2 s waiting for rank 0's JAX coordination "
        "service to listen on 127.0.0.1:" in proc.stderr
    ), proc.stderr[-2000:]
    assert took < 60, f"job took {took:.0f} s to end"


@pytest.mark.parametrize(
    "mode, why",
    [
        ("thread", "where rank 0's service listens: no answer in 2 s"),
        pytest.param(
            "probe",
            "where rank 0's service is to listen: no answer in 0.5 s, until the "
            "deadline",
            marks=util.variant,
        ),
    ],
)
def test_a_node_that_cannot_reach_the_coordinator_ends_the_job(mode, why):
    start = time.monotonic()
    proc = util.run_mpi("reach_deadline.py", 2, mode, check=False, timeout=90)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert "REACHED" not in proc.stdout and "RELEASED" not in proc.stdout
    address = re.search(r"coordinator at (127\.0\.0\.1:\d+)", proc.stderr)
    assert address, proc.stderr[-2000:]
    line = (
        f"rank 1 of 2: {socket.gethostname()} (127.0.0.1) cannot reach JAX's "
        f"coordinator at {address.group(1)}, {why}. "
    )
    assert line in proc.stderr, proc.stderr[-2000:]
    assert took < 60, f"job took {took:.0f} s to end"


@util.same_under_every_mpi
def test_proxy_exempted_and_service_bound_to_loopback():
    proc = util.run_mpi(
        "robust_init.py",
        2,
        env=util.clean_env(
            http_proxy="http://127.0.0.1:9",
            HTTPS_PROXY="http://127.0.0.1:9",
            TEST_INIT_TIMEOUT=30,
        ),
    )
    rows = results(proc.stdout)
    assert [r["process_index"] for r in rows] == [0, 1]
    for r in rows:
        assert r["no_grpc_proxy"] == "127.0.0.1"
        assert r["http_proxy"] == "http://127.0.0.1:9"  # the user's own, untouched
    assert "added 127.0.0.1 to no_grpc_proxy" in proc.stderr
    assert proc.stderr.count("added 127.0.0.1 to no_grpc_proxy") == 1  # rank 0 only
    # One message: JAX's warning that the proxies "may cause a hang" is no longer
    # true, and off (test_jax_s_proxy_warning_only_where_a_proxy_catches_...).
    assert "JAX detected proxy variable(s)" not in proc.stderr, proc.stderr[-2000:]
    zero = rows[0]
    assert zero["coordinator"].startswith("127.0.0.1:")
    assert zero["bind"] is None  # set for JAX, taken back once the service listened
    assert zero["answers_on_coordinator"] is True
    assert zero["answers_on_other"] is False, zero


@util.same_under_every_mpi
def test_user_bind_address_wins():
    port = _free_port()
    proc = util.run_mpi(
        "robust_init.py",
        2,
        env=util.clean_env(
            JAX_COORDINATOR_BIND_ADDRESS=f"[::]:{port}", JAX_COORDINATOR_PORT=port
        ),
    )
    zero = results(proc.stdout)[0]
    assert zero["bind"] == f"[::]:{port}"
    assert zero["answers_on_other"] is True  # every interface, as the user asked


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@util.same_under_every_mpi
@util.same_under_every_jax
def test_port_in_use_fails_fast_naming_port():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        proc = util.run_mpi(
            "robust_init.py",
            2,
            check=False,
            timeout=90,
            env=util.clean_env(JAX_COORDINATOR_PORT=port),
        )
        took = util.seconds_from("INITIALIZING", proc.stdout, start, time.monotonic())
    assert proc.returncode != 0
    assert f"coordinator port {port} on 127.0.0.1" in proc.stderr
    assert took < 30  # rank 1 would wait out its 60 s to initialize


@pytest.mark.parametrize(
    "variable, value",
    [
        ("JAX_COORDINATOR_PORT", "eighty"),
        pytest.param("JAX_COORDINATOR_ADDRESS", "nohostport", marks=util.variant),
        pytest.param("MPI4JAX_DIST_INTERFACE", "no-such-if0", marks=util.variant),
    ],
)
@util.same_under_every_jax
def test_bad_input_names_variable(variable, value):
    proc = util.run_mpi(
        "robust_init.py",
        2,
        hosts="nodeA:1,nodeB:1",
        check=False,
        timeout=90,
        env=util.clean_env(**{variable: value}),
    )
    assert proc.returncode != 0
    assert f"{variable}={value!r}" in proc.stderr


@util.variant
@util.same_under_every_mpi
def test_non_boolean_disable_warns_and_keeps_working():
    proc = util.run_mpi(
        "robust_init.py", 2, env=util.clean_env(MPI4JAX_DIST_DISABLE="maybe")
    )
    assert [r["process_index"] for r in results(proc.stdout)] == [0, 1]
    assert "MPI4JAX_DIST_DISABLE='maybe' is not a boolean" in proc.stderr


@util.same_under_every_jax
def test_launcher_size_differs_from_mpi_size():
    # What Open MPI's mpiexec does to an mpi4py built for MPICH: every rank a
    # singleton. Faked here with Open MPI's variables around a plain python run.
    code = "import mpi4jax_dist; mpi4jax_dist.topology()"
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=util.clean_env(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4"),
    )
    assert proc.returncode != 0
    assert "The launcher (openmpi) started 4 ranks but MPI says this job has 1" in (
        proc.stderr
    )


def test_diagnostics_check_under_mpiexec():
    proc = util.run_mpi(["-m", "mpi4jax_dist"], 2, "--json", "--check")
    report = json.loads(proc.stdout)  # all of it: jaxlib's Gloo prints to stderr
    assert report["problems"] == []
    assert report["launcher"] == util.expected_launcher()
    assert report["topology"]["ranks_per_node"] == {"0": [0, 1]}
    assert report["check"]["allreduce_equals_psum"] is True
    calls = [(c["phase"], c["name"]) for c in report["bootstrap_calls"]]
    assert calls == [
        ("arrival", "Idup"),
        ("topology", "Split_type"),
        ("topology", "Iexscan"),
        ("topology", "Iallreduce"),
        ("topology", "Ibcast"),
        ("topology", "Ibcast"),
    ]
    # Split_type: what this MPI adds, in its own words (not MPICH's elsewhere)
    adds = report["bootstrap_calls"][1]["mpi_adds"]
    if util.mpi_family() == "openmpi":
        assert adds.startswith("Open MPI finds the node's ranks") and "O(log P)" in adds
    else:
        assert adds.startswith("MPICH splits by node id") and "O(P)" in adds
    library = report["mpi"]["library"]
    assert library.startswith(
        {"mpich": "MPICH", "openmpi": "Open MPI", "impi": "Intel(R) MPI"}[
            util.mpi_family()
        ]
    )


# What another MPI's mpiexec prints for --version (Open MPI 4's ORTE, MPICH's Hydra).
OTHER_MPIEXEC = {
    "openmpi": "HYDRA build details:\n    Version: 4.0.2",
    "mpich": "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/",
    "impi": "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/",
}


@util.same_under_every_jax
def test_another_mpis_mpiexec_on_path_is_named(tmp_path):
    """An mpiexec of another MPI first on PATH (Debian's, Open MPI 4's, beside
    mpi4py's MPICH): a problem where nothing says what started the job; a note
    where the job's own launcher is the library's (it ran, and was the right one)."""
    fake = tmp_path / "mpiexec"
    fake.write_text(
        f"#!/bin/sh\ncat <<'END'\n{OTHER_MPIEXEC[util.mpi_family()]}\nEND\n"
    )
    fake.chmod(0o755)
    path = f"{tmp_path}:{util.BIN}:{util.clean_env()['PATH']}"
    alone = util.run_command(
        [sys.executable, "-m", "mpi4jax_dist", "--json"],
        env=util.clean_env(PATH=path),
        timeout=120,
    )
    report = json.loads(alone.stdout)
    assert report["mpi"]["mpiexec"] == str(fake)
    (problem,) = [p for p in report["problems"] if "mpiexec on PATH" in p]
    assert "looks like another MPI than the one mpi4py uses" in problem, problem
    launched = util.run_mpi(
        ["-m", "mpi4jax_dist", "--json"], 1, env=util.clean_env(PATH=path)
    )
    report = json.loads(launched.stdout)
    assert not [p for p in report["problems"] if "mpiexec on PATH" in p], report
    if report["mpi"]["mpiexec"] != str(fake):
        # Open MPI 4's mpiexec (ORTE) puts its own bin first on the ranks' PATH:
        # they find it, not the fake, and nothing is amiss.
        assert report["mpi"]["mpiexec_note"] is None, report["mpi"]
        return
    assert "this job's launcher" in report["mpi"]["mpiexec_note"], report["mpi"]


@util.variant
@util.same_under_every_mpi
def test_diagnostics_without_launcher_exit_nonzero():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "mpi4jax_dist"],
        capture_output=True,
        text=True,
        timeout=120,
        env=util.clean_env(),
        cwd=util.ROOT,
    )
    assert proc.returncode == 1
    assert "PROBLEM       rank 0: size 1 and no launcher variables" in proc.stdout


@util.same_under_every_mpi
@util.same_under_every_jax
def test_jobs_started_together_on_one_host_all_initialize():
    import subprocess

    jobs = [
        subprocess.Popen(
            [
                util.mpiexec(),
                "-n",
                "2",
                sys.executable,
                str(util.SCRIPTS / "robust_init.py"),
            ],
            env=util.clean_env(TEST_INIT_TIMEOUT=60),
            cwd=util.ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = []
    try:
        for job in jobs:
            out, err = job.communicate(timeout=150)
            outputs.append((job.returncode, out, err))
    finally:
        for job in jobs:
            job.kill()
    for code, _, err in outputs:
        assert code == 0, err
    coordinators = {results(out)[0]["coordinator"] for _, out, _ in outputs}
    assert len(coordinators) == 4, coordinators


def test_mpi4py_of_another_mpi_is_caught():
    # mpi4py from the other MPI's environment, started by this one's mpiexec: every
    # rank comes up as a singleton of size 1 while the launcher says 2.
    import os

    other = os.environ.get("TEST_OTHER_MPI_PYTHON")
    if not other:
        pytest.skip(
            "needs TEST_OTHER_MPI_PYTHON, a Python whose mpi4py uses another "
            "MPI (tools/test.sh sets it in its Open MPI stage)"
        )
    start = time.monotonic()
    proc = util.run_mpi(
        ["-c", "import mpi4jax_dist; mpi4jax_dist.topology()"],
        2,
        check=False,
        timeout=120,
        python=other,
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    # Open MPI's mpi4py under MPICH's (or Intel MPI's) mpiexec starts silently as
    # singletons: ours to catch. MPICH's mpi4py under Open MPI's mpiexec fails in
    # MPI_Init by itself.
    ours = "started 2 ranks but MPI says this job has 1" in proc.stderr
    assert ours or "internal_Init_thread" in proc.stderr, proc.stderr[-3000:]
    if util.mpi_family() in ("mpich", "impi"):
        assert ours, proc.stderr[-3000:]


@util.same_under_every_jax
def test_hard_file_limit_too_low_fails_every_rank_at_once():
    start = time.monotonic()
    proc = util.run_mpi("file_limit.py", 2, check=False, timeout=90, nofile=(200, 200))
    took = util.seconds_from("INITIALIZING", proc.stdout, start, time.monotonic())
    assert proc.returncode != 0
    message = (
        "rank 0 needs 258 open files for JAX's coordination service (2 processes, "
        "one connection each, + 256 for the rest), but its hard limit is 200 (soft "
        "200)"
    )
    # Every rank raises rank 0's message (the bootstrap's error broadcast), and
    # only rank 0 prints it: one line for the job.
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" not in proc.stderr
    assert "RESULT" not in proc.stdout
    assert took < 30, f"job took {took:.0f} s to end"


@util.variant
@util.same_under_every_mpi
def test_soft_file_limit_is_raised_to_the_hard_one():
    proc = util.run_mpi("file_limit.py", 2, nofile=(100, 4096))
    rows = results(proc.stdout)
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["before"] == [100, 4096]
    assert rows[0]["after"] == [4096, 4096]
    assert rows[0]["raised"] == [100, 4096]
    # Only rank 0 runs the service.
    assert rows[1]["after"] == [100, 4096] and rows[1]["raised"] is None


def test_jax_s_proxy_warning_only_where_a_proxy_catches_the_coordinator():
    """JAX warns on every rank about each variable with "_proxy" in its name
    ("may cause a hang"): Intel MPI's Hydra sets HYDRA_BSTRAP_PROXY_ID on every
    rank, and a proxy the package exempted the coordinator from no longer catches
    it (test_proxy_exempted_and_service_bound_to_loopback); neither shows it. A
    proxy kept (MPI4JAX_DIST_PROXY=keep) keeps JAX's warning, which is true then:
    the job fails at its coordinator."""
    alarm = "JAX detected proxy variable(s)"
    quiet = util.run_mpi(
        "robust_init.py", 2, env=util.clean_env(HYDRA_BSTRAP_PROXY_ID="0")
    )
    assert alarm not in quiet.stderr, quiet.stderr[-2000:]
    assert len(results(quiet.stdout)) == 2
    kept = util.run_mpi(
        "robust_init.py",
        2,
        timeout=90,
        check=False,
        env=util.clean_env(
            MPI4JAX_DIST_PROXY="keep",
            http_proxy="http://127.0.0.1:9",
            TEST_INIT_TIMEOUT=5,
        ),
    )
    assert kept.stderr.count(alarm) == 2, kept.stderr[-2000:]
    assert kept.returncode != 0 and not results(kept.stdout), kept.stderr[-2000:]
