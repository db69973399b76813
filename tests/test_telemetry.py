"""What a coordinator tells of itself beyond its counters, on both implementations.

* each engine's tally in stats(): its requests (routed, completed, failed: with metrics
  on), its errors (bad and unknown reply entries, times gone), what its heartbeats say
  and how long ago, exported to Prometheus with bounded labels;
* a message's time in the coordinator, the routing decision, each engine's latency
  (engine_histograms), in metrics();
* STATS with ``{"metrics": 1}``: stats() and metrics() in one STATS_REPLY (a bare STATS
  as ever), and the clients with the most in flight, never in Prometheus.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from coordkit import Client, ErrorCode
from coordkit._shared import STATS_CLIENTS
from coordkit.metrics import scrape
from coordkit.protocol import unpackb
from tests.support.peers import (
    DISCONNECT,
    ERROR,
    HEARTBEAT,
    REPLY,
    STATS,
    STATS_REPLY,
    SUBMIT,
    m,
    um,
    wait_for,
)
from tests.support.scripted import TIMEOUT, run
from tests.support.threads import fake_engines


def engine_of(stats: dict, identity: str) -> dict:
    (engine,) = (e for e in stats["engines"] if e["identity"] == identity)
    return engine


def submit(client, rid: int) -> None:
    client.send(m([SUBMIT, rid, {"n": rid}]), m([rid]))


def answer(engine) -> int:
    """The engine's next SUBMIT answered: its server id."""
    server_rid = um(engine.recv()[0])[1]
    engine.send(m([REPLY, [[server_rid, False]]]), m("done"))
    return server_rid


@pytest.mark.parametrize("measured", [True, False], ids=["metrics", "no-metrics"])
def test_each_engines_tally(make_cluster, impl, measured):
    """routed, completed and failed (lost with it: re-sent elsewhere) per engine with
    metrics on (None off: nothing per request is kept then); its malformed and unknown
    entries and the times it was gone, its heartbeat's report and age, either way."""
    options = {"metrics_port": 0} if measured else {}
    with make_cluster(heartbeat_timeout=0.5, **options) as c:
        steady = c.add_coordkit_engine(b"steady")
        client = c.client(coordkit=True)
        for rid in range(3):
            submit(client, rid)
            answer(steady)
        assert [um(client.recv()[0])[:2] for _ in range(3)] == [[REPLY, r] for r in range(3)]
        steady.send(m([REPLY, [[1, False], [99, False]]]), m("late"), m("?"))  # unknown twice
        steady.send(m([REPLY, [["x", False]]]), m("bad"))  # malformed
        assert [um(f[0])[0] for f in steady.recv_all()] == [ERROR] * 3
        # An engine that heartbeats, takes a request, then goes silent: gone, its request
        # re-sent to the steady one (which heartbeats on meanwhile).
        flaky = c.add_coordkit_engine(b"flaky")
        flaky.send(m([HEARTBEAT, 0, 4]))
        wait_for(lambda: engine_of(c.coord.stats(), "flaky")["reported_capacity"] == 4)
        answered = 3
        while True:
            submit(client, rid := rid + 1)
            if flaky.sock.poll(200):
                flaky.recv()
                break
            answer(steady)
            client.recv()
            answered += 1
        while engine_of(c.coord.stats(), "flaky")["state"] != "gone":
            steady.send(m([HEARTBEAT, 2, 16]))
            time.sleep(0.1)
        answer(steady)  # the request flaky lost
        assert um(client.recv()[0]) == [REPLY, rid]
        stats = c.coord.stats()
    steady_tally, flaky_tally = engine_of(stats, "steady"), engine_of(stats, "flaky")
    assert (flaky_tally["gone"], steady_tally["gone"]) == (1, 0)
    assert (steady_tally["malformed_entries"], steady_tally["unknown_request"]) == (1, 2)
    assert (steady_tally["reported_pending"], steady_tally["reported_capacity"]) == (2, 16)
    assert 0 <= steady_tally["heartbeat_age"] < 0.5 < flaky_tally["heartbeat_age"]
    assert (flaky_tally["reported_pending"], flaky_tally["unknown_request"]) == (0, 0)
    requests = ("routed", "completed", "failed")
    if not measured:
        assert [steady_tally[k] for k in requests] == [flaky_tally[k] for k in requests]
        assert steady_tally["routed"] is None
        return
    assert [steady_tally[k] for k in requests] == [answered + 1, answered + 1, 0]
    assert [flaky_tally[k] for k in requests] == [1, 0, 1]


