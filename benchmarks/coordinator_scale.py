"""JAX's coordination service at P = 64 ... 4,096 processes, emulated in one process.

    python benchmarks/coordinator_scale.py [--procs 64,256,1024,2048,4096]
        [--waves 0,256,1024/200] [--repeat 3] [--timeout 180] [--init-timeout S]
        [--json PATH]

Every run is a fresh subprocess (its own session, killed at ``--timeout``) that
starts one real coordination service (jaxlib's ``get_distributed_runtime_service``,
as rank 0's ``jax.distributed.initialize`` does) and P clients, each ``connect()``
from a thread of its own to its own loopback address ``127.x.y.z:PORT``, so that
gRPC gives each its own TCP connection, as P processes would have (every connection
is loopback). The soft open-file limit is first raised as the package does for a
rank 0 (``limits.ensure_file_limit``), for ``2 * P``: this process holds both ends.
Measured per run: ``connect`` (first ``connect()`` to the last return: a barrier
over all P), ``issued``, ``shutdown``, this process's open files and the service's
sockets, RSS, and the kernel's TCP counters (a burst of SYNs beyond the listen
backlog shows in ListenOverflows). ``--waves W`` or ``W/GAP_MS`` (default gap 100
ms): client ``i`` starts at ``(i // W) * gap``; ``0`` is the burst.
docs/benchmarks-scale.rst, *JAX's coordination service*, gives the runs; settled
questions: docs/benchmarks-settled.rst.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

from mpi4jax_dist.launch import limits  # noqa: E402

NETSTAT_KEYS = ("ListenOverflows", "ListenDrops", "TCPSynRetrans")
# How long past its init_timeout a connect() may take before it counts as failed
# (jaxlib 0.6.0's can wait on for good).
CONNECT_GRACE_S = 10
GAP_MS = 100.0  # between waves, unless --waves says W/GAP_MS
SHUTDOWN_TIMEOUT_S = 60


# --- The worker: one run in a fresh process -------------------------------------------


def client_address(index: int, port: int) -> str:
    """Return client ``index``'s own loopback ``127.x.y.z:port`` (z in 1..254, so
    that no address ends in .0 or .255; 254 * 256 clients per x)."""
    z = 1 + index % 254
    y = (index // 254) % 256
    x = 1 + index // (254 * 256)
    if x > 255:
        raise ValueError(f"no loopback address for client {index}")
    return f"127.{x}.{y}.{z}:{port}"


def free_port() -> int:
    """Return a TCP port the kernel had free (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def service_sockets(port: int) -> dict[str, int] | None:
    """Return this process's TCP sockets whose local port is ``port`` (psutil, from
    its open files: the kernel's queued connections are not among them):
    ``accepted`` (ESTABLISHED: the service's ends) and ``listening``. None when they
    cannot be read (at the open-file limit even /proc cannot be opened)."""
    import psutil

    try:
        found = psutil.Process().net_connections(kind="tcp")
    except (OSError, psutil.Error):
        return None
    states = [c.status for c in found if c.laddr and c.laddr.port == port]
    return {
        "accepted": states.count(psutil.CONN_ESTABLISHED),
        "listening": states.count(psutil.CONN_LISTEN),
    }


def open_files() -> int | None:
    """Return how many file descriptors this process has open (None where they
    cannot be counted: the limit is reached)."""
    import psutil

    try:
        return psutil.Process().num_fds()
    except (OSError, psutil.Error):
        return None


def netstat() -> dict[str, int]:
    """Return the TcpExt counters of :data:`NETSTAT_KEYS` (empty where unreadable)."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return {k: int(row[k]) for k in NETSTAT_KEYS if k in row}
    return {}


def mib(n: int) -> float:
    return n / 2**20


def worker(config: dict) -> None:
    """One run: a service and ``procs`` clients; prints one ``RESULT`` line, then
    ends the process at once (a failed client must not be left to its destructor)."""
    procs, waves = config["procs"], config["waves"]
    gap = config["gap_ms"] / 1e3
    row = {"procs": procs, "waves": waves, "gap_ms": config["gap_ms"] if waves else 0}
    try:
        _run(config, row, procs, waves, gap)
    except Exception as err:  # reported in the row, never a traceback
        row.update(ok=False, error=f"{type(err).__name__}: {err}")
    _harness.report(**row)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(config: dict, row: dict, procs: int, waves: int, gap: float) -> None:
    from mpi4jax_dist import _compat

    runtime = _compat.distributed_runtime()

    # Both ends of every connection are in this process: 2 files per client.
    limits.ensure_file_limit(2 * procs)
    threading.stack_size(256 * 1024)
    rss0, _ = _harness.rss_bytes()
    port = free_port()
    init_timeout = int(config["init_timeout"])
    service = runtime.get_distributed_runtime_service(
        f"0.0.0.0:{port}",
        procs,
        **_compat.runtime_heartbeat(100),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    # JAX's default for a client that hears of a fatal error (a failed peer, a
    # missed heartbeat, a failed connect) terminates the process. A Python callback
    # keeps it alive: jaxlib 0.10 cannot pass it the status (connect() then raises
    # RuntimeError("std::bad_cast")), so the client's status is read from its log
    # ("Agent status: ...") by the parent.
    fatal: list[str] = []

    def on_fatal(*status) -> None:
        fatal.append(" ".join(map(str, status)))

    clients = [
        runtime.get_distributed_runtime_client(
            client_address(i, port),
            i,
            init_timeout=init_timeout,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            **_compat.runtime_heartbeat(100),
            missed_heartbeat_callback=on_fatal,
            shutdown_on_destruction=False,
            use_compression=True,
        )
        for i in range(procs)
    ]
    net0 = netstat()

    start = threading.Event()
    t0 = [0.0]
    issued = [None] * procs
    done = [None] * procs
    errors: dict[int, str] = {}

    def connect(i: int) -> None:
        start.wait()
        delay = (i // waves) * gap if waves else 0.0
        if delay:
            time.sleep(max(0.0, t0[0] + delay - time.perf_counter()))
        issued[i] = time.perf_counter()
        try:
            clients[i].connect()
        except Exception as err:
            errors[i] = f"{type(err).__name__}: {err}"
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(procs)]
    for t in threads:
        t.start()

    t0[0] = time.perf_counter()
    start.set()
    last_issue = ((procs - 1) // waves) * gap if waves else 0.0
    give_up = t0[0] + last_issue + init_timeout + CONNECT_GRACE_S
    waiting = []
    for i, t in enumerate(threads):
        t.join(max(0.0, give_up - time.perf_counter()))
        if t.is_alive():
            waiting.append(i)
            errors.setdefault(i, "connect() still waiting")
            done[i] = time.perf_counter()
    t1 = max(done)
    row["connect_s"] = t1 - t0[0]
    row["issued_s"] = max(issued) - t0[0]
    row["fds"] = open_files()
    counts = service_sockets(port) or {}
    row["service_conns"] = counts.get("accepted")
    row["service_fds"] = counts["accepted"] + counts["listening"] if counts else None
    try:  # at the open-file limit even /proc/self/status cannot be opened
        rss1, _ = _harness.rss_bytes()
        row["rss_mib"] = mib(rss1)
        row["rss_per_client_kib"] = (rss1 - rss0) / procs / 1024
    except OSError:
        pass
    row["fatal_callbacks"] = len(fatal)
    net1 = netstat()
    row["tcp_counters"] = {k: net1[k] - net0.get(k, 0) for k in net1}
    if errors:
        first = min(errors)
        row.update(
            ok=False,
            failed_clients=len(errors),
            error=f"{len(errors)}/{procs} clients failed after "
            f"{row['connect_s']:.1f} s; client {first}: {errors[first]}"[:300],
        )
        if waiting:
            row["error"] += (
                f"; {len(waiting)} still in connect() {CONNECT_GRACE_S} s past "
                f"init_timeout"
            )
        return

    # Shutdown: every client's (a barrier over all), then the service's.
    done_shut = [None] * procs

    def shut(i: int) -> None:
        try:
            clients[i].shutdown()
        except Exception as err:
            errors[i] = f"{type(err).__name__}: {err}"
        done_shut[i] = time.perf_counter()

    threads = [threading.Thread(target=shut, args=(i,)) for i in range(procs)]
    s0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    service.shutdown()
    row["shutdown_s"] = time.perf_counter() - s0
    if errors:
        first = min(errors)
        row.update(
            ok=False,
            error=f"shutdown: {len(errors)}/{procs} clients failed; client "
            f"{first}: {errors[first]}"[:400],
        )
        return
    row["ok"] = True


# --- The parent: one subprocess per run -----------------------------------------------


def worker_env() -> dict:
    """This environment for a run: JAX on CPU, no proxies (gRPC would use them)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")
    }
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", no_grpc_proxy="*")
    return env


