"""The requests traced (loop/traces.pyx)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..tracing import CLIENT_GONE, TRACEPARENT_MARK, TraceRecord
from .dialect import Inbound
from .tables import TRACEPARENT_SIZE, _Engine, _Request

if TYPE_CHECKING:
    from ..tracing import TraceSink


class Traced:
    """What is recorded of a traced request: a TraceRecord's fields."""

    __slots__ = (
        "server_rid",
        "client_rid",
        "client",
        "engine",
        "accepted",
        "routed",
        "first_reply",
        "final",
        "error",
        "traceparent",
    )

    def __init__(self, request: _Request, accepted: float, traceparent: str | None):
        self.server_rid = request.server_rid
        self.client_rid = request.client_rid
        self.client = request.client.identity
        self.engine: bytes | None = None  # never routed
        self.accepted = accepted
        self.routed: float | None = None
        self.first_reply: float | None = None
        self.final: float | None = None
        self.error = 0  # a final; an ErrorCode; or tracing.CLIENT_GONE
        self.traceparent = traceparent


class Traces:
    """The requests the coordinator traces, recorded for its TraceSink (coordkit.tracing).

    A request is traced when its params carry a client's traceparent (``follow``) or it
    is one in ``every`` of the others: ``accept`` gives it a record. The hooks stamp its
    routing, its first reply, its final, and its ERROR; ``forget`` (every end of a
    request goes through the Loop's) sets it aside, and ``end``, once the message at
    hand is handled (its replies and ERRORs sent), stamps them ended and pushes them to
    the sink (the C twin keeps them in a ring its sink takes them from instead).
    """

    __slots__ = ("_sink", "follow", "every", "countdown", "traced", "ending")

    def __init__(self, sink: TraceSink):
        self._sink = sink
        self.follow = sink.follow  # every request whose params carry a traceparent
        self.every = self.countdown = sink.every  # and one in `every` of the others
        self.traced: dict[_Request, Traced] = {}  # the requests traced in flight
        self.ending: list[Traced] = []  # those ended by the message at hand

    def accept(self, request: _Request, inbound: Inbound) -> None:
        """A request accepted: traced when the sampling says so."""
        if self.follow:
            parent = self._parent(inbound)
            if parent is None and not self._counted():
                return
        elif self._counted():
            parent = self._parent(inbound)  # its spans still join the client's trace
        else:
            return
        accepted = request.submitted or time.monotonic()  # _admit's, when it timed it
        self.traced[request] = Traced(request, accepted, parent)

    def routed(self, request: _Request, engine: _Engine) -> None:
        """Its frames went to ``engine`` (a re-send: the last routing counts)."""
        if (traced := self.traced.get(request)) is not None:
            traced.routed = time.monotonic()
            traced.engine = engine.identity

    def replied(self, request: _Request, final: bool, now: float) -> None:
        """A reply entry for it (``now``: the clock read for its message, or 0)."""
        if (traced := self.traced.get(request)) is None:
            return
        now = now or time.monotonic()
        if traced.first_reply is None:
            traced.first_reply = now
        if final:
            traced.final = now

    def fail(self, request: _Request, code: int) -> None:
        """It ends with ERROR(code) (or tracing.CLIENT_GONE), before its forget."""
        if (traced := self.traced.get(request)) is not None:
            traced.error = code

    def drop(self, request: _Request) -> None:
        """It leaves without an end of its own (its client sends it again: RESEND)."""
        self.traced.pop(request, None)

    def forget(self, request: _Request) -> None:
        """It leaves the tables (the Loop's _forget): its record waits for the message's
        end (end). Without a final or an ERROR, its client left."""
        if (traced := self.traced.pop(request, None)) is None:
            return
        if traced.final is None and not traced.error:
            traced.error = CLIENT_GONE
        self.ending.append(traced)

    def end(self) -> None:
        """The message at hand is handled, what it sent sent: the records set aside are
        stamped ended and pushed to the sink."""
        now = time.monotonic()
        for t in self.ending:
            self._sink.push(
                TraceRecord(
                    t.server_rid,
                    t.client_rid,
                    t.client,
                    t.engine,
                    t.accepted,
                    t.routed,
                    t.first_reply,
                    t.final,
                    now,
                    t.error,
                    t.traceparent,
                )
            )
        self.ending.clear()

    def _parent(self, inbound: Inbound) -> str | None:
        """The traceparent in a multipart request's params (tracing.TRACEPARENT_MARK and
        the 55 bytes after it), or None. A Megatron client's single frame carries none."""
        if inbound.single or inbound.params is None:
            return None
        params = bytes(inbound.params)
        found = params.find(TRACEPARENT_MARK)
        start = found + len(TRACEPARENT_MARK)
        if found < 0 or start + TRACEPARENT_SIZE > len(params):
            return None
        return params[start : start + TRACEPARENT_SIZE].decode("latin-1")

    def _counted(self) -> bool:
        """Whether this one is the one in ``every`` (of the requests without a parent
        followed)."""
        if not self.every:
            return False
        self.countdown -= 1
        if self.countdown:
            return False
        self.countdown = self.every
        return True
