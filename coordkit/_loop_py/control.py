"""A peer's rare messages: aborts, KV releases, control signals, stats (loop/control.pyx)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import zmq

from .. import protocol
from .._shared import Counter, GoneReason, never_ran, unknown_from_engine
from ..protocol import (
    CONTROL_HEADERS,
    CONTROL_TRANSITIONS,
    ControlState,
    ErrorCode,
    Header,
    asks_metrics,
    packb,
)
from .dialect import engine_parses
from .tables import ABORTED, GONE, _Client, _Engine

if TYPE_CHECKING:
    from .loop import Loop


class Control:
    """A peer's rare messages, dispatched; a client's: aborts, KV releases, the control
    signals, shutdown and stats."""

    def __init__(self, loop: Loop):
        self._loop = loop

    def from_client(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        if header == Header.ABORT_REQUEST:
            self.abort(client, frames)
        elif header == Header.RELEASE_KV:
            self.release_kv(client, frames)
        elif header in CONTROL_HEADERS:
            self.signal(client, header, frames)
        elif header == Header.SHUTDOWN:
            self.shutdown_signal(client, frames)
        elif header == Header.STATS:
            self.stats_request(client, frames)
        elif header == Header.REJOIN and client.rebuild:
            self._loop._rebuild.rejoin(client, frames)
        elif header == Header.DISCONNECT:
            self._loop._peers.goodbye(client, frames)
        else:
            self._loop._refusals.refuse(
                client, None, ErrorCode.UNKNOWN_HEADER, header, Counter.UNKNOWN_HEADER
            )

    def from_engine(self, engine: _Engine, header: int, frames: list[zmq.Frame]) -> None:
        if header == Header.HEARTBEAT:
            self._loop._peers.heartbeat(engine, frames)
        elif header == Header.ENGINE_HELLO:
            self._loop._peers.engine_hello(engine.identity, engine, frames)
        elif header == Header.DISCONNECT:
            self._loop._peers.disconnect(engine, frames)
        elif header == Header.HELD and engine.rebuild:
            self._loop._rebuild.held(engine, frames)
        elif header == Header.REPLAYED and engine.rebuild:
            engine.handled += 1
            self._loop._rebuild.replayed(engine, frames)
        elif header == Header.REGISTER_ROLE:
            self._loop._peers.register_role(engine.identity, engine, frames)
        elif self._loop._pd is not None and self._loop._pd.messages.from_engine(
            engine, header, frames
        ):
            pass
        else:
            self._loop._counters[Counter.UNKNOWN_HEADER] += 1
            self._loop._log.warn(
                "unknown_header", unknown_from_engine(header, engine.rank, engine.format)
            )

    def abort(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """ABORT_REQUEST: on to the owning engine, once, with the server id."""
        message = self._loop._answers.parse(
            protocol.ABORT_REQUEST, client, Header.ABORT_REQUEST, frames
        )
        if message is None:
            return
        request = client.requests.get(message.rid)
        if request is None and (client.identity, message.rid) in self._loop._rebuild.awaiting:
            # REJOINed, no engine claimed it yet: aborted when one does (Rebuild.held), else
            # ended at the window's end, never sent again (Rebuild.end_window)
            self._loop._counters[Counter.ABORTS] += 1
            self._loop._rebuild.aborting.add((client.identity, message.rid))
            return
        if request is None:
            self._loop._refusals.refuse(
                client,
                message.rid,
                ErrorCode.UNKNOWN_REQUEST,
                Header.ABORT_REQUEST,
                Counter.UNKNOWN_REQUEST,
            )
            return
        self._loop._counters[Counter.ABORTS] += 1
        pd = (
            self._loop._pd
            if self._loop._pd is not None and request.server_rid in self._loop._pd.hops
            else None
        )
        if request.rank < 0 and pd is None:  # it waits: it ends here, no engine has it
            self._loop._forget(request)
            self._loop._failed[ErrorCode.ABORTED] += 1
            code, text = ErrorCode.ABORTED, never_ran(request.client_rid)
            if not self._loop._refusals.send_error(
                client, message.rid, code, Header.ABORT_REQUEST, True, text
            ):
                self._loop._peers.client_gone(client)
            return
        if request.flags & ABORTED:
            return
        request.flags |= ABORTED
        if pd is not None:
            pd.abort(request)  # at the hop holding it, or ended waiting for one
            return
        self.abort_at_engine(self._loop._engines[request.rank], request.server_rid)

    def abort_at_engine(self, engine: _Engine, server_rid: int) -> None:
        """ABORT_REQUEST to an engine; a 0.19 engine has none: the request runs to its end."""
        if not engine_parses(engine.format, Header.ABORT_REQUEST):
            return
        if not self._loop._answers.send(engine.identity, protocol.ABORT_REQUEST.pack(server_rid)):
            self._loop._faults.lost(engine, GoneReason.UNREACHABLE)

    def release_kv(self, client: _Client, frames: list[zmq.Frame]) -> None:
        message = self._loop._answers.parse(protocol.RELEASE_KV, client, Header.RELEASE_KV, frames)
        if message is None:
            return
        self._loop._counters[Counter.RELEASE_KV] += 1
        if self._loop._pd is not None:  # its own requests' pins, at their prefill only
            self._loop._pd.client_release(client, message.rid)
        else:
            self.broadcast(Header.RELEASE_KV, frames[1])

    def signal(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        """A control signal: through the state machine, then to every engine."""
        if self._loop._answers.parse(protocol.CONTROL[header], client, header, frames) is None:
            return
        state = CONTROL_TRANSITIONS.get((self._loop._control_state, header))
        if state is None:
            self._loop._refusals.refuse(
                client, None, ErrorCode.INVALID_STATE, header, Counter.INVALID_CONTROL
            )
            return
        self._loop._counters[Counter.CONTROL] += 1
        self._loop._control_state = ControlState(state)
        self.broadcast(header, frames[1])

    def shutdown_signal(self, client: _Client, frames: list[zmq.Frame]) -> None:
        if (
            self._loop._answers.parse(protocol.SHUTDOWN, client, Header.SHUTDOWN, frames)
            is not None
        ):
            self._loop._stopping = True

    def stats_request(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """STATS: stats(), and with {"metrics": 1} metrics() in it too, to a coordkit client."""
        message = self._loop._answers.parse(protocol.STATS, client, Header.STATS, frames)
        if message is not None and client.coordkit:
            stats = self._loop._report.stats()
            if asks_metrics(message.asked):
                stats["metrics"] = self._loop._report.metrics()
            self._loop._answers.send(client.identity, protocol.STATS_REPLY.pack(packb(stats)))

    def broadcast(self, header: int, frame: zmq.Frame) -> None:
        """The metadata frame as it came to every engine not gone."""
        for engine in self._loop._engines:
            if engine.state == GONE:
                continue
            if not engine_parses(engine.format, header):
                continue  # 0.19 has no KV transfer
            if not self._loop._answers.send(engine.identity, [frame]):
                self._loop._faults.lost(engine, GoneReason.UNREACHABLE)
