"""The loop's records: a client, an engine, a request (the C tables: _loop_c.pxd)."""

from __future__ import annotations

import math

import msgpack
import zmq

from .._shared import EngineState, PeerFormat, RequestFlag

ALIVE, DRAINING, GONE, AWAY = (
    EngineState.ALIVE,
    EngineState.DRAINING,
    EngineState.GONE,
    EngineState.AWAY,
)
PRODUCED, ABORTED = RequestFlag.PRODUCED, RequestFlag.ABORTED
REPLAYING, ORPHAN, PINNED = RequestFlag.REPLAYING, RequestFlag.ORPHAN, RequestFlag.PINNED
ASKED, MIGRATED, UNCONFIRMED = RequestFlag.ASKED, RequestFlag.MIGRATED, RequestFlag.UNCONFIRMED
SINGLE_FRAME, MULTIPART = PeerFormat.SINGLE_FRAME, PeerFormat.MULTIPART
SINGLE_FRAME_MAIN = PeerFormat.SINGLE_FRAME_MAIN
_packer = msgpack.Packer()
MSGPACK_BOOLS = (b"\xc2", b"\xc3")  # false, true: a reply batch entry's final flag
MSGPACK_NIL = 0xC0  # Megatron main's multi_modal_data of a text request
# Server ids are the wall clock in ns at a life's start, and up: an id an engine reports
# at or past this (the year 2116) is no earlier life's, and would leave no ids to draw.
MAX_ADOPTED = 1 << 62
TRACEPARENT_SIZE = 55  # a W3C traceparent's characters


class Kept:
    """What re-sends a request whose engine died: its metadata (the server id in it
    already) and its prompt, or (``single``, no metadata) the whole frame it came in;
    ``small``: a prompt below COPY_BELOW shared, not copied."""

    __slots__ = ("meta", "prompt", "single", "small")

    def __init__(self, meta: bytes | None, prompt: zmq.Frame | bytes, single: bool, small: bool):
        self.meta = meta
        self.prompt = prompt
        self.single = single
        self.small = small


class _Client:
    __slots__ = (
        "identity",
        "coordkit",
        "batch",
        "rebuild",
        "present",
        "fresh",
        "rejoined",
        "format",
        "requests",
        "fd",
        "hold",
        "qos",
        "tenant",
    )

    def __init__(self, identity: bytes):
        self.identity = identity
        self.coordkit = False  # may be sent ERROR and STATS_REPLY
        self.batch = False  # granted batches: may send SUBMIT_BATCH, is sent REPLY_BATCH
        self.rebuild = False  # keeps its requests: told to RESEND, sent CLIENT_REPLAYED
        self.present = True  # sent CONNECT (False: known only from an engine's report)
        # Connected and has sent nothing since: an engine's claim may be its (a rebuild
        # client REJOINs first); its first other message says it rejoins nothing.
        self.fresh = True
        self.rejoined = False  # sent REJOIN: its requests not listed are not awaited
        self.format = MULTIPART
        self.requests: dict[int, _Request] = {}  # in flight, by client rid
        self.fd = -1  # the connection its CONNECT came on (ZMQ_SRCFD; -1: inproc)
        self.hold = 0.0  # a rebuild client: seconds its requests are kept once it is gone
        self.qos = False  # granted QoS: its SUBMITs may carry a priority and a deadline
        self.tenant = -1  # its tenant in the queue (-1: none yet, it never sent CONNECT)


class _Engine:
    __slots__ = (
        "rank",
        "identity",
        "state",
        "coordkit",
        "batch",
        "format",
        "heartbeats",
        "last_heartbeat",
        "drain_deadline",
        "rebuild",
        "base",
        "handled",
        "mark",
        "acked",
        "fd",
        "session",
        "away_until",
        "failures",
        "failures_since",
        "last_failure",
        "quarantined_until",
        "quarantines",
    )

    def __init__(self, rank: int, identity: bytes):
        self.rank = rank
        self.identity = identity
        self.state = ALIVE
        self.coordkit = False  # sent ENGINE_HELLO: may be sent ERROR for entries it got wrong
        self.batch = False  # asked for batches in ENGINE_HELLO: is sent ENGINE_SUBMIT_BATCH
        self.format = MULTIPART
        self.heartbeats = False  # has sent a HEARTBEAT: may be timed out
        self.last_heartbeat = 0.0
        self.drain_deadline = 0.0
        # A rebuild engine is sent a trailer with every request, and HANDLED on the
        # timer: the number of its last reply message handled a whole tick ago (its
        # reply messages since its registration are numbered from its base).
        self.rebuild = False
        self.base = 0
        self.handled = 0  # reply messages received since its registration
        self.mark = 0  # handled at the last tick
        self.acked = 0  # handled as of the last HANDLED sent
        self.fd = -1  # the connection it registered on (ZMQ_SRCFD; -1: inproc)
        self.session = 0  # a coordkit engine: the token of its process, from its hello
        self.away_until = 0.0  # AWAY: when its grace ends
        # The breaker: its failures since failures_since (a window), the last one's
        # GoneReason (-1: none), until when it is quarantined, and how many quarantines
        # in a row (the next one's backoff doubles).
        self.failures = 0
        self.failures_since = 0.0
        self.last_failure = -1
        self.quarantined_until = 0.0
        self.quarantines = 0


class _Request:
    __slots__ = (
        "server_rid",
        "client",
        "client_rid",
        "rank",
        "flags",
        "kept",
        "work",
        "submitted",
        "streamed",
        "priority",
        "deadline",
    )

    def __init__(self, server_rid: int, client: _Client, client_rid: int):
        self.server_rid = server_rid
        self.client = client
        self.client_rid = client_rid
        self.rank = -1  # -1 while it is being re-sent or failed
        self.flags = 0
        self.kept: Kept | None = None  # to re-send it if its engine dies
        self.work = 0  # the work units its rank was charged for it (router.charged)
        self.submitted = 0.0  # with a request_timeout or measure_latency: when it was submitted
        # With its prompt kept: the tokens its partials streamed at its engine (None: not
        # known, it cannot go on elsewhere once it streamed: see Faults)
        self.streamed: list[int] | None = None
        # Its QoS: where it waits in the queue, if it must (again, when its engine dies).
        self.priority = 0
        self.deadline = math.inf  # time.monotonic() past which it may not wait
