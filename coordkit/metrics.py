"""Prometheus metrics of a running coordinator (the ``metrics`` extra: prometheus_client).

``Coordinator(metrics_port=PORT)`` (``coordkit serve --metrics-port PORT``)
serves them over HTTP. Nothing is kept for Prometheus on the loop: a scrape
calls :class:`CoordinatorCollector`, which reads the loop's own counters and
tables (``stats()`` and ``metrics()``) and turns them into metric families,
so the loop pays per request only for the counters it keeps anyway (and, with
metrics on, one clock read per submission and per reply batch for the two
latency histograms). The names are documented in docs/deploying.md ("Metrics").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._shared import HEADER_SLOTS
from .protocol import ErrorCode, header_name

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .coordinator import Coordinator

__all__ = ["CoordinatorCollector", "MetricsServer"]

_PREFIX = "coordkit_"


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def _header_label(slot: int) -> str:
    return "other" if slot == HEADER_SLOTS - 1 else header_name(slot)


class CoordinatorCollector:
    """A prometheus_client collector over one coordinator, read at each scrape."""

    def __init__(self, coordinator: Coordinator):
        self._coordinator = coordinator

    def describe(self) -> list[Metric]:
        return []  # families depend on the traffic seen: no fixed description

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        stats = self._coordinator.stats()
        metrics = self._coordinator.metrics()
        counters = stats["counters"]

        requests = CounterMetricFamily(
            _PREFIX + "requests",
            "Requests by outcome: accepted, completed (a final reply), failed (an ERROR "
            "after being accepted, by code).",
            labels=["outcome", "code"],
        )
        requests.add_metric(["accepted", ""], counters["submitted"])
        requests.add_metric(["completed", ""], counters["replies"])
        for code, n in metrics["failed"].items():
            requests.add_metric(["failed", _code_name(code)], n)
        yield requests

        refused = CounterMetricFamily(
            _PREFIX + "refused_messages",
            "Messages refused with an ERROR (dropped for a peer that cannot parse one), by code.",
            labels=["code"],
        )
        for code, n in metrics["refused"].items():
            refused.add_metric([_code_name(code)], n)
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
        engines = GaugeMetricFamily(_PREFIX + "engines", "Engines by state.", labels=["state"])
        by_state = {"alive": 0, "draining": 0, "gone": 0}
        for engine in stats["engines"]:
            per_engine.add_metric([engine["identity"]], engine["pending"])
            by_state[engine["state"]] += 1
        for state, n in by_state.items():
            engines.add_metric([state], n)
        yield per_engine
        yield engines

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
        for row in metrics["traffic"]:
            labels = [_header_label(row["header"]), row["direction"]]
            messages.add_metric(labels, row["messages"])
            size.add_metric(labels, row["bytes"])
        yield messages
        yield size

        if metrics["latency"] is not None:
            bounds = metrics["latency_bounds"]
            for name, key, text in (
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
            ):
                histogram = metrics["latency"][key]
                buckets = _cumulative(bounds, histogram["buckets"])
                yield HistogramMetricFamily(
                    _PREFIX + name, text, buckets=buckets, sum_value=histogram["sum"]
                )

        if "queue" in stats:
            yield from _queue_families(stats["queue"], metrics["queue"], metrics["latency_bounds"])


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

    def __init__(self, coordinator: Coordinator, port: int, address: str = "0.0.0.0"):
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


def scrape(coordinator: Coordinator) -> str:
    """The Prometheus text a scrape of ``coordinator`` gives (for tests and tools)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    return generate_latest(registry).decode()
