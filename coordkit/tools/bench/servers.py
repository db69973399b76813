"""The coordinator child: the process whose CPU time and memory the bench measures.

It runs one variant's server -- libzmq's proxy (``floor``), the design
before the split (``mono``) or a coordkit Coordinator (``c``, ``py``) -- and
a thread that answers the bench: samples of its ``getrusage`` and VmRSS, how
many engines registered, and stop.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from ... import Coordinator
from ..._kvevents import THREAD_NAME
from ...protocol import packb, unpackb
from .load import raise_fd_limit
from .workload import CONNECT, CONNECT_ACK, IMPLEMENTATIONS, REPLY, SUBMIT


def _usage() -> dict[str, float]:
    """This process's CPU time (every thread; libzmq's I/O threads' apart), context
    switches, faults and resident memory."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "user": usage.ru_utime,
        "sys": usage.ru_stime,
        "io": _io_threads_cpu(),
        "kv": _kv_thread_cpu(),
        "main": _thread_cpu(threading.main_thread().native_id),
        "switches": usage.ru_nvcsw + usage.ru_nivcsw,
        "involuntary": usage.ru_nivcsw,
        "page_faults": usage.ru_minflt + usage.ru_majflt,
        "rss": rss * 1024,
    }


def _io_threads_cpu() -> float:
    """CPU seconds (user + sys) of libzmq's I/O threads, which it names ``ZMQbg/IO/N``:
    the transport's share, which the loop's thread does not see."""
    seconds = 0.0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if not comm.read().startswith("ZMQbg/IO/"):
                    continue
            # The thread's CPU-time clock, as pthread_getcpuclockid makes it from a TID
            # (Linux's CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED): ns, where /proc counts ticks.
            seconds += time.clock_gettime((~int(task) << 3) | 6)
        except OSError:  # a thread that ended meanwhile
            continue
    return seconds


def _kv_thread_cpu() -> float:
    """CPU seconds of the thread that reads and decodes the KV events (0: none)."""
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME:
            return _thread_cpu(thread.native_id)
    return 0.0


def _thread_cpu(native_id: int | None) -> float:
    """CPU seconds of a thread of this process (0: none, or it ended meanwhile); the main
    thread's is the loop's (coordinator_child serves there)."""
    if native_id is None:
        return 0.0
    try:
        return time.clock_gettime((~native_id << 3) | 6)  # as _io_threads_cpu
    except OSError:
        return 0.0


def coordinator_child(
    conn: Connection,
    variant: str,
    endpoints: list[str],
    policy: str,
    options: dict[str, Any],
) -> None:
    raise_fd_limit()
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
        elif command == "identities" and isinstance(server, _Coordkit):
            conn.send(("identities", server.identities()))
        elif command == "kv_events" and isinstance(server, _Coordkit):
            conn.send(("kv_events", server.kv_events()))
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
        self.coord = Coordinator(
            endpoint,
            implementation=IMPLEMENTATIONS[variant],
            policy=policy,
            context=context,
            **options,
        )
        self.client_address = self.engine_address = self.coord.address

    def serve(self) -> None:
        self.coord.serve_forever()

    def stop(self) -> None:
        self.coord.stop(timeout=0)

    def engines(self) -> int:
        return len(self.coord.stats()["engines"])

    def identities(self) -> list[str]:
        """The registered engines' identities, by rank."""
        engines = sorted(self.coord.stats()["engines"], key=lambda e: e["rank"])
        return [engine["identity"] for engine in engines]

    def kv_events(self) -> dict[str, int]:
        """The KV events' batches and records (an event's each) applied so far."""
        kv = self.coord.stats()["kv_events"]
        return {"batches": kv["batches"], "records": kv["records"]}


class _Floor:
    """libzmq's proxy: clients on a ROUTER, engines on a DEALER; nothing decoded, no state.

    ``proxy_steerable`` is ``zmq.proxy`` with a control socket, the way to stop it.
    The engines are counted by a monitor of the DEALER, as their handshakes end.
    """

    def __init__(self, context: zmq.Context, front: str, back: str):
        self.front = _bound(context, zmq.ROUTER, front)
        self.back = _bound(context, zmq.DEALER, back)
        self.client_address = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.engine_address = self.back.getsockopt_string(zmq.LAST_ENDPOINT)
        control = f"inproc://coordkit-bench-floor-{id(self):x}"
        self.control = context.socket(zmq.PAIR)
        self.control.bind(control)
        # The answering thread's alone:
        self.stopper = context.socket(zmq.PAIR)
        self.stopper.connect(control)
        self.monitor = self.back.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.connected = 0

    def serve(self) -> None:
        zmq.proxy_steerable(self.front, self.back, None, self.control)

    def stop(self) -> None:
        self.stopper.send(b"TERMINATE")

    def engines(self) -> int:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            self.connected += 1 if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else -1
        return self.connected


class _Mono:
    """The design before the split: a Python loop that unpacks and repacks whole messages.

    Megatron-Core 0.19's coordinator, in the layouts of its single-frame
    dialect: clients send ``[20, rid, prompt_tokens, sampling_params]`` as one
    msgpack message (main's: and its ``multi_modal_data``, decoded and re-encoded
    too, as main's coordinator does); engines reply ``[21, [finished_request,
    ...]]``, each a map whose ``"request_id"`` is the server id; a client gets
    ``[21, rid, finished_request]``. Ids are translated, engines taken round
    robin.
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
                if decoded[0] == SUBMIT:
                    _, rid, *fields = decoded  # prompt, sampling params (, multi_modal_data)
                    requests[next_rid] = (identity, rid)
                    rank = ranks[next_rid % len(ranks)]
                    sock.send_multipart([rank, packb([SUBMIT, next_rid, *fields])])
                    next_rid += 1
                elif decoded[0] == REPLY:
                    for reply in decoded[1]:
                        client, rid = requests.pop(reply["request_id"])
                        sock.send_multipart([client, packb([REPLY, rid, reply])])
                elif decoded[0] == CONNECT:
                    sock.send_multipart([identity, packb([CONNECT_ACK])])

    def stop(self) -> None:
        self.waker.send(b"")

    def engines(self) -> int:
        return len(self.ranks)
