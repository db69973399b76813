"""The reference loop core: the coordinator's tables and message handlers over pyzmq.

:class:`coordkit.Coordinator` owns the sockets, the thread and the timers and
drives this core, or its Cython twin (``_loop_c.pyx``). This one is the
oracle: both make the same decisions in the same order and put the same
frames on the wire, method for method under the same names.

The twin's concepts (``loop/*.pyx``, a struct and its functions each) are the
classes and functions below, in the same order under the same names: C's
``x_verb(&self.x, ...)`` is ``self._x.verb(...)`` here. The message at hand is
pyzmq's list of frames (``message_bytes`` its one function here); then the
dialect, the kept-prompt store, the batch fan-out, the request_timeout queue,
the latency histograms and the traffic counters. The Loop keeps the tables and
the handlers: the hot path (a SUBMIT out to an engine; an engine's batch of
replies out to their clients) first, the rare paths after it, which parse with
the message specs of :mod:`coordkit.protocol`. Requests are filed by
``server_rid & mask``, and server ids are drawn exactly as the C index draws
them (see _add). An engine found gone on the hot path is only marked; its
requests are settled once the message at hand is done.
"""

from __future__ import annotations

import heapq
import math
import struct
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from . import _codec_py as codec
from . import _pd, protocol
from ._kvevents import kv_stats
from ._kvindex_py import KVIndex
from ._shared import (
    BACKOFF_MAX,
    COPY_BELOW,
    DECISION_BUCKETS,
    DECISION_SAMPLE,
    ERROR_SLOTS,
    GONE_REASONS,
    HEADER_SLOTS,
    INDEX_WINDOW_MIN,
    LATENCY_BUCKETS,
    N_PRIORITIES,
    OTHER_TENANTS,
    QUEUE_TENANTS,
    REFUSAL_EVENTS,
    RETIRED_IDS,
    SHARED_SMALL_MAX,
    TICK,
    Counter,
    EngineState,
    GoneReason,
    Options,
    PeerFormat,
    PeerRole,
    QueueOutcome,
    RateLimitedLog,
    RequestFlag,
    RouteStatus,
    busiest,
    continued,
    detokenize,
    header_slot,
    latency_bucket,
    megatron_failed_reply,
    metrics_map,
    monitor_events,
    never_ran,
    resumed,
    stats_map,
    tenant_stride,
    unknown_from_engine,
)
from .protocol import (
    BATCH_FEATURE,
    BLOCK_HASH_SIZE,
    CONTROL_HEADERS,
    CONTROL_TRANSITIONS,
    EPOCH_KEY,
    MAX_PARTS,
    PRIORITY_MIN,
    QOS_FEATURE,
    REBUILD_FEATURE,
    ROLE_NAMES,
    Buffer,
    ControlState,
    EngineRole,
    ErrorCode,
    Header,
    MessageSpec,
    ProtocolError,
    asks_metrics,
    error_text,
    header_name,
    packb,
    parse_connect,
    parse_engine_hello,
    unpackb,
)
from .tracing import CLIENT_GONE, TRACEPARENT_MARK, TraceRecord

if TYPE_CHECKING:
    from ._routing_py import Router
    from .tracing import TraceSink

__all__ = ["Loop"]

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


# -- sending ---------------------------------------------------------------------------


def _send_all(sock: zmq.Socket, frames: list[Any]) -> int:
    """Send ``frames`` (after a routing id already sent); the bytes sent."""
    sock.send_multipart(frames, copy=False)
    return sum(len(frame) for frame in frames)


def _view(frame: zmq.Frame | Buffer) -> memoryview:
    """A frame's bytes (a zmq.Frame, or bytes kept), without copying them."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def _source_fd(frame: zmq.Frame) -> int:
    """The fd of the connection a message came on (ZMQ_SRCFD); -1 for inproc, which has
    none (where zmq_msg_get returns -1, pyzmq raises)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def _parses(check: Callable[[Buffer], object], frame: Buffer) -> bool:
    try:
        check(frame)
    except ProtocolError:
        return False
    return True


# -- the message at hand (loop/message.pyx): pyzmq's frames ------------------------------


def message_bytes(frames: list[zmq.Frame]) -> int:
    """Its size after the routing id, as the traffic counters count it."""
    return sum(len(frame) for frame in frames[1:])


# -- multipart and single frame (loop/dialect.pyx) -------------------------------------


def single_frame(format: int) -> bool:
    """Whether a peer of ``format`` speaks Megatron-Core's single frames."""
    return format == SINGLE_FRAME or format == SINGLE_FRAME_MAIN


def single_layout(header: int, length: int) -> bool:
    """Whether a single-frame SUBMIT has its header's fields: [20, rid, prompt, params]
    (0.19's), with multi_modal_data last (main's), or [24, rid, prompt, params,
    kv_meta, src_block_ids] (main's KV submission)."""
    if header == Header.SUBMIT_REQUEST:
        return length == 4 or length == 5
    return length == 6


def single_walks(length: int, n_multipart: int, n_single: int) -> bool:
    """Whether a single frame must be read whole to be carried: to be split for a
    multipart engine, or (main's five fields) to be cut to four for a 0.19 engine,
    which it may be only once its multi_modal_data is found nil."""
    return n_multipart > 0 or (length == 5 and n_single > 0)


class Inbound:
    """A request, new or kept, to be put in the format of the engine chosen for it."""

    __slots__ = (
        "header",
        "single",
        "length",
        "meta",
        "payload",
        "prompt",
        "params",
        "extra",
        "hashes",
        "hash_frame",
        "tokens",
        "batched",
        "carriers",
        "priority",
        "deadline_ms",
    )

    def __init__(self, header: int):
        self.header = header
        self.single = False  # it came as one frame (Megatron-Core's: 0.19's or main's)
        self.length = 0  # single frame: its fields, 4, 5 or 6
        self.meta = b""  # multipart: its metadata with the server id
        # The frames it came in after the metadata: multipart its payload frames (the
        # prompt first), single frame the frame itself.
        self.payload: list[Any] = []
        # Its prompt, and what follows the rid in its metadata: the params (and a KV
        # submission's kv_meta). Single frame: the params once found (else None: the
        # prompt then runs to the frame's end), then its last field, extra: main's
        # multi_modal_data or src_block_ids (empty for 0.19's four fields).
        self.prompt: Buffer = b""
        self.params: Buffer | None = b""
        self.extra: Buffer = b""
        self.hashes: Buffer | None = None  # its block hashes
        self.hash_frame: Any = None  # the frame they came in: forwarded to a rebuild engine
        self.tokens = 0
        self.batched = False  # an entry of a SUBMIT_BATCH: a batched engine takes it later
        self.carriers = 0  # a bit per PeerFormat whose engines can take it (carriers)
        self.priority = 0  # its QoS, as its client sent it (read_qos): never sent on
        self.deadline_ms = 0


def multipart_inbound(header: int, payload: list[Any], params: Buffer, hashes: Any) -> Inbound:
    """A multipart request: ``payload`` its payload frames (the prompt first), ``params``
    what follows the rid in its metadata (or a SUBMIT_BATCH entry's params), ``hashes``
    its block-hash frame or None."""
    inbound = Inbound(header)
    inbound.payload = payload
    inbound.prompt = _view(payload[0])
    inbound.params = params
    if hashes is not None:
        inbound.hashes = _view(hashes)
        inbound.hash_frame = hashes
    inbound.tokens = codec.prompt_tokens(inbound.prompt)
    return inbound


def single_inbound(
    frame: memoryview, header: int, length: int, prompt: int, params: int, extra: int
) -> Inbound:
    """A single-frame request of ``length`` fields, read as far as its rid (``prompt``
    where the rest starts: it runs to the frame's end, ``params`` 0), or whole
    (``params`` and ``extra`` where the params and the last field start)."""
    inbound = Inbound(header)
    inbound.single = True
    inbound.length = length
    inbound.prompt = frame[prompt:]
    inbound.params = None
    if params:
        inbound.prompt = frame[prompt:params]
        inbound.params = frame[params:extra]
        inbound.extra = frame[extra:]
    inbound.tokens = codec.prompt_tokens(inbound.prompt)
    return inbound


def text_only(inbound: Inbound) -> bool:
    """A single-frame SUBMIT_REQUEST without multimodal data: 0.19's four fields, or
    main's five once read whole with its multi_modal_data nil."""
    return inbound.header == Header.SUBMIT_REQUEST and (
        inbound.length == 4 or (len(inbound.extra) == 1 and inbound.extra[0] == MSGPACK_NIL)
    )


def carriers(inbound: Inbound, single_engines: bool) -> None:
    """Which formats can carry the request, once. A single frame goes to a main engine
    as it came; to a 0.19 engine as a SUBMIT_REQUEST of four fields (main's nil
    multi_modal_data dropped); to a multipart engine once its params were found (it
    splits there), with no multimodal data. A multipart request goes to a
    single-frame engine (when there is one) as [20, rid, prompt, params], so only a
    SUBMIT_REQUEST whose prompt is one str or array and whose params are a map."""
    if inbound.single:
        inbound.carriers = 1 << SINGLE_FRAME_MAIN
        if text_only(inbound):
            inbound.carriers |= 1 << SINGLE_FRAME
        if inbound.params is not None and (
            inbound.header == Header.SUBMIT_REQUEST_WITH_KV or text_only(inbound)
        ):
            inbound.carriers |= 1 << MULTIPART
        return
    assert inbound.params is not None
    inbound.carriers = 1 << MULTIPART
    if (
        single_engines
        and inbound.header == Header.SUBMIT_REQUEST
        and _parses(codec.check_prompt, inbound.prompt)
        and _parses(codec.check_map, inbound.params)
    ):
        inbound.carriers |= 1 << SINGLE_FRAME | 1 << SINGLE_FRAME_MAIN


def carries(inbound: Inbound, format: int) -> bool:
    """Whether an engine of ``format`` can take the request (carriers)."""
    return bool(inbound.carriers >> format & 1)


def rewrite_meta(inbound: Inbound, server_rid: int) -> bytes:
    """A multipart request's metadata with ``server_rid``: ``[header, server_rid,
    <params>]``, an array of 2 + its payload frames."""
    assert inbound.params is not None
    return codec.write_submit(inbound.header, 2 + len(inbound.payload), server_rid, inbound.params)


def send_single(
    sock: zmq.Socket, inbound: Inbound, server_rid: int, format: int, trailer: list[Any]
) -> int:
    """A single-frame request in an engine's format, then ``trailer``; the bytes sent.
    To a main engine the rest behind the new head as it came; to a 0.19 engine its
    four fields; to a multipart engine split at the field boundaries: ``[header,
    server_rid, <params>]``, the prompt and (a KV submission) src_block_ids."""
    params = b"" if inbound.params is None else inbound.params
    if format == SINGLE_FRAME_MAIN:
        rest = b"".join((inbound.prompt, params, inbound.extra))
        meta = codec.write_submit(inbound.header, inbound.length, server_rid, rest)
        return _send_all(sock, [meta, *trailer])
    if format == SINGLE_FRAME:
        rest = b"".join((inbound.prompt, params))
        meta = codec.write_submit(inbound.header, 4, server_rid, rest)
        return _send_all(sock, [meta, *trailer])
    kv = inbound.header == Header.SUBMIT_REQUEST_WITH_KV
    meta = codec.write_submit(inbound.header, 4 if kv else 3, server_rid, params)
    return _send_all(sock, [meta, inbound.prompt, *([inbound.extra] if kv else []), *trailer])


def send_request(
    sock: zmq.Socket, inbound: Inbound, server_rid: int, format: int, trailer: list[Any]
) -> int:
    """A request's frames after its engine's routing id, in the engine's ``format``, then
    ``trailer`` (see trailer_frames); the bytes sent. Multipart to multipart: the
    metadata and the payload frames as themselves. Otherwise the prompt and the params
    spliced into the engine's format (a single frame behind a new head, or split at the
    field boundaries): a copy."""
    if inbound.single:
        return send_single(sock, inbound, server_rid, format, trailer)
    if single_frame(format):
        assert inbound.params is not None
        frame = codec.write_single_submit(
            Header.SUBMIT_REQUEST, server_rid, inbound.prompt, inbound.params
        )
        return _send_all(sock, [frame, *trailer])
    return _send_all(sock, [inbound.meta, *inbound.payload, *trailer])


def trailer_frames(client_rid: int, client_id: bytes | None, hashes: Any) -> list[Any]:
    """What follows a request's payload to a rebuild engine: its trailer ``[client_rid,
    client_id, hashed]`` (``client_id`` None for a client that cannot rejoin), then its
    block-hash frame when given."""
    trailer = protocol.pack_trailer(client_rid, client_id, hashes is not None)
    return [trailer] if hashes is None else [trailer, hashes]


def engine_parses(format: int, header: int) -> bool:
    """Whether an engine of ``format`` parses a message of ``header`` from the
    coordinator: a 0.19 engine has no ABORT_REQUEST and no KV transfer."""
    return format != SINGLE_FRAME or header not in (Header.ABORT_REQUEST, Header.RELEASE_KV)


# Whether a client's format carries a reply (reply_carried).
CARRIED = 0
NOT_SENT = 1  # a partial to a 0.19 client, which takes finals only
NOT_A_MAP = 2  # a body that is not a map, to a Megatron client: counted, dropped


def reply_carried(format: int, header: int, body: Any) -> int:
    """Whether a client of ``format`` takes a reply (CARRIED, NOT_SENT, NOT_A_MAP): a
    Megatron client takes maps, each ``[header, client_rid, <map>]``; a 0.19 client
    finals only."""
    if not single_frame(format):
        return CARRIED
    if header != Header.ENGINE_REPLY and format != SINGLE_FRAME_MAIN:
        return NOT_SENT
    return CARRIED if _parses(codec.check_map, body) else NOT_A_MAP


def send_reply(sock: zmq.Socket, format: int, header: int, client_rid: int, body: Any) -> int:
    """A reply's frames after its client's routing id, in the client's ``format``: one
    ``[header, client_rid, <map>]``, or ``[header, client_rid]`` and the body; the
    bytes sent."""
    if single_frame(format):
        return _send_all(sock, [codec.write_submit(header, 3, client_rid, body)])
    return _send_all(sock, [codec.write_header_int(header, client_rid), body])


# -- the kept-prompt store (loop/kept.pyx) ---------------------------------------------


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


def keep(meta: bytes | None, prompt: zmq.Frame, single: bool, small_shared: int) -> Kept:
    """What re-sends a request. A prompt of COPY_BELOW bytes or more has a buffer of
    its own: shared. A smaller one is shared too while the loop shares fewer than
    SHARED_SMALL_MAX (``small_shared``): sharing a small frame pins the whole receive
    buffer libzmq decoded it from, so past that bound it is copied (pyzmq's
    copy-below-a-threshold rule)."""
    if len(prompt) >= COPY_BELOW:
        return Kept(meta, prompt, single, False)
    if small_shared < SHARED_SMALL_MAX:
        return Kept(meta, prompt, single, True)
    return Kept(meta, prompt.bytes, single, False)


def kept_prompt(kept: Kept) -> memoryview:
    """The kept prompt's bytes (for a single frame: the whole frame)."""
    return _view(kept.prompt)


def kept_inbound(kept: Kept, n_multipart: int, n_single: int) -> Inbound:
    """A kept request as an Inbound, to be re-sent as a new one is sent: a single frame
    read again (whole when the engines of each format, ``n_multipart`` and
    ``n_single``, say it must be: single_walks), or its metadata and its prompt."""
    data = kept_prompt(kept)
    if kept.single:
        header, _, length, prompt = codec.read_single_head(data)
        params = extra = 0
        if single_walks(length, n_multipart, n_single):
            try:
                *_, params, extra = codec.read_single_submit(data)
            except ProtocolError:
                pass
        return single_inbound(data, header, length, prompt, params, extra)
    assert kept.meta is not None
    meta = memoryview(kept.meta)
    inbound = multipart_inbound(
        Header.SUBMIT_REQUEST, [kept.prompt], meta[codec.read_submit(meta)[3] :], None
    )
    inbound.meta = kept.meta
    return inbound


# -- one batch fan-out for both directions (loop/fanout.pyx) ---------------------------


class Fanout:
    """The entries of the batch at hand bound for peers that take batches (a
    SUBMIT_BATCH's to batched engines, a reply batch's to batched clients), sent
    once every entry is handled, one batch per peer in the order the peers were
    first chosen: a head ``[header, [[rid, <tail>], ...]]``, then the frames as the
    same messages."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        # (peer, rid, tail, frames) in the order they were routed: the peer an _Engine
        # or a _Client, the rid its server id or its client's, the tail what follows
        # the rid in its entry (its params, or the final flag), the frames its prompt
        # (and its trailer to a rebuild engine) or its body.
        self.entries: list[tuple[Any, int, Buffer, list[Any]]] = []

    def add(self, to: Any, rid: int, tail: Buffer, frames: list[Any]) -> None:
        self.entries.append((to, rid, tail, frames))

    def by_peer(self) -> dict[Any, list[tuple[int, Buffer, list[Any]]]]:
        """The entries by peer, the peers in the order they first came; the fan-out
        is then empty."""
        peers: dict[Any, list[tuple[int, Buffer, list[Any]]]] = {}
        for to, rid, tail, frames in self.entries:
            peers.setdefault(to, []).append((rid, tail, frames))
        self.entries.clear()
        return peers

    @staticmethod
    def send(sock: zmq.Socket, header: int, entries: list[tuple[int, Buffer, list[Any]]]) -> int:
        """One peer's batch after its routing id: the head, then the frames; the bytes
        sent."""
        head = [_packer.pack_array_header(2), _packer.pack(int(header))]
        head.append(_packer.pack_array_header(len(entries)))
        head += [b"\x92" + _packer.pack(rid) + bytes(tail) for rid, tail, _ in entries]
        return _send_all(sock, [b"".join(head), *(f for *_, frames in entries for f in frames)])


# -- the request_timeout queue (loop/lists.pyx) ----------------------------------------


class Deadlines:
    """The requests in submission order, so in deadline order (every request has the
    same timeout): the timer ends the due ones from the head and touches nothing else."""

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: OrderedDict[int, _Request] = OrderedDict()

    @property
    def oldest(self) -> _Request | None:
        return next(iter(self._requests.values()), None)

    def push(self, request: _Request) -> None:
        """A new request, the newest."""
        self._requests[request.server_rid] = request

    def remove(self, request: _Request) -> None:
        del self._requests[request.server_rid]


# -- the latency histograms of measure_latency (loop/latency.pyx) ----------------------


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


# -- the traffic counters (loop/traffic.pyx) -------------------------------------------

RECEIVED, SENT = 0, 1


class Traffic:
    """Messages and bytes by direction and header slot (the last: unreadable)."""

    __slots__ = ("messages", "bytes")

    def __init__(self) -> None:
        self.messages = [[0] * HEADER_SLOTS for _ in range(2)]
        self.bytes = [[0] * HEADER_SLOTS for _ in range(2)]

    def count(self, direction: int, header: int, size: int) -> None:
        """A message of ``size`` bytes (after the routing id), RECEIVED or SENT."""
        slot = header_slot(header)
        self.messages[direction][slot] += 1
        self.bytes[direction][slot] += size

    def metrics(self) -> list[tuple[int, int, int, int]]:
        """(direction, header slot, messages, bytes) for every slot, as metrics() gives it."""
        return [
            (direction, slot, self.messages[direction][slot], self.bytes[direction][slot])
            for direction in range(2)
            for slot in range(HEADER_SLOTS)
        ]


# -- the roles of the identities retired (loop/roles.pyx) ------------------------------


def made_up(identity: bytes) -> bool:
    """A routing id libzmq made up for a peer that named none: 5 bytes, a zero first.
    Each is one connection's and never handed out again."""
    return len(identity) == 5 and identity[0] == 0


class Roles:
    """The routing ids that left the tables, with the PeerRole each had, so that one
    identity keeps one role for the coordinator's life: a client forgotten (gone, or
    evicted from a full table) is never taken for an engine's registration, nor an
    engine's id, once its rank is reused, for a client. Bounded: past ``capacity`` the
    oldest is forgotten. Ids libzmq made up are not kept (see made_up)."""

    __slots__ = ("capacity", "_roles")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._roles: OrderedDict[bytes, int] = OrderedDict()

    def remember(self, identity: bytes, role: int) -> None:
        if made_up(identity):
            return
        self._roles[identity] = role
        self._roles.move_to_end(identity)
        if len(self._roles) > self.capacity:
            self._roles.popitem(last=False)

    def of(self, identity: bytes) -> int:
        """The role ``identity`` had (PeerRole.NONE: none remembered)."""
        return self._roles.get(identity, PeerRole.NONE)


