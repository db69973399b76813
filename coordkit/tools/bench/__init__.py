"""``coordkit bench``: the coordinator process's own CPU time per request, side by side.

Every variant runs in its own process, with one client process and one engine
process (``RANKS`` engine sockets) as lean raw-pyzmq load generators:

* ``floor`` -- libzmq's ``zmq.proxy`` between a ROUTER (clients) and a DEALER
  (engines) carrying the same frames; no decoding, no state: this machine's limit;
* ``c`` / ``py`` -- the Cython and the reference coordinator, on DESIGN.md's
  multipart protocol;
* ``mono`` -- the design before the split: one msgpack message per request,
  unpacked and repacked whole by a Python loop (:class:`_Mono`).

For each prompt length the client first warms the path up, then the bench
reads the coordinator's ``getrusage`` (user and sys, all its threads,
libzmq's I/O thread included) right before the load and right after its last
reply: CPU time, not wall time, is the figure, because the load generators
share the cores. The memory test holds requests in flight at the engines and
reads the coordinator's VmRSS before and with them. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import msgpack
import zmq

import coordkit
from coordkit._routing_py import POLICIES
from coordkit.protocol import Header, block_hashes, packb, unpackb

__all__ = ["main", "VARIANTS", "LENGTHS"]

VARIANTS = ("floor", "c", "py", "mono")
LENGTHS = (16, 256, 2000, 8000, 32000)
RANKS = 2  # engine sockets in the one engine process
BATCH = 8  # finished requests per ENGINE_REPLY, at most
VOCAB = 150_000  # token ids are drawn below this
OUTPUT_TOKENS = 32  # generated tokens (and logprobs) in every reply body
BLOCK_SIZE = 16  # tokens per block hash with --policy prefix
MEMORY_PROMPT_TOKENS = 16  # the memory test measures per-request state, not prompts
SAMPLING = {
    "temperature": 0.8,
    "top_k": 0,
    "top_p": 0.95,
    "num_tokens_to_generate": OUTPUT_TOKENS,
    "return_log_probs": True,
    "termination_id": 2,
}

_TIMEOUT = 60.0  # seconds without progress before a point is declared failed
_STOP_TIMEOUT = 10.0  # seconds the coordinator gets to exit before it is terminated
_GRACE = 2.0  # the same for a load generator, and for any process after SIGTERM
_DRAIN = 64  # messages an engine socket handles before the next one gets a turn
_FLUSH_MS = 20  # an engine sends a short batch after this long without a request
_SPAWN = multiprocessing.get_context("spawn")  # children hold no state of ours
# Plain ints: the loops compare them per message.
_CONNECT, _CONNECT_ACK = int(Header.CONNECT), int(Header.CONNECT_ACK)
_SUBMIT, _REPLY = int(Header.SUBMIT_REQUEST), int(Header.ENGINE_REPLY)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    environment = _environment(args)
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus / 2:
        print(
            f"coordkit bench: warning: load average {load:.1f} on {cpus} CPUs; "
            "other processes will disturb the figures",
            file=sys.stderr,
        )
    runs: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="coordkit-bench-") as directory:
        try:
            _measure_cpu(args, directory, runs, failures)
            _measure_memory(args, directory, memory, failures)
        except KeyboardInterrupt:
            interrupted = True
            print("coordkit bench: interrupted; reporting what was measured", file=sys.stderr)
    summary = _summarize(runs)
    _print_cpu(args, summary)
    _print_memory(memory)
    for variant, reason in failures.items():
        print(f"FAILED {variant}: {reason}")
    if args.json:
        result = {
            "environment": environment,
            "config": _config(args),
            "runs": runs,
            "summary": {str(t): s for t, s in summary.items()},
            "memory": memory,
            "failures": failures,
            "seconds": round(time.monotonic() - started, 1),
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        _plot(args, summary, Path(args.plot))
    return 130 if interrupted else 1 if failures else 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="coordkit bench",
        description="Coordinator CPU time per request (user and sys of its own process) "
        "and memory per request in flight, for floor, c, py and mono side by side.",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument("--lengths", type=int, nargs="+", metavar="TOKENS", default=LENGTHS)
    parser.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="measured requests per point up to 2000 tokens; longer prompts get "
        "proportionally fewer, at least N/8 (default 60000, --quick 2000)",
    )
    parser.add_argument("--repeat", type=int, metavar="N", help="default 5, --quick 1")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--policy", choices=POLICIES, default="least_loaded", help="c and py")
    parser.add_argument(
        "--inflight",
        type=int,
        metavar="N",
        help="requests held in flight by c and py in the memory test; 0 skips "
        "(default 200000, --quick 20000)",
    )
    parser.add_argument(
        "--inflight-large",
        type=int,
        metavar="N",
        help="c alone, the 256 MiB target; 0 skips (default 1000000, --quick 0)",
    )
    parser.add_argument("--window", type=int, default=512, help="requests in flight per client")
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    parser.add_argument("--json", metavar="PATH", help="write every repetition here")
    parser.add_argument("--plot", metavar="PATH", help="PNG of µs/request against prompt length")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, smoke in (
        ("requests", 60_000, 2_000),
        ("repeat", 5, 1),
        ("inflight", 200_000, 20_000),
        ("inflight_large", 1_000_000, 0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, smoke if quick else full)
    if min(args.lengths) < 1 or args.requests < 1 or args.repeat < 1 or args.window < 1:
        parser.error("--lengths, --requests, --repeat and --window must be positive")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'coordkit[bench]'")
    return args


def _requests_at(args: argparse.Namespace, tokens: int) -> int:
    # Long prompts cost mostly copies: fewer requests keep the run short.
    return max(args.requests // 8, min(args.requests, args.requests * 2000 // tokens), 1)


# -- the orchestration (this process) --------------------------------------------------


def _measure_cpu(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    sessions: dict[str, _Session] = {}
    try:
        for variant in args.variants:
            try:
                sessions[variant] = _Session(variant, args, directory)
            except _Failure as exc:
                failures[variant] = str(exc)
        # Variants interleave within each repetition, so drift hits them all alike.
        for repetition in range(args.repeat):
            for tokens in args.lengths:
                n = _requests_at(args, tokens)
                warmup = min(n, max(2 * args.window, n // 20))
                for variant in list(sessions):
                    try:
                        run = sessions[variant].run(tokens, n, warmup, args.window)
                    except _Failure as exc:
                        failures[variant] = f"at {tokens} tokens: {exc}"
                        sessions.pop(variant).close()
                        continue
                    run.update(variant=variant, tokens=tokens, repetition=repetition)
                    runs.append(run)
                    print(
                        f"[{repetition + 1}/{args.repeat}] {tokens:>6} tokens {variant:>5}: "
                        f"{run['total_us']:8.2f} µs/request, {run['requests_per_s']:8.0f} req/s",
                        file=sys.stderr,
                    )
    finally:
        for session in sessions.values():
            session.close()


def _measure_memory(
    args: argparse.Namespace,
    directory: str,
    memory: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    # The large run goes twice: keeping each prompt to re-send it, and not.
    plan = [(v, args.inflight, True) for v in ("c", "py")]
    plan += [("c", args.inflight_large, keep) for keep in (True, False)]
    for variant, n, keep_prompts in plan:
        if n <= 0 or variant not in args.variants or variant in failures:
            continue
        warmup = min(n, 2 * args.window)
        session = None
        options = {"max_inflight": n, "keep_prompts": keep_prompts}
        try:
            session = _Session(variant, args, directory, options, hold_after=warmup)
            result = session.fill(n, warmup, args.window)
            result["keep_prompts"] = keep_prompts
        except _Failure as exc:
            failures[f"{variant} memory"] = f"holding {n} requests: {exc}"
            continue
        finally:
            if session is not None:
                session.close()
        memory.append(result)
        print(
            f"memory {variant:>5}: {n} in flight, {result['bytes_per_request']:.0f} bytes each, "
            f"RSS {result['rss_with'] / 2**20:.1f} MiB",
            file=sys.stderr,
        )


class _Failure(Exception):
    """A benchmark process failed; the message says which one and why."""


@dataclass
class _Proc:
    name: str  # "coordinator", "engine" or "client"
    process: BaseProcess
    conn: Connection  # commands to it, answers from it


class _Session:
    """One variant's coordinator, engine and client processes, and how to drive them.

    ``hold_after`` makes it a memory session: the engine answers that many
    requests (the warm-up), then holds every later one without replying.
    """

    def __init__(
        self,
        variant: str,
        args: argparse.Namespace,
        directory: str,
        coordinator_options: dict[str, Any] | None = None,
        hold_after: int | None = None,
    ):
        self.variant = variant
        self.procs: list[_Proc] = []
        self.held = _SPAWN.Value("q", 0, lock=False)  # requests the engine holds
        try:
            if args.transport == "tcp":
                endpoints = ["tcp://127.0.0.1:*"] * 2  # the ports are read back once bound
            else:
                endpoints = [f"ipc://{directory}/{variant}-{side}" for side in ("front", "back")]
            self.coordinator = self._start(
                "coordinator",
                _coordinator_child,
                variant,
                endpoints,
                args.policy,
                coordinator_options or {},
            )
            _, client_address, engine_address = self._receive(self.coordinator)
            self.engine = self._start(
                "engine", _engine_child, variant, engine_address, hold_after, self.held
            )
            self._receive(self.engine)
            self._wait_for_engines()
            prefix = args.policy == "prefix"
            self.client = self._start(
                "client", _client_child, variant, client_address, prefix, self.held
            )
            self._receive(self.client)
        except BaseException:
            self.close()
            raise

    def run(self, tokens: int, n: int, warmup: int, window: int) -> dict[str, Any]:
        """Warm up, then ``n`` requests with the coordinator's CPU sampled around them."""
        self.client.conn.send(("load", tokens, n, warmup, window))
        self._receive(self.client, timeout=None)  # warm: the client progresses or says why not
        _, messages0, entries0 = self._call(self.engine, ("stats",))
        before = self._call(self.coordinator, ("sample",))[1]
        self.client.conn.send(("go",))
        wall = self._receive(self.client, timeout=None)[1]
        after = self._call(self.coordinator, ("sample",))[1]
        _, messages1, entries1 = self._call(self.engine, ("stats",))
        user, sys_ = after["user"] - before["user"], after["sys"] - before["sys"]
        return {
            "requests": n,
            "total_us": (user + sys_) / n * 1e6,
            "user_us": user / n * 1e6,
            "sys_us": sys_ / n * 1e6,
            "requests_per_s": n / wall,
            "wall_s": wall,
            "reply_batch": (entries1 - entries0) / max(messages1 - messages0, 1),
            "context_switches": after["switches"] - before["switches"],
            "involuntary_switches": after["involuntary"] - before["involuntary"],
            "page_faults": after["page_faults"] - before["page_faults"],
            "rss_before": before["rss"],
            "rss_after": after["rss"],
        }

    def fill(self, n: int, warmup: int, window: int) -> dict[str, Any]:
        """Hold ``n`` requests at the engine; the coordinator's RSS before and with them."""
        self.client.conn.send(("fill", MEMORY_PROMPT_TOKENS, n, warmup, window))
        self._receive(self.client, timeout=None)
        before = self._call(self.coordinator, ("sample",))[1]
        self.client.conn.send(("go",))
        wall = self._receive(self.client, timeout=None)[1]
        self._wait(lambda: self.held.value >= n, f"the engine to hold {n} requests")
        held = self._call(self.coordinator, ("sample",))[1]
        cpu = held["user"] + held["sys"] - before["user"] - before["sys"]
        return {
            "variant": self.variant,
            "inflight": n,
            "prompt_tokens": MEMORY_PROMPT_TOKENS,
            "rss_before": before["rss"],
            "rss_with": held["rss"],
            "bytes_per_request": (held["rss"] - before["rss"]) / n,
            "submit_cpu_us": cpu / n * 1e6,
            "fill_s": wall,
        }

    def close(self) -> None:
        """Stop the processes, the coordinator first (its peers' exits then go unlogged).

        A client stopped in the middle of a load (a failure, Ctrl-C) does not
        read its commands: it is terminated after a short grace.
        """
        for proc in self.procs:
            try:
                proc.conn.send(("stop",))
            except OSError:
                pass  # it is gone already
            # The coordinator may have many requests in flight to fail first.
            proc.process.join(_STOP_TIMEOUT if proc is self.procs[0] else _GRACE)
            if proc.process.exitcode is None:
                proc.process.terminate()
                proc.process.join(_GRACE)
            if proc.process.exitcode is None:
                proc.process.kill()
                proc.process.join()
            proc.conn.close()
        self.procs = []

    def _start(self, name: str, target: Callable[..., None], *args: Any) -> _Proc:
        ours, theirs = _SPAWN.Pipe()
        process = _SPAWN.Process(
            target=_child,
            args=(theirs, target, *args),
            name=f"coordkit-bench-{self.variant}-{name}",
            daemon=True,
        )
        process.start()
        theirs.close()  # so that its death reads as EOF here
        proc = _Proc(name, process, ours)
        self.procs.append(proc)
        return proc

    def _call(self, proc: _Proc, command: tuple[Any, ...]) -> Any:
        proc.conn.send(command)
        return self._receive(proc)

    def _receive(self, proc: _Proc, timeout: float | None = _TIMEOUT) -> Any:
        """``proc``'s next message; a failure if it reports one, or any process dies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not proc.conn.poll(0.1):
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise _Failure(f"the {proc.name} did not answer within {timeout:.0f} s")
        try:
            message = proc.conn.recv()
        except EOFError:
            proc.process.join(_STOP_TIMEOUT)
            raise _Failure(f"the {proc.name} exited (code {proc.process.exitcode})") from None
        if message[0] == "error":
            raise _Failure(f"{proc.name}: {message[1]}")
        return message

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.process.exitcode is None:
                continue
            reason = f"exited with code {proc.process.exitcode}"
            if proc.conn.poll():  # its last word, when it had the time to say it
                try:
                    message = proc.conn.recv()
                except EOFError:
                    message = ()
                if message[:1] == ("error",):
                    reason = message[1]
            raise _Failure(f"the {proc.name} {reason}")

    def _wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _TIMEOUT
        while not condition():
            self._check_alive()
            if time.monotonic() > deadline:
                raise _Failure(f"timed out waiting for {what}")
            time.sleep(0.01)

    def _wait_for_engines(self) -> None:
        # c and py would drop a plain client's requests while no engine is registered.
        deadline = time.monotonic() + _TIMEOUT
        while self._call(self.coordinator, ("engines",))[1] < RANKS:
            if time.monotonic() > deadline:
                raise _Failure(f"the {RANKS} engine ranks did not register")
            time.sleep(0.01)


# -- the child processes ---------------------------------------------------------------


def _child(conn: Connection, target: Callable[..., None], *args: Any) -> None:
    """A child's entry point: failures are reported to the bench, not just printed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle
    try:
        target(conn, *args)
    except EOFError:
        pass  # the bench is gone: so are we
    except BaseException as exc:
        traceback.print_exc()
        try:
            conn.send(("error", "".join(traceback.format_exception_only(exc)).strip()))
        except OSError:
            pass
        raise SystemExit(1) from None


