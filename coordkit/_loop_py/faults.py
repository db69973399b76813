"""An engine's faults (loop/faults.pyx)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import _codec_py as codec
from .._shared import (
    BACKOFF_MAX,
    GONE_REASONS,
    Counter,
    GoneReason,
    Options,
    RouteStatus,
    continued,
    resumed,
)
from ..protocol import Buffer, ErrorCode, Header, ProtocolError
from .dialect import carriers
from .kept import kept_inbound, kept_prompt
from .refusals import _refusal
from .tables import (
    ABORTED,
    ALIVE,
    AWAY,
    GONE,
    MIGRATED,
    PINNED,
    PRODUCED,
    UNCONFIRMED,
    Kept,
    _Client,
    _Engine,
    _Request,
)

if TYPE_CHECKING:
    from .loop import Loop


class Faults:
    """An engine's faults cost no double work and no stream (docs/failure-model.md).

    The grace: an engine whose connection ends (the monitor says so, or a send finds
    no peer) takes no new work at once, but what it holds waits for it (AWAY) for
    ``engine_grace`` seconds; back in time (any message from its identity, or a hello
    of the same session), its replies are the answers and nothing ran twice; not
    back, it is gone. The breaker: an engine that fails ``breaker_failures`` times
    within ``breaker_window`` is quarantined (no work) for a backoff that doubles
    while it keeps failing. The migration: a request that streamed tokens before its
    engine died goes on at another, its prompt extended by them (``streamed``, read
    from its partials) and its budget reduced; its replies then continue the stream.
    """

    def __init__(self, loop: Loop, options: Options):
        self._loop = loop
        self.grace = options.engine_grace
        self.failures = options.breaker_failures
        self.window = options.breaker_window
        self.backoff = options.breaker_backoff
        # server id -> the tokens it streamed at the engines before its present one
        self.migrated: dict[int, list[int]] = {}

    # -- the grace -----------------------------------------------------------------------

    def lost(self, engine: _Engine, reason: GoneReason) -> None:
        """Its connection ended, or a send found no peer: AWAY for the grace, or gone
        (no grace, or it was not taking work); AWAY already, nothing more."""
        if engine.state == AWAY:
            return
        if engine.state != ALIVE or not self.grace:
            self.mark_gone(engine, reason)
            return
        now = time.monotonic()
        self.strike(engine, reason, now)
        engine.state = AWAY
        engine.away_until = now + self.grace
        self._loop._router.remove_rank(engine.rank)

    def ended(self, engine: _Engine) -> None:
        """The monitor says its connection ended: from now on no new work, whatever the
        grace (a Megatron engine cannot say what reached it). What it sent before is
        handled first (its late replies routed), then it is lost (Peers.drop_ended)."""
        if engine.state != ALIVE:
            return
        if self.grace:
            self.lost(engine, GoneReason.DISCONNECTED)
        else:  # gone once its last messages are handled
            self._loop._router.remove_rank(engine.rank)

    def back(self, engine: _Engine, fd: int) -> None:
        """An engine AWAY (or whose connection changed unseen) heard from again on
        connection ``fd``: its requests are its own again, and it takes work (unless
        quarantined). A request may have been lost with the old connection on its way
        to it: a rebuild engine's HELD says which it holds (UNCONFIRMED until then).
        A message from a connection that ended is what it sent before: not its return."""
        self._loop._peers.connection_events()  # what the monitor said first
        if fd >= 0 and fd not in self._loop._connections:
            return
        if engine.state == AWAY:
            engine.state = ALIVE
            self._loop._counters[Counter.ENGINES_BACK] += 1
        self.admit(engine)  # out of the pool since its connection ended (ended)
        self._loop._peers.watch(engine, fd)
        if engine.rebuild:
            for request in self.in_order(lambda r: r.rank == engine.rank):
                request.flags |= UNCONFIRMED

    def not_held(self, engine: _Engine) -> None:
        """After an engine's HELD: its requests it did not list never reached it."""
        resend: dict[_Client, list[int]] = defaultdict(list)
        for request in self.in_order(lambda r: r.rank == engine.rank and r.flags & UNCONFIRMED):
            self.unrun(request, resend)
        self._loop._rebuild.send_resends(resend)

    def admit(self, engine: _Engine) -> None:
        """An engine ALIVE takes work, unless quarantined."""
        if engine.quarantined_until <= time.monotonic() and self._whole(engine.rank):
            self._loop._router.add_rank(engine.rank)

    def tick(self, now: float) -> None:
        """The grace over (gone), and the quarantines over (work again)."""
        for engine in self._loop._engines:
            if engine.state == AWAY and now >= engine.away_until:
                self.mark_gone(engine, GoneReason.GRACE_OVER)
            if engine.quarantined_until and now >= engine.quarantined_until:
                engine.quarantined_until = 0.0
                if engine.state == ALIVE and self._whole(engine.rank):
                    self._loop._router.add_rank(engine.rank)

    def _whole(self, rank: int) -> bool:
        """Whether a rank takes whole requests (a P/D role may say it does not)."""
        return self._loop._pd is None or self._loop._pd.whole(rank)

    # -- the breaker ---------------------------------------------------------------------

    def strike(self, engine: _Engine, reason: GoneReason, now: float) -> None:
        """An engine failed: one more in its window; at ``failures`` it is quarantined,
        for a backoff doubled from the last one's unless it stayed up a window since."""
        engine.last_failure = reason
        if not self.failures or now < engine.quarantined_until:
            return  # the breaker is open: failing meanwhile is what it is open for
        if now - engine.failures_since > self.window:
            engine.failures, engine.failures_since = 0, now
        engine.failures += 1
        if engine.failures < self.failures:
            return
        if now - engine.quarantined_until > self.window:
            engine.quarantines = 0  # it stayed up since the last one: start over
        backoff = min(self.backoff * 2**engine.quarantines, BACKOFF_MAX)
        engine.quarantined_until = now + backoff
        engine.quarantines += 1
        engine.failures = 0
        self._loop._router.remove_rank(engine.rank)
        self._loop._counters[Counter.QUARANTINES] += 1
        what = f"engine {engine.rank} quarantined for {backoff:g} s ({GONE_REASONS[reason]})"
        self._loop._log.warn("quarantine", what)

    # -- the migration -------------------------------------------------------------------

    def streamed(self, request: _Request, body: Buffer) -> None:
        """A partial of a request whose prompt is kept: the tokens it carries (a partial
        without them, or a bad one: the request cannot go on elsewhere)."""
        try:
            kind, tokens = codec.streamed_tokens(body)
        except ProtocolError:
            kind = codec.NO_TOKENS
        assert request.streamed is not None
        if kind == codec.NEW_TOKENS:
            request.streamed += tokens
        elif kind == codec.ALL_TOKENS:
            request.streamed = tokens
        else:
            request.streamed = None

    def migrate(self, request: _Request) -> RouteStatus | None:
        """A request that streamed before its engine died, on to another: its prompt
        extended by the tokens streamed and its budget reduced (see _shared.resumed);
        None when it cannot go on (tokens not known, its params opt out, a str prompt)."""
        kept = request.kept
        if request.streamed is None or kept is None:
            return None
        new = resumed(kept.meta, kept_prompt(kept), request.streamed)
        if new is None:
            return None
        self._loop._small_shared -= kept.small
        request.kept = Kept(*new, kept.single, False)
        before = self.migrated.get(request.server_rid, [])
        self.migrated[request.server_rid] = before + request.streamed
        request.streamed = []
        request.flags |= MIGRATED
        return self.resend(request)

    def continued(self, request: _Request, body: Buffer) -> bytes:
        """A reply of a request that went on at another engine, continuing its stream."""
        return continued(body, self.migrated[request.server_rid])

    # -- a gone engine's requests settled --------------------------------------------

    def mark_gone(self, engine: _Engine, reason: GoneReason) -> None:
        """Take an engine out of the pool now; its requests are settled after the
        message at hand (see _settle), so a failure never recurses into routing."""
        if engine.state == GONE:
            return
        if engine.state != AWAY:  # counted when it went away
            self.strike(engine, reason, time.monotonic())
        if engine.state == ALIVE:
            self._loop._router.remove_rank(engine.rank)
        engine.state = GONE
        self._loop._counters[Counter.ENGINE_FAILURES] += 1
        self._loop._tally.engines[engine.rank].gone += 1
        self._loop._gone.append((engine, reason))

    def settle(self) -> None:
        """Re-send or fail the requests of the engines found gone, oldest first.

        Settling one engine may find others gone (a re-send that cannot reach
        its engine): they join the queue, so the work stays a loop, not a recursion.
        """
        i = 0
        while i < len(self._loop._gone):
            self.settle_engine(*self._loop._gone[i])
            i += 1
        self._loop._gone.clear()

    def settle_engine(self, engine: _Engine, reason: GoneReason) -> None:
        """Each request of a gone engine, by server id, lost there (_unrun)."""
        self._loop._log.warn("engine_failed", f"engine {engine.rank} gone ({GONE_REASONS[reason]})")
        if self._loop._pd is not None:
            self._loop._pd.engine_gone(engine)  # its P/D requests go on elsewhere, or end
        if self._loop._kv_events is not None and engine.state == GONE:  # (not back already)
            self._loop._kv_events.unannounce(engine.rank)  # the publisher it announced goes too
        resend: dict[_Client, list[int]] = defaultdict(list)
        for request in self.in_order(lambda r: r.rank == engine.rank):
            if self._loop._find(request.server_rid) is not request or request.rank != engine.rank:
                continue  # ended meanwhile: its client went away
            self.unrun(request, resend)
        self._loop._rebuild.send_resends(resend)

    def unrun(self, request: _Request, resend: dict[_Client, list[int]]) -> None:
        """A request its engine will never answer (it died, or does not hold it): re-sent
        from what was kept when it produced nothing (a rebuild client's: RESEND), moved on
        with the tokens it streamed when it did (Faults.migrate), otherwise ended with
        ERROR(ENGINE_FAILED)."""
        self._loop._tally.failed(request.rank)  # whatever comes of it, that engine lost it
        self._loop._router.release(request.rank, request.work)
        request.rank = -1
        request.flags &= ~UNCONFIRMED
        if request.flags & (ABORTED | PINNED) or (
            request.kept is None and not request.client.rebuild
        ):
            self._loop._refusals.fail_request(
                request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST
            )
            return
        if request.flags & PRODUCED:
            migrated = self.migrate(request)
            if migrated is None:  # it cannot go on elsewhere
                self._loop._refusals.fail_request(
                    request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST
                )
                return
            status, counter = migrated, Counter.MIGRATED
        elif request.kept is None:  # a rebuild client sends it again itself
            if self._loop._traces is not None:
                self._loop._traces.drop(request)
            self._loop._forget(request)
            resend[request.client].append(request.client_rid)
            return
        else:
            status, counter = self.resend(request), Counter.REROUTED
        if (
            status == RouteStatus.ALL_BUSY
            and self._loop._queue.limit
            and self._loop._queued(request, None, True)
        ):
            return  # it waits at the head, sent from what it kept (moved on: its tokens)
        if status == RouteStatus.SENT:
            self._loop._counters[counter] += 1
        elif status == RouteStatus.UNSENDABLE:  # no engine left that speaks its format
            self._loop._refusals.fail_request(
                request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST
            )
        else:
            self._loop._refusals.fail_request(request, _refusal(status), Header.SUBMIT_REQUEST)

    def resend(self, request: _Request) -> RouteStatus:
        """Send a request whose engine died to another, from what it kept, as a new
        request is sent (_route); a RouteStatus."""
        assert request.kept is not None
        inbound = kept_inbound(
            request.kept, self._loop._n_multipart_engines, self._loop._n_single_engines
        )
        carriers(inbound, self._loop._n_single_engines + self._loop._n_main_engines > 0)
        status = RouteStatus.ENGINE_GONE
        while status == RouteStatus.ENGINE_GONE:  # that one waits in the queue of gone engines
            status = self._loop._route(request, inbound)
        return status

    def in_order(self, keep: Any, among: Iterable[_Request] | None = None) -> list[_Request]:
        """The requests in flight (of ``among``, else all) for which ``keep`` holds, by
        server id."""
        if among is None:
            among = [*self._loop._requests.values(), *self._loop._adopted.values()]
        return sorted((r for r in among if keep(r)), key=lambda r: r.server_rid)
