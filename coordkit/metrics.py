"""Prometheus metrics of a running coordinator (the ``metrics`` extra: prometheus_client).

``Coordinator(metrics_port=PORT)`` (``coordkit serve --metrics-port PORT``)
serves them over HTTP. Nothing is kept for Prometheus on the loop: a scrape
calls :class:`CoordinatorCollector`, which reads the loop's own counters and
tables (``stats()`` and ``metrics()``) and turns them into metric families,
so the loop pays per request only for the counters it keeps anyway (and, with
metrics on, a few clock reads for its latency histograms: one per submission, one
per reply batch, one per message timed in the coordinator, two per routing decision
timed, one in 64). The names are documented in docs/deploying.md ("Metrics").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ._shared import HEADER_SLOTS, EngineState
from .protocol import ErrorCode, Header, header_name

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["CoordinatorCollector", "Measured", "MetricsServer"]


class Measured(Protocol):
    """What the metrics read at each scrape: a Coordinator (which serves them, so
    this module does not import it)."""

    def stats(self) -> dict[str, Any]: ...

    def metrics(self) -> dict[str, Any]: ...


_PREFIX = "coordkit_"

_HEADERS = frozenset(Header)


#: An engine's states, as stats() names them (the label values of the engine gauges).
_ENGINE_STATES = tuple(state.name.lower() for state in EngineState)

#: An engine's requests by outcome, and its errors by kind, as stats() names them.
_ENGINE_OUTCOMES = ("routed", "completed", "failed")
_ENGINE_ERRORS = ("malformed_entries", "unknown_request", "gone")


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def _by_code(counts: dict[int, int]) -> list[tuple[str, int]]:
    """(code name, count) for every ErrorCode, 0 included, and any other code counted:
    a series exists before its first failure, so a rate over it is 0, not absent."""
    every = dict.fromkeys(ErrorCode, 0) | counts
    return [(_code_name(code), n) for code, n in sorted(every.items())]


def _header_label(slot: int) -> str:
    """A header's name; ``other`` for one the protocol does not declare, or unread."""
    return header_name(slot) if slot in _HEADERS and slot != HEADER_SLOTS - 1 else "other"


