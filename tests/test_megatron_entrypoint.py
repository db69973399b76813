"""coordkit.megatron.entrypoint, as Megatron-Core's engine runs its coordinator:
in a spawned process, with a real Pipe and Event, the peers raw single-frame sockets.

No Megatron here: the peers know only 0.19's and main's frames
(tests/support/peers.py), and the call is the one
``start_listening_to_data_parallel_coordinator`` makes, keyword for keyword (0.19
and main make the same one). Which release it serves is asked of the installed
``megatron.core``: a stand-in package of the two releases' headers plays it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import coordkit.megatron
from coordkit._policies import MAX_PREFILL_WEIGHT
from coordkit.megatron import entrypoint
from tests.support.peers import (
    ABORT,
    CONNECT_ACK,
    PARTIAL,
    REPLY,
    SHUTDOWN,
    STATS,
    MainClient,
    MainEngine,
    RawClient,
    SingleFrameClient,
    SingleFrameEngine,
    finished_request,
    m,
    main_partial,
    um,
    wait_for,
)

TIMEOUT = 60.0  # a spawned Python imports coordkit on a shared machine

# The signature of DataParallelInferenceCoordinator.entrypoint at core_v0.19.0 and on
# main at d98e8a6, the same (less its cls): names, order and defaults, the policy enum
# as its value.
MEGATRON_SIGNATURE = [
    ("pipe_connection", inspect.Parameter.empty),
    ("ready_event", inspect.Parameter.empty),
    ("data_parallel_size", inspect.Parameter.empty),
    ("tokenizer", inspect.Parameter.empty),
    ("max_requests", inspect.Parameter.empty),
    ("inference_coordinator_port", None),
    ("deterministic_mode", False),
    ("block_size_tokens", None),
    ("enable_prefix_caching", False),
    ("prefix_caching_coordinator_policy", "first_prefix_block"),
    ("prefix_caching_routing_alpha", 0.5),
    ("schedule_output_path", None),
    ("hostname", None),
]


class Tokenizer:
    """A stand-in for Megatron's tokenizer: what the coordinator may call of it."""

    def detokenize(self, tokens: list[int]) -> str:
        return " ".join(map(str, tokens))


class Spawned:
    """The coordinator process, as 0.19's engine starts it, and the parent's ends."""

    def __init__(
        self, impl: Any, monkeypatch: pytest.MonkeyPatch, target: Any = entrypoint, **kwargs: Any
    ):
        # the child picks its implementation from the environment it inherits
        if impl.name == "py":
            monkeypatch.setenv("COORDKIT_PUREPYTHON", "1")
        else:
            monkeypatch.delenv("COORDKIT_PUREPYTHON", raising=False)
            monkeypatch.setenv("COORDKIT_REQUIRE_EXTENSION", "1")
        spawn = multiprocessing.get_context("spawn")
        self.pipe, child_pipe = spawn.Pipe()
        self.ready = spawn.Event()
        arguments = {
            "pipe_connection": child_pipe,
            "ready_event": self.ready,
            "data_parallel_size": 2,
            "tokenizer": Tokenizer(),
            "max_requests": 64,
            "inference_coordinator_port": None,
            "deterministic_mode": False,
            "block_size_tokens": 16,
            "enable_prefix_caching": False,
            "prefix_caching_coordinator_policy": "first_prefix_block",
            "prefix_caching_routing_alpha": 0.5,
            "schedule_output_path": None,
            "hostname": "127.0.0.1",
            **kwargs,
        }
        self.process = spawn.Process(target=target, kwargs=arguments)
        self.process.start()
        child_pipe.close()  # the child's end: ours is closed only by the child now
        self.ctx = zmq.Context()
        self.peers: list[Any] = []

    def address(self) -> str:
        assert self.pipe.poll(TIMEOUT), "the coordinator sent no address"
        address = self.pipe.recv()
        # then it closed its end, as 0.19 does
        assert self.pipe.poll(TIMEOUT)
        with pytest.raises(EOFError):
            self.pipe.recv()
        return address

    def peer(self, peer: Any) -> Any:
        self.peers.append(peer)
        return peer

    def stats(self, address: str) -> dict[str, Any]:
        """The coordinator's stats, asked for as a coordkit client does."""
        probe = self.peer(RawClient(self.ctx, address)).connect(coordkit=True)
        probe.send(m([STATS]))
        return um(probe.recv(TIMEOUT)[1])

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.ctx.term()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(TIMEOUT)


