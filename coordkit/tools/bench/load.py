"""The load generators: the client and the engine child processes.

Lean raw pyzmq sending pre-built bytes, so that they cost little beside the
coordinator. Each is one ROUTER socket that connects to the coordinator once
per peer it plays -- ``clients`` clients, ``ranks`` engine ranks -- each
connection with an identity of its own (``ZMQ_ROUTING_ID``, set before its
connect) and a local name to send on (``ZMQ_CONNECT_ROUTING_ID``): the
coordinator sees as many peers as it would from as many DEALER sockets,
while this process polls one socket whatever their number, so that its own
cost per message (and with it the pace of the load) does not change with the
fleet's size. The client keeps a window of requests in flight (split evenly
over its clients, each sending its next request when one of its replies
comes); the engine answers them in batches of ``BATCH`` per rank, at once
(up to ``ECHO_BATCH`` of what it has read), or, for the memory test, holds
them unanswered. ``direct`` is the engine bound where a coordinator would be,
for clients connected to it without one.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import zmq

from ...protocol import block_hashes, packb
from ..fake_engine import FakeEngine
from . import kvevents
from .workload import (
    BATCH,
    BLOCK_SIZE,
    CONNECT,
    CONNECT_ACK,
    DIRECT,
    ECHO_BATCH,
    REPLY,
    SAMPLING,
    SUBMIT,
    TIMEOUT,
    Prompt,
    reply_body,
)

_DRAIN = 64  # messages read before the engine replies to what it has (at once) or polls again
_FLUSH_MS = 100  # an engine sends a short batch after this long without a request (the
# end of a load: a stall of a shared machine shorter than this does not cut batches short)
_UINTS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}  # msgpack's unsigned ints: their sizes
_MORE = int(zmq.SNDMORE)
_FAKE_OUTPUT_TOKENS = 2  # steps per request at a FakeEngine: the coordinator sees one final
_FAKE_CAPACITY = 1024  # each FakeEngine's, declared: above the client's window, nothing waits


def frames_sender(sock: zmq.Socket) -> Callable[[list[Any]], None]:
    """``send_multipart`` without its checks: a ``send`` per frame, the flags plain ints.
    pyzmq's own costs several times what sending small frames does, and the load
    generators' cost is the pace of the load. (``bytes`` are copied, a ``Frame`` is not.)"""
    send = sock.send

    def send_frames(frames: list[Any]) -> None:
        for frame in frames[:-1]:
            send(frame, _MORE)
        send(frames[-1])

    return send_frames


def head_receiver(sock: zmq.Socket, count: int) -> Callable[[], list[bytes]]:
    """``recv_multipart`` of a message's first ``count`` frames (fewer if it has fewer),
    the rest read and dropped uncopied; ``zmq.Again`` when no message is there.
    (A Frame tells whether more follow; ``RCVMORE`` is an option lookup per frame.)"""
    recv, noblock = sock.recv, int(zmq.NOBLOCK)

    def receive() -> list[bytes]:
        frame = recv(noblock, copy=False)
        head = [frame.bytes]
        while frame.more:
            frame = recv(copy=False)
            if len(head) < count:
                head.append(frame.bytes)
        return head

    return receive


def _array_head(n: int, header: int) -> bytes:
    """The msgpack bytes that start an ``n``-array (``n`` < 16) whose first item is ``header``."""
    return bytes([0x90 | n, header])  # a fixarray; the header a positive fixint


def megatron_reply(rids: list[int], body: bytes) -> bytes:
    """Megatron-Core 0.19's ``[21, [finished_request, ...]]``: per request the reply
    ``body`` (a fixmap of fewer than 15 keys) with its ``"request_id"`` first."""
    head, rest = bytes([body[0] + 1]) + packb("request_id"), body[1:]
    # an array of len(rids) entries: its head as msgpack writes it, the entries after it
    entries = packb([None] * len(rids))[: -len(rids)]
    return _array_head(2, REPLY) + entries + b"".join(head + packb(rid) + rest for rid in rids)


