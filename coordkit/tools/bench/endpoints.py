"""``coordkit bench --client`` and ``--end-to-end``: the endpoints' CPU per request.

**Client mode** measures a client process's own CPU time per request
(``getrusage``: all its threads, libzmq's I/O thread included), read right
before a measured load and right after its last reply. The load is the
issue's: one client process keeps ``window`` requests in flight in waves --
it submits a wave, awaits every reply, submits the next. Side by side, each
in its own process:

* ``plain`` -- a plain pyzmq client doing what Megatron-LM's
  ``InferenceClient.add_request`` does (:class:`PlainClient`): pack the whole
  request, one message each way, unpack the reply, a task that polls the
  socket and sleeps 5 ms when it is empty;
* ``submit`` / ``submit_many`` -- :class:`coordkit.Client`, one call per
  request or one call per wave; ``-raw`` takes the replies as bytes instead
  of decoding them (``raw=True``).

against a peer: ``coordinator`` is a coordkit Coordinator (the C loop) in its
own process with an echo engine process (two ranks on coordkit's Engine,
answering each request at once, at most 16 per reply); ``echo`` is a
stand-in that plays coordinator and engine in one process and grants
batches, so that the clients' batched path can be measured whatever the
coordinator does.

**End-to-end mode** runs a whole deployment, each part in its own process:
a coordinator, two engine ranks (one process each) echoing on coordkit's
Engine, and one client process. It reports requests per second (wall time
of the client's measured load) and every process's CPU per request.

Variants take turns within each repetition; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import zmq

from ... import IMPLEMENTATION, Client, load_implementation
from ...engine import Engine, Request
from ...protocol import Header, packb, parse_connect, unpackb
from .servers import _usage, coordinator_child
from .session import Failure, Processes
from .workload import ECHO_BATCH, SAMPLING, TIMEOUT, Prompt, reply_body, requests_at

__all__ = [
    "CLIENT_VARIANTS",
    "END_TO_END_VARIANTS",
    "PEERS",
    "PlainClient",
    "measure_clients",
    "measure_end_to_end",
]

CLIENT_VARIANTS = ("plain", "submit", "submit_many", "submit-raw", "submit_many-raw")
END_TO_END_VARIANTS = ("plain", "submit", "submit_many")
PEERS = ("coordinator", "echo")
ENGINE_RANKS = 2

SUBMIT, REPLY, REPLY_BATCH = int(Header.SUBMIT_REQUEST), int(Header.ENGINE_REPLY), 96
CONNECT, CONNECT_ACK, SUBMIT_BATCH = int(Header.CONNECT), int(Header.CONNECT_ACK), 95


# -- the plain client --------------------------------------------------------------------


class PlainClient:
    """What Megatron-LM's ``InferenceClient`` does, on plain pyzmq (its multipart
    layout, PR #6497): every request packed whole and sent as one message, a
    future per request, and a task that takes the replies one by one, polling
    the socket and sleeping 5 ms whenever it is empty, and resolving each
    future through ``call_soon_threadsafe`` as it does. Its record class is
    left out: the future gets the reply map."""

    def __init__(self, address: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.socket.send(packb([CONNECT]))
        if not self.socket.poll(int(TIMEOUT * 1000)):
            raise TimeoutError("no CONNECT_ACK")
        assert unpackb(self.socket.recv())[0] == CONNECT_ACK
        self.completion_futures: dict[int, asyncio.Future[Any]] = {}
        self.request_submission_times: dict[int, float] = {}
        self.next_request_id = 0
        self.loop = asyncio.get_running_loop()
        self.task = self.loop.create_task(self._recv_task())

    def add_request(self, prompt: Any, sampling_params: Any) -> asyncio.Future[Any]:
        request_id = self.next_request_id
        self.next_request_id += 1
        metadata = msgpack.packb([SUBMIT, request_id, sampling_params], use_bin_type=True)
        self.socket.send_multipart([metadata, msgpack.packb(prompt, use_bin_type=True)])
        future = self.loop.create_future()
        self.completion_futures[request_id] = future
        self.request_submission_times[request_id] = time.perf_counter()
        return future

    async def _recv_task(self) -> None:
        while True:
            try:
                metadata, body = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(0.005)
                continue
            header, request_id = msgpack.unpackb(metadata, raw=False)
            if header == REPLY:
                reply = msgpack.unpackb(body, raw=False)
                reply["latency"] = time.perf_counter() - self.request_submission_times.pop(
                    request_id
                )
                future = self.completion_futures.pop(request_id)
                if not future.done():
                    future.get_loop().call_soon_threadsafe(future.set_result, reply)

    async def close(self) -> None:
        self.task.cancel()
        self.socket.close()
        self.context.term()


# -- the children ------------------------------------------------------------------------


def _cpu() -> float:
    usage = _usage()
    return usage["user"] + usage["sys"]


def client_child(conn: Connection, variant: str, address: str, implementation: str) -> None:
    asyncio.run(_client(conn, variant, address, implementation))


async def _client(conn: Connection, variant: str, address: str, implementation: str) -> None:
    plain = variant == "plain"
    client: Any = (
        PlainClient(address)
        if plain
        else await Client.connect(address, timeout=TIMEOUT, implementation=implementation)
    )
    conn.send(("ready", False if plain else client.batch))
    try:
        while True:
            command = conn.recv()  # nothing is in flight between loads: block the loop
            if command[0] == "stop":
                return
            _, prompt, n, warmup, window = command
            load = _load(variant, client, prompt.token_ids())
            await _waves(load, warmup, window)
            conn.send(("warm",))
            if conn.recv()[0] != "go":
                return
            before, main_before, start = _cpu(), time.thread_time(), time.perf_counter()
            await _waves(load, n, window)
            wall, cpu = time.perf_counter() - start, _cpu() - before
            conn.send(("done", wall, cpu, time.thread_time() - main_before))
    finally:
        await client.close()


def _load(variant: str, client: Any, prompt: list[int]) -> Callable[[int], list[Any]]:
    """A function submitting ``k`` requests and returning their futures."""
    raw = variant.endswith("-raw")
    if variant == "plain":
        return lambda k: [client.add_request(prompt, SAMPLING) for _ in range(k)]
    if variant.startswith("submit_many"):
        return lambda k: client.submit_many([prompt] * k, SAMPLING, raw=raw)
    return lambda k: [client.submit(prompt, SAMPLING, raw=raw) for _ in range(k)]


async def _waves(load: Callable[[int], list[Any]], n: int, window: int) -> None:
    """``n`` requests, ``window`` at a time: submit them all, then await every reply."""
    done = 0
    while done < n:
        futures = load(min(window, n - done))
        for future in futures:
            await future
        done += len(futures)


def echo_engine_child(
    conn: Connection, address: str, ranks: list[int], implementation: str
) -> None:
    """Engine ranks on coordkit's Engine answering every request at once, with the
    bench's reply body, at most ECHO_BATCH per reply (two ranks in one process
    for the client bench, one per process end to end)."""
    body = reply_body()
    stop = threading.Event()
    counts = {"messages": 0, "entries": 0}
    engines = [
        Engine(address, rank, identity=f"echo-{rank}", implementation=implementation)
        for rank in ranks
    ]
    conn.send(("ready",))
    threading.Thread(target=_answer, args=(conn, stop, counts), daemon=True).start()
    try:
        wait = 0.01 if len(engines) == 1 else 0.0
        while not stop.is_set():
            idle = True
            for engine in engines:
                rids = [e.server_rid for e in engine.poll(wait) if type(e) is Request]
                for start in range(0, len(rids), ECHO_BATCH):
                    engine.reply([(rid, body) for rid in rids[start : start + ECHO_BATCH]])
                    counts["messages"] += 1
                counts["entries"] += len(rids)
                idle = idle and not rids
            if idle and len(engines) > 1:
                time.sleep(0.0002)  # two ranks share one thread: do not spin on both
    finally:
        for engine in engines:
            engine.close()


def _answer(conn: Connection, stop: threading.Event, counts: dict[str, int]) -> None:
    while True:
        try:
            command = conn.recv()[0]
        except EOFError:
            stop.set()
            return
        if command == "sample":
            conn.send(("usage", _usage(), dict(counts)))
        else:
            stop.set()
            return


def batch_echo_child(conn: Connection, endpoint: str, implementation: str) -> None:
    """A stand-in for a coordinator that grants batches, with an echo engine in it:
    it answers CONNECT (granting batches when asked), a SUBMIT with its reply,
    and a SUBMIT_BATCH with REPLY_BATCH messages of at most ECHO_BATCH.

    It costs as little as plain pyzmq allows, so that the client it serves is
    not kept waiting: the prompts are received into one scratch buffer
    (``recv_into``), the body sent is one frame shared by reference."""
    codec = load_implementation(implementation).codec
    body = zmq.Frame(reply_body())
    scratch = bytearray(1 << 16)
    context = zmq.Context()
    try:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(endpoint)
        conn.send(("ready", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)
        send, recv, recv_into = sock.send, sock.recv, sock.recv_into
        more = zmq.SNDMORE
        while True:
            for item, _ in poller.poll():
                if item == conn.fileno():
                    if conn.recv()[0] == "stop":
                        return
                    continue
                for _ in range(64):
                    try:
                        identity = recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    metadata = recv()
                    header = codec.read_header(metadata)[0]
                    if header == SUBMIT_BATCH:
                        entries = codec.read_submit_batch(metadata)
                        for _, _, _, hashed in entries:
                            recv_into(scratch)
                            if hashed:
                                recv_into(scratch)
                        rids = [entry[0] for entry in entries]
                        for start in range(0, len(rids), ECHO_BATCH):
                            chunk = rids[start : start + ECHO_BATCH]
                            send(identity, more)
                            send(packb([REPLY_BATCH, [[rid, True] for rid in chunk]]), more)
                            for _ in range(len(chunk) - 1):
                                send(body, more, copy=False)
                            send(body, copy=False)
                    elif header == SUBMIT:
                        rid = codec.read_submit(metadata)[2]
                        sock.send_multipart([identity, packb([REPLY, rid]), body], copy=False)
                    elif header == CONNECT:
                        hello = parse_connect([metadata])
                        ack = [CONNECT_ACK, {"batch": 1}] if hello.batch else [CONNECT_ACK]
                        sock.send_multipart([identity, packb(ack)])
                    while sock.getsockopt(zmq.RCVMORE):  # what was not read above
                        recv_into(scratch)
    finally:
        context.destroy(linger=0)


# -- the sessions ---------------------------------------------------------------------------


def _endpoints(args: argparse.Namespace, directory: str, name: str) -> str:
    return "tcp://127.0.0.1:*" if args.transport == "tcp" else f"ipc://{directory}/{name}"


class _Bench(Processes):
    """Server processes and one client process per variant, driven in turns."""

    def __init__(self, variant: str):
        super().__init__(variant)
        self.clients: dict[str, Any] = {}
        self.batch: dict[str, bool] = {}

    def _coordinator(self, args: argparse.Namespace, directory: str, name: str) -> str:
        self.coordinator = self._start(
            "coordinator",
            coordinator_child,
            "c",
            [_endpoints(args, directory, name)],
            args.policy,
            {},
        )
        return str(self._receive(self.coordinator)[1])

    def _client(self, key: str, variant: str, address: str, implementation: str) -> None:
        proc = self._start(f"client-{key}", client_child, variant, address, implementation)
        self.batch[key] = self._receive(proc)[1]
        self.clients[key] = proc

    def _wait_for_engines(self, count: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self._call(self.coordinator, ("engines",))[1] < count:
            if time.monotonic() > deadline:
                raise Failure(f"the {count} engine ranks did not register")
            time.sleep(0.01)

    def _load(
        self, key: str, prompt: Prompt, n: int, warmup: int, window: int, around: list[Any]
    ) -> tuple[float, float, float, list[Any], list[Any]]:
        """Warm up, then the measured load: (wall, client cpu, its main thread's,
        samples before, after)."""
        client = self.clients[key]
        client.conn.send(("load", prompt, n, warmup, window))
        self._receive(client, timeout=None)
        before = [self._call(proc, ("sample",)) for proc in around]
        client.conn.send(("go",))
        _, wall, cpu, main = self._receive(client, timeout=None)
        after = [self._call(proc, ("sample",)) for proc in around]
        return wall, cpu, main, before, after


class ClientBench(_Bench):
    """One peer (a coordinator with an echo engine, or the batch echo stand-in) and
    a client process per variant."""

    def __init__(self, peer: str, variants: list[str], args: argparse.Namespace, directory: str):
        super().__init__(f"client-{peer}")
        implementation = IMPLEMENTATION
        try:
            if peer == "coordinator":
                address = self._coordinator(args, directory, "client-coordinator")
                engine = self._start("engine", echo_engine_child, address, [0, 1], implementation)
                self._receive(engine)
                self._wait_for_engines(ENGINE_RANKS)
            else:
                stand_in = self._start(
                    "echo",
                    batch_echo_child,
                    _endpoints(args, directory, "client-echo"),
                    implementation,
                )
                address = self._receive(stand_in)[1]
            for variant in variants:
                self._client(variant, variant, address, implementation)
        except BaseException:
            self.close()
            raise

    def run(self, variant: str, prompt: Prompt, n: int, warmup: int, window: int) -> dict[str, Any]:
        wall, cpu, main, _, _ = self._load(variant, prompt, n, warmup, window, [])
        return {
            "requests": n,
            "client_us": cpu / n * 1e6,
            # the rest is libzmq's I/O thread, moving the frames through the kernel
            "client_main_us": main / n * 1e6,
            "requests_per_s": n / wall,
            "wall_s": wall,
            "batch": self.batch[variant],
        }


class EndToEnd(_Bench):
    """A coordinator, ENGINE_RANKS engine processes and a client process per variant."""

    def __init__(self, variants: list[str], args: argparse.Namespace, directory: str):
        super().__init__("end-to-end")
        implementation = IMPLEMENTATION
        try:
            address = self._coordinator(args, directory, "end-to-end")
            self.engines = []
            for rank in range(ENGINE_RANKS):
                engine = self._start(
                    f"engine-{rank}", echo_engine_child, address, [rank], implementation
                )
                self._receive(engine)
                self.engines.append(engine)
            self._wait_for_engines(ENGINE_RANKS)
            for variant in variants:
                self._client(variant, variant, address, implementation)
        except BaseException:
            self.close()
            raise

    def run(self, variant: str, prompt: Prompt, n: int, warmup: int, window: int) -> dict[str, Any]:
        around = [self.coordinator, *self.engines]
        wall, cpu, _, before, after = self._load(variant, prompt, n, warmup, window, around)

        def used(i: int) -> float:
            b, a = before[i][1], after[i][1]
            return float(a["user"] + a["sys"] - b["user"] - b["sys"])

        engine_cpu = [used(1 + rank) for rank in range(ENGINE_RANKS)]
        served = [
            after[1 + rank][2]["entries"] - before[1 + rank][2]["entries"]
            for rank in range(ENGINE_RANKS)
        ]
        messages = sum(
            after[1 + rank][2]["messages"] - before[1 + rank][2]["messages"]
            for rank in range(ENGINE_RANKS)
        )
        return {
            "requests": n,
            "requests_per_s": n / wall,
            "wall_s": wall,
            "client_us": cpu / n * 1e6,
            "coordinator_us": used(0) / n * 1e6,
            "engines_us": sum(engine_cpu) / n * 1e6,
            # each engine process over the requests it answered
            "engine_us": [c / max(s, 1) * 1e6 for c, s in zip(engine_cpu, served, strict=True)],
            "reply_batch": sum(served) / max(messages, 1),
            "batch": self.batch[variant],
        }


# -- driving them ---------------------------------------------------------------------------


def _warmup(n: int, window: int) -> int:
    return min(n, max(2 * window, n // 20))


def measure_clients(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    benches: dict[str, ClientBench] = {}
    try:
        for peer in args.peers:
            try:
                benches[peer] = ClientBench(peer, list(args.clients), args, directory)
            except Failure as exc:
                failures[f"client against {peer}"] = str(exc)
        for repetition in range(args.repeat):
            for prompt in args.lengths:
                n = requests_at(args, prompt.tokens)
                for peer, bench in list(benches.items()):
                    for variant in args.clients:
                        try:
                            run = bench.run(
                                variant, prompt, n, _warmup(n, args.window), args.window
                            )
                        except Failure as exc:
                            failures[f"client against {peer}"] = f"at {prompt.key} tokens: {exc}"
                            benches.pop(peer).close()
                            break
                        run.update(peer=peer, variant=variant, repetition=repetition)
                        run.update(prompt.describe())
                        runs.append(run)
                        print(
                            f"[{repetition + 1}/{args.repeat}] {prompt.key:>6} tokens {peer:>11} "
                            f"{variant:>15}: {run['client_us']:8.2f} µs/request "
                            f"({run['client_main_us']:.2f} in the main thread), "
                            f"{run['requests_per_s']:8.0f} req/s",
                            file=sys.stderr,
                        )
    finally:
        for bench in benches.values():
            bench.close()


def measure_end_to_end(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    try:
        bench = EndToEnd(list(args.end_to_end_clients), args, directory)
    except Failure as exc:
        failures["end to end"] = str(exc)
        return
    try:
        for repetition in range(args.repeat):
            for prompt in args.lengths:
                n = requests_at(args, prompt.tokens)
                for variant in args.end_to_end_clients:
                    run = bench.run(variant, prompt, n, _warmup(n, args.window), args.window)
                    run.update(variant=variant, repetition=repetition, **prompt.describe())
                    runs.append(run)
                    print(
                        f"[{repetition + 1}/{args.repeat}] {prompt.key:>6} tokens {variant:>11}: "
                        f"{run['requests_per_s']:8.0f} req/s, client {run['client_us']:.2f}, "
                        f"coordinator {run['coordinator_us']:.2f}, engines "
                        f"{run['engines_us']:.2f} µs/request",
                        file=sys.stderr,
                    )
    except Failure as exc:
        failures["end to end"] = str(exc)
    finally:
        bench.close()


def summarize(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple[Any, ...], Any]:
    """(peer, variant, prompt) or (variant, prompt) -> the medians of ``keys``."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        group = (run.get("peer"), run["variant"], run["prompt"])
        groups.setdefault(group, []).append(run)
    summary = {}
    for group, members in groups.items():
        point: dict[str, Any] = {k: statistics.median(r[k] for r in members) for k in keys}
        if "engine_us" in members[0]:
            ranks = len(members[0]["engine_us"])
            point["engine_us"] = [
                statistics.median(r["engine_us"][i] for r in members) for i in range(ranks)
            ]
        point["batch"] = members[0]["batch"]
        point["tokens"] = members[0]["tokens"]
        point["repetitions"] = len(members)
        summary[group] = point
    return summary