def test_the_engine_families_have_bounded_labels(make_cluster, impl):
    """Each engine's requests by outcome, errors by kind (every kind from the start),
    heartbeat report and age: labelled by its routing id."""
    with make_cluster(metrics_port=0) as c:
        engine = c.add_coordkit_engine(b"engine-x")
        client = c.client(coordkit=True)
        submit(client, 0)
        answer(engine)
        client.recv()
        engine.send(m([HEARTBEAT, 1, 8]))
        wait_for(lambda: engine_of(c.coord.stats(), "engine-x")["reported_pending"] == 1)
        text = scrape(c.coord)
    samples = dict(
        re.findall(r'^(coordkit_engine_\w+\{engine="engine-x"[^}]*\}) (\S+)', text, re.M)
    )
    for outcome, n in (("routed", 1), ("completed", 1), ("failed", 0)):
        assert (
            float(
                samples[f'coordkit_engine_requests_total{{engine="engine-x",outcome="{outcome}"}}']
            )
            == n
        )
    for kind in ("malformed_entries", "unknown_request", "gone"):
        assert (
            float(samples[f'coordkit_engine_errors_total{{engine="engine-x",kind="{kind}"}}']) == 0
        )
    assert float(samples['coordkit_engine_reported_pending{engine="engine-x"}']) == 1
    assert float(samples['coordkit_engine_capacity{engine="engine-x"}']) == 8
    assert 0 <= float(samples['coordkit_engine_heartbeat_age_seconds{engine="engine-x"}']) < 5
    assert "coordkit_engine_request_duration_seconds_bucket" not in text  # not asked for


def test_latencies_in_the_coordinator_and_by_engine(make_cluster, impl):
    """A message's time in the coordinator by direction (one observation per message: a
    batch is one), the routing decision one in 64, each engine's histograms."""

    async def body(address: str) -> None:
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            await client.wait_for_engines(2, timeout=TIMEOUT)
            for _ in range(4):
                await asyncio.gather(*(client.submit([i]) for i in range(40)))

    with make_cluster(metrics_port=0, engine_histograms=True) as c:
        with fake_engines(c.coord.address, 2, output_tokens=2, implementation=impl.name):
            run(body(c.coord.address))
        metrics, stats = c.coord.metrics(), c.coord.stats()
    latency = metrics["latency"]
    counts = {name: sum(h["buckets"]) for name, h in latency.items()}
    assert counts["final"] == 160
    assert 4 <= counts["coordinator_request"] <= 160  # a batch of requests is one message
    assert counts["coordinator_reply"] >= 1
    assert counts["routing_decision"] == 160 // 64
    for name in ("coordinator_request", "coordinator_reply", "routing_decision"):
        assert 0 < latency[name]["sum"] < counts[name]  # each well below a second
    assert len(metrics["decision_bounds"]) == len(metrics["latency_bounds"])
    assert metrics["decision_bounds"][0] == pytest.approx(50e-9)
    by_engine = metrics["engine_latency"]
    assert sorted(by_engine) == [0, 1]
    for engine in stats["engines"]:
        mine = by_engine[engine["rank"]]
        assert sum(mine["final"]["buckets"]) == engine["completed"] > 0
        assert sum(mine["first_reply"]["buckets"]) == engine["completed"]


def test_engine_histograms_are_metrics():
    with pytest.raises(ValueError, match="engine_histograms needs metrics_port"):
        from coordkit import Coordinator

        Coordinator("ipc:///tmp/never", engine_histograms=True)


