"""What the two loop cores share: their counters, states and thresholds, and
the little Python both run off the hot path (options, stats, logging).

The enums and ints here, with those of :mod:`coordkit.protocol` and
:mod:`coordkit._policies`, are the one source of the constants the Cython
modules use: ``make constants`` writes them into ``_constants.pxd``
(``Counter.SUBMITTED`` is ``COUNTER_SUBMITTED`` there), and each module checks
at import that what it was compiled with still matches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import _policies, protocol
from .protocol import Buffer, ControlState, packb, unpackb

#: The package's logger, by the name the package lives under (a vendored copy logs apart).
logger = logging.getLogger(__package__)

Detokenizer = Callable[[list[int]], str]

#: The wire formats a coordinator can speak to peers that are not coordkit's own:
#: Megatron-LM's multipart format (PR #6497), or Megatron-Core's single frames
#: (releases up to 0.19). coordkit clients and engines always speak multipart.
DIALECTS = ("multipart", "megatron-core")

#: The Megatron-Core releases whose engines the megatron-core dialect serves
#: (``Coordinator(megatron_version=...)``): an engine that only registers speaks
#: 0.19's layouts, or main's (megatron-core 0.20), which add the five-field SUBMIT,
#: partial replies, ABORT and the KV handoff. Clients are told apart by what they send.
#: "pr6675" serves Megatron-LM PR #6675's disaggregated prefill/decode: its engines
#: register with REGISTER_ROLE, and a client that only CONNECTs is its InferenceClient
#: (main's single frames, and REQUEST_ERROR / REQUEST_ABORTED as its terminal replies).
MEGATRON_VERSIONS = ("0.19", "main", "pr6675")

#: Server ids are drawn from at least this many positions of the request index
#: (a power of two; see ck_requests in includes/tables.h): with few requests in flight,
#: the index's working set stays this small.
INDEX_WINDOW_MIN = 4096

#: Messages and bytes are counted per header value below this; the last slot
#: counts every other header, and messages whose header could not be read.
HEADER_SLOTS = 128

#: Requests ended, and messages refused, are counted per ErrorCode below this.
ERROR_SLOTS = 32

#: Upper bounds (seconds) of the latency histograms' buckets, log-spaced from
#: 100 µs to about 3.5 minutes; a last bucket takes the rest (+Inf).
LATENCY_BUCKETS = tuple(0.0001 * 2.0**k for k in range(22))
#: The routing decision's buckets: as many, from 50 ns (a decision takes 0.1-1 µs).
DECISION_BUCKETS = tuple(50e-9 * 2.0**k for k in range(len(LATENCY_BUCKETS)))
#: One routing decision in this many is timed (two clock reads: one is the router's own).
DECISION_SAMPLE = 64
#: The clients stats() lists, those with the most requests in flight (``coordkit top``;
#: never exported to Prometheus: their routing ids are unbounded label values).
STATS_CLIENTS = 50

#: Seconds between the loop's timer runs (heartbeats, drains, request deadlines, the
#: rebuild window, HANDLED): inside serve(), which never returns to Python for them.
TICK = 0.05

#: Seconds a coordinator waits, from its start, for engines to report what they hold
#: before it tells rebuild clients to re-send what none claimed: the endpoints'
#: default coordinator_timeout, so that peers that noticed a frozen leader only by
#: its silence still report in time.
REBUILD_WINDOW = 5.0

#: Seconds an engine whose tcp connection ended keeps what it holds, waiting for it
#: to come back (a network blip): libzmq reconnects 100 ms after the end and the
#: handshake takes milliseconds, a brief flap of a switch or a NIC lasts a second or
#: two (Megatron's engines have been seen back in 1.5 s), while a dead engine's
#: requests wait this long more before they are sent elsewhere.
ENGINE_GRACE = 3.0
#: The breaker: this many failures of an engine (its connection ended, it was found
#: gone, a new process took its identity) within BREAKER_WINDOW seconds quarantine it
#: for BREAKER_BACKOFF seconds, doubled at each next quarantine (to BACKOFF_MAX) until
#: it stays up a window.
BREAKER_FAILURES = 3
BREAKER_WINDOW = 30.0
BREAKER_BACKOFF = 5.0

#: What the loop reads from its ROUTER's socket monitor: the connections accepted and
#: ended (by fd: a client whose CONNECT came on a connection that ended has left), and
#: the handshakes refused (CURVE: no key or the wrong mechanism, a key not admitted).
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
REFUSAL_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

#: A kept prompt below this many bytes is copied: sharing it would pin the whole
#: receive buffer libzmq decoded it from (pyzmq's copy-below-a-threshold rule)...
COPY_BELOW = 8192
#: ...once a loop shares this many such prompts: each may pin one receive buffer
#: (8 KiB of data and libzmq's message counters, about 18 KiB: 36 MiB at most), and
#: below it a small prompt is kept for the cost of a refcount, not a copy.
SHARED_SMALL_MAX = 2048
#: Routing ids the loop remembers the role of once they left its tables (loop/roles):
#: the oldest is forgotten past this many (4 MiB of ids at most in C).
RETIRED_IDS = 16384
#: The longest quarantine of an engine that keeps failing (the breaker), in seconds.
BACKOFF_MAX = 300.0

#: Requests that may wait at the coordinator at once, by default (``--queue-limit``);
#: past it a request that finds no room is refused with ERROR(BUSY), as with no queue.
#: Each keeps its frames (its prompt) while it waits: the limit bounds that memory.
DEFAULT_QUEUE_LIMIT = 16384
MAX_QUEUE_LIMIT = 1 << 22
#: A tenant's weight (``--tenant-weight NAME=W``, 1 by default) is in this range.
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 0.001, 1000.0
#: The queue's virtual time: each dispatch moves its tenant's pass on by its stride,
#: STRIDE_SCALE / weight rounded (tenant_stride), an integer so that both cores
#: order alike, bit for bit.
STRIDE_SCALE = 1 << 32
#: Named tenants whose queue waits stats() and the metrics keep apart (the first this
#: many to connect, those given a weight first); every other is counted as "other",
#: so that the metrics' labels stay bounded whatever the clients.
QUEUE_TENANTS = 16
#: The label of the waits of every tenant without one of its own.
OTHER_TENANTS = "other"
#: A priority level's index in the queue's tables: priority - PRIORITY_MIN.
N_PRIORITIES = protocol.PRIORITY_MAX - protocol.PRIORITY_MIN + 1


class Counter(IntEnum):
    """Event counters, in the order both loops keep them (``stats()["counters"]``)."""

    SUBMITTED = 0
    REPLIES = 1
    PARTIALS = 2
    ABORTS = 3
    RELEASE_KV = 4
    CONTROL = 5
    ERRORS_SENT = 6
    MALFORMED = 7
    UNKNOWN_HEADER = 8
    NOT_CONNECTED = 9
    UNKNOWN_REQUEST = 10
    DUPLICATE_REQUEST = 11
    BUSY = 12
    NO_ENGINES = 13
    INVALID_CONTROL = 14
    DUPLICATE_CONNECT = 15
    DUPLICATE_REGISTER = 16
    TABLE_FULL = 17
    REROUTED = 18
    ENGINE_FAILED = 19
    ENGINE_FAILURES = 20
    CLIENT_GONE = 21
    DETOKENIZED = 22
    DETOKENIZE_ERRORS = 23
    MALFORMED_ENTRIES = 24  # entries of an engine's batch skipped, the rest delivered
    TIMED_OUT = 25
    AUTH_REFUSED = 26  # peers refused at the CURVE handshake
    CLIENTS_DEPARTED = 27  # clients that left: said DISCONNECT, their connection ended, or gone
    ADOPTED = 28  # requests an engine reported holding, taken over after a coordinator's loss
    RESENT = 29  # requests a rebuild client was told to send again (RESEND)
    REPLAYED = 30  # requests whose replies an engine was asked to send again (REPLAY)
    CLIENTS_RETURNED = 31  # rebuild clients back within their hold (a blip): nothing aborted
    REFUSED_CLAIMS = 32  # rebuild claims refused: HELD entries not adopted, REPLAYED not asked
    ENGINE_RESTARTS = 33  # registrations of a new process under an engine's identity
    MIGRATED = 34  # requests moved, with the tokens they streamed, off an engine that died
    ENGINES_BACK = 35  # engines whose connection ended and that came back within the grace
    QUARANTINES = 36  # engines the breaker took out of the pool for failing too often
    QUEUED = 37  # requests that waited in the queue for an engine with room


class QueueOutcome(IntEnum):
    """How a request's wait at the coordinator ended (the queue's wait histograms)."""

    DISPATCHED = 0  # sent to an engine
    TIMED_OUT = 1  # its deadline (or the request_timeout) passed while it waited
    REFUSED = 2  # refused by the coordinator: no room to wait (BUSY), no engine left
    ABANDONED = 3  # its client aborted it or went away while it waited


class EngineState(IntEnum):
    """An engine rank's life: it takes work while ALIVE, finishes it while
    DRAINING (after DISCONNECT), takes nothing once GONE, and nothing while AWAY (its
    connection ended: what it holds waits for it for the grace)."""

    ALIVE = 0
    DRAINING = 1
    GONE = 2
    AWAY = 3


#: Why an engine left the pool, by its GoneReason (the loops' logs and stats()).
GONE_REASONS = (
    "unreachable",
    "no heartbeat",
    "drain timed out",
    "a new process registered under its identity",
    "its connection ended",
    "not back within the grace",
)


class GoneReason(IntEnum):
    """Why an engine left the pool (GONE_REASONS says it in words)."""

    UNREACHABLE = 0
    NO_HEARTBEAT = 1
    DRAIN_TIMED_OUT = 2
    RESTARTED = 3
    DISCONNECTED = 4
    GRACE_OVER = 5


class RequestFlag(IntEnum):
    """Bits of a request in flight that decide what its engine's death means."""

    PRODUCED = 1  # a partial reply went out: it cannot be re-sent
    ABORTED = 2  # its client aborted it: it is never re-sent
    REPLAYING = 4  # its engine was asked to REPLAY it: its replies wait for the REPLAYED
    ORPHAN = 8  # adopted from an engine's report: its client has not REJOINed yet
    PINNED = 16  # a KV submission: tied to the engine chosen, never sent again
    ASKED = 32  # its engine was sent REPLAY for it: the one REPLAYED that may deliver it
    MIGRATED = 64  # moved off a dead engine with the tokens it streamed: its replies continue
    UNCONFIRMED = 128  # its engine is back on a new connection: it runs there if HELD says so


