"""Each engine's and each client's tally (loop/tally.pyx)."""

from __future__ import annotations

from typing import Any

from .latency import Histogram
from .tables import _Client


class EngineTally:
    """One rank's counts, since its routing id took the rank."""

    __slots__ = (
        "routed",
        "completed",
        "failed",
        "malformed_entries",
        "unknown_request",
        "gone",
        "reported",
    )

    def __init__(self) -> None:
        # Its requests (kept with measure_latency): sent to it (re-sent ones too), their
        # finals forwarded, and those lost with it or ended with an ERROR while it held
        # them.
        self.routed = self.completed = self.failed = 0
        # Its errors: reply entries of the wrong shape, entries for requests it does not
        # own (late, or wrong), and the times it was declared gone.
        self.malformed_entries = self.unknown_request = self.gone = 0
        self.reported: tuple[int, int] | None = None  # its last HEARTBEAT's (pending, capacity)


class Tally:
    """Each engine's and each client's tally: an engine's requests, its errors, what its
    heartbeats report and (engine_histograms) its latencies; a client's submissions."""

    __slots__ = ("engines", "submitted", "first_reply", "final")

    def __init__(self, histograms: bool) -> None:
        self.engines: list[EngineTally] = []  # by rank
        self.submitted: dict[_Client, int] = {}  # the requests it submitted (measure_latency)
        # engine_histograms: by rank, its time to first reply and its request duration
        self.first_reply: list[Histogram] | None = [] if histograms else None
        self.final: list[Histogram] | None = [] if histograms else None

    def reset(self, rank: int) -> None:
        """Another routing id takes ``rank`` (or a new rank is added): from nothing."""
        fresh: list[tuple[list[Any] | None, Any]] = [
            (self.engines, EngineTally()),
            (self.first_reply, Histogram()),
            (self.final, Histogram()),
        ]
        for items, item in fresh:
            if items is None:
                continue
            if rank == len(items):
                items.append(item)
            else:
                items[rank] = item

    def replied(self, rank: int, seconds: float, first: bool, final: bool) -> None:
        """A reply from ``rank``, ``seconds`` after its SUBMIT (measure_latency): a final
        completes a request; into its histograms when it has them."""
        self.engines[rank].completed += final
        if self.first_reply is None or self.final is None:
            return
        if first:
            self.first_reply[rank].observe(seconds)
        if final:
            self.final[rank].observe(seconds)

    def failed(self, rank: int) -> None:
        """A request ``rank`` held ended without its final from it (-1: none held it)."""
        if rank >= 0:
            self.engines[rank].failed += 1

    def heartbeat(self, rank: int, pending: int, capacity: int) -> None:
        self.engines[rank].reported = (pending, capacity)

    def engine(
        self, rank: int, measured: bool
    ) -> tuple[tuple[int, int, int] | None, tuple[int, int, int], tuple[int, int] | None]:
        """Its (requests or None, errors, reported or None), as stats_map takes them."""
        tally = self.engines[rank]
        return (
            (tally.routed, tally.completed, tally.failed) if measured else None,
            (tally.malformed_entries, tally.unknown_request, tally.gone),
            tally.reported,
        )

    def latency(self) -> list[tuple[int, dict[str, tuple[list[int], float]]]]:
        """(rank, its histograms as metrics() gives them) per rank (engine_histograms)."""
        assert self.first_reply is not None and self.final is not None
        return [
            (rank, {"final": final.metrics(), "first_reply": first.metrics()})
            for rank, (first, final) in enumerate(zip(self.first_reply, self.final, strict=True))
        ]