def run_one(config: dict, timeout: float) -> dict:
    """Run one worker in a fresh process of its own session, killed at ``timeout``.
    Return its row (a failed one when it printed none)."""
    argv = [os.path.abspath(__file__), "--worker", json.dumps(config)]
    job = _harness.run_job(0, argv, timeout=timeout, env=worker_env())
    if job.results:
        row = job.results[0]
    else:
        row = {k: config[k] for k in ("procs", "waves")}
        why = "killed" if job.returncode is None else f"exit {job.returncode}"
        tail = (job.stdout + job.stderr).strip().splitlines()[-3:]
        row.update(ok=False, error=f"no result ({why}): " + " | ".join(tail)[-300:])
    row["run_s"] = job.seconds
    if not row.get("ok"):
        status = re.search(r"Agent status: (?:%s)?([A-Z_]+: [^\n\[]{0,80})", job.stderr)
        if status:
            row["error"] += f"; client status {status.group(1).strip()}"
    return row


def case_name(waves: int, gap_ms: float) -> str:
    return "burst" if waves == 0 else f"waves {waves}/{gap_ms:g}ms"


def _s(value) -> str:
    return f"{value:.3f}"


TABLE = _harness.Table(
    [
        _harness.Column("case", "case", "", 17, left=True),
        _harness.Column("procs", "P", "", 5, "d"),
        _harness.Column("connect_s", "connect", "median s", 8, _s),
        _harness.Column("connect_max_s", "connect", "max s", 8, _s),
        _harness.Column("ratio", "ratio", "to burst", 8, ".2f"),
        _harness.Column("issued_s", "issued", "median s", 8, _s),
        _harness.Column("shutdown_s", "shutdown", "median s", 8, _s),
        _harness.Column("fds", "fds", "process", 7, "d"),
        _harness.Column("service_fds", "service", "fds", 7, "d"),
        _harness.Column("rss_mib", "RSS", "MiB", 7, ".0f"),
        _harness.Column("rss_per_client_kib", "RSS/cl", "KiB", 6, ".0f"),
        _harness.Column("overflows", "listen", "ovfl", 6, "d"),
        _harness.Column("status", "status", "ok/runs", 8, left=True),
    ]
)


