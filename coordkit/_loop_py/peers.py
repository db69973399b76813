"""The peers' life: engines and clients joining, living and leaving (loop/peers.pyx)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import zmq

from .. import _pd, protocol
from .._shared import REFUSAL_EVENTS, Counter, GoneReason, PeerRole, monitor_events
from ..protocol import (
    BATCH_FEATURE,
    EPOCH_KEY,
    QOS_FEATURE,
    REBUILD_FEATURE,
    ROLE_NAMES,
    ErrorCode,
    Header,
    ProtocolError,
    error_text,
    parse_connect,
    parse_engine_hello,
    unpackb,
)
from .message import _buffers, _source_fd
from .pd import PD
from .tables import (
    ABORTED,
    ALIVE,
    AWAY,
    DRAINING,
    GONE,
    MULTIPART,
    SINGLE_FRAME,
    SINGLE_FRAME_MAIN,
    _Client,
    _Engine,
)

if TYPE_CHECKING:
    from .loop import Loop


class Peers:
    """The peers' life: engines registering, saying hello and their role, new and restarted;
    the socket monitor's events; clients connecting and their table, tenants; goodbyes,
    heartbeats and disconnects; a client gone."""

    def __init__(self, loop: Loop):
        self._loop = loop

    def register(self, identity: bytes, engine: _Engine | None, fd: int) -> None:
        """An engine announced itself (one empty frame) on connection ``fd``: a new rank,
        or one coming back after it left or was declared gone. Under an identity alive,
        it is a repeat on the same connection, or, on another, a new process (Megatron's
        engines register once, at their start) -- unless a hello named its process: then
        the hello that follows says which."""
        if engine is None or engine.state in (GONE, DRAINING):
            self.new_engine(identity, engine, fd)
        elif fd == engine.fd or engine.session:
            self._loop._counters[Counter.DUPLICATE_REGISTER] += 1
        else:
            self.restarted(engine, fd)

    def engine_hello(self, identity: bytes, engine: _Engine | None, frames: list[Any]) -> None:
        """ENGINE_HELLO: a coordkit engine registers, or says so once registered; a
        hello naming another process than the one registered under its identity is a
        new process (the old one's requests are handled as its death)."""
        try:
            hello = parse_engine_hello(_buffers(frames))
        except ProtocolError as exc:
            self._loop._refusals.malformed(None, None, Header.ENGINE_HELLO, str(exc), frames)
            return
        fd = _source_fd(frames[1])
        if engine is None or engine.state in (GONE, DRAINING):
            engine = self.new_engine(identity, engine, fd)
        elif engine.session and hello.session != engine.session:
            self.restarted(engine, fd)
        elif engine.state == AWAY or fd != engine.fd:  # the same process, a new connection
            self._loop._faults.back(engine, fd)
        if engine is not None:
            engine.session = hello.session
            engine.coordkit = hello.coordkit
            engine.batch = hello.batch
            engine.format = MULTIPART
            # Its reply messages are numbered anew from its base: a registration each time.
            engine.rebuild, engine.base = hello.rebuild, hello.base
            engine.handled = engine.mark = engine.acked = 0
            self._loop._router.set_capacity(engine.rank, hello.capacity)
            self._loop._dispatch_due = True
            self.count_formats()
            if hello.role:
                pd = self.pd_room()
                pd.seat(
                    engine, hello.role, False, hello.domain, hello.capacity
                ).transfer = hello.transfer
            elif self._loop._pd is not None and engine.rank in self._loop._pd.seats:
                self._loop._pd.unseat(engine.rank)
                self._loop._faults.admit(engine)
            if self._loop._kv_events is not None:  # its publisher, or none (its predecessor's)
                if hello.kv_events is None:
                    self._loop._kv_events.unannounce(engine.rank)
                else:
                    self._loop._kv_events.add(
                        engine.rank, hello.kv_events, hello.kv_events_replay, announced=True
                    )
            if hello.ack or hello.rebuild:  # it is in the pool: say so, and what it was granted
                self._loop._answers.send(
                    identity, protocol.engine_ack(hello, self._loop._epoch, roles=True)
                )
            if self._loop._pd is not None:
                self._loop._pd.drain()

    def pd_room(self) -> PD:
        """The P/D room, made when the first engine takes a role."""
        if self._loop._pd is None:
            self._loop._pd = PD(self._loop, self._loop._options)
        return self._loop._pd

    def register_role(self, identity: bytes, engine: _Engine | None, frames: list[Any]) -> None:
        """A #6675 engine's REGISTER_ROLE: judged as #6675 judges it (a registered identity
        is replaced first: its requests as at its death), then acknowledged ([2]) and
        seated, or refused ([29, reason])."""
        try:
            message = unpackb(frames[1].buffer)
        except ProtocolError as exc:
            self._loop._refusals.malformed(None, None, Header.REGISTER_ROLE, str(exc), frames)
            return
        pd = self.pd_room() if self._loop._pr6675 else self._loop._pd
        fleet = {} if pd is None else pd.registrations
        if not isinstance(message, list):
            message = [message]
        check = _pd.check_register_role(message, identity, fleet, self._loop._pr6675)
        if check.replaces and engine is not None and engine.state != GONE:
            self._loop._faults.mark_gone(engine, GoneReason.RESTARTED)
            self._loop._faults.settle()
        registration = check.registration
        if registration is None or pd is None:
            if pd is not None:
                pd.counts["roles_refused"] += 1
            self._loop._answers.send(identity, protocol.ROLE_REFUSED.pack(check.refusal))
            return
        engine = self.new_engine(
            identity, self._loop._engine_by_identity.get(identity), _source_fd(frames[1])
        )
        if engine is None:
            return
        engine.format = SINGLE_FRAME_MAIN  # main's single frames, four SUBMIT fields
        self.count_formats()
        seat = pd.seat(
            engine,
            ROLE_NAMES[registration.role],
            True,
            _pd.MEGATRON_DOMAIN,
            registration.request_capacity,
        )
        seat.ssm_capacity = registration.ssm_capacity or 0
        seat.slot_cost = registration.slot_cost
        seat.nccl = registration.transport == "nccl"
        seat.transfer = registration.instance_meta
        pd.registrations[identity] = registration
        self._loop._answers.send(identity, protocol.REGISTER_ROLE_ACK.pack())
        pd.drain()

    def count_formats(self) -> None:
        """How many engines not gone speak each format: which checks a SUBMIT needs."""
        live = [engine for engine in self._loop._engines if engine.state != GONE]
        self._loop._n_single_engines = sum(engine.format == SINGLE_FRAME for engine in live)
        self._loop._n_main_engines = sum(engine.format == SINGLE_FRAME_MAIN for engine in live)
        self._loop._n_multipart_engines = (
            len(live) - self._loop._n_single_engines - self._loop._n_main_engines
        )

    def restarted(self, engine: _Engine, fd: int) -> None:
        """A new process registered under an engine's identity: the old one's requests
        are handled as its death (re-sent or failed), and the rank starts anew."""
        self._loop._counters[Counter.ENGINE_RESTARTS] += 1
        self._loop._faults.mark_gone(engine, GoneReason.RESTARTED)
        self.new_engine(engine.identity, engine, fd)  # first: the new one may take them
        self._loop._faults.settle()

    def new_engine(self, identity: bytes, engine: _Engine | None, fd: int) -> _Engine | None:
        """Put the sender in the pool: ``engine`` coming back, or a new rank (reusing
        a gone rank with nothing left in flight once the table is full); None when
        there is no room or the sender is, or was, a client."""
        if engine is None:
            if identity in self._loop._clients or self._loop._roles.of(identity) == PeerRole.CLIENT:
                self._loop._refusals.malformed(
                    None, None, -1, "a client sent an engine registration", [identity]
                )
                return None
            rank = len(self._loop._engines)
            if rank == self._loop._options.max_engines:
                rank = next(
                    (
                        e.rank
                        for e in self._loop._engines
                        if e.state == GONE and not self._loop._router.pending(e.rank)
                    ),
                    -1,
                )
                if rank < 0:
                    self._loop._counters[Counter.TABLE_FULL] += 1
                    self._loop._log.warn("engines_full", "engine table full: registration dropped")
                    return None
                retired = self._loop._engines[rank].identity
                del self._loop._engine_by_identity[retired]
                self._loop._roles.remember(retired, PeerRole.ENGINE)
                self._loop._engines[rank] = _Engine(rank, identity)
            else:
                self._loop._engines.append(_Engine(rank, identity))
            self._loop._tally.reset(rank)
            engine = self._loop._engine_by_identity[identity] = self._loop._engines[rank]
            if self._loop._kv_events is not None:  # the publisher configured for its id
                self._loop._kv_events.registered(rank, identity)
        engine.state = ALIVE
        self.watch(engine, fd)
        engine.session = 0
        engine.coordkit = False
        engine.batch = False
        engine.format = self._loop._single_format if self._loop._megatron_core else MULTIPART
        engine.heartbeats = False
        engine.rebuild = False
        engine.handled = engine.mark = engine.acked = 0
        self._loop._router.set_capacity(engine.rank, 0)  # until a hello says otherwise
        self._loop._faults.admit(engine)
        self._loop._dispatch_due = True
        self.count_formats()
        return engine

    def watch(self, engine: _Engine, fd: int) -> None:
        """An engine's connection is ``fd`` (-1: inproc, not watched): when it ends, the
        engine is lost (Faults.lost)."""
        if self._loop._engine_fds.get(engine.fd) is engine:
            del self._loop._engine_fds[engine.fd]
        engine.fd = fd
        if fd < 0:
            return
        self.connection_events()  # what the monitor said first
        if fd in self._loop._connections:
            self._loop._engine_fds[fd] = engine
        else:  # it ended already
            self._loop._ended.append((engine.identity, fd))

    def connect(self, identity: bytes, client: _Client | None, frames: list[zmq.Frame]) -> None:
        """CONNECT: a new client (or a repeated CONNECT), answered with CONNECT_ACK."""
        try:
            hello = parse_connect(_buffers(frames))
        except ProtocolError as exc:
            self._loop._refusals.malformed(None, None, Header.CONNECT, str(exc), frames)
            return
        fd = _source_fd(frames[1])
        if client is not None and client.present and fd != client.fd:
            # Its routing id on a new connection (libzmq hands it over: nothing reaches
            # the old one any more): it reconnected before its old connection's end was
            # seen, or another process took its name: either way the old one is gone
            # (away, with a hold: a blip).
            if client.hold > 0:
                self._loop._rebuild.go_away(client)
            else:
                self.client_gone(client, unreachable=False)
            client = self._loop._clients.get(identity)  # None: forgotten (nothing in flight kept)
        if client is None and self._loop._roles.of(identity) == PeerRole.ENGINE:
            self._loop._refusals.malformed(
                None, None, Header.CONNECT, "an engine sent CONNECT", frames
            )
            return
        if client is not None:
            if client.present:
                self._loop._counters[Counter.DUPLICATE_CONNECT] += 1
            else:  # known from an engine's report only, or away: this is its connection
                self.connection_events()  # as for a new client: what the monitor said first
                client.fd = fd
                self._loop._rebuild.returned(client)
            self._loop._seen(client)
        else:
            # What the monitor said first: a connection that ended on this CONNECT's fd
            # before this one opened is not to be taken for this one's end.
            self.connection_events()
            if (
                len(self._loop._clients) >= self._loop._options.max_clients
                and not self.vacant_client()
            ):
                self._loop._counters[Counter.TABLE_FULL] += 1
                self._loop._refused[ErrorCode.BUSY] += 1
                if hello.coordkit:
                    self._loop._counters[Counter.ERRORS_SENT] += 1
                    text = error_text(ErrorCode.BUSY, Header.CONNECT)
                    self._loop._answers.send(
                        identity, protocol.ERROR.pack(None, ErrorCode.BUSY, text)
                    )
                return
            client = self._loop._clients[identity] = self._loop._idle[identity] = _Client(identity)
            client.fd = fd
        client.coordkit = hello.coordkit
        client.batch = hello.batch
        client.rebuild = hello.rebuild
        client.hold = hello.hold
        client.qos = hello.qos
        tenant = self._loop._queue.tenant(hello.tenant)  # the one it names now (None: its own)
        if client.tenant >= 0:
            self._loop._queue.leave(client.tenant)
        client.tenant = tenant
        client.present = client.fresh = True
        client.rejoined = False  # until its REJOIN, the requests adopted for it wait
        client.format = MULTIPART
        if self._loop._megatron_core and not hello.coordkit:
            client.format = SINGLE_FRAME_MAIN if self._loop._pr6675 else SINGLE_FRAME
        features: dict[str, int] = {BATCH_FEATURE: 1} if hello.batch else {}
        if hello.qos:
            features[QOS_FEATURE] = 1
        if hello.rebuild:
            features.update({REBUILD_FEATURE: 1, EPOCH_KEY: self._loop._epoch})
        if features:
            self._loop._answers.send(identity, protocol.CONNECT_ACK_BATCH.pack(features))
        else:
            self._loop._answers.send(identity, protocol.CONNECT_ACK.pack())
        if client.fd >= 0:
            if client.fd in self._loop._connections:
                self._loop._connections[client.fd] = client
            else:  # the monitor said its connection ended already
                self._loop._ended.append((client.identity, client.fd))

    def vacant_client(self) -> bool:
        """Make room for a client: the one idle longest gives up its place."""
        if not self._loop._idle:
            return False
        self.remove_client(next(iter(self._loop._idle.values())))
        return True

    def remove_client(self, client: _Client) -> None:
        """A client with nothing in flight leaves the tables (its identity stays a
        client's)."""
        self._loop._roles.remember(client.identity, PeerRole.CLIENT)
        if client.tenant >= 0:
            self._loop._queue.leave(client.tenant)
        del self._loop._clients[client.identity]
        self._loop._tally.submitted.pop(client, None)
        del self._loop._idle[client.identity]
        self._loop._rebuild.away.pop(client.identity, None)
        if self._loop._connections.get(client.fd) is client:
            self._loop._connections[client.fd] = None

    def connection_events(self) -> None:
        """The ROUTER's monitor: connections opened and ended (a client whose connection
        ended has left: nothing can reach its routing id again), handshakes refused."""
        for event, value in monitor_events(self._loop._monitor):
            if event == zmq.EVENT_ACCEPTED:
                self._loop._connections[value] = None
            elif event == zmq.EVENT_DISCONNECTED:
                client = self._loop._connections.pop(value, None)
                engine = self._loop._engine_fds.pop(value, None)
                if client is not None:
                    self._loop._ended.append((client.identity, value))
                elif engine is not None:
                    self._loop._faults.ended(engine)
                    self._loop._ended.append((engine.identity, value))
            elif event & REFUSAL_EVENTS:
                self._loop._counters[Counter.AUTH_REFUSED] += 1

    def drop_ended(self) -> None:
        """Forget the clients whose connection ended (those still known by that routing
        id on that connection), and abort their requests."""
        ended, self._loop._ended = self._loop._ended, []
        for identity, fd in ended:
            client = self._loop._clients.get(identity)
            engine = self._loop._engine_by_identity.get(identity)
            if client is not None and client.fd == fd:
                self.client_gone(client, unreachable=False)
            elif engine is not None and engine.fd == fd and engine.state != GONE:
                self._loop._faults.lost(engine, GoneReason.DISCONNECTED)
        if self._loop._gone:
            self._loop._faults.settle()

    def goodbye(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """DISCONNECT from a client: it closes; forget it and abort what it left."""
        if (
            self._loop._answers.parse(protocol.DISCONNECT, client, Header.DISCONNECT, frames)
            is not None
        ):
            self.client_gone(client, unreachable=False, closed=True)

    def heartbeat(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        message = self._loop._answers.parse(protocol.HEARTBEAT, None, Header.HEARTBEAT, frames)
        if message is None:
            return
        if engine.state != GONE:
            engine.heartbeats = True
            engine.last_heartbeat = time.monotonic()
            self._loop._tally.heartbeat(engine.rank, message.pending, message.capacity)

    def disconnect(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """DISCONNECT: no new work; its requests in flight may finish, for a while."""
        if self._loop._answers.parse(protocol.DISCONNECT, None, Header.DISCONNECT, frames) is None:
            return
        if engine.state != ALIVE:
            return
        if self._loop._pd is not None and engine.rank in self._loop._pd.seats:
            # a role engine leaves as #6675's do: its hops go on elsewhere now
            self._loop._faults.mark_gone(engine, GoneReason.DISCONNECTED)
            return
        self._loop._router.remove_rank(engine.rank)
        engine.state = DRAINING
        engine.drain_deadline = time.monotonic() + self._loop._options.drain_timeout
        if self._loop._router.pending(engine.rank) == 0:
            engine.state = GONE

    def client_gone(self, client: _Client, unreachable: bool = True, closed: bool = False) -> None:
        """A client that cannot be reached, or that left (DISCONNECT: ``closed``, or its
        connection ended): its requests are aborted at their engines and forgotten, and
        so is the client; but a rebuild client with a hold that did not close may come
        back (a blip): it is only away (Rebuild.go_away)."""
        if self._loop._clients.get(client.identity) is not client:
            return
        self._loop._counters[Counter.CLIENTS_DEPARTED] += 1
        if unreachable:
            self._loop._counters[Counter.CLIENT_GONE] += 1
        if client.present and client.hold > 0 and not closed:
            self._loop._rebuild.go_away(client)
        else:
            self.drop_client(client)

    def drop_client(self, client: _Client) -> None:
        """Abort a client's requests at their engines, and forget them and it."""
        for request in self._loop._faults.in_order(lambda r: True, client.requests.values()):
            if self._loop._find(request.server_rid) is not request:
                continue
            rank = request.rank
            self._loop._forget(request)
            if request.flags & ABORTED or rank < 0 or self._loop._engines[rank].state == GONE:
                continue
            self._loop._control.abort_at_engine(self._loop._engines[rank], request.server_rid)
        self.remove_client(client)
