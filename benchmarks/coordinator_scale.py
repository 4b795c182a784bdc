"""JAX's coordination service at P = 64 ... 4,096 processes, emulated in one process.

    python benchmarks/coordinator_scale.py [--procs 64,256,1024,2048,4096]
        [--waves 0,256,1024] [--gap-ms 100] [--repeat 3] [--timeout 180]
        [--soft-limit N] [--protection on|off|off,on] [--init-timeout S]
        [--exchange [PLATFORM:]BYTES[,...] [--gather-threads N]]
        [--json PATH] [--plot PNG]

Every run is a fresh subprocess (its own session, killed at ``--timeout``) that
starts one real coordination service (jaxlib's ``get_distributed_runtime_service``,
as ``jax.distributed.initialize`` does on rank 0) and P clients
(``get_distributed_runtime_client``), each ``connect()`` called from a thread of its
own. Client ``i`` connects to its own loopback address ``127.x.y.z:PORT``, so that
gRPC, which shares one connection between channels to the same address, gives each
its own TCP connection, as P processes would have. The service therefore listens on
``0.0.0.0:PORT`` (a kernel-chosen free port) for the run's few seconds; every
connection made is loopback.

Measured per run:

- ``connect``: from the start of the first ``connect()`` until the last one has
  returned. ``connect()`` registers the client and is a barrier over all P, so this
  is the time to register the whole job. ``issued``: until the last client's
  ``connect()`` was called (waking 4,096 threads is not free). (Sampling
  /proc/net/tcp while clients connect is no cheaper way: one read costs about 25 ms
  of kernel time at 4,096 clients, and sampling every 100 ms slowed the burst's
  connect from 3.3 s to 8.3 s.)
- ``shutdown``: every client's ``shutdown()`` (also a barrier over all P), then the
  service's.
- ``fds``: this process's open files (``/proc/self/fd``) at the peak, after connect;
  both ends live in this process, so this is about twice a real rank 0's.
- ``service fds``: the service side's file descriptors, counted as the ESTABLISHED
  TCP sockets in /proc/net/tcp and /proc/net/tcp6 whose *local* port is the
  service's port and whose inode is one of this process's open sockets (so
  accepted; the kernel's queued, not yet accepted ones have inode 0 and no file
  descriptor), plus its listening socket(s). That is what a real rank 0 holds for
  the service; the clients' ends have the service's port as their remote port.
- ``RSS``: this process's resident memory after connect and its growth from before
  the service started (clients, threads and service together).
- the kernel's TCP counters over the run (ListenOverflows, ListenDrops,
  TCPSynRetrans from /proc/net/netstat; per network namespace, so another program's
  traffic counts too): a burst of SYNs beyond the listen backlog shows here.

Waves (``--waves W``, W > 0): client ``i`` starts its ``connect()`` at
``(i // W) * gap`` after the first, a fixed stagger by rank that an MPI job could
apply to its released ranks without any feedback from the service; ``0`` is the
burst, all at once. ``--gap-ms`` sets the gap.

Topology exchange (``--exchange BYTES``): after connect, the clients do what PJRT's
CPU client does at start-up (XLA's ExchangeTopologies): every client puts a local
topology of BYTES (random: gRPC's compression cannot shrink it) under
``cpu:local_topology/cpu/<i>``; client 0 gets all P of them (``--gather-threads``
blocking gets at a time, default the CPUs, as XLA's thread pool) and puts the
global one (each local one framed as a GlobalTopologyProto node: P * (BYTES + 2 or
3)) under ``cpu:global_topology/cpu``; every client then gets it (in JAX all but
process 0 do). Timed per phase (``put_s``, ``gather_s``, ``global_put_s``,
``fetch_s``), with every fetched size checked, the bytes the service's sockets sent
(``ss``'s bytes_sent) against the payload (P * BYTES + P * global), and the
process's peak RSS growth over the exchange (service and all P clients together:
this emulation holds both ends). A real CPU process's local topology is 69-80 B at
P = 2 or 4 (one device; 69 for process 0, whose node_id 0 is not serialized), about
88 B at P = 4,096. ``--exchange PLATFORM:BYTES,...`` makes one exchange per
platform, in that order, under that platform's keys (``cuda:local_topology/cuda/<i>``),
as JAX does for each backend it starts (the CPU one first): ``cpu:88,cuda:110`` is a
GPU process without ``JAX_PLATFORMS``. Each platform's figures are kept under
``<platform>.<key>``, their sums under the plain keys. A GPU process's local topology
is an estimate (no GPU here): about 40 B and 70 B per GPU
(``mpi4jax_dist.launch.limits.GPU_LOCAL_TOPOLOGY_BYTES``).
``tests/unit/test_topology_model.py`` fits the package's model to these runs.

File limits: ``--soft-limit N`` lowers this process's soft RLIMIT_NOFILE to N before
anything starts. With ``--protection on`` the run then calls the package's
protection, :func:`mpi4jax_dist.launch.limits.ensure_file_limit`, before the service
starts; ``off`` does not. The protection's rule is one file per process of the job
plus a margin, for a rank 0 that holds the service's ends of the connections; this
emulation also holds the clients' ends, one more file per client, so it asks for
``2 * P`` processes' worth (2 P + margin), the same rule applied to a process that
holds both ends. Too few files make gRPC log "File descriptor limit reached.
Retrying." and every ``connect()`` fail with DEADLINE_EXCEEDED after
``--init-timeout`` (+ about 5 s): such a row is reported failed, with the error.
(jaxlib 0.6.0's gRPC logs "Too many open files" instead, and a ``connect()`` there
may wait on for good: 10 s past ``--init-timeout`` it counts as failed.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

from mpi4jax_dist.launch import limits  # noqa: E402

TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"
NETSTAT_KEYS = ("ListenOverflows", "ListenDrops", "TCPSynRetrans")
# What gRPC logs when the files run out: current jaxlib's words, and jaxlib 0.6.0's
# (a failed accept4).
FD_LIMIT_LOGS = ("File descriptor limit reached", "Too many open files")
# How long past its init_timeout a connect() may take before it counts as failed:
# jaxlib 0.6.0's can wait on for good when the service has run out of files.
CONNECT_GRACE_S = 10


# ---------------------------------------------------------------------------------
# The worker: one run in a fresh process


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
    """Return the TCP sockets whose local port is ``port``, from /proc/net/tcp and
    /proc/net/tcp6: ``accepted`` (ESTABLISHED and open in this process: the
    service's file descriptors, matched by inode), ``queued`` (ESTABLISHED by the
    kernel but not yet accepted: inode 0, no file descriptor yet) and ``listening``
    (LISTEN sockets of this process). None when the tables cannot be read (with the
    open-file limit reached, even /proc cannot be opened)."""
    wanted = f":{port:04X}"
    ours = socket_inodes()
    if ours is None:
        return None
    counts = {"accepted": 0, "queued": 0, "listening": 0}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if not fields[1].endswith(wanted):
                        continue
                    inode = fields[9]
                    if fields[3] == TCP_ESTABLISHED:
                        if inode == "0":
                            counts["queued"] += 1
                        elif inode in ours:
                            counts["accepted"] += 1
                    elif fields[3] == TCP_LISTEN and inode in ours:
                        counts["listening"] += 1
        except FileNotFoundError:  # no IPv6
            continue
        except OSError:
            return None
    return counts


def socket_inodes() -> set[str] | None:
    """Return the inodes of this process's open sockets; None when unreadable."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return None
    return inodes