def summarize(runs: list[dict], case: str, procs: int) -> dict:
    """One table row from a setting's runs: medians over the ok runs."""
    good = [r for r in runs if r.get("ok")]
    first = runs[0]
    row = {
        "case": case,
        "procs": procs,
        "waves": first["waves"],
        "gap_ms": first.get("gap_ms", 0),
        "ok": len(good) == len(runs),
        "status": f"{'ok' if len(good) == len(runs) else 'FAILED'} {len(good)}/"
        f"{len(runs)}",
        "errors": [r["error"] for r in runs if not r.get("ok")],
        "runs": runs,
    }
    for key in ("connect_s", "issued_s", "shutdown_s", "rss_mib", "rss_per_client_kib"):
        values = [r[key] for r in good if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    values = [r["connect_s"] for r in good]
    row["connect_max_s"] = max(values) if values else None
    for key in ("fds", "service_fds", "service_conns"):
        values = [r[key] for r in runs if r.get(key) is not None]
        row[key] = max(values) if values else None
    row["overflows"] = max(
        (r.get("tcp_counters", {}).get("ListenOverflows", 0) for r in runs),
        default=None,
    )
    return row


def parse_waves(text: str, gap_ms: float = GAP_MS) -> list[tuple[int, float]]:
    """Return ``(W, gap in ms)`` from ``0,256,1024/400``: a wave size, with its own
    gap after a slash (else ``gap_ms``); 0 is the burst."""
    waves = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        size, _, gap = item.partition("/")
        try:
            waves.append((int(size), float(gap) if gap else gap_ms))
        except ValueError:
            raise ValueError(
                f"--waves {text!r}: {item!r} is not W or W/GAP_MS"
            ) from None
        if waves[-1][0] < 0 or waves[-1][1] < 0:
            raise ValueError(f"--waves {text!r}: {item!r} is negative")
    if not waves:
        raise ValueError(f"--waves {text!r}: no wave size")
    return [(w, 0.0 if w == 0 else g) for w, g in waves]


def main(argv=None) -> list[dict]:
    """Run every setting ``--repeat`` times (round-robin); return one row each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--procs", type=_harness.ints, default="64,256,1024,2048,4096", help="P values"
    )
    parser.add_argument(
        "--waves",
        default="0,256,1024",
        help="wave sizes W or W/GAP_MS, comma-separated; 0: burst",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per run")
    parser.add_argument(
        "--init-timeout",
        type=int,
        default=60,
        help="clients' init_timeout [s]; default 60",
    )
    args = _harness.parse_or_work(parser, argv, lambda arg: worker(json.loads(arg)))
    if args is None:
        return []
    try:
        waves_list = parse_waves(args.waves)
    except ValueError as err:
        parser.error(str(err))
    init_timeout = args.init_timeout

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            somaxconn = int(f.read())
    except OSError:
        somaxconn = None
    print(
        f"# one coordination service and P clients in one process, each client on "
        f"its own loopback address; median of {args.repeat} run(s) per setting"
    )
    print(
        f"# open files: soft {soft}, hard {hard}; somaxconn {somaxconn}; "
        f"init_timeout {init_timeout} s; run timeout {args.timeout:g} s; "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "# connect: first connect() to last return (register barrier); issued: last "
        "connect() called; fds: whole process (both ends); "
        "service fds: its established connections + listening socket(s)"
    )
    print(TABLE.header(), flush=True)
    results = []
    for procs in args.procs:
        runs: dict[tuple, list[dict]] = {w: [] for w in waves_list}
        for _ in range(args.repeat):
            for waves in waves_list:
                config = {
                    "procs": procs,
                    "waves": waves[0],
                    "gap_ms": waves[1],
                    "init_timeout": init_timeout,
                }
                runs[waves].append(run_one(config, args.timeout))
        burst = runs.get((0, 0.0))
        base = summarize(burst, "", procs)["connect_s"] if burst else None
        for waves in waves_list:
            row = summarize(runs[waves], case_name(*waves), procs)
            row["ratio"] = (
                row["connect_s"] / base if base and row["connect_s"] else None
            )
            results.append(row)
            print(TABLE.row(row), flush=True)
            for error in dict.fromkeys(row["errors"]):
                print(f"#   error: {error}", flush=True)
    _harness.save(
        args,
        _harness.meta(
            repeat=args.repeat,
            somaxconn=somaxconn,
            file_limits=[soft, hard],
            init_timeout=init_timeout,
        ),
        results,
    )
    return results


if __name__ == "__main__":
    main()