def _usage() -> dict[str, float]:
    """This process's CPU time (every thread), context switches, faults and resident memory."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "user": usage.ru_utime,
        "sys": usage.ru_stime,
        "switches": usage.ru_nvcsw + usage.ru_nivcsw,
        "involuntary": usage.ru_nivcsw,
        "page_faults": usage.ru_minflt + usage.ru_majflt,
        "rss": rss * 1024,
    }


def _coordinator_child(
    conn: Connection,
    variant: str,
    endpoints: list[str],
    policy: str,
    options: dict[str, Any],
) -> None:
    context = zmq.Context()
    server: _Server
    if variant == "floor":
        server = _Floor(context, *endpoints)
    elif variant == "mono":
        server = _Mono(context, endpoints[0])
    else:
        server = _Coordkit(context, variant, endpoints[0], policy, options)
    conn.send(("ready", server.client_address, server.engine_address))
    # The loop runs here; a thread answers the bench (rarely: a few times per point).
    threading.Thread(target=_answer, args=(conn, server), daemon=True).start()
    try:
        server.serve()
    finally:
        context.destroy(linger=0)


def _answer(conn: Connection, server: _Server) -> None:
    while True:
        try:
            command = conn.recv()[0]
        except EOFError:
            os._exit(1)  # the bench is gone: do not outlive it
        if command == "sample":
            conn.send(("usage", _usage()))
        elif command == "engines":
            conn.send(("engines", server.engines()))
        else:
            server.stop()
            return


class _Server(Protocol):
    """What the coordinator child runs: a loop, its addresses, a way to stop it."""

    client_address: str
    engine_address: str

    def serve(self) -> None: ...

    def stop(self) -> None:
        """From the answering thread: make serve() return."""

    def engines(self) -> int:
        """How many engine ranks registered (read while the loop runs)."""


def _bound(context: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)  # as the coordinators do
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    return sock


class _Coordkit:
    def __init__(
        self,
        context: zmq.Context,
        variant: str,
        endpoint: str,
        policy: str,
        options: dict[str, Any],
    ):
        implementation = coordkit.load_implementation(variant)
        self.coord = implementation.Coordinator(endpoint, policy=policy, context=context, **options)
        self.client_address = self.engine_address = self.coord.address

    def serve(self) -> None:
        self.coord.serve_forever()

    def stop(self) -> None:
        self.coord.stop(timeout=0)

    def engines(self) -> int:
        return len(self.coord.stats()["engines"])


class _Floor:
    """libzmq's proxy: clients on a ROUTER, engines on a DEALER; nothing decoded, no state.

    ``proxy_steerable`` is ``zmq.proxy`` with a control socket, the way to stop it.
    """

    def __init__(self, context: zmq.Context, front: str, back: str):
        self.front = _bound(context, zmq.ROUTER, front)
        self.back = _bound(context, zmq.DEALER, back)
        self.client_address = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.engine_address = self.back.getsockopt_string(zmq.LAST_ENDPOINT)
        control = f"inproc://coordkit-bench-floor-{id(self):x}"
        self.control = context.socket(zmq.PAIR)
        self.control.bind(control)
        self.stopper = context.socket(zmq.PAIR)  # used by the answering thread only
        self.stopper.connect(control)

    def serve(self) -> None:
        zmq.proxy_steerable(self.front, self.back, None, self.control)

    def stop(self) -> None:
        self.stopper.send(b"TERMINATE")

    def engines(self) -> int:
        return RANKS  # a DEALER cannot tell; it holds messages until an engine connects


class _Mono:
    """The design before the split: a Python loop that unpacks and repacks whole messages.

    Clients send ``[20, rid, prompt_tokens, sampling_params]`` as one msgpack
    message; engines reply ``[21, [[rid, reply_map], ...]]``. Ids are
    translated, engines taken round robin.
    """

    def __init__(self, context: zmq.Context, endpoint: str):
        self.sock = _bound(context, zmq.ROUTER, endpoint)
        self.client_address = self.engine_address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        wake = f"inproc://coordkit-bench-mono-{id(self):x}"
        self.wake = context.socket(zmq.PAIR)
        self.wake.bind(wake)
        self.waker = context.socket(zmq.PAIR)  # used by the answering thread only
        self.waker.connect(wake)
        self.ranks: list[bytes] = []

    def serve(self) -> None:
        sock, ranks = self.sock, self.ranks
        requests: dict[int, tuple[bytes, int]] = {}  # server rid -> (client, client rid)
        next_rid = 0
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.wake, zmq.POLLIN)
        while self.wake not in dict(poller.poll()):
            while True:
                try:
                    identity, message = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if not message:  # an engine registers with an empty frame
                    ranks.append(identity)
                    continue
                decoded = unpackb(message)
                if decoded[0] == _SUBMIT:
                    _, rid, prompt, sampling = decoded
                    requests[next_rid] = (identity, rid)
                    rank = ranks[next_rid % len(ranks)]
                    sock.send_multipart([rank, packb([_SUBMIT, next_rid, prompt, sampling])])
                    next_rid += 1
                elif decoded[0] == _REPLY:
                    for server_rid, reply in decoded[1]:
                        client, rid = requests.pop(server_rid)
                        sock.send_multipart([client, packb([_REPLY, rid, reply])])
                elif decoded[0] == _CONNECT:
                    sock.send_multipart([identity, packb([_CONNECT_ACK])])

    def stop(self) -> None:
        self.waker.send(b"")

    def engines(self) -> int:
        return len(self.ranks)


# -- load generators: pre-built bytes, raw pyzmq -----------------------------------------


def _fixarray(n: int) -> bytes:
    """The msgpack head of an array of ``n`` < 16 items (the items follow it, packed)."""
    return bytes([0x90 | n])


def _array_head(n: int, header: int) -> bytes:
    """The msgpack bytes that start an ``n``-array whose first item is ``header``."""
    return _fixarray(n) + bytes([header])  # the header: a positive fixint


def _rid(metadata: memoryview) -> int:
    """The second item of a msgpack array (the request id), read without the rest."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(metadata[:16])  # array head, header and an int fit in 11 bytes
    unpacker.read_array_header()
    unpacker.skip()
    return unpacker.unpack()  # type: ignore[no-any-return]