@pytest.fixture
def spawned(impl, monkeypatch) -> Iterator[Any]:
    started: list[Spawned] = []

    def start(**kwargs: Any) -> Spawned:
        started.append(Spawned(impl, monkeypatch, **kwargs))
        return started[-1]

    yield start
    for process in started:
        process.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_signature_is_megatron_cores(impl):
    *parameters, version = inspect.signature(entrypoint).parameters.values()
    assert [(p.name, p.default) for p in parameters] == MEGATRON_SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
    # coordkit's own: keyword-only, after every one Megatron passes
    assert (version.name, version.default, version.kind) == (
        "megatron_version",
        None,
        inspect.Parameter.KEYWORD_ONLY,
    )
    # one assignment swaps it in, and a class attribute that is a function is called as one
    holder = type("DataParallelInferenceCoordinator", (), {"entrypoint": classmethod(lambda c: c)})
    holder.entrypoint = coordkit.megatron.entrypoint
    assert holder.entrypoint is entrypoint


def test_serves_megatron_core_until_shutdown(impl, spawned):
    port = free_port()
    coordinator = spawned(inference_coordinator_port=port)
    address = coordinator.address()
    assert address == f"tcp://127.0.0.1:{port}"
    # not ready before data_parallel_size engines have registered
    assert not coordinator.ready.wait(0.5)
    engines = [
        coordinator.peer(SingleFrameEngine(coordinator.ctx, address, f"mp-coord-{rank}".encode()))
        for rank in range(2)
    ]
    engines[0].register()
    assert not coordinator.ready.wait(0.5)
    engines[1].register()
    assert coordinator.ready.wait(TIMEOUT)
    stats = coordinator.stats(address)
    assert stats["implementation"] == impl.name
    assert stats["policy"] == "least_loaded"
    assert [e["identity"] for e in stats["engines"]] == ["mp-coord-0", "mp-coord-1"]
    client = coordinator.peer(SingleFrameClient(coordinator.ctx, address))
    client.send(m([0]))
    assert client.recv_frame(TIMEOUT) == m([CONNECT_ACK])
    client.shutdown()
    coordinator.process.join(TIMEOUT)
    assert coordinator.process.exitcode == 0
    for engine in engines:
        engine.assert_silent(0.1)  # SHUTDOWN is the coordinator's, not the engines'


def test_a_taken_port_binds_another(impl, spawned):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        coordinator = spawned(inference_coordinator_port=port, data_parallel_size=0)
        address = coordinator.address()
    host, _, bound = address.rpartition(":")
    assert host == "tcp://127.0.0.1" and int(bound) not in (0, port)
    assert coordinator.ready.wait(TIMEOUT)  # no engine to wait for
    client = coordinator.peer(SingleFrameClient(coordinator.ctx, address)).connect()
    client.shutdown()
    coordinator.process.join(TIMEOUT)
    assert coordinator.process.exitcode == 0


def test_no_port_binds_any_and_prefix_caching_routes_by_prefix(impl, spawned):
    coordinator = spawned(
        data_parallel_size=1, enable_prefix_caching=True, block_size_tokens=4, hostname=None
    )
    address = coordinator.address()
    assert address.startswith("tcp://") and not address.endswith(":0")
    # bound where 0.19 binds: this host's name, as the engines will reach it
    assert socket.gethostbyname(socket.gethostname()) in address
    engine = coordinator.peer(SingleFrameEngine(coordinator.ctx, address, b"mp-coord-0"))
    engine.register()
    assert coordinator.ready.wait(TIMEOUT)
    assert coordinator.stats(address)["policy"] == "prefix"
    coordinator.peer(SingleFrameClient(coordinator.ctx, address)).connect().shutdown()
    coordinator.process.join(TIMEOUT)
    assert coordinator.process.exitcode == 0


def test_shutdown_before_the_engines_came(impl, spawned):
    coordinator = spawned(data_parallel_size=3)
    address = coordinator.address()
    coordinator.peer(SingleFrameClient(coordinator.ctx, address)).connect().shutdown()
    coordinator.process.join(TIMEOUT)
    assert coordinator.process.exitcode == 0
    assert not coordinator.ready.is_set()


