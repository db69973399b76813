"""The latency histograms of measure_latency (loop/latency.pyx)."""

from __future__ import annotations

import time

from .._shared import DECISION_BUCKETS, DECISION_SAMPLE, LATENCY_BUCKETS, latency_bucket
from ..protocol import Header


class Histogram:
    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)  # by bound, and the rest
        self.sum = 0.0  # of the seconds

    def observe(self, seconds: float) -> None:
        """One duration into the histogram: the first bucket whose bound it fits."""
        self.buckets[latency_bucket(seconds, self.bounds)] += 1
        self.sum += seconds

    def metrics(self) -> tuple[list[int], float]:
        """(count per bucket, sum of the seconds), as metrics() gives a histogram."""
        return list(self.buckets), self.sum


# A message's stage: its way through the coordinator (coordinator_seconds).
STAGE_REQUEST, STAGE_REPLY = 0, 1  # a client's submission; an engine's replies
_STAGE_HEADERS = (
    (Header.SUBMIT_REQUEST, Header.SUBMIT_REQUEST_WITH_KV, Header.SUBMIT_BATCH),
    (Header.ENGINE_REPLY, Header.ENGINE_REPLY_PARTIAL),
)


class Latency:
    """From SUBMIT to the final reply, and to the first (partial or final); a message's
    time in the coordinator, by stage; the router's choice, one in DECISION_SAMPLE."""

    __slots__ = ("final", "first_reply", "coordinator", "decision", "countdown", "since")

    def __init__(self) -> None:
        self.final = Histogram()
        self.first_reply = Histogram()
        self.coordinator = (Histogram(), Histogram())  # by stage
        self.decision = Histogram(DECISION_BUCKETS)
        self.countdown = DECISION_SAMPLE  # to the next decision timed
        # When the message at hand was taken up, at the latest: the poll's wake, or the
        # last timed message's end (the next one was received right after it).
        self.since = 0.0

    def observe(self, seconds: float, first: bool, final: bool) -> None:
        """A reply ``seconds`` after its SUBMIT: into first_reply when it is its
        request's first, into final when it is final."""
        if first:
            self.first_reply.observe(seconds)
        if final:
            self.final.observe(seconds)

    def handled(self, stage: int, header: int) -> None:
        """A message handled in ``stage`` (from a client, or from an engine): a submission
        or an engine's replies is timed from when it was taken up (one clock read)."""
        if header not in _STAGE_HEADERS[stage]:
            return
        now = time.monotonic()
        self.coordinator[stage].observe(now - self.since)
        self.since = now

    def decided(self, started: float) -> None:
        """The router chose, from ``started`` (its own clock read): one in DECISION_SAMPLE
        is timed."""
        self.countdown -= 1
        if self.countdown:
            return
        self.countdown = DECISION_SAMPLE
        self.decision.observe(time.monotonic() - started)

    def metrics(self) -> dict[str, tuple[list[int], float]]:
        """Each histogram as metrics() gives it."""
        return {
            "final": self.final.metrics(),
            "first_reply": self.first_reply.metrics(),
            "coordinator_request": self.coordinator[STAGE_REQUEST].metrics(),
            "coordinator_reply": self.coordinator[STAGE_REPLY].metrics(),
            "routing_decision": self.decision.metrics(),
        }