def _prompt(tokens: int) -> list[int]:
    rng = random.Random(tokens)
    return [rng.randrange(VOCAB) for _ in range(tokens)]


def _reply_body() -> bytes:
    """What a finished request's ENGINE_REPLY entry carries: a realistic msgpack map."""
    rng = random.Random(0)
    return packb(
        {
            "status": "COMPLETED",
            "generated_tokens": [rng.randrange(VOCAB) for _ in range(OUTPUT_TOKENS)],
            "generated_log_probs": [-rng.expovariate(2.0) for _ in range(OUTPUT_TOKENS)],
            "generated_length": OUTPUT_TOKENS,
            "finish_reason": "length",
            "latency": 0.4821,
        }
    )


def _submitter(variant: str, tokens: int, prefix: bool) -> Callable[[int], list[Any]]:
    """The frames of request ``rid``: everything but the id is built once."""
    prompt = _prompt(tokens)
    sampling = packb(SAMPLING)
    if variant == "mono":
        whole = packb(prompt) + sampling
        return lambda rid: [_array_head(4, _SUBMIT) + packb(rid) + whole]
    payload = [zmq.Frame(packb(prompt))]  # sent as a reference each time, not copied
    if prefix and variant != "floor":
        payload.append(zmq.Frame(block_hashes(prompt, BLOCK_SIZE)))
    return lambda rid: [_array_head(3, _SUBMIT) + packb(rid) + sampling, *payload]


