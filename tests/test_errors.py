"""A user's mistake gets one clear error and loses nothing (docs/errors.md), on both
implementations: bad prompts and sampling params refused before anything is sent,
mistyped addresses, the command line's one-line errors, a removed option naming
its replacement, an ipc path already served refused and its socket file removed
on exit, the engine's registration flag, the clients count after departures."""

from __future__ import annotations

import argparse
import asyncio
import errno
import inspect
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import zmq

import coordkit
from coordkit import Client, Coordinator, Engine
from coordkit.protocol import Header
from coordkit.tools import cli
from tests.support.peers import ENGINE_HELLO, REBUILD_HELLO, engine_hello, m, wait_for
from tests.support.processes import coordkit_command, fake_engine_command, python_env
from tests.support.scripted import packb, run, scripted

TIMEOUT = 20.0
# The rebuild, as a coordkit coordinator grants it (pinned_clock: epoch 0).
GRANTED = {"rebuild": 1, "epoch": 0, "held_all": 1}
FORMS = "expected tcp://HOST:PORT, ipc:///path or inproc://name"
PROMPT_FORMS = "a str, a bytes-like object, or token ids (a sequence of ints in [0, 2**32))"
TOKEN_RULE = "not an int in [0, 2**32)"

#: The prompts a newcomer got wrong, and what each is told.
BAD_PROMPTS = [
    ({"a": 1}, TypeError, f"dict is not {PROMPT_FORMS}"),
    ([1.5, 2.0], TypeError, f"token 0 is 1.5 (float), {TOKEN_RULE}"),
    ([1, -1], ValueError, f"token 1 is -1, {TOKEN_RULE}"),
    ([2**40], ValueError, f"token 0 is {2**40}, {TOKEN_RULE}"),
    (object(), TypeError, f"object is not {PROMPT_FORMS}"),
]
BAD_PARAMS = [
    ([("top_k", 2)], "list"),
    ("temperature=0", "str"),
    (0.5, "float"),
]


def command(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        coordkit_command(*args), env=python_env(), capture_output=True, text=True, timeout=timeout
    )


# -- prompts and sampling params: refused at submit, nothing sent ----------------------


@pytest.mark.parametrize(
    ("prompt", "error", "text"), BAD_PROMPTS, ids=["dict", "floats", "-1", "2**40", "object"]
)
def test_a_bad_prompt_is_refused_before_anything_is_sent(tmp_path, impl, prompt, error, text):
    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            for call, where in ((client.submit, "prompt"), (client.stream, "prompt")):
                with pytest.raises(error) as caught:
                    call(prompt)
                assert str(caught.value) == f"coordkit: {where}: {text}"
            with pytest.raises(error) as caught:
                client.submit_many([[1, 2], prompt])  # the good one is not sent either
            assert str(caught.value) == f"coordkit: prompt 1: {text}"
            await script.silent()
            assert client.pending == 0
            client.submit([1, 2])  # the client is as good as before
            assert (await script.recv())[1] == packb([1, 2])

    run(body())


@pytest.mark.parametrize(("params", "kind"), BAD_PARAMS)
def test_sampling_params_that_are_not_a_map_are_refused(tmp_path, impl, params, kind):
    async def body():
        async with scripted(tmp_path, impl, grant=True) as (script, client):
            for call, prompt in (
                (client.submit, [1]),
                (client.stream, [1]),
                (client.submit_many, [[1]]),
            ):
                with pytest.raises(TypeError) as caught:
                    call(prompt, params)
                assert str(caught.value) == (
                    f"coordkit: sampling_params must be a map (a dict) or None, not {kind}"
                )
            await script.silent()

    run(body())


