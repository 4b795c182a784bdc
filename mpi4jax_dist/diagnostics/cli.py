"""``mpiexec -n N python -m mpi4jax_dist [--json] [--check]``: what mpi4jax_dist sees.

Rank 0 prints the report; the exit status is 1, with the reasons, when anything
looks wrong.

``python -m mpi4jax_dist env`` (no mpiexec) prints the shell lines that make JAX's
CPU collectives run over MPI, for a job script: ``eval "$(python -m mpi4jax_dist
env)"`` before the ``mpiexec`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from .. import _config

# --help is read in a terminal: plain text, not the reStructuredText of the docstring.
_DESCRIPTION = """\
Report what mpi4jax_dist sees in this job: the launcher and its variables,
the MPI library, the ranks on each node, the coordinator, proxies and versions.
Run it under the launcher that starts the job, for example:

  mpiexec -n 2 python -m mpi4jax_dist --check

Rank 0 prints the report. The exit status is 1, with the reasons, when anything
looks wrong."""

_EPILOG = '''\
env (run without mpiexec) prints the shell lines that make JAX's CPU collectives
run over MPI. In a job script, before the mpiexec line:

  eval "$(python -m mpi4jax_dist env)"'''


def _print_devices(devices: list[dict], ranks_per_node: dict) -> None:
    """Each rank's devices for the first node's ranks, then how many other ranks
    use what (at 10^5 ranks one line per rank would bury the rest)."""
    if not any(d["source"] for d in devices):
        print("devices       CPU (no accelerator visible)")
        return
    first = set(ranks_per_node.get("0", [d["rank"] for d in devices]))
    print("devices       what each rank sees, and the ids JAX will use:")
    others: dict[tuple, int] = {}
    for d in devices:
        ids = d["local_device_ids"]
        use = "all" if ids is None else ",".join(map(str, ids))
        if d["rank"] in first:
            print(f"  rank {d['rank']}: {d['source']}, {d['visible']} visible -> {use}")
        else:
            key = (d["visible"], "all" if ids is None else len(ids))
            others[key] = others.get(key, 0) + 1
    for (visible, used), count in sorted(others.items(), key=str):
        print(f"  {count} more rank(s): {visible} visible, {used} used")


def _print_on_hang(hang: dict) -> None:
    """What ends a job that hangs, and the variables that change it."""
    timeout = hang["hang_timeout_s"]
    if timeout is None:
        print(f"on a hang     no hang timeout ({_config.HANG_TIMEOUT}=0)")
    else:
        how = "the default" if not hang["hang_timeout_set"] else "set"
        print(
            f"on a hang     the job ends, named, after {timeout:g} s without "
            f"progress ({_config.HANG_TIMEOUT}, {how}; 0 turns it off)"
        )
    if hang["standstill"]:
        print(
            "  ranks that all wait in calls that cannot match: ended within "
            f"seconds ({_config.CHECKS})"
        )
    collective = hang["collective_timeout_s"]
    print(
        f"  collective timeout: {f'{collective:g} s' if collective else 'off'} "
        f"({_config.COLLECTIVE_TIMEOUT})"
    )
    if hang["bootstrapped"] and hang["watchdog"] == "none":
        print(
            "  not in force in this job: no watchdog (one rank, or no MPI "
            "thread level that lets it run)"
        )


def _print_text(report: dict, verbose: bool = False) -> None:
    """The report as README shows it; with ``verbose`` every detail as well (the
    launcher's variables, mpiexec, nodes, devices, the bootstrap's MPI calls,
    versions, limits and timeouts, CPU collectives)."""
    mpi, topo = report["mpi"], report["topology"]

    def more(*args, **kwargs):
        if verbose:
            print(*args, **kwargs)

    if report["launcher"] is None:
        print("launcher      none recognised: no launcher variables in the environment")
    else:
        colon = ":" if verbose else ""
        print(f"launcher      {report['launcher']}, recognised by its variables{colon}")
    for name, value in report["launcher_variables"].items():
        more(f"  {name}={value}")
    print(
        f"MPI           {mpi['library']} (MPI {mpi['standard']}, thread level "
        f"{mpi['thread_level']})"
    )
    settings = ", ".join(f"{k}={v}" for k, v in mpi["thread_level_settings"].items())
    print(f"  {mpi['thread_level']}: {mpi['thread_level_means']}")
    if settings:
        print(f"  set by {settings}")
    # Without a launcher, which mpiexec to start the job with is what matters.
    say = print if report["launcher"] is None else more
    if mpi["mpiexec"] is None:
        say("mpiexec       none on PATH, nor beside this Python")
    else:
        where = "" if mpi["mpiexec_on_path"] else " (beside this Python; not on PATH)"
        say(
            f"mpiexec       {mpi['mpiexec']}{where}: "
            f"{mpi['mpiexec_version'] or 'printed no version'}"
        )
    if mpi.get("mpiexec_note"):
        print(f"  note: {mpi['mpiexec_note']}")
    print(f"size          {topo['size']} ranks on {topo['num_nodes']} node(s)")
    for node, ranks in topo.get("ranks_per_node", {}).items():
        more(f"  node {node}: ranks {ranks}")
    devices = report.get("devices", [])
    if verbose or any(d["source"] for d in devices):  # accelerators: always
        _print_devices(devices, topo.get("ranks_per_node", {}))
    release = {
        "thread": "rank 0's thread releases the others",
        "probe": "the others probe its port",
        None: "one rank",
    }[topo["release"]]
    print(f"coordinator   {topo['coordinator_address']} ({release})")
    more("bootstrap     MPI calls that communicate, as they ran on rank 0:")
    for call in report["bootstrap_calls"]:
        more(
            f"  {call['phase']:<8} {call['name']:<10} {call['bytes_per_rank']:>5} B "
            f"per rank; {call['mpi_adds']}"
        )
    proxy = report["proxy"]
    print(
        f"proxies       {', '.join(proxy['variables']) or 'none'}"
        f" (no_grpc_proxy={proxy['no_grpc_proxy']}, keep={proxy['keep']})"
    )
    more(
        "versions      " + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    )
    scale = report["scale"]
    files = scale["open_files"]
    more(
        f"scale         P={scale['processes']}: rank 0's open files soft "
        f"{files['soft']}, hard {files['hard']}, needed {files['needed']}; "
        f"listen backlog {scale['listen_backlog']}; topology exchange "
        f"{scale['topology_exchange_bytes']:,} B"
    )
    for name, values in scale["timeouts"].items():
        more(
            f"  timeouts of {name}: "
            + ", ".join(f"{k} {v} s" for k, v in values.items())
        )
    for name, values in scale["topology_timeouts_minutes"].items():
        more(
            f"  topology timeouts of {name}: "
            + ", ".join(f"{k} {v} min" for k, v in values.items())
        )
    model, gpu = scale["topology_exchange_s"], scale["gpu_topology_exchange"]
    more(
        f"  topology exchange by the model: CPU {model['whole']:.0f} s; CUDA plugin, "
        f"one GPU per process {gpu['seconds']['whole']:.0f} s (XLA's fixed limit "
        f"{gpu['xla_timeouts_minutes']['global']} min)"
    )
    for warning in scale["warnings"]:
        print(f"WARNING       {warning}")
    failure = report["on_failure"]
    if failure["abort_on_failure"]:
        when = "in force" if failure["installed"] else "once JAX initializes"
        print(f"on failure    a failing rank calls MPI_Abort ({when})")
    else:
        print("on failure    JAX's own behaviour: the other ranks may wait")
    more(f"  SIGTERM: {failure['sigterm']}")
    _print_on_hang(report["on_hang"])
    cpu = report["cpu_collectives"]
    if cpu["jax"] == "mpi" and cpu["wrapper_loaded"]:
        in_force = f"MPI, through {cpu['wrapper']}"
        if cpu.get("xla_world") == {"private": True, "congruent": True}:
            in_force += ", on a private duplicate of MPI_COMM_WORLD"
    else:
        in_force = (
            f"{cpu['jax'] or 'gloo'} (MPI4JAX_DIST_CPU_COLLECTIVES=mpi: over MPI)"
        )
    more(f"CPU collectives {in_force}")
    for name, value in failure["settings"].items():
        if value is not None:
            print(f"  {name}={value}")
    if "check" in report:
        check = report["check"]
        print(f"backend       {check['backend']}: {', '.join(check['devices'])}")
        print(f"check         psum correct: {check['psum_correct']}")
        if check.get("gloo_address"):
            more(f"  JAX's Gloo collectives on {check['gloo_address']}")
        if check.get("psum_error"):
            print(f"  {check['psum_error']}")
        if check["allreduce_equals_psum"] is None:
            print(f"  mpi4jax.allreduce {check['mpi4jax']}")
        else:
            print(f"  mpi4jax.allreduce == psum: {check['allreduce_equals_psum']}")
    for problem in report["problems"]:
        print(f"PROBLEM       {problem}")
    if not verbose:
        print(
            "(--verbose adds the launcher's variables, mpiexec, nodes, devices, the "
            "bootstrap's MPI calls, versions, limits and timeouts)"
        )


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send what the libraries print on standard output to standard error while
    the report is made (jaxlib's Gloo prints ``[Gloo] Rank 0 is connected to ...``
    there from C++), so that standard output carries the report alone: ``--json |
    jq`` works."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _status(args) -> int:
    from . import status

    try:
        result = status.status(job=args.job, local=args.local)
    except (OSError, status.StatusError) as err:
        print(f"python -m mpi4jax_dist status: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status.as_json(result), indent=1))
    else:
        print(status.text(result))
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line's parser (the docs render its help)."""
    from .. import __version__
    from .check import CHECK_TIMEOUT_S

    cli = argparse.ArgumentParser(
        prog="python -m mpi4jax_dist",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_argument(
        "--version", action="version", version=f"mpi4jax_dist {__version__}"
    )
    cli.add_argument(
        "command",
        nargs="?",
        choices=["env", "timeline", "status"],
        help="env: print the shell lines that make JAX's CPU collectives use MPI; "
        "timeline DIR: merge the ranks' timelines in DIR (MPI4JAX_DIST_TIMELINE) "
        "into a trace and print where the collectives' time goes; status: ask the "
        "job running on this node where its ranks stand (starts no MPI)",
    )
    cli.add_argument("folder", nargs="?", help=argparse.SUPPRESS)
    cli.add_argument(
        "--trace",
        metavar="PATH",
        help="with timeline: where the trace goes (default: DIR/trace.json)",
    )
    cli.add_argument(
        "--job",
        metavar="KEY",
        help="with status: the job to ask, where several run on this node",
    )
    cli.add_argument(
        "--local",
        action="store_true",
        help="with status: ask only this node's ranks, each in turn",
    )
    cli.add_argument("--json", action="store_true", help="print JSON (everything)")
    cli.add_argument(
        "--verbose",
        action="store_true",
        help="print every detail (default: the lines README shows, warnings and "
        "problems)",
    )
    cli.add_argument(
        "--check",
        action="store_true",
        help="also initialize JAX and compare allreduce with psum",
    )
    cli.add_argument(
        "--procs",
        type=int,
        metavar="N",
        help="judge rank 0's limits for a job of N processes (default: this one's)",
    )
    cli.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="with --check: how long the ranks wait for each other after JAX's psum "
        f"before the job ends, saying that it hangs (default: {CHECK_TIMEOUT_S})",
    )
    cli.add_argument(
        "--hangs",
        metavar="DIR",
        help="group the ranks of a hung job by their stacks, from the rank-N.txt "
        "files its ranks wrote to DIR (MPI4JAX_DIST_HANG_DIR) on SIGUSR1 or at "
        "MPI4JAX_DIST_COLLECTIVE_TIMEOUT; starts no MPI",
    )
    return cli