def stats_reply(client, *fields) -> dict:
    client.send(m([STATS, *fields]))
    frames = client.recv()
    assert um(frames[0]) == [STATS_REPLY]
    return unpackb(frames[1])


def test_stats_with_metrics_in_one_reply(make_cluster, impl):
    """m([92, {"metrics": 1}]): stats() with metrics() under "metrics"; m([92]) and a map
    not asking: stats() alone; any other field: MALFORMED; a Megatron client: nothing."""
    with make_cluster(metrics_port=0) as c:
        client = c.client(coordkit=True)
        bare = stats_reply(client)
        assert "metrics" not in bare and "busiest_clients" in bare
        assert "metrics" not in stats_reply(client, {"metrics": 0})
        asked = stats_reply(client, {"metrics": 1})
        assert set(asked["metrics"]) == set(c.coord.metrics())
        assert asked["metrics"]["latency"]["final"]["buckets"] == [0] * 23
        client.send(m([STATS, 1]))
        assert um(client.recv()[0])[:3] == [ERROR, None, ErrorCode.MALFORMED]
        megatron = c.client()
        megatron.send(m([STATS, {"metrics": 1}]))
        megatron.assert_silent()

    async def body(address: str) -> tuple[dict, dict]:
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name
        ) as client:
            return await client.stats(), await client.stats(metrics=True)

    with make_cluster() as c:
        plain, with_metrics = run(body(c.coord.address))
    assert "metrics" not in plain
    assert with_metrics["metrics"]["latency"] is None  # not measured: no histograms


def test_the_busiest_clients(make_cluster, impl):
    """stats()["busiest_clients"]: the STATS_CLIENTS with most in flight, then by routing
    id; what each submitted (with metrics on); away clients flagged. Never exported."""
    with make_cluster(metrics_port=0) as c:
        engine = c.add_engine()
        clients = [
            c.client(coordkit=True, identity=b"c%02d" % i) for i in range(STATS_CLIENTS + 10)
        ]
        for i, client in enumerate(clients[:3]):
            for rid in range(3 - i):  # c00: 3 in flight, c01: 2, c02: 1
                submit(client, rid)
        wait_for(lambda: c.coord.stats()["inflight"] == 6)
        answer(engine)  # c00's first: 2 left, a tie with c01 (then by routing id)
        wait_for(lambda: c.coord.stats()["inflight"] == 5)
        clients[-1].send(m([DISCONNECT]))
        wait_for(lambda: c.coord.stats()["clients"] == STATS_CLIENTS + 9)
        stats = c.coord.stats()
        text = scrape(c.coord)
    listed = stats["busiest_clients"]
    assert len(listed) == STATS_CLIENTS
    assert [(x["identity"], x["inflight"]) for x in listed[:4]] == [
        ("c00", 2),
        ("c01", 2),
        ("c02", 1),
        ("c03", 0),
    ]
    assert [x["identity"] for x in listed[3:]] == [f"c{i:02}" for i in range(3, STATS_CLIENTS)]
    assert [x["submitted"] for x in listed[:4]] == [3, 2, 1, 0]
    assert not any(x["away"] or x["rebuild"] for x in listed)
    assert "c00" not in text


def test_a_routing_id_is_shown_as_text_only_when_it_is_printable_ascii(make_cluster, impl):
    """Random bytes often decode as UTF-8 (these did, to combining marks, in a client's
    generated id): shown as hex, as any id that is not printable ASCII."""
    garbled = b"c6\xdd\x96M*\xcc\x99"
    with make_cluster() as c:
        c.add_engine()
        for identity in (garbled, b"tenant-a", b"\x01\x02"):
            submit(c.client(coordkit=True, identity=identity), 0)
        wait_for(lambda: c.coord.stats()["inflight"] == 3)
        shown = {x["identity"] for x in c.coord.stats()["busiest_clients"]}
    assert shown == {garbled.hex(), "tenant-a", "0102"}