@pytest.mark.parametrize(
    ("kwargs", "policy", "weight"),
    [
        ({}, "least_loaded", 32.0),
        ({"enable_prefix_caching": True}, "least_loaded", 32.0),  # no block size: no hashes
        ({"enable_prefix_caching": True, "block_size_tokens": 16}, "prefix", 32.0),
        (
            {"enable_prefix_caching": True, "block_size_tokens": 16, "routing_alpha": 0.8},
            "prefix",
            128.0,
        ),
        (
            {"enable_prefix_caching": True, "block_size_tokens": 16, "routing_alpha": 0.2},
            "prefix",
            8.0,
        ),
        (
            {"enable_prefix_caching": True, "block_size_tokens": 16, "routing_alpha": 1.0},
            "prefix",
            MAX_PREFILL_WEIGHT,
        ),
        (
            {"enable_prefix_caching": True, "block_size_tokens": 16, "routing_alpha": 0.0},
            "least_loaded",
            32.0,
        ),
        (
            {"enable_prefix_caching": True, "block_size_tokens": 16, "policy": "load_balanced"},
            "least_loaded",
            32.0,
        ),
        (
            {"enable_prefix_caching": True, "block_size_tokens": 16, "policy": "longest_prefix"},
            "prefix",
            32.0,
        ),
    ],
)
def test_routing_arguments(impl, kwargs, policy, weight):
    arguments = {"routing_alpha": 0.5, "policy": "first_prefix_block", **kwargs}
    got = coordkit.megatron._routing(
        arguments.get("enable_prefix_caching", False),
        arguments.get("block_size_tokens"),
        arguments["policy"],
        arguments["routing_alpha"],
    )
    assert got == pytest.approx((policy, weight))


def test_routing_takes_the_policy_enum(impl):
    import enum

    class PrefixCachingCoordinatorPolicy(str, enum.Enum):  # as 0.19 might spell it
        FIRST_PREFIX_BLOCK = "first_prefix_block"
        LOAD_BALANCED = "load_balanced"

    route = coordkit.megatron._routing
    assert route(True, 16, PrefixCachingCoordinatorPolicy.LOAD_BALANCED, 0.5)[0] == "least_loaded"
    assert route(True, 16, PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK, 0.5)[0] == "prefix"


def test_tokenizer_becomes_the_detokenizer(impl):
    detokenize = coordkit.megatron._detokenizer(Tokenizer())
    assert detokenize([1, 2, 3]) == "1 2 3"
    assert coordkit.megatron._detokenizer(None) is None


def test_bind_falls_back_when_the_port_is_taken(impl):
    with contextlib.ExitStack() as stack:
        taken = stack.enter_context(socket.socket())
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        coord = coordkit.megatron._bind(
            "127.0.0.1", port, dialect="megatron-core", implementation=impl.name
        )
        stack.callback(coord.stop)
        assert coord.address.startswith("tcp://127.0.0.1:")
        assert int(coord.address.rpartition(":")[2]) != port


def test_engines_counted_from_stats(impl, make_coordinator):
    """The readiness rule, in process: set once enough engines registered, never after a stop."""
    coord = make_coordinator(dialect="megatron-core")
    coord.start()
    try:
        ready, served = multiprocessing.get_context("spawn").Event(), threading.Event()
        ctx = zmq.Context()
        try:
            watcher = threading.Thread(
                target=coordkit.megatron._set_when_registered, args=(coord, 1, ready, served)
            )
            watcher.start()
            assert not ready.wait(0.2)
            engine = SingleFrameEngine(ctx, coord.address, b"mp-coord-0").register()
            wait_for(ready.is_set)
            watcher.join(TIMEOUT)
            engine.close()
            # a coordinator that stopped first: the watcher returns, the event stays unset
            unset = multiprocessing.get_context("spawn").Event()
            served.set()
            coordkit.megatron._set_when_registered(coord, 5, unset, served)
            assert not unset.is_set()
        finally:
            ctx.term()
    finally:
        coord.stop()


# -- which release: main's ---------------------------------------------------------