class PeerRole(IntEnum):
    """What a routing id is to the coordinator, for its whole life: one identity, one
    role (a client never becomes an engine, nor an engine a client)."""

    NONE = 0
    CLIENT = 1
    ENGINE = 2


class RouteStatus(IntEnum):
    """How sending a request to an engine went."""

    SENT = 0
    NO_ENGINES = 1  # no engine is registered and accepting work
    ALL_BUSY = 2  # every engine is at its cap
    ENGINE_GONE = 3  # the engine chosen was unreachable: it is marked gone, choose again
    UNSENDABLE = 4  # the engine chosen speaks a format the request cannot be put in


class PeerFormat(IntEnum):
    """How a peer's messages are framed."""

    MULTIPART = 0  # metadata frame, then payload frames (Megatron-LM PR #6497, coordkit)
    SINGLE_FRAME = 1  # Megatron-Core 0.19's: one msgpack frame per message
    BATCHED = 2  # multipart, and many requests or replies per message when in hand
    SINGLE_FRAME_MAIN = 3  # Megatron main's single frames: 0.19's, and partials, aborts, KV


@dataclass(frozen=True)
class Options:
    """A coordinator's options as its loop core reads them, already validated.

    :class:`coordkit.Coordinator` checks them and builds this; the router's
    own options go to the router it builds.
    """

    max_inflight: int
    max_inflight_per_engine: int
    heartbeat_timeout: float
    drain_timeout: float
    detokenizer: Detokenizer | None
    max_clients: int
    max_engines: int
    keep_prompts: bool
    request_timeout: float
    measure_latency: bool  # keep the latency histograms (Coordinator(metrics_port=...))
    dialect: str
    block_size: int
    epoch: int  # what the coordinator announces to rebuild peers (see coordinator.py)
    first_server_id: int  # its server ids start here: above any of an earlier life's
    rebuild_window: float  # seconds after the start during which peers report
    # A cluster's member: a REJOIN or HELD opens the window again, or makes it last a
    # window from then (the clients and engine reports of a member lost: docs/scaling.md).
    cluster: bool = False
    megatron_version: str = "0.19"  # of the single-frame engines (MEGATRON_VERSIONS)
    # An engine whose connection ends waits this long for it (0: dead at once; tcp only)
    engine_grace: float = 0.0
    breaker_failures: int = 0  # failures within breaker_window that quarantine (0: never)
    breaker_window: float = 30.0
    breaker_backoff: float = 5.0  # the first quarantine; doubled each next, to BACKOFF_MAX
    # Where the requests it traces go (every and follow: which), None: none traced: a
    # tracing.TraceSink, named and not imported (tracing imports this module).
    tracing: Any = None
    # With measure_latency: each engine's time to first reply and request duration.
    engine_histograms: bool = False
    queue_limit: int = DEFAULT_QUEUE_LIMIT  # requests waiting at most (0: none wait)
    # (name, weight) of each tenant given one: its share of the dispatches of its priority
    tenant_weights: tuple[tuple[str, float], ...] = ()
    # Disaggregated prefill/decode (docs/pd.md): read once an engine registers a role.
    pd_mode: str = "conditional"  # or "always" (_pd.PD_MODES)
    pd_threshold: int = 256  # conditional: uncached prompt tokens at most run whole
    pd_lease: float = 60.0  # seconds a prefill's pins wait for their decode's read
    pd_retries: int = 2  # re-prefills and re-handoffs after an engine's death
    # The thread that reads the engines' KV-cache events (a _kvevents.Subscriber, named
    # and not imported: it imports this module), None: the prefix policy guesses for all.
    kv_events: Any = None

    @property
    def index_size(self) -> int:
        """Positions in the server-id index: the power of two at or above max_inflight."""
        return 1 << (self.max_inflight - 1).bit_length()


