"""Serial: addresses and reachability (``_network``), on loopback.

A listening socket whose accept queue is full stands in for a port behind a
firewall that drops packets: the kernel leaves further connection requests
unanswered.
"""

import socket
import threading
import time

import pytest
import util

from mpi4jax_dist.launch import network

pytestmark = [util.serial_only, util.same_under_every_mpi, util.same_under_every_jax]


@pytest.fixture
def listening():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.fixture
def refused():
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return port


@pytest.fixture
def unanswered():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        with socket.create_connection(server.getsockname()):  # fills the queue
            yield server.getsockname()[1]


def test_not_reached(listening, refused, unanswered):
    assert network.not_reached("127.0.0.1", listening, 1) is None
    assert network.not_reached("127.0.0.1", refused, 1) == network.REFUSED
    assert network.not_reached("127.0.0.1", unanswered, 0.3) == "no answer in 0.3 s"


def test_wait_accepting_stops_on_silence(unanswered):
    start = time.monotonic()
    why = network.wait_accepting(
        "127.0.0.1", unanswered, start + 30, 1e-3, 0.01, silence_s=1
    )
    assert why == "no answer in 0.5 s, for 1 s"
    assert time.monotonic() - start < 5


def test_wait_accepting_waits_out_refusals(refused):
    start = time.monotonic()
    why = network.wait_accepting(
        "127.0.0.1", refused, start + 0.5, 1e-3, 0.01, silence_s=0.1
    )
    assert why == "refused, until the deadline"  # refusals are not silence


def test_wait_accepting_until_it_listens(refused):
    server = socket.socket()

    def listen_later():
        time.sleep(0.3)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", refused))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        assert (
            network.wait_accepting("127.0.0.1", refused, deadline, 1e-3, 0.01) is None
        )
    finally:
        thread.join()
        server.close()


def test_collectives_address():
    # Loopback reaches loopback; on a cluster, the node's address on the
    # coordinator's network (tests/cluster/test_slurm_cluster.py).
    assert network.source_address("127.0.0.1") == "127.0.0.1"
    assert network.collectives_address("127.0.0.1:1234") == "127.0.0.1"
    assert network.collectives_address("127.0.0.1:1234", "lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="MPI4JAX_DIST_INTERFACE='nope'"):
        network.collectives_address("127.0.0.1:1234", "nope")


def test_hostname_on_loopback():
    found = network.hostname_on_loopback()
    resolved = socket.getaddrinfo(socket.gethostname(), None)[0][4][0]
    assert found == (resolved if resolved.startswith("127.") else None)
