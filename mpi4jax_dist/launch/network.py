"""Addresses: the coordinator's (which interface of rank 0's host, and a free port,
chosen on rank 0), and each process's own for JAX's Gloo collectives.

No MPI here. ``psutil`` lists the interfaces.
"""

from __future__ import annotations

import ipaddress
import socket
import time

from .. import _config

# How long one connection attempt of a poll may wait for an answer.
_ATTEMPT_S = 0.5
REFUSED = "refused"

# Interfaces that belong to containers or VMs on the host, not to the cluster network.
_VIRTUAL_PREFIXES = ("docker", "br-", "veth", "virbr", "cni", "flannel", "cali", "tun")


def format_address(host: str, port: int) -> str:
    """Return ``host:port``, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def coordinator_host(num_nodes: int, interface: str | None = None) -> str:
    """Return the host part of the coordinator address seen from every node.

    Args:
        num_nodes: how many nodes the job spans. One node: loopback, which never
            leaves the host.
        interface: an interface name (``MPI4JAX_DIST_INTERFACE``); None picks one.

    Raises:
        ValueError: ``interface`` names no interface, or one without an address.
        RuntimeError: several nodes, and this host has only loopback addresses.
    """
    if num_nodes <= 1:
        return "127.0.0.1"
    if interface is not None:
        return interface_address(interface)
    return routable_address()


def interface_error(name: str | None) -> str | None:
    """Return why this host cannot use the interface ``name`` (None: it can, or
    no interface is named)."""
    if name is None:
        return None
    try:
        interface_address(name)
    except ValueError as err:
        return str(err)
    return None


def interface_address(name: str) -> str:
    """Return an address of the interface ``name``: IPv4 first, then global IPv6."""
    import psutil

    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        raise ValueError(
            f"{_config.INTERFACE}={name!r} names no network interface on "
            f"{socket.gethostname()}; interfaces there: "
            f"{', '.join(sorted(interfaces))}."
        )
    candidates = _usable([a.address for a in interfaces[name]], allow_loopback=True)
    if not candidates:
        raise ValueError(
            f"{_config.INTERFACE}={name!r}: that interface on {socket.gethostname()} "
            f"has no IPv4 or global IPv6 address."
        )
    return candidates[0]


def routable_address() -> str:
    """Return an address of this host that other hosts can reach (not loopback).

    The hostname's own address comes first when it is not loopback (Debian-like hosts
    map the hostname to 127.0.1.1, so it often is); then the addresses of the
    interfaces that are up, physical ones before container bridges.
    """
    import psutil

    local = psutil.net_if_addrs()
    local_addresses = {a.address for addrs in local.values() for a in addrs}
    try:
        resolved = [
            info[4][0]
            for info in socket.getaddrinfo(
                socket.gethostname(), None, type=socket.SOCK_STREAM
            )
        ]
    except OSError:
        resolved = []
    for address in _usable(resolved):
        if address in local_addresses:
            return address

    stats = psutil.net_if_stats()
    names = [n for n in local if stats.get(n) is None or stats[n].isup]
    names.sort(key=lambda n: n.startswith(_VIRTUAL_PREFIXES))
    for name in names:
        candidates = _usable([a.address for a in local[name]])
        if candidates:
            return candidates[0]
    raise RuntimeError(
        f"The job spans several nodes but rank 0's host {socket.gethostname()} has "
        f"no address other than loopback. Set {_config.INTERFACE} to the interface "
        f"of the cluster network, or {_config.COORDINATOR_ADDRESS} to host:port."
    )


def source_address(host: str) -> str:
    """Return the address of this host that its traffic to ``host`` leaves from.

    The kernel's own choice (a UDP socket's ``connect`` sends nothing): on another
    node, the address on the network that reaches ``host``; on ``host``'s own node,
    ``host`` itself; loopback for loopback.

    Raises:
        OSError: no route to ``host``, or a host name that does not resolve.
    """
    with socket.socket(_family(host), socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))  # any port: nothing is sent
        return sock.getsockname()[0]


def collectives_address(coordinator_address: str, interface: str | None = None) -> str:
    """Return the address this process's Gloo collectives should publish.

    Gloo (JAX's default CPU collectives) publishes the address its host name
    resolves to, which on Debian-like hosts is 127.0.1.1: no other node can reach
    it. Instead: the address of ``interface`` (``MPI4JAX_DIST_INTERFACE``) where one
    is named, else the one this host reaches the coordinator from
    (:func:`source_address`), which every node reaches the coordinator on too.

    Raises:
        ValueError: ``interface`` names no interface, or one without an address.
        OSError: no route to the coordinator's host.
    """
    if interface is not None:
        return interface_address(interface)
    host, _ = _config.split_host_port(coordinator_address, "coordinator address")
    return source_address(host)


def hostname_on_loopback() -> str | None:
    """Return the loopback address this host's name resolves to first, or None
    (not loopback, or it does not resolve)."""
    try:
        first = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    address = first[0][4][0]
    return address if ipaddress.ip_address(address.split("%")[0]).is_loopback else None


def _usable(addresses, allow_loopback: bool = False) -> list[str]:
    """Return the IP addresses other hosts could use, IPv4 before IPv6, in order."""
    v4, v6 = [], []
    for text in addresses:
        try:
            address = ipaddress.ip_address(text.split("%")[0])
        except ValueError:  # a MAC address from psutil's AF_PACKET rows
            continue
        if address.is_link_local or address.is_multicast or address.is_unspecified:
            continue
        if address.is_loopback and not allow_loopback:
            continue
        (v4 if address.version == 4 else v6).append(str(address))
    return v4 + v6


def _family(host: str):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port_free(host: str, port: int) -> None:
    """Raise ``RuntimeError`` naming ``port`` when another program holds it."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        # A port left in TIME_WAIT by an earlier job is free to listen on again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise RuntimeError(
                f"coordinator port {port} on {host} ({socket.gethostname()}) is not "
                f"free: {err.strerror}. Another program or job holds it; unset "
                f"{_config.COORDINATOR_PORT} to let rank 0 choose a free port, or "
                f"choose another."
            ) from None


