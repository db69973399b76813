"""The rebuild after a coordinator's loss (loop/rebuild.pyx)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import zmq

from .. import protocol
from .._shared import Counter, GoneReason, Options, PeerRole
from ..protocol import ErrorCode, Header
from .tables import (
    ABORTED,
    ASKED,
    GONE,
    MAX_ADOPTED,
    ORPHAN,
    PINNED,
    PRODUCED,
    REPLAYING,
    UNCONFIRMED,
    _Client,
    _Engine,
    _Request,
)

if TYPE_CHECKING:
    from .loop import Loop


class Rebuild:
    """The rebuild after a coordinator's loss, and the ride-through of a client's blip
    (docs/design.md, "The rebuild after a coordinator's loss"): what engines report
    (HELD), what clients wait for (REJOIN), the replays (REPLAY, REPLAYED), what is sent
    back (RESEND), the acknowledgements (HANDLED) and the clients away. Until the window
    ends, engines report what they hold and clients what they wait for; meanwhile no
    HANDLED goes out (a replay may need it all). It works on its loop's tables."""

    def __init__(self, loop: Loop, options: Options):
        self._loop = loop
        self.window = options.rebuild_window
        self.cluster = options.cluster
        self.until = time.monotonic() + self.window
        self.rebuilding = True
        # REJOIN entries no engine claimed yet: (client identity, rid) -> partials got
        self.awaiting: dict[tuple[bytes, int], int] = {}
        # REJOIN entries aborted before an engine claimed them: (client identity, rid)
        self.aborting: set[tuple[bytes, int]] = set()
        # What engines' reports adopted in the window, ended or not: a second claim of a
        # server id, or of a client's request id, is refused (nothing is answered twice).
        self.claimed_ids: set[int] = set()
        self.claimed_rids: set[tuple[bytes, int]] = set()
        # Requests of rejoined clients that found no engine yet, by routing id: sent back
        # (RESEND) once one registers, or at the window's end (resend_deferred).
        self.deferred: dict[bytes, list[int]] = defaultdict(list)
        # Rebuild clients whose connection ended, by identity: until when their requests
        # wait for their REJOIN (meanwhile their engines get no HANDLED: a replay may
        # need all they kept).
        self.away: dict[bytes, float] = {}

    def held(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """HELD: what a rebuild engine holds, after its registration. A request this
        coordinator has at that engine (a blip) is replayed whole; one it does not know
        is adopted under its server id while the window lasts, for a client that may
        still REJOIN it; any other is aborted at the engine, which must not run it on."""
        parsed = self._loop._answers.parse(protocol.HELD, None, Header.HELD, frames)
        if parsed is None:
            return
        self.reopen()
        entries, hashes = parsed
        self._loop._router.learn(engine.rank, hashes, time.monotonic())
        replays: dict[_Engine, list[list[int]]] = defaultdict(list)
        aborts = []
        pd = self._loop._pd
        for server_rid, client_rid, client_id, partials, final in entries:
            if client_id is None and pd is not None and pd.reported(engine.rank, server_rid, final):
                continue
            request = self._loop._find(server_rid)
            if request is not None:
                # Its client named, or nil for one that did not ask for the rebuild.
                named = client_id == (request.client.identity if request.client.rebuild else None)
                if not (request.rank == engine.rank and request.client_rid == client_rid and named):
                    aborts.append(server_rid)  # another's: the first claim stands
                    continue
                request.flags &= ~UNCONFIRMED
                if client_id is not None and not request.flags & ORPHAN:
                    self._replay(request, -1, replays)  # an orphan's waits for its client
                continue
            if client_id is None:  # nobody to adopt it for
                aborts.append(server_rid)
                continue
            client = None if engine.state == GONE else self._adoptive_client(client_id, client_rid)
            if client is None or not self._claimable(server_rid, client_id, client_rid):
                aborts.append(server_rid)
                continue
            request = self._loop._adopt(client, client_rid, server_rid)
            self._loop._admit(request)
            self._loop._router.hold(engine.rank)
            request.rank, request.work = engine.rank, self._loop._router.charged
            request.flags = ORPHAN | REPLAYING | (PRODUCED if partials else 0)
            self._loop._counters[Counter.ADOPTED] += 1
            start = self.awaiting.pop((client_id, client_rid), None)
            if start is not None:
                request.flags &= ~ORPHAN
                self._replay(request, start, replays)
                if (client_id, client_rid) in self.aborting:  # its client aborted it meanwhile
                    self.aborting.discard((client_id, client_rid))
                    request.flags |= ABORTED
                    aborts.append(server_rid)
        self._refuse_claims(engine, "HELD", len(aborts))
        for server_rid in aborts:
            if engine.state != GONE:
                self._loop._control.abort_at_engine(engine, server_rid)
        self._send_replays(replays)
        self._loop._faults.not_held(engine)

    def reopen(self) -> None:
        """A cluster's member, a HELD or a REJOIN at hand: the window (again, or longer)
        for what a member lost leaves (its clients' REJOINs, the engines' claims of
        their requests, in either order, within a window of each other)."""
        if self.cluster:
            self.rebuilding = True
            self.until = max(self.until, time.monotonic() + self.window)

    def _claimable(self, server_rid: int, client_id: bytes, client_rid: int) -> bool:
        """Whether an engine's report may be adopted under ``server_rid``: not an id this
        life drew (those are all known, in flight or ended), nor one past MAX_ADOPTED,
        and claimed by nobody before in the window (by server id, or by its client's
        id), even if it has ended since. A cluster's member skips the first test: a
        member lost drew its ids from its own start, among or past this one's, and an
        adoption moves the next id past the one adopted; a claim of its own ended
        request is adopted only for a client that is absent or has not REJOINed yet,
        and its REJOIN, which does not list it, has it aborted."""
        if not 0 <= server_rid < MAX_ADOPTED or (
            not self.cluster
            and self._loop._options.first_server_id <= server_rid < self._loop._next_rid
        ):
            return False
        if server_rid in self.claimed_ids or (client_id, client_rid) in self.claimed_rids:
            return False
        self.claimed_ids.add(server_rid)
        self.claimed_rids.add((client_id, client_rid))
        return True

    def _refuse_claims(self, engine: _Engine, kind: str, count: int) -> None:
        """Claims of an engine's report that could not be true: counted and logged; they
        change nothing of another peer's."""
        if count:
            self._loop._counters[Counter.REFUSED_CLAIMS] += count
            what = f"refused {count} {kind} claims from engine {engine.rank}"
            self._loop._log.warn(f"claims:{engine.rank}", what)

    def _adoptive_client(self, identity: bytes, client_rid: int) -> _Client | None:
        """The client an adopted request would be for (made, absent, until it
        connects); None when it must not be adopted: the window is over, the client
        rejoined without it or sent it again, or the tables are full."""
        client = self._loop._clients.get(identity)
        # A client connected that rejoined (or said it rejoins nothing) waits only for
        # what it listed; one that never asked for the rebuild waits for nothing.
        unwanted = client is not None and client.present and not (client.rebuild and client.fresh)
        if (
            not self.rebuilding
            or self._loop._live >= self._loop._options.max_inflight
            or (client is not None and client_rid in client.requests)
            or (unwanted and (identity, client_rid) not in self.awaiting)
        ):
            return None
        if client is not None:
            return client
        if (
            identity in self._loop._engine_by_identity
            or self._loop._roles.of(identity) == PeerRole.ENGINE
        ):
            return None
        if (
            len(self._loop._clients) >= self._loop._options.max_clients
            and not self._loop._peers.vacant_client()
        ):
            return None
        client = self._loop._clients[identity] = self._loop._idle[identity] = _Client(identity)
        client.coordkit = client.rebuild = True  # only a rebuild client's id travels
        client.present = False
        return client

    def rejoin(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """REJOIN: the requests a rebuild client still waits for, once acknowledged
        again. Each one held is replayed from the partials it got; one not held waits
        for an engine to claim it while the window lasts, and is sent back after it
        (RESEND, or ERROR(ENGINE_FAILED) when it got partials: it cannot start over).
        Its adopted requests it did not list are not awaited: aborted."""
        if not client.fresh:  # what it waits for was settled by its first message
            self._loop._refusals.malformed(
                client, None, Header.REJOIN, "not the connection's first", frames
            )
            return
        parsed = self._loop._answers.parse(protocol.REJOIN, client, Header.REJOIN, frames)
        if parsed is None:
            return
        entries, _ = parsed
        if any(partials < 0 for _, partials in entries):
            self._loop._refusals.malformed(
                client, None, Header.REJOIN, "a negative count of partials", frames
            )
            return
        if len(entries) > self._loop._options.max_inflight:
            self._loop._refusals.malformed(
                client, None, Header.REJOIN, "more entries than max_inflight", frames
            )
            return
        client.fresh = False
        client.rejoined = True
        self.reopen()
        self.away.pop(client.identity, None)  # back from a blip: its requests carry on
        replays: dict[_Engine, list[list[int]]] = defaultdict(list)
        resend: dict[_Client, list[int]] = defaultdict(list)
        for rid, partials in entries:
            request = client.requests.get(rid)
            if request is not None:
                request.flags &= ~ORPHAN
                self._replay(request, partials, replays)
            elif self.rebuilding:
                self.awaiting[(client.identity, rid)] = partials
            else:
                self._unclaimed(client, rid, partials, resend)
        for request in self._loop._faults.in_order(
            lambda r: r.client is client and r.flags & ORPHAN
        ):
            self._drop_orphan(request)
        self._send_replays(replays)
        self.send_resends(resend)

    def replayed(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """REPLAYED: what an engine sends again, each reply with its place, on to its
        client as CLIENT_REPLAYED (which drops what it has); its normal replies flow
        again. A request the engine does not hold is sent back to its client when
        nothing of it was delivered, else ended with ERROR(ENGINE_FAILED)."""
        parsed = self._loop._answers.parse(protocol.REPLAYED, None, Header.REPLAYED, frames)
        if parsed is None:
            return
        entries, _ = parsed
        now = time.monotonic() if self._loop._latency is not None else 0.0
        out: dict[_Client, list[tuple[list[Any], Any]]] = defaultdict(list)
        resend: dict[_Client, list[int]] = defaultdict(list)
        at = 2
        refused = 0
        for server_rid, first, count, final in entries:
            bodies, at = frames[at : at + count], at + count
            request = self._loop._find(server_rid)
            if request is None or request.rank != engine.rank or not request.flags & ASKED:
                refused += 1  # not asked of it (or asked and answered already)
                continue
            if not request.client.present:
                continue  # its client is away again: its REJOIN asks anew
            request.flags &= ~(REPLAYING | ASKED)
            if first < 0:
                self._unheld(request, resend)
                continue
            for j, body in enumerate(bodies):
                last = final and j == count - 1
                self._loop._finish(request, last, now)
                out[request.client].append(([request.client_rid, first + j, last], body))
        self._refuse_claims(engine, "REPLAYED", refused)
        for client, replies in out.items():
            message = protocol.CLIENT_REPLAYED.pack(*zip(*replies, strict=True))
            if not self._loop._answers.send(client.identity, message):
                self._loop._peers.client_gone(client)
        self.send_resends(resend)

    def _replay(self, request: _Request, start: int, replays: dict[_Engine, Any]) -> None:
        """Ask the request's engine (a rebuild engine) to send again what it sent for
        it from partial ``start`` on (-1: all it keeps); its replies wait till then."""
        if request.rank < 0:
            return
        engine = self._loop._engines[request.rank]
        if engine.rebuild and engine.state != GONE:
            request.flags |= REPLAYING | ASKED
            replays[engine].append([request.server_rid, start])

    def _send_replays(self, replays: dict[_Engine, list[list[int]]]) -> None:
        for engine, entries in replays.items():
            self._loop._counters[Counter.REPLAYED] += len(entries)
            if not self._loop._answers.send(engine.identity, protocol.REPLAY.pack(entries)):
                self._loop._faults.lost(engine, GoneReason.UNREACHABLE)

    def send_resends(self, resend: dict[_Client, list[int]]) -> None:
        """RESEND to each client (one that is connected) of the requests it must send again."""
        for client, rids in resend.items():
            if not client.present or self._loop._clients.get(client.identity) is not client:
                continue
            self._loop._counters[Counter.RESENT] += len(rids)
            if not self._loop._answers.send(client.identity, protocol.RESEND.pack(rids)):
                self._loop._peers.client_gone(client)

    def rejoins_nothing(self, client: _Client) -> None:
        """A connected client's first message is not a REJOIN: it waits for nothing an
        engine may still report, and what was adopted for it is aborted (before the
        message is handled: one of its new requests may have the id of one)."""
        client.fresh = False
        if client.requests:
            for request in self._loop._faults.in_order(
                lambda r: r.flags & ORPHAN, client.requests.values()
            ):
                self._drop_orphan(request)

    def _unclaimed(
        self, client: _Client, rid: int, partials: int, resend: dict[_Client, list[int]]
    ) -> None:
        """A request a client waits for that no engine holds: sent back when it got
        nothing, else ended (partials went out: it cannot start over)."""
        if partials == 0:
            resend[client].append(rid)
            return
        self._loop._failed[ErrorCode.ENGINE_FAILED] += 1
        self._loop._counters[Counter.ENGINE_FAILED] += 1
        if not self._loop._refusals.send_error(
            client, rid, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST
        ):
            self._loop._peers.client_gone(client)

    def _unheld(self, request: _Request, resend: dict[_Client, list[int]]) -> None:
        """A request its engine says it does not hold (any more): sent back to its
        client when nothing of it was delivered, else ended with ERROR(ENGINE_FAILED)."""
        if request.flags & (PRODUCED | ABORTED | PINNED) or not request.client.rebuild:
            self._loop._refusals.fail_request(
                request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST
            )
            return
        if self._loop._traces is not None:
            self._loop._traces.drop(request)
        self._loop._forget(request)
        resend[request.client].append(request.client_rid)

    def _drop_orphan(self, request: _Request) -> None:
        """An adopted request no client waits for: aborted at its engine and forgotten,
        and its client with it when that never came back and has nothing left."""
        rank, client = request.rank, request.client
        self._loop._forget(request)
        if rank >= 0 and self._loop._engines[rank].state != GONE:
            self._loop._control.abort_at_engine(self._loop._engines[rank], request.server_rid)
        if not client.present and not client.requests and client.identity in self._loop._clients:
            self._loop._peers.remove_client(client)

    def defer(self, client: _Client, rid: int) -> None:
        """Keep a request for RESEND once an engine registered (see Loop._accept)."""
        self.deferred[client.identity].append(rid)

    def resend_deferred(self) -> None:
        """RESEND of the deferred requests (see _accept), to the clients still here."""
        deferred, self.deferred = self.deferred, defaultdict(list)
        resend: dict[_Client, list[int]] = {}
        for identity, rids in deferred.items():
            client = self._loop._clients.get(identity)
            if client is not None:
                resend[client] = rids
        self.send_resends(resend)

    def end_window(self) -> None:
        """The window's end: the requests clients wait for that no engine claimed are
        sent back (see _unclaimed), the adopted ones no client came back for are
        aborted, and HANDLED goes out again."""
        self.rebuilding = False
        self.claimed_ids.clear()  # no report is adopted any more
        self.claimed_rids.clear()
        awaiting, self.awaiting = self.awaiting, {}
        resend: dict[_Client, list[int]] = defaultdict(list)
        aborting, self.aborting = self.aborting, set()
        for (identity, rid), partials in awaiting.items():
            client = self._loop._clients.get(identity)
            if client is None:
                continue
            if (identity, rid) in aborting:  # aborted before anyone ran it: not sent again
                self._loop._refusals.refuse(
                    client,
                    rid,
                    ErrorCode.UNKNOWN_REQUEST,
                    Header.ABORT_REQUEST,
                    Counter.UNKNOWN_REQUEST,
                )
            else:
                self._unclaimed(client, rid, partials, resend)
        self.send_resends(resend)
        # The orphans of a client away from a blip wait for it till its hold ends.
        for request in self._loop._faults.in_order(
            lambda r: r.flags & ORPHAN and r.client.identity not in self.away
        ):
            if self._loop._find(request.server_rid) is request:
                self._drop_orphan(request)

    def acknowledge(self) -> None:
        """HANDLED to each rebuild engine (after the window): the number of its last
        reply message handled by the previous tick, so at least a tick ago, by when
        the replies in it have left this process in all but a stall. An engine that
        holds requests of a client away is not: a REJOIN may want all it kept."""
        holding = {r.rank for i in self.away for r in self._loop._clients[i].requests.values()}
        for engine in self._loop._engines:
            if (
                engine.rebuild
                and engine.state != GONE
                and not self.rebuilding
                and engine.rank not in holding
                and engine.mark > engine.acked
            ):
                engine.acked = engine.mark
                count = engine.base + engine.acked - 1
                if not self._loop._answers.send(engine.identity, protocol.HANDLED.pack(count)):
                    self._loop._faults.lost(engine, GoneReason.UNREACHABLE)
            engine.mark = engine.handled

    def go_away(self, client: _Client) -> None:
        """A rebuild client's connection ended: for its hold (its failover_timeout, from
        its CONNECT) its requests at rebuild engines wait for its REJOIN, as adopted ones
        do (ORPHAN), their replies dropped meanwhile (REPLAYING: the engine keeps them,
        and is sent no HANDLED meanwhile); the REJOIN replays what it lacks. Those at
        other engines cannot be replayed: aborted now (the REJOIN then has them sent
        again, or failed, as after a coordinator's loss). A client left with nothing in
        flight is not kept: it is forgotten as any other."""
        client.present = client.rejoined = False
        if self._loop._connections.get(client.fd) is client:
            self._loop._connections[client.fd] = None
        client.fd = -1
        self.away[client.identity] = time.monotonic() + client.hold
        for request in self._loop._faults.in_order(lambda r: True, client.requests.values()):
            rank = request.rank
            if (
                rank >= 0
                and self._loop._engines[rank].rebuild
                and self._loop._engines[rank].state != GONE
            ):
                request.flags |= ORPHAN | REPLAYING
                continue
            self._loop._forget(request)
            if (
                not request.flags & ABORTED
                and rank >= 0
                and self._loop._engines[rank].state != GONE
            ):
                self._loop._control.abort_at_engine(self._loop._engines[rank], request.server_rid)
        if not client.requests:
            self._loop._peers.remove_client(client)

    def returned(self, client: _Client) -> None:
        """A client not connected (away, or known from an engine's report) sent CONNECT:
        one that was away and has nothing in flight awaits no REJOIN."""
        if client.identity in self.away:
            self._loop._counters[Counter.CLIENTS_RETURNED] += 1
            if not client.requests:
                del self.away[client.identity]

    def end_holds(self, now: float) -> None:
        """The clients away past their hold: one that did not come back is dropped with
        its requests (aborted at their engines); one that came back and did not REJOIN
        them has its orphans aborted."""
        for identity, until in list(self.away.items()):
            if now < until:
                continue
            del self.away[identity]
            client = self._loop._clients[identity]
            if not client.present:
                self._loop._peers.drop_client(client)
                continue
            for request in self._loop._faults.in_order(
                lambda r: r.flags & ORPHAN, client.requests.values()
            ):
                self._drop_orphan(request)

    def sent_finals(self, engine: _Engine, entries: list[Any], now: float) -> None:
        """The finals to clients with a hold, sent: forgotten now, but those whose client
        went away meanwhile (REPLAYING since: its REJOIN replays them)."""
        for entry in entries:
            request = None if entry is None else self._loop._find(entry[0])
            if (
                request is not None
                and request.rank == engine.rank
                and request.client.hold > 0
                and not request.flags & REPLAYING
            ):
                self._loop._finish(request, True, now)
