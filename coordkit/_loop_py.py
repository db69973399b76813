"""The reference loop core: the coordinator's tables and message handlers over pyzmq.

:class:`coordkit.Coordinator` owns the sockets, the thread and the timers and
drives this core, or its Cython twin (``_loop_c.pyx``). This one is the
oracle: both make the same decisions in the same order and put the same
frames on the wire, method for method under the same names.

The hot path (a SUBMIT out to an engine; an engine's batch of replies out to
their clients) comes first; the rare paths after it parse with the message
specs of :mod:`coordkit.protocol`. Requests are filed by ``server_rid &
mask``, and server ids are drawn exactly as the C index draws them (see
_add). An engine found gone on the hot path is only marked; its requests are
settled once the message at hand is done.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from . import _codec_py as codec
from . import protocol
from ._shared import (
    COPY_BELOW,
    ERROR_SLOTS,
    HEADER_SLOTS,
    INDEX_WINDOW_MIN,
    LATENCY_BUCKETS,
    Counter,
    EngineState,
    Options,
    PeerFormat,
    RateLimitedLog,
    RequestFlag,
    RouteStatus,
    detokenize,
    header_slot,
    latency_bucket,
    metrics_map,
    stats_map,
)
from .protocol import (
    BATCH_FEATURE,
    BLOCK_HASH_SIZE,
    CONTROL_HEADERS,
    CONTROL_TRANSITIONS,
    MAX_PARTS,
    Buffer,
    ControlState,
    ErrorCode,
    Header,
    MessageSpec,
    ProtocolError,
    error_text,
    header_name,
    packb,
    parse_connect,
    parse_engine_hello,
)

if TYPE_CHECKING:
    from ._routing_py import Router

__all__ = ["Loop"]

ALIVE, DRAINING, GONE = EngineState.ALIVE, EngineState.DRAINING, EngineState.GONE
PRODUCED, ABORTED = RequestFlag.PRODUCED, RequestFlag.ABORTED
SINGLE_FRAME, MULTIPART = PeerFormat.SINGLE_FRAME, PeerFormat.MULTIPART
_packer = msgpack.Packer()
_HEADER_BATCH = _packer.pack(int(Header.SUBMIT_BATCH))
_HEADER_REPLY_BATCH = _packer.pack(int(Header.REPLY_BATCH))


class _Client:
    __slots__ = ("identity", "coordkit", "batch", "format", "inflight", "last_seen")

    def __init__(self, identity: bytes):
        self.identity = identity
        self.coordkit = False  # may be sent ERROR and STATS_REPLY
        self.batch = False  # granted batches: may send SUBMIT_BATCH, is sent REPLY_BATCH
        self.format = MULTIPART
        self.inflight = 0
        self.last_seen = 0  # the message count when it last sent one


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


class _Request:
    __slots__ = ("server_rid", "client", "client_rid", "rank", "flags", "kept", "work", "submitted")

    def __init__(self, server_rid: int, client: _Client, client_rid: int):
        self.server_rid = server_rid
        self.client = client
        self.client_rid = client_rid
        self.rank = -1  # -1 while it is being re-sent or failed
        self.flags = 0
        # To re-send it if its engine dies: the rewritten metadata and the prompt,
        # or (None, the whole frame) for a request that came as a single frame.
        self.kept: tuple[bytes | None, zmq.Frame | bytes] | None = None
        self.work = 0  # the work units its rank was charged for it (router.charged)
        self.submitted = 0.0  # with a request_timeout or measure_latency: when it was submitted


class _Inbound:
    """A new request as it came, to be put in the format of the engine chosen for it."""

    __slots__ = (
        "header",
        "frames",
        "single",
        "meta",
        "length",
        "rest",
        "payload",
        "batched",
        "prompt",
        "params",
        "single_ok",
        "multi_ok",
    )

    def __init__(self, header: int, frames: list[zmq.Frame], single: bool):
        self.header = header
        self.frames = frames
        self.single = single  # frames[1] is the whole request: [20, client_rid, prompt, params]
        self.meta = b""  # multipart: the metadata rewritten with the server id
        # Multipart: the metadata's length, what follows its rid (the params, and a
        # KV submission's kv_meta), and where the payload frames start in frames.
        self.length = 3
        self.rest: Buffer = b""
        self.payload = 2
        self.batched = False  # an entry of a SUBMIT_BATCH: a batched engine takes it later
        # Single frame: where the prompt starts in frames[1], and where the params
        # do (0 until parsed).
        self.prompt = 0
        self.params = 0
        self.single_ok = True  # may go to a single-frame engine
        self.multi_ok = True  # may go to a multipart engine


class Loop:
    """The reference loop core; :class:`coordkit.Coordinator` builds and drives it."""

    implementation = "py"

    def __init__(
        self, options: Options, router: Router, router_socket: zmq.Socket, wake_socket: zmq.Socket
    ):
        self._router = router
        self._sock = router_socket
        self._wake = wake_socket
        self._options = options
        self._log = RateLimitedLog()
        self._stopping = False
        self._mask = options.index_size - 1
        self._window = self._window_min = min(options.index_size, INDEX_WINDOW_MIN)
        self._requests: dict[int, _Request] = {}  # server_rid & mask -> request
        self._by_client: dict[tuple[bytes, int], _Request] = {}
        self._next_rid = 0
        self._clients: dict[bytes, _Client] = {}
        self._engines: list[_Engine] = []
        self._engine_by_identity: dict[bytes, _Engine] = {}
        self._gone: list[tuple[_Engine, str]] = []  # found gone, not settled yet
        # The SUBMIT_BATCH at hand: (request, server_rid, rank, prompt, params) of
        # each entry routed to a batched engine, sent once every entry is routed.
        self._engine_batch: list[tuple[_Request, int, int, zmq.Frame, Buffer]] = []
        # The reply batch at hand: (client_rid, body) by batched client, sent once
        # every entry is read.
        self._client_batch: dict[_Client, list[tuple[int, Any]]] = {}
        # The megatron-core dialect: peers that are not coordkit's speak single frames.
        self._megatron_core = options.dialect == "megatron-core"
        # the prefix policy hashes the prompts of single-frame SUBMITs
        self._computes_hashes = self._megatron_core and router.policy == "prefix"
        # engines not gone of each format, counted at each registration: which checks to make
        self._n_single_engines = self._n_multipart_engines = 0
        # With a request_timeout: the requests in submission (so deadline) order.
        self._queue: OrderedDict[int, _Request] | None = (
            OrderedDict() if options.request_timeout else None
        )
        self._control_state = ControlState.RUNNING
        self._counters = [0] * len(Counter)
        self._messages = 0
        # Messages and bytes by header slot, received ([0]) and sent ([1]).
        self._traffic_messages = [[0] * HEADER_SLOTS for _ in range(2)]
        self._traffic_bytes = [[0] * HEADER_SLOTS for _ in range(2)]
        self._failed = [0] * ERROR_SLOTS  # accepted requests ended with ERROR(code)
        self._refused = [0] * ERROR_SLOTS  # messages refused with ERROR(code)
        # measure_latency: SUBMIT to final, SUBMIT to the first partial or final.
        self._latency: dict[str, list[Any]] | None = None
        if options.measure_latency:
            self._latency = {
                name: [[0] * (len(LATENCY_BUCKETS) + 1), 0.0] for name in ("final", "first_reply")
            }
        self._poller = zmq.Poller()
        self._poller.register(router_socket, zmq.POLLIN)
        self._poller.register(wake_socket, zmq.POLLIN)

    # -- what the Coordinator calls ------------------------------------------------------

    def serve(self, timeout: float) -> bool:
        """Handle messages for up to ``timeout`` seconds; False once the loop must stop."""
        deadline = time.monotonic() + timeout
        while not self._stopping:
            wait_ms = int((deadline - time.monotonic()) * 1000)
            if wait_ms <= 0:
                return True
            ready = dict(self._poller.poll(wait_ms))
            if self._wake in ready:
                self._wake.recv()
                self._stopping = True
            elif self._sock in ready:
                self._drain()
        return False

    def expire(self, now: float) -> None:
        """Declare gone the engines whose drain or heartbeat timed out, end the
        requests in flight longer than request_timeout, and settle what that left."""
        timeout = self._options.heartbeat_timeout
        for engine in self._engines:
            if engine.state == GONE:
                continue
            if engine.state == DRAINING:
                if now >= engine.drain_deadline:
                    self._mark_gone(engine, "drain timed out")
            elif timeout and engine.heartbeats and now - engine.last_heartbeat > timeout:
                self._mark_gone(engine, "no heartbeat")
        # The oldest first: only the requests that are due are touched.
        deadline = now - self._options.request_timeout
        while self._queue and (oldest := next(iter(self._queue.values()))).submitted < deadline:
            self._time_out(oldest)
        self._settle()

    def shutdown(self) -> None:
        """End every request still in flight with ERROR(SHUTTING_DOWN): its terminal reply."""
        for request in self._in_order(lambda r: True):
            if self._find(request.server_rid) is request:
                self._fail_request(request, ErrorCode.SHUTTING_DOWN, Header.SHUTDOWN)
        self._settle()

    def stats(self) -> dict[str, Any]:
        return stats_map(
            implementation=self.implementation,
            policy=self._router.policy,
            messages=self._messages,
            inflight=len(self._requests),
            clients=len(self._clients),
            control_state=self._control_state,
            counters=list(self._counters),
            engines=[
                (e.rank, e.identity, e.state, self._router.pending(e.rank))
                for e in list(self._engines)
            ],
        )

    def count_auth_refused(self) -> None:
        """A peer refused at the CURVE handshake (from the thread that watches for them)."""
        self._counters[Counter.AUTH_REFUSED] += 1

    def metrics(self) -> dict[str, Any]:
        """Traffic by header and direction, outcomes by error code, latencies."""
        latency = None
        if self._latency is not None:
            latency = {name: (list(b), total) for name, (b, total) in self._latency.items()}
        return metrics_map(
            traffic=[
                (direction, slot, self._traffic_messages[direction][slot], size)
                for direction in range(2)
                for slot, size in enumerate(self._traffic_bytes[direction])
            ],
            failed=list(self._failed),
            refused=list(self._refused),
            latency=latency,
            prefix=self._router.prefix_counts,
        )

    # -- the hot path --------------------------------------------------------------------

    def _drain(self) -> None:
        """Handle every message waiting, one at a time."""
        receive = self._sock.recv_multipart
        while not self._stopping:
            try:
                frames = receive(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._messages += 1
            self._handle(frames)
            if self._gone:
                self._settle()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """Dispatch a message (frame 0 is the sender's routing id)."""
        identity = frames[0].bytes
        engine = self._engine_by_identity.get(identity)
        if len(frames) == 2 and len(frames[1]) == 0:
            self._register(identity, engine)
            return
        client = self._clients.get(identity)
        try:
            if len(frames) > MAX_PARTS:
                raise ProtocolError(f"more than {MAX_PARTS} frames")
            header = codec.read_header(frames[1].buffer)[0]
        except ProtocolError as exc:
            self._count_in(-1, frames)
            self._malformed(client, None, -1, str(exc), frames)
            return
        self._count_in(header, frames)
        if engine is not None:
            self._from_engine(engine, header, frames)
        elif header == Header.CONNECT:
            self._connect(identity, client, frames)
        elif header == Header.ENGINE_HELLO and client is None:
            self._engine_hello(identity, None, frames)
        elif client is None:
            self._counters[Counter.NOT_CONNECTED] += 1
            self._log.warn(
                "not_connected", f"dropped {header_name(header)} from a peer that never connected"
            )
        else:
            client.last_seen = self._messages
            self._from_client(client, header, frames)

    def _from_client(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        if header == Header.SUBMIT_REQUEST and client.format == SINGLE_FRAME:
            self._submit_single(client, frames)
        elif header == Header.SUBMIT_REQUEST or header == Header.SUBMIT_REQUEST_WITH_KV:
            if client.format == SINGLE_FRAME:  # 0.19 has no KV submission
                self._refuse(client, None, ErrorCode.UNKNOWN_HEADER, header, Counter.UNKNOWN_HEADER)
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
        hashes = frames[2 + n_payload].buffer if n_frames == n_payload + 1 else None
        if (
            length != 2 + n_payload
            or not n_payload <= n_frames <= n_payload + 1
            or (hashes is not None and len(hashes) % BLOCK_HASH_SIZE)
        ):
            self._malformed(client, rid, header, "bad frame layout", frames)
            return
        inbound = _Inbound(header, frames, False)
        inbound.length = length
        inbound.rest = meta[offset:]
        # A single-frame engine takes [20, rid, prompt, params]: a str or array, and a map.
        inbound.single_ok = (
            self._n_single_engines > 0
            and header == Header.SUBMIT_REQUEST
            and _parses(codec.check_prompt, frames[2].buffer)
            and _parses(codec.check_map, inbound.rest)
        )
        self._accept(client, rid, hashes, codec.prompt_tokens(frames[2].buffer), inbound)

    def _submit_batch(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """SUBMIT_BATCH: each entry down the path of a SUBMIT_REQUEST; the entries
        routed to batched engines leave as one ENGINE_SUBMIT_BATCH per engine once
        every entry is routed (see _send_engine_batches)."""
        header = Header.SUBMIT_BATCH
        if not client.batch:
            self._malformed(client, None, header, "batches not granted", frames)
            return
        meta = frames[1].buffer
        try:
            entries = codec.read_submit_batch(meta)
        except ProtocolError as exc:
            self._malformed_batch(client, exc.rids, str(exc), frames)
            return
        if sum(1 + hashed for *_, hashed in entries) != len(frames) - 2:
            self._malformed_batch(client, [rid for rid, *_ in entries], "bad frame layout", frames)
            return
        part = 2
        for rid, offset, size, hashed in entries:
            if self._clients.get(client.identity) is not client:
                break  # found gone meanwhile
            hashes = frames[part + 1].buffer if hashed else None
            if hashes is not None and len(hashes) % BLOCK_HASH_SIZE:
                self._malformed(client, rid, header, "bad frame layout", frames)
            else:
                inbound = _Inbound(Header.SUBMIT_REQUEST, frames, False)
                inbound.rest = meta[offset : offset + size]
                inbound.payload = part
                inbound.batched = True
                prompt = frames[part].buffer
                inbound.single_ok = (
                    self._n_single_engines > 0
                    and _parses(codec.check_prompt, prompt)
                    and _parses(codec.check_map, inbound.rest)
                )
                self._accept(client, rid, hashes, codec.prompt_tokens(prompt), inbound)
            part += 1 + hashed
        self._send_engine_batches()

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

    def _send_engine_batches(self) -> None:
        """The entries routed to batched engines: one ENGINE_SUBMIT_BATCH per engine,
        in the order the engines were first chosen, the prompts as the same frames.
        An entry re-sent or ended meanwhile is left out; an engine found gone here
        leaves its requests to _settle, as any engine found gone."""
        by_rank: dict[int, list[tuple[int, zmq.Frame, Buffer]]] = {}
        for request, server_rid, rank, prompt, params in self._engine_batch:
            if self._find(server_rid) is request and request.rank == rank:
                by_rank.setdefault(rank, []).append((server_rid, prompt, params))
        self._engine_batch.clear()
        for rank, entries in by_rank.items():
            engine = self._engines[rank]
            if engine.state == GONE:  # its requests are settled
                continue
            if self._send_identity(engine.identity):
                self._send_engine_batch(entries)
            else:
                self._mark_gone(engine, "unreachable")

    def _send_engine_batch(self, entries: list[tuple[int, zmq.Frame, Buffer]]) -> None:
        """One engine's ENGINE_SUBMIT_BATCH after its routing id: the metadata, then
        the prompts as the same frames."""
        head = [
            _packer.pack_array_header(2),
            _HEADER_BATCH,
            _packer.pack_array_header(len(entries)),
        ]
        head += [b"\x92" + _packer.pack(rid) + bytes(params) for rid, _, params in entries]
        out: list[Any] = [b"".join(head), *(prompt for _, prompt, _ in entries)]
        self._count_out(Header.SUBMIT_BATCH, out)
        self._sock.send_multipart(out, copy=False)

    def _submit_single(self, client: _Client, frames: list[zmq.Frame]) -> None:
        """A new request in one frame: [20, client_rid, prompt, params] (Megatron-Core 0.19).

        Read as far as its request id: to a single-frame engine the rest goes as it
        came. The prompt and the params are found (walking the prompt) only when a
        multipart engine may take it, or the prefix policy hashes the prompt.
        """
        data = frames[1].buffer
        try:
            _, rid, prompt = codec.read_single_head(data)
            params = 0
            if len(frames) != 2:
                raise ProtocolError("bad frame layout", rid)
            if self._n_multipart_engines > 0 or self._computes_hashes:
                _, rid, prompt, params = codec.read_single_submit(data)
        except ProtocolError as exc:
            self._malformed(client, exc.rid, Header.SUBMIT_REQUEST, str(exc), frames)
            return
        inbound = _Inbound(Header.SUBMIT_REQUEST, frames, True)
        inbound.prompt = prompt
        inbound.params = params
        inbound.multi_ok = params != 0
        hashes = None
        if self._computes_hashes:
            try:
                hashes = codec.prompt_hashes(data[prompt:params], self._options.block_size)
            except ProtocolError:  # no token ids (a str prompt): routed by load
                pass
        self._accept(client, rid, hashes, codec.prompt_tokens(data[prompt:]), inbound)

    def _accept(
        self,
        client: _Client,
        rid: int,
        hashes: Buffer | None,
        tokens: int,
        inbound: _Inbound,
    ) -> None:
        """A request that parsed: refused (a duplicate id, a full table), or given a
        server id and an engine, and the frames on to it."""
        header = inbound.header
        if (client.identity, rid) in self._by_client:
            self._refuse(
                client, rid, ErrorCode.DUPLICATE_REQUEST, header, Counter.DUPLICATE_REQUEST
            )
            return
        if len(self._requests) >= self._options.max_inflight:
            self._refuse(client, rid, ErrorCode.BUSY, header, Counter.BUSY)
            return
        request = self._add(client, rid)
        client.inflight += 1
        if self._queue is not None or self._latency is not None:
            request.submitted = time.monotonic()
        if self._queue is not None:
            self._queue[request.server_rid] = request
        frames = inbound.frames
        if not inbound.single:
            inbound.meta = codec.write_submit(
                header, inbound.length, request.server_rid, inbound.rest
            )
        # A KV submission's source blocks are tied to the engine chosen now: never re-sent.
        if header == Header.SUBMIT_REQUEST and self._options.keep_prompts:
            kept = frames[1] if inbound.single else frames[inbound.payload]
            request.kept = (
                None if inbound.single else inbound.meta,
                kept.bytes if len(kept) < COPY_BELOW else kept,
            )
        status = self._route(request, hashes, tokens, inbound)
        while status == RouteStatus.ENGINE_GONE:
            # The gone engine's requests are older than this one: they go first.
            self._settle()
            if self._find(request.server_rid) is not request:  # its client went away meanwhile
                return
            status = self._route(request, hashes, tokens, inbound)
        if status == RouteStatus.SENT:
            self._counters[Counter.SUBMITTED] += 1
            return
        self._forget(request)
        self._refuse(client, rid, _refusal(status), header, _REFUSAL_COUNTERS[status])

    def _route(
        self, request: _Request, hashes: Buffer | None, tokens: int, inbound: _Inbound
    ) -> RouteStatus:
        """Send a new request to the engine chosen for it, in its format; an entry of
        a SUBMIT_BATCH bound for a batched engine joins that engine's batch."""
        rank, status = self._pick_engine(
            hashes, tokens, inbound.single_ok, inbound.multi_ok, inbound.batched
        )
        if status == RouteStatus.SENT:
            request.rank = rank
            request.work = self._router.charged
            engine = self._engines[rank]
            if inbound.batched and engine.batch:
                prompt = inbound.frames[inbound.payload]
                self._engine_batch.append((request, request.server_rid, rank, prompt, inbound.rest))
            else:
                self._send_new(request, engine, inbound)
        return status

    def _send_new(self, request: _Request, engine: _Engine, inbound: _Inbound) -> None:
        """The frames of a new request after the engine's routing id, in its format."""
        data = inbound.frames[1].buffer
        if inbound.single and engine.format == SINGLE_FRAME:  # as it came, behind a new head
            out = _submit_frames(True, request.server_rid, data[inbound.prompt :], b"")
        elif inbound.single:  # split at the field boundary
            prompt = data[inbound.prompt : inbound.params]
            out = _submit_frames(False, request.server_rid, prompt, data[inbound.params :])
        elif engine.format == SINGLE_FRAME:
            prompt = inbound.frames[inbound.payload].buffer
            out = _submit_frames(True, request.server_rid, prompt, inbound.rest)
        else:  # the metadata and the payload frames as themselves
            n_payload = 1 if inbound.header == Header.SUBMIT_REQUEST else 2
            out = [inbound.meta, *inbound.frames[inbound.payload : inbound.payload + n_payload]]
        self._count_out(inbound.header, out)
        self._sock.send_multipart(out, copy=False)

    def _resend(self, request: _Request) -> RouteStatus:
        """Send a request whose engine died to another, from what it kept; a RouteStatus."""
        assert request.kept is not None
        meta, kept = request.kept
        data = _view(kept)
        if meta is None:  # a single frame
            prompt = codec.read_single_head(data)[2]
            tokens = codec.prompt_tokens(data[prompt:])
            single_ok = True
            multi_ok = self._n_multipart_engines > 0 and _parses(codec.read_single_submit, data)
        else:
            tokens = codec.prompt_tokens(data)
            multi_ok = True
            params = memoryview(meta)[codec.read_submit(meta)[3] :]
            single_ok = (
                self._n_single_engines > 0
                and _parses(codec.check_prompt, data)
                and _parses(codec.check_map, params)
            )
        status = RouteStatus.ENGINE_GONE
        while status == RouteStatus.ENGINE_GONE:  # that one waits in the queue of gone engines
            rank, status = self._pick_engine(None, tokens, single_ok, multi_ok)
        if status == RouteStatus.SENT:
            request.rank = rank
            request.work = self._router.charged
            self._send_kept(request, self._engines[rank])
        return status

    def _send_kept(self, request: _Request, engine: _Engine) -> None:
        """A kept request's frames after the engine's routing id, in the engine's format."""
        assert request.kept is not None
        meta, kept = request.kept
        data = _view(kept)
        single_frame = engine.format == SINGLE_FRAME
        if meta is None and single_frame:
            prompt = codec.read_single_head(data)[2]
            out = _submit_frames(True, request.server_rid, data[prompt:], b"")
        elif meta is None:  # _resend read it whole: it splits
            _, _, prompt, params = codec.read_single_submit(data)
            out = _submit_frames(False, request.server_rid, data[prompt:params], data[params:])
        elif single_frame:
            meta_params = memoryview(meta)[codec.read_submit(meta)[3] :]
            out = _submit_frames(True, request.server_rid, data, meta_params)
        else:  # the kept metadata (the server id in it already) and the prompt
            out = [meta, kept]
        self._count_out(Header.SUBMIT_REQUEST, out)
        self._sock.send_multipart(out, copy=False)

    def _pick_engine(
        self,
        hashes: Buffer | None,
        tokens: int,
        single_ok: bool,
        multi_ok: bool,
        batched: bool = False,
    ) -> tuple[int, RouteStatus]:
        """The router's choice, its routing id sent (the request's frames follow),
        unless ``batched`` and the engine takes batches (the batch is sent later).
        An unreachable choice is marked gone: ENGINE_GONE; one whose format the
        request cannot be put in: UNSENDABLE."""
        rank = self._router.choose(hashes, time.monotonic(), tokens)
        if rank < 0:
            if self._router.n_accepting == 0:
                return rank, RouteStatus.NO_ENGINES
            return rank, RouteStatus.ALL_BUSY
        engine = self._engines[rank]
        if not (single_ok if engine.format == SINGLE_FRAME else multi_ok):
            self._router.release(rank, self._router.charged)
            return rank, RouteStatus.UNSENDABLE
        if (batched and engine.batch) or self._send_identity(engine.identity):
            return rank, RouteStatus.SENT
        self._router.release(rank, self._router.charged)
        self._mark_gone(engine, "unreachable")
        return rank, RouteStatus.ENGINE_GONE

    def _from_engine(self, engine: _Engine, header: int, frames: list[zmq.Frame]) -> None:
        if engine.format == SINGLE_FRAME and header == Header.ENGINE_REPLY:
            self._forward_single_replies(engine, frames)
        elif engine.format != SINGLE_FRAME and (
            header == Header.ENGINE_REPLY or header == Header.ENGINE_REPLY_PARTIAL
        ):
            self._forward_replies(engine, frames)
        else:
            self._from_engine_rarely(engine, header, frames)

    def _forward_replies(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """Each entry of an engine's batch to its request's client, the body as itself."""
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
                if engine.coordkit:
                    self._reject_entry(engine, server_rid, ErrorCode.UNKNOWN_REQUEST, header)
                continue
            self._finish(request, final, now)
            out: Any = body
            if needs_detokenize and self._options.detokenizer is not None:
                out = self._detokenized(body.buffer)
            if request.client.batch:
                self._client_batch.setdefault(request.client, []).append((request.client_rid, out))
            elif not self._deliver(request.client, header, request.client_rid, out):
                self._client_gone(request.client)
        self._send_client_batches(final)

    def _send_client_batches(self, final: bool) -> None:
        """The entries of the reply batch at hand bound for batched clients: one
        REPLY_BATCH per client, in the order the clients first came, the bodies
        as the same frames."""
        batches = list(self._client_batch.items())
        self._client_batch.clear()
        for client, entries in batches:
            if self._send_identity(client.identity):
                self._send_client_batch(final, entries)
            else:
                self._client_gone(client)

    def _send_client_batch(self, final: bool, entries: list[tuple[int, Any]]) -> None:
        """One client's REPLY_BATCH after its routing id: the metadata, then the
        bodies as the same frames."""
        flag = b"\xc3" if final else b"\xc2"
        head = [_packer.pack_array_header(2), _HEADER_REPLY_BATCH]
        head.append(_packer.pack_array_header(len(entries)))
        head += [b"\x92" + _packer.pack(rid) + flag for rid, _ in entries]
        out: list[Any] = [b"".join(head), *(body for _, body in entries)]
        self._count_out(Header.REPLY_BATCH, out)
        self._sock.send_multipart(out, copy=False)

    def _forward_single_replies(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """A 0.19 engine's finished requests, each map to its request's client; those
        bound for batched clients leave as one REPLY_BATCH per client."""
        data = frames[1].buffer
        try:
            if len(frames) != 2:
                raise ProtocolError("bad frame layout")
            entries = codec.read_single_reply(data)
        except ProtocolError as exc:
            self._malformed(None, None, Header.ENGINE_REPLY, str(exc), frames)
            return
        now = time.monotonic() if self._latency is not None else 0.0
        for start, end, server_rid, error in entries:
            if error is not None:
                self._reject_entry(engine, None, ErrorCode.MALFORMED, Header.ENGINE_REPLY)
                continue
            assert server_rid is not None  # read whenever there is no error
            request = self._find(server_rid)
            if request is None or request.rank != engine.rank:
                self._counters[Counter.UNKNOWN_REQUEST] += 1
                continue
            self._finish(request, True, now)
            body: Buffer = data[start:end]
            if self._options.detokenizer is not None:  # as 0.19's coordinator: every one
                body = self._detokenized(body)
            if request.client.batch:
                self._client_batch.setdefault(request.client, []).append((request.client_rid, body))
            elif not self._deliver(request.client, Header.ENGINE_REPLY, request.client_rid, body):
                self._client_gone(request.client)
        self._send_client_batches(True)

    def _finish(self, request: _Request, final: bool, now: float) -> None:
        """A reply for ``request`` arrived: timed, counted, and a final forgets it."""
        if self._latency is not None:
            if not request.flags & PRODUCED:
                self._observe("first_reply", now - request.submitted)
            if final:
                self._observe("final", now - request.submitted)
        if final:
            self._forget(request)
            self._counters[Counter.REPLIES] += 1
        else:
            request.flags |= PRODUCED
            self._counters[Counter.PARTIALS] += 1

    def _deliver(self, client: _Client, header: int, client_rid: int, body: Any) -> bool:
        """One reply to its client in the client's format; False when the client is gone.

        A 0.19 client takes finals only, each ``[21, client_rid, <map>]``: a partial is
        not sent, and a final whose body is not a map cannot be (counted, dropped).
        """
        if client.format == SINGLE_FRAME:
            if header != Header.ENGINE_REPLY:
                return True
            if not _parses(codec.check_map, body):
                self._counters[Counter.MALFORMED_ENTRIES] += 1
                return True
            if not self._send_identity(client.identity):
                return False
            out = [codec.write_submit(header, 3, client_rid, body)]
        else:
            if not self._send_identity(client.identity):
                return False
            out = [codec.write_header_int(header, client_rid), body]
        self._count_out(header, out)
        self._sock.send_multipart(out, copy=False)
        return True

    def _add(self, client: _Client, client_rid: int) -> _Request:
        """A new request: the next server id whose position is free, drawn below
        the window while few requests are in flight (as ck_requests_add does)."""
        rid, mask, live = self._next_rid, self._mask, len(self._requests)
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
        self._by_client[(client.identity, client_rid)] = request
        return request

    def _remove(self, request: _Request) -> None:
        del self._requests[request.server_rid & self._mask]
        del self._by_client[(request.client.identity, request.client_rid)]

    def _find(self, server_rid: int) -> _Request | None:
        request = self._requests.get(server_rid & self._mask)
        return request if request is not None and request.server_rid == server_rid else None

    def _forget(self, request: _Request) -> None:
        """Take a request out of every table and count; a draining engine whose
        last request this was is gone."""
        request.client.inflight -= 1
        if self._queue is not None:
            del self._queue[request.server_rid]
        self._remove(request)
        if request.rank < 0:
            return
        self._router.release(request.rank, request.work)
        engine = self._engines[request.rank]
        if engine.state == DRAINING and self._router.pending(engine.rank) == 0:
            engine.state = GONE

    def _count_in(self, header: int, frames: list[zmq.Frame]) -> None:
        """Count a received message (header -1: unreadable)."""
        slot = header_slot(header)
        self._traffic_messages[0][slot] += 1
        self._traffic_bytes[0][slot] += sum(len(frame) for frame in frames[1:])

    def _count_out(self, header: int, frames: Any) -> None:
        slot = header_slot(header)
        self._traffic_messages[1][slot] += 1
        self._traffic_bytes[1][slot] += sum(len(frame) for frame in frames)

    def _observe(self, name: str, seconds: float) -> None:
        """One duration into a latency histogram: the first bucket whose bound it fits."""
        assert self._latency is not None
        histogram = self._latency[name]
        histogram[0][latency_bucket(seconds)] += 1
        histogram[1] += seconds

    def _mark_gone(self, engine: _Engine, reason: str) -> None:
        """Take an engine out of the pool now; its requests are settled after the
        message at hand (see _settle), so a failure never recurses into routing."""
        if engine.state == GONE:
            return
        if engine.state == ALIVE:
            self._router.remove_rank(engine.rank)
        engine.state = GONE
        self._counters[Counter.ENGINE_FAILURES] += 1
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
        else:
            self._refuse(client, None, ErrorCode.UNKNOWN_HEADER, header, Counter.UNKNOWN_HEADER)

    def _from_engine_rarely(self, engine: _Engine, header: int, frames: list[zmq.Frame]) -> None:
        if header == Header.HEARTBEAT:
            self._heartbeat(engine, frames)
        elif header == Header.ENGINE_HELLO:
            self._engine_hello(engine.identity, engine, frames)
        elif header == Header.DISCONNECT:
            self._disconnect(engine, frames)
        else:
            self._counters[Counter.UNKNOWN_HEADER] += 1
            self._log.warn(
                "unknown_header", f"dropped {header_name(header)} from engine {engine.rank}"
            )

    def _register(self, identity: bytes, engine: _Engine | None) -> None:
        """An engine announced itself (one empty frame): a new rank, or one coming
        back after it left or was declared gone."""
        if engine is not None and engine.state == ALIVE:
            self._counters[Counter.DUPLICATE_REGISTER] += 1
        else:
            self._new_engine(identity, engine)

    def _engine_hello(self, identity: bytes, engine: _Engine | None, frames: list[Any]) -> None:
        """ENGINE_HELLO: a coordkit engine registers, or says so once registered."""
        try:
            hello = parse_engine_hello(_buffers(frames))
        except ProtocolError as exc:
            self._malformed(None, None, Header.ENGINE_HELLO, str(exc), frames)
            return
        if engine is None or engine.state != ALIVE:
            engine = self._new_engine(identity, engine)
        if engine is not None:
            engine.coordkit = hello.coordkit
            engine.batch = hello.batch
            engine.format = MULTIPART
            self._count_formats()

    def _count_formats(self) -> None:
        """How many engines not gone speak each format: which checks a SUBMIT needs."""
        live = [engine for engine in self._engines if engine.state != GONE]
        self._n_single_engines = sum(engine.format == SINGLE_FRAME for engine in live)
        self._n_multipart_engines = len(live) - self._n_single_engines

    def _new_engine(self, identity: bytes, engine: _Engine | None) -> _Engine | None:
        """Put the sender in the pool: ``engine`` coming back, or a new rank (reusing
        a gone rank with nothing left in flight once the table is full); None when
        there is no room or the sender is a client."""
        if engine is None:
            if identity in self._clients:
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
                del self._engine_by_identity[self._engines[rank].identity]
                self._engines[rank] = _Engine(rank, identity)
            else:
                self._engines.append(_Engine(rank, identity))
            engine = self._engine_by_identity[identity] = self._engines[rank]
        engine.state = ALIVE
        engine.coordkit = False
        engine.batch = False
        engine.format = SINGLE_FRAME if self._megatron_core else MULTIPART
        engine.heartbeats = False
        self._router.add_rank(engine.rank)
        self._count_formats()
        return engine

    def _connect(self, identity: bytes, client: _Client | None, frames: list[zmq.Frame]) -> None:
        """CONNECT: a new client (or a repeated CONNECT), answered with CONNECT_ACK."""
        try:
            hello = parse_connect(_buffers(frames))
        except ProtocolError as exc:
            self._malformed(None, None, Header.CONNECT, str(exc), frames)
            return
        if client is not None:
            self._counters[Counter.DUPLICATE_CONNECT] += 1
        else:
            if len(self._clients) >= self._options.max_clients and not self._vacant_client():
                self._counters[Counter.TABLE_FULL] += 1
                self._refused[ErrorCode.BUSY] += 1
                if hello.coordkit:
                    self._counters[Counter.ERRORS_SENT] += 1
                    text = error_text(ErrorCode.BUSY, Header.CONNECT)
                    self._send(identity, protocol.ERROR.pack(None, ErrorCode.BUSY, text))
                return
            client = self._clients[identity] = _Client(identity)
        client.coordkit = hello.coordkit
        client.batch = hello.batch
        client.last_seen = self._messages
        client.format = SINGLE_FRAME if self._megatron_core and not hello.coordkit else MULTIPART
        if hello.batch:
            self._send(identity, protocol.CONNECT_ACK_BATCH.pack({BATCH_FEATURE: 1}))
        else:
            self._send(identity, protocol.CONNECT_ACK.pack())

    def _vacant_client(self) -> bool:
        """Make room for a client: the idle one seen longest ago gives up its place."""
        idle = [c for c in self._clients.values() if c.inflight == 0]
        if not idle:
            return False
        del self._clients[min(idle, key=lambda c: c.last_seen).identity]
        return True

    def _heartbeat(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        if self._parse(protocol.HEARTBEAT, None, Header.HEARTBEAT, frames) is None:
            return
        if engine.state != GONE:
            engine.heartbeats = True
            engine.last_heartbeat = time.monotonic()

    def _disconnect(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """DISCONNECT: no new work; its requests in flight may finish, for a while."""
        if self._parse(protocol.DISCONNECT, None, Header.DISCONNECT, frames) is None:
            return
        if engine.state != ALIVE:
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
        request = self._by_client.get((client.identity, message.rid))
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
        if request.flags & ABORTED:
            return
        request.flags |= ABORTED
        self._abort_at_engine(self._engines[request.rank], request.server_rid)

    def _abort_at_engine(self, engine: _Engine, server_rid: int) -> None:
        """ABORT_REQUEST to an engine; a 0.19 engine has none: the request runs to its end."""
        if engine.format == SINGLE_FRAME:
            return
        if not self._send(engine.identity, protocol.ABORT_REQUEST.pack(server_rid)):
            self._mark_gone(engine, "unreachable")

    def _release_kv(self, client: _Client, frames: list[zmq.Frame]) -> None:
        if self._parse(protocol.RELEASE_KV, client, Header.RELEASE_KV, frames) is not None:
            self._counters[Counter.RELEASE_KV] += 1
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
        if self._parse(protocol.STATS, client, Header.STATS, frames) is not None:
            if client.coordkit:
                self._send(client.identity, protocol.STATS_REPLY.pack(packb(self.stats())))

    def _parse(
        self, spec: MessageSpec, client: _Client | None, header: int, frames: list[zmq.Frame]
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
            if header == Header.RELEASE_KV and engine.format == SINGLE_FRAME:
                continue  # 0.19 has no KV transfer
            if not self._send(engine.identity, [frame]):
                self._mark_gone(engine, "unreachable")

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

    def _settle_engine(self, engine: _Engine, reason: str) -> None:
        """Each request of a gone engine, by server id: re-sent when it produced
        nothing and was kept, otherwise ended with ERROR(ENGINE_FAILED)."""
        self._log.warn("engine_failed", f"engine {engine.rank} gone ({reason})")
        for request in self._in_order(lambda r: r.rank == engine.rank):
            if self._find(request.server_rid) is not request or request.rank != engine.rank:
                continue  # ended meanwhile: its client went away
            self._router.release(engine.rank, request.work)
            request.rank = -1
            if request.flags & (PRODUCED | ABORTED) or request.kept is None:
                self._fail_request(request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
                continue
            status = self._resend(request)
            if status == RouteStatus.SENT:
                self._counters[Counter.REROUTED] += 1
            elif status == RouteStatus.UNSENDABLE:  # no engine left that speaks its format
                self._fail_request(request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
            else:
                self._fail_request(request, _refusal(status), Header.SUBMIT_REQUEST)

    def _in_order(self, keep: Any) -> list[_Request]:
        """The requests in flight for which ``keep`` holds, by server id."""
        return sorted((r for r in self._requests.values() if keep(r)), key=lambda r: r.server_rid)

    def _fail_request(self, request: _Request, code: ErrorCode, header: int) -> None:
        """End ``request`` with ERROR(code): its one terminal reply."""
        self._forget(request)
        self._failed[code] += 1
        if code == ErrorCode.ENGINE_FAILED:
            self._counters[Counter.ENGINE_FAILED] += 1
        if not self._send_error(request.client, request.client_rid, code, header):
            self._client_gone(request.client)

    def _time_out(self, request: _Request) -> None:
        """End a request in flight longer than request_timeout: ERROR(TIMED_OUT) to
        its client, ABORT to its engine (whose late final is then unknown, dropped)."""
        engine = self._engines[request.rank]
        self._counters[Counter.TIMED_OUT] += 1
        if not request.flags & ABORTED and engine.state != GONE:
            self._abort_at_engine(engine, request.server_rid)
        self._fail_request(request, ErrorCode.TIMED_OUT, Header.SUBMIT_REQUEST)

    def _reject_entry(self, engine: _Engine, rid: int | None, code: int, header: int) -> None:
        """An entry of an engine's batch that was not delivered: malformed ones are
        counted and logged, and a coordkit engine is told with an ERROR."""
        if code == ErrorCode.MALFORMED:
            self._counters[Counter.MALFORMED_ENTRIES] += 1
            what = f"malformed entry in {header_name(header)} from engine {engine.rank}"
            self._log.warn("malformed", what)
        if engine.coordkit:
            error = protocol.ERROR.pack(rid, code, error_text(code, header))
            if not self._send(engine.identity, error):
                self._mark_gone(engine, "unreachable")

    def _client_gone(self, client: _Client) -> None:
        """A client that cannot be reached: its requests are aborted at their
        engines and forgotten, and so is the client."""
        if self._clients.get(client.identity) is not client:
            return
        self._counters[Counter.CLIENT_GONE] += 1
        for request in self._in_order(lambda r: r.client is client):
            if self._find(request.server_rid) is not request:
                continue
            rank = request.rank
            self._forget(request)
            if request.flags & ABORTED or rank < 0 or self._engines[rank].state == GONE:
                continue
            self._abort_at_engine(self._engines[rank], request.server_rid)
        del self._clients[client.identity]

    # -- answers and malformed input ------------------------------------------------------

    def _send(self, identity: bytes, frames: list[Any]) -> bool:
        """Send one message to a peer; False when it is gone."""
        if not self._send_identity(identity):
            return False
        try:
            header = codec.read_header(frames[0])[0]
        except ProtocolError:
            header = -1
        self._count_out(header, frames)
        self._sock.send_multipart(frames, copy=False)
        return True

    def _send_error(self, client: _Client, rid: int | None, code: int, header: int) -> bool:
        """ERROR to a coordkit client (others cannot parse it); False when it is gone."""
        if not client.coordkit:
            return True
        self._counters[Counter.ERRORS_SENT] += 1
        return self._send(client.identity, protocol.ERROR.pack(rid, code, error_text(code, header)))

    def _refuse(
        self, client: _Client, rid: int | None, code: int, header: int, counter: Counter
    ) -> None:
        """Count a refused message and answer its client with ERROR(code)."""
        self._counters[counter] += 1
        self._refused[code] += 1
        if not self._send_error(client, rid, code, header):
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


def _parses(check: Callable[[Buffer], object], frame: Buffer) -> bool:
    try:
        check(frame)
    except ProtocolError:
        return False
    return True


def _submit_frames(single_frame: bool, rid: int, prompt: Buffer, params: Buffer) -> list[Any]:
    """A request from the bytes of its prompt and its params, in an engine's format:
    ``[20, rid, <prompt>, <params>]``, or ``[20, rid, <params>]`` and the prompt."""
    if single_frame:
        return [codec.write_single_submit(Header.SUBMIT_REQUEST, rid, prompt, params)]
    return [codec.write_submit(Header.SUBMIT_REQUEST, 3, rid, params), prompt]


def _view(kept: zmq.Frame | bytes) -> memoryview:
    """The bytes a request kept, without copying them."""
    return kept.buffer if isinstance(kept, zmq.Frame) else memoryview(kept)


def _buffers(frames: list[zmq.Frame]) -> list[memoryview]:
    """A message's frames after the routing id, for the specs to parse."""
    return [frame.buffer for frame in frames[1:]]
