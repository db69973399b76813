"""The engine side: an engine rank's endpoint and the events it hands out.

:class:`Engine` is what an inference engine's step loop talks to: it
registers with the coordinator, hands out what arrived as small event
objects, and sends each step's finished requests as one batched reply::

    with Engine("ipc:///tmp/coordkit.sock", rank=0) as engine:
        while True:
            for event in engine.poll(timeout=0.01):
                ...  # Request, Abort, ReleaseKV or Control
            engine.reply([(rid, body) for rid, body in finished_this_step])

It is synchronous (engine step loops are) and not thread-safe: use one
Engine from one thread. :class:`coordkit.tools.fake_engine.FakeEngine` is a
complete engine built on it, for demos and tests.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from . import protocol
from .protocol import Header, ProtocolError, packb, unpackb

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Engine", "Request", "Abort", "ReleaseKV", "Control", "Event"]

log = logging.getLogger(__name__)

_MAX_DRAIN = 4096  # messages taken per poll, so a flood cannot starve the step loop
_CLOSE_LINGER_MS = 1000  # lets the last replies and DISCONNECT leave on close()


@dataclass(frozen=True, slots=True)
class Request:
    """A new request: SUBMIT_REQUEST, or SUBMIT_REQUEST_WITH_KV when ``kv_meta`` is set.

    ``prompt`` (and ``src_block_ids``) are the received frames, not copies.
    """

    server_rid: int
    sampling_params: Any
    prompt: zmq.Frame
    kv_meta: Any = None
    src_block_ids: zmq.Frame | None = None

    def prompt_tokens(self) -> Any:
        """The prompt msgpack-decoded: token ids (or a str, as the client sent it)."""
        return unpackb(self.prompt.buffer)


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort ``server_rid``; the engine still owes it a final reply."""

    server_rid: int


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """RELEASE_KV, broadcast to every engine; ``rid`` is the id the client sent."""

    rid: int


@dataclass(frozen=True, slots=True)
class Control:
    """A control signal (PAUSE ... STOP_CUDA_PROFILER); ``epoch`` for SET_GENERATION_EPOCH."""

    header: Header
    epoch: int | None = None


Event = Request | Abort | ReleaseKV | Control

#: A reply entry: (server_rid, body) or (server_rid, body, needs_detokenize).
#: A body that is not bytes-like is msgpack-packed.
ReplyEntry = tuple[int, Any] | tuple[int, Any, bool]


class Engine:
    """One engine rank's connection to the coordinator (a DEALER with an identity).

    ``pending`` counts requests received and not yet answered with a final
    reply. With ``heartbeat_interval`` set, :meth:`poll` sends
    HEARTBEAT ``[91, pending, capacity]`` that often (the first at once), so
    the coordinator can declare the engine gone when they stop.
    """

    def __init__(
        self,
        address: str,
        rank: int = 0,
        identity: bytes | str | None = None,
        *,
        heartbeat_interval: float | None = None,
        capacity: int = 0,
        context: zmq.Context | None = None,
    ):
        if identity is None:
            identity = f"engine-{rank}"
        self.address = address
        self.rank = rank
        self.identity = identity.encode() if isinstance(identity, str) else identity
        self.heartbeat_interval = heartbeat_interval
        self.capacity = capacity
        self.pending = 0
        self._next_heartbeat = time.monotonic() if heartbeat_interval else math.inf
        # An own context, so close() can wait (up to the linger) for the last replies to leave.
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity)
        # No high-water marks: the coordinator's max_inflight bounds what can queue here.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.connect(address)
        self._socket.send(b"")  # registration

    def poll(self, timeout: float = 0.0) -> list[Event]:
        """Wait up to ``timeout`` seconds for messages and return their events.

        Returns as soon as something arrived, with everything that is queued;
        an empty list on timeout. Sends a HEARTBEAT whenever one is due.
        """
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if now >= self._next_heartbeat:
                self._send_heartbeat(now)
            wait = min(deadline, self._next_heartbeat) - now
            if self._socket.poll(math.ceil(max(wait, 0.0) * 1000), zmq.POLLIN):
                return self._drain()
            if time.monotonic() >= deadline:
                return []

    def reply(self, finished: Iterable[ReplyEntry]) -> None:
        """Send the final replies of one step as ONE batched ENGINE_REPLY."""
        entries, bodies = [], []
        for rid, body, *detokenize in finished:
            entries.append([rid, bool(detokenize and detokenize[0])])
            bodies.append(_encode_body(body))
        if entries:
            self._socket.send_multipart(protocol.ENGINE_REPLY.pack(entries, bodies), copy=False)
            self.pending = max(self.pending - len(entries), 0)

    def reply_partial(self, partial: Iterable[tuple[int, Any]]) -> None:
        """Send the partial replies of one step as ONE batched ENGINE_REPLY_PARTIAL."""
        entries, bodies = [], []
        for rid, body in partial:
            entries.append(rid)
            bodies.append(_encode_body(body))
        if entries:
            frames = protocol.ENGINE_REPLY_PARTIAL.pack(entries, bodies)
            self._socket.send_multipart(frames, copy=False)

    def disconnect(self) -> None:
        """Tell the coordinator this rank takes no new work (send finals for what it holds)."""
        self._socket.send_multipart(protocol.DISCONNECT.pack())

    def close(self) -> None:
        self._socket.close(linger=_CLOSE_LINGER_MS)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_heartbeat(self, now: float) -> None:
        self._socket.send_multipart(protocol.HEARTBEAT.pack(self.pending, self.capacity))
        self._next_heartbeat = now + (self.heartbeat_interval or math.inf)

    def _drain(self) -> list[Event]:
        events = []
        for _ in range(_MAX_DRAIN):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                events.append(self._parse(frames))
            except ProtocolError as exc:
                log.warning("engine %s: dropped a malformed message: %s", self.rank, exc)
        return events

    def _parse(self, frames: list[zmq.Frame]) -> Event:
        try:
            header = unpackb(frames[0].buffer)[0]
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"unreadable metadata frame ({exc!r})") from None
        if header == Header.SUBMIT_REQUEST:
            submit = protocol.SUBMIT_REQUEST.parse(frames)
            self.pending += 1
            return Request(submit.rid, submit.sampling_params, submit.prompt)
        if header == Header.SUBMIT_REQUEST_WITH_KV:
            submit = protocol.SUBMIT_REQUEST_WITH_KV.parse(frames)
            self.pending += 1
            return Request(
                submit.rid,
                submit.sampling_params,
                submit.prompt,
                submit.kv_meta,
                submit.src_block_ids,
            )
        if header == Header.ABORT_REQUEST:
            return Abort(protocol.ABORT_REQUEST.parse(frames).rid)
        if header == Header.RELEASE_KV:
            return ReleaseKV(protocol.RELEASE_KV.parse(frames).rid)
        if header in protocol.CONTROL:
            message = protocol.CONTROL[header].parse(frames)
            return Control(Header(header), getattr(message, "epoch", None))
        raise ProtocolError(f"unexpected header {header!r}")


def _encode_body(body: Any) -> Any:
    return body if isinstance(body, (bytes, bytearray, memoryview, zmq.Frame)) else packb(body)
