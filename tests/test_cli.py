"""The ``coordkit`` command: ``serve`` and ``stats`` as subprocesses, ``bench`` delegation."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import zmq

import coordkit
from coordkit import Client
from coordkit.tools import cli
from coordkit.tools.fake_engine import FakeEngine
from tests.support.peers import (
    PARTIAL,
    REPLY,
    SHUTDOWN,
    STATS,
    SUBMIT,
    MainClient,
    MainEngine,
    RawClient,
    RawEngine,
    m,
    um,
    wait_for,
)
from tests.support.processes import coordkit_command, python_env

TIMEOUT = 20.0
LISTENING = re.compile(r"coordkit listening on (\S+) \(implementation (\w+), policy (\w+)\)")


class Serve:
    """``coordkit serve`` as a subprocess, its stderr read line by line on a thread."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            coordkit_command("serve", *args), env=python_env(), stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def listening(self) -> re.Match[str]:
        """The ``coordkit listening on ...`` line, once it came."""
        while (line := self.lines.get(timeout=TIMEOUT)) is not None:
            self.stderr.append(line)
            if match := LISTENING.fullmatch(line.strip()):
                return match
        raise AssertionError(f"serve exited without its line: {''.join(self.stderr)}")

    def wait(self) -> int:
        code = self.process.wait(TIMEOUT)
        while (line := self.lines.get(timeout=TIMEOUT)) is not None:
            self.stderr.append(line)
        return code

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def serve():
    """Starts ``coordkit serve`` processes, killed at teardown if still running."""
    started: list[Serve] = []

    def start(*args: str) -> Serve:
        started.append(Serve(*args))
        return started[-1]

    yield start
    for server in started:
        server.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_on_signal(impl, serve, signum):
    server = serve("--bind", "tcp://127.0.0.1:0", "--implementation", impl.name)
    address, implementation, policy = server.listening().groups()
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", address) and not address.endswith(":0")
    assert (implementation, policy) == (impl.name, "least_loaded")
    stats = asyncio.run(fetch_stats(address))
    assert stats["implementation"] == impl.name
    server.process.send_signal(signum)
    assert server.wait() == 0
    assert sum(bool(LISTENING.fullmatch(line.strip())) for line in server.stderr) == 1


def test_serve_speaks_megatrons_frames(impl, serve, tmp_path):
    """A client and an engine that know only Megatron-LM's layouts, against the command."""
    server = serve("--bind", f"ipc://{tmp_path}/c.sock", "--implementation", impl.name)
    address = server.listening().group(1)
    ctx = zmq.Context()
    try:
        engine = RawEngine(ctx, address, b"mp-coord-0").register()
        probe = RawClient(ctx, address).connect(coordkit=True)

        def registered() -> bool:
            probe.send(m([STATS]))
            return len(um(probe.recv(TIMEOUT)[1])["engines"]) == 1

        wait_for(registered)
        client = RawClient(ctx, address).connect()
        params = {"temperature": 1.0, "num_tokens_to_generate": 4}
        client.send(m([SUBMIT, 0, params]), m([1, 2, 3]))
        meta, prompt = engine.recv(TIMEOUT)
        assert um(meta)[0::2] == [SUBMIT, params] and prompt == m([1, 2, 3])
        engine.send(m([REPLY, [[um(meta)[1], False]]]), m({"generated_tokens": [4]}))
        assert client.recv(TIMEOUT) == [m([REPLY, 0]), m({"generated_tokens": [4]})]
        client.send(m([SHUTDOWN]))
        assert server.wait() == 0
    finally:
        ctx.destroy(linger=0)


def test_serve_speaks_megatron_mains_frames(impl, serve, tmp_path):
    """``--dialect megatron-core --megatron-version main``: main's client and engine."""
    server = serve(
        "--bind",
        f"ipc://{tmp_path}/c.sock",
        "--implementation",
        impl.name,
        "--dialect",
        "megatron-core",
        "--megatron-version",
        "main",
    )
    address = server.listening().group(1)
    ctx = zmq.Context()
    try:
        engine = MainEngine(ctx, address, b"mp-coord-0").register()
        client = MainClient(ctx, address).connect()
        # until the engine is registered a request is dropped: send until one arrives
        params = {"streaming": True}
        for rid in range(100):
            client.submit(rid, [rid], params)  # the prompt names the request
            if engine.sock.poll(100):
                break
        data, frame = engine.recv_parsed(TIMEOUT)
        rid, server_rid = data[2][0], data[1]
        # main's five fields, as they came
        assert frame == b"\x95\x14" + m(server_rid) + m([rid]) + m(params) + m(None)
        engine.partial({"request_id": server_rid, "new_tokens": [3]})
        assert client.recv_message(TIMEOUT)[:2] == (PARTIAL, rid)
        client.signal(SHUTDOWN)
        assert server.wait() == 0
    finally:
        ctx.destroy(linger=0)


