"""benchmarks/coordinator_scale.py at small P: every client gets its own connection,
and a too-low open-file limit fails without the package's protection, not with it."""

import json

import pytest
import util

pytestmark = [util.skip_in_mpi_job, util.same_under_every_jax]


def test_every_client_has_its_own_connection_burst_and_waves(tmp_path):
    bench = util.load_benchmark("coordinator_scale")
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    results = bench.main(
        ["--procs", "16", "--waves", "0,4/20", "--timeout", "60"]
        + ["--init-timeout", "20", "--json", str(out), "--plot", str(png)]
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
    assert png.stat().st_size > 0


def test_client_addresses_are_distinct_loopback_addresses():
    bench = util.load_benchmark("coordinator_scale")
    addresses = [bench.client_address(i, 1234) for i in range(5000)]
    assert len(set(addresses)) == 5000
    for address in addresses:
        host, port = address.rsplit(":", 1)
        octets = [int(o) for o in host.split(".")]
        assert octets[0] == 127 and port == "1234"
        assert 1 <= octets[3] <= 254


def test_file_limit_fails_without_protection_and_passes_with_it():
    bench = util.load_benchmark("coordinator_scale")
    procs = 48
    # What a run of this size needs, measured: then a soft limit just below it.
    (probe,) = bench.main(["--procs", str(procs), "--waves", "0", "--timeout", "60"])
    assert probe["ok"], probe["errors"]
    soft = probe["fds"] - 8
    off, on = bench.main(
        ["--procs", str(procs), "--waves", "0", "--timeout", "60"]
        + ["--soft-limit", str(soft), "--protection", "off,on", "--init-timeout", "2"]
    )
    assert off["protection"] == "off" and not off["ok"]
    (error,) = off["errors"]
    # gRPC's words for the files running out, then how the run failed: a client's
    # deadline; or, with jaxlib 0.6.0, a connect() that would wait for good, or one of
    # gRPC's own assertions aborting the process (SIGABRT: exit -6, seen in CI).
    assert "File descriptor limit reached" in error or "Too many open files" in error
    failed_as = ("DEADLINE_EXCEEDED", "still in connect()", "(exit -6)")
    assert any(words in error for words in failed_as), error
    (run,) = off["runs"]
    assert run["soft_limit_run"] == soft and run["run_s"] < 30
    assert on["protection"] == "on" and on["ok"], on["errors"]
    (run,) = on["runs"]
    assert run["raised_from"] == soft and run["soft_limit_run"] > soft
    assert run["service_conns"] == procs


def test_topology_exchange_is_timed_and_every_client_fetches_the_global_one():
    bench = util.load_benchmark("coordinator_scale")
    procs, local = 8, 88
    (row,) = bench.main(
        ["--procs", str(procs), "--waves", "0", "--timeout", "60"]
        + ["--init-timeout", "20", "--exchange", str(local)]
    )
    assert row["ok"], row["errors"]
    # A GlobalTopologyProto: each node's local one behind a tag and its length.
    assert row["exchange_global_bytes"] == bench.global_size(procs, local) == 720
    for phase in bench.EXCHANGE_PHASES:
        assert row[f"{phase}_s"] > 0, phase
    assert row["exchange_fetched_ok"] == procs
    assert row["exchange_fetched_bytes"] == procs * 720
    assert row["exchange_payload_bytes"] == procs * local + procs * 720
    # The service's sockets sent at least the payload (gRPC's framing on top).
    assert row["service_sent_bytes"] >= row["exchange_payload_bytes"]
    assert row["exchange_peak_mib"] is not None


class FakeClient:
    """A client of an in-memory key-value store; ``short`` fetches lose a byte."""

    def __init__(self, store: dict, short: bool = False):
        self.store, self.short = store, short

    def key_value_set_bytes(self, key, value):
        self.store[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        value = self.store[key]
        return value[:-1] if self.short and key == "cpu:global_topology/cpu" else value


def test_topology_exchange_fails_when_a_client_fetches_the_wrong_size():
    bench = util.load_benchmark("coordinator_scale")
    config = {"exchange": 50, "exchange_timeout": 1}
    store: dict = {}
    good = [FakeClient(store) for _ in range(4)]
    row: dict = {}
    assert bench.exchange(config, row, good, 1, 4)
    assert row["exchange_fetched_ok"] == 4 and "error" not in row
    assert store["cpu:global_topology/cpu"].startswith(b"\x0a\x32")  # field 1, 50 B
    store.clear()
    clients = good[:2] + [FakeClient(store, short=True)] + good[3:]
    row = {}
    assert not bench.exchange(config, row, clients, 1, 4)
    assert row["ok"] is False and row["exchange_fetched_ok"] == 3
    assert "fetch 2: fetched 207 B, not 208 B" in row["error"]


def test_exchange_parses_one_platform_or_several_in_order():
    bench = util.load_benchmark("coordinator_scale")
    assert bench.parse_exchange(88) == [("cpu", 88)]
    assert bench.parse_exchange(0) == bench.parse_exchange("") == []
    assert bench.parse_exchange("88") == [("cpu", 88)]
    assert bench.parse_exchange("cpu:88,cuda:110") == [("cpu", 88), ("cuda", 110)]
    for bad, words in [
        ("cpu:88,cpu:90", "a platform appears twice"),
        ("cuda:x", "is not BYTES or PLATFORM:BYTES"),
        ("cuda:0", "a positive byte count"),
        ("CUDA:5", "lower-case"),
    ]:
        with pytest.raises(ValueError, match=words):
            bench.parse_exchange(bad)


def test_each_platform_exchanges_under_its_own_keys_one_after_another():
    bench = util.load_benchmark("coordinator_scale")
    config = {"exchange": "cpu:20,cuda:50", "exchange_timeout": 1}
    store: dict = {}
    row: dict = {}
    assert bench.exchange(config, row, [FakeClient(store) for _ in range(3)], 1, 3)
    assert sorted(store) == [
        "cpu:global_topology/cpu",
        "cpu:local_topology/cpu/0",
        "cpu:local_topology/cpu/1",
        "cpu:local_topology/cpu/2",
        "cuda:global_topology/cuda",
        "cuda:local_topology/cuda/0",
        "cuda:local_topology/cuda/1",
        "cuda:local_topology/cuda/2",
    ]
    assert len(store["cuda:global_topology/cuda"]) == bench.global_size(3, 50)
    assert row["exchange_platforms"] == ["cpu", "cuda"]
    assert row["cpu.exchange_local_bytes"] == 20
    assert row["cuda.exchange_local_bytes"] == 50
    # The plain keys hold the sums over the platforms.
    assert row["exchange_s"] == row["cpu.exchange_s"] + row["cuda.exchange_s"]
    assert row["exchange_payload_bytes"] == 3 * 20 + 3 * 66 + 3 * 50 + 3 * 156
    lines = bench.exchange_lines(row)
    assert [line["platform"] for line in lines] == ["cpu", "cuda", "all"]
    assert lines[1]["exchange_s"] == row["cuda.exchange_s"]