def read_rid(metadata: bytes | memoryview) -> int:
    """The second item of a msgpack ``[header, rid, ...]`` (a fixarray and a fixint
    header, as every peer writes them), read without the rest."""
    first = metadata[2]
    if first < 0x80:
        return first
    size = _UINTS.get(first)
    if size is None:  # not written that way: the general reader
        unpacker = msgpack.Unpacker()
        unpacker.feed(metadata[:16])  # array head, header and an int fit in 11 bytes
        unpacker.read_array_header()
        unpacker.skip()
        return int(unpacker.unpack())
    return int.from_bytes(metadata[3 : 3 + size], "big")


def submitter(
    single_frame: bool, prompt: Prompt, prefix: bool, fields: int = 4
) -> Callable[[int], list[Any]]:
    """The frames of request ``rid``: everything but the id is built once. Single frames
    have ``fields`` (SUBMIT_FIELDS): Megatron-Core 0.19's [20, rid, prompt,
    sampling_params], or main's with a nil multi_modal_data after them."""
    tokens = prompt.token_ids()
    sampling = packb(SAMPLING)
    if single_frame:
        whole = packb(tokens) + sampling + packb(None) * (fields - 4)
        return lambda rid: [_array_head(fields, SUBMIT) + packb(rid) + whole]
    payload = [zmq.Frame(packb(tokens))]  # sent as a reference each time, not copied
    if prefix:
        payload.append(zmq.Frame(block_hashes(tokens, BLOCK_SIZE)))
    return lambda rid: [_array_head(3, SUBMIT) + packb(rid) + sampling, *payload]


def commands(conn: Connection) -> Iterator[Any]:
    """The bench's commands to a load generator, up to its "stop"."""
    while (command := conn.recv())[0] != "stop":
        yield command