def stand_in_megatron(root: Path, main: bool) -> Path:
    """A ``megatron.core.inference.headers`` as the release has it, where it matters:
    main's Headers has ABORT_REQUEST (and the rest of main's headers), 0.19's has not."""
    package = root / "megatron" / "core" / "inference"
    package.mkdir(parents=True)
    for directory in (root / "megatron", root / "megatron" / "core", package):
        (directory / "__init__.py").write_text("")
    names = ["CONNECT = 0", "SUBMIT_REQUEST = 20", "ENGINE_REPLY = 21"]
    if main:
        names += ["ENGINE_REPLY_PARTIAL = 22", "ABORT_REQUEST = 23", "RELEASE_KV = 25"]
    body = "".join(f"    {name}\n" for name in names)
    (package / "headers.py").write_text(f"class _Headers:\n{body}\n\nHeaders = _Headers()\n")
    return root


def forget_megatron() -> None:
    for name in [name for name in sys.modules if name.split(".")[0] == "megatron"]:
        del sys.modules[name]


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """``installed(main)``: a stand-in Megatron on sys.path (a spawned child inherits it)."""

    def install(main: bool) -> None:
        monkeypatch.syspath_prepend(str(stand_in_megatron(tmp_path / f"m{int(main)}", main)))
        forget_megatron()

    yield install
    forget_megatron()  # what this test imported, sys.path restored


@pytest.mark.parametrize(("main", "version"), [(True, "main"), (False, "0.19")])
def test_installed_version_is_asked_of_megatron(impl, installed, main, version):
    installed(main)
    assert coordkit.megatron.installed_version()[0] == version


def test_installed_version_without_megatron(impl, monkeypatch):
    forget_megatron()
    monkeypatch.setitem(sys.modules, "megatron", None)  # not importable
    assert coordkit.megatron.installed_version() == (
        "0.19",
        "megatron.core is not importable here",
    )


def serve_main(coordinator: Spawned) -> None:
    """A main engine and a main client through the spawned coordinator: five fields as
    they came, a partial, an abort to the engine, the final."""
    address = coordinator.address()
    engine = coordinator.peer(MainEngine(coordinator.ctx, address, b"mp-coord-0")).register()
    assert coordinator.ready.wait(TIMEOUT)
    client = coordinator.peer(MainClient(coordinator.ctx, address)).connect()
    sent = client.submit(3, [1, 2], {"streaming": True})
    parsed, frame = engine.recv_parsed(TIMEOUT)
    server_rid = parsed[1]  # drawn from the coordinator's clock (docs/failover.md)
    assert frame == b"\x95\x14" + m(server_rid) + sent[3:]  # main's five fields, as they came
    engine.partial(main_partial(server_rid, [9]))
    assert client.recv_message(TIMEOUT) == (PARTIAL, 3, m(main_partial(server_rid, [9])))
    client.abort(3)
    assert engine.recv_parsed(TIMEOUT)[1] == m([ABORT, server_rid])
    engine.reply(finished_request(server_rid, generated_tokens=[9, 10]))
    header, rid, body = client.recv_message(TIMEOUT)
    assert (header, rid, um(body)["generated_text"]) == (REPLY, 3, "9 10")
    client.signal(SHUTDOWN)
    coordinator.process.join(TIMEOUT)
    assert coordinator.process.exitcode == 0


def test_serves_main_when_megatron_is_mains(impl, spawned, installed):
    installed(True)  # the child asks the Megatron it inherits
    serve_main(spawned(data_parallel_size=1))


def test_serves_main_when_asked(impl, spawned):
    target = functools.partial(entrypoint, megatron_version="main")
    serve_main(spawned(target=target, data_parallel_size=1))


def test_serves_019_when_megatron_is_019s(impl, spawned, installed):
    installed(False)
    coordinator = spawned(data_parallel_size=1)
    address = coordinator.address()
    engine = coordinator.peer(SingleFrameEngine(coordinator.ctx, address, b"mp-coord-0"))
    engine.register()
    assert coordinator.ready.wait(TIMEOUT)
    client = coordinator.peer(MainClient(coordinator.ctx, address)).connect()
    client.submit(3, [1, 2], {})
    header, server_rid, *rest = um(engine.recv_frame(TIMEOUT))
    assert (header, rest) == (20, [[1, 2], {}])  # four fields for 0.19's
    client.abort(3)
    engine.assert_silent(0.3)  # 0.19's engine would raise on ABORT
    client.signal(SHUTDOWN)
    coordinator.process.join(TIMEOUT)
    assert coordinator.process.exitcode == 0