# -- addresses ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("localhost:5555", "no transport"),
        ("foo", "no transport"),
        ("tcp://localhost", "no HOST:PORT"),
        ("tcp://127.0.0.1:99999", "port '99999' is not 0-65535 or *"),
        ("ipc://", "no path"),
        ("http://127.0.0.1:5555", "unknown transport 'http'"),
    ],
)
def test_a_mistyped_address_is_one_line(impl, address, problem):
    text = f"coordkit: bad address {address!r} ({problem}): {FORMS}"
    with pytest.raises(ValueError) as caught:
        asyncio.run(Client.connect(address, timeout=1.0, implementation=impl.name))
    assert str(caught.value) == text
    with pytest.raises(ValueError) as caught:
        Engine(address, implementation=impl.name)
    assert str(caught.value) == text
    with pytest.raises(ValueError) as caught:
        Coordinator(address, implementation=impl.name)
    assert str(caught.value) == text
    with pytest.raises(TypeError, match=r"^coordkit: an address is a str \(.*\), not int$"):
        Engine(5555, implementation=impl.name)  # type: ignore[arg-type]


# -- the command line: one line, exit status 2 ------------------------------------------------


def test_stats_of_a_mistyped_address():
    result = command("stats", "--address", "foo")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"coordkit stats: bad address 'foo' (no transport): {FORMS}\n"


def test_a_usage_error_is_one_line():
    for args, text in [
        (["serve"], "coordkit serve: the following arguments are required: --bind"),
        (
            ["serve", "--bind", "tcp://127.0.0.1:0", "--policy", "fastest"],
            "coordkit serve: argument --policy: invalid choice: 'fastest'",
        ),
        (["frobnicate"], "coordkit: argument COMMAND: invalid choice: 'frobnicate'"),
        (
            ["stats", "--address", "ipc:///x", "--timeout", "soon"],
            "coordkit stats: argument --timeout: invalid float value: 'soon'",
        ),
    ]:
        result = command(*args)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(text), result.stderr
        assert result.stderr.endswith(" --help)\n") and result.stderr.count("\n") == 1


def test_version():
    result = command("--version")
    assert result.returncode == 0
    assert result.stdout == (
        f"coordkit {coordkit.__version__} (implementation {coordkit.IMPLEMENTATION})\n"
    )


def test_every_option_says_its_default():
    commands = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help is argparse.SUPPRESS or action.nargs == 0 or action.required:
                continue  # hidden (a removed option), a flag, or one that must be given
            if action.option_strings:
                assert "default" in formatter._get_help_string(action), (name, action.dest)
    result = command("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    text = text[text.index("options:") :]
    defaults = inspect.signature(Coordinator).parameters
    for option, default in [
        ("--policy {", "least_loaded"),
        ("--max-inflight N", defaults["max_inflight"].default),
        ("--drain-timeout S", defaults["drain_timeout"].default),
        ("--heartbeat-timeout S", defaults["heartbeat_timeout"].default),
        ("--prefix-ttl S", defaults["prefix_ttl"].default),
    ]:
        after = text[text.index(option) :]
        assert f"(default: {default})" in after[: after.index(" --", 2)], option


def test_a_removed_option_names_its_replacement(impl):
    hint = "prefix_prefill_weight (32·α/(1−α) for the old α: the same ratio of affinity to load)"
    with pytest.raises(TypeError) as caught:
        Coordinator("tcp://127.0.0.1:0", implementation=impl.name, prefix_alpha=0.5)
    assert str(caught.value) == f"coordkit: prefix_alpha is gone: use {hint}"
    for subcommand in ("serve", "demo", "replay"):
        result = command(subcommand, "--prefix-alpha", "0.5")
        assert result.returncode == 2
        assert result.stderr == (
            f"coordkit {subcommand}: --prefix-alpha is gone: use --{hint.replace('_', '-', 2)} "
            f"(see coordkit {subcommand} --help)\n"
        )


# -- an ipc path already served --------------------------------------------------------------


def answers(address: str) -> bool:
    """A coordinator answers a client's CONNECT at ``address``."""

    async def probe() -> bool:
        async with await Client.connect(address, timeout=TIMEOUT) as client:
            return "engines" in await client.stats()

    return asyncio.run(probe())


def test_an_ipc_path_served_is_refused(impl, tmp_path):
    path = tmp_path / "coord.sock"
    address = f"ipc://{path}"
    with Coordinator(address, implementation=impl.name) as first:
        with pytest.raises(zmq.ZMQError) as caught:
            Coordinator(address, implementation=impl.name)
        assert caught.value.errno == errno.EADDRINUSE
        assert str(caught.value) == (
            f"coordkit: {address} is in use: a coordinator (or another program) answers "
            "there; stop it, or bind another path"
        )
        assert answers(first.address)  # the first one kept its path
    assert not path.exists()  # removed on close


def test_a_tcp_port_in_use(impl):
    with Coordinator("tcp://127.0.0.1:0", implementation=impl.name) as first:
        with pytest.raises(zmq.ZMQError) as caught:
            Coordinator(first.address, implementation=impl.name)
        assert caught.value.errno == errno.EADDRINUSE
        assert str(caught.value) == f"coordkit: cannot bind {first.address}: Address already in use"


def test_a_stale_socket_file_is_replaced_and_a_plain_file_kept(impl, tmp_path):
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))  # a file nobody listens on: a coordinator killed
    listener.close()
    with Coordinator(f"ipc://{stale}", implementation=impl.name) as coord:
        assert answers(coord.address)
    assert not stale.exists()
    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    with pytest.raises(zmq.ZMQError, match=r"is not a socket file$"):
        Coordinator(f"ipc://{plain}", implementation=impl.name)
    assert plain.read_text() == "mine"