def open_files() -> int | None:
    """Return how many file descriptors this process has open (None when even
    /proc/self/fd cannot be opened: the limit is reached)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
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
    row["protection"] = config["protection"]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if config.get("soft_limit"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (config["soft_limit"], hard))
    row["soft_limit"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
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

    if config["protection"] == "on":
        # Both ends of every connection are in this process: 2 files per client.
        raised = limits.ensure_file_limit(2 * procs)
        row["raised_from"] = raised[0] if raised else None
    row["soft_limit_run"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    threading.stack_size(256 * 1024)
    rss0, _ = _harness.rss_bytes()
    fds0 = open_files()
    port = free_port()
    init_timeout = int(config["init_timeout"])
    service = runtime.get_distributed_runtime_service(
        f"0.0.0.0:{port}",
        procs,
        **_compat.runtime_heartbeat(100),
        shutdown_timeout=int(config["shutdown_timeout"]),
    )
    # JAX's default for a client that hears of a fatal error (a failed peer, a
    # missed heartbeat, a failed connect) terminates the process. A Python callback
    # keeps it alive: jaxlib 0.10 cannot pass it the status (connect() then raises
    # RuntimeError("std::bad_cast")), so the client's status is read from its log
    # ("Agent status: ...") by the parent.
    fatal: list[str] = []

    def on_fatal(*status) -> None:
        fatal.append(" ".join(map(str, status)))

    t_create = time.perf_counter()
    clients = [
        runtime.get_distributed_runtime_client(
            client_address(i, port),
            i,
            init_timeout=init_timeout,
            shutdown_timeout=int(config["shutdown_timeout"]),
            **_compat.runtime_heartbeat(100),
            missed_heartbeat_callback=on_fatal,
            shutdown_on_destruction=False,
            use_compression=True,
        )
        for i in range(procs)
    ]
    row["create_s"] = time.perf_counter() - t_create
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
    row["fds_before"] = fds0
    counts = service_sockets(port) or {}
    row["service_conns"] = counts.get("accepted")
    row["service_queued"] = counts.get("queued")
    row["service_fds"] = counts["accepted"] + counts["listening"] if counts else None
    row["rss_before_mib"] = mib(rss0)
    try:  # at the open-file limit even /proc/self/status cannot be opened
        rss1, hwm = _harness.rss_bytes()
        row["rss_mib"], row["hwm_mib"] = mib(rss1), mib(hwm)
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

    if config.get("exchange"):
        if not exchange(config, row, clients, port, procs):
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
    s1 = max(done_shut)
    service.shutdown()
    s2 = time.perf_counter()
    row["shutdown_s"] = s2 - s0
    row["service_shutdown_s"] = s2 - s1
    row["fds_after"] = open_files()
    if errors:
        first = min(errors)
        row.update(
            ok=False,
            error=f"shutdown: {len(errors)}/{procs} clients failed; client "
            f"{first}: {errors[first]}"[:400],
        )
        return
    row["ok"] = True


# ---------------------------------------------------------------------------------
# The topology exchange (--exchange BYTES)

# The keys a PJRT client uses: its key-value store prefixes "<platform>:", and
# XLA's ExchangeTopologies names the keys by the platform too. The CPU client's were
# read from a real 2-process run of jax.distributed.initialize() with jaxlib 0.10.2;
# a GPU plugin's ("cuda:") follow the same rule (not run here: no GPU).
LOCAL_KEY = "{platform}:local_topology/{platform}/{index}"
GLOBAL_KEY = "{platform}:global_topology/{platform}"
EXCHANGE_PHASES = ("put", "gather", "global_put", "fetch")


def parse_exchange(value) -> list[tuple[str, int]]:
    """``--exchange``'s value as ``[(platform, bytes), ...]``: ``88`` is the CPU
    client's alone; ``cpu:88,cuda:110`` is one exchange per platform, in that order
    (JAX initializes its backends one after another, the CPU one first)."""
    if isinstance(value, int):
        return [("cpu", value)] if value else []
    pairs = []
    for item in (t.strip() for t in str(value).split(",")):
        if not item:
            continue
        platform, _, size = item.rpartition(":")
        platform = platform or "cpu"
        try:
            pairs.append((platform, int(size)))
        except ValueError:
            raise ValueError(
                f"--exchange {value!r}: {item!r} is not BYTES or PLATFORM:BYTES"
            ) from None
        if pairs[-1][1] <= 0 or not re.fullmatch(r"[a-z0-9_]+", platform):
            raise ValueError(
                f"--exchange {value!r}: {item!r} needs a platform name of lower-case "
                f"letters, digits or _ (as JAX's: cpu, cuda, rocm) and a positive byte "
                f"count"
            )
    if len({p for p, _ in pairs}) != len(pairs):
        raise ValueError(f"--exchange {value!r}: a platform appears twice")
    return pairs


# The global topology's size, as the package's model counts it; the exchange checks
# it against the one it builds with frame().
global_size = limits.global_topology_bytes


def frame(value: bytes) -> bytes:
    """``value`` as one ``nodes`` entry (field 1) of a GlobalTopologyProto."""
    n, length = len(value), bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    return b"\x0a" + bytes(length) + value


def service_bytes_sent(port: int) -> int | None:
    """Bytes the service's ESTABLISHED sockets (local port ``port``) have sent, from
    ``ss -tin`` (bytes_sent, retransmissions included); None without ss."""
    try:
        out = subprocess.run(
            ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.findall(r"\bbytes_sent:(\d+)", out)
    return sum(map(int, found)) if found else None


def _all_clients(procs: int, call) -> tuple[float, dict[int, str]]:
    """Run ``call(i)`` for every client, each from a thread of its own, released
    together; return the seconds until the last returned, and the errors."""
    start = threading.Event()
    done = [0.0] * procs
    errors: dict[int, str] = {}

    def one(i: int) -> None:
        start.wait()
        try:
            call(i)
        except Exception as err:
            errors[i] = f"{type(err).__name__}: {err}"
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(procs)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    return max(done) - t0, errors


# What one platform's exchange records; the row also holds their sums over the
# platforms under the same names, but for the clients that fetched the right size
# (the fewest) and the peak RSS (the largest).
EXCHANGE_KEYS = (
    "put_s",
    "gather_s",
    "global_put_s",
    "fetch_s",
    "exchange_s",
    "exchange_local_bytes",
    "exchange_global_bytes",
    "exchange_payload_bytes",
    "service_sent_bytes",
    "exchange_fetched_bytes",
    "exchange_fetched_ok",
    "exchange_rss_mib",
    "exchange_peak_mib",
)
EXCHANGE_SUMS = tuple(
    k for k in EXCHANGE_KEYS if k not in ("exchange_fetched_ok", "exchange_peak_mib")
)


def exchange(config: dict, row: dict, clients: list, port: int, procs: int) -> bool:
    """What PJRT's clients do at start-up, after connect, one platform after
    another (``config["exchange"]``, see :func:`parse_exchange`): each platform's
    exchange is recorded in ``row`` under ``"<platform>.<key>"``, and their sums
    under the plain keys. Return False (``row`` failed) on an error."""
    platforms = parse_exchange(config["exchange"])
    row["exchange_platforms"] = [p for p, _ in platforms]
    records, failed = [], None
    for platform, local in platforms:
        record, errors = exchange_platform(
            config, clients, port, procs, platform, local
        )
        records.append(record)
        row.update({f"{platform}.{k}": v for k, v in record.items()})
        if errors:
            failed = platform, errors
            break
    for key in EXCHANGE_SUMS:
        values = [r.get(key) for r in records]
        row[key] = None if None in values else sum(values)
    fetched_ok = [r.get("exchange_fetched_ok") for r in records]
    row["exchange_fetched_ok"] = None if None in fetched_ok else min(fetched_ok)
    peaks = [r["exchange_peak_mib"] for r in records]
    row["exchange_peak_mib"] = None if None in peaks else max(peaks)
    if failed:
        platform, errors = failed
        first = next(iter(errors))
        row.update(
            ok=False,
            failed_clients=len(errors),
            error=f"exchange {platform}: {len(errors)} failed; {first}: "
            f"{errors[first]}"[:400],
        )
        return False
    return True


def exchange_platform(
    config: dict, clients: list, port: int, procs: int, platform: str, local: int
) -> tuple[dict, dict[str, str]]:
    """One platform's exchange, as XLA's ExchangeTopologies does it: every client
    puts its local topology (``local`` bytes, random so that gRPC's compression
    cannot shrink it), client 0 gets all P (``config["gather_threads"]`` blocking
    gets at a time; default: the CPUs, as XLA) and puts the global one (each local
    one framed as a GlobalTopologyProto's node), every client gets the global one.
    Each phase is timed; the fetched sizes are checked. Return the record and the
    errors by ``"<phase> <client>"``."""
    timeout_ms = int(config.get("exchange_timeout", 120)) * 1000
    local_key, global_key = LOCAL_KEY, GLOBAL_KEY.format(platform=platform)
    expected = global_size(procs, local)
    record: dict = {
        "exchange_local_bytes": local,
        "exchange_global_bytes": expected,
    }
    values = [os.urandom(local) for _ in range(procs)]
    times, failures = {}, {}
    rss0, _ = _harness.rss_bytes()
    record["exchange_peak_reset"] = _harness.reset_peak_rss()
    sent0 = service_bytes_sent(port)

    def key(i: int) -> str:
        return local_key.format(platform=platform, index=i)

    # 1. Every client puts its local topology.
    times["put"], failures["put"] = _all_clients(
        procs, lambda i: clients[i].key_value_set_bytes(key(i), values[i])
    )
    values.clear()
    # 2. Client 0 gathers all P with a pool of threads, one blocking get each, as
    # XLA's GetAllLocalTopologies does (its pool: DefaultThreadPoolSize(), about
    # the CPUs); 3. puts the global one.
    threads = int(config.get("gather_threads") or os.cpu_count() or 1)
    record["exchange_gather_threads"] = threads
    if not failures["put"]:
        t0 = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                nodes = list(
                    pool.map(
                        lambda i: frame(
                            clients[0].blocking_key_value_get_bytes(key(i), timeout_ms)
                        ),
                        range(procs),
                    )
                )
            t1 = time.perf_counter()
            blob = b"".join(nodes)
            del nodes
            t2 = time.perf_counter()
            clients[0].key_value_set_bytes(global_key, blob)
            times["gather"], times["global_put"] = t1 - t0, time.perf_counter() - t2
            failures["gather"] = {}
            if len(blob) != expected:
                failures["gather"] = {0: f"global {len(blob)} B, not {expected} B"}
            del blob
        except Exception as err:
            failures["gather"] = {0: f"{type(err).__name__}: {err}"}
    # 4. Every client fetches the global topology; only its size is kept.
    fetched = [None] * procs

    def fetch(i: int) -> None:
        fetched[i] = len(
            clients[i].blocking_key_value_get_bytes(global_key, timeout_ms)
        )

    if not any(failures.values()):
        times["fetch"], failures["fetch"] = _all_clients(procs, fetch)
        wrong = {
            i: f"fetched {n} B, not {expected} B"
            for i, n in enumerate(fetched)
            if n is not None and n != expected
        }
        failures["fetch"].update(wrong)
        record["exchange_fetched_bytes"] = sum(n for n in fetched if n is not None)
        record["exchange_fetched_ok"] = sum(n == expected for n in fetched)

    rss1, hwm = _harness.rss_bytes()
    sent1 = service_bytes_sent(port)
    for phase in EXCHANGE_PHASES:
        record[f"{phase}_s"] = times.get(phase)
    record["exchange_s"] = sum(times.values())
    # What the service must send, at the least: the P locals to client 0, the
    # global to each of the P clients (messages' framing and gRPC's not counted).
    record["exchange_payload_bytes"] = procs * local + procs * expected
    record["service_sent_bytes"] = (
        sent1 - sent0 if sent0 is not None and sent1 is not None else None
    )
    record["exchange_rss_mib"] = mib(rss1 - rss0)
    record["exchange_peak_mib"] = (
        mib(hwm - rss0) if record["exchange_peak_reset"] else None
    )
    errors = {
        f"{p} {i}": e for p in EXCHANGE_PHASES for i, e in failures.get(p, {}).items()
    }
    return record, errors


# ---------------------------------------------------------------------------------
# The parent: one subprocess per run


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
    """Run one worker in a fresh process of its own session; kill the session at
    ``timeout``. Return its row (a failed one when it printed none)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(config)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    killed = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = True
        _harness._end_group(proc)
        out, err = proc.communicate()
    seconds = time.perf_counter() - start
    rows = [
        json.loads(line[len(_harness.RESULT) :])
        for line in out.splitlines()
        if line.startswith(_harness.RESULT)
    ]
    if rows:
        row = rows[0]
    else:
        row = {k: config[k] for k in ("procs", "waves", "protection")}
        row["ok"] = False
        why = f"killed after {timeout:g} s" if killed else f"exit {proc.returncode}"
        tail = (out + err).strip().splitlines()[-3:]
        row["error"] = f"no result ({why}): " + " | ".join(tail)[-300:]
    row["run_s"] = seconds
    logged = {text: err.count(text) for text in FD_LIMIT_LOGS if text in err}
    row["fd_limit_logs"] = sum(logged.values())
    if not row.get("ok"):
        status = re.search(r"Agent status: (?:%s)?([A-Z_]+: [^\n\[]{0,80})", err)
        if status:
            row["error"] += f"; client status {status.group(1).strip()}"
        for text, count in logged.items():
            row["error"] += f"; gRPC logged '{text}' {count}x"
    # The distinct kinds of log lines gRPC/XLA printed (timestamps and numbers cut).
    kinds = {re.sub(r"[0-9]+", "N", line)[:160] for line in err.splitlines() if line}
    row["log_kinds"] = sorted(kinds)[:20]
    return row


def case_name(waves: int, gap_ms: float) -> str:
    return "burst" if waves == 0 else f"waves {waves}/{gap_ms:g}ms"


def _s(value) -> str:
    return f"{value:.3f}"


TABLE = _harness.Table(
    [
        _harness.Column("case", "case", "", 17, left=True),
        _harness.Column("procs", "P", "", 5, "d"),
        _harness.Column("limit", "soft lim", "start>run", 11),
        _harness.Column("protection", "prot", "", 4),
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


def _mb(value) -> str:
    return f"{value / 1e6:.1f}"


EXCHANGE_TABLE = _harness.Table(
    [
        _harness.Column("case", "case", "", 17, left=True),
        _harness.Column("procs", "P", "", 5, "d"),
        _harness.Column("platform", "platform", "", 8, left=True),
        _harness.Column("exchange_local_bytes", "local", "B", 6, "d"),
        _harness.Column("exchange_global_bytes", "global", "B", 9, "d"),
        _harness.Column("put_s", "put", "median s", 8, _s),
        _harness.Column("gather_s", "gather", "median s", 8, _s),
        _harness.Column("global_put_s", "glob put", "median s", 8, _s),
        _harness.Column("fetch_s", "fetch", "median s", 8, _s),
        _harness.Column("exchange_s", "exchange", "median s", 8, _s),
        _harness.Column("exchange_payload_bytes", "payload", "MB", 8, _mb),
        _harness.Column("service_sent_bytes", "svc sent", "MB (ss)", 8, _mb),
        _harness.Column("exchange_peak_mib", "peak RSS", "+MiB", 8, ".0f"),
        _harness.Column("status", "status", "ok/runs", 8, left=True),
    ]
)


def exchange_lines(row: dict) -> list[dict]:
    """The exchange table's lines of one result: one per platform, then their sums
    where there are several."""
    platforms = row.get("exchange_platforms") or []
    lines = [
        {
            **row,
            "platform": p,
            **{k: row.get(f"{p}.{k}") for k in EXCHANGE_KEYS},
        }
        for p in platforms
    ]
    if len(platforms) > 1:
        lines.append({**row, "platform": "all"})
    return lines


def summarize(runs: list[dict], case: str, procs: int) -> dict:
    """One table row from a setting's runs: medians over the ok runs."""
    good = [r for r in runs if r.get("ok")]
    first = runs[0]
    row = {
        "case": case,
        "procs": procs,
        "waves": first["waves"],
        "gap_ms": first.get("gap_ms", 0),
        "protection": first["protection"],
        "limit": f"{first.get('soft_limit', '?')}>{first.get('soft_limit_run', '?')}",
        "ok": len(good) == len(runs),
        "status": f"{'ok' if len(good) == len(runs) else 'FAILED'} {len(good)}/"
        f"{len(runs)}",
        "errors": [r["error"] for r in runs if not r.get("ok")],
        "runs": runs,
    }
    for key in (
        "connect_s",
        "issued_s",
        "shutdown_s",
        "rss_mib",
        "rss_per_client_kib",
        "hwm_mib",
        *EXCHANGE_KEYS,
        *(
            f"{p}.{k}"
            for p in first.get("exchange_platforms", ())
            for k in EXCHANGE_KEYS
        ),
    ):
        values = [r[key] for r in good if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    row["exchange_platforms"] = first.get("exchange_platforms", [])
    values = [r["connect_s"] for r in good]
    row["connect_max_s"] = max(values) if values else None
    for key in ("fds", "service_fds", "service_conns"):
        values = [r[key] for r in runs if r.get(key) is not None]
        row[key] = max(values) if values else None
    row["overflows"] = max(
        (r.get("tcp_counters", {}).get("ListenOverflows", 0) for r in runs),
        default=None,
    )
    row["syn_retrans"] = max(
        (r.get("tcp_counters", {}).get("TCPSynRetrans", 0) for r in runs),
        default=None,
    )
    return row


def plot(results: list[dict], path: str) -> None:
    _harness.plot_lines(
        [r for r in results if r.get("connect_s")],
        path,
        x="procs",
        panels=[
            ("connect_s", "connect + register, all clients [s]", 1.0),
            ("shutdown_s", "shutdown [s]", 1.0),
            ("fds", "open files, whole process", 1.0),
            ("rss_mib", "RSS after connect [MiB]", 1.0),
        ],
        series=lambda r: f"{r['case']} ({r['protection']})",
        title="one coordination service, P emulated clients (median over runs)",
        xlabel="clients P",
    )


def parse_ints(text: str, option: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r}: comma-separated integers") from None


def parse_waves(text: str, gap_ms: float) -> list[tuple[int, float]]:
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
    parser.add_argument("--procs", default="64,256,1024,2048,4096", help="P values")
    parser.add_argument(
        "--waves",
        default="0,256,1024",
        help="wave sizes W or W/GAP_MS, comma-separated; 0: burst",
    )
    parser.add_argument(
        "--gap-ms", type=float, default=100.0, help="default gap between waves [ms]"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per run")
    parser.add_argument(
        "--init-timeout",
        type=int,
        default=None,
        help="clients' init_timeout [s]; default 60, 10 with --soft-limit",
    )
    parser.add_argument(
        "--shutdown-timeout", type=int, default=60, help="shutdown barrier [s]"
    )
    parser.add_argument(
        "--exchange",
        default="",
        help="after connect, exchange topologies as PJRT's clients do: BYTES (the "
        "CPU client's, each local one this many bytes) or PLATFORM:BYTES,... (one "
        "exchange per platform, in order); empty: off",
    )
    parser.add_argument(
        "--gather-threads",
        type=int,
        default=0,
        help="client 0's concurrent gets in the exchange's gather; 0: the CPUs",
    )
    parser.add_argument(
        "--exchange-timeout",
        type=int,
        default=120,
        help="the exchange's blocking gets' timeout [s]",
    )
    parser.add_argument(
        "--soft-limit", type=int, default=None, help="lower RLIMIT_NOFILE first"
    )
    parser.add_argument(
        "--protection",
        default="on",
        help="on, off, or both (off,on): call ensure_file_limit before the service",
    )
    _harness.add_output_arguments(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return []
    try:
        procs_list = parse_ints(args.procs, "--procs")
        waves_list = parse_waves(args.waves, args.gap_ms)
        parse_exchange(args.exchange)
    except ValueError as err:
        parser.error(str(err))
    protections = [p.strip() for p in args.protection.split(",") if p.strip()]
    if not protections or set(protections) - {"on", "off"}:
        parser.error(f"--protection {args.protection!r}: on, off or off,on")
    init_timeout = args.init_timeout or (10 if args.soft_limit else 60)

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
    for procs in procs_list:
        settings = [(p, w) for p in protections for w in waves_list]
        runs: dict[tuple, list[dict]] = {s: [] for s in settings}
        for _ in range(args.repeat):
            for protection, waves in settings:
                config = {
                    "procs": procs,
                    "waves": waves[0],
                    "gap_ms": waves[1],
                    "protection": protection,
                    "soft_limit": args.soft_limit,
                    "init_timeout": init_timeout,
                    "shutdown_timeout": args.shutdown_timeout,
                    "exchange": args.exchange,
                    "exchange_timeout": args.exchange_timeout,
                    "gather_threads": args.gather_threads,
                }
                runs[(protection, waves)].append(run_one(config, args.timeout))
        for protection, waves in settings:
            row = summarize(runs[(protection, waves)], case_name(*waves), procs)
            burst = runs.get((protection, (0, 0.0)))
            base = summarize(burst, "", procs)["connect_s"] if burst else None
            row["ratio"] = (
                row["connect_s"] / base if base and row["connect_s"] else None
            )
            results.append(row)
            print(TABLE.row(row), flush=True)
            for error in dict.fromkeys(row["errors"]):
                print(f"#   error: {error}", flush=True)
    if args.exchange:
        gets = args.gather_threads or os.cpu_count()
        sizes = ", ".join(f"{p} {b} B" for p, b in parse_exchange(args.exchange))
        print(
            f"# topology exchange, per local topology: {sizes}; one platform after "
            "another, as JAX initializes its backends: put (all "
            f"clients), gather (client 0 gets all P, {gets} at a time), glob put "
            "(client 0), fetch (all clients get the global); payload: what the "
            "service must send; svc sent: its sockets' bytes_sent over the exchange "
            "(ss); peak RSS: the whole process's peak (service and all clients) "
            "over its RSS before; platform 'all': the sums (peak: the largest)"
        )
        print(EXCHANGE_TABLE.header())
        for row in results:
            for line in exchange_lines(row):
                print(EXCHANGE_TABLE.row(line), flush=True)
    _harness.save(
        args,
        _harness.meta(
            repeat=args.repeat,
            gap_ms=args.gap_ms,
            somaxconn=somaxconn,
            file_limits=[soft, hard],
            init_timeout=init_timeout,
        ),
        results,
        plot,
    )
    return results


if __name__ == "__main__":
    main()
