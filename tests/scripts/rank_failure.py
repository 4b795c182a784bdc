"""How long a 2-rank job takes to end when one rank fails, with JAX's behaviour and
with mpi4jax_dist's.

    python tests/scripts/rank_failure.py [--limit 200] [--cases raise,exit3,...]
        [--runner python|mpi4py] [--json PATH]

The worker of tests/jobs/test_failfast.py, and the instrument of the figure in
docs/benchmarks-scale.rst, *When a rank fails* (a settled question, so it left
benchmarks/; it still uses benchmarks/_harness.py for its jobs and table).

Each case is one ``mpiexec -n 2`` job (this file's ``--worker CASE``) that imports
mpi4jax_dist and calls a plain ``jax.distributed.initialize()``; then rank 1 fails
while rank 0 waits for it: in JAX's backend start-up (``raise_before_backend``) or in
a jitted ``mpi4jax.allreduce`` (the others). Every case runs twice: with
``MPI4JAX_DIST_FAIL_FAST=0`` (JAX's own behaviour, which this package had before
it made failing ranks abort) and with the default. A job still running at
``--limit`` seconds is killed (its process group) and shown as ``> limit``.

Reported per case and setting: the time from ``mpiexec`` start to the end of the
job, its exit status, and the first line it printed about its end (stderr, then
stdout; the worker's own ``READY``/``RANK0 DONE``/``RANK1 FAILS`` lines left out).

``--runner mpi4py`` starts the ranks as ``python -m mpi4py``, mpi4py's recipe for
aborting on an uncaught exception.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir, "benchmarks"))
import _harness  # noqa: E402

CASES = _harness.Registry("failure case")
CASES.register("raise_before_backend", "rank 1 raises before JAX's backend starts")
CASES.register("raise", "rank 1 raises; rank 0 in mpi4jax.allreduce")
CASES.register("thread", "a thread of rank 1 raises; its main thread waits for it")
CASES.register("exit3", "rank 1 calls sys.exit(3)")
CASES.register("kill9", "rank 1 is killed with SIGKILL")
CASES.register("sigterm", "rank 1 gets SIGTERM")
CASES.register("caught_exit", "rank 1 catches its own sys.exit(2); no failure")
CASES.register("raise_after", "rank 1 raises after the allreduce; nobody waits")
CASES.register("ok", "nothing fails")
CASES.register("exit0", "rank 1 calls sys.exit(0); rank 0 in mpi4jax.allreduce")
CASES.register("os_exit0", "rank 1 calls os._exit(0); rank 0 in mpi4jax.allreduce")
CASES.register(
    "os_exit0_early", "rank 1 calls os._exit(0) at its end; rank 0 works 3 s more"
)
CASES.register(
    "os_exit0_cleanup_fails",
    "rank 1 calls os._exit(0) at its end, and its clean-up (JAX's shutdown) fails",
)
CASES.register("fork_os_exit0", "a forked child of rank 1 ends by os._exit(0)")
# What the table shows by default: the failures, and one job that does not fail.
DEFAULT_CASES = ("raise_before_backend", "raise", "thread", "exit3", "kill9")
DEFAULT_CASES += ("sigterm", "ok")

SETTINGS = {"JAX's": "0", "mpi4jax_dist": "1"}  # MPI4JAX_DIST_FAIL_FAST


def worker(case: str) -> None:
    """One job of 2 ranks in which rank 1 fails as ``case`` says.

    Rank 0 prints ``RANK0 DONE`` once through its allreduce, which it gets only
    when rank 1 did not fail first. Every rank prints ``READY <rank> <SIGTERM
    caught>`` once JAX's backend is up, the last from the kernel's record of this
    process's signal handlers (C or Python). Rank 1 prints ``RANK1 FAILS AT <t>``
    (``time.monotonic()``, one clock for every process of a machine) just before
    it fails: the tests time the job's end from there, not from a start-up that
    a loaded machine makes slow.
    """
    import jax
    import jax.numpy as jnp

    if case == "os_exit0_early":
        # Rank 0's work at its exit (rank 1 leaves by os._exit), after the ranks
        # meet there (atexit runs this after mpi4jax_dist's handler, before JAX's).
        atexit.register(lambda: (time.sleep(1), _say("EXIT WORK DONE")))
    import mpi4jax_dist  # noqa: F401  (registers the cluster env)

    jax.distributed.initialize(initialization_timeout=60)

    import mpi4jax
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    allreduce = jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM))

    def fail():
        raise ValueError(f"rank {rank} failed on purpose")

    if case == "raise_before_backend" and rank == 1:
        _failing()
        fail()
    x = jnp.ones(4)  # starts the backend
    _say(f"READY {rank} {_sigterm_caught()}")
    if rank == 1:
        _failing()
        if case == "raise":
            fail()
        elif case == "thread":
            result = []
            worker = threading.Thread(target=lambda: result.append(fail()))
            worker.start()
            worker.join()
            while not result:  # a main thread that waits for its worker's answer
                threading.Event().wait(0.1)
        elif case == "exit3":
            sys.exit(3)
        elif case == "kill9":
            os.kill(os.getpid(), signal.SIGKILL)
        elif case == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(3600)  # if the signal does not end this process
        elif case == "exit0":
            sys.exit(0)
        elif case == "os_exit0":
            os._exit(0)
        elif case == "fork_os_exit0":
            start = time.monotonic()
            child = os.fork()
            if child == 0:
                os._exit(0)  # the child's: not the rank's exit
            os.waitpid(child, 0)
            _say(f"CHILD ENDED {time.monotonic() - start:.1f}")
        elif case == "caught_exit":
            try:
                sys.exit(2)
            except SystemExit:
                pass
    total = allreduce(x)
    total.block_until_ready()
    if rank == 0:
        _say(f"RANK0 DONE {float(total[0])}")
    if rank == 1 and case == "raise_after":
        fail()
    if case in ("os_exit0_early", "os_exit0_cleanup_fails"):
        if rank == 1:
            if case == "os_exit0_cleanup_fails":
                jax.distributed.shutdown = _fail_to_shut_down
            _failing()
            os._exit(0)
        time.sleep(3)  # work the launcher would cut short
        _say(f"RANK{rank} LATE DONE")


def _fail_to_shut_down() -> None:
    raise RuntimeError("the coordination service is gone (injected)")


def _failing() -> None:
    _say(f"RANK1 FAILS AT {time.monotonic():.3f}")


def _say(text: str) -> None:
    # One write per line, so that the two ranks' lines do not interleave.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _sigterm_caught() -> bool:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


# mpi4jax warns at import where JAX is newer than it knows (0.9.1.post2: past
# 0.11.2), a line about the start and not the end the jobs here are judged by.
QUIET = {"MPI4JAX_NO_WARN_JAX_VERSION": "1"}


def first_line(stdout: str, stderr: str) -> str:
    """The first line a job printed about its end: stderr first (where the ranks
    write), then stdout (where MPICH's mpiexec writes); rules, blanks and the
    worker's progress lines skipped."""
    for text in (stderr, stdout):
        for line in text.splitlines():
            line = line.strip("=- \t\0")
            if line and not line.startswith(("READY", "RANK0 DONE", "RANK1 FAILS")):
                return line
    return ""


def run_case(case: str, setting: str, limit: float, runner: str) -> dict:
    env = dict(os.environ, MPI4JAX_DIST_FAIL_FAST=SETTINGS[setting])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env = {**QUIET, **env}
    python_args = ["-m", "mpi4py"] if runner == "mpi4py" else []
    job = _harness.run_job(
        2,
        [*python_args, os.path.abspath(__file__), "--worker", case],
        timeout=limit,
        env=env,
    )
    killed = job.returncode is None
    return {
        "case": case,
        "setting": setting,
        "runner": runner,
        "ended_s": None if killed else job.seconds,
        "killed_at_s": limit if killed else None,
        "exit": job.returncode,
        "rank0_done": "RANK0 DONE" in job.stdout,
        "first_line": first_line(job.stdout, job.stderr.split("\n(killed after")[0]),
    }


def _ended(row: dict) -> str:
    if row["ended_s"] is None:
        return f"> {row['killed_at_s']:g} s"
    return f"{row['ended_s']:.1f} s"


TABLE = _harness.Table(
    [
        _harness.Column("case", "case", "", 20, left=True),
        _harness.Column("setting", "behaviour", "", 12, left=True),
        _harness.Column("ended", "job ended", "after", 10),
        _harness.Column("exit", "exit", "status", 6),
        _harness.Column("first_line", "first line printed", "", 0, left=True),
    ]
)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--limit", type=float, default=200, help="seconds before a job is killed"
    )
    CASES.option(parser, "--cases", DEFAULT_CASES)
    parser.add_argument("--runner", choices=("python", "mpi4py"), default="python")
    args = _harness.parse_or_work(parser, argv, worker)
    if args is None:
        return []
    cases = args.cases

    launch = "python -m mpi4py" if args.runner == "mpi4py" else "python"
    print(
        f"# mpiexec -n 2 {launch} {os.path.basename(__file__)} --worker CASE; "
        f"killed at {args.limit:g} s"
    )
    print("# behaviour: JAX's (MPI4JAX_DIST_FAIL_FAST=0) or mpi4jax_dist's (default)")
    print(TABLE.header(), flush=True)
    results = []
    for case in cases:
        for setting in SETTINGS:
            row = run_case(case, setting, args.limit, args.runner)
            row["ended"] = _ended(row)
            results.append(row)
            print(TABLE.row(row), flush=True)
    _harness.save(args, _harness.meta(limit_s=args.limit, runner=args.runner), results)
    return results


if __name__ == "__main__":
    main()