def _client_child(conn: Connection, variant: str, address: str, prefix: bool, held: Any) -> None:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(_TIMEOUT * 1000))
        sock.connect(address)
        if variant != "floor":  # the proxy has no CONNECT
            sock.send(packb([_CONNECT]))
            if not sock.poll(_TIMEOUT * 1000) or sock.recv() != packb([_CONNECT_ACK]):
                raise RuntimeError("no CONNECT_ACK")
        conn.send(("ready",))
        rid = 0  # never reused: a coordinator would refuse a duplicate in flight
        while True:
            command = conn.recv()
            if command[0] == "stop":
                return
            mode, tokens, n, warmup, window = command
            submit = _submitter(variant, tokens, prefix)
            _round_trips(sock, submit, rid, warmup, window)
            rid += warmup
            conn.send(("warm",))
            if conn.recv()[0] != "go":
                return
            start = time.perf_counter()
            if mode == "load":
                _round_trips(sock, submit, rid, n, window)
            else:
                _fill(sock, submit, rid, n, window, held)
            rid += n
            conn.send(("done", time.perf_counter() - start))
    finally:
        context.destroy(linger=0)


def _round_trips(
    sock: zmq.Socket, submit: Callable[[int], list[Any]], first: int, n: int, window: int
) -> None:
    """``n`` requests with at most ``window`` in flight; returns after the last reply."""
    sent = done = 0
    while done < n:
        while sent < n and sent - done < window:
            sock.send_multipart(submit(first + sent), copy=False)
            sent += 1
        if not sock.poll(_TIMEOUT * 1000):
            raise TimeoutError(f"no reply for {_TIMEOUT:.0f} s ({done} of {n} answered)")
        while True:
            try:
                metadata = sock.recv_multipart(zmq.NOBLOCK)[0]
            except zmq.Again:
                break
            if metadata[1:2] != b"\x15":  # [21, ...]: ENGINE_REPLY
                raise RuntimeError(f"unexpected reply {metadata[:80]!r}")
            done += 1


