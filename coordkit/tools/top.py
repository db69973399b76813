"""What ``coordkit top ADDRESS`` shows, computed from the snapshots it read.

Every ``--interval`` seconds :mod:`coordkit.tools.top_app` (the ``top`` extra:
the reading and the screen, which :mod:`coordkit.tools.cli` imports only when
the command runs) asks the coordinator for its stats and its metrics over the wire
(STATS with ``{"metrics": 1}``), the two latency histograms among them when it
measures them (``--metrics-port``); or, given ``--metrics URL``, its stats alone and
the histograms from that Prometheus endpoint. A :class:`History` keeps the
snapshots of the last ``--window`` seconds; rates and percentiles are over that
window.

What the coordinator does not give is shown as "–": the percentiles when it does not
measure latencies, each engine's requests/s and a client's submissions when it does
not measure (no ``--metrics-port``), and the queue depth of a coordinator from before
the queue.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FAILURE_COUNTERS",
    "History",
    "Snapshot",
    "client_rows",
    "engine_rows",
    "figures",
    "measured_latency",
]

#: The counters of stats() that count a request refused or failed, summed as "failed".
FAILURE_COUNTERS = ("engine_failed", "timed_out", "busy", "no_engines", "malformed")

#: The histograms shown, by what the view calls them: (their Prometheus name, read from
#: --metrics; their key in metrics()["latency"], read from the STATS_REPLY).
LATENCY_HISTOGRAMS = {
    "request": ("coordkit_request_duration_seconds", "final"),
    "first reply": ("coordkit_time_to_first_reply_seconds", "first_reply"),
}

#: An engine's counts of stats() summed in its "errors" column.
ENGINE_ERRORS = ("failed", "malformed_entries", "unknown_request", "gone")

NOTHING = "–"  # what the loop does not keep yet, or a rate before a second snapshot

#: Cumulative bucket counts of one histogram: (upper bound, count up to it), +Inf last.
Buckets = list[tuple[float, float]]


@dataclass(frozen=True)
class Snapshot:
    """What one refresh read: the coordinator's stats and, with --metrics, its
    histograms' cumulative buckets by LATENCY_HISTOGRAMS' keys."""

    at: float  # time.monotonic() when read
    stats: dict[str, Any]
    latency: dict[str, Buckets] | None


def measured_latency(metrics: dict[str, Any]) -> dict[str, Buckets] | None:
    """The histograms of LATENCY_HISTOGRAMS from a coordinator's metrics() (the
    STATS_REPLY's "metrics"), cumulative as Prometheus gives them; None when it does
    not measure them."""
    if metrics["latency"] is None:
        return None
    bounds = [*metrics["latency_bounds"], math.inf]
    latency: dict[str, Buckets] = {}
    for name, (_, key) in LATENCY_HISTOGRAMS.items():
        counts, total = metrics["latency"][key]["buckets"], 0.0
        latency[name] = []
        for bound, count in zip(bounds, counts, strict=True):
            total += count
            latency[name].append((bound, total))
    return latency


class History:
    """The snapshots of the last ``window`` seconds (at least the last two)."""

    def __init__(self, window: float):
        self.window = window
        self._snapshots: deque[Snapshot] = deque()

    def add(self, snapshot: Snapshot) -> None:
        if self._snapshots and snapshot.stats["epoch"] != self.newest.stats["epoch"]:
            self._snapshots.clear()  # another coordinator: its counters start again
        self._snapshots.append(snapshot)
        while len(self._snapshots) > 2 and snapshot.at - self._snapshots[1].at >= self.window:
            self._snapshots.popleft()

    @property
    def newest(self) -> Snapshot:
        return self._snapshots[-1]

    @property
    def oldest(self) -> Snapshot:
        return self._snapshots[0]

    @property
    def seconds(self) -> float:
        """The time the rates are over (0: a single snapshot, no rate yet)."""
        return self.newest.at - self._snapshots[0].at

    def rate(self, counters: Iterable[str]) -> float | None:
        """The sum of ``counters`` per second over the window (None: no window yet)."""
        if self.seconds <= 0:
            return None
        first, last = self._snapshots[0].stats["counters"], self.newest.stats["counters"]
        return sum(last[name] - first[name] for name in counters) / self.seconds

    def messages_rate(self) -> float | None:
        if self.seconds <= 0:
            return None
        return (self.newest.stats["messages"] - self._snapshots[0].stats["messages"]) / self.seconds

    def quantile(self, name: str, q: float) -> float | None:
        """The ``q`` quantile of histogram ``name`` over the window, as Prometheus's
        histogram_quantile computes it (None: not read, or nothing observed)."""
        first, last = self._snapshots[0].latency, self.newest.latency
        if first is None or last is None or self.seconds <= 0:
            return None
        observed = [
            (bound, count - before)
            for (bound, count), (_, before) in zip(last[name], first[name], strict=True)
        ]
        return quantile(observed, q)


def quantile(buckets: Buckets, q: float) -> float | None:
    """The ``q`` quantile of cumulative ``buckets``, interpolated linearly inside its
    bucket; in the last (+Inf) bucket, the highest finite bound."""
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def per_second(value: float | None) -> str:
    return NOTHING if value is None else f"{value:,.1f}/s"


def seconds(value: float | None) -> str:
    if value is None:
        return NOTHING
    return f"{value * 1000:,.1f} ms" if value < 1 else f"{value:,.2f} s"


def figures(history: History) -> list[tuple[str, str]]:
    """The fleet's figures, (label, value), in the order shown."""
    stats = history.newest.stats
    rows = [
        ("requests", per_second(history.rate(["submitted"]))),
        ("completed", per_second(history.rate(["replies"]))),
        ("failed", per_second(history.rate(FAILURE_COUNTERS))),
        ("rerouted", per_second(history.rate(["rerouted"]))),
        ("messages in", per_second(history.messages_rate())),
        ("in flight", str(stats["inflight"])),
        ("queued", str(stats["queue"]["depth"]) if "queue" in stats else NOTHING),
        ("clients", str(stats["clients"])),
    ]
    for name in LATENCY_HISTOGRAMS:
        p50, p99 = (seconds(history.quantile(name, q)) for q in (0.5, 0.99))
        rows.append((f"{name} p50 / p99", f"{p50} / {p99}"))
    return rows


