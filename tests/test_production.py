"""What an operator needs: Prometheus metrics, CURVE, and the commands around them."""

from __future__ import annotations

import contextlib
import re
import struct
import subprocess
import time
import urllib.request

import pytest
import zmq

from coordkit.curve import secure_client
from coordkit.metrics import scrape
from coordkit.protocol import ErrorCode
from coordkit.tools.cli import stats_table
from tests.support.peers import (
    ABORT,
    CONNECT,
    CONNECT_ACK,
    PARTIAL,
    REPLY,
    SUBMIT,
    RawClient,
    RawEngine,
    m,
    um,
    wait_for,
)
from tests.support.processes import coordkit_command, python_env

#: The metric names the table of docs/deploying.md lists.
METRIC_NAMES = [
    "coordkit_info",
    "coordkit_requests_total",
    "coordkit_refused_messages_total",
    "coordkit_events_total",
    "coordkit_rerouted_requests_total",
    "coordkit_requests_in_flight",
    "coordkit_engine_requests_in_flight",
    "coordkit_engine_state",
    "coordkit_engines",
    "coordkit_control_state",
    "coordkit_clients",
    "coordkit_messages_total",
    "coordkit_message_bytes_total",
    "coordkit_request_duration_seconds",
    "coordkit_time_to_first_reply_seconds",
    "coordkit_prefix_routing_decisions_total",
    "coordkit_prefix_routing_blocks_total",
]


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample of a Prometheus text scrape."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def test_a_scrape_after_known_traffic_gives_exact_counts(make_cluster, impl):
    with make_cluster(n_engines=2, policy="round_robin", metrics_port=0) as c:
        client = c.client(coordkit=True)
        # Four requests: 0 streams a partial then finishes, 1 finishes, 2 stays in
        # flight, 3 is refused as a duplicate of 2; then an unknown abort.
        sids = []
        for rid in range(3):
            client.send(m([SUBMIT, rid, {}]), b"prompt")
            sids.append(um(c.engines[rid % 2].recv()[0])[1])
        client.send(m([SUBMIT, 2, {}]), b"again")
        assert um(client.recv()[0])[2] == ErrorCode.DUPLICATE_REQUEST
        client.send(m([ABORT, 99]))
        assert um(client.recv()[0])[2] == ErrorCode.UNKNOWN_REQUEST
        c.engines[0].send(m([PARTIAL, [sids[0]]]), b"part")
        assert client.recv() == [m([PARTIAL, 0]), b"part"]
        c.engines[0].send(m([REPLY, [[sids[0], False]]]), b"done")
        c.engines[1].send(m([REPLY, [[sids[1], False]]]), b"done")
        assert sorted(um(client.recv()[0])[1] for _ in range(2)) == [0, 1]

        text = urllib.request.urlopen(f"http://127.0.0.1:{c.coord.metrics_port}/metrics").read()
        got = samples(text.decode())
        assert scrape(c.coord).splitlines()[0] == text.decode().splitlines()[0]
    assert got['coordkit_requests_total{code="",outcome="accepted"}'] == 3
    assert got['coordkit_requests_total{code="",outcome="completed"}'] == 2
    assert got['coordkit_refused_messages_total{code="DUPLICATE_REQUEST"}'] == 1
    assert got['coordkit_refused_messages_total{code="UNKNOWN_REQUEST"}'] == 1
    # Every code has its series from the start: a rate over it is 0, not absent.
    assert got['coordkit_refused_messages_total{code="BUSY"}'] == 0
    assert got['coordkit_requests_total{code="TIMED_OUT",outcome="failed"}'] == 0
    assert got[f'coordkit_info{{implementation="{impl.name}",policy="round_robin"}}'] == 1
    assert got["coordkit_requests_in_flight"] == 1
    assert got['coordkit_engine_requests_in_flight{engine="engine-0"}'] == 1  # request 2
    assert got['coordkit_engine_requests_in_flight{engine="engine-1"}'] == 0
    assert got['coordkit_engines{state="alive"}'] == 2
    assert got['coordkit_engine_state{engine="engine-1",state="alive"}'] == 1
    assert got['coordkit_engine_state{engine="engine-1",state="gone"}'] == 0
    assert got['coordkit_control_state{state="running"}'] == 1
    assert got['coordkit_messages_total{direction="in",header="SUBMIT_REQUEST"}'] == 4
    assert got['coordkit_messages_total{direction="out",header="SUBMIT_REQUEST"}'] == 3
    assert got['coordkit_messages_total{direction="out",header="ERROR"}'] == 2
    assert got['coordkit_messages_total{direction="in",header="ENGINE_REPLY"}'] == 2
    assert got['coordkit_message_bytes_total{direction="out",header="ENGINE_REPLY_PARTIAL"}'] == (
        len(m([PARTIAL, 0])) + len(b"part")
    )
    # Histograms count what completed: two finals; first replies: request 0's
    # partial and request 1's final.
    assert got["coordkit_request_duration_seconds_count"] == 2
    assert got['coordkit_request_duration_seconds_bucket{le="+Inf"}'] == 2
    assert got["coordkit_time_to_first_reply_seconds_count"] == 2
    assert 0 < got["coordkit_request_duration_seconds_sum"] < 60
    for name in METRIC_NAMES:
        assert any(key.split("{")[0].startswith(name) for key in got), name


