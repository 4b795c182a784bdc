"""Rank 0's coordination service as the ranks see it over the network: when its
port accepts, and whether a node reaches it.

No MPI here: the bootstrap (mpi4jax_dist/launch/bootstrap.py) holds the other ranks
until the port accepts, and ends the job when a node cannot reach it.
"""

from __future__ import annotations

import socket

from .. import _config
from . import network

# Probing rank 0's port: the first pause, and the most probes per second that all
# probers together may send to rank 0 (each prober's pause grows to its share).
_FIRST_PAUSE_S = 1e-4
_PROBE_MIN_CAP_S = 2e-3
_PROBES_PER_S = 50_000
# Rank 0 polling its own port: one prober, on its own host.
_RANK0_PAUSE_CAP_S = 5e-3
# How long a node waits for any answer from the coordinator's port, once rank 0's
# service listens, before it ends the job: TCP's retries of a lost connection
# request (1, 2, 4 and 8 s apart) all fit in it.
REACH_TIMEOUT_S = 20


def listening(address: str, deadline: float) -> str | None:
    """Rank 0: poll its own service's port until it accepts; return None once it
    does, else why not (see :func:`network.wait_accepting`)."""
    host, port = _host_port(address)
    return network.wait_accepting(
        host, port, deadline, _FIRST_PAUSE_S, _RANK0_PAUSE_CAP_S
    )


def probe(address: str, deadline: float, probers: int) -> str | None:
    """Poll rank 0's port until it accepts, with a bounded back-off; return None
    once it does, else why not: ``deadline`` passed (the reason starts with
    :data:`network.REFUSED` where refusals answered: the service is not up yet), or
    :data:`REACH_TIMEOUT_S` of attempts went unanswered.

    Each of the ``probers``' pauses doubles up to its share of
    :data:`_PROBES_PER_S` (at least 2 ms), so that rank 0 sees a bounded rate of
    refused connections however many nodes probe.
    """
    host, port = _host_port(address)
    cap = max(_PROBE_MIN_CAP_S, probers / _PROBES_PER_S)
    return network.wait_accepting(
        host, port, deadline, _FIRST_PAUSE_S, cap, silence_s=REACH_TIMEOUT_S
    )


def reach(address: str, timeout_s: float) -> str | None:
    """Connect to the listening service once; return None, or why it failed.

    Without it, JAX's own connection retries in silence until its initialization
    timeout (300 s by default) and then fails with a ``DEADLINE_EXCEEDED`` that
    names no node. One connection per node beside the P that JAX makes.
    """
    host, port = _host_port(address)
    return network.not_reached(host, port, min(REACH_TIMEOUT_S, timeout_s))


def unreachable(address: str, why: str, where: str) -> str:
    """Say that this node cannot reach the coordinator at ``address`` (``where``:
    what is known of its service), why, and what to do."""
    host, _ = _host_port(address)
    try:
        source = f" ({network.source_address(host)})"
    except OSError:
        source = ""
    return (
        f"{socket.gethostname()}{source} cannot reach JAX's coordinator at "
        f"{address}, {where}: {why}. Something between "
        f"the nodes drops or refuses that port (a firewall?): open it between "
        f"the nodes ({_config.COORDINATOR_PORT} chooses it), or name the "
        f"interface of a network they share in {_config.INTERFACE}."
    )


def _host_port(address: str) -> tuple[str, int]:
    return _config.split_host_port(address, "coordinator address")
