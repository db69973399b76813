"""What the loop reports: stats() and metrics() (loop/report.pyx)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._kvevents import kv_stats
from .._shared import busiest, metrics_map, stats_map

if TYPE_CHECKING:
    from .loop import Loop

#: Reads of the tables from another thread before one is let fail (see _read_racing).
READ_ATTEMPTS = 100


class Report:
    """What the loop reports: stats() and metrics(), read from its tables and counters."""

    def __init__(self, loop: Loop):
        self._loop = loop

    def stats(self) -> dict[str, Any]:
        return _read_racing(self._stats)

    def metrics(self) -> dict[str, Any]:
        """Traffic by header and direction, outcomes by error code, latencies."""
        return _read_racing(self._metrics)

    def _stats(self) -> dict[str, Any]:
        now = time.monotonic()
        measured = self._loop._latency is not None
        stats = stats_map(
            implementation=self._loop.implementation,
            policy=self._loop._router.policy,
            epoch=self._loop._epoch,
            messages=self._loop._messages,
            inflight=self._loop._live,
            clients=len(self._loop._clients)
            - sum(not self._loop._clients[i].present for i in self._loop._rebuild.away),
            control_state=self._loop._control_state,
            counters=list(self._loop._counters),
            engines=[
                (
                    e.rank,
                    e.identity,
                    e.state,
                    self._loop._router.pending(e.rank),
                    max(e.quarantined_until - now, 0.0),
                    e.failures,
                    e.last_failure,
                    *self._loop._tally.engine(e.rank, measured),
                    now - e.last_heartbeat if e.heartbeats else None,
                )
                for e in list(self._loop._engines)
            ],
            queue=self._loop._queue.stats(),
            busiest_clients=busiest(
                [
                    (
                        c.identity,
                        len(c.requests),
                        self._loop._tally.submitted.get(c, 0) if measured else None,
                        c.rebuild,
                        not c.present,
                    )
                    for c in list(self._loop._clients.values())
                ]
            ),
        )
        if self._loop._pd is not None:
            stats["pd"] = self._loop._pd.stats()
        if self._loop._kv is not None and self._loop._kv_events is not None:
            stats["kv_events"] = kv_stats(self._loop._kv.stats(), self._loop._kv_events.stats())
        return stats

    def _metrics(self) -> dict[str, Any]:
        return metrics_map(
            traffic=self._loop._traffic.metrics(),
            failed=list(self._loop._failed),
            refused=list(self._loop._refused),
            latency=None if self._loop._latency is None else self._loop._latency.metrics(),
            prefix=self._loop._router.prefix_counts,
            queue=self._loop._queue.metrics(),
            engine_latency=None if self._loop._tally.final is None else self._loop._tally.latency(),
        )


def _read_racing(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``read()``, from any thread. A read from another thread (the API, the metrics
    server) races the loop's thread, and CPython raises when a table changes size
    under an iteration: read again. (The C core reads its tables without letting the
    loop's thread run.)"""
    for _ in range(READ_ATTEMPTS - 1):
        try:
            return read()
        except RuntimeError:
            continue
    return read()