# -- the requests waiting at the coordinator (loop/queue.pyx) ----------------------------
#
# Requests that find no engine with room wait here, at the coordinator, until one has
# it (docs/queueing.md). Each waits in the *flow* of its (priority, tenant):
#
# * **Strict priority.** A lower priority is always dispatched first: nothing of
#   priority 5 leaves while anything of priority -1 waits. Nothing ages a waiting
#   request into a better priority, so a flood at a better priority starves the
#   worse ones: a request there leaves only once its deadline, when it has one, ends
#   its wait (TIMED_OUT), or its client gives up; the queue limit bounds what waits.
# * **Fair shares within a priority: virtual time, by requests.** Each flow has a
#   *pass*; the flow with the lowest pass is served next (the earlier set pass on a
#   tie), and each dispatch moves its pass on by its tenant's *stride*,
#   STRIDE_SCALE / weight (start-time fair queueing, or stride scheduling, with a
#   request as the unit). A flow that starts waiting starts at the priority's
#   virtual time, the pass of its last dispatch: a tenant gains no credit for the
#   time it had nothing waiting, and a newcomer, or an interactive tenant's lone
#   request, goes at the next dispatch. Requests, not tokens, because what the queue
#   hands out is an engine's room for one request (its capacity counts requests), held
#   for the request's whole life, whose length the coordinator cannot know (the
#   output's is unknown at dispatch).
# * **Within a flow, first come first served**, but for a request whose engine died
#   before it produced anything: it goes back at the head of its flow (``head``).
# * **Deadlines.** A request with one is also in a heap by deadline: ``expired`` ends
#   the due ones, O(log n) each.
#
# Every operation is O(log n) in the flows waiting (one heap of flows, ordered by
# priority, then pass, then the order the pass was set in) or in the requests with a
# deadline; keys are integers, so both twins order alike, bit for bit. The C twin's
# passes are uint64s compared by their difference (they wrap), this one's unbounded
# ints: the same order while passes stay within 2**63 of each other, which they do
# (every pass waiting is within one stride of the priority's virtual time).
#
# Tenants: a name (``tenant(name)``) is shared by every client naming it; ``tenant()``
# makes one of its own for a client that names none. A tenant is forgotten once no
# client refers to it and nothing of it waits, unless it was given a weight or holds
# one of the QUEUE_TENANTS labels its waits are kept under (the first named ones,
# those given a weight first); every other tenant's are kept as "other". Tenant 0
# takes the clients past the table (it cannot fill while each client holds one).
#
# Handles are the loop's request slots: ``handles`` of them, each waiting once at most.
# What a waiting request's frames are, this twin keeps as the caller's ``inbound``;
# the C twin keeps the messages (queue_keep, queue_inbound).

#: The stride of a tenant given no weight (weight 1).
DEFAULT_STRIDE = tenant_stride(1.0)
#: A lazy heap is rebuilt once it holds more than this many entries beyond twice the live.
_SLACK = 64


class _WaitTally:
    """One row of the stats: requests waiting now, and the waits by outcome."""

    __slots__ = ("depth", "buckets", "sums")

    def __init__(self) -> None:
        self.depth = 0
        self.buckets = [[0] * (len(LATENCY_BUCKETS) + 1) for _ in QueueOutcome]
        self.sums = [0.0] * len(QueueOutcome)

    def observe(self, outcome: int, seconds: float) -> None:
        self.buckets[outcome][latency_bucket(seconds)] += 1
        self.sums[outcome] += seconds

    def stats(self) -> dict[str, Any]:
        return {
            "depth": self.depth,
            "outcomes": {o.name.lower(): sum(self.buckets[o]) for o in QueueOutcome},
        }

    def metrics(self) -> dict[str, Any]:
        return {
            o.name.lower(): {"buckets": list(self.buckets[o]), "sum": self.sums[o]}
            for o in QueueOutcome
        }


class _Tenant:
    __slots__ = ("name", "stride", "refs", "depth", "label", "kept")

    def __init__(self, name: str | None, label: int):
        self.name = name
        self.stride = DEFAULT_STRIDE
        self.refs = 0  # the clients naming it
        self.depth = 0  # its requests waiting
        self.label = label  # its row of by_label (QUEUE_TENANTS: "other")
        self.kept = label < QUEUE_TENANTS  # given a weight, or labelled: never forgotten


class _Flow:
    """The requests of one tenant at one priority, oldest first."""

    __slots__ = ("priority", "tenant", "waiting", "pass_", "seq")

    def __init__(self, priority: int, tenant: int, pass_: int, seq: int):
        self.priority = priority
        self.tenant = tenant
        self.waiting: OrderedDict[int, None] = OrderedDict()  # handles, oldest first
        self.pass_ = pass_  # the virtual time its next dispatch starts at
        self.seq = seq  # when its pass was set: the earlier goes first on a tie


class _Waiting:
    __slots__ = ("flow", "since", "deadline", "order", "inbound")

    def __init__(self, flow: _Flow, since: float, deadline: float, order: int, inbound: Any):
        self.flow = flow
        self.since = since
        self.deadline = deadline
        self.order = order  # its arrival's number: deadlines tie by it
        self.inbound = inbound


class Queue:
    """The requests waiting at the coordinator (see the module's docstring)."""

    def __init__(
        self,
        limit: int,
        handles: int,
        tenants: int,
        weights: tuple[tuple[str, float], ...] = (),
    ):
        self.limit = limit
        self.handles = handles
        self.depth = 0
        self._capacity = tenants + 1  # tenant 0 takes the clients past the table
        self._waiting: dict[int, _Waiting] = {}
        self._flows: dict[tuple[int, int], _Flow] = {}
        self._heap: list[tuple[int, int, int, tuple[int, int]]] = []  # (priority, pass, seq, key)
        self._due: list[tuple[float, int, int]] = []  # (deadline, order, handle)
        self._vtime = [0] * N_PRIORITIES
        self._seq = 0
        self._arrivals = 0
        self._tenants: dict[int, _Tenant] = {0: _Tenant(None, QUEUE_TENANTS)}
        self._tenants[0].kept = True
        self._free: list[int] = []  # indices forgotten, reused last freed first
        self._used = 1  # indices ever used
        self._names: dict[str, int] = {}
        self._labels: list[str] = []
        self._by_priority = [_WaitTally() for _ in range(N_PRIORITIES)]
        self._by_label = [_WaitTally() for _ in range(QUEUE_TENANTS + 1)]
        for name, weight in weights:
            index = self.tenant(name)
            self._tenants[index].stride = tenant_stride(weight)
            self._tenants[index].kept = True

    # -- tenants -----------------------------------------------------------------------

    def tenant(self, name: str | None = None) -> int:
        """The tenant named ``name`` (found, or made), or a new one of its own for None;
        one more client refers to it (leave() when it goes)."""
        index = self._names.get(name, -1) if name is not None else -1
        if index < 0:
            index = self._new_tenant(name)
        self._tenants[index].refs += 1
        return index

    def _new_tenant(self, name: str | None) -> int:
        if self._free:
            index = self._free.pop()
        elif self._used < self._capacity:
            index = self._used
            self._used += 1
        else:
            return 0
        label = QUEUE_TENANTS
        if name is not None and len(self._labels) < QUEUE_TENANTS:
            label = len(self._labels)
            self._labels.append(name)
        self._tenants[index] = _Tenant(name, label)
        if name is not None:
            self._names[name] = index
        return index

    def leave(self, tenant: int) -> None:
        """A client that referred to ``tenant`` is gone."""
        self._tenants[tenant].refs -= 1
        self._forget_if_unused(tenant)

    def _forget_if_unused(self, index: int) -> None:
        tenant = self._tenants[index]
        if tenant.refs or tenant.depth or tenant.kept:
            return
        if tenant.name is not None:
            del self._names[tenant.name]
        del self._tenants[index]
        self._free.append(index)

    @property
    def tenants(self) -> int:
        """Tenants known now (not counting the one for the clients past the table)."""
        return len(self._tenants) - 1

    # -- requests ------------------------------------------------------------------------

    def holds(self, handle: int) -> bool:
        return handle in self._waiting

    def push(
        self,
        handle: int,
        tenant: int,
        priority: int,
        now: float,
        deadline: float = math.inf,
        head: bool = False,
        inbound: Any = None,
    ) -> bool:
        """``handle`` waits in its (priority, tenant) flow, last (first with ``head``: a
        request whose engine died before it produced anything), until ``deadline`` (a
        time.monotonic()); False when the queue is full: it is refused (counted so)."""
        level = priority - PRIORITY_MIN
        label = self._tenants[tenant].label
        if self.depth >= self.limit:
            self._by_priority[level].observe(QueueOutcome.REFUSED, 0.0)
            self._by_label[label].observe(QueueOutcome.REFUSED, 0.0)
            return False
        key = (priority, tenant)
        flow = self._flows.get(key)
        if flow is None:
            self._seq += 1
            flow = self._flows[key] = _Flow(priority, tenant, self._vtime[level], self._seq)
            self._push_flow(flow)
        flow.waiting[handle] = None
        if head:
            flow.waiting.move_to_end(handle, last=False)
        self._arrivals += 1
        self._waiting[handle] = _Waiting(flow, now, deadline, self._arrivals, inbound)
        if deadline < math.inf:
            heapq.heappush(self._due, (deadline, self._arrivals, handle))
        self._count(flow, 1)
        return True

    def peek(self) -> int:
        """The request dispatched next (-1: none waits): the oldest of the flow of the
        lowest priority, then the lowest pass."""
        flow = self._top()
        return -1 if flow is None else next(iter(flow.waiting))

    def pop(self, now: float) -> int:
        """Dispatch peek()'s request: it leaves the queue (its wait counted DISPATCHED)
        and its flow's pass moves on by its tenant's stride; -1 when none waits."""
        flow = self._top()
        if flow is None:
            return -1
        handle = next(iter(flow.waiting))
        self._vtime[flow.priority - PRIORITY_MIN] = flow.pass_
        self._take(handle, now, QueueOutcome.DISPATCHED)
        if flow.waiting:
            flow.pass_ += self._tenants[flow.tenant].stride
            self._seq += 1
            flow.seq = self._seq
            self._push_flow(flow)
        return handle

    def remove(self, handle: int, now: float, outcome: int) -> None:
        """A waiting request leaves without a dispatch (its wait counted as ``outcome``):
        aborted, its client gone, timed out, failed."""
        self._take(handle, now, outcome)

    def expired(self, now: float) -> int:
        """The waiting request whose deadline is the earliest, if it is past ``now``:
        taken out (TIMED_OUT); -1 when none is due."""
        due = self._due
        while due:
            deadline, order, handle = due[0]
            waiting = self._waiting.get(handle)
            if waiting is None or waiting.order != order:
                heapq.heappop(due)  # it left meanwhile
                continue
            if deadline > now:
                return -1
            heapq.heappop(due)
            self._take(handle, now, QueueOutcome.TIMED_OUT)
            return handle
        return -1

    def inbound(self, handle: int) -> Any:
        """What the request was pushed with (the C twin: queue_inbound)."""
        return self._waiting[handle].inbound

    # -- its steps -------------------------------------------------------------------------

    def _take(self, handle: int, now: float, outcome: int) -> None:
        waiting = self._waiting.pop(handle)
        flow = waiting.flow
        del flow.waiting[handle]
        if not flow.waiting:
            del self._flows[(flow.priority, flow.tenant)]  # its heap entry goes stale
        self._count(flow, -1)
        seconds = now - waiting.since
        self._by_priority[flow.priority - PRIORITY_MIN].observe(outcome, seconds)
        self._by_label[self._tenants[flow.tenant].label].observe(outcome, seconds)
        self._forget_if_unused(flow.tenant)
        self._compact()

    def _count(self, flow: _Flow, change: int) -> None:
        tenant = self._tenants[flow.tenant]
        self.depth += change
        tenant.depth += change
        self._by_priority[flow.priority - PRIORITY_MIN].depth += change
        self._by_label[tenant.label].depth += change

    def _push_flow(self, flow: _Flow) -> None:
        key = (flow.priority, flow.tenant)
        heapq.heappush(self._heap, (flow.priority, flow.pass_, flow.seq, key))

    def _top(self) -> _Flow | None:
        """The flow served next; the heap's stale entries (flows emptied, or whose pass
        moved on) are dropped on the way."""
        heap = self._heap
        while heap:
            _, pass_, seq, key = heap[0]
            flow = self._flows.get(key)
            if flow is not None and flow.seq == seq:
                return flow
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        """Rebuild a lazy heap that holds far more stale entries than live ones."""
        if len(self._heap) > 2 * len(self._flows) + _SLACK:
            self._heap = [
                (f.priority, f.pass_, f.seq, (f.priority, f.tenant)) for f in self._flows.values()
            ]
            heapq.heapify(self._heap)
        if len(self._due) > 2 * len(self._waiting) + _SLACK:
            self._due = [
                (w.deadline, w.order, h) for h, w in self._waiting.items() if w.deadline < math.inf
            ]
            heapq.heapify(self._due)

    # -- what stats() and metrics() give ---------------------------------------------------

    def _rows(self) -> tuple[dict[int, _WaitTally], dict[str, _WaitTally]]:
        """The rows with anything to say: priorities and labels waited in."""
        priorities = {
            level + PRIORITY_MIN: tally
            for level, tally in enumerate(self._by_priority)
            if tally.depth or any(any(b) for b in tally.buckets)
        }
        labels = dict(zip(self._labels, self._by_label, strict=False))
        other = self._by_label[QUEUE_TENANTS]
        if other.depth or any(any(b) for b in other.buckets):
            labels[OTHER_TENANTS] = other
        return priorities, labels

    def stats(self) -> dict[str, Any]:
        """Waiting now and ended so far, by priority and by tenant (its label)."""
        priorities, labels = self._rows()
        return {
            "depth": self.depth,
            "limit": self.limit,
            "tenants": self.tenants,
            "by_priority": {p: tally.stats() for p, tally in priorities.items()},
            "by_tenant": {name: tally.stats() for name, tally in labels.items()},
        }

    def metrics(self) -> dict[str, Any]:
        """The wait histograms (buckets of LATENCY_BUCKETS and one more), by outcome."""
        priorities, labels = self._rows()
        return {
            "by_priority": {p: tally.metrics() for p, tally in priorities.items()},
            "by_tenant": {name: tally.metrics() for name, tally in labels.items()},
        }


# -- each engine's and each client's tally (loop/tally.pyx) ----------------------------


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


# -- an engine's faults (loop/faults.pyx) ---------------------------------------------


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
            self._loop._mark_gone(engine, reason)
            return
        now = time.monotonic()
        self.strike(engine, reason, now)
        engine.state = AWAY
        engine.away_until = now + self.grace
        self._loop._router.remove_rank(engine.rank)

    def back(self, engine: _Engine, fd: int) -> None:
        """An engine AWAY (or whose connection changed unseen) heard from again on
        connection ``fd``: its requests are its own again, and it takes work (unless
        quarantined). A request may have been lost with the old connection on its way
        to it: a rebuild engine's HELD says which it holds (UNCONFIRMED until then)."""
        if engine.state == AWAY:
            engine.state = ALIVE
            self._loop._counters[Counter.ENGINES_BACK] += 1
            self.admit(engine)
        self._loop._watch(engine, fd)
        if engine.rebuild:
            for request in self._loop._in_order(lambda r: r.rank == engine.rank):
                request.flags |= UNCONFIRMED

    def not_held(self, engine: _Engine) -> None:
        """After an engine's HELD: its requests it did not list never reached it."""
        resend: dict[_Client, list[int]] = defaultdict(list)
        for request in self._loop._in_order(
            lambda r: r.rank == engine.rank and r.flags & UNCONFIRMED
        ):
            self._loop._unrun(request, resend)
        self._loop._rebuild.send_resends(resend)

    def admit(self, engine: _Engine) -> None:
        """An engine ALIVE takes work, unless quarantined."""
        if engine.quarantined_until <= time.monotonic() and self._whole(engine.rank):
            self._loop._router.add_rank(engine.rank)

    def tick(self, now: float) -> None:
        """The grace over (gone), and the quarantines over (work again)."""
        for engine in self._loop._engines:
            if engine.state == AWAY and now >= engine.away_until:
                self._loop._mark_gone(engine, GoneReason.GRACE_OVER)
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
        return self._loop._resend(request)

    def continued(self, request: _Request, body: Buffer) -> bytes:
        """A reply of a request that went on at another engine, continuing its stream."""
        return continued(body, self.migrated[request.server_rid])


# -- the rebuild after a coordinator's loss (loop/rebuild.pyx) --------------------------