#: The enums the Cython modules take from Python, with the prefix their
#: members get there (``Header.CONNECT`` is ``HEADER_CONNECT``).
CYTHON_ENUMS: tuple[tuple[type[IntEnum], str], ...] = (
    (protocol.Header, "HEADER_"),
    (protocol.ErrorCode, "ERROR_"),
    (protocol.ControlState, "CONTROL_"),
    (protocol.EngineRole, "PD_"),
    (Counter, "COUNTER_"),
    (EngineState, "ENGINE_"),
    (RequestFlag, "FLAG_"),
    (RouteStatus, "ROUTE_"),
    (PeerFormat, "FORMAT_"),
    (PeerRole, "ROLE_"),
    (GoneReason, "GONE_"),
    (QueueOutcome, "OUTCOME_"),
)


def cython_constants() -> dict[str, int]:
    """Every constant the Cython modules take from Python, by its Python name."""
    values = {
        f"{enum.__name__}.{member.name}": int(member) for enum, _ in CYTHON_ENUMS for member in enum
    }
    values.update(
        BLOCK_HASH_SIZE=protocol.BLOCK_HASH_SIZE,
        PRIORITY_MIN=protocol.PRIORITY_MIN,
        PRIORITY_MAX=protocol.PRIORITY_MAX,
        MAX_PARTS=protocol.MAX_PARTS,
        COPY_BELOW=COPY_BELOW,
        SHARED_SMALL_MAX=SHARED_SMALL_MAX,
        RETIRED_IDS=RETIRED_IDS,
        INDEX_WINDOW_MIN=INDEX_WINDOW_MIN,
        HEADER_SLOTS=HEADER_SLOTS,
        ERROR_SLOTS=ERROR_SLOTS,
        N_LATENCY_BUCKETS=len(LATENCY_BUCKETS),
        N_COUNTERS=len(Counter),
        N_OUTCOMES=len(QueueOutcome),
        N_PRIORITIES=N_PRIORITIES,
        QUEUE_TENANTS=QUEUE_TENANTS,
        WEIGHT_SCALE=_policies.WEIGHT_SCALE,
        MAX_BLOCKS=_policies.MAX_BLOCKS,
        SPARSE_RANKS=_policies.SPARSE_RANKS,
        WALK_MAX=_policies.WALK_MAX,
    )
    # a router's policy, by its index in POLICIES: POLICY_ROUND_ROBIN = 0, ...
    values.update({f"POLICY_{name.upper()}": i for i, name in enumerate(_policies.POLICIES)})
    return values