def test_headers_it_does_not_know_are_one_series(make_cluster):
    with make_cluster(metrics_port=0) as c:
        client = c.client(coordkit=True)
        for header in (70, 88, 126, 200):
            client.send(m([header]))
            assert um(client.recv()[0])[2] == ErrorCode.UNKNOWN_HEADER
        got = samples(scrape(c.coord))
    assert got['coordkit_messages_total{direction="in",header="other"}'] == 4
    assert not any("header " in key for key in got)


def test_prefix_decisions_and_matched_blocks(make_cluster):
    hashes = [struct.pack("<4Q", 1, 2, 3, 4), struct.pack("<4Q", 1, 2, 3, 4)]
    hashes.append(struct.pack("<4Q", 1, 2, 7, 8))  # shares two blocks with the others
    with make_cluster(n_engines=2, policy="prefix", metrics_port=0) as c:
        client = c.client(coordkit=True)
        poller = zmq.Poller()
        for engine in c.engines:
            poller.register(engine.sock, zmq.POLLIN)
        for rid, frame in enumerate(hashes):  # one at a time: each engine idle again
            client.send(m([SUBMIT, rid, {}]), b"prompt", frame)
            ready = dict(poller.poll(5000))
            engine = next(e for e in c.engines if e.sock in ready)
            sid = um(engine.recv()[0])[1]
            engine.send(m([REPLY, [[sid, False]]]), b"done")
            assert um(client.recv()[0])[1] == rid
        client.send(m([SUBMIT, 3, {}]), b"no hashes")  # routed by load: not counted
        got = samples(scrape(c.coord))
    assert got["coordkit_prefix_routing_decisions_total"] == 3
    assert got['coordkit_prefix_routing_blocks_total{kind="hashed"}'] == 12
    assert got['coordkit_prefix_routing_blocks_total{kind="matched"}'] == 4 + 2


def test_the_same_metrics_from_both_implementations(c_impl, py_impl, tmp_path):
    from coordkit import Coordinator

    texts = []
    for impl in (c_impl, py_impl):
        coord = Coordinator(f"ipc://{tmp_path}/{impl.name}.sock", implementation=impl.name)
        # coordkit_info names the implementation: every other sample is the same.
        texts.append(scrape(coord).replace(f'implementation="{impl.name}"', "implementation"))
        coord.stop()
    assert texts[0] == texts[1]


def test_without_metrics_the_loop_keeps_no_latency(make_cluster):
    with make_cluster(n_engines=1) as c:
        assert c.coord.metrics_port is None
        assert c.coord.metrics()["latency"] is None


# -- CURVE ------------------------------------------------------------------------------


def curve_peer(kind, ctx, address, keys, name, directory="admitted", identity=None):
    peer = kind(ctx, address, identity, connect=False)
    if name is not None:
        secure_client(
            peer.sock, keys / "server" / "coordinator.key", keys / directory / f"{name}.key_secret"
        )
    peer.sock.connect(address)
    return peer


