"""A Megatron engine that departs: its process exits without DISCONNECT (issue 39).

Megatron's engines (0.19's, main's) cannot say what reached them (no HELD), so for
them a connection that ended is a departure: whatever ``engine_grace`` says, it gets
no new request, and a send that finds it gone goes on at once to an engine left, as
Megatron main's coordinator does (``ROUTER_MANDATORY``'s EHOSTUNREACH, #6025). What a
blip may keep stays (tests/test_faults.py: a removed engine's late replies are
routed). Both loop cores, tcp, real processes; and the same departure through
Megatron's own coordinator, from the reference copies named by
``COORDKIT_MEGATRON_REFERENCE`` (tests/support/megatron_reference.py), compared with
coordkit's: what the client and each engine get.
"""

from __future__ import annotations

import contextlib
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import zmq

from tests.support.megatron_reference import (
    RELEASES,
    build_tree,
    reference_coordinator,
    release_dir,
)
from tests.support.peers import (
    REPLY,
    SUBMIT,
    MainClient,
    MainEngine,
    SingleFrameClient,
    finished_request,
    um,
    wait_for,
)
from tests.support.processes import single_frame_engine_process

SP = {"num_tokens_to_generate": 4}
GRACE = 30.0  # far longer than any wait below: a request left at the departed engine shows


def _client(version: str, ctx: zmq.Context, address: str) -> SingleFrameClient:
    """The release's client (main's sends five fields), connected."""
    kind = MainClient if version == "main" else SingleFrameClient
    return kind(ctx, address).connect()


def _finals(client: SingleFrameClient, rids: range, timeout: float) -> dict[int, Any]:
    """The finals of ``rids`` (each once), submitted now, within ``timeout`` seconds."""
    for rid in rids:
        client.submit(rid, [rid, 1], SP)
    finals: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(finals) < len(rids):
        left = deadline - time.monotonic()
        assert left > 0, f"{sorted(set(rids) - set(finals))} never resolved"
        frame = client.recv_frame(left)
        header, rid, body = um(frame)
        assert header == REPLY and rid in rids and rid not in finals
        finals[rid] = body
    return finals


@pytest.mark.parametrize("version", ["0.19", "main"])
def test_a_killed_engine_gets_no_new_request(make_cluster, version):
    """Three engine processes; one is SIGKILLed and 20 requests follow at once: all
    resolve from the two left, none waits for the grace (none was sent to the
    departed identity), and a second departure is the same."""
    with (
        make_cluster(
            transport="tcp",
            dialect="megatron-core",
            megatron_version=version,
            engine_grace=GRACE,
        ) as c,
        contextlib.ExitStack() as stack,
    ):
        processes = [
            stack.enter_context(
                single_frame_engine_process(
                    c.coord.address, f"mp-coord-{i}".encode(), main=version == "main"
                )
            )
            for i in range(3)
        ]
        wait_for(lambda: len(c.coord.stats()["engines"]) == 3, 30)
        client = _client(version, c.ctx, c.coord.address)
        c.peers.append(client)
        assert len(_finals(client, range(6), 10)) == 6
        for victim, first in ((1, 100), (0, 200)):
            processes[victim].send_signal(signal.SIGKILL)
            processes[victim].wait()
            finals = _finals(client, range(first, first + 20), 5)
            assert sorted(finals) == list(range(first, first + 20))
            assert all(body["prompt"] == [rid, 1] for rid, body in finals.items())
        stats = c.coord.stats()
        states = {e["identity"]: e["state"] for e in stats["engines"]}
        assert states["mp-coord-2"] == "alive"
        assert states["mp-coord-0"] in ("away", "gone") and states["mp-coord-1"] in ("away", "gone")
        assert stats["counters"]["rerouted"] == 0 and stats["inflight"] == 0


def test_a_departed_engines_last_replies_are_not_its_return(make_cluster):
    """An engine replies and closes at once: its finals reach the client, and, read
    after the monitor said its connection ended, they do not bring it back into the
    pool (it would get new requests it can never see). Ten in a row, each the only
    engine taking work when it gets its request."""
    with make_cluster(
        transport="tcp", dialect="megatron-core", megatron_version="main", engine_grace=GRACE
    ) as c:
        client = c.main_client()
        for i in range(10):
            engine = c.add_main_engine(f"gone-{i}".encode())
            client.submit(i, [i], SP)
            server_rid = um(engine.recv_frame())[1]
            engine.reply(finished_request(server_rid))
            engine.sock.close(linger=1000)  # its final goes out, then its connection ends
            assert client.recv_message()[:2] == (REPLY, i)
            wait_for(lambda i=i: c.coord.stats()["engines"][i]["state"] == "away")
        time.sleep(0.1)
        stats = c.coord.stats()
        assert [e["failures"] for e in stats["engines"]] == [1] * 10
        assert stats["counters"]["engines_back"] == 0 and stats["inflight"] == 0


# -- against Megatron's own coordinator ------------------------------------------------


def _wait_ready(process: subprocess.Popen, timeout: float = 30) -> None:
    """The reference coordinator said ready (its engines registered)."""
    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], timeout)
    assert readable and process.stdout.readline().strip() == "ready"