class Rebuild:
    """The rebuild after a coordinator's loss, and the ride-through of a client's blip
    (docs/design.md, "The rebuild after a coordinator's loss"): what engines report
    (HELD), what clients wait for (REJOIN), the replays (REPLAY, REPLAYED), what is sent
    back (RESEND), the acknowledgements (HANDLED) and the clients away. Until the window
    ends, engines report what they hold and clients what they wait for; meanwhile no
    HANDLED goes out (a replay may need it all). It works on its loop's tables."""

    def __init__(self, loop: Loop, options: Options):
        self._loop = loop
        self.until = time.monotonic() + options.rebuild_window
        self.rebuilding = True
        # REJOIN entries no engine claimed yet: (client identity, rid) -> partials got
        self.awaiting: dict[tuple[bytes, int], int] = {}
        # REJOIN entries aborted before an engine claimed them: (client identity, rid)
        self.aborting: set[tuple[bytes, int]] = set()
        # What engines' reports adopted in the window, ended or not: a second claim of a
        # server id, or of a client's request id, is refused (nothing is answered twice).
        self.claimed_ids: set[int] = set()
        self.claimed_rids: set[tuple[bytes, int]] = set()
        # Requests of rejoined clients that found no engine yet, by routing id: sent back
        # (RESEND) once one registers, or at the window's end (resend_deferred).
        self.deferred: dict[bytes, list[int]] = defaultdict(list)
        # Rebuild clients whose connection ended, by identity: until when their requests
        # wait for their REJOIN (meanwhile their engines get no HANDLED: a replay may
        # need all they kept).
        self.away: dict[bytes, float] = {}

    def held(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """HELD: what a rebuild engine holds, after its registration. A request this
        coordinator has at that engine (a blip) is replayed whole; one it does not know
        is adopted under its server id while the window lasts, for a client that may
        still REJOIN it; any other is aborted at the engine, which must not run it on."""
        parsed = self._loop._parse(protocol.HELD, None, Header.HELD, frames)
        if parsed is None:
            return
        entries, hashes = parsed
        self._loop._router.learn(engine.rank, hashes, time.monotonic())
        replays: dict[_Engine, list[list[int]]] = defaultdict(list)
        aborts = []
        pd = self._loop._pd
        for server_rid, client_rid, client_id, partials, final in entries:
            if client_id is None and pd is not None and pd.reported(engine.rank, server_rid, final):
                continue
            request = self._loop._find(server_rid)
            if request is not None:
                # Its client named, or nil for one that did not ask for the rebuild.
                named = client_id == (request.client.identity if request.client.rebuild else None)
                if not (request.rank == engine.rank and request.client_rid == client_rid and named):
                    aborts.append(server_rid)  # another's: the first claim stands
                    continue
                request.flags &= ~UNCONFIRMED
                if client_id is not None and not request.flags & ORPHAN:
                    self._replay(request, -1, replays)  # an orphan's waits for its client
                continue
            if client_id is None:  # nobody to adopt it for
                aborts.append(server_rid)
                continue
            client = None if engine.state == GONE else self._adoptive_client(client_id, client_rid)
            if client is None or not self._claimable(server_rid, client_id, client_rid):
                aborts.append(server_rid)
                continue
            request = self._loop._adopt(client, client_rid, server_rid)
            self._loop._admit(request)
            self._loop._router.hold(engine.rank)
            request.rank, request.work = engine.rank, self._loop._router.charged
            request.flags = ORPHAN | REPLAYING | (PRODUCED if partials else 0)
            self._loop._counters[Counter.ADOPTED] += 1
            start = self.awaiting.pop((client_id, client_rid), None)
            if start is not None:
                request.flags &= ~ORPHAN
                self._replay(request, start, replays)
                if (client_id, client_rid) in self.aborting:  # its client aborted it meanwhile
                    self.aborting.discard((client_id, client_rid))
                    request.flags |= ABORTED
                    aborts.append(server_rid)
        self._refuse_claims(engine, "HELD", len(aborts))
        for server_rid in aborts:
            if engine.state != GONE:
                self._loop._abort_at_engine(engine, server_rid)
        self._send_replays(replays)
        self._loop._faults.not_held(engine)

    def _claimable(self, server_rid: int, client_id: bytes, client_rid: int) -> bool:
        """Whether an engine's report may be adopted under ``server_rid``: not an id this
        life drew (those are all known, in flight or ended), nor one past MAX_ADOPTED,
        and claimed by nobody before in the window (by server id, or by its client's
        id), even if it has ended since."""
        if not 0 <= server_rid < MAX_ADOPTED or (
            self._loop._options.first_server_id <= server_rid < self._loop._next_rid
        ):
            return False
        if server_rid in self.claimed_ids or (client_id, client_rid) in self.claimed_rids:
            return False
        self.claimed_ids.add(server_rid)
        self.claimed_rids.add((client_id, client_rid))
        return True

    def _refuse_claims(self, engine: _Engine, kind: str, count: int) -> None:
        """Claims of an engine's report that could not be true: counted and logged; they
        change nothing of another peer's."""
        if count:
            self._loop._counters[Counter.REFUSED_CLAIMS] += count
            what = f"refused {count} {kind} claims from engine {engine.rank}"
            self._loop._log.warn(f"claims:{engine.rank}", what)

    def _adoptive_client(self, identity: bytes, client_rid: int) -> _Client | None:
        """The client an adopted request would be for (made, absent, until it
        connects); None when it must not be adopted: the window is over, the client
        rejoined without it or sent it again, or the tables are full."""
        client = self._loop._clients.get(identity)
        # A client connected that rejoined (or said it rejoins nothing) waits only for
        # what it listed; one that never asked for the rebuild waits for nothing.
        unwanted = client is not None and client.present and not (client.rebuild and client.fresh)
        if (
            not self.rebuilding
            or self._loop._live >= self._loop._options.max_inflight
            or (client is not None and client_rid in client.requests)
            or (unwanted and (identity, client_rid) not in self.awaiting)
        ):
            return None
        if client is not None:
            return client
        if (
            identity in self._loop._engine_by_identity
            or self._loop._roles.of(identity) == PeerRole.ENGINE
        ):
            return None
        if (
            len(self._loop._clients) >= self._loop._options.max_clients
            and not self._loop._vacant_client()
        ):
            return None
        client = self._loop._clients[identity] = self._loop._idle[identity] = _Client(identity)
        client.coordkit = client.rebuild = True  # only a rebuild client's id travels
        client.present = False
        return client

    def rejoin(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """REJOIN: the requests a rebuild client still waits for, once acknowledged
        again. Each one held is replayed from the partials it got; one not held waits
        for an engine to claim it while the window lasts, and is sent back after it
        (RESEND, or ERROR(ENGINE_FAILED) when it got partials: it cannot start over).
        Its adopted requests it did not list are not awaited: aborted."""
        if not client.fresh:  # what it waits for was settled by its first message
            self._loop._malformed(client, None, Header.REJOIN, "not the connection's first", frames)
            return
        parsed = self._loop._parse(protocol.REJOIN, client, Header.REJOIN, frames)
        if parsed is None:
            return
        entries, _ = parsed
        if any(partials < 0 for _, partials in entries):
            self._loop._malformed(
                client, None, Header.REJOIN, "a negative count of partials", frames
            )
            return
        if len(entries) > self._loop._options.max_inflight:
            self._loop._malformed(
                client, None, Header.REJOIN, "more entries than max_inflight", frames
            )
            return
        client.fresh = False
        client.rejoined = True
        self.away.pop(client.identity, None)  # back from a blip: its requests carry on
        replays: dict[_Engine, list[list[int]]] = defaultdict(list)
        resend: dict[_Client, list[int]] = defaultdict(list)
        for rid, partials in entries:
            request = client.requests.get(rid)
            if request is not None:
                request.flags &= ~ORPHAN
                self._replay(request, partials, replays)
            elif self.rebuilding:
                self.awaiting[(client.identity, rid)] = partials
            else:
                self._unclaimed(client, rid, partials, resend)
        for request in self._loop._in_order(lambda r: r.client is client and r.flags & ORPHAN):
            self._drop_orphan(request)
        self._send_replays(replays)
        self.send_resends(resend)

    def replayed(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """REPLAYED: what an engine sends again, each reply with its place, on to its
        client as CLIENT_REPLAYED (which drops what it has); its normal replies flow
        again. A request the engine does not hold is sent back to its client when
        nothing of it was delivered, else ended with ERROR(ENGINE_FAILED)."""
        parsed = self._loop._parse(protocol.REPLAYED, None, Header.REPLAYED, frames)
        if parsed is None:
            return
        entries, _ = parsed
        now = time.monotonic() if self._loop._latency is not None else 0.0
        out: dict[_Client, list[tuple[list[Any], Any]]] = defaultdict(list)
        resend: dict[_Client, list[int]] = defaultdict(list)
        at = 2
        refused = 0
        for server_rid, first, count, final in entries:
            bodies, at = frames[at : at + count], at + count
            request = self._loop._find(server_rid)
            if request is None or request.rank != engine.rank or not request.flags & ASKED:
                refused += 1  # not asked of it (or asked and answered already)
                continue
            if not request.client.present:
                continue  # its client is away again: its REJOIN asks anew
            request.flags &= ~(REPLAYING | ASKED)
            if first < 0:
                self._unheld(request, resend)
                continue
            for j, body in enumerate(bodies):
                last = final and j == count - 1
                self._loop._finish(request, last, now)
                out[request.client].append(([request.client_rid, first + j, last], body))
        self._refuse_claims(engine, "REPLAYED", refused)
        for client, replies in out.items():
            message = protocol.CLIENT_REPLAYED.pack(*zip(*replies, strict=True))
            if not self._loop._send(client.identity, message):
                self._loop._client_gone(client)
        self.send_resends(resend)

    def _replay(self, request: _Request, start: int, replays: dict[_Engine, Any]) -> None:
        """Ask the request's engine (a rebuild engine) to send again what it sent for
        it from partial ``start`` on (-1: all it keeps); its replies wait till then."""
        if request.rank < 0:
            return
        engine = self._loop._engines[request.rank]
        if engine.rebuild and engine.state != GONE:
            request.flags |= REPLAYING | ASKED
            replays[engine].append([request.server_rid, start])

    def _send_replays(self, replays: dict[_Engine, list[list[int]]]) -> None:
        for engine, entries in replays.items():
            self._loop._counters[Counter.REPLAYED] += len(entries)
            if not self._loop._send(engine.identity, protocol.REPLAY.pack(entries)):
                self._loop._faults.lost(engine, GoneReason.UNREACHABLE)

    def send_resends(self, resend: dict[_Client, list[int]]) -> None:
        """RESEND to each client (one that is connected) of the requests it must send again."""
        for client, rids in resend.items():
            if not client.present or self._loop._clients.get(client.identity) is not client:
                continue
            self._loop._counters[Counter.RESENT] += len(rids)
            if not self._loop._send(client.identity, protocol.RESEND.pack(rids)):
                self._loop._client_gone(client)

    def rejoins_nothing(self, client: _Client) -> None:
        """A connected client's first message is not a REJOIN: it waits for nothing an
        engine may still report, and what was adopted for it is aborted (before the
        message is handled: one of its new requests may have the id of one)."""
        client.fresh = False
        if client.requests:
            for request in self._loop._in_order(
                lambda r: r.flags & ORPHAN, client.requests.values()
            ):
                self._drop_orphan(request)

    def _unclaimed(
        self, client: _Client, rid: int, partials: int, resend: dict[_Client, list[int]]
    ) -> None:
        """A request a client waits for that no engine holds: sent back when it got
        nothing, else ended (partials went out: it cannot start over)."""
        if partials == 0:
            resend[client].append(rid)
            return
        self._loop._failed[ErrorCode.ENGINE_FAILED] += 1
        self._loop._counters[Counter.ENGINE_FAILED] += 1
        if not self._loop._send_error(client, rid, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST):
            self._loop._client_gone(client)

    def _unheld(self, request: _Request, resend: dict[_Client, list[int]]) -> None:
        """A request its engine says it does not hold (any more): sent back to its
        client when nothing of it was delivered, else ended with ERROR(ENGINE_FAILED)."""
        if request.flags & (PRODUCED | ABORTED | PINNED) or not request.client.rebuild:
            self._loop._fail_request(request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
            return
        if self._loop._traces is not None:
            self._loop._traces.drop(request)
        self._loop._forget(request)
        resend[request.client].append(request.client_rid)

    def _drop_orphan(self, request: _Request) -> None:
        """An adopted request no client waits for: aborted at its engine and forgotten,
        and its client with it when that never came back and has nothing left."""
        rank, client = request.rank, request.client
        self._loop._forget(request)
        if rank >= 0 and self._loop._engines[rank].state != GONE:
            self._loop._abort_at_engine(self._loop._engines[rank], request.server_rid)
        if not client.present and not client.requests and client.identity in self._loop._clients:
            self._loop._remove_client(client)

    def defer(self, client: _Client, rid: int) -> None:
        """Keep a request for RESEND once an engine registered (see Loop._accept)."""
        self.deferred[client.identity].append(rid)

    def resend_deferred(self) -> None:
        """RESEND of the deferred requests (see _accept), to the clients still here."""
        deferred, self.deferred = self.deferred, defaultdict(list)
        resend: dict[_Client, list[int]] = {}
        for identity, rids in deferred.items():
            client = self._loop._clients.get(identity)
            if client is not None:
                resend[client] = rids
        self.send_resends(resend)

    def end_window(self) -> None:
        """The window's end: the requests clients wait for that no engine claimed are
        sent back (see _unclaimed), the adopted ones no client came back for are
        aborted, and HANDLED goes out again."""
        self.rebuilding = False
        self.claimed_ids.clear()  # no report is adopted any more
        self.claimed_rids.clear()
        awaiting, self.awaiting = self.awaiting, {}
        resend: dict[_Client, list[int]] = defaultdict(list)
        aborting, self.aborting = self.aborting, set()
        for (identity, rid), partials in awaiting.items():
            client = self._loop._clients.get(identity)
            if client is None:
                continue
            if (identity, rid) in aborting:  # aborted before anyone ran it: not sent again
                self._loop._refuse(
                    client,
                    rid,
                    ErrorCode.UNKNOWN_REQUEST,
                    Header.ABORT_REQUEST,
                    Counter.UNKNOWN_REQUEST,
                )
            else:
                self._unclaimed(client, rid, partials, resend)
        self.send_resends(resend)
        # The orphans of a client away from a blip wait for it till its hold ends.
        for request in self._loop._in_order(
            lambda r: r.flags & ORPHAN and r.client.identity not in self.away
        ):
            if self._loop._find(request.server_rid) is request:
                self._drop_orphan(request)

    def acknowledge(self) -> None:
        """HANDLED to each rebuild engine (after the window): the number of its last
        reply message handled by the previous tick, so at least a tick ago, by when
        the replies in it have left this process in all but a stall. An engine that
        holds requests of a client away is not: a REJOIN may want all it kept."""
        holding = {r.rank for i in self.away for r in self._loop._clients[i].requests.values()}
        for engine in self._loop._engines:
            if (
                engine.rebuild
                and engine.state != GONE
                and not self.rebuilding
                and engine.rank not in holding
                and engine.mark > engine.acked
            ):
                engine.acked = engine.mark
                count = engine.base + engine.acked - 1
                if not self._loop._send(engine.identity, protocol.HANDLED.pack(count)):
                    self._loop._faults.lost(engine, GoneReason.UNREACHABLE)
            engine.mark = engine.handled

    def go_away(self, client: _Client) -> None:
        """A rebuild client's connection ended: for its hold (its failover_timeout, from
        its CONNECT) its requests at rebuild engines wait for its REJOIN, as adopted ones
        do (ORPHAN), their replies dropped meanwhile (REPLAYING: the engine keeps them,
        and is sent no HANDLED meanwhile); the REJOIN replays what it lacks. Those at
        other engines cannot be replayed: aborted now (the REJOIN then has them sent
        again, or failed, as after a coordinator's loss). A client left with nothing in
        flight is not kept: it is forgotten as any other."""
        client.present = client.rejoined = False
        if self._loop._connections.get(client.fd) is client:
            self._loop._connections[client.fd] = None
        client.fd = -1
        self.away[client.identity] = time.monotonic() + client.hold
        for request in self._loop._in_order(lambda r: True, client.requests.values()):
            rank = request.rank
            if (
                rank >= 0
                and self._loop._engines[rank].rebuild
                and self._loop._engines[rank].state != GONE
            ):
                request.flags |= ORPHAN | REPLAYING
                continue
            self._loop._forget(request)
            if (
                not request.flags & ABORTED
                and rank >= 0
                and self._loop._engines[rank].state != GONE
            ):
                self._loop._abort_at_engine(self._loop._engines[rank], request.server_rid)
        if not client.requests:
            self._loop._remove_client(client)

    def returned(self, client: _Client) -> None:
        """A client not connected (away, or known from an engine's report) sent CONNECT:
        one that was away and has nothing in flight awaits no REJOIN."""
        if client.identity in self.away:
            self._loop._counters[Counter.CLIENTS_RETURNED] += 1
            if not client.requests:
                del self.away[client.identity]

    def end_holds(self, now: float) -> None:
        """The clients away past their hold: one that did not come back is dropped with
        its requests (aborted at their engines); one that came back and did not REJOIN
        them has its orphans aborted."""
        for identity, until in list(self.away.items()):
            if now < until:
                continue
            del self.away[identity]
            client = self._loop._clients[identity]
            if not client.present:
                self._loop._drop_client(client)
                continue
            for request in self._loop._in_order(
                lambda r: r.flags & ORPHAN, client.requests.values()
            ):
                self._drop_orphan(request)


# -- the requests traced (loop/traces.pyx) ---------------------------------------------


class Traced:
    """What is recorded of a traced request: a TraceRecord's fields."""

    __slots__ = (
        "server_rid",
        "client_rid",
        "client",
        "engine",
        "accepted",
        "routed",
        "first_reply",
        "final",
        "error",
        "traceparent",
    )

    def __init__(self, request: _Request, accepted: float, traceparent: str | None):
        self.server_rid = request.server_rid
        self.client_rid = request.client_rid
        self.client = request.client.identity
        self.engine: bytes | None = None  # never routed
        self.accepted = accepted
        self.routed: float | None = None
        self.first_reply: float | None = None
        self.final: float | None = None
        self.error = 0  # a final; an ErrorCode; or tracing.CLIENT_GONE
        self.traceparent = traceparent


class Traces:
    """The requests the coordinator traces, recorded for its TraceSink (coordkit.tracing).

    A request is traced when its params carry a client's traceparent (``follow``) or it
    is one in ``every`` of the others: ``accept`` gives it a record. The hooks stamp its
    routing, its first reply, its final, and its ERROR; ``forget`` (every end of a
    request goes through the Loop's) sets it aside, and ``end``, once the message at
    hand is handled (its replies and ERRORs sent), stamps them ended and pushes them to
    the sink (the C twin keeps them in a ring its sink takes them from instead).
    """

    __slots__ = ("_sink", "follow", "every", "countdown", "traced", "ending")

    def __init__(self, sink: TraceSink):
        self._sink = sink
        self.follow = sink.follow  # every request whose params carry a traceparent
        self.every = self.countdown = sink.every  # and one in `every` of the others
        self.traced: dict[_Request, Traced] = {}  # the requests traced in flight
        self.ending: list[Traced] = []  # those ended by the message at hand

    def accept(self, request: _Request, inbound: Inbound) -> None:
        """A request accepted: traced when the sampling says so."""
        if self.follow:
            parent = self._parent(inbound)
            if parent is None and not self._counted():
                return
        elif self._counted():
            parent = self._parent(inbound)  # its spans still join the client's trace
        else:
            return
        accepted = request.submitted or time.monotonic()  # _admit's, when it timed it
        self.traced[request] = Traced(request, accepted, parent)

    def routed(self, request: _Request, engine: _Engine) -> None:
        """Its frames went to ``engine`` (a re-send: the last routing counts)."""
        if (traced := self.traced.get(request)) is not None:
            traced.routed = time.monotonic()
            traced.engine = engine.identity

    def replied(self, request: _Request, final: bool, now: float) -> None:
        """A reply entry for it (``now``: the clock read for its message, or 0)."""
        if (traced := self.traced.get(request)) is None:
            return
        now = now or time.monotonic()
        if traced.first_reply is None:
            traced.first_reply = now
        if final:
            traced.final = now

    def fail(self, request: _Request, code: int) -> None:
        """It ends with ERROR(code) (or tracing.CLIENT_GONE), before its forget."""
        if (traced := self.traced.get(request)) is not None:
            traced.error = code

    def drop(self, request: _Request) -> None:
        """It leaves without an end of its own (its client sends it again: RESEND)."""
        self.traced.pop(request, None)

    def forget(self, request: _Request) -> None:
        """It leaves the tables (the Loop's _forget): its record waits for the message's
        end (end). Without a final or an ERROR, its client left."""
        if (traced := self.traced.pop(request, None)) is None:
            return
        if traced.final is None and not traced.error:
            traced.error = CLIENT_GONE
        self.ending.append(traced)

    def end(self) -> None:
        """The message at hand is handled, what it sent sent: the records set aside are
        stamped ended and pushed to the sink."""
        now = time.monotonic()
        for t in self.ending:
            self._sink.push(
                TraceRecord(
                    t.server_rid,
                    t.client_rid,
                    t.client,
                    t.engine,
                    t.accepted,
                    t.routed,
                    t.first_reply,
                    t.final,
                    now,
                    t.error,
                    t.traceparent,
                )
            )
        self.ending.clear()

    def _parent(self, inbound: Inbound) -> str | None:
        """The traceparent in a multipart request's params (tracing.TRACEPARENT_MARK and
        the 55 bytes after it), or None. A Megatron client's single frame carries none."""
        if inbound.single or inbound.params is None:
            return None
        params = bytes(inbound.params)
        found = params.find(TRACEPARENT_MARK)
        start = found + len(TRACEPARENT_MARK)
        if found < 0 or start + TRACEPARENT_SIZE > len(params):
            return None
        return params[start : start + TRACEPARENT_SIZE].decode("latin-1")

    def _counted(self) -> bool:
        """Whether this one is the one in ``every`` (of the requests without a parent
        followed)."""
        if not self.every:
            return False
        self.countdown -= 1
        if self.countdown:
            return False
        self.countdown = self.every
        return True


# -- the rare paths' helpers -----------------------------------------------------------


# -- disaggregated prefill/decode (loop/pd.pyx) ------------------------------------------


class Seat:
    """An engine with a P/D role (PD.seats, by rank): what it takes and holds."""

    __slots__ = (
        "role",
        "megatron",
        "domain",
        "capacity",
        "reserved",
        "ssm_capacity",
        "ssm_used",
        "slot_cost",
        "nccl",
        "transfer",
    )

    def __init__(self, role: int, megatron: bool, domain: str, capacity: int):
        self.role = role  # EngineRole: PREFILL takes hop 1, DECODE hop 2 (and whole requests)
        self.megatron = megatron  # a #6675 engine (REGISTER_ROLE), else a coordkit one
        self.domain = domain  # the transfer domain it moves KV within
        self.capacity = capacity  # requests it holds at most (a prefill's pinned ones counted)
        self.reserved = 0  # held now: a prefill's prefilling and pinned, a decode's handoffs
        self.ssm_capacity = 0  # a #6675 hybrid's live SSM slots (0: none)
        self.ssm_used = 0
        self.slot_cost = 0  # a hybrid prefill's SSM slots per request
        self.nccl = False  # a #6675 prefill that pushes on SEND_KV
        self.transfer: Any = None  # a decode's metadata for SEND_KV


class Hop:
    """A request of the room (PD.hops): where its two hops stand."""

    __slots__ = (
        "stage",
        "prefill",
        "decode",
        "attempts",
        "pins",
        "lease",
        "final",
        "unsafe",
        "prefill_work",
        "decode_work",
        "ssm",
        "prompt",
        "params",
        "hashes",
        "tokens",
        "kv_meta",
        "blocks",
        "decode_prompt",
    )

    def __init__(self, prompt: bytes, params: bytes, hashes: bytes | None, tokens: int):
        self.stage = 0  # QUEUED_PREFILL, PREFILL, QUEUED_DECODE, DECODE, READ (_pd)
        self.prefill = -1  # the prefill rank, kept after the read: who to release
        self.decode = -1
        self.attempts = 0  # re-prefills and re-handoffs after deaths and leases
        self.pins = False  # its prefill holds its blocks pinned (a handoff, no release yet)
        self.lease = 0.0  # the pins' deadline
        self.final = False  # its decode sent the final: the read is over
        self.unsafe = False  # ended while a read may still run: its pins wait (orphans)
        self.prefill_work = self.decode_work = 0  # the role routers' charges
        self.ssm = 0  # the SSM slots its handoff takes at the decode
        # What re-sends it: the prompt and the client's params (packed), its block
        # hashes and tokens; the handoff kept from the prefill's answer to the read.
        self.prompt, self.params, self.hashes, self.tokens = prompt, params, hashes, tokens
        self.kv_meta = self.blocks = b""
        self.decode_prompt: bytes | None = None  # a str prompt's tokens, for a #6675 decode


class Orphan:
    """Pins that outlive their request (ended while its decode may still read them)."""

    __slots__ = ("prefill", "decode", "deadline", "client", "client_rid")

    def __init__(self, prefill: int, decode: int, deadline: float, client: bytes | None, rid: int):
        self.prefill, self.decode, self.deadline = prefill, decode, deadline
        self.client = client  # a #6675 client told [31, rid, True] once they go, else None
        self.client_rid = rid


class PD:
    """Disaggregated prefill/decode (docs/pd.md): a request's two hops, chained here.

    Hop 1 to a prefill engine chosen by the prefill pool's router (its cached prefix
    against its queued work), its answer (a coordkit HANDOFF, a #6675 reply) never
    shown to the client; hop 2, the same server id, to a decode engine of the
    prefill's transfer domain chosen by its router (the blocks it would have to move
    against its load); KV_TRANSFER_READY then SEND_KV for pushing prefills; RELEASE_KV
    to the owning prefill once the decode read the blocks. Every engine with a role
    holds a seat of ``capacity`` requests; a hop that finds every seat of its pool
    full waits in its role's FIFO (the decode's per domain), and goes out when a seat
    frees. The request's ``rank`` is the engine holding its present hop (-1 while it
    waits), so the loop's rank checks take a late reply of an earlier hop's engine for
    an unknown request. Deaths, leases, aborts and time-outs: docs/pd.md's table.
    """

    def __init__(self, loop: Loop, options: Options):
        self._loop = loop
        self.mode = options.pd_mode
        self.threshold = options.pd_threshold
        self.lease = options.pd_lease
        self.retries = options.pd_retries
        self.block_size = options.block_size
        self.max_engines = options.max_engines
        self.megatron_clients = options.megatron_version == "pr6675"
        self.seats: dict[int, Seat] = {}
        self.registrations: dict[bytes, _pd.Registration] = {}  # #6675 engines, by identity
        self.prefill_router = self._new_router()
        self.decode_routers: dict[str, Router] = {}
        self.hops: dict[int, Hop] = {}  # by server id
        self.prefill_queue: deque[int] = deque()  # server ids waiting for a prefill seat
        self.decode_queues: dict[str, deque[int]] = {}  # by domain
        self.leases: deque[tuple[float, int]] = deque()  # (deadline, server id): pinned
        self.orphans: dict[int, Orphan] = {}  # by server id
        self.orphan_order: deque[tuple[float, int]] = deque()
        # while a KV_READ_DONE of several is read: by prefill, (server id, work) released
        self.releasing: dict[int, list[tuple[int, int]]] | None = None
        self.counts = dict.fromkeys(_pd.PD_COUNTS, 0)

    def _new_router(self) -> Router:
        router = self._loop._router
        return type(router)(
            router.policy, self.max_engines, block_size=self.block_size, prefix_decode_tokens=0
        )

    # -- seats ---------------------------------------------------------------------------

    def seat(self, engine: _Engine, role: int, megatron: bool, domain: str, capacity: int) -> Seat:
        """An engine takes a role (its hello, or a #6675 REGISTER_ROLE): seated, out of
        the whole-request pool unless it runs whole requests, into its role's pools."""
        self.unseat(engine.rank)
        seat = self.seats[engine.rank] = Seat(role, megatron, domain, capacity)
        if domain not in self.decode_routers:
            self.decode_routers[domain] = self._new_router()
            self.decode_queues[domain] = deque()
        if not self.whole(engine.rank):
            self._loop._router.remove_rank(engine.rank)
        self.sync(engine.rank)
        return seat

    def unseat(self, rank: int) -> None:
        """A rank leaves its role (gone, or a new engine under it)."""
        seat = self.seats.pop(rank, None)
        if seat is None:
            return
        self.prefill_router.remove_rank(rank)
        self.decode_routers[seat.domain].remove_rank(rank)

    def whole(self, rank: int) -> bool:
        """Whether a rank runs whole requests: no role, a coordkit decode (a short prompt
        prefilled where it decodes), a #6675 prefill (its engine runs them)."""
        seat = self.seats.get(rank)
        if seat is None:
            return True
        if seat.megatron:
            return seat.role == EngineRole.PREFILL
        return bool(seat.role & EngineRole.DECODE)

    def _usable(self, rank: int) -> bool:
        engine = self._loop._engines[rank]
        return engine.state == ALIVE and engine.quarantined_until <= time.monotonic()

    def _free(self, seat: Seat, role: int) -> bool:
        if seat.reserved >= seat.capacity:
            return False
        if not seat.ssm_capacity:
            return True
        cost = seat.slot_cost if role == EngineRole.PREFILL else 1
        return seat.ssm_used + cost <= seat.ssm_capacity

    def sync(self, rank: int) -> None:
        """A rank in its role routers when it is usable with a free seat, else out."""
        seat = self.seats[rank]
        usable = self._usable(rank)
        for role, router in (
            (EngineRole.PREFILL, self.prefill_router),
            (EngineRole.DECODE, self.decode_routers[seat.domain]),
        ):
            if seat.role & role and usable and self._free(seat, role):
                router.add_rank(rank)
            else:
                router.remove_rank(rank)

    def _live(self, role: int, domain: str | None = None) -> bool:
        """Whether an engine of ``role`` (of ``domain``) is up, full or not."""
        return any(
            seat.role & role and (domain is None or seat.domain == domain) and self._usable(rank)
            for rank, seat in self.seats.items()
        )

    def _choose(self, router: Router, hop: Hop) -> int:
        """A rank of a role pool with a free seat for ``hop`` (-1: none); a rank found
        unusable since (away, quarantined) leaves the pool until the tick's sync."""
        while True:
            rank = router.choose(hop.hashes, time.monotonic(), hop.tokens)
            if rank < 0 or self._usable(rank):
                return rank
            router.release(rank, router.charged)
            router.remove_rank(rank)

    def _reserve(self, rank: int, ssm: int) -> None:
        seat = self.seats[rank]
        seat.reserved += 1
        seat.ssm_used += ssm
        self.sync(rank)

    def _release_seat(self, rank: int, role: int, work: int, ssm: int) -> None:
        """A hop's seat free again: its router's charge released, its queue drained."""
        seat = self.seats.get(rank)
        if seat is None:  # gone: its seat went with it
            return
        seat.reserved -= 1
        seat.ssm_used -= ssm
        if role == EngineRole.PREFILL:
            self.prefill_router.release(rank, work)
        else:
            self.decode_routers[seat.domain].release(rank, work)
        self.sync(rank)
        self.drain()

    def drain(self) -> None:
        """The queues' heads out while a seat of their pool is free, oldest first."""
        loop = self._loop
        while self.prefill_queue and self.prefill_router.n_accepting:
            rid = self.prefill_queue.popleft()
            request, hop = loop._find(rid), self.hops.get(rid)
            if request is not None and hop is not None and hop.stage == _pd.QUEUED_PREFILL:
                if not self._hop1(request, hop, True):
                    break
        for domain, queue in self.decode_queues.items():
            while queue and self.decode_routers[domain].n_accepting:
                rid = queue.popleft()
                request, hop = loop._find(rid), self.hops.get(rid)
                if request is not None and hop is not None and hop.stage == _pd.QUEUED_DECODE:
                    if not self._hop2(request, hop, True):
                        break

    # -- a request's hops ----------------------------------------------------------------

    def takes(self, request: _Request, inbound: Inbound) -> bool:
        """A new request: both hops (the first sent or queued), or False: it runs whole,
        as any request (no prefill or no decode engine up; conditional P/D and a prompt
        short enough, or cached enough where it would run whole)."""
        if inbound.header != Header.SUBMIT_REQUEST:
            return False
        if not self._live(EngineRole.PREFILL) or not self._live(EngineRole.DECODE):
            return False
        hashes = None if inbound.hashes is None else bytes(inbound.hashes)
        if self.mode == "conditional" and self._loop._router.n_accepting:
            depth = self._cached_depth(hashes)
            if _pd.uncached_tokens(inbound.tokens, depth, self.block_size) <= self.threshold:
                self.counts["whole"] += 1
                return False
        params = inbound.params
        prompt: Buffer = inbound.prompt
        if params is None:  # a single frame read as far as its rid
            _, _, _, start, middle, end = codec.read_single_submit(inbound.payload[0].buffer)
            data = inbound.payload[0].buffer
            prompt, params = data[start:middle], data[middle:end]
        hop = self.hops[request.server_rid] = Hop(
            bytes(prompt), bytes(params), hashes, inbound.tokens
        )
        request.rank = -1
        if self._megatron_client(request.client) and _pd.refuses_prompt_log_probs(
            _params_map(hop.params)
        ):
            self._end(request, ErrorCode.ENGINE_FAILED, _pd.PROMPT_LOG_PROBS, True)
            return True
        if _pd.map_head(hop.params) is None:  # the room cannot add its key: a clear error
            self._end(request, ErrorCode.MALFORMED, _pd.PARAMS_NOT_A_MAP, True)
            return True
        self.counts["requests"] += 1
        self._hop1(request, hop, False, inbound.batched)
        return True

    def _cached_depth(self, hashes: bytes | None) -> int:
        """The leading blocks of a prompt the most cached whole-request engine holds."""
        if not hashes:
            return 0
        router, now = self._loop._router, time.monotonic()
        ranks: set[int] | None = None
        depth = 0
        for (value,) in struct.iter_unpack("<Q", hashes):
            held = {rank for rank in router.prefix_ranks(value, now) if router.accepting(rank)}
            ranks = held if ranks is None else ranks & held
            if not ranks:
                break
            depth += 1
        return depth

    def _hop1(self, request: _Request, hop: Hop, head: bool, batched: bool = False) -> bool:
        """Hop 1 to a prefill with a free seat; queued when every seat is taken (at the
        head: it was the queue's), ended when no prefill is up. True when sent. A
        request of a client's batch joins the batch a prefill granted batches is sent."""
        hop.stage = _pd.QUEUED_PREFILL
        request.rank = -1
        rank = self._choose(self.prefill_router, hop)
        if rank < 0:
            if not self._live(EngineRole.PREFILL):
                self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("prefill"), True)
            elif head:
                self.prefill_queue.appendleft(request.server_rid)
            else:
                self.prefill_queue.append(request.server_rid)
            return False
        seat = self.seats[rank]
        hop.prefill_work = self.prefill_router.charged
        self._reserve(rank, seat.slot_cost)
        hop.prefill, hop.stage, request.rank = rank, _pd.PREFILL, rank
        self._learn(rank, hop)
        engine = self._loop._engines[rank]
        if batched and engine.batch and not seat.megatron:
            # its entry in the ENGINE_SUBMIT_BATCH the loop sends once the client's
            # batch is handled
            params = _pd.with_keys(hop.params, _pd.PREFILL_OVERRIDES["coordkit"])
            frames = [hop.prompt, *self._trailer(rank, request)]
            self._loop._fanout.add(engine, request.server_rid, params, frames)
            return True
        megatron_str = seat.megatron and _pd.str_prompt(hop.prompt)
        frames = _pd.prefill_frames(
            seat.megatron, request.server_rid, hop.prompt, hop.params, megatron_str
        )
        self._send_to(rank, frames + self._trailer(rank, request))
        return True

    def _hop2(self, request: _Request, hop: Hop, head: bool) -> bool:
        """Hop 2, the handoff kept, to a decode of the prefill's domain with a free seat;
        queued when each is full; ended (its pins released) when none is up."""
        hop.stage = _pd.QUEUED_DECODE
        request.rank = -1
        domain = self.seats[hop.prefill].domain
        router = self.decode_routers[domain]
        rank = self._choose(router, hop)
        if rank < 0:
            if not self._live(EngineRole.DECODE, domain):
                self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("decode"), True)
            elif head:
                self.decode_queues[domain].appendleft(request.server_rid)
            else:
                self.decode_queues[domain].append(request.server_rid)
            return False
        seat = self.seats[rank]
        hop.decode_work = router.charged
        self._reserve(rank, hop.ssm)
        hop.decode, hop.stage, request.rank = rank, _pd.DECODE, rank
        prompt = hop.decode_prompt if seat.megatron and hop.decode_prompt else hop.prompt
        frames = _pd.decode_frames(
            seat.megatron, request.server_rid, prompt, hop.params, hop.kv_meta, hop.blocks
        )
        self._learn(rank, hop)
        self._send_to(rank, frames + self._trailer(rank, request))
        return True

    def _trailer(self, rank: int, request: _Request) -> list[bytes]:
        """A rebuild engine's trailer: no client id (a hop is not rebuilt: docs/pd.md)."""
        if not self._loop._engines[rank].rebuild:
            return []
        return [protocol.pack_trailer(request.client_rid, None, False)]

    def _learn(self, rank: int, hop: Hop) -> None:
        """A hop sent to an engine that runs whole requests too: the whole-request router
        learns the prefix it now caches (conditional P/D then finds it)."""
        if hop.hashes and self.whole(rank) and self._loop._router.policy == "prefix":
            self._loop._router.learn(rank, hop.hashes, time.monotonic())

    def _send_to(self, rank: int, frames: list[Any]) -> bool:
        engine = self._loop._engines[rank]
        if engine.state == GONE:
            return False
        if self._loop._send(engine.identity, frames):
            return True
        self._loop._faults.lost(engine, GoneReason.UNREACHABLE)  # settled: engine_gone
        return False

    def _handed(
        self, rank: int, rid: int, kv_meta: bytes, blocks: bytes, ssm: int, tokens: Any
    ) -> None:
        """A prefill hop's handoff: its blocks pinned at ``rank``; on to hop 2. A handoff
        of no request of that prefill's (late, ended) is released at once."""
        request = self._loop._find(rid)
        hop = self.hops.get(rid)
        if request is None or hop is None or hop.stage != _pd.PREFILL or hop.prefill != rank:
            self.counts["stray"] += 1
            self._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
            return
        hop.pins = True
        hop.kv_meta, hop.blocks, hop.ssm = kv_meta, blocks, ssm
        hop.lease = time.monotonic() + self.lease
        self.leases.append((hop.lease, rid))
        if isinstance(tokens, list):
            hop.decode_prompt = packb(tokens)
        self.counts["handoffs"] += 1
        if request.flags & ABORTED:  # its client aborted it meanwhile: nothing reads them
            self._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        self._hop2(request, hop, False)

    def _release_pins(self, rid: int, hop: Hop) -> None:
        """RELEASE_KV to the owning prefill, its seat free, the handoff dropped."""
        hop.pins = False
        hop.kv_meta = hop.blocks = b""
        self.counts["pins_released"] += 1
        self._release(hop.prefill, rid, hop.prefill_work)

    def _release(self, prefill: int, rid: int, work: int) -> None:
        """RELEASE_KV of ``rid`` to its prefill, then its seat free: at once, or, while a
        KV_READ_DONE of several is read, with the others of that coordkit prefill at its
        end (_send_releases: a seat is freed after its release is sent)."""
        seat = self.seats.get(prefill)
        if self.releasing is not None and seat is not None and not seat.megatron:
            self.releasing.setdefault(prefill, []).append((rid, work))
            return
        self._send_to(prefill, [protocol.rids_message(Header.RELEASE_KV, rid)])
        if seat is not None:
            self._release_seat(prefill, EngineRole.PREFILL, work, seat.slot_cost)

    def _send_releases(self, releases: dict[int, list[tuple[int, int]]]) -> None:
        """The releases a KV_READ_DONE of several made: one RELEASE_KV per prefill, its
        rids in order, then their seats freed."""
        for prefill, pins in releases.items():
            rids = (rid for rid, _ in pins)
            self._send_to(prefill, [protocol.rids_message(Header.RELEASE_KV, *rids)])
            for _, work in pins:
                seat = self.seats.get(prefill)
                if seat is not None:
                    self._release_seat(prefill, EngineRole.PREFILL, work, seat.slot_cost)

    # -- what the loop calls -------------------------------------------------------------

    def finished(self, request: _Request) -> None:
        """Its final arrived: at a decode, its read is over."""
        self.hops[request.server_rid].final = True

    def forget(self, request: _Request) -> None:
        """The request leaves the tables (its final, its error, its abort): what it holds
        goes, but pins a read may still use, which wait (orphans). Its rank is -1 after:
        the loop releases nothing of the whole-request router for it."""
        rid = request.server_rid
        hop = self.hops.pop(rid)
        stage = hop.stage
        request.rank = -1
        if stage == _pd.QUEUED_PREFILL:
            _discard(self.prefill_queue, rid)
        elif stage == _pd.QUEUED_DECODE and hop.prefill in self.seats:
            _discard(self.decode_queues[self.seats[hop.prefill].domain], rid)
        elif stage in (_pd.DECODE, _pd.READ):
            self._release_seat(hop.decode, EngineRole.DECODE, hop.decode_work, hop.ssm)
        # The prefill's seat is held from hop 1 until its pins go.
        if hop.pins and stage == _pd.DECODE and not hop.final:
            self._orphan(request, hop)
        elif hop.pins:
            self._release_pins(rid, hop)
        elif stage == _pd.PREFILL:
            seat = self.seats.get(hop.prefill)
            self._release_seat(
                hop.prefill,
                EngineRole.PREFILL,
                hop.prefill_work,
                0 if seat is None else seat.slot_cost,
            )

    def _orphan(self, request: _Request, hop: Hop) -> None:
        client = request.client
        notify = client.identity if hop.unsafe and self._megatron_client(client) else None
        deadline = time.monotonic() + self.lease
        self.orphans[request.server_rid] = Orphan(
            hop.prefill, hop.decode, deadline, notify, request.client_rid
        )
        self.orphan_order.append((deadline, request.server_rid))
        # the prefill's seat stays held until they go (_free_orphan)
        hop.pins = False

    def _free_orphan(self, rid: int) -> None:
        orphan = self.orphans.pop(rid)
        self.counts["pins_released"] += 1
        self._release(orphan.prefill, rid, 0)
        if orphan.client is not None:
            self._tell(orphan.client, protocol.REQUEST_ABORTED.pack(orphan.client_rid, True))

    def reported(self, rank: int, rid: int, final: bool) -> bool:
        """An entry naming no client in the HELD of a rebuild engine at ``rank``: one of
        the room's hops there (confirmed), or pins there that their read or lease
        releases (kept); pins the room does not know of (a handoff made under a
        coordinator before this one, or by ``rank`` before it was seen gone) are
        released now. False for anything else: the loop aborts it at the engine."""
        hop = self.hops.get(rid)
        if hop is not None and hop.stage:
            if hop.pins and hop.prefill == rank:
                return True
            request = self._loop._find(rid)
            if request is not None and request.rank == rank and not final:
                request.flags &= ~UNCONFIRMED
                return True
        orphan = self.orphans.get(rid)
        if orphan is not None and orphan.prefill == rank:
            return True
        if not final:
            return False
        self.counts["pins_released"] += 1
        self._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
        return True

    def _megatron_client(self, client: _Client) -> bool:
        return self.megatron_clients and not client.coordkit

    def _tell(self, identity: bytes, frames: list[bytes]) -> None:
        client = self._loop._clients.get(identity)
        if client is not None and client.present and not self._loop._send(identity, frames):
            self._loop._client_gone(client)

    def _end(
        self, request: _Request, code: int, reason: str, safe: bool, aborted: bool = False
    ) -> None:
        """The room ends a request: its one terminal reply (a #6675 client's REQUEST_ERROR
        or, aborted, REQUEST_ABORTED; ERROR(code) for others), and what it holds goes
        (``safe`` False: its pins wait for the read, orphans)."""
        hop = self.hops.get(request.server_rid)
        if hop is not None and safe and hop.stage == _pd.DECODE:
            hop.final = True  # the decode reads nothing more: its pins go now
        # Not safe only while pins wait for a read: a safe REQUEST_ABORTED follows then.
        safe = safe or hop is None or not (hop.pins and hop.stage == _pd.DECODE and not hop.final)
        if hop is not None:
            hop.unsafe = not safe
        client = request.client
        if not self._megatron_client(client):
            self._loop._fail_request(request, ErrorCode(code), Header.SUBMIT_REQUEST)
            return
        self._loop._forget(request)
        self._loop._failed[code] += 1
        if aborted:
            frames = protocol.REQUEST_ABORTED.pack(request.client_rid, True)
        else:
            frames = protocol.REQUEST_ERROR.pack(request.client_rid, reason, safe)
        self._tell(client.identity, frames)

    def abort(self, request: _Request) -> None:
        """A client's abort: a waiting request ends at once; one at a hop is aborted there
        (its engine's answer, or a handoff, ends it)."""
        hop = self.hops[request.server_rid]
        if hop.stage in (_pd.QUEUED_PREFILL, _pd.QUEUED_DECODE):
            self._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        abort = protocol.rids_message(Header.ABORT_REQUEST, request.server_rid)
        self._send_to(request.rank, [abort])

    def time_out(self, request: _Request) -> None:
        """Past request_timeout: ERROR(TIMED_OUT) (a #6675 client's REQUEST_ERROR), ABORT at
        the hop holding it; pins at a decode wait for its read (orphans)."""
        rank = request.rank
        if rank >= 0 and not request.flags & ABORTED:
            self._send_to(rank, [protocol.rids_message(Header.ABORT_REQUEST, request.server_rid)])
        self._end(request, ErrorCode.TIMED_OUT, _pd.TIMED_OUT_TEXT, False)

    def client_release(self, client: _Client, rid: int) -> None:
        """A client's RELEASE_KV of one of its requests: its pins go, to their prefill only
        (never broadcast: no client frees another's blocks)."""
        request = client.requests.get(rid)
        hop = None if request is None else self.hops.get(request.server_rid)
        if request is not None and hop is not None and hop.pins:
            self._release_pins(request.server_rid, hop)
            return
        for server_rid, orphan in list(self.orphans.items()):
            if orphan.client_rid == rid and self._orphan_of(orphan, server_rid, client):
                self._free_orphan(server_rid)
                return
        self._loop._counters[Counter.UNKNOWN_REQUEST] += 1

    def _orphan_of(self, orphan: Orphan, server_rid: int, client: _Client) -> bool:
        return orphan.client == client.identity

    def intercepts(self, request: _Request) -> bool:
        """A single-frame reply of this request is the prefill's answer (never shown)."""
        hop = self.hops.get(request.server_rid)
        return hop is not None and hop.stage == _pd.PREFILL

    def prefilled(self, request: _Request, engine: _Engine, body: Buffer) -> None:
        """A #6675 prefill's finished request, read for its handoff (NIXL blobs put back)."""
        rid, rank = request.server_rid, engine.rank
        hop = self.hops[rid]
        try:
            record = unpackb(body)
        except ProtocolError:
            record = None
        handoff = _pd.handoff_of(record)
        if request.flags & ABORTED:
            self._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
            self._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        if isinstance(handoff, str):
            self._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
            self._end(request, ErrorCode.ENGINE_FAILED, handoff, True)
            return
        kv_meta, blocks = handoff
        registration = self.registrations.get(engine.identity)
        if registration is not None and registration.transport == "nixl":
            try:
                kv_meta = _pd.restore_nixl_blobs(kv_meta, registration.instance_meta)
            except ValueError as error:
                self._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
                self._end(
                    request,
                    ErrorCode.ENGINE_FAILED,
                    f"invalid NIXL handoff metadata: {error}",
                    True,
                )
                return
        tokens = record.get("prompt_tokens") if _pd.str_prompt(hop.prompt) else None
        self._handed(rank, rid, packb(kv_meta), packb(blocks), _pd.decode_slots(kv_meta), tokens)

    def stray_reply(self, engine: _Engine, rid: int) -> None:
        """A #6675 prefill's reply of no request of its (ended meanwhile): what it may
        have pinned for it goes."""
        seat = self.seats.get(engine.rank)
        if seat is not None and seat.megatron and seat.role & EngineRole.PREFILL:
            self._send_to(engine.rank, [protocol.rids_message(Header.RELEASE_KV, rid)])

    def from_engine(self, engine: _Engine, header: int, frames: list[zmq.Frame]) -> bool:
        """The P/D messages of an engine (False: not one)."""
        if header == Header.HANDOFF:
            self._handoff(engine, frames)
        elif header == Header.KV_TRANSFER_READY:
            self._transfer_ready(engine, frames)
        elif header == Header.KV_READ_DONE:
            self._read_done(engine, frames)
        elif header == Header.REQUEST_ERROR:
            self._request_error(engine, frames)
        elif header == Header.REQUEST_ABORTED:
            self._request_aborted(engine, frames)
        elif header == Header.REGISTER_ROLE:
            self._loop._register_role(engine.identity, engine, frames)
        else:
            return False
        return True

    def _handoff(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """A coordkit prefill's HANDOFF: each kv_meta and block-id frame goes to the
        decode as it came."""
        meta = frames[1].bytes
        try:
            entries = codec.read_handoff(meta)
        except ProtocolError as exc:
            self._loop._malformed(None, None, Header.HANDOFF, str(exc), frames)
            return
        if len(entries) != len(frames) - 2:
            self._loop._malformed(None, None, Header.HANDOFF, "bad frame layout", frames)
            return
        for (rid, offset, size), frame in zip(entries, frames[2:], strict=True):
            self._handed(engine.rank, rid, meta[offset : offset + size], frame.bytes, 0, None)

    def _hop_at(self, rid: int, rank: int) -> Hop | None:
        """The request's hop when ``rank`` is its decode (before its read), else None."""
        hop = self.hops.get(rid)
        if hop is None or hop.stage != _pd.DECODE or hop.decode != rank:
            return None
        return hop

    def _transfer_ready(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        message = self._loop._parse(protocol.KV_TRANSFER_READY, None, -1, frames)
        if message is None:
            return
        hop = self._hop_at(message.rid, engine.rank)
        if hop is None:
            self.counts["stray"] += 1
            return
        prefill = self.seats.get(hop.prefill)
        if prefill is not None and prefill.megatron and not prefill.nccl:
            request = self._loop._find(message.rid)
            assert request is not None
            self._end(request, ErrorCode.ENGINE_FAILED, _pd.UNEXPECTED_READINESS, False)
            return
        decode_meta = self.seats[engine.rank].transfer
        frame = _pd.send_kv_message(message.rid, decode_meta, message.cached_prefix_blocks)
        self._send_to(hop.prefill, [frame])

    def _read_done(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """KV_READ_DONE: a request's read, or the reads of a coordkit decode's step; the
        pins of those a coordkit prefill holds released in one RELEASE_KV per prefill."""
        try:
            _, rids = codec.read_rids(frames[1].bytes)
        except ProtocolError as exc:
            self._loop._malformed(None, None, Header.KV_READ_DONE, str(exc), frames)
            return
        if len(frames) != 2:
            self._loop._malformed(None, None, Header.KV_READ_DONE, "bad frame layout", frames)
            return
        self.releasing = {} if len(rids) > 1 else None
        try:
            for rid in rids:
                self._read_one(engine, rid)
        finally:
            releases, self.releasing = self.releasing, None
            if releases:
                self._send_releases(releases)

    def _read_one(self, engine: _Engine, rid: int) -> None:
        hop = self._hop_at(rid, engine.rank)
        if hop is not None:
            hop.stage = _pd.READ
            if hop.pins:
                self._release_pins(rid, hop)
            return
        orphan = self.orphans.get(rid)
        if orphan is not None and orphan.decode == engine.rank:
            self._free_orphan(rid)
            return
        self.counts["stray"] += 1

    def _request_error(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """An engine's REQUEST_ERROR for a request it holds: it ends with the engine's
        reason; not safe, its pins wait for the read."""
        message = self._loop._parse(protocol.REQUEST_ERROR, None, -1, frames)
        if message is None:
            return
        request = self._loop._find(message.rid)
        if request is None or request.rank != engine.rank:
            orphan = self.orphans.get(message.rid)
            if message.source_safe and orphan is not None and orphan.decode == engine.rank:
                self._free_orphan(message.rid)
            else:
                self.counts["stray"] += 1
            return
        if request.server_rid not in self.hops:  # a whole request its engine failed
            self._end(request, ErrorCode.ENGINE_FAILED, message.reason, True)
            return
        self._end(request, ErrorCode.ENGINE_FAILED, message.reason, message.source_safe)

    def _request_aborted(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        message = self._loop._parse(protocol.REQUEST_ABORTED, None, -1, frames)
        if message is None or not message.source_safe:
            return  # unsafe: a safe one follows
        request = self._loop._find(message.rid)
        if request is not None and request.rank == engine.rank:
            self._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        orphan = self.orphans.get(message.rid)
        if orphan is not None and orphan.decode == engine.rank:
            self._free_orphan(message.rid)

    # -- deaths, leases ------------------------------------------------------------------

    def engine_gone(self, engine: _Engine) -> None:
        """An engine is gone (before the loop's walk over its requests): every request of
        the room it touched goes on or ends here, orphans it held or read are freed, and
        its seat goes."""
        rank = engine.rank
        if rank not in self.seats:
            return
        name = engine.identity
        for rid in sorted(self.hops):
            hop = self.hops.get(rid)
            request = self._loop._find(rid)
            if hop is None or request is None:
                continue
            if hop.prefill == rank and hop.stage in (_pd.PREFILL, _pd.QUEUED_DECODE, _pd.DECODE):
                if hop.stage == _pd.DECODE:  # its KV is gone: the import stops
                    self._send_to(hop.decode, [protocol.rids_message(Header.ABORT_REQUEST, rid)])
                    self._release_seat(hop.decode, EngineRole.DECODE, hop.decode_work, hop.ssm)
                    hop.decode = -1  # its seat is free: not freed again if it ends here
                elif hop.stage == _pd.QUEUED_DECODE:
                    _discard(self.decode_queues[self.seats[rank].domain], rid)
                hop.pins = False
                hop.kv_meta = hop.blocks = b""
                self._again(request, hop, _pd.removed(name), prefill=True)
            elif hop.decode == rank and hop.stage == _pd.DECODE:
                self._release_seat(rank, EngineRole.DECODE, hop.decode_work, hop.ssm)
                hop.decode = -1
                self._again(request, hop, _pd.removed(name), prefill=False)
            elif hop.decode == rank and hop.stage == _pd.READ:
                if request.flags & PRODUCED:
                    self._end(request, ErrorCode.ENGINE_FAILED, _pd.removed(name), True)
                else:
                    self._release_seat(rank, EngineRole.DECODE, hop.decode_work, hop.ssm)
                    hop.stage = 0
                    self._again(request, hop, _pd.removed(name), prefill=True)
            elif hop.prefill == rank and hop.stage == _pd.READ:
                hop.prefill = -1  # the decode's import is whole: nothing to release
        for rid, orphan in list(self.orphans.items()):
            if orphan.decode == rank:
                self._free_orphan(rid)  # a dead process reads nothing more
            elif orphan.prefill == rank:
                del self.orphans[rid]
        self.unseat(rank)
        self.registrations.pop(name, None)
        self._fail_stranded()

    def _again(self, request: _Request, hop: Hop, reason: str, prefill: bool) -> None:
        """After a death or a lease: prefilled again (the prompt kept), or handed off
        again (the handoff kept, the prefill still pinning), up to ``retries`` times;
        then ended with ``reason``."""
        hop.attempts += 1
        if hop.attempts > self.retries:
            self._end(request, ErrorCode.ENGINE_FAILED, reason, True)
            return
        if prefill:
            self.counts["reprefilled"] += 1
            self._hop1(request, hop, True)
        else:
            self.counts["rehanded"] += 1
            self._hop2(request, hop, True)

    def _fail_stranded(self) -> None:
        """Requests waiting for a pool that no engine serves any more end."""
        loop = self._loop
        if self.prefill_queue and not self._live(EngineRole.PREFILL):
            for rid in list(self.prefill_queue):
                request = loop._find(rid)
                if request is not None:
                    self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("prefill"), True)
        for domain, queue in self.decode_queues.items():
            if queue and not self._live(EngineRole.DECODE, domain):
                for rid in list(queue):
                    request = loop._find(rid)
                    if request is not None:
                        self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("decode"), True)

    def tick(self, now: float) -> None:
        """Leases due (pins a read never came for), orphans' leases, and the seats synced
        (an engine back, or out of quarantine, takes hops again)."""
        loop = self._loop
        while self.leases and self.leases[0][0] <= now:
            deadline, rid = self.leases.popleft()
            hop = self.hops.get(rid)
            request = loop._find(rid)
            if hop is None or request is None or not hop.pins or hop.lease != deadline:
                continue
            self.counts["leases_expired"] += 1
            if hop.stage == _pd.DECODE:
                self._send_to(hop.decode, [protocol.rids_message(Header.ABORT_REQUEST, rid)])
                self._release_seat(hop.decode, EngineRole.DECODE, hop.decode_work, hop.ssm)
                hop.decode = -1  # its seat is free: not freed again if it ends here
            elif hop.stage == _pd.QUEUED_DECODE:
                _discard(self.decode_queues[self.seats[hop.prefill].domain], rid)
            self._release_pins(rid, hop)
            self._again(request, hop, _pd.LEASE_EXPIRED, prefill=True)
        while self.orphan_order and self.orphan_order[0][0] <= now:
            _, rid = self.orphan_order.popleft()
            if rid in self.orphans and self.orphans[rid].deadline <= now:
                self.counts["leases_expired"] += 1
                self._free_orphan(rid)
        for rank in list(self.seats):
            self.sync(rank)
        self.drain()

    def stats(self) -> dict[str, Any]:
        """What stats()["pd"] shows: the counts, each seat, the queues, pins held."""
        pinned: dict[int, int] = {}
        for hop in self.hops.values():
            if hop.pins:
                pinned[hop.prefill] = pinned.get(hop.prefill, 0) + 1
        for orphan in self.orphans.values():
            pinned[orphan.prefill] = pinned.get(orphan.prefill, 0) + 1
        return {
            "mode": self.mode,
            "threshold": self.threshold,
            "counts": dict(self.counts),
            "engines": {
                rank: {
                    "role": protocol.role_name(seat.role),
                    "megatron": seat.megatron,
                    "capacity": seat.capacity,
                    "reserved": seat.reserved,
                    "pinned": pinned.get(rank, 0),
                }
                for rank, seat in sorted(self.seats.items())
            },
            "queued": {
                "prefill": len(self.prefill_queue),
                "decode": sum(len(queue) for queue in self.decode_queues.values()),
            },
            "orphans": len(self.orphans),
        }


def _discard(queue: deque[int], rid: int) -> None:
    try:
        queue.remove(rid)
    except ValueError:
        pass


def _params_map(params: bytes) -> Any:
    try:
        return unpackb(params)
    except ProtocolError:
        return None


def _refusal(status: RouteStatus) -> ErrorCode:
    """The ErrorCode for a new request no engine took (a RouteStatus other than SENT)."""
    if status == RouteStatus.NO_ENGINES:
        return ErrorCode.NO_ENGINES
    return ErrorCode.MALFORMED if status == RouteStatus.UNSENDABLE else ErrorCode.BUSY


_REFUSAL_COUNTERS = {
    RouteStatus.NO_ENGINES: Counter.NO_ENGINES,
    RouteStatus.ALL_BUSY: Counter.BUSY,
    RouteStatus.UNSENDABLE: Counter.MALFORMED,
}


def _buffers(frames: list[zmq.Frame]) -> list[memoryview]:
    """A message's frames after the routing id, for the specs to parse."""
    return [frame.buffer for frame in frames[1:]]


class Loop:
    """The reference loop core; :class:`coordkit.Coordinator` builds and drives it."""

    implementation = "py"

    def __init__(
        self,
        options: Options,
        router: Router,
        router_socket: zmq.Socket,
        wake_socket: zmq.Socket,
        monitor_socket: zmq.Socket,
    ):
        self._router = router
        self._sock = router_socket
        self._wake = wake_socket
        self._monitor = monitor_socket
        self._options = options
        self._log = RateLimitedLog()
        self._stopping = False
        self._small_shared = 0  # kept prompts below COPY_BELOW shared, not copied
        self._mask = options.index_size - 1
        self._window = self._window_min = min(options.index_size, INDEX_WINDOW_MIN)
        # The tables.
        self._requests: dict[int, _Request] = {}  # server_rid & mask -> request
        # adopted requests whose position was held, by server id (ck_requests' side table)
        self._adopted: dict[int, _Request] = {}
        self._next_rid = options.first_server_id
        self._clients: dict[bytes, _Client] = {}
        # the clients with nothing in flight, the one idle longest first
        self._idle: OrderedDict[bytes, _Client] = OrderedDict()
        # The connections open, by fd (the monitor's ACCEPTED), and the client on each.
        self._connections: dict[int, _Client | None] = {}
        # Clients whose connection ended, (routing id, fd): dropped once what they sent
        # before it ended is handled.
        self._ended: list[tuple[bytes, int]] = []
        self._engines: list[_Engine] = []
        self._engine_by_identity: dict[bytes, _Engine] = {}
        self._roles = Roles(RETIRED_IDS)  # the identities that left the tables, and their role
        # engines not gone of each format, counted at each registration: which checks to make
        self._n_single_engines = self._n_main_engines = self._n_multipart_engines = 0
        self._gone: list[tuple[_Engine, GoneReason]] = []  # found gone, not settled yet
        self._faults = Faults(self, options)
        self._pd: PD | None = None  # made by the first engine with a P/D role (_pd_room)
        self._pr6675 = options.megatron_version == "pr6675"  # serves #6675's P/D peers
        # The connections engines registered on, by fd: a connection that ends is theirs.
        self._engine_fds: dict[int, _Engine] = {}
        self._control_state = ControlState.RUNNING
        # The megatron-core dialect: peers that are not coordkit's speak single frames.
        self._megatron_core = options.dialect == "megatron-core"
        # the prefix policy hashes the prompts of single-frame SUBMITs
        self._computes_hashes = self._megatron_core and router.policy == "prefix"
        self._epoch = options.epoch  # what it announces to rebuild peers
        self._rebuild = Rebuild(self, options)
        # the prefix policy learns from the hashes a rebuild engine reports: it is sent them
        self._forwards_hashes = router.policy == "prefix"
        # the format of an engine that only registered: its Megatron version
        self._single_format = (
            SINGLE_FRAME_MAIN if options.megatron_version == "main" else SINGLE_FRAME
        )
        # The counts.
        self._counters = [0] * len(Counter)
        self._messages = 0
        self._drained = 0  # messages received in wake-ups: the deadline is read every 256
        self._next_tick = 0.0  # when the timers run next (time.monotonic())
        self._failed = [0] * ERROR_SLOTS  # accepted requests ended with ERROR(code)
        self._refused = [0] * ERROR_SLOTS  # messages refused with ERROR(code)
        self._traffic = Traffic()
        self._latency = Latency() if options.measure_latency else None
        self._tally = Tally(options.engine_histograms)
        self._traces = None if options.tracing is None else Traces(options.tracing)
        self._deadlines = Deadlines() if options.request_timeout else None
        # The message at hand's entries bound for peers that take batches.
        self._fanout = Fanout()
        # The requests waiting for an engine with room, filed by server_rid & mask.
        self._queue = Queue(
            options.queue_limit, options.index_size, options.max_clients, options.tenant_weights
        )
        self._dispatch_due = False  # room may have freed up for them: _dispatch after the message
        self._poller = zmq.Poller()
        self._poller.register(router_socket, zmq.POLLIN)
        self._poller.register(wake_socket, zmq.POLLIN)
        self._poller.register(monitor_socket, zmq.POLLIN)
        # The engines' KV-cache events: their thread (None: none read), the index they make.
        self._kv_events = options.kv_events
        self._kv: KVIndex | None = None
        if self._kv_events is not None:
            self._kv = KVIndex(options.block_size)
            router.attach_kv(self._kv)

    # -- what the Coordinator calls ------------------------------------------------------

    def serve(self, timeout: float, deadline: float = math.inf) -> bool:
        """Handle messages and run the timers (every ``TICK``) for up to ``timeout``
        seconds; False once the loop must stop.

        ``deadline`` (a ``time.monotonic()``) is its term's: read after each wake-up,
        before anything is handled; past it, the loop stops.
        """
        until = time.monotonic() + timeout
        while not self._stopping:
            now = time.monotonic()
            if now >= until:
                return True
            # Rounded up: rounded down, the last millisecond before the deadline would
            # return at once, again and again, handling nothing until it passed.
            ready = dict(self._poller.poll(math.ceil((min(until, self._next_tick) - now) * 1000)))
            now = time.monotonic()
            if self._latency is not None:
                self._latency.since = now
            if now >= deadline:
                self._stopping = True
                break
            if now >= self._next_tick:
                self._next_tick = now + TICK
                self._tick(now)
            if self._monitor in ready:
                self._connection_events()
            if self._wake in ready and self._woken():
                self._stopping = True
            elif self._sock in ready:
                self._drain(deadline)
            while self._ended and not self._stopping:
                self._drain(deadline)  # what they sent before their connections ended goes first
                self._drop_ended()
                if self._traces is not None and self._traces.ending:
                    self._traces.end()
        return False

    def _woken(self) -> bool:
        """Whether stop() wrote to the wake socket (an empty frame); the KV events'
        thread writes a byte there when it has records waiting: they are applied."""
        woken = False
        while True:
            try:
                frame = self._wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                return woken
            if frame:
                assert self._kv is not None and self._kv_events is not None
                self._kv.take(self._kv_events, self._router)
            else:
                woken = True

    def _tick(self, now: float) -> None:
        """The timers: engines whose drain or heartbeat timed out declared gone (an
        engine that heartbeats and stops is dead, whatever the grace), the grace and
        the quarantines that are over, the requests in flight longer than
        request_timeout ended, the rebuild window closed, HANDLED to rebuild engines,
        and what that left settled."""
        timeout = self._options.heartbeat_timeout
        for engine in self._engines:
            if engine.state == GONE:
                continue
            if engine.state == DRAINING:
                if now >= engine.drain_deadline:
                    self._mark_gone(engine, GoneReason.DRAIN_TIMED_OUT)
            elif timeout and engine.heartbeats and now - engine.last_heartbeat > timeout:
                self._mark_gone(engine, GoneReason.NO_HEARTBEAT)
        self._faults.tick(now)
        if self._pd is not None:
            self._pd.tick(now)
        # The oldest first: only the requests that are due are touched.
        deadline = now - self._options.request_timeout
        while self._deadlines is not None and (oldest := self._deadlines.oldest) is not None:
            if oldest.submitted >= deadline:
                break
            self._time_out(oldest)
        while self._queue.depth and (handle := self._queue.expired(now)) >= 0:
            self._counters[Counter.TIMED_OUT] += 1  # its own deadline, while it waited
            self._fail_request(self._requests[handle], ErrorCode.TIMED_OUT, Header.SUBMIT_REQUEST)
        if self._rebuild.rebuilding and now >= self._rebuild.until:
            self._rebuild.end_window()
        if self._rebuild.deferred and (self._router.n_accepting or not self._rebuild.rebuilding):
            self._rebuild.resend_deferred()
        if self._rebuild.away:
            self._rebuild.end_holds(now)
        self._rebuild.acknowledge()
        self._settle()
        if self._dispatch_due or self._queue.depth:  # an engine back from quarantine, ...
            self._dispatch()
        if self._traces is not None and self._traces.ending:
            self._traces.end()

    def shutdown(self) -> None:
        """End every request still in flight with ERROR(SHUTTING_DOWN): its terminal reply."""
        for request in self._in_order(lambda r: True):
            if self._find(request.server_rid) is request:
                self._unqueue(request, QueueOutcome.REFUSED)
                self._fail_request(request, ErrorCode.SHUTTING_DOWN, Header.SHUTDOWN)
        self._settle()
        if self._traces is not None and self._traces.ending:
            self._traces.end()

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        measured = self._latency is not None
        stats = stats_map(
            implementation=self.implementation,
            policy=self._router.policy,
            epoch=self._epoch,
            messages=self._messages,
            inflight=self._live,
            clients=len(self._clients)
            - sum(not self._clients[i].present for i in self._rebuild.away),
            control_state=self._control_state,
            counters=list(self._counters),
            engines=[
                (
                    e.rank,
                    e.identity,
                    e.state,
                    self._router.pending(e.rank),
                    max(e.quarantined_until - now, 0.0),
                    e.failures,
                    e.last_failure,
                    *self._tally.engine(e.rank, measured),
                    now - e.last_heartbeat if e.heartbeats else None,
                )
                for e in list(self._engines)
            ],
            queue=self._queue.stats(),
            busiest_clients=busiest(
                [
                    (
                        c.identity,
                        len(c.requests),
                        self._tally.submitted.get(c, 0) if measured else None,
                        c.rebuild,
                        not c.present,
                    )
                    for c in list(self._clients.values())
                ]
            ),
        )
        if self._pd is not None:
            stats["pd"] = self._pd.stats()
        if self._kv is not None and self._kv_events is not None:
            stats["kv_events"] = kv_stats(self._kv.stats(), self._kv_events.stats())
        return stats

    def metrics(self) -> dict[str, Any]:
        """Traffic by header and direction, outcomes by error code, latencies."""
        return metrics_map(
            traffic=self._traffic.metrics(),
            failed=list(self._failed),
            refused=list(self._refused),
            latency=None if self._latency is None else self._latency.metrics(),
            prefix=self._router.prefix_counts,
            queue=self._queue.metrics(),
            engine_latency=None if self._tally.final is None else self._tally.latency(),
        )

    # -- the hot path --------------------------------------------------------------------

    def _drain(self, deadline: float) -> None:
        """Handle every message waiting, one at a time; the term's ``deadline`` is read
        again every 256 (a freeze in a long burst)."""
        receive = self._sock.recv_multipart
        while not self._stopping:
            try:
                frames = receive(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._drained += 1
            if not self._drained & 255 and time.monotonic() >= deadline:
                self._stopping = True
                return
            self._messages += 1
            self._handle(frames)
            if self._gone:
                self._settle()
            if self._dispatch_due:
                self._dispatch()
            if self._traces is not None and self._traces.ending:  # what it ended was sent
                self._traces.end()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """Dispatch a message (frame 0 is the sender's routing id)."""
        identity = frames[0].bytes
        engine = self._engine_by_identity.get(identity)
        if len(frames) == 2 and len(frames[1]) == 0:
            self._register(identity, engine, _source_fd(frames[1]))
            return
        client = self._clients.get(identity)
        try:
            if len(frames) > MAX_PARTS:
                raise ProtocolError(f"more than {MAX_PARTS} frames")
            header = codec.read_header(frames[1].buffer)[0]
        except ProtocolError as exc:
            self._traffic.count(RECEIVED, -1, message_bytes(frames))
            self._malformed(client, None, -1, str(exc), frames)
            return
        self._traffic.count(RECEIVED, header, message_bytes(frames))
        if engine is not None:
            self._from_engine(engine, header, frames)
            if self._latency is not None:
                self._latency.handled(STAGE_REPLY, header)
        elif header == Header.CONNECT:
            self._connect(identity, client, frames)
        elif header == Header.ENGINE_HELLO and client is None:
            self._engine_hello(identity, None, frames)
        elif header == Header.REGISTER_ROLE and client is None:
            self._register_role(identity, None, frames)
        elif client is None or not client.present:
            # A client known only from an engine's report, or away after a blip: what
            # its socket queued before it lost us comes ahead of its CONNECT, stale
            # (its REJOIN names the requests; acting on them could run one twice).
            self._counters[Counter.NOT_CONNECTED] += 1
            self._log.warn(
                "not_connected", f"dropped {header_name(header)} from a peer that is not connected"
            )
        else:
            self._seen(client)
            if client.fresh and header != Header.REJOIN:
                self._rebuild.rejoins_nothing(client)
            self._from_client(client, header, frames)
            if self._latency is not None:
                self._latency.handled(STAGE_REQUEST, header)

    def _from_client(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        if header == Header.SUBMIT_REQUEST or header == Header.SUBMIT_REQUEST_WITH_KV:
            if single_frame(client.format):
                self._submit_single(client, header, frames)
            else:
                self._submit(client, header, frames)
        elif header == Header.SUBMIT_BATCH:
            self._submit_batch(client, frames)
        else:
            self._from_client_rarely(client, header, frames)

    def _submit(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        """A new request in frames: metadata, payload, and maybe its block hashes."""
        meta = frames[1].buffer
        try:
            _, length, rid, offset = codec.read_submit(meta)
        except ProtocolError as exc:
            self._malformed(client, exc.rid, header, str(exc), frames)
            return
        n_payload = 1 if header == Header.SUBMIT_REQUEST else 2
        n_frames = len(frames) - 2
        hashes = frames[2 + n_payload] if n_frames == n_payload + 1 else None
        priority = deadline_ms = 0
        if length != 2 + n_payload:  # QoS, from a client granted it, or a bad layout
            if length != 4 + n_payload or not client.qos:
                self._malformed(client, rid, header, "bad frame layout", frames)
                return
            try:  # the QoS fields come off here: the params span starts after them
                priority, deadline_ms, offset = codec.read_qos(meta, offset)
            except ProtocolError as exc:
                self._malformed(client, rid, header, str(exc), frames)
                return
        if not n_payload <= n_frames <= n_payload + 1 or (
            hashes is not None and len(hashes) % BLOCK_HASH_SIZE
        ):
            self._malformed(client, rid, header, "bad frame layout", frames)
            return
        inbound = multipart_inbound(header, frames[2 : 2 + n_payload], meta[offset:], hashes)
        inbound.priority, inbound.deadline_ms = priority, deadline_ms
        self._accept(client, rid, inbound)

    def _submit_single(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        """A new request in one frame (Megatron-Core): [20, client_rid, prompt, params],
        0.19's, with multi_modal_data last, main's, or main's KV submission [24, ...].

        Read as far as its request id: to an engine of its own layout the rest goes as
        it came. The fields are found (walking the prompt) only when another engine may
        take it (single_walks), or the prefix policy hashes the prompt. A client that
        sends main's layouts is main's, and is sent main's partial replies.
        """
        data = frames[1].buffer
        hashes = self._computes_hashes and header == Header.SUBMIT_REQUEST
        try:
            _, rid, length, prompt = codec.read_single_head(data)
            params = extra = 0
            if len(frames) != 2 or not single_layout(header, length):
                raise ProtocolError("bad frame layout", rid)
            if length > 4:
                client.format = SINGLE_FRAME_MAIN
            if hashes or single_walks(length, self._n_multipart_engines, self._n_single_engines):
                *_, params, extra = codec.read_single_submit(data)
        except ProtocolError as exc:
            self._malformed(client, exc.rid, header, str(exc), frames)
            return
        inbound = single_inbound(data, header, length, prompt, params, extra)
        inbound.payload = [frames[1]]  # kept whole
        if hashes and text_only(inbound):  # main's: no prefix affinity for multimodal data
            try:
                inbound.hashes = codec.prompt_hashes(inbound.prompt, self._options.block_size)
            except ProtocolError:  # no token ids (a str prompt): routed by load
                pass
        self._accept(client, rid, inbound)

    def _submit_batch(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """SUBMIT_BATCH: each entry down the path of a SUBMIT_REQUEST; the entries
        routed to batched engines leave as one ENGINE_SUBMIT_BATCH per engine once
        every entry is routed (see _send_batches)."""
        header = Header.SUBMIT_BATCH
        if not client.batch:
            self._malformed(client, None, header, "batches not granted", frames)
            return
        meta = frames[1].buffer
        try:
            entries = codec.read_submit_batch(meta, codec.QOS_WIDTH if client.qos else 3)
        except ProtocolError as exc:
            self._malformed_batch(client, exc.rids, str(exc), frames)
            return
        if sum(1 + entry[3] for entry in entries) != len(frames) - 2:
            self._malformed_batch(client, [rid for rid, *_ in entries], "bad frame layout", frames)
            return
        part = 2
        for rid, offset, size, hashed, *qos in entries:
            if self._clients.get(client.identity) is not client:
                break  # found gone meanwhile
            hashes = frames[part + 1] if hashed else None
            if hashes is not None and len(hashes) % BLOCK_HASH_SIZE:
                self._malformed(client, rid, header, "bad frame layout", frames)
            else:
                params = meta[offset : offset + size]
                inbound = multipart_inbound(Header.SUBMIT_REQUEST, [frames[part]], params, hashes)
                inbound.batched = True
                if qos:
                    inbound.priority, inbound.deadline_ms = qos
                self._accept(client, rid, inbound)
            part += 1 + hashed
        self._send_batches(header)

    def _accept(self, client: _Client, rid: int, inbound: Inbound) -> None:
        """A request that parsed: refused (a duplicate id, a full table), or given a
        server id and an engine, and the frames on to it; it waits in the queue while
        others do (it overtakes none), or when no engine has room."""
        header = inbound.header
        if rid in client.requests:
            self._refuse(
                client, rid, ErrorCode.DUPLICATE_REQUEST, header, Counter.DUPLICATE_REQUEST
            )
            return
        if self._live >= self._options.max_inflight:
            self._refuse(client, rid, ErrorCode.BUSY, header, Counter.BUSY)
            return
        request = self._add(client, rid)
        self._admit(request)
        if self._traces is not None:
            self._traces.accept(request, inbound)
        request.priority = inbound.priority
        if inbound.deadline_ms:
            request.deadline = time.monotonic() + inbound.deadline_ms / 1000
        if self._queue.depth:  # others wait: it overtakes none
            status = RouteStatus.ALL_BUSY
        else:
            status = self._send_new(request, inbound)
            if status == RouteStatus.SENT:
                self._counters[Counter.SUBMITTED] += 1
                return
            if status == RouteStatus.ENGINE_GONE:
                return
        if status == RouteStatus.ALL_BUSY and self._queue.limit:
            self._forget_kept(request)  # kept again at its dispatch
            if self._queued(request, inbound):
                return
        deferred = status == RouteStatus.NO_ENGINES and self._rebuild.rebuilding and client.rejoined
        if self._traces is not None:
            if deferred:
                self._traces.drop(request)
            else:
                self._traces.fail(request, _refusal(status))
        self._forget(request)
        if deferred:
            # Back after a loss, before its engines registered again: sent back once
            # one has (RESEND), not refused.
            self._rebuild.defer(client, rid)
            return
        self._refuse(client, rid, _refusal(status), header, _REFUSAL_COUNTERS[status], True)

    def _send_new(self, request: _Request, inbound: Inbound) -> RouteStatus:
        """A new request (or one that waited) out to an engine: its metadata with its
        server id, what re-sends it kept, and routed; a RouteStatus. An engine found
        gone on the way is settled first, and the request routed again; ENGINE_GONE:
        its client went away meanwhile, the request is forgotten."""
        header = inbound.header
        if not inbound.single:
            inbound.meta = rewrite_meta(inbound, request.server_rid)
        if self._pd is not None and self._pd.takes(request, inbound):  # both hops: the room's
            return RouteStatus.SENT
        # A KV submission's source blocks are tied to the engine chosen now: never re-sent.
        # What is kept re-sends it, or moves it on with what it streamed, when its
        # engine dies (a rebuild client's too: after the coordinator's loss, it is the
        # client that sends it again, RESEND).
        if header != Header.SUBMIT_REQUEST:
            request.flags |= PINNED
        elif self._options.keep_prompts:
            meta = None if inbound.single else inbound.meta
            request.kept = keep(meta, inbound.payload[0], inbound.single, self._small_shared)
            self._small_shared += request.kept.small
            request.streamed = []  # it may go on elsewhere from the tokens it streams
        carriers(inbound, self._n_single_engines + self._n_main_engines > 0)
        status = self._route(request, inbound)
        while status == RouteStatus.ENGINE_GONE:
            # The gone engine's requests are older than this one: they go first.
            self._settle()
            if self._find(request.server_rid) is not request:  # its client went away meanwhile
                return RouteStatus.ENGINE_GONE
            status = self._route(request, inbound)
        return status

    def _forget_kept(self, request: _Request) -> None:
        """What a request kept, to re-send it, given up (it waits: kept again when sent)."""
        if request.kept is not None:
            self._small_shared -= request.kept.small
            request.kept = None
            request.streamed = None

    def _queued(self, request: _Request, inbound: Inbound | None, head: bool = False) -> bool:
        """``request`` waits in the queue till an engine has room (_dispatch): last in
        its flow, or first (``head``: its engine died before it produced anything; it is
        sent from what it kept); False when the queue is full."""
        handle = request.server_rid & self._mask
        tenant = max(request.client.tenant, 0)  # a client never connected: tenant 0's
        now = time.monotonic()
        if not self._queue.push(
            handle, tenant, request.priority, now, request.deadline, head, inbound
        ):
            return False
        self._counters[Counter.QUEUED] += 1
        return True

    def _route(self, request: _Request, inbound: Inbound) -> RouteStatus:
        """Send a request to the engine chosen for it, in its format; an entry of a
        SUBMIT_BATCH bound for a batched engine joins that engine's batch."""
        rank, status = self._pick_engine(inbound)
        if status != RouteStatus.SENT:
            return status
        request.rank = rank
        request.work = self._router.charged
        engine = self._engines[rank]
        trailer = []
        if engine.rebuild:
            client = request.client
            hashes = inbound.hash_frame if self._forwards_hashes else None
            client_id = client.identity if client.rebuild else None
            trailer = trailer_frames(request.client_rid, client_id, hashes)
        if inbound.batched and engine.batch:
            assert inbound.params is not None
            frames = [inbound.payload[0], *trailer]
            self._fanout.add(engine, request.server_rid, inbound.params, frames)
        else:
            size = send_request(self._sock, inbound, request.server_rid, engine.format, trailer)
            self._traffic.count(SENT, inbound.header, size)
        if self._latency is not None:
            self._tally.engines[rank].routed += 1
        if self._traces is not None:
            self._traces.routed(request, engine)
        return status

    def _pick_engine(self, inbound: Inbound) -> tuple[int, RouteStatus]:
        """The router's choice, its routing id sent (the request's frames follow),
        unless the request is ``batched`` and the engine takes batches (the batch is
        sent later). An unreachable choice is marked gone: ENGINE_GONE; one whose
        format cannot carry the request: UNSENDABLE."""
        now = time.monotonic()
        rank = self._router.choose(inbound.hashes, now, inbound.tokens)
        if self._latency is not None:
            self._latency.decided(now)
        if rank < 0:
            if self._router.n_accepting == 0:
                return rank, RouteStatus.NO_ENGINES
            return rank, RouteStatus.ALL_BUSY
        engine = self._engines[rank]
        if not carries(inbound, engine.format):
            self._router.release(rank, self._router.charged)
            return rank, RouteStatus.UNSENDABLE
        if (inbound.batched and engine.batch) or self._send_identity(engine.identity):
            return rank, RouteStatus.SENT
        self._router.release(rank, self._router.charged)
        self._faults.lost(engine, GoneReason.UNREACHABLE)
        return rank, RouteStatus.ENGINE_GONE

    def _send_batches(self, header: int) -> None:
        """The fan-out's entries: one batch per peer (ENGINE_SUBMIT_BATCH to each
        batched engine, REPLY_BATCH to each batched client), in the order the peers
        were first chosen. An entry for an engine that was re-sent or ended meanwhile
        is left out; an engine found gone here leaves its requests to _settle, as any
        engine found gone, and a client that cannot be reached is gone."""
        fanout = self._fanout
        to_engines = header == Header.SUBMIT_BATCH
        if to_engines:
            fanout.entries = [
                (to, rid, tail, frame)
                for to, rid, tail, frame in fanout.entries
                if (request := self._find(rid)) is not None and request.rank == to.rank
            ]
        for to, entries in fanout.by_peer().items():
            if to_engines and to.state == GONE:
                pass  # its requests are settled
            elif self._send_identity(to.identity):
                self._traffic.count(SENT, header, Fanout.send(self._sock, header, entries))
            elif to_engines:
                self._faults.lost(to, GoneReason.UNREACHABLE)
            else:
                self._client_gone(to)

    def _from_engine(self, engine: _Engine, header: int, frames: list[zmq.Frame]) -> None:
        if engine.state == AWAY and header != Header.ENGINE_HELLO:  # back on a new connection
            self._faults.back(engine, _source_fd(frames[1]))
        if header == Header.ENGINE_REPLY or (
            header == Header.ENGINE_REPLY_PARTIAL and engine.format != SINGLE_FRAME
        ):
            if single_frame(engine.format):
                self._forward_single_replies(engine, frames)
            else:
                engine.handled += 1
                self._forward_replies(engine, frames)
        else:
            self._from_engine_rarely(engine, header, frames)

    def _forward_replies(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """Each entry of an engine's batch to its request's client, the body as itself;
        those bound for batched clients leave as one REPLY_BATCH per client. A final to
        a client with a hold is forgotten only once sent: one whose client is found
        gone by its send waits, with the client's other requests, for its REJOIN."""
        try:
            header, entries = codec.read_reply(frames[1].buffer)
        except ProtocolError as exc:
            self._malformed(None, None, -1, str(exc), frames)
            return
        bodies = frames[2:]
        if len(entries) != len(bodies):
            detail = f"{len(entries)} entries but {len(bodies)} payload frames"
            self._malformed(None, None, header, detail, frames)
            return
        final = header == Header.ENGINE_REPLY
        now = time.monotonic() if self._latency is not None else 0.0
        deferred = 0  # finals to clients with a hold, forgotten once sent (_sent_finals)
        for entry, body in zip(entries, bodies, strict=True):
            if entry is None:
                self._reject_entry(engine, None, ErrorCode.MALFORMED, header)
                continue
            server_rid, needs_detokenize = entry
            request = self._find(server_rid)
            if request is None or request.rank != engine.rank:
                # A late reply (its request ended: aborted, timed out, its client
                # gone), or a reply the engine got wrong.
                self._counters[Counter.UNKNOWN_REQUEST] += 1
                self._tally.engines[engine.rank].unknown_request += 1
                if engine.coordkit:
                    self._reject_entry(engine, server_rid, ErrorCode.UNKNOWN_REQUEST, header)
                continue
            if request.flags & REPLAYING:
                continue  # the engine's REPLAYED brings it again, in its place
            out: Any = self._continued(request, body.buffer, final) or body
            if final and request.client.hold > 0:
                deferred += 1
            else:
                self._finish(request, final, now)
            if needs_detokenize and self._options.detokenizer is not None:
                out = self._detokenized(out.buffer if isinstance(out, zmq.Frame) else out)
            if request.client.batch:
                self._fanout.add(request.client, request.client_rid, MSGPACK_BOOLS[final], [out])
            elif not self._deliver(request.client, header, request.client_rid, out):
                self._client_gone(request.client)
        self._send_batches(Header.REPLY_BATCH)
        if deferred:
            self._sent_finals(engine, entries, now)

    def _sent_finals(self, engine: _Engine, entries: list[Any], now: float) -> None:
        """The finals to clients with a hold, sent: forgotten now, but those whose client
        went away meanwhile (REPLAYING since: its REJOIN replays them)."""
        for entry in entries:
            request = None if entry is None else self._find(entry[0])
            if (
                request is not None
                and request.rank == engine.rank
                and request.client.hold > 0
                and not request.flags & REPLAYING
            ):
                self._finish(request, True, now)

    def _forward_single_replies(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """A Megatron engine's finished requests (or main's partial replies), each map to
        its request's client; those bound for batched clients leave as one REPLY_BATCH
        per client."""
        data = frames[1].buffer
        try:
            if len(frames) != 2:
                raise ProtocolError("bad frame layout")
            header, entries = codec.read_single_reply(data)
        except ProtocolError as exc:
            self._malformed(None, None, Header.ENGINE_REPLY, str(exc), frames)
            return
        final = header == Header.ENGINE_REPLY
        now = time.monotonic() if self._latency is not None else 0.0
        for start, end, server_rid, error in entries:
            if error is not None:
                self._reject_entry(engine, None, ErrorCode.MALFORMED, header)
                continue
            assert server_rid is not None  # read whenever there is no error
            request = self._find(server_rid)
            if request is None or request.rank != engine.rank:
                self._counters[Counter.UNKNOWN_REQUEST] += 1
                self._tally.engines[engine.rank].unknown_request += 1
                if self._pd is not None:
                    self._pd.stray_reply(engine, server_rid)
                continue
            if self._pd is not None and self._pd.intercepts(request):  # hop 1's answer
                self._pd.prefilled(request, engine, data[start:end])
                continue
            body: Buffer = self._continued(request, data[start:end], final) or data[start:end]
            self._finish(request, final, now)
            if final and self._options.detokenizer is not None:  # as Megatron's: every final
                body = self._detokenized(body)
            if request.client.batch:
                self._fanout.add(request.client, request.client_rid, MSGPACK_BOOLS[final], [body])
            elif not self._deliver(request.client, header, request.client_rid, body):
                self._client_gone(request.client)
        self._send_batches(Header.REPLY_BATCH)

    def _continued(self, request: _Request, body: Buffer, final: bool) -> bytes | None:
        """A reply's body, before it is delivered: a partial's tokens kept while the
        request may have to go on elsewhere (Faults.streamed), and the body of a request
        that went on at another engine continuing its stream (None: as it came)."""
        if not final and request.streamed is not None:
            self._faults.streamed(request, body)
        if request.flags & MIGRATED:
            return self._faults.continued(request, body)
        return None

    def _finish(self, request: _Request, final: bool, now: float) -> None:
        """A reply for ``request`` arrived: timed, counted, and a final forgets it."""
        if self._latency is not None:
            self._latency.observe(now - request.submitted, not request.flags & PRODUCED, final)
            self._tally.replied(
                request.rank, now - request.submitted, not request.flags & PRODUCED, final
            )
        if self._traces is not None:
            self._traces.replied(request, final, now)
        if final:
            if self._pd is not None and request.server_rid in self._pd.hops:
                self._pd.finished(request)
            self._forget(request)
            self._counters[Counter.REPLIES] += 1
        else:
            request.flags |= PRODUCED
            self._counters[Counter.PARTIALS] += 1

    def _deliver(self, client: _Client, header: int, client_rid: int, body: Any) -> bool:
        """One reply to its client in the client's format (reply_carried, send_reply);
        False when the client is gone."""
        carried = reply_carried(client.format, header, body)
        if carried != CARRIED:
            if carried == NOT_A_MAP:
                self._counters[Counter.MALFORMED_ENTRIES] += 1
            return True
        if not self._send_identity(client.identity):
            return False
        size = send_reply(self._sock, client.format, header, client_rid, body)
        self._traffic.count(SENT, header, size)
        return True

    def _admit(self, request: _Request) -> None:
        """A request that joins the tables: listed at its client, timed."""
        client = request.client
        if not client.requests:
            del self._idle[client.identity]
        client.requests[request.client_rid] = request
        if self._deadlines is not None or self._latency is not None:  # timed, counted at its client
            request.submitted = time.monotonic()
            self._tally.submitted[client] = self._tally.submitted.get(client, 0) + 1
        if self._deadlines is not None:
            self._deadlines.push(request)

    @property
    def _live(self) -> int:
        return len(self._requests) + len(self._adopted)

    def _add(self, client: _Client, client_rid: int) -> _Request:
        """A new request: the next server id whose position is free, drawn below
        the window while few requests are in flight (as ck_requests_add does)."""
        rid, mask, live = self._next_rid, self._mask, self._live
        if rid & mask >= self._window:  # the window's end: a new lap
            rid = (rid | mask) + 1
            while self._window > self._window_min and 4 * live < self._window:
                self._window //= 2
        while 2 * (live + 1) > self._window and self._window <= mask:
            self._window *= 2
        while (rid & mask) in self._requests:
            rid += 1
        self._next_rid = rid + 1
        request = _Request(rid, client, client_rid)
        self._requests[rid & self._mask] = request
        return request

    def _adopt(self, client: _Client, client_rid: int, server_rid: int) -> _Request:
        """A request an engine holds from an earlier life, under its server id (no
        request in flight has it: see _claimable): filed by position when that is free,
        else apart; server ids drawn later are above it (as ck_requests_adopt does)."""
        request = _Request(server_rid, client, client_rid)
        if server_rid & self._mask in self._requests:
            self._adopted[server_rid] = request
        else:
            self._requests[server_rid & self._mask] = request
        self._next_rid = max(self._next_rid, server_rid + 1)
        return request

    def _remove(self, request: _Request) -> None:
        position = request.server_rid & self._mask
        if self._requests.get(position) is request:
            del self._requests[position]
        else:
            del self._adopted[request.server_rid]

    def _find(self, server_rid: int) -> _Request | None:
        request = self._requests.get(server_rid & self._mask)
        if request is not None and request.server_rid == server_rid:
            return request
        return self._adopted.get(server_rid) if self._adopted else None

    def _forget(self, request: _Request) -> None:
        """Take a request out of every table and count; a draining engine whose
        last request this was is gone."""
        self._unqueue(request, QueueOutcome.ABANDONED)
        if self._pd is not None and request.server_rid in self._pd.hops:
            self._pd.forget(request)  # what its hops hold; its rank -1 after
        if self._traces is not None:
            self._traces.forget(request)
        client = request.client
        del client.requests[request.client_rid]
        if not client.requests:
            self._idle[client.identity] = client
        if self._deadlines is not None:
            self._deadlines.remove(request)
        self._remove(request)
        if request.flags & MIGRATED:
            del self._faults.migrated[request.server_rid]
        if request.kept is not None:
            self._small_shared -= request.kept.small
        if request.rank < 0:
            return
        self._router.release(request.rank, request.work)
        engine = self._engines[request.rank]
        if engine.state == DRAINING and self._router.pending(engine.rank) == 0:
            engine.state = GONE
        if self._queue.depth:  # its room is another's
            self._dispatch_due = True

    def _unqueue(self, request: _Request, outcome: QueueOutcome) -> None:
        """A request that waits leaves the queue, not dispatched (``outcome``)."""
        handle = request.server_rid & self._mask
        if request.rank < 0 and self._queue.depth and self._queue.holds(handle):
            self._queue.remove(handle, time.monotonic(), outcome)

    def _dispatch(self) -> None:
        """The requests waiting, in the queue's order, to the engines with room now; the
        entries for batched engines leave as one ENGINE_SUBMIT_BATCH each, once all
        are routed (an engine that starts a step on the first arrival is not handed one
        request ahead of the rest). With no engine left, they end NO_ENGINES."""
        self._dispatch_due = False
        queue = self._queue
        while queue.depth and self._router.has_room:
            handle = queue.peek()
            inbound = queue.inbound(handle)
            queue.pop(time.monotonic())
            request = self._requests[handle]
            if inbound is None:  # re-queued when its engine died: sent from what it kept
                status, counter = self._resend(request), Counter.REROUTED
                code = ErrorCode.ENGINE_FAILED  # no engine left that speaks its format
            else:
                # A whole multipart request joins its engine's batch.
                inbound.batched = not inbound.single and inbound.header == Header.SUBMIT_REQUEST
                status, counter = self._send_new(request, inbound), Counter.SUBMITTED
                code = ErrorCode.MALFORMED
            if status == RouteStatus.SENT:
                self._counters[counter] += 1
            elif status != RouteStatus.ENGINE_GONE:  # ENGINE_GONE: its client went away
                failed = code if status == RouteStatus.UNSENDABLE else _refusal(status)
                self._fail_request(request, failed, Header.SUBMIT_REQUEST)
        self._send_batches(Header.SUBMIT_BATCH)
        if queue.depth and not self._router.n_accepting:
            mask = self._mask
            for request in self._in_order(
                lambda r: r.rank < 0 and queue.holds(r.server_rid & mask)
            ):
                if self._find(request.server_rid) is request:
                    self._unqueue(request, QueueOutcome.REFUSED)
                    self._fail_request(request, ErrorCode.NO_ENGINES, Header.SUBMIT_REQUEST)

    def _seen(self, client: _Client) -> None:
        """A message from ``client``: with nothing in flight, it is the idle one seen last."""
        if not client.requests:
            self._idle.move_to_end(client.identity)

    def _mark_gone(self, engine: _Engine, reason: GoneReason) -> None:
        """Take an engine out of the pool now; its requests are settled after the
        message at hand (see _settle), so a failure never recurses into routing."""
        if engine.state == GONE:
            return
        if engine.state != AWAY:  # counted when it went away
            self._faults.strike(engine, reason, time.monotonic())
        if engine.state == ALIVE:
            self._router.remove_rank(engine.rank)
        engine.state = GONE
        self._counters[Counter.ENGINE_FAILURES] += 1
        self._tally.engines[engine.rank].gone += 1
        self._gone.append((engine, reason))

    def _send_identity(self, identity: bytes) -> bool:
        """Start a message to a peer; False when it is gone (ROUTER_MANDATORY)."""
        try:
            self._sock.send(identity, zmq.SNDMORE)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    # -- rare paths ----------------------------------------------------------------------

    def _from_client_rarely(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        if header == Header.ABORT_REQUEST:
            self._abort(client, frames)
        elif header == Header.RELEASE_KV:
            self._release_kv(client, frames)
        elif header in CONTROL_HEADERS:
            self._control(client, header, frames)
        elif header == Header.SHUTDOWN:
            self._shutdown_signal(client, frames)
        elif header == Header.STATS:
            self._stats_request(client, frames)
        elif header == Header.REJOIN and client.rebuild:
            self._rebuild.rejoin(client, frames)
        elif header == Header.DISCONNECT:
            self._goodbye(client, frames)
        else:
            self._refuse(client, None, ErrorCode.UNKNOWN_HEADER, header, Counter.UNKNOWN_HEADER)

    def _from_engine_rarely(self, engine: _Engine, header: int, frames: list[zmq.Frame]) -> None:
        if header == Header.HEARTBEAT:
            self._heartbeat(engine, frames)
        elif header == Header.ENGINE_HELLO:
            self._engine_hello(engine.identity, engine, frames)
        elif header == Header.DISCONNECT:
            self._disconnect(engine, frames)
        elif header == Header.HELD and engine.rebuild:
            self._rebuild.held(engine, frames)
        elif header == Header.REPLAYED and engine.rebuild:
            engine.handled += 1
            self._rebuild.replayed(engine, frames)
        elif header == Header.REGISTER_ROLE:
            self._register_role(engine.identity, engine, frames)
        elif self._pd is not None and self._pd.from_engine(engine, header, frames):
            pass
        else:
            self._counters[Counter.UNKNOWN_HEADER] += 1
            self._log.warn(
                "unknown_header", unknown_from_engine(header, engine.rank, engine.format)
            )

    def _register(self, identity: bytes, engine: _Engine | None, fd: int) -> None:
        """An engine announced itself (one empty frame) on connection ``fd``: a new rank,
        or one coming back after it left or was declared gone. Under an identity alive,
        it is a repeat on the same connection, or, on another, a new process (Megatron's
        engines register once, at their start) -- unless a hello named its process: then
        the hello that follows says which."""
        if engine is None or engine.state in (GONE, DRAINING):
            self._new_engine(identity, engine, fd)
        elif fd == engine.fd or engine.session:
            self._counters[Counter.DUPLICATE_REGISTER] += 1
        else:
            self._restarted(engine, fd)

    def _engine_hello(self, identity: bytes, engine: _Engine | None, frames: list[Any]) -> None:
        """ENGINE_HELLO: a coordkit engine registers, or says so once registered; a
        hello naming another process than the one registered under its identity is a
        new process (the old one's requests are handled as its death)."""
        try:
            hello = parse_engine_hello(_buffers(frames))
        except ProtocolError as exc:
            self._malformed(None, None, Header.ENGINE_HELLO, str(exc), frames)
            return
        fd = _source_fd(frames[1])
        if engine is None or engine.state in (GONE, DRAINING):
            engine = self._new_engine(identity, engine, fd)
        elif engine.session and hello.session != engine.session:
            self._restarted(engine, fd)
        elif engine.state == AWAY or fd != engine.fd:  # the same process, a new connection
            self._faults.back(engine, fd)
        if engine is not None:
            engine.session = hello.session
            engine.coordkit = hello.coordkit
            engine.batch = hello.batch
            engine.format = MULTIPART
            # Its reply messages are numbered anew from its base: a registration each time.
            engine.rebuild, engine.base = hello.rebuild, hello.base
            engine.handled = engine.mark = engine.acked = 0
            self._router.set_capacity(engine.rank, hello.capacity)
            self._dispatch_due = True
            self._count_formats()
            if hello.role:
                pd = self._pd_room()
                pd.seat(
                    engine, hello.role, False, hello.domain, hello.capacity
                ).transfer = hello.transfer
            elif self._pd is not None and engine.rank in self._pd.seats:
                self._pd.unseat(engine.rank)
                self._faults.admit(engine)
            if self._kv_events is not None:  # its publisher, or none (its predecessor's go)
                if hello.kv_events is None:
                    self._kv_events.unannounce(engine.rank)
                else:
                    self._kv_events.add(
                        engine.rank, hello.kv_events, hello.kv_events_replay, announced=True
                    )
            if hello.ack or hello.rebuild:  # it is in the pool: say so, and what it was granted
                self._send(identity, protocol.engine_ack(hello, self._epoch, roles=True))
            if self._pd is not None:
                self._pd.drain()

    def _pd_room(self) -> PD:
        """The P/D room, made when the first engine takes a role."""
        if self._pd is None:
            self._pd = PD(self, self._options)
        return self._pd

    def _register_role(self, identity: bytes, engine: _Engine | None, frames: list[Any]) -> None:
        """A #6675 engine's REGISTER_ROLE: judged as #6675 judges it (a registered identity
        is replaced first: its requests as at its death), then acknowledged ([2]) and
        seated, or refused ([29, reason])."""
        try:
            message = unpackb(frames[1].buffer)
        except ProtocolError as exc:
            self._malformed(None, None, Header.REGISTER_ROLE, str(exc), frames)
            return
        pd = self._pd_room() if self._pr6675 else self._pd
        fleet = {} if pd is None else pd.registrations
        if not isinstance(message, list):
            message = [message]
        check = _pd.check_register_role(message, identity, fleet, self._pr6675)
        if check.replaces and engine is not None and engine.state != GONE:
            self._mark_gone(engine, GoneReason.RESTARTED)
            self._settle()
        registration = check.registration
        if registration is None or pd is None:
            if pd is not None:
                pd.counts["roles_refused"] += 1
            self._send(identity, protocol.ROLE_REFUSED.pack(check.refusal))
            return
        engine = self._new_engine(
            identity, self._engine_by_identity.get(identity), _source_fd(frames[1])
        )
        if engine is None:
            return
        engine.format = SINGLE_FRAME_MAIN  # main's single frames, four SUBMIT fields
        self._count_formats()
        seat = pd.seat(
            engine,
            ROLE_NAMES[registration.role],
            True,
            _pd.MEGATRON_DOMAIN,
            registration.request_capacity,
        )
        seat.ssm_capacity = registration.ssm_capacity or 0
        seat.slot_cost = registration.slot_cost
        seat.nccl = registration.transport == "nccl"
        seat.transfer = registration.instance_meta
        pd.registrations[identity] = registration
        self._send(identity, protocol.REGISTER_ROLE_ACK.pack())
        pd.drain()

    def _count_formats(self) -> None:
        """How many engines not gone speak each format: which checks a SUBMIT needs."""
        live = [engine for engine in self._engines if engine.state != GONE]
        self._n_single_engines = sum(engine.format == SINGLE_FRAME for engine in live)
        self._n_main_engines = sum(engine.format == SINGLE_FRAME_MAIN for engine in live)
        self._n_multipart_engines = len(live) - self._n_single_engines - self._n_main_engines

    def _restarted(self, engine: _Engine, fd: int) -> None:
        """A new process registered under an engine's identity: the old one's requests
        are handled as its death (re-sent or failed), and the rank starts anew."""
        self._counters[Counter.ENGINE_RESTARTS] += 1
        self._mark_gone(engine, GoneReason.RESTARTED)
        self._new_engine(engine.identity, engine, fd)  # first: the new one may take them
        self._settle()

    def _new_engine(self, identity: bytes, engine: _Engine | None, fd: int) -> _Engine | None:
        """Put the sender in the pool: ``engine`` coming back, or a new rank (reusing
        a gone rank with nothing left in flight once the table is full); None when
        there is no room or the sender is, or was, a client."""
        if engine is None:
            if identity in self._clients or self._roles.of(identity) == PeerRole.CLIENT:
                self._malformed(None, None, -1, "a client sent an engine registration", [identity])
                return None
            rank = len(self._engines)
            if rank == self._options.max_engines:
                rank = next(
                    (
                        e.rank
                        for e in self._engines
                        if e.state == GONE and not self._router.pending(e.rank)
                    ),
                    -1,
                )
                if rank < 0:
                    self._counters[Counter.TABLE_FULL] += 1
                    self._log.warn("engines_full", "engine table full: registration dropped")
                    return None
                retired = self._engines[rank].identity
                del self._engine_by_identity[retired]
                self._roles.remember(retired, PeerRole.ENGINE)
                self._engines[rank] = _Engine(rank, identity)
            else:
                self._engines.append(_Engine(rank, identity))
            self._tally.reset(rank)
            engine = self._engine_by_identity[identity] = self._engines[rank]
        engine.state = ALIVE
        self._watch(engine, fd)
        engine.session = 0
        engine.coordkit = False
        engine.batch = False
        engine.format = self._single_format if self._megatron_core else MULTIPART
        engine.heartbeats = False
        engine.rebuild = False
        engine.handled = engine.mark = engine.acked = 0
        self._router.set_capacity(engine.rank, 0)  # until a hello says otherwise
        self._faults.admit(engine)
        self._dispatch_due = True
        self._count_formats()
        return engine

    def _watch(self, engine: _Engine, fd: int) -> None:
        """An engine's connection is ``fd`` (-1: inproc, not watched): when it ends, the
        engine is lost (Faults.lost)."""
        if self._engine_fds.get(engine.fd) is engine:
            del self._engine_fds[engine.fd]
        engine.fd = fd
        if fd < 0:
            return
        self._connection_events()  # what the monitor said first
        if fd in self._connections:
            self._engine_fds[fd] = engine
        else:  # it ended already
            self._ended.append((engine.identity, fd))

    def _connect(self, identity: bytes, client: _Client | None, frames: list[zmq.Frame]) -> None:
        """CONNECT: a new client (or a repeated CONNECT), answered with CONNECT_ACK."""
        try:
            hello = parse_connect(_buffers(frames))
        except ProtocolError as exc:
            self._malformed(None, None, Header.CONNECT, str(exc), frames)
            return
        fd = _source_fd(frames[1])
        if client is not None and client.present and fd != client.fd:
            # Its routing id on a new connection (libzmq hands it over: nothing reaches
            # the old one any more): it reconnected before its old connection's end was
            # seen, or another process took its name: either way the old one is gone
            # (away, with a hold: a blip).
            if client.hold > 0:
                self._rebuild.go_away(client)
            else:
                self._client_gone(client, unreachable=False)
            client = self._clients.get(identity)  # None: forgotten (nothing in flight kept)
        if client is None and self._roles.of(identity) == PeerRole.ENGINE:
            self._malformed(None, None, Header.CONNECT, "an engine sent CONNECT", frames)
            return
        if client is not None:
            if client.present:
                self._counters[Counter.DUPLICATE_CONNECT] += 1
            else:  # known from an engine's report only, or away: this is its connection
                self._connection_events()  # as for a new client: what the monitor said first
                client.fd = fd
                self._rebuild.returned(client)
            self._seen(client)
        else:
            # What the monitor said first: a connection that ended on this CONNECT's fd
            # before this one opened is not to be taken for this one's end.
            self._connection_events()
            if len(self._clients) >= self._options.max_clients and not self._vacant_client():
                self._counters[Counter.TABLE_FULL] += 1
                self._refused[ErrorCode.BUSY] += 1
                if hello.coordkit:
                    self._counters[Counter.ERRORS_SENT] += 1
                    text = error_text(ErrorCode.BUSY, Header.CONNECT)
                    self._send(identity, protocol.ERROR.pack(None, ErrorCode.BUSY, text))
                return
            client = self._clients[identity] = self._idle[identity] = _Client(identity)
            client.fd = fd
        client.coordkit = hello.coordkit
        client.batch = hello.batch
        client.rebuild = hello.rebuild
        client.hold = hello.hold
        client.qos = hello.qos
        tenant = self._queue.tenant(hello.tenant)  # the one it names now (None: its own)
        if client.tenant >= 0:
            self._queue.leave(client.tenant)
        client.tenant = tenant
        client.present = client.fresh = True
        client.rejoined = False  # until its REJOIN, the requests adopted for it wait
        client.format = MULTIPART
        if self._megatron_core and not hello.coordkit:
            client.format = SINGLE_FRAME_MAIN if self._pr6675 else SINGLE_FRAME
        features: dict[str, int] = {BATCH_FEATURE: 1} if hello.batch else {}
        if hello.qos:
            features[QOS_FEATURE] = 1
        if hello.rebuild:
            features.update({REBUILD_FEATURE: 1, EPOCH_KEY: self._epoch})
        if features:
            self._send(identity, protocol.CONNECT_ACK_BATCH.pack(features))
        else:
            self._send(identity, protocol.CONNECT_ACK.pack())
        if client.fd >= 0:
            if client.fd in self._connections:
                self._connections[client.fd] = client
            else:  # the monitor said its connection ended already
                self._ended.append((client.identity, client.fd))

    def _vacant_client(self) -> bool:
        """Make room for a client: the one idle longest gives up its place."""
        if not self._idle:
            return False
        self._remove_client(next(iter(self._idle.values())))
        return True

    def _remove_client(self, client: _Client) -> None:
        """A client with nothing in flight leaves the tables (its identity stays a
        client's)."""
        self._roles.remember(client.identity, PeerRole.CLIENT)
        if client.tenant >= 0:
            self._queue.leave(client.tenant)
        del self._clients[client.identity]
        self._tally.submitted.pop(client, None)
        del self._idle[client.identity]
        self._rebuild.away.pop(client.identity, None)
        if self._connections.get(client.fd) is client:
            self._connections[client.fd] = None

    def _connection_events(self) -> None:
        """The ROUTER's monitor: connections opened and ended (a client whose connection
        ended has left: nothing can reach its routing id again), handshakes refused."""
        for event, value in monitor_events(self._monitor):
            if event == zmq.EVENT_ACCEPTED:
                self._connections[value] = None
            elif event == zmq.EVENT_DISCONNECTED:
                client = self._connections.pop(value, None)
                engine = self._engine_fds.pop(value, None)
                if client is not None:
                    self._ended.append((client.identity, value))
                elif engine is not None:
                    self._ended.append((engine.identity, value))
            elif event & REFUSAL_EVENTS:
                self._counters[Counter.AUTH_REFUSED] += 1

    def _drop_ended(self) -> None:
        """Forget the clients whose connection ended (those still known by that routing
        id on that connection), and abort their requests."""
        ended, self._ended = self._ended, []
        for identity, fd in ended:
            client = self._clients.get(identity)
            engine = self._engine_by_identity.get(identity)
            if client is not None and client.fd == fd:
                self._client_gone(client, unreachable=False)
            elif engine is not None and engine.fd == fd and engine.state != GONE:
                self._faults.lost(engine, GoneReason.DISCONNECTED)
        if self._gone:
            self._settle()

    def _goodbye(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """DISCONNECT from a client: it closes; forget it and abort what it left."""
        if self._parse(protocol.DISCONNECT, client, Header.DISCONNECT, frames) is not None:
            self._client_gone(client, unreachable=False, closed=True)

    def _heartbeat(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        message = self._parse(protocol.HEARTBEAT, None, Header.HEARTBEAT, frames)
        if message is None:
            return
        if engine.state != GONE:
            engine.heartbeats = True
            engine.last_heartbeat = time.monotonic()
            self._tally.heartbeat(engine.rank, message.pending, message.capacity)

    def _disconnect(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """DISCONNECT: no new work; its requests in flight may finish, for a while."""
        if self._parse(protocol.DISCONNECT, None, Header.DISCONNECT, frames) is None:
            return
        if engine.state != ALIVE:
            return
        if self._pd is not None and engine.rank in self._pd.seats:
            # a role engine leaves as #6675's do: its hops go on elsewhere now
            self._mark_gone(engine, GoneReason.DISCONNECTED)
            return
        self._router.remove_rank(engine.rank)
        engine.state = DRAINING
        engine.drain_deadline = time.monotonic() + self._options.drain_timeout
        if self._router.pending(engine.rank) == 0:
            engine.state = GONE

    def _abort(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """ABORT_REQUEST: on to the owning engine, once, with the server id."""
        message = self._parse(protocol.ABORT_REQUEST, client, Header.ABORT_REQUEST, frames)
        if message is None:
            return
        request = client.requests.get(message.rid)
        if request is None and (client.identity, message.rid) in self._rebuild.awaiting:
            # REJOINed, no engine claimed it yet: aborted when one does (Rebuild.held), else
            # ended at the window's end, never sent again (Rebuild.end_window)
            self._counters[Counter.ABORTS] += 1
            self._rebuild.aborting.add((client.identity, message.rid))
            return
        if request is None:
            self._refuse(
                client,
                message.rid,
                ErrorCode.UNKNOWN_REQUEST,
                Header.ABORT_REQUEST,
                Counter.UNKNOWN_REQUEST,
            )
            return
        self._counters[Counter.ABORTS] += 1
        pd = self._pd if self._pd is not None and request.server_rid in self._pd.hops else None
        if request.rank < 0 and pd is None:  # it waits: it ends here, no engine has it
            self._forget(request)
            self._failed[ErrorCode.ABORTED] += 1
            code, text = ErrorCode.ABORTED, never_ran(request.client_rid)
            if not self._send_error(client, message.rid, code, Header.ABORT_REQUEST, True, text):
                self._client_gone(client)
            return
        if request.flags & ABORTED:
            return
        request.flags |= ABORTED
        if pd is not None:
            pd.abort(request)  # at the hop holding it, or ended waiting for one
            return
        self._abort_at_engine(self._engines[request.rank], request.server_rid)

    def _abort_at_engine(self, engine: _Engine, server_rid: int) -> None:
        """ABORT_REQUEST to an engine; a 0.19 engine has none: the request runs to its end."""
        if not engine_parses(engine.format, Header.ABORT_REQUEST):
            return
        if not self._send(engine.identity, protocol.ABORT_REQUEST.pack(server_rid)):
            self._faults.lost(engine, GoneReason.UNREACHABLE)

    def _release_kv(self, client: _Client, frames: list[zmq.Frame]) -> None:
        message = self._parse(protocol.RELEASE_KV, client, Header.RELEASE_KV, frames)
        if message is None:
            return
        self._counters[Counter.RELEASE_KV] += 1
        if self._pd is not None:  # its own requests' pins, at their prefill only
            self._pd.client_release(client, message.rid)
        else:
            self._broadcast(Header.RELEASE_KV, frames[1])

    def _control(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        """A control signal: through the state machine, then to every engine."""
        if self._parse(protocol.CONTROL[header], client, header, frames) is None:
            return
        state = CONTROL_TRANSITIONS.get((self._control_state, header))
        if state is None:
            self._refuse(client, None, ErrorCode.INVALID_STATE, header, Counter.INVALID_CONTROL)
            return
        self._counters[Counter.CONTROL] += 1
        self._control_state = ControlState(state)
        self._broadcast(header, frames[1])

    def _shutdown_signal(self, client: _Client, frames: list[zmq.Frame]) -> None:
        if self._parse(protocol.SHUTDOWN, client, Header.SHUTDOWN, frames) is not None:
            self._stopping = True

    def _stats_request(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """STATS: stats(), and with {"metrics": 1} metrics() in it too, to a coordkit client."""
        message = self._parse(protocol.STATS, client, Header.STATS, frames)
        if message is not None and client.coordkit:
            stats = self.stats()
            if asks_metrics(message.asked):
                stats["metrics"] = self.metrics()
            self._send(client.identity, protocol.STATS_REPLY.pack(packb(stats)))

    def _parse(
        self,
        spec: MessageSpec | protocol.BatchedMessageSpec | protocol.HeldSpec | protocol.ReplayedSpec,
        client: _Client | None,
        header: int,
        frames: list[zmq.Frame],
    ) -> Any:
        """The message parsed by ``spec``, or None after handling it as malformed."""
        try:
            return spec.parse(_buffers(frames))
        except ProtocolError as exc:
            self._malformed(client, exc.rid, header, str(exc), frames)
            return None

    def _broadcast(self, header: int, frame: zmq.Frame) -> None:
        """The metadata frame as it came to every engine not gone."""
        for engine in self._engines:
            if engine.state == GONE:
                continue
            if not engine_parses(engine.format, header):
                continue  # 0.19 has no KV transfer
            if not self._send(engine.identity, [frame]):
                self._faults.lost(engine, GoneReason.UNREACHABLE)

    def _detokenized(self, body: Buffer) -> Buffer:
        """A reply body with its generated_text; on failure the body as it is."""
        try:
            out = detokenize(self._options.detokenizer, body)  # type: ignore[arg-type]
        except Exception as exc:  # a bad body or a failing detokenizer
            self._counters[Counter.DETOKENIZE_ERRORS] += 1
            self._log.warn("detokenize", f"detokenize failed, body forwarded as is: {exc!r}")
            return body
        self._counters[Counter.DETOKENIZED] += 1
        return out

    # -- failures ------------------------------------------------------------------------

    def _settle(self) -> None:
        """Re-send or fail the requests of the engines found gone, oldest first.

        Settling one engine may find others gone (a re-send that cannot reach
        its engine): they join the queue, so the work stays a loop, not a recursion.
        """
        i = 0
        while i < len(self._gone):
            self._settle_engine(*self._gone[i])
            i += 1
        self._gone.clear()

    def _settle_engine(self, engine: _Engine, reason: GoneReason) -> None:
        """Each request of a gone engine, by server id, lost there (_unrun)."""
        self._log.warn("engine_failed", f"engine {engine.rank} gone ({GONE_REASONS[reason]})")
        if self._pd is not None:
            self._pd.engine_gone(engine)  # its P/D requests go on elsewhere, or end
        if self._kv_events is not None and engine.state == GONE:  # (not back already)
            self._kv_events.unannounce(engine.rank)  # the publisher it announced goes too
        resend: dict[_Client, list[int]] = defaultdict(list)
        for request in self._in_order(lambda r: r.rank == engine.rank):
            if self._find(request.server_rid) is not request or request.rank != engine.rank:
                continue  # ended meanwhile: its client went away
            self._unrun(request, resend)
        self._rebuild.send_resends(resend)

    def _unrun(self, request: _Request, resend: dict[_Client, list[int]]) -> None:
        """A request its engine will never answer (it died, or does not hold it): re-sent
        from what was kept when it produced nothing (a rebuild client's: RESEND), moved on
        with the tokens it streamed when it did (Faults.migrate), otherwise ended with
        ERROR(ENGINE_FAILED)."""
        self._tally.failed(request.rank)  # whatever comes of it, that engine lost it
        self._router.release(request.rank, request.work)
        request.rank = -1
        request.flags &= ~UNCONFIRMED
        if request.flags & (ABORTED | PINNED) or (
            request.kept is None and not request.client.rebuild
        ):
            self._fail_request(request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
            return
        if request.flags & PRODUCED:
            migrated = self._faults.migrate(request)
            if migrated is None:  # it cannot go on elsewhere
                self._fail_request(request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
                return
            status, counter = migrated, Counter.MIGRATED
        elif request.kept is None:  # a rebuild client sends it again itself
            if self._traces is not None:
                self._traces.drop(request)
            self._forget(request)
            resend[request.client].append(request.client_rid)
            return
        else:
            status, counter = self._resend(request), Counter.REROUTED
        if (
            status == RouteStatus.ALL_BUSY
            and self._queue.limit
            and self._queued(request, None, True)
        ):
            return  # it waits at the head, sent from what it kept (moved on: its tokens)
        if status == RouteStatus.SENT:
            self._counters[counter] += 1
        elif status == RouteStatus.UNSENDABLE:  # no engine left that speaks its format
            self._fail_request(request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
        else:
            self._fail_request(request, _refusal(status), Header.SUBMIT_REQUEST)

    def _resend(self, request: _Request) -> RouteStatus:
        """Send a request whose engine died to another, from what it kept, as a new
        request is sent (_route); a RouteStatus."""
        assert request.kept is not None
        inbound = kept_inbound(request.kept, self._n_multipart_engines, self._n_single_engines)
        carriers(inbound, self._n_single_engines + self._n_main_engines > 0)
        status = RouteStatus.ENGINE_GONE
        while status == RouteStatus.ENGINE_GONE:  # that one waits in the queue of gone engines
            status = self._route(request, inbound)
        return status

    def _in_order(self, keep: Any, among: Iterable[_Request] | None = None) -> list[_Request]:
        """The requests in flight (of ``among``, else all) for which ``keep`` holds, by
        server id."""
        if among is None:
            among = [*self._requests.values(), *self._adopted.values()]
        return sorted((r for r in among if keep(r)), key=lambda r: r.server_rid)

    def _fail_request(self, request: _Request, code: ErrorCode, header: int) -> None:
        """End ``request`` with ERROR(code): its one terminal reply."""
        self._tally.failed(request.rank)
        if self._traces is not None:
            self._traces.fail(request, code)
        self._forget(request)
        self._failed[code] += 1
        if code == ErrorCode.ENGINE_FAILED:
            self._counters[Counter.ENGINE_FAILED] += 1
        if not self._send_error(request.client, request.client_rid, code, header, True):
            self._client_gone(request.client)

    def _time_out(self, request: _Request) -> None:
        """End a request in flight longer than request_timeout: ERROR(TIMED_OUT) to
        its client, ABORT to its engine (whose late final is then unknown, dropped); one
        that waits leaves the queue; a P/D request's hops are its room's."""
        self._counters[Counter.TIMED_OUT] += 1
        if self._pd is not None and request.server_rid in self._pd.hops:
            self._pd.time_out(request)
            return
        if request.rank < 0:
            self._unqueue(request, QueueOutcome.TIMED_OUT)
        elif not request.flags & ABORTED and self._engines[request.rank].state != GONE:
            self._abort_at_engine(self._engines[request.rank], request.server_rid)
        self._fail_request(request, ErrorCode.TIMED_OUT, Header.SUBMIT_REQUEST)

    def _reject_entry(self, engine: _Engine, rid: int | None, code: int, header: int) -> None:
        """An entry of an engine's batch that was not delivered: malformed ones are
        counted and logged, and a coordkit engine is told with an ERROR."""
        if code == ErrorCode.MALFORMED:
            self._counters[Counter.MALFORMED_ENTRIES] += 1
            self._tally.engines[engine.rank].malformed_entries += 1
            what = f"malformed entry in {header_name(header)} from engine {engine.rank}"
            self._log.warn("malformed", what)
        if engine.coordkit:
            error = protocol.ERROR.pack(rid, code, error_text(code, header))
            if not self._send(engine.identity, error):
                self._faults.lost(engine, GoneReason.UNREACHABLE)

    def _client_gone(self, client: _Client, unreachable: bool = True, closed: bool = False) -> None:
        """A client that cannot be reached, or that left (DISCONNECT: ``closed``, or its
        connection ended): its requests are aborted at their engines and forgotten, and
        so is the client; but a rebuild client with a hold that did not close may come
        back (a blip): it is only away (Rebuild.go_away)."""
        if self._clients.get(client.identity) is not client:
            return
        self._counters[Counter.CLIENTS_DEPARTED] += 1
        if unreachable:
            self._counters[Counter.CLIENT_GONE] += 1
        if client.present and client.hold > 0 and not closed:
            self._rebuild.go_away(client)
        else:
            self._drop_client(client)

    def _drop_client(self, client: _Client) -> None:
        """Abort a client's requests at their engines, and forget them and it."""
        for request in self._in_order(lambda r: True, client.requests.values()):
            if self._find(request.server_rid) is not request:
                continue
            rank = request.rank
            self._forget(request)
            if request.flags & ABORTED or rank < 0 or self._engines[rank].state == GONE:
                continue
            self._abort_at_engine(self._engines[rank], request.server_rid)
        self._remove_client(client)

    # -- answers and malformed input ------------------------------------------------------

    def _send(self, identity: bytes, frames: list[Any]) -> bool:
        """Send one message to a peer; False when it is gone."""
        if not self._send_identity(identity):
            return False
        try:
            header = codec.read_header(frames[0])[0]
        except ProtocolError:
            header = -1
        self._traffic.count(SENT, header, _send_all(self._sock, frames))
        return True

    def _send_error(
        self,
        client: _Client,
        rid: int | None,
        code: int,
        header: int,
        ends: bool = False,
        text: str | None = None,
    ) -> bool:
        """ERROR to a coordkit client (its text ``text``, else error_text's); to a
        Megatron main client, when the error ends a request of its (``ends``), the
        FAILED final it takes (0.19's clients get nothing). False when the client is
        gone."""
        if not client.present or (
            not client.coordkit and not (ends and client.format == SINGLE_FRAME_MAIN)
        ):
            return True  # away, its REJOIN then finds it ended; or it takes no ERROR
        self._counters[Counter.ERRORS_SENT] += 1
        text = error_text(code, header) if text is None else text
        if self._pr6675 and not client.coordkit:  # #6675's client: its REQUEST_ERROR
            assert rid is not None
            return self._send(client.identity, protocol.REQUEST_ERROR.pack(rid, text, True))
        if not client.coordkit:
            assert rid is not None
            self._log.warn("failed_final", f"a Megatron main client's request {rid} failed: {text}")
            return self._send(client.identity, [megatron_failed_reply(rid)])
        return self._send(client.identity, protocol.ERROR.pack(rid, code, text))

    def _refuse(
        self,
        client: _Client,
        rid: int | None,
        code: int,
        header: int,
        counter: Counter,
        ends: bool = False,
    ) -> None:
        """Count a refused message and answer its client with ERROR(code); ``ends``:
        it was a request that parsed (see _send_error)."""
        self._counters[counter] += 1
        self._refused[code] += 1
        if not self._send_error(client, rid, code, header, ends):
            self._client_gone(client)

    def _malformed(
        self,
        client: _Client | None,
        rid: int | None,
        header: int,
        detail: str,
        frames: list[Any],
    ) -> None:
        """A message that does not parse: counted, logged (rate-limited), and
        answered when its sender is a client."""
        sender = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        self._log.warn("malformed", f"malformed {header_name(header)} from {sender!r}: {detail}")
        if client is None:
            self._counters[Counter.MALFORMED] += 1
        else:
            self._refuse(client, rid, ErrorCode.MALFORMED, header, Counter.MALFORMED)

    def _malformed_batch(
        self, client: _Client, rids: Sequence[int], detail: str, frames: list[zmq.Frame]
    ) -> None:
        """A SUBMIT_BATCH whose entries cannot all go on: no prompt can be told from
        another, so each request named ends here; when none is, one ERROR without
        an id says so."""
        if not rids:
            self._malformed(client, None, Header.SUBMIT_BATCH, detail, frames)
        for rid in rids:
            if self._clients.get(client.identity) is not client:
                return  # found gone meanwhile
            self._malformed(client, rid, Header.SUBMIT_BATCH, detail, frames)
