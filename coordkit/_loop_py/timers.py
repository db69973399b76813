"""The loop's timers, every TICK (loop/timers.pyx)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._shared import Counter, GoneReason
from ..protocol import ErrorCode, Header
from .tables import DRAINING, GONE

if TYPE_CHECKING:
    from .loop import Loop


class Timers:
    """The loop's timers, every TICK: engines whose drain or heartbeat timed out, the grace
    and the quarantines over, requests past request_timeout, the rebuild's window, and
    what that left settled."""

    def __init__(self, loop: Loop):
        self._loop = loop

    def tick(self, now: float) -> None:
        """The timers: engines whose drain or heartbeat timed out declared gone (an
        engine that heartbeats and stops is dead, whatever the grace), the grace and
        the quarantines that are over, the requests in flight longer than
        request_timeout ended, the rebuild window closed, HANDLED to rebuild engines,
        and what that left settled."""
        timeout = self._loop._options.heartbeat_timeout
        for engine in self._loop._engines:
            if engine.state == GONE:
                continue
            if engine.state == DRAINING:
                if now >= engine.drain_deadline:
                    self._loop._faults.mark_gone(engine, GoneReason.DRAIN_TIMED_OUT)
            elif timeout and engine.heartbeats and now - engine.last_heartbeat > timeout:
                self._loop._faults.mark_gone(engine, GoneReason.NO_HEARTBEAT)
        self._loop._faults.tick(now)
        if self._loop._pd is not None:
            self._loop._pd.tick(now)
        # The oldest first: only the requests that are due are touched.
        deadline = now - self._loop._options.request_timeout
        while (
            self._loop._deadlines is not None
            and (oldest := self._loop._deadlines.oldest) is not None
        ):
            if oldest.submitted >= deadline:
                break
            self._loop._refusals.time_out(oldest)
        while self._loop._queue.depth and (handle := self._loop._queue.expired(now)) >= 0:
            self._loop._counters[Counter.TIMED_OUT] += 1  # its own deadline, while it waited
            self._loop._refusals.fail_request(
                self._loop._requests[handle], ErrorCode.TIMED_OUT, Header.SUBMIT_REQUEST
            )
        if self._loop._rebuild.rebuilding and now >= self._loop._rebuild.until:
            self._loop._rebuild.end_window()
        if self._loop._rebuild.deferred and (
            self._loop._router.n_accepting or not self._loop._rebuild.rebuilding
        ):
            self._loop._rebuild.resend_deferred()
        if self._loop._rebuild.away:
            self._loop._rebuild.end_holds(now)
        self._loop._rebuild.acknowledge()
        self._loop._faults.settle()
        if (
            self._loop._dispatch_due or self._loop._queue.depth
        ):  # an engine back from quarantine, ...
            self._loop._dispatch()
        if self._loop._traces is not None and self._loop._traces.ending:
            self._loop._traces.end()
