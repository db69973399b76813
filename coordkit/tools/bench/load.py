"""The load generators: the client and the engine child processes.

Lean raw pyzmq sending pre-built bytes, so that they cost little beside the
coordinator: the client keeps a window of requests in flight, the engine
(``RANKS`` sockets) answers them in batches of up to ``BATCH`` or, for the
memory test, holds them unanswered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import zmq

from ...protocol import block_hashes, packb, unpackb
from .workload import (
    BATCH,
    BLOCK_SIZE,
    CONNECT,
    CONNECT_ACK,
    RANKS,
    REPLY,
    SAMPLING,
    SUBMIT,
    TIMEOUT,
    prompt_tokens,
    reply_body,
)

_DRAIN = 64  # messages an engine socket handles before the next one gets a turn
_FLUSH_MS = 20  # an engine sends a short batch after this long without a request


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
    return unpacker.unpack()


def _submitter(single_frame: bool, tokens: int, prefix: bool) -> Callable[[int], list[Any]]:
    """The frames of request ``rid``: everything but the id is built once."""
    prompt = prompt_tokens(tokens)
    sampling = packb(SAMPLING)
    if single_frame:  # Megatron-Core 0.19's [20, rid, prompt, sampling_params]
        whole = packb(prompt) + sampling
        return lambda rid: [_array_head(4, SUBMIT) + packb(rid) + whole]
    payload = [zmq.Frame(packb(prompt))]  # sent as a reference each time, not copied
    if prefix:
        payload.append(zmq.Frame(block_hashes(prompt, BLOCK_SIZE)))
    return lambda rid: [_array_head(3, SUBMIT) + packb(rid) + sampling, *payload]


def client_child(
    conn: Connection, variant: str, single_frame: bool, address: str, prefix: bool, held: Any
) -> None:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(TIMEOUT * 1000))
        sock.connect(address)
        if variant != "floor":  # the proxy has no CONNECT
            sock.send(packb([CONNECT]))
            if not sock.poll(int(TIMEOUT * 1000)) or sock.recv() != packb([CONNECT_ACK]):
                raise RuntimeError("no CONNECT_ACK")
        conn.send(("ready",))
        rid = 0  # never reused: a coordinator would refuse a duplicate in flight
        while True:
            command = conn.recv()
            if command[0] == "stop":
                return
            mode, tokens, n, warmup, window = command
            submit = _submitter(single_frame, tokens, prefix and variant != "floor")
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
        if not sock.poll(int(TIMEOUT * 1000)):
            raise TimeoutError(f"no reply for {TIMEOUT:.0f} s ({done} of {n} answered)")
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
            last, deadline = held.value, time.monotonic() + TIMEOUT
        elif time.monotonic() > deadline:
            raise TimeoutError(f"the engine holds {last} of {sent} requests after {TIMEOUT} s")
        time.sleep(0.0005)


def engine_child(
    conn: Connection,
    variant: str,
    single_frame: bool,
    address: str,
    hold_after: int | None,
    held: Any,
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
        _serve_engine(conn, variant, single_frame, socks, hold_after, held)
    finally:
        context.destroy(linger=0)


def _serve_engine(
    conn: Connection,
    variant: str,
    single_frame: bool,
    socks: list[zmq.Socket],
    hold_after: int | None,
    held: Any,
) -> None:
    """Answer requests in batches of BATCH per rank; after ``hold_after`` requests, hold them.

    A batch waits until it is full, so every coordinator sees the same
    messages; what is left goes out short once no request came for a while.
    """
    body = reply_body()
    # Megatron-Core 0.19's finished request: the body's map with its "request_id" first.
    assert body[0] == 0x80 | (len(unpackb(body)) & 0x0F)  # a fixmap, one more key fits
    with_id_head, with_id_rest = bytes([body[0] + 1]) + packb("request_id"), body[1:]
    received = answered = messages = 0
    pending: dict[zmq.Socket, list[int]] = {sock: [] for sock in socks}
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)

    def reply(sock: zmq.Socket) -> None:
        nonlocal answered, messages
        rids, pending[sock] = pending[sock], []
        if single_frame:  # [21, [finished_request, ...]], one whole message
            entries = b"".join(with_id_head + packb(rid) + with_id_rest for rid in rids)
            sock.send(_array_head(2, REPLY) + _fixarray(len(rids)) + entries)
        else:
            metadata = packb([REPLY, [[rid, False] for rid in rids]])
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
                    if single_frame:
                        reply_frames = [frames[0], _array_head(3, REPLY) + packb(rid) + body]
                    else:
                        reply_frames = [frames[0], packb([REPLY, rid]), body]
                    item.send_multipart(reply_frames, copy=False)
                    answered += 1
                    messages += 1
                else:
                    pending[item].append(_rid(frames[0].buffer))
                    if len(pending[item]) == BATCH:
                        reply(item)