ENGINE_COLUMNS = ("rank", "engine", "state", "in flight", "share", "req/s", "errors", "cache")


def engine_rows(history: History) -> list[tuple[str, ...]]:
    """One row per engine: rank, routing id, state, in flight, share of the load, the
    requests routed to it per second and its errors (requests failed, bad or unknown
    reply entries, times gone) over the window; since it took its rank when that is
    shorter. Its requests/s are "–" when the coordinator does not measure them. Its
    cache is what the prefix policy knows of it: "exact" (its KV-cache events),
    "replaying" (its events' state being asked: priced as caching nothing), "guessed"
    (the coordinator's own table)."""
    stats = history.newest.stats
    published = {e["rank"]: e["state"] for e in stats.get("kv_events", {}).get("engines", [])}
    total = max(stats["inflight"], 1)
    before = {(e["rank"], e["identity"]): _counts(e) for e in history.oldest.stats["engines"]}
    rows: list[tuple[str, ...]] = []
    for engine in stats["engines"]:
        now = _counts(engine)
        then = before.get((engine["rank"], engine["identity"]), dict.fromkeys(now, 0))
        if any(now[k] < then[k] for k in now):  # its counts started again since
            then = dict.fromkeys(now, 0)
        rate = None
        if engine["routed"] is not None and history.seconds > 0:
            rate = (now["routed"] - then["routed"]) / history.seconds
        rows.append(
            (
                str(engine["rank"]),
                engine["identity"],
                engine["state"],
                str(engine["pending"]),
                f"{100 * engine['pending'] / total:.0f}%",
                per_second(rate),
                str(sum(now[k] - then[k] for k in ENGINE_ERRORS)),
                _CACHE_KNOWN.get(published.get(engine["rank"], ""), "guessed"),
            )
        )
    return rows


_CACHE_KNOWN = {"exact": "exact", "unknown": "replaying"}


def _counts(engine: dict[str, Any]) -> dict[str, int]:
    """An engine's counts the rows are made of, 0 for those not kept."""
    return {k: engine[k] or 0 for k in ("routed", *ENGINE_ERRORS)}


CLIENT_COLUMNS = ("client", "in flight", "submitted", "")


def client_rows(stats: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per client of stats()["busiest_clients"] (those with the most in flight):
    routing id, in flight, requests submitted ("–" when not measured), and whether it
    is a rebuild client away (its connection ended: it may come back)."""
    return [
        (
            client["identity"],
            str(client["inflight"]),
            NOTHING if client["submitted"] is None else str(client["submitted"]),
            "away" if client["away"] else "",
        )
        for client in stats["busiest_clients"]
    ]