def test_a_second_serve_on_a_live_ipc_path(impl, tmp_path):
    path = tmp_path / "coordkit.sock"
    address = f"ipc://{path}"
    args = ["serve", "--bind", address, "--implementation", impl.name]
    first = subprocess.Popen(
        coordkit_command(*args), env=python_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        assert "coordkit listening on" in first.stderr.readline()
        second = command(*args)
        assert second.returncode == 2
        assert second.stderr == (
            f"coordkit serve: {address} is in use: a coordinator (or another program) "
            "answers there; stop it, or bind another path\n"
        )
        assert answers(address)
        first.send_signal(signal.SIGINT)
        assert first.wait(TIMEOUT) == 0
        assert not path.exists()
    finally:
        first.kill()
        first.wait()


# -- whether an engine was registered ------------------------------------------------------


def test_an_engine_against_nobody_is_not_registered(impl, tmp_path):
    with Engine(f"ipc://{tmp_path}/nothing-here.sock", implementation=impl.name) as engine:
        assert engine.connected and not engine.registered
        assert engine.wait_registered(0.3) is False
        assert engine.poll(0.05) == [] and not engine.registered


def test_an_engine_acknowledged(make_cluster, impl):
    cluster = make_cluster()
    with Engine(cluster.coord.address, implementation=impl.name) as engine:
        assert engine.wait_registered(TIMEOUT) is True
        # The rebuild is granted too, with the coordinator's epoch (pinned_clock: 0).
        assert engine.registered and engine.granted == {"batch": 1, **GRANTED}
        assert engine.poll(0.05) == []  # the ENGINE_ACK is no event
    with Engine(cluster.coord.address, implementation=impl.name, batch=False, rank=1) as engine:
        assert engine.wait_registered(TIMEOUT) and engine.granted == GRANTED
    with Engine(cluster.coord.address, implementation=impl.name, hello=False, rank=2) as engine:
        with pytest.raises(RuntimeError, match="hello=False is never acknowledged"):
            engine.wait_registered(0.1)


def test_a_request_before_the_ack_is_kept(impl, tmp_path):
    """What wait_registered() receives meanwhile is the next poll()'s."""
    router = zmq.Context.instance().socket(zmq.ROUTER)  # a coordinator, frame by frame
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/script.sock")
    try:
        with Engine(f"ipc://{tmp_path}/script.sock", implementation=impl.name) as engine:
            assert router.poll(TIMEOUT * 1000) and router.recv_multipart()[1] == b""
            hello = {"coordkit": 1, "ack": 1, "batch": 1, **REBUILD_HELLO}
            assert router.poll(TIMEOUT * 1000)
            assert engine_hello(router.recv_multipart()[1]) == hello
            identity = engine.identity
            router.send_multipart([identity, m([Header.SUBMIT_REQUEST, 7, {}]), m([1, 2])])
            router.send_multipart([identity, m([Header.ENGINE_ACK, {}])])
            assert engine.wait_registered(TIMEOUT) and engine.granted == {}
            [request] = engine.poll(0)
            assert (request.server_rid, request.prompt_tokens()) == (7, [1, 2])
    finally:
        router.close()


def test_only_an_engine_that_reads_it_gets_engine_ack(make_cluster):
    """A Megatron engine (the empty frame only) and a coordkit 0.1 engine (a hello
    without "ack") get no ENGINE_ACK: neither could parse it."""
    cluster = make_cluster()
    megatron = cluster.add_engine()
    old = cluster.add_coordkit_engine(batch=True)
    reader = cluster.add_engine()
    reader.send(m([ENGINE_HELLO, {"coordkit": 1, "ack": 1, "batch": 1}]))
    assert reader.recv(TIMEOUT) == [m([Header.ENGINE_ACK, {"batch": 1}])]
    megatron.assert_silent()
    old.assert_silent()
    assert [e["state"] for e in cluster.coord.stats()["engines"]] == ["alive"] * 3


def test_a_lost_coordinator_unregisters(impl, tmp_path):
    address = f"ipc://{tmp_path}/coord.sock"
    coord = Coordinator(address, implementation=impl.name)
    coord.start()
    with Engine(address, implementation=impl.name) as engine:
        assert engine.wait_registered(TIMEOUT)
        coord.stop()
        deadline = time.monotonic() + TIMEOUT
        while engine.registered:
            engine.poll(0.1)
            assert time.monotonic() < deadline
        coord = Coordinator(address, implementation=impl.name)
        coord.start()
        try:
            assert engine.wait_registered(TIMEOUT)
        finally:
            coord.stop()


def test_fake_engine_says_when_it_is_registered(make_cluster):
    cluster = make_cluster()
    address = cluster.coord.address
    process = subprocess.Popen(
        fake_engine_command(address, 4), env=python_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stderr.readline()
        granted = repr({"batch": 1, **GRANTED})
        assert line == f"coordkit engine 4: registered at {address} (granted {granted})\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0
        assert process.stderr.read() == ""  # that one line, nothing more
    finally:
        process.kill()
        process.wait()


# -- clients connected now -------------------------------------------------------------


def test_clients_that_left_are_not_counted(make_cluster, tmp_path):
    cluster = make_cluster()
    address = cluster.coord.address

    async def three_then_one() -> None:
        clients = [await Client.connect(address, timeout=TIMEOUT) for _ in range(3)]
        assert cluster.coord.stats()["clients"] == 3
        for client in clients[:2]:
            await client.close()  # DISCONNECT
        wait_for(lambda: cluster.coord.stats()["clients"] == 1)
        await clients[2].close()

    asyncio.run(three_then_one())
    wait_for(lambda: cluster.coord.stats()["clients"] == 0)
    # A client process that is killed says nothing: its connection's end is its departure.
    script = "import asyncio, os, sys, coordkit\n" + (
        "async def main():\n"
        f"    await coordkit.Client.connect({address!r}, timeout={TIMEOUT})\n"
        "    print('connected', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], env=python_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "connected\n"
        assert cluster.coord.stats()["clients"] == 1
        os.kill(process.pid, signal.SIGKILL)
        process.wait(TIMEOUT)
        wait_for(lambda: cluster.coord.stats()["clients"] == 0, TIMEOUT)
    finally:
        process.kill()
        process.wait()
    counters = cluster.coord.stats()["counters"]
    assert counters["clients_departed"] == 4
    assert counters["client_gone"] == 0  # none was unreachable: each left