def check_constants(generated: dict[str, int]) -> None:
    """ImportError unless the values compiled into a Cython module (from the
    generated ``_constants.pxd``) are today's Python ones, member for member."""
    current = cython_constants()
    if generated != current:
        stale = sorted(
            k for k in generated.keys() | current.keys() if generated.get(k) != current.get(k)
        )
        raise ImportError(
            "coordkit: the compiled constants differ from the Python ones "
            f"({', '.join(stale)}): run make constants and rebuild"
        )


def tenant_stride(weight: float) -> int:
    """How far a dispatch moves a tenant's pass on (the queue's virtual time): inversely
    to its weight, at least 1."""
    return max(1, round(STRIDE_SCALE / weight))


def monitor_events(monitor: zmq.Socket) -> list[tuple[int, int]]:
    """(event, value) of each event waiting on a socket monitor, in order, without blocking."""
    events: list[tuple[int, int]] = []
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return events
        event = parse_monitor_message(frames)
        events.append((int(event["event"]), int(event["value"])))


def detokenize(detokenizer: Detokenizer, body: Buffer) -> bytes:
    """A reply body with ``generated_text`` set from ``generated_tokens``.

    Raises whatever a bad body or a failing detokenizer raises; the caller
    then forwards the body untouched.
    """
    reply = unpackb(body)
    reply["generated_text"] = detokenizer(reply["generated_tokens"])
    return packb(reply)


