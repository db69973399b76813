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
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import zmq

from .. import _codec_py as codec
from .._shared import (
    ERROR_SLOTS,
    INDEX_WINDOW_MIN,
    RETIRED_IDS,
    TICK,
    Counter,
    GoneReason,
    Options,
    QueueOutcome,
    RateLimitedLog,
    RouteStatus,
)
from ..protocol import (
    BLOCK_HASH_SIZE,
    MAX_PARTS,
    Buffer,
    ControlState,
    ErrorCode,
    Header,
    ProtocolError,
    header_name,
)
from .answers import Answers
from .control import Control
from .dialect import (
    CARRIED,
    NOT_A_MAP,
    Inbound,
    carriers,
    carries,
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
from .kept import keep
from .kvindex import KVIndex
from .latency import STAGE_REPLY, STAGE_REQUEST, Latency
from .lists import Deadlines
from .message import _source_fd, message_bytes
from .pd import PD
from .peers import Peers
from .queue import Queue
from .rebuild import Rebuild
from .refusals import _REFUSAL_COUNTERS, Refusals, _refusal
from .report import Report
from .roles import Roles
from .tables import (
    AWAY,
    DRAINING,
    GONE,
    MIGRATED,
    MSGPACK_BOOLS,
    PINNED,
    PRODUCED,
    REPLAYING,
    SINGLE_FRAME,
    SINGLE_FRAME_MAIN,
    _Client,
    _Engine,
    _Request,
)
from .tally import Tally
from .timers import Timers
from .traces import Traces
from .traffic import RECEIVED, SENT, Traffic

if TYPE_CHECKING:
    from .._routing_py import Router


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
        self._answers = Answers(self)
        self._control = Control(self)
        self._peers = Peers(self)
        self._refusals = Refusals(self)
        self._report = Report(self)
        self._timers = Timers(self)
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
            self._kv = KVIndex()
            router.attach_kv(self._kv)
            self._kv_events.attach(self._kv)

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
                self._timers.tick(now)
            if self._monitor in ready:
                self._peers.connection_events()
            if self._wake in ready and self._woken():
                self._stopping = True
            elif self._sock in ready:
                self._drain(deadline)
            while self._ended and not self._stopping:
                self._drain(deadline)  # what they sent before their connections ended goes first
                self._peers.drop_ended()
                if self._traces is not None and self._traces.ending:
                    self._traces.end()
        return False

    def _woken(self) -> bool:
        """Whether stop() wrote to the wake socket (an empty frame); the KV events'
        thread writes a byte there when it has STATE records waiting: they are applied."""
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

    def shutdown(self) -> None:
        self._refusals.shut_down()

    def stats(self) -> dict[str, Any]:
        return self._report.stats()

    def metrics(self) -> dict[str, Any]:
        return self._report.metrics()

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
                self._faults.settle()
            if self._dispatch_due:
                self._dispatch()
            if self._traces is not None and self._traces.ending:  # what it ended was sent
                self._traces.end()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """Dispatch a message (frame 0 is the sender's routing id)."""
        identity = frames[0].bytes
        engine = self._engine_by_identity.get(identity)
        if len(frames) == 2 and len(frames[1]) == 0:
            self._peers.register(identity, engine, _source_fd(frames[1]))
            return
        client = self._clients.get(identity)
        try:
            if len(frames) > MAX_PARTS:
                raise ProtocolError(f"more than {MAX_PARTS} frames")
            header = codec.read_header(frames[1].buffer)[0]
        except ProtocolError as exc:
            self._traffic.count(RECEIVED, -1, message_bytes(frames))
            self._refusals.malformed(client, None, -1, str(exc), frames)
            return
        self._traffic.count(RECEIVED, header, message_bytes(frames))
        if engine is not None:
            self._from_engine(engine, header, frames)
            if self._latency is not None:
                self._latency.handled(STAGE_REPLY, header)
        elif header == Header.CONNECT:
            self._peers.connect(identity, client, frames)
        elif header == Header.ENGINE_HELLO and client is None:
            self._peers.engine_hello(identity, None, frames)
        elif header == Header.REGISTER_ROLE and client is None:
            self._peers.register_role(identity, None, frames)
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
            self._control.from_client(client, header, frames)

    def _submit(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        """A new request in frames: metadata, payload, and maybe its block hashes."""
        meta = frames[1].buffer
        try:
            _, length, rid, offset = codec.read_submit(meta)
        except ProtocolError as exc:
            self._refusals.malformed(client, exc.rid, header, str(exc), frames)
            return
        n_payload = 1 if header == Header.SUBMIT_REQUEST else 2
        n_frames = len(frames) - 2
        hashes = frames[2 + n_payload] if n_frames == n_payload + 1 else None
        priority = deadline_ms = 0
        if length != 2 + n_payload:  # QoS, from a client granted it, or a bad layout
            if length != 4 + n_payload or not client.qos:
                self._refusals.malformed(client, rid, header, "bad frame layout", frames)
                return
            try:  # the QoS fields come off here: the params span starts after them
                priority, deadline_ms, offset = codec.read_qos(meta, offset)
            except ProtocolError as exc:
                self._refusals.malformed(client, rid, header, str(exc), frames)
                return
        if not n_payload <= n_frames <= n_payload + 1 or (
            hashes is not None and len(hashes) % BLOCK_HASH_SIZE
        ):
            self._refusals.malformed(client, rid, header, "bad frame layout", frames)
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
            self._refusals.malformed(client, exc.rid, header, str(exc), frames)
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
            self._refusals.malformed(client, None, header, "batches not granted", frames)
            return
        meta = frames[1].buffer
        try:
            entries = codec.read_submit_batch(meta, codec.QOS_WIDTH if client.qos else 3)
        except ProtocolError as exc:
            self._refusals.malformed_batch(client, exc.rids, str(exc), frames)
            return
        if sum(1 + entry[3] for entry in entries) != len(frames) - 2:
            self._refusals.malformed_batch(
                client, [rid for rid, *_ in entries], "bad frame layout", frames
            )
            return
        part = 2
        for rid, offset, size, hashed, *qos in entries:
            if self._clients.get(client.identity) is not client:
                break  # found gone meanwhile
            hashes = frames[part + 1] if hashed else None
            if hashes is not None and len(hashes) % BLOCK_HASH_SIZE:
                self._refusals.malformed(client, rid, header, "bad frame layout", frames)
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
            self._refusals.refuse(
                client, rid, ErrorCode.DUPLICATE_REQUEST, header, Counter.DUPLICATE_REQUEST
            )
            return
        if self._live >= self._options.max_inflight:
            self._refusals.refuse(client, rid, ErrorCode.BUSY, header, Counter.BUSY)
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
        self._refusals.refuse(
            client, rid, _refusal(status), header, _REFUSAL_COUNTERS[status], True
        )

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
            self._faults.settle()
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
                self._peers.client_gone(to)

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
            self._control.from_engine(engine, header, frames)

    def _forward_replies(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """Each entry of an engine's batch to its request's client, the body as itself;
        those bound for batched clients leave as one REPLY_BATCH per client. A final to
        a client with a hold is forgotten only once sent: one whose client is found
        gone by its send waits, with the client's other requests, for its REJOIN."""
        try:
            header, entries = codec.read_reply(frames[1].buffer)
        except ProtocolError as exc:
            self._refusals.malformed(None, None, -1, str(exc), frames)
            return
        bodies = frames[2:]
        if len(entries) != len(bodies):
            detail = f"{len(entries)} entries but {len(bodies)} payload frames"
            self._refusals.malformed(None, None, header, detail, frames)
            return
        final = header == Header.ENGINE_REPLY
        now = time.monotonic() if self._latency is not None else 0.0
        deferred = 0  # finals to clients with a hold, forgotten once sent (Rebuild.sent_finals)
        for entry, body in zip(entries, bodies, strict=True):
            if entry is None:
                self._refusals.reject_entry(engine, None, ErrorCode.MALFORMED, header)
                continue
            server_rid, needs_detokenize = entry
            request = self._find(server_rid)
            if request is None or request.rank != engine.rank:
                # A late reply (its request ended: aborted, timed out, its client
                # gone), or a reply the engine got wrong.
                self._counters[Counter.UNKNOWN_REQUEST] += 1
                self._tally.engines[engine.rank].unknown_request += 1
                if engine.coordkit:
                    self._refusals.reject_entry(
                        engine, server_rid, ErrorCode.UNKNOWN_REQUEST, header
                    )
                continue
            if request.flags & REPLAYING:
                continue  # the engine's REPLAYED brings it again, in its place
            out: Any = self._continued(request, body.buffer, final) or body
            if final and request.client.hold > 0:
                deferred += 1
            else:
                self._finish(request, final, now)
            if needs_detokenize and self._options.detokenizer is not None:
                out = self._answers.detokenized(out.buffer if isinstance(out, zmq.Frame) else out)
            if request.client.batch:
                self._fanout.add(request.client, request.client_rid, MSGPACK_BOOLS[final], [out])
            elif not self._deliver(request.client, header, request.client_rid, out):
                self._peers.client_gone(request.client)
        self._send_batches(Header.REPLY_BATCH)
        if deferred:
            self._rebuild.sent_finals(engine, entries, now)

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
            self._refusals.malformed(None, None, Header.ENGINE_REPLY, str(exc), frames)
            return
        final = header == Header.ENGINE_REPLY
        now = time.monotonic() if self._latency is not None else 0.0
        for start, end, server_rid, error in entries:
            if error is not None:
                self._refusals.reject_entry(engine, None, ErrorCode.MALFORMED, header)
                continue
            assert server_rid is not None  # read whenever there is no error
            request = self._find(server_rid)
            if request is None or request.rank != engine.rank:
                self._counters[Counter.UNKNOWN_REQUEST] += 1
                self._tally.engines[engine.rank].unknown_request += 1
                if self._pd is not None:
                    self._pd.messages.stray_reply(engine, server_rid)
                continue
            if self._pd is not None and self._pd.intercepts(request):  # hop 1's answer
                self._pd.messages.prefilled(request, engine, data[start:end])
                continue
            body: Buffer = self._continued(request, data[start:end], final) or data[start:end]
            self._finish(request, final, now)
            if final and self._options.detokenizer is not None:  # as Megatron's: every final
                body = self._answers.detokenized(body)
            if request.client.batch:
                self._fanout.add(request.client, request.client_rid, MSGPACK_BOOLS[final], [body])
            elif not self._deliver(request.client, header, request.client_rid, body):
                self._peers.client_gone(request.client)
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
                status, counter = self._faults.resend(request), Counter.REROUTED
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
                self._refusals.fail_request(request, failed, Header.SUBMIT_REQUEST)
        self._send_batches(Header.SUBMIT_BATCH)
        if queue.depth and not self._router.n_accepting:
            mask = self._mask
            for request in self._faults.in_order(
                lambda r: r.rank < 0 and queue.holds(r.server_rid & mask)
            ):
                if self._find(request.server_rid) is request:
                    self._unqueue(request, QueueOutcome.REFUSED)
                    self._refusals.fail_request(
                        request, ErrorCode.NO_ENGINES, Header.SUBMIT_REQUEST
                    )

    def _seen(self, client: _Client) -> None:
        """A message from ``client``: with nothing in flight, it is the idle one seen last."""
        if not client.requests:
            self._idle.move_to_end(client.identity)

    def _send_identity(self, identity: bytes) -> bool:
        """Start a message to a peer; False when it is gone (ROUTER_MANDATORY)."""
        try:
            self._sock.send(identity, zmq.SNDMORE)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    # -- failures ------------------------------------------------------------------------

    # -- answers and malformed input ------------------------------------------------------
