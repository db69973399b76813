"""The reference loop core's ``Loop``: the coordinator's tables and its hot path, over pyzmq.

:class:`coordkit.Coordinator` owns the sockets, the thread and the timers and
drives this core, or its Cython twin (``_loop_c.pyx``). This one is the
oracle: both make the same decisions in the same order and put the same
frames on the wire, method for method under the same names.

Each concept of the twin (``loop/X.pyx``) is the module ``X.py`` beside this
one, under the same names: C's ``x_verb(&self.x, ...)`` is ``self._x.verb(...)``
here. The Loop keeps the tables and the handlers: the hot path (a SUBMIT out to
an engine; an engine's batch of replies out to their clients) first, the rare
paths after it, which parse with the message specs of :mod:`coordkit.protocol`.
Requests are filed by ``server_rid & mask``, and server ids are drawn exactly as
the C index draws them (see _add). An engine found gone on the hot path is only
marked; its requests are settled once the message at hand is done.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from .. import _codec_py as codec
from .. import _pd, protocol
from .._shared import (
    ERROR_SLOTS,
    GONE_REASONS,
    INDEX_WINDOW_MIN,
    REFUSAL_EVENTS,
    RETIRED_IDS,
    TICK,
    Counter,
    GoneReason,
    Options,
    PeerRole,
    QueueOutcome,
    RateLimitedLog,
    RouteStatus,
    busiest,
    detokenize,
    megatron_failed_reply,
    metrics_map,
    monitor_events,
    never_ran,
    stats_map,
    unknown_from_engine,
)
from ..protocol import (
    BATCH_FEATURE,
    BLOCK_HASH_SIZE,
    CONTROL_HEADERS,
    CONTROL_TRANSITIONS,
    EPOCH_KEY,
    MAX_PARTS,
    QOS_FEATURE,
    REBUILD_FEATURE,
    ROLE_NAMES,
    Buffer,
    ControlState,
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
from .dialect import (
    CARRIED,
    NOT_A_MAP,
    Inbound,
    carriers,
    carries,
    engine_parses,
    multipart_inbound,
    reply_carried,
    rewrite_meta,
    send_reply,
    send_request,
    single_frame,
    single_inbound,
    single_layout,
    single_walks,
    text_only,
    trailer_frames,
)
from .fanout import Fanout
from .faults import Faults
from .kept import keep, kept_inbound
from .latency import STAGE_REPLY, STAGE_REQUEST, Latency
from .lists import Deadlines
from .message import _send_all, _source_fd, message_bytes
from .pd import PD
from .queue import Queue
from .rebuild import Rebuild
from .roles import Roles
from .tables import (
    ABORTED,
    ALIVE,
    AWAY,
    DRAINING,
    GONE,
    MIGRATED,
    MSGPACK_BOOLS,
    MULTIPART,
    PINNED,
    PRODUCED,
    REPLAYING,
    SINGLE_FRAME,
    SINGLE_FRAME_MAIN,
    UNCONFIRMED,
    _Client,
    _Engine,
    _Request,
)
from .tally import Tally
from .traces import Traces
from .traffic import RECEIVED, SENT, Traffic

if TYPE_CHECKING:
    from .._routing_py import Router


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
            if self._wake in ready:
                self._wake.recv()
                self._stopping = True
            elif self._sock in ready:
                self._drain(deadline)
            while self._ended and not self._stopping:
                self._drain(deadline)  # what they sent before their connections ended goes first
                self._drop_ended()
                if self._traces is not None and self._traces.ending:
                    self._traces.end()
        return False

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