class CoordinatorCollector:
    """A prometheus_client collector over one coordinator, read at each scrape."""

    def __init__(self, coordinator: Measured):
        self._coordinator = coordinator

    def describe(self) -> list[Metric]:
        return []  # families depend on the traffic seen: no fixed description

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
        )

        stats = self._coordinator.stats()
        metrics = self._coordinator.metrics()
        counters = stats["counters"]

        info = GaugeMetricFamily(
            _PREFIX + "info",
            "1, labelled with the implementation serving and the routing policy.",
            labels=["implementation", "policy"],
        )
        info.add_metric([stats["implementation"], stats["policy"]], 1)
        yield info

        requests = CounterMetricFamily(
            _PREFIX + "requests",
            "Requests by outcome: accepted, completed (a final reply), failed (an ERROR "
            "after being accepted, by code).",
            labels=["outcome", "code"],
        )
        requests.add_metric(["accepted", ""], counters["submitted"])
        requests.add_metric(["completed", ""], counters["replies"])
        for code, n in _by_code(metrics["failed"]):
            requests.add_metric(["failed", code], n)
        yield requests

        refused = CounterMetricFamily(
            _PREFIX + "refused_messages",
            "Messages refused with an ERROR (dropped for a peer that cannot parse one), by code.",
            labels=["code"],
        )
        for code, n in _by_code(metrics["refused"]):
            refused.add_metric([code], n)
        yield refused

        events = CounterMetricFamily(
            _PREFIX + "events",
            "Every counter the loop keeps (stats()['counters']), by name.",
            labels=["event"],
        )
        for name, n in counters.items():
            events.add_metric([name], n)
        yield events

        yield CounterMetricFamily(
            _PREFIX + "rerouted_requests",
            "Requests re-sent to another engine after theirs died.",
            value=counters["rerouted"],
        )

        prefix = metrics["prefix"]
        yield CounterMetricFamily(
            _PREFIX + "prefix_routing_decisions",
            "Requests the prefix policy routed by their block hashes.",
            value=prefix["decisions"],
        )
        blocks = CounterMetricFamily(
            _PREFIX + "prefix_routing_blocks",
            "Block hashes of those requests (hashed), and those the chosen engine had "
            "cached (matched).",
            labels=["kind"],
        )
        blocks.add_metric(["hashed"], prefix["blocks"])
        blocks.add_metric(["matched"], prefix["matched_blocks"])
        yield blocks

        inflight = GaugeMetricFamily(_PREFIX + "requests_in_flight", "Requests in flight.")
        inflight.add_metric([], stats["inflight"])
        yield inflight
        per_engine = GaugeMetricFamily(
            _PREFIX + "engine_requests_in_flight",
            "Requests in flight per engine (its routing id).",
            labels=["engine"],
        )
        engine_state = GaugeMetricFamily(
            _PREFIX + "engine_state",
            "Each engine's state (its routing id): 1 for the current one, 0 for the others.",
            labels=["engine", "state"],
        )
        engines = GaugeMetricFamily(_PREFIX + "engines", "Engines by state.", labels=["state"])
        quarantined = GaugeMetricFamily(
            _PREFIX + "engine_quarantined_seconds",
            "Seconds left of each engine's quarantine (the breaker; 0: it takes work).",
            labels=["engine"],
        )
        failures = GaugeMetricFamily(
            _PREFIX + "engine_failures",
            "Each engine's failures in the breaker's window.",
            labels=["engine"],
        )
        by_state = dict.fromkeys(_ENGINE_STATES, 0)
        for engine in stats["engines"]:
            per_engine.add_metric([engine["identity"]], engine["pending"])
            quarantined.add_metric([engine["identity"]], engine["quarantined"])
            failures.add_metric([engine["identity"]], engine["failures"])
            for state in _ENGINE_STATES:
                engine_state.add_metric([engine["identity"], state], int(engine["state"] == state))
            by_state[engine["state"]] += 1
        for state, n in by_state.items():
            engines.add_metric([state], n)
        yield per_engine
        yield engine_state
        yield engines
        yield quarantined
        yield failures
        yield from _engine_families(stats["engines"])

        control = GaugeMetricFamily(
            _PREFIX + "control_state",
            "The control state machine's state: 1 for the current one.",
            labels=["state"],
        )
        for state in ("running", "paused", "suspended"):
            control.add_metric([state], int(stats["control_state"] == state))
        yield control

        clients = GaugeMetricFamily(_PREFIX + "clients", "Clients connected.")
        clients.add_metric([], stats["clients"])
        yield clients

        messages = CounterMetricFamily(
            _PREFIX + "messages",
            "Messages by header and direction (in: received, out: sent).",
            labels=["header", "direction"],
        )
        size = CounterMetricFamily(
            _PREFIX + "message_bytes",
            "Bytes of messages (their frames after the routing id) by header and direction.",
            labels=["header", "direction"],
        )
        traffic: dict[tuple[str, str], list[int]] = {}  # the headers unknown summed as other
        for row in metrics["traffic"]:
            counts = traffic.setdefault((_header_label(row["header"]), row["direction"]), [0, 0])
            counts[0] += row["messages"]
            counts[1] += row["bytes"]
        for labels, (n, n_bytes) in traffic.items():
            messages.add_metric(labels, n)
            size.add_metric(labels, n_bytes)
        yield messages
        yield size

        if metrics["latency"] is not None:
            yield from _latency_families(stats["engines"], metrics)

        if "queue" in stats:
            yield from _queue_families(stats["queue"], metrics["queue"], metrics["latency_bounds"])

        if "kv_events" in stats:
            yield from _kv_event_families(stats["kv_events"])