def _departure(
    ctx: zmq.Context, address: str, version: str, ready: Any, hold: bool = False
) -> dict[str, Any]:
    """The scripted departure against the coordinator at ``address``: three engines
    register, 6 requests, ``mp-coord-1`` closes its socket (linger 0, no DISCONNECT)
    having answered its share (or, with ``hold``, holding it), then 20 requests that
    the two engines left answer. What the client got (its finals, by client id; who
    answered each, apart) and the SUBMITs each engine got (less their server id)."""
    engines = {
        name: MainEngine(ctx, address, name.encode()).register()
        for name in ("mp-coord-0", "mp-coord-1", "mp-coord-2")
    }
    ready()
    client = _client(version, ctx, address)
    got: dict[str, list[Any]] = {name: [] for name in engines}
    finals: dict[int, Any] = {}

    def run(rids: range, answering: set[str]) -> None:
        for rid in rids:
            client.submit(rid, [rid, 1], SP)
        deadline = time.monotonic() + 3
        while len(finals) < rids.stop and time.monotonic() < deadline:
            for name in answering:
                for frame in engines[name].recv_frames(0.01):
                    data = um(frame)
                    assert data[0] == SUBMIT
                    got[name].append(data[2:])
                    engines[name].reply(finished_request(data[1], data[2], engine=name))
            while client.sock.poll(0):
                header, rid, body = um(client.recv_frame())
                assert header == REPLY and rid not in finals
                finals[rid] = body

    try:
        left = {"mp-coord-0", "mp-coord-2"}
        run(range(6), left if hold else {*left, "mp-coord-1"})
        got["mp-coord-1"] += [um(f)[2:] for f in engines["mp-coord-1"].recv_frames(0.01)]
        engines["mp-coord-1"].close()
        time.sleep(0.5)  # its end seen by both: Megatron's own loses a request sent meanwhile
        run(range(6, 26), left)
    finally:
        client.close()
        for engine in engines.values():
            engine.close()
    return {
        "finals": {rid: _less(body, "engine") for rid, body in finals.items()},
        "by_engine": {rid: body["engine"] for rid, body in finals.items()},
        "got": got,
    }


def _less(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def _submitted(version: str, rids: Any) -> list[Any]:
    """The SUBMIT fields after the server id that an engine gets for ``rids``."""
    return sorted([[rid, 1], SP, None] if version == "main" else [[rid, 1], SP] for rid in rids)


def _compare(make_cluster: Any, tmp_path: Any, version: str, grace: float, hold: bool) -> Any:
    """The departure through Megatron's own coordinator (its real zmq loop, in its own
    process), then through coordkit: theirs, ours, coordkit's stats."""
    tree = build_tree(release_dir(RELEASES[version]), tmp_path / "reference")
    ctx = zmq.Context()
    try:
        with reference_coordinator(tree, 3) as (process, address):
            theirs = _departure(ctx, address, version, lambda: _wait_ready(process), hold)
        with make_cluster(
            transport="tcp", dialect="megatron-core", megatron_version=version, engine_grace=grace
        ) as c:

            def registered() -> None:
                wait_for(lambda: len(c.coord.stats()["engines"]) == 3)

            ours = _departure(ctx, c.coord.address, version, registered, hold)
            stats = c.coord.stats()
    finally:
        ctx.term()
    return theirs, ours, stats


@pytest.mark.parametrize("version", ["0.19", "main"])
def test_a_departure_as_megatrons_coordinator_serves_it(make_cluster, tmp_path, version):
    """An engine that answered its share departs: through Megatron's coordinator and
    through coordkit the client gets the same 26 finals, the 20 after the departure
    from the two engines left (a SUBMIT to the gone identity would leave its request
    unresolved: for ever in Megatron's, for the grace in coordkit's), and the engines
    got what the client sent, each once. Which engine took which request may differ
    (the load each coordinator counts)."""
    theirs, ours, stats = _compare(make_cluster, tmp_path, version, GRACE, hold=False)
    for outcome in (theirs, ours):
        assert sorted(outcome["finals"]) == list(range(26))
        assert "mp-coord-1" not in [outcome["by_engine"][rid] for rid in range(6, 26)]
        assert sorted(s for sent in outcome["got"].values() for s in sent) == _submitted(
            version, range(26)
        )
    assert ours["finals"] == theirs["finals"]
    assert stats["counters"]["rerouted"] == 0 and stats["inflight"] == 0


@pytest.mark.parametrize("version", ["0.19", "main"])
def test_what_a_departed_engine_held_is_answered_where_megatrons_waits(
    make_cluster, tmp_path, version
):
    """Deliberately better: the departed engine held its share. Megatron's coordinator
    keeps those requests for a final that never comes; coordkit re-sends them as they
    came to the engines left once the grace is over. Everything else is the same."""
    theirs, ours, stats = _compare(make_cluster, tmp_path, version, 0.5, hold=True)
    held = {
        name: [s[0][0] for s in o["got"]["mp-coord-1"]]
        for name, o in (("theirs", theirs), ("ours", ours))
    }
    assert held["theirs"] and held["ours"]  # which ones: the load each counted
    assert sorted(theirs["finals"]) == sorted(set(range(26)) - set(held["theirs"]))
    assert sorted(ours["finals"]) == list(range(26))
    assert {ours["by_engine"][rid] for rid in held["ours"]} <= {"mp-coord-0", "mp-coord-2"}
    assert {rid: ours["finals"][rid] for rid in theirs["finals"]} == theirs["finals"]
    left = [s for name in ("mp-coord-0", "mp-coord-2") for s in ours["got"][name]]
    assert sorted(left) == _submitted(version, range(26))  # the held ones again, as they came
    assert stats["counters"]["rerouted"] == len(held["ours"]) and stats["inflight"] == 0


def test_the_reference_tree_imports_each_release(tmp_path):
    """Each release's coordinator package imports from the tree (a shim missing shows
    here first, not as a coordinator process that never said its address)."""
    for name in RELEASES.values():
        tree = build_tree(release_dir(name), tmp_path / name)
        command = "import megatron.core.inference.data_parallel_inference_coordinator.coordinator"
        done = subprocess.run(
            [sys.executable, "-c", command], cwd=tree, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