def _fill(
    sock: zmq.Socket, submit: Callable[[int], list[Any]], first: int, n: int, window: int, held: Any
) -> None:
    """``n`` requests the engine holds, at most ``window`` of them not there yet."""
    sent, last, deadline = 0, -1, 0.0
    while sent < n:
        if sent - held.value < window:
            sock.send_multipart(submit(first + sent), copy=False)
            sent += 1
            continue
        if held.value != last:
            last, deadline = held.value, time.monotonic() + _TIMEOUT
        elif time.monotonic() > deadline:
            raise TimeoutError(f"the engine holds {last} of {sent} requests after {_TIMEOUT} s")
        time.sleep(0.0005)


def _engine_child(
    conn: Connection, variant: str, address: str, hold_after: int | None, held: Any
) -> None:
    context = zmq.Context()
    try:
        socks = []
        for rank in range(RANKS):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"mp-coord-{rank}".encode())
            sock.connect(address)
            if variant != "floor":  # the proxy's DEALER needs no registration
                sock.send(b"")
            socks.append(sock)
        conn.send(("ready",))
        _serve_engine(conn, variant, socks, hold_after, held)
    finally:
        context.destroy(linger=0)


def _serve_engine(
    conn: Connection, variant: str, socks: list[zmq.Socket], hold_after: int | None, held: Any
) -> None:
    """Answer requests in batches of BATCH per rank; after ``hold_after`` requests, hold them.

    A batch waits until it is full, so every coordinator sees the same
    messages; what is left goes out short once no request came for a while.
    """
    body = _reply_body()
    received = answered = messages = 0
    pending: dict[zmq.Socket, list[int]] = {sock: [] for sock in socks}
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)

    def reply(sock: zmq.Socket) -> None:
        nonlocal answered, messages
        rids, pending[sock] = pending[sock], []
        if variant == "mono":  # [21, [[rid, reply_map], ...]], one whole message
            entries = b"".join(_fixarray(2) + packb(rid) + body for rid in rids)
            sock.send(_array_head(2, _REPLY) + _fixarray(len(rids)) + entries)
        else:
            metadata = packb([_REPLY, [[rid, False] for rid in rids]])
            sock.send_multipart([metadata, *[body] * len(rids)])
        answered += len(rids)
        messages += 1

    while True:
        events = poller.poll(_FLUSH_MS if any(pending.values()) else None)
        if not events:
            for sock, rids in pending.items():
                if rids:
                    reply(sock)
        for item, _ in events:
            if item == conn.fileno():
                if conn.recv()[0] != "stats":
                    return
                conn.send(("stats", messages, answered))
                continue
            for _ in range(_DRAIN):
                try:
                    frames = item.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                received += 1
                if hold_after is not None and received > hold_after:
                    held.value += 1
                elif variant == "floor":  # echo the client's envelope; a proxy cannot batch
                    rid = _rid(frames[1].buffer)
                    item.send_multipart([frames[0], packb([_REPLY, rid]), body], copy=False)
                    answered += 1
                    messages += 1
                else:
                    pending[item].append(_rid(frames[0].buffer))
                    if len(pending[item]) == BATCH:
                        reply(item)