def test_curve_admits_listed_keys_and_refuses_the_others(make_cluster, keys):
    options = {
        "curve_secret_key": keys / "server" / "coordinator.key_secret",
        "curve_authorized_keys": keys / "admitted",
    }
    with make_cluster(transport="tcp", **options) as c:
        assert c.coord.curve and c.coord.address.startswith("tcp://127.0.0.1:")
        engine = curve_peer(RawEngine, c.ctx, c.coord.address, keys, "engine", identity=b"e0")
        client = curve_peer(RawClient, c.ctx, c.coord.address, keys, "client")
        keyless = curve_peer(RawClient, c.ctx, c.coord.address, keys, None)
        stranger = curve_peer(
            RawClient, c.ctx, c.coord.address, keys, "mallory", directory="strangers"
        )
        c.peers += [engine, client, keyless, stranger]
        engine.register()
        wait_for(lambda: len(c.coord.stats()["engines"]) == 1)
        client.send(m([CONNECT]))
        for refused in (keyless, stranger):
            # A refused handshake leaves no connection to queue a message on.
            with contextlib.suppress(zmq.Again):
                refused.sock.send(m([CONNECT]), zmq.DONTWAIT)
        assert client.recv() == [m([CONNECT_ACK])]
        client.send(m([SUBMIT, 7, {}]), b"secret prompt")
        meta, prompt = engine.recv()
        assert prompt == b"secret prompt"
        engine.send(m([REPLY, [[um(meta)[1], False]]]), b"secret reply")
        assert client.recv() == [m([REPLY, 7]), b"secret reply"]
        keyless.assert_silent(0.3)
        stranger.assert_silent(0.3)
        wait_for(lambda: c.coord.stats()["counters"]["auth_refused"] >= 2)
        assert c.coord.stats()["clients"] == 1


def test_curve_needs_both_keys(make_coordinator, keys):
    with pytest.raises(ValueError, match="both"):
        make_coordinator(curve_secret_key=keys / "server" / "coordinator.key_secret")


# -- the commands -----------------------------------------------------------------------


def test_keygen_writes_a_key_pair(tmp_path):
    result = subprocess.run(
        coordkit_command("keygen", str(tmp_path / "keys"), "alice"),
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    public, secret = zmq.auth.load_certificate(tmp_path / "keys" / "alice.key_secret")
    assert zmq.auth.load_certificate(tmp_path / "keys" / "alice.key") == (public, None)
    assert secret is not None and str(tmp_path / "keys" / "alice.key") in result.stdout


def test_serve_on_tcp_without_curve_warns_once(tmp_path, impl):
    command = coordkit_command(
        "serve", "--bind", "tcp://127.0.0.1:0", "--implementation", impl.name
    )
    server = subprocess.Popen(command, env=python_env(), stderr=subprocess.PIPE, text=True)
    try:
        listening = server.stderr.readline()
        warning = server.stderr.readline()
    finally:
        server.terminate()
        assert server.wait(10) == 0
    assert "listening" in listening
    assert "open to anyone who can reach it" in warning
    assert "warning" not in server.stderr.read()


def test_stats_watch_refreshes_a_live_table(make_cluster):
    with make_cluster(n_engines=1, transport="tcp") as c:
        command = coordkit_command(
            "stats", "--address", c.coord.address, "--watch", "--interval", "0.2"
        )
        watcher = subprocess.Popen(command, env=python_env(), stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)
        finally:
            watcher.send_signal(2)  # SIGINT, as a user ends it
            out, _ = watcher.communicate(timeout=10)
        assert watcher.returncode == 0
    screens = out.split("\x1b[H\x1b[2J")[1:]
    assert len(screens) >= 3
    assert re.search(r"submitted\s+0\s+0/s", screens[-1])
    assert "engine-0" in screens[-1]


def test_stats_table_rates():
    stats = {
        "implementation": "c",
        "policy": "prefix",
        "control_state": "running",
        "clients": 1,
        "inflight": 2,
        "counters": dict.fromkeys(
            ["submitted", "replies", "engine_failed", "timed_out", "busy", "no_engines",
             "malformed", "rerouted"], 0),
        "engines": [{"rank": 0, "identity": "e0", "state": "alive", "pending": 2}],
    }  # fmt: skip
    later = {**stats, "counters": {**stats["counters"], "submitted": 50, "replies": 48}}
    table = stats_table(later, stats, 0.5)
    assert re.search(r"submitted\s+50\s+100/s", table)
    assert re.search(r"completed\s+48\s+96/s", table)
    assert re.search(r"0\s+e0\s+alive\s+2", table)