def resumed(
    meta: Buffer | None, prompt: Buffer, tokens: list[int]
) -> tuple[bytes | None, bytes] | None:
    """A request that streamed ``tokens`` before its engine died, to go on at another:
    ``(meta, prompt)`` with the prompt extended by them and each budget in its params
    (BUDGET_KEYS) reduced by their count. ``meta`` is its kept metadata ``[20, rid,
    params]`` and ``prompt`` its prompt frame, or (``meta`` None) ``prompt`` is the one
    frame it came in, ``[20, rid, prompt, params, ...]``, and so is the result's (its
    metadata None). None when it cannot go on: its params say RESUMABLE_KEY false,
    its prompt is not token ids (a str), or a budget is spent."""
    try:
        if meta is None:
            frame = unpackb(prompt)
            head, ids, params, rest = frame[:2], frame[2], frame[3], frame[4:]
        else:
            *head, params = unpackb(meta)
            ids, rest = unpackb(prompt), []
    except Exception:  # not what this coordinator kept: cannot be resumed
        return None
    if not isinstance(params, dict) or params.get(protocol.RESUMABLE_KEY) is False:
        return None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        return None
    params = dict(params)
    for key in protocol.BUDGET_KEYS:
        budget = params.get(key)
        if type(budget) is int:
            if budget <= len(tokens):
                return None
            params[key] = budget - len(tokens)
    ids = ids + tokens
    if meta is None:
        return None, packb([*head, ids, params, *rest])
    return packb([*head, params]), packb(ids)


def continued(body: Buffer, before: list[int]) -> bytes:
    """A reply body of a request that went on at another engine: its
    ``generated_tokens`` preceded by ``before``, those streamed at the engines before
    (a partial's ``new_tokens`` already continue); the body as it is when it has none."""
    try:
        reply = unpackb(body)
    except Exception:  # not msgpack: forwarded as it is, as any body
        return bytes(body)
    if isinstance(reply, dict) and isinstance(reply.get("generated_tokens"), list):
        reply["generated_tokens"] = before + reply["generated_tokens"]
        return packb(reply)
    return bytes(body)