# -- reporting -------------------------------------------------------------------------


def _summarize(runs: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, float]]]:
    """tokens -> variant -> medians over the repetitions (and the total's range)."""
    groups: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        groups.setdefault(run["tokens"], {}).setdefault(run["variant"], []).append(run)
    summary: dict[int, dict[str, dict[str, float]]] = {}
    for tokens, variants in sorted(groups.items()):
        summary[tokens] = {}
        for variant, group in variants.items():
            point = {
                key: statistics.median(r[key] for r in group)
                for key in ("total_us", "user_us", "sys_us", "requests_per_s", "reply_batch")
            }
            point["min_total_us"] = min(r["total_us"] for r in group)
            point["max_total_us"] = max(r["total_us"] for r in group)
            point["repetitions"] = len(group)
            summary[tokens][variant] = point
    return summary


def _ratio(point: dict[str, dict[str, float]], a: str, b: str, key: str = "total_us") -> str:
    if a not in point or b not in point or not point[b][key]:
        return "-"
    return f"{point[a][key] / point[b][key]:.2f}"


def _print_cpu(args: argparse.Namespace, summary: dict[int, dict[str, dict[str, float]]]) -> None:
    if not summary:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\ncoordinator CPU per request, median of {args.repeat} "
        f"({transport}, policy {args.policy}, {RANKS} engine ranks, window {args.window})"
    )
    print(
        f"{'tokens':>6}  {'variant':<7} {'µs/req':>8} {'user':>8} {'sys':>8} "
        f"{'>floor':>8} {'req/s':>8} {'batch':>6}"
    )
    for tokens, point in summary.items():
        floor = point.get("floor", {}).get("total_us")
        for variant in VARIANTS:
            if variant not in point:
                continue
            p = point[variant]
            above = "-" if floor is None or variant == "floor" else f"{p['total_us'] - floor:.2f}"
            print(
                f"{tokens:>6}  {variant:<7} {p['total_us']:8.2f} {p['user_us']:8.2f} "
                f"{p['sys_us']:8.2f} {above:>8} {p['requests_per_s']:8.0f} "
                f"{p['reply_batch']:6.2f}"
            )
    print(f"\n{'tokens':>6}  {'c/floor':>8} {'py/c':>8} {'py/c user':>10} {'mono/c':>8}")
    for tokens, point in summary.items():
        print(
            f"{tokens:>6}  {_ratio(point, 'c', 'floor'):>8} {_ratio(point, 'py', 'c'):>8} "
            f"{_ratio(point, 'py', 'c', 'user_us'):>10} {_ratio(point, 'mono', 'c'):>8}"
        )