def reserve_port(host: str) -> socket.socket:
    """Return a socket that holds a free port on ``host`` until JAX's service binds it.

    Between choosing a port and gRPC binding it, another job on the node could take
    it. The socket is bound, not listening, with ``SO_REUSEPORT``: gRPC binds with
    that option too, so JAX's service can bind beside it, while the kernel hands the
    port to no other ``bind(0)`` and a plain ``bind`` fails. Close it once the
    service listens.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def wait_accepting(
    host: str,
    port: int,
    deadline: float,
    first_pause: float,
    cap: float,
    silence_s: float | None = None,
) -> str | None:
    """Poll ``host:port`` until it accepts, pausing ``first_pause`` doubling up to
    ``cap``.

    Returns:
        None once it accepts; else why it stopped waiting, in words: ``deadline``
        (``time.monotonic``) passed, or for ``silence_s`` seconds no attempt was
        answered at all (refusals are answers: nothing listens yet), which waiting
        longer will not mend.
    """
    pause = first_pause
    silent_since = None
    while True:
        why = not_reached(host, port, _ATTEMPT_S)
        if why is None:
            return None
        now = time.monotonic()
        if why == REFUSED:
            silent_since = None
        elif silent_since is None:
            silent_since = now
        elif silence_s is not None and now - silent_since >= silence_s:
            return f"{why}, for {now - silent_since:.0f} s"
        if now > deadline:
            return f"{why}, until the deadline"
        time.sleep(pause)
        pause = min(pause * 2, cap)


def accepts(host: str, port: int, timeout_s: float = _ATTEMPT_S) -> bool:
    """Return True when something accepts TCP connections on ``host:port``."""
    return not_reached(host, port, timeout_s) is None


def not_reached(host: str, port: int, timeout_s: float) -> str | None:
    """Try one TCP connection to ``host:port``; return None when it is accepted,
    else why not, in words: :data:`REFUSED`, ``no answer in 20 s``, or the OS's
    error (``No route to host``).

    A refusal comes from the host (nothing listens there); no answer at all means
    that something between the two drops the packets (a firewall).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return REFUSED
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as err:
        return err.strerror or str(err)