def main(argv=None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.procs is not None and args.procs < 1:
        cli.error(f"--procs {args.procs}: expected a process count of 1 or more")
    if args.timeout is not None and not args.timeout > 0:
        cli.error(f"--timeout {args.timeout:g}: expected seconds, more than 0")
    if args.hangs is not None:
        from .hangs import summarize

        try:
            print(summarize(args.hangs))
        except (FileNotFoundError, NotADirectoryError) as err:
            print(f"python -m mpi4jax_dist --hangs: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "timeline" and args.folder is None:
        cli.error("timeline takes the timeline's folder: timeline DIR")
    if args.command != "timeline" and args.folder is not None:
        cli.error("only timeline takes a folder (timeline DIR)")
    if args.command == "timeline":
        from .timeline import report

        try:
            print(report(args.folder, args.trace))
        except OSError as err:
            print(f"python -m mpi4jax_dist timeline: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "status":
        return _status(args)
    if args.command == "env":
        from ..xla_mpi import env_lines

        try:
            print("\n".join(env_lines()))
        except RuntimeError as err:
            print(f"python -m mpi4jax_dist env: {err}", file=sys.stderr)
            return 1
        return 0

    from mpi4py import MPI

    from .check import diagnose

    with _stdout_to_stderr():
        report = diagnose(check=args.check, procs=args.procs, timeout_s=args.timeout)
    if MPI.COMM_WORLD.Get_rank() == 0:
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print_text(report, verbose=args.verbose)
    return 1 if report["problems"] else 0