#: stats()["kv_events"]'s counts, as counters: (key, help).
_KV_EVENT_COUNTS = (
    ("batches", "KV-cache event batches applied to the prefix index."),
    ("gaps", "Gaps in an engine's event sequence (a batch missed)."),
    ("resets", "Engines' indexes cleared: history lost, no replay, a restart, a batch lost."),
    ("replays", "Replays asked of the engines' publishers."),
    ("malformed", "Event messages or batches malformed, dropped."),
    ("events_malformed", "Events malformed in a batch otherwise applied, skipped."),
)


def _kv_event_families(kv: dict[str, Any]) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for key, text in _KV_EVENT_COUNTS:
        family = CounterMetricFamily(_PREFIX + "kv_events_" + key, text)
        family.add_metric([], kv[key])
        yield family
    blocks = GaugeMetricFamily(
        _PREFIX + "kv_index_blocks",
        "Blocks an engine holds according to its KV-cache events, by whether they are known.",
        labels=["rank", "state"],
    )
    for engine in kv["engines"]:
        blocks.add_metric([str(engine["rank"]), engine["state"]], engine["blocks"])
    yield blocks


def _engine_families(engines: list[dict[str, Any]]) -> Iterator[Metric]:
    """Each engine's requests (when the loop measures), errors, and what its heartbeats
    report: labelled by its routing id, one series per rank of the engine table."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    requests = CounterMetricFamily(
        _PREFIX + "engine_requests",
        "Each engine's requests: routed to it (re-sent ones too), completed (their final "
        "forwarded), failed (lost with it, or ended with an ERROR while it held them).",
        labels=["engine", "outcome"],
    )
    errors = CounterMetricFamily(
        _PREFIX + "engine_errors",
        "Each engine's errors: reply entries of the wrong shape (malformed_entries), "
        "entries for requests it does not own (unknown_request), times declared gone.",
        labels=["engine", "kind"],
    )
    pending = GaugeMetricFamily(
        _PREFIX + "engine_reported_pending",
        "The requests each engine said it holds, in its last HEARTBEAT.",
        labels=["engine"],
    )
    capacity = GaugeMetricFamily(
        _PREFIX + "engine_capacity",
        "The requests each engine said it can run at once, in its last HEARTBEAT.",
        labels=["engine"],
    )
    age = GaugeMetricFamily(
        _PREFIX + "engine_heartbeat_age_seconds",
        "Seconds since each engine's last HEARTBEAT (engines that send them).",
        labels=["engine"],
    )
    for engine in engines:
        identity = engine["identity"]
        if engine["routed"] is not None:
            for outcome in _ENGINE_OUTCOMES:
                requests.add_metric([identity, outcome], engine[outcome])
        for kind in _ENGINE_ERRORS:
            errors.add_metric([identity, kind], engine[kind])
        if engine["reported_pending"] is not None:
            pending.add_metric([identity], engine["reported_pending"])
            capacity.add_metric([identity], engine["reported_capacity"])
        if engine["heartbeat_age"] is not None:
            age.add_metric([identity], engine["heartbeat_age"])
    yield from (requests, errors, pending, capacity, age)


#: The fleet's histograms, (name, metrics()["latency"] key, help).
_LATENCIES = (
    (
        "request_duration_seconds",
        "final",
        "Time from a SUBMIT to its final reply, as the coordinator sees it.",
    ),
    (
        "time_to_first_reply_seconds",
        "first_reply",
        "Time from a SUBMIT to its first reply, partial or final.",
    ),
)


def _latency_families(engines: list[dict[str, Any]], metrics: dict[str, Any]) -> Iterator[Metric]:
    """The latency histograms of a loop that measures them: from the SUBMIT, a message's
    time in the coordinator, the routing decision, and (engine_histograms) each engine's."""
    from prometheus_client.core import HistogramMetricFamily

    latency, bounds = metrics["latency"], metrics["latency_bounds"]
    for name, key, text in _LATENCIES:
        yield HistogramMetricFamily(
            _PREFIX + name,
            text,
            buckets=_cumulative(bounds, latency[key]["buckets"]),
            sum_value=latency[key]["sum"],
        )
    stages = HistogramMetricFamily(
        _PREFIX + "coordinator_seconds",
        "A message's time in the coordinator, from when the loop took it up to its last "
        "send: a client's submission (request: its requests sent to engines), an engine's "
        "replies (reply: sent to their clients).",
        labels=["direction"],
    )
    for direction in ("request", "reply"):
        measured = latency[f"coordinator_{direction}"]
        stages.add_metric([direction], _cumulative(bounds, measured["buckets"]), measured["sum"])
    yield stages
    decision = latency["routing_decision"]
    yield HistogramMetricFamily(
        _PREFIX + "routing_decision_seconds",
        "The router's choice of an engine (one request in 64 timed).",
        buckets=_cumulative(metrics["decision_bounds"], decision["buckets"]),
        sum_value=decision["sum"],
    )
    if metrics["engine_latency"] is None:
        return
    identities = {engine["rank"]: engine["identity"] for engine in engines}
    for name, key, text in _LATENCIES:
        per_engine = HistogramMetricFamily(
            _PREFIX + "engine_" + name, f"{text} By engine.", labels=["engine"]
        )
        for rank, measured in metrics["engine_latency"].items():
            if rank in identities:  # a rank that registered since stats() was read: next time
                per_engine.add_metric(
                    [identities[rank]],
                    _cumulative(bounds, measured[key]["buckets"]),
                    measured[key]["sum"],
                )
        yield per_engine