def test_serve_megatron_version_needs_the_dialect(serve, tmp_path):
    server = serve("--bind", f"ipc://{tmp_path}/c.sock", "--megatron-version", "main")
    assert server.wait() == 2
    assert "".join(server.stderr) == (
        "coordkit serve: megatron_version='main' needs dialect='megatron-core'\n"
    )


def test_serve_stops_on_shutdown(impl, serve, tmp_path):
    server = serve("--bind", f"ipc://{tmp_path}/c.sock", "--implementation", impl.name)
    address = server.listening().group(1)

    async def shutdown():
        async with await Client.connect(address, timeout=TIMEOUT) as client:
            await client.shutdown_coordinator()

    asyncio.run(shutdown())
    assert server.wait() == 0


def test_serve_options(impl, serve, tmp_path):
    server = serve(
        "--bind",
        f"ipc://{tmp_path}/c.sock",
        "--implementation",
        impl.name,
        "--policy",
        "prefix",
        "--max-inflight",
        "100",
        "--max-inflight-per-engine",
        "50",
        "--heartbeat-timeout",
        "5",
        "--drain-timeout",
        "5",
        "--max-message-size",
        "1000000",
        "--seed",
        "7",
        "--prefix-prefill-weight",
        "0.5",
        "--prefix-decode-tokens",
        "3",
        "--block-size",
        "2",
        "--prefix-ttl",
        "60",
        "--prefix-max-entries",
        "1000",
        "--no-keep-prompts",
        "--detokenizer",
        "json:dumps",  # any importable callable of the token ids
    )
    address, _, policy = server.listening().groups()
    assert policy == "prefix"

    async def detokenized():
        async with await Client.connect(address, timeout=TIMEOUT) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            return await client.submit([1, 2, 3], {"detokenize": True}, block_size=2)

    stop = threading.Event()
    with FakeEngine(address, heartbeat_interval=None, output_tokens=3) as engine:
        thread = threading.Thread(target=engine.run, args=(stop,))
        thread.start()
        try:
            reply = asyncio.run(asyncio.wait_for(detokenized(), TIMEOUT))
        finally:
            stop.set()
            thread.join(TIMEOUT)
    assert reply["generated_text"] == json.dumps(FakeEngine.generate([1, 2, 3], 3))
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0


def test_serve_rejects_a_bad_address(serve):
    server = serve("--bind", "nonsense://x", "--implementation", "py")
    assert server.wait() == 2
    assert server.stderr == [
        "coordkit serve: bad address 'nonsense://x' (unknown transport 'nonsense'): "
        "expected tcp://HOST:PORT, ipc:///path or inproc://name\n"
    ]


def test_serve_requires_the_chosen_implementation(serve):
    try:
        coordkit.load_implementation("c")
    except ImportError:
        pass
    else:
        pytest.skip("the C implementation is available here")
    server = serve("--bind", "tcp://127.0.0.1:0", "--implementation", "c")
    assert server.wait() == 2
    assert len(server.stderr) == 1
    assert server.stderr[0].startswith("coordkit serve: the 'c' implementation is not available")


async def fetch_stats(address: str) -> dict:
    async with await Client.connect(address, timeout=TIMEOUT) as client:
        return await client.stats()


def test_stats_command(impl, make_coordinator):
    with make_coordinator() as coord:
        result = subprocess.run(
            coordkit_command("stats", "--address", coord.address),
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["implementation"] == impl.name
    assert stats["engines"] == []


def test_stats_command_without_coordinator(tmp_path):
    result = subprocess.run(
        coordkit_command("stats", "--address", f"ipc://{tmp_path}/none.sock", "--timeout", "0.3"),
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 2
    address = f"ipc://{tmp_path}/none.sock"
    assert result.stderr == f"coordkit stats: no coordinator answered at {address} within 0.3 s\n"


def test_bench_is_delegated(monkeypatch):
    calls = []
    bench = SimpleNamespace(main=lambda argv: calls.append(argv) or 3)
    monkeypatch.setitem(sys.modules, "coordkit.tools.bench", bench)
    monkeypatch.setattr(coordkit.tools, "bench", bench, raising=False)
    assert cli.main(["bench", "--sizes", "16", "--help"]) == 3
    assert calls == [["--sizes", "16", "--help"]]


def test_help():
    result = subprocess.run(
        coordkit_command("--help"),
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0
    for command in ("serve", "demo", "stats", "bench"):
        assert command in result.stdout