def raise_fd_limit() -> int:
    """Lift this process's open-file limit to its hard limit (a connection is a
    descriptor: 10 000 clients need as many); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _routed(context: zmq.Context) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to no peer is an error, not a drop
    sock.setsockopt(zmq.SNDTIMEO, int(TIMEOUT * 1000))
    return sock


def _connect_as(sock: zmq.Socket, address: str, identities: list[bytes]) -> list[bytes]:
    """One connection per identity; the names to send on, in that order."""
    routes = []
    for index, identity in enumerate(identities):
        route = index.to_bytes(4, "big")
        sock.setsockopt(zmq.ROUTING_ID, identity)  # what the coordinator sees
        sock.setsockopt(zmq.CONNECT_ROUTING_ID, route)  # what this socket sends to
        sock.connect(address)
        routes.append(route)
    return routes


def connect_clients(
    context: zmq.Context, variant: str, address: str, clients: int
) -> tuple[zmq.Socket, list[bytes]]:
    """A socket with ``clients`` connections to ``address``, each a client the
    coordinator acknowledged; the socket and the names to send on."""
    sock = _routed(context)
    routes = _connect_as(sock, address, [b"bench-client-%d" % i for i in range(clients)])
    _handshake(sock, variant, [[route] for route in routes])
    return sock, routes


def connect_client(context: zmq.Context, variant: str, address: str) -> zmq.Socket:
    """A DEALER connected to ``address``, a client the coordinator acknowledged."""
    sock = context.socket(zmq.DEALER)
    for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
        sock.setsockopt(option, value)
    sock.connect(address)
    _handshake(sock, variant, [[]])
    return sock


def _handshake(sock: zmq.Socket, variant: str, envelopes: list[list[bytes]]) -> None:
    """A CONNECT from each client (its envelope before it), and every CONNECT_ACK."""
    if variant == "floor" or variant in DIRECT:  # a proxy, an engine: no CONNECT
        return
    for envelope in envelopes:
        sock.send_multipart([*envelope, packb([CONNECT])])
    for envelope in envelopes:
        if not sock.poll(int(TIMEOUT * 1000)):
            raise RuntimeError("no CONNECT_ACK")
        if sock.recv_multipart()[len(envelope) :] != [packb([CONNECT_ACK])]:
            raise RuntimeError("a CONNECT was not acknowledged")


def client_child(
    conn: Connection,
    variant: str,
    single_frame: bool,
    address: str,
    prefix: bool,
    held: Any,
    clients: int,
    fields: int,
) -> None:
    raise_fd_limit()
    context = zmq.Context()
    try:
        sock, routes = connect_clients(context, variant, address, clients)
        conn.send(("ready",))
        rid = 0  # never reused: a coordinator would refuse a duplicate in flight
        for mode, prompt, n, warmup, window in commands(conn):
            submit = submitter(single_frame, prompt, prefix, fields)
            _round_trips(sock, routes, submit, rid, warmup, window)
            rid += warmup
            conn.send(("warm",))
            if conn.recv()[0] != "go":
                return
            start = time.perf_counter()
            if mode == "load":
                _round_trips(sock, routes, submit, rid, n, window)
            else:
                _fill(sock, routes[0], submit, rid, n, window, held)
            rid += n
            conn.send(("done", time.perf_counter() - start))
    finally:
        context.destroy(linger=0)


def _round_trips(
    sock: zmq.Socket,
    routes: list[bytes],
    submit: Callable[[int], list[Any]],
    first: int,
    n: int,
    window: int,
) -> None:
    """``n`` requests with ``window`` in flight, as evenly as they go over the clients
    (each sends its next request on a reply); returns after the last reply."""
    send, receive = frames_sender(sock), head_receiver(sock, 2)
    sent = done = 0
    for index in range(min(n, max(window, len(routes)))):
        send([routes[index % len(routes)], *submit(first + sent)])
        sent += 1
    while done < n:
        if not sock.poll(int(TIMEOUT * 1000)):
            raise TimeoutError(f"no reply for {TIMEOUT:.0f} s ({done} of {n} answered)")
        while True:
            try:
                route, metadata = receive()
            except zmq.Again:
                break
            if metadata[1:2] != b"\x15":  # [21, ...]: ENGINE_REPLY
                raise RuntimeError(f"unexpected reply {metadata[:80]!r}")
            done += 1
            if sent < n:
                send([route, *submit(first + sent)])
                sent += 1


def _fill(
    sock: zmq.Socket,
    route: bytes,
    submit: Callable[[int], list[Any]],
    first: int,
    n: int,
    window: int,
    held: Any,
) -> None:
    """``n`` requests the engine holds, at most ``window`` of them not there yet."""
    sent, last, deadline = 0, -1, 0.0
    send = frames_sender(sock)
    while sent < n:
        if sent - held.value < window:
            send([route, *submit(first + sent)])
            sent += 1
            continue
        if held.value != last:
            last, deadline = held.value, time.monotonic() + TIMEOUT
        elif time.monotonic() > deadline:
            raise TimeoutError(f"the engine holds {last} of {sent} requests after {TIMEOUT} s")
        time.sleep(0.0005)


def engine_child(
    conn: Connection,
    variant: str,
    single_frame: bool,
    address: str,
    ranks: int,
    at_once: bool,
    hold_after: int | None,
    held: Any,
    workload: str = "standard",
    kv_events: bool = False,
) -> None:
    """``ranks`` engine ranks connected to ``address``, or (``direct``) one bound there,
    answering with ``workload``'s reply body; with ``kv_events``, once registered, each
    rank publishing its KV-cache events where the bench then says (:mod:`.kvevents`)."""
    raise_fd_limit()
    context = zmq.Context()
    caches: list[kvevents.RankCache] = []
    try:
        sock = _routed(context)
        if variant in DIRECT:
            sock.bind(address)
            address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            routes = _connect_as(sock, address, [b"mp-coord-%d" % r for r in range(ranks)])
            if variant != "floor":  # the proxy's DEALER needs no registration
                for route in routes:
                    sock.send_multipart([route, b""])
        conn.send(("ready", address))
        if kv_events:  # the endpoints of the rank each route registered as
            command, where = conn.recv()
            if command != "publish":
                return
            caches = kvevents.publishers(context, where)
            conn.send(("publishing",))
        _serve_engine(
            conn,
            variant,
            single_frame,
            sock,
            at_once,
            hold_after,
            held,
            reply_body(workload),
            {i.to_bytes(4, "big"): cache for i, cache in enumerate(caches)},
        )
    finally:
        kvevents.close(caches)
        context.destroy(linger=0)


def _serve_engine(
    conn: Connection,
    variant: str,
    single_frame: bool,
    sock: zmq.Socket,
    at_once: bool,
    hold_after: int | None,
    held: Any,
    body: bytes,
    caches: dict[bytes, kvevents.RankCache],
) -> None:
    """Answer requests with ``body`` (until the bench sends another: ``("body", bytes)``)
    in batches of BATCH per rank, or at once; after ``hold_after`` requests, hold them.
    A rank with a cache in ``caches`` (by route) stores each prompt there and publishes
    its events with each reply.

    A batch waits until it is full, so every coordinator sees the same
    messages; what is left goes out short once no request came for a while.
    At once, what was read is answered before the engine polls again. The
    floor's engine (and ``direct``'s) echoes each request on its own, with the
    client's envelope: a proxy cannot batch.
    """
    shared_body = zmq.Frame(body)  # sent by reference
    batch = ECHO_BATCH if at_once else BATCH
    # The frames before a request's metadata: this socket's name for the peer, and
    # behind the proxy the client's identity.
    envelope = 2 if variant == "floor" else 1
    echo = variant == "floor" or variant in DIRECT
    received = answered = messages = 0
    # A cache reads the prompt: the frame after the metadata, or the single frame.
    prompt_frame = bool(caches) and not single_frame
    send, receive = frames_sender(sock), head_receiver(sock, envelope + 1 + prompt_frame)
    caches_get = caches.get
    pending: dict[bytes, list[int]] = {}
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)

    def reply(route: bytes, rids: list[int]) -> None:
        nonlocal answered, messages
        cache = caches_get(route)
        if cache is not None:
            cache.flush()
        if single_frame:  # [21, [finished_request, ...]], one whole message
            send([route, megatron_reply(rids, body)])
        else:
            metadata = packb([REPLY, [[rid, False] for rid in rids]])
            send([route, metadata, *[shared_body] * len(rids)])
        answered += len(rids)
        messages += 1

    def flush() -> None:
        for route, rids in pending.items():
            for start in range(0, len(rids), batch):
                reply(route, rids[start : start + batch])
        pending.clear()

    while True:
        events = poller.poll(_FLUSH_MS if pending else None)
        if not events:
            flush()
        for item, _ in events:
            if item == conn.fileno():
                command, *operands = conn.recv()
                if command == "kv_batches":
                    conn.send(("kv_batches", sum(c.batches for c in caches.values())))
                    continue
                if command == "body":  # the next point's, sent between two points
                    body = operands[0]
                    shared_body = zmq.Frame(body)
                    conn.send(("body",))
                    continue
                if command != "stats":
                    return
                conn.send(("stats", messages, answered))
                continue
            for _ in range(_DRAIN):
                try:
                    *peer, metadata = frames = receive()
                except zmq.Again:
                    break
                if prompt_frame:
                    *peer, metadata, prompt = frames
                received += 1
                if hold_after is not None and received > hold_after:
                    held.value += 1
                    continue
                rid = read_rid(metadata)
                if echo:
                    reply_frames: list[Any]
                    if single_frame:
                        reply_frames = [_array_head(3, REPLY) + packb(rid) + body]
                    else:
                        reply_frames = [packb([REPLY, rid]), shared_body]
                    send([*peer, *reply_frames])
                    answered += 1
                    messages += 1
                    continue
                route = peer[0]
                cache = caches_get(route)
                if cache is not None:
                    cache.store(metadata if single_frame else prompt, single_frame)
                rids = pending.setdefault(route, [])
                rids.append(rid)
                if len(rids) == batch:
                    del pending[route]
                    reply(route, rids)
            if at_once:
                flush()


def fake_engines_child(conn: Connection, address: str, roles: tuple[str | None, ...]) -> None:
    """One FakeEngine per role, each on a thread of this process, free of model time,
    until the bench says stop (the Session's engine child: it answers "stats")."""
    logging.getLogger("coordkit.engine").setLevel(logging.ERROR)  # the session ends it all
    stop = threading.Event()
    engines = [
        FakeEngine(
            address,
            rank,
            role=role,
            max_batch=_FAKE_CAPACITY,
            output_tokens=_FAKE_OUTPUT_TOKENS,
            heartbeat_interval=None,
        )
        for rank, role in enumerate(roles)
    ]
    threads = [threading.Thread(target=e.run, args=(stop,), daemon=True) for e in engines]
    for thread in threads:
        thread.start()
    try:
        conn.send(("ready", address))
        while conn.recv()[0] == "stats":
            conn.send(("stats", 0, 0))  # its replies are not counted: FakeEngine's own
    finally:
        stop.set()
        for thread in threads:
            thread.join(TIMEOUT)