def megatron_failed_reply(client_rid: int) -> bytes:
    """ENGINE_REPLY ending a Megatron main client's request that coordkit ended
    (refused, timed out, its engine lost): a finished request whose status is
    FAILED, as main's engine sends for a request it cannot take. Main's client
    resolves its future (or ends its stream) with it; its ``deserialize=True``
    path rebuilds a DynamicInferenceRequest from it, so it holds fields of that
    class only. Its FAIL event has no timestamp (the event's own __post_init__
    stamps one on deserializing), so both loop cores send the same bytes."""
    failed = {
        "request_id": client_rid,
        "status": "FAILED",
        "sampling_params": None,
        "inference_parameters": None,
        "generated_tokens": [],
        "generated_text": "",
        "events": [{"timestamp": None, "type": "FAIL", "payload": None}],
    }
    return packb([int(protocol.Header.ENGINE_REPLY), client_rid, failed])


class RateLimitedLog:
    """At most one warning per kind per interval, with the count of those skipped."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval) < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        suffix = f" ({skipped} more since the last report)" if skipped else ""
        logger.warning("%s%s", message, suffix)


def unknown_from_engine(header: int, rank: int, format: int) -> str:
    """The log line for a message of ``header`` an engine may not send: a partial reply
    from an engine taken for 0.19's says which option serves main's."""
    text = f"dropped {protocol.header_name(header)} from engine {rank}"
    if header == protocol.Header.ENGINE_REPLY_PARTIAL and format == PeerFormat.SINGLE_FRAME:
        text += (
            " (Megatron-Core 0.19 has none: an engine of Megatron main"
            " needs megatron_version='main')"
        )
    return text


def never_ran(rid: int) -> str:
    """The UNKNOWN_REQUEST a rebuild client's request ends with when it was aborted
    before any engine ran it (never sent since a coordinator's loss, or sent back)."""
    return f"request {rid} was aborted before any engine ran it"


def identity_text(identity: bytes) -> str:
    """A ZeroMQ routing id for humans: its text when printable ASCII, else hex (random
    bytes often decode as UTF-8, to combining marks and scripts no one named a peer in)."""
    text = identity.decode("latin-1")
    return text if identity.isascii() and text.isprintable() else identity.hex()


def header_slot(header: int) -> int:
    """Where a message of ``header`` is counted (-1: its header could not be read)."""
    return header if 0 <= header < HEADER_SLOTS - 1 else HEADER_SLOTS - 1


def latency_bucket(seconds: float, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> int:
    """The histogram bucket of a duration: the first of ``bounds`` not below it."""
    for i, bound in enumerate(bounds):
        if seconds <= bound:
            return i
    return len(bounds)


def metrics_map(
    *,
    traffic: list[tuple[int, int, int, int]],
    failed: list[int],
    refused: list[int],
    latency: dict[str, tuple[list[int], float]] | None,
    prefix: tuple[int, int, int],
    queue: dict[str, Any],
    engine_latency: list[tuple[int, dict[str, tuple[list[int], float]]]] | None = None,
) -> dict[str, Any]:
    """What ``Coordinator.metrics()`` gives beyond stats(): ``traffic`` is
    (direction 0 in / 1 out, header slot, messages, bytes) for every slot used;
    ``failed``/``refused`` count per ErrorCode; ``latency`` (when measured) maps each
    histogram -- "final" and "first_reply" (from the SUBMIT), "coordinator_request"
    and "coordinator_reply" (a message's time in the coordinator), in the buckets of
    LATENCY_BUCKETS, and "routing_decision" in those of DECISION_BUCKETS -- to (count
    per bucket and one more for the rest, the sum of the seconds); ``engine_latency``
    (engine_histograms) is (rank, its "final" and "first_reply") per engine; ``prefix``
    is the prefix policy's (decisions with block hashes, their blocks, blocks matched)."""
    decisions, blocks, matched = prefix

    def histograms(measured: dict[str, tuple[list[int], float]]) -> dict[str, Any]:
        return {
            name: {"buckets": list(buckets), "sum": total}
            for name, (buckets, total) in measured.items()
        }

    return {
        "traffic": [
            {
                "direction": "in" if direction == 0 else "out",
                "header": slot,
                "messages": messages,
                "bytes": size,
            }
            for direction, slot, messages, size in traffic
            if messages
        ],
        "failed": {code: n for code, n in enumerate(failed) if n},
        "refused": {code: n for code, n in enumerate(refused) if n},
        "latency": None if latency is None else histograms(latency),
        "latency_bounds": list(LATENCY_BUCKETS),
        "decision_bounds": list(DECISION_BUCKETS),
        "engine_latency": None
        if engine_latency is None
        else {rank: histograms(measured) for rank, measured in engine_latency},
        "prefix": {"decisions": decisions, "blocks": blocks, "matched_blocks": matched},
        "queue": queue,
    }


#: An engine's line of stats(), as each loop core gives it to stats_map: rank, routing
#: id, state, pending, seconds of quarantine left, failures in the breaker's window, the
#: last GoneReason or -1; its requests (routed, completed, failed: None unless
#: measure_latency), its errors (malformed entries, entries for requests it does not
#: own, times declared gone), its last HEARTBEAT's (pending, capacity) or None, and
#: the seconds since that heartbeat or None.
EngineLine = tuple[
    int,
    bytes,
    int,
    int,
    float,
    int,
    int,
    tuple[int, int, int] | None,
    tuple[int, int, int],
    tuple[int, int] | None,
    float | None,
]

#: A client's line of stats()["busiest_clients"]: routing id, requests in flight, requests
#: submitted (None unless measure_latency), a rebuild client, away (not connected now).
ClientLine = tuple[bytes, int, int | None, bool, bool]


def _engine_map(line: EngineLine) -> dict[str, Any]:
    (
        rank,
        identity,
        state,
        pending,
        quarantined,
        failures,
        reason,
        requests,
        errors,
        reported,
        age,
    ) = line
    routed, completed, failed = requests or (None, None, None)
    malformed_entries, unknown_request, gone = errors
    reported_pending, reported_capacity = reported or (None, None)
    return {
        "rank": rank,
        "identity": identity_text(identity),
        "state": EngineState(state).name.lower(),
        "pending": pending,
        "quarantined": round(quarantined, 3),
        "failures": failures,
        "last_failure": GONE_REASONS[reason] if reason >= 0 else None,
        "routed": routed,
        "completed": completed,
        "failed": failed,
        "malformed_entries": malformed_entries,
        "unknown_request": unknown_request,
        "gone": gone,
        "reported_pending": reported_pending,
        "reported_capacity": reported_capacity,
        "heartbeat_age": None if age is None else round(age, 3),
    }


def busiest(clients: list[ClientLine]) -> list[ClientLine]:
    """The STATS_CLIENTS lines with the most requests in flight (then by routing id)."""
    return sorted(clients, key=lambda line: (-line[1], line[0]))[:STATS_CLIENTS]


def stats_map(
    *,
    implementation: str,
    policy: str,
    epoch: int,
    messages: int,
    inflight: int,
    clients: int,
    control_state: int,
    counters: list[int],
    engines: list[EngineLine],
    busiest_clients: list[ClientLine],
    queue: dict[str, Any],
) -> dict[str, Any]:
    """The map of ``Coordinator.stats()`` and STATS_REPLY; ``epoch`` is what the
    coordinator announces, ``engines`` an EngineLine per rank, ``busiest_clients`` the
    ClientLines of busiest(), ``queue`` the queue's (Queue.stats)."""
    return {
        "implementation": implementation,
        "policy": policy,
        "epoch": epoch,
        "messages": messages,
        "inflight": inflight,
        "clients": clients,
        "control_state": ControlState(control_state).name.lower(),
        "counters": {c.name.lower(): counters[c] for c in Counter},
        "engines": [_engine_map(line) for line in engines],
        "busiest_clients": [
            {
                "identity": identity_text(identity),
                "inflight": inflight,
                "submitted": submitted,
                "rebuild": rebuild,
                "away": away,
            }
            for identity, inflight, submitted, rebuild, away in busiest_clients
        ],
        "queue": queue,
    }