def _print_memory(memory: list[dict[str, Any]]) -> None:
    if not memory:
        return
    print(f"\ncoordinator memory with requests in flight ({MEMORY_PROMPT_TOKENS}-token prompts)")
    print(
        f"{'variant':<7} {'in flight':>10} {'prompts kept':>13} {'RSS before':>11} "
        f"{'RSS with':>11} {'per request':>12}"
    )
    for m in memory:
        print(
            f"{m['variant']:<7} {m['inflight']:>10} {'yes' if m['keep_prompts'] else 'no':>13} "
            f"{m['rss_before'] / 2**20:>7.1f} MiB "
            f"{m['rss_with'] / 2**20:>7.1f} MiB {m['bytes_per_request']:>8.0f} B"
        )


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line)
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "coordkit": coordkit.__version__,
        "transport": "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg": os.getloadavg(),  # before the run: others sharing the CPUs disturb it
    }


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "lengths": list(args.lengths),
        "requests": {str(t): _requests_at(args, t) for t in args.lengths},
        "repeat": args.repeat,
        "variants": list(args.variants),
        "policy": args.policy,
        "window": args.window,
        "ranks": RANKS,
        "reply_batch_max": BATCH,
        "output_tokens": OUTPUT_TOKENS,
        "reply_body_bytes": len(_reply_body()),
        "sampling_params": SAMPLING,
        "block_size": BLOCK_SIZE if args.policy == "prefix" else None,
        "inflight": args.inflight,
        "inflight_large": args.inflight_large,
        "quick": args.quick,
    }


def _plot(
    args: argparse.Namespace, summary: dict[int, dict[str, dict[str, float]]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for variant in VARIANTS:
        lengths = [t for t in summary if variant in summary[t]]
        if not lengths:
            continue
        points = [summary[t][variant] for t in lengths]
        medians = [p["total_us"] for p in points]
        spread = [
            [m - p["min_total_us"] for m, p in zip(medians, points, strict=True)],
            [p["max_total_us"] - m for m, p in zip(medians, points, strict=True)],
        ]
        axes.errorbar(lengths, medians, yerr=spread, marker="o", capsize=3, label=variant)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("prompt length (tokens)")
    axes.set_ylabel("coordinator CPU per request (µs, user + sys)")
    axes.set_title(f"coordkit bench ({args.transport}, median of {args.repeat}, min-max bars)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
