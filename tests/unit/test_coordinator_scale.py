"""benchmarks/coordinator_scale.py at small P: every client gets its own connection."""

import json

import util

pytestmark = [util.skip_in_mpi_job, util.same_under_every_jax]


def test_every_client_has_its_own_connection_burst_and_waves(tmp_path):
    bench = util.load_benchmark("coordinator_scale")
    out = tmp_path / "scale.json"
    results = bench.main(
        ["--procs", "16", "--waves", "0,4/20", "--timeout", "60"]
        + ["--init-timeout", "20", "--json", str(out)]
    )
    assert [(r["case"], r["procs"]) for r in results] == [
        ("burst", 16),
        ("waves 4/20ms", 16),
    ]
    for row in results:
        assert row["ok"], row["errors"]
        # One connection per client on the service's side (not one shared by all
        # clients of a loopback address), plus its listening socket.
        assert row["service_conns"] == 16
        assert row["service_fds"] == 17
        # Both ends live in the one process.
        assert row["fds"] >= 2 * 16
        assert row["connect_s"] > 0 and row["shutdown_s"] > 0
    # 4 waves of 4 clients, 20 ms apart: the last connect() is called >= 60 ms in.
    assert results[1]["issued_s"] >= 0.06
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == 2 and "versions" in saved["meta"]


def test_client_addresses_are_distinct_loopback_addresses():
    bench = util.load_benchmark("coordinator_scale")
    addresses = [bench.client_address(i, 1234) for i in range(5000)]
    assert len(set(addresses)) == 5000
    for address in addresses:
        host, port = address.rsplit(":", 1)
        octets = [int(o) for o in host.split(".")]
        assert octets[0] == 127 and port == "1234"
        assert 1 <= octets[3] <= 254