def _queue_families(
    queue: dict[str, Any], waits: dict[str, Any], bounds: list[float]
) -> Iterator[Metric]:
    """The requests waiting at the coordinator, and how long they waited, by priority
    and by tenant (the first named ones, the rest as "other": bounded labels)."""
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

    for key, label, what in (
        ("by_priority", "priority", "priority"),
        ("by_tenant", "tenant", "tenant"),
    ):
        suffix = "" if label == "priority" else "_tenant"
        depth = GaugeMetricFamily(
            f"{_PREFIX}queue{suffix}_depth",
            f"Requests waiting at the coordinator for an engine with room, by {what}.",
            labels=[label],
        )
        for name, row in queue[key].items():
            depth.add_metric([str(name)], row["depth"])
        yield depth
        histogram = HistogramMetricFamily(
            f"{_PREFIX}queue{suffix}_wait_seconds",
            f"How long requests waited at the coordinator, by {what} and by how the wait "
            "ended (dispatched, timed_out, refused, abandoned).",
            labels=[label, "outcome"],
        )
        for name, outcomes in waits[key].items():
            for outcome, waited in outcomes.items():
                histogram.add_metric(
                    [str(name), outcome], _cumulative(bounds, waited["buckets"]), waited["sum"]
                )
        yield histogram


def _cumulative(bounds: list[float], counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus' buckets (le, count at or below) of counts per bucket and one more."""
    buckets, cumulative = [], 0
    for bound, n in zip([*bounds, float("inf")], counts, strict=True):
        cumulative += n
        buckets.append((_le(bound), cumulative))
    return buckets


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class MetricsServer:
    """Prometheus text format over HTTP for one coordinator, on its own thread."""

    def __init__(self, coordinator: Measured, port: int, address: str = "0.0.0.0"):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise ImportError(
                "coordkit: metrics need prometheus_client: pip install 'coordkit[metrics]'"
            ) from None
        self.registry = CollectorRegistry()
        self.registry.register(CoordinatorCollector(coordinator))
        self._server, self._thread = start_http_server(port, address, self.registry)
        #: The port it listens on (useful when asked for port 0).
        self.port: int = self._server.server_port
        self._stopped = threading.Event()

    def close(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._server.shutdown()
            self._server.server_close()


def scrape(coordinator: Measured) -> str:
    """The Prometheus text a scrape of ``coordinator`` gives (for tests and tools)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    return generate_latest(registry).decode()
