"""``python -m mpi4jax_dist status`` asked of running jobs: one with a straggling
rank, one hung with a rank whose Python cannot run (it holds its GIL in C); and
_stacks's thread, which answers it from C, answering an asker that is late."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import util

SCRIPT = util.SCRIPTS / "status_job.py"


def line_of(marker: str) -> int:
    """The number of the script's line that holds ``marker``."""
    for number, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if marker in line:
            return number
    raise AssertionError(marker)


class Job:
    """``mpiexec -n 3 python status_job.py`` running in the background, its status
    sockets in a folder of the test's own; ended by the STOP file (or killed)."""

    def __init__(self, tmp_path, mode: str, **extra):
        self.sockets = tmp_path / "status"
        self.stop = tmp_path / "stop"
        self.env = util.clean_env(
            MPI4JAX_DIST_STATUS_DIR=self.sockets, STOP=self.stop, MODE=mode, **extra
        )
        cmd = [util.mpiexec(), "-n", "3", sys.executable, str(SCRIPT)]
        self.proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd=util.ROOT,
        )

    def wait_for_sockets(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended first:\n{self.proc.stdout.read()}")
            if len(list(self.sockets.glob("*/*.sock"))) == 3:  # in the host's folder
                return
            time.sleep(0.2)
        pytest.fail(f"no 3 status sockets in {self.sockets} after {timeout_s} s")

    def status(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mpi4jax_dist", "status", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def end(self) -> str:
        """Stop the job (the STOP file) and return its output."""
        self.stop.touch()
        try:
            out, _ = self.proc.communicate(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.communicate()
        return out


# What status reads (the record's counts, the socket, _stacks's C thread) is the
# package's own: alike under every JAX, whose part (the ops' calls) other files test.
@util.same_under_every_jax
def test_status_names_the_straggling_rank_and_where_each_rank_stands(tmp_path):
    """Rank 1 of 3 sleeps 0.1 s before each allreduce: the others spend nearly
    all their time waiting in the call for it. Status, asked while the job runs
    (as JSON; the text of such a reply: tests/unit/test_status_cli.py), answers
    for every rank, names rank 1 as the one the others wait for, and gives rank
    1's Python line (the program's own)."""
    job = Job(tmp_path, "straggle", LAG_S=0.1)
    try:
        job.wait_for_sockets()
        time.sleep(1.0)
        asked = job.status("--json")
    finally:
        out = job.end()
    assert asked.returncode == 0, asked.stderr + out
    result = json.loads(asked.stdout)
    assert result["size"] == 3 and result["missing"] == [], result
    assert result["waited_for"] == [1], result
    ranks = {r["rank"]: r for r in result["ranks"]}
    # Rank 1 sleeps nearly all its time; read at a random moment, its line is its
    # sleep's, or now and then its allreduce's: a frame of the program's own.
    loop = range(line_of("STRAGGLE LINE"), line_of("allreduce(flag") + 1)
    own = {f"status_job.py:{n} in <module>" for n in loop}
    assert ranks[1]["python"] in own, ranks[1]
    assert all(ranks[r]["calls"] > 0 for r in range(3)), ranks
    for r in (0, 2):
        # Each waits in the call nearly all its time: its share far above rank 1's.
        assert ranks[r]["blocked_s"] > 2 * ranks[1]["blocked_s"], ranks
    assert out.count("DONE") == 3, out


@util.same_under_every_jax
def test_status_of_a_hung_job_answers_from_c_for_a_rank_holding_its_gil(tmp_path):
    """After 5 calls rank 1 holds its GIL in a C call; ranks 0 and 2 wait in the
    6th allreduce: the job is hung. Status answers within seconds for all three
    (rank 1's thread in C, its Python unable to run), says that rank 1 has the
    fewest calls (the counts stood still while read) and is waited for, where
    its Python stands, and that the others wait in allreduce #6."""
    job = Job(tmp_path, "hang")
    try:
        job.wait_for_sockets()
        time.sleep(1.0)
        start = time.monotonic()
        asked = job.status()
        took_s = time.monotonic() - start
    finally:
        out = job.end()
    assert asked.returncode == 0, asked.stderr + out
    text = asked.stdout
    assert "3 ranks; rank 0 on " in text and "3 answered" in text, text
    assert "fewest calls: rank 1 (5, the others up to 6)" in text, text
    # The others' wait in the 6th call counts as they are asked.
    assert "waited for: rank 1 (blocked in collectives" in text, text
    hang_line = f"status_job.py:{line_of('HANG LINE')} in <module>"
    assert f"  rank 1: in no call\n    Python at {hang_line}" in text, text
    assert "  ranks 0, 2: in allreduce #6 SUM float32[1]" in text, text
    # Their innermost frames are JAX's and the package's: the line is the call's.
    call_line = f"status_job.py:{line_of('allreduce(flag')} in <module>"
    assert re.search(
        rf"  ranks 0, 2: .*\n    Python at {re.escape(call_line)}$", text, re.M
    )
    assert took_s < 30, took_s
    assert out.count("DONE") == 3, out


ASKED_AND_RECEIVED_LATE = """
import os, signal, time
import jax
import mpi4jax_dist
from mpi4py import MPI
from mpi4jax_dist.faults import hangs, watchdog

jax.distributed.initialize()
comm = hangs._state.watchdog.comm  # the watchdog's: where _stacks's thread answers
first = comm.bcast(os.getpid(), root=0)
if comm.rank == 0:
    comm.Send([b"asked by the test", MPI.CHAR], 1, watchdog._TAG_ASK_C)
    time.sleep(10)  # stopped meanwhile by rank 1: no MPI progress at all here
    status = MPI.Status()
    comm.Probe(1, watchdog._TAG_REPLY_C, status)
    comm.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE], 1, status.Get_tag())
    print("RECEIVED", flush=True)
else:
    time.sleep(0.5)  # rank 0's request is sent
    os.kill(first, signal.SIGSTOP)  # an asker starved of its core
    cpu = time.process_time()
    time.sleep(7)  # this rank's thread sends its stacks within its look (3 s)
    print(f"CPU {time.process_time() - cpu:.3f}", flush=True)
    os.kill(first, signal.SIGCONT)
comm.Barrier()
"""


@util.same_under_every_jax
def test_a_rank_answering_from_c_does_not_spin_while_the_asker_is_late():
    """_stacks's thread answers a request for the stacks (and the status' request)
    without waiting in MPI_Send, which over TCP spins until the asker receives
    (tests/jobs/test_standstill.py shows the spin): rank 1's 7 s while rank 0,
    having asked, stands stopped (SIGSTOP, as if starved of its core) cost it
    little CPU (0.11 s; with MPI_Send, 4.5 s)."""
    if util.mpi_family() != "mpich":
        pytest.skip("MPICH's variables choose TCP here")
    tcp = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "MPIR_CVAR_NOLOCAL": 1}
    env = util.clean_env(MPI4JAX_NO_WARN_JAX_VERSION=1, **tcp, **util.SPIN)
    proc = util.run_mpi(["-c", ASKED_AND_RECEIVED_LATE], 2, timeout=90, env=env)
    assert "RECEIVED" in proc.stdout, proc.stdout + proc.stderr
    cpu = float(re.search(r"CPU (\d+\.\d{3})", proc.stdout).group(1))
    assert cpu < 1.0, proc.stdout
