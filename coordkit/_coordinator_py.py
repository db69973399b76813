"""The reference coordinator: the whole protocol in plain Python over pyzmq.

It is the oracle for the Cython loop (``_coordinator_c.pyx``): both make the
same decisions in the same order and put the same frames on the wire. What
it does, message by message, is described in DESIGN.md; the choices the
design leaves open are noted where they are made.

Request state lives in a table of ``table_size(max_inflight)`` slots indexed
by ``server_rid & mask``: server ids are handed out in increasing order,
skipping ids whose slot is still held by an older request, which is exactly
what the C slab does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from . import _codec_py as codec
from ._common import (
    CONTROL_TRANSITIONS,
    COPY_BELOW,
    MAX_PARTS,
    ControlState,
    Counter,
    LoopSockets,
    RateLimitedLog,
    build_stats,
    check_options,
    detokenize,
    error_frame,
    header_name,
    read_connect,
    table_size,
    valid_heartbeat,
)
from ._routing_py import Router
from .protocol import (
    BLOCK_HASH_SIZE,
    CONTROL_HEADERS,
    ErrorCode,
    Header,
    ProtocolError,
    packb,
)

__all__ = ["Coordinator"]

ALIVE, DRAINING, GONE = 0, 1, 2
_TIMER_INTERVAL = 0.05  # seconds between heartbeat / drain checks on an idle loop

Detokenizer = Callable[[list[int]], str]


class _Client:
    __slots__ = ("identity", "coordkit", "inflight", "last_seen")

    def __init__(self, identity: bytes, coordkit: bool, tick: int):
        self.identity = identity
        self.coordkit = coordkit
        self.inflight = 0
        self.last_seen = tick


class _Engine:
    __slots__ = ("rank", "identity", "state", "heartbeats", "last_heartbeat", "drain_deadline")

    def __init__(self, rank: int, identity: bytes):
        self.rank = rank
        self.identity = identity
        self.state = ALIVE
        self.heartbeats = False
        self.last_heartbeat = 0.0
        self.drain_deadline = 0.0


class _Request:
    __slots__ = (
        "server_rid",
        "client",
        "client_rid",
        "rank",
        "produced",
        "aborted",
        "meta",
        "prompt",
    )

    def __init__(self, server_rid: int, client: _Client, client_rid: int, rank: int):
        self.server_rid = server_rid
        self.client = client
        self.client_rid = client_rid
        self.rank = rank
        self.produced = False
        self.aborted = False
        self.meta: bytes | None = None  # kept to re-send the request if its engine dies
        self.prompt: zmq.Frame | bytes | None = None


class _Unroutable(Exception):
    def __init__(self, code: ErrorCode):
        self.code = code


class Coordinator:
    """A data-parallel coordinator bound to ``bind`` (pure-Python implementation)."""

    implementation = "py"

    def __init__(
        self,
        bind: str = "ipc:///tmp/coordkit.sock",
        *,
        policy: str = "least_loaded",
        max_inflight: int = 1_000_000,
        max_inflight_per_engine: int = 0,
        heartbeat_timeout: float = 10.0,
        drain_timeout: float = 30.0,
        max_message_size: int = 256 << 20,
        detokenizer: Detokenizer | None = None,
        seed: int = 0,
        prefix_alpha: float = 1.0,
        prefix_ttl: float = 600.0,
        prefix_max_entries: int = 1_000_000,
        max_clients: int = 65536,
        max_engines: int = 1024,
        keep_prompts: bool = True,
        context: zmq.Context | None = None,
    ):
        check_options(
            max_inflight=max_inflight,
            max_inflight_per_engine=max_inflight_per_engine,
            heartbeat_timeout=heartbeat_timeout,
            drain_timeout=drain_timeout,
            max_message_size=max_message_size,
            max_clients=max_clients,
            max_engines=max_engines,
        )
        self.policy = policy
        self.max_inflight = max_inflight
        self.heartbeat_timeout = heartbeat_timeout
        self.drain_timeout = drain_timeout
        self.max_clients = max_clients
        self.max_engines = max_engines
        self._detokenizer = detokenizer
        self.keep_prompts = keep_prompts
        self._router = Router(
            policy,
            max_engines,
            seed=seed,
            rank_cap=max_inflight_per_engine,
            prefix_alpha=prefix_alpha,
            prefix_ttl=prefix_ttl,
            prefix_max_entries=prefix_max_entries,
        )
        self._mask = table_size(max_inflight) - 1
        self._requests: dict[int, _Request] = {}  # slot -> request
        self._by_client: dict[tuple[bytes, int], _Request] = {}
        self._next_rid = 0
        self._clients: dict[bytes, _Client] = {}
        self._engines: list[_Engine] = []
        self._engine_by_identity: dict[bytes, _Engine] = {}
        self._state = ControlState.RUNNING
        self._counters = [0] * len(Counter)
        self._tick = 0
        self._log = RateLimitedLog()

        self._sockets = LoopSockets(bind, max_message_size, context)
        self._sock = self._sockets.router
        self.address = self._sockets.address
        self._thread: threading.Thread | None = None
        self._running = self._started = False

    # -- lifecycle ---------------------------------------------------------------

    def serve_forever(self) -> None:
        """Run the loop until SHUTDOWN or :meth:`stop`; then close the sockets."""
        if self._sockets.closed:
            raise RuntimeError("coordinator is closed")
        self._running = self._started = True
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._sockets.wake_recv, zmq.POLLIN)
        next_timer = time.monotonic() + _TIMER_INTERVAL
        try:
            while self._running:
                ready = dict(poller.poll(_TIMER_INTERVAL * 1000))
                if self._sockets.wake_recv in ready:
                    self._sockets.wake_recv.recv()
                    self._running = False
                    break
                if self._sock in ready:
                    self._drain()
                now = time.monotonic()
                if now >= next_timer:
                    self._run_timers(now)
                    next_timer = now + _TIMER_INTERVAL
        finally:
            self._finish()

    def start(self) -> None:
        """Run :meth:`serve_forever` on a background thread."""
        if self._thread is not None:
            raise RuntimeError("coordinator already started")
        self._thread = threading.Thread(target=self.serve_forever, name="coordkit", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop (from any thread) and wait for it when it runs on ours."""
        if not self._started:
            self._finish()
            return
        self._sockets.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _finish(self) -> None:
        """End of the loop: every request still in flight gets its terminal reply."""
        if self._sockets.closed:
            return
        for request in self._sorted_requests(lambda r: True):
            if self._lookup(request.server_rid) is request:  # not freed with a gone client
                self._fail(request, ErrorCode.SHUTTING_DOWN, Header.SHUTDOWN)
        self._sockets.close()

    # -- stats -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return build_stats(
            implementation=self.implementation,
            policy=self.policy,
            messages=self._tick,
            inflight=len(self._requests),
            clients=len(self._clients),
            control_state=self._state,
            counters=list(self._counters),
            engines=[
                (e.rank, e.identity, e.state, self._router.pending(e.rank))
                for e in list(self._engines)
            ],
        )

    # -- the loop ----------------------------------------------------------------

    def _drain(self) -> None:
        recv = self._sock.recv_multipart
        while True:
            try:
                frames = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._tick += 1
            self._handle(frames)
            if not self._running:
                return

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        engine = self._engine_by_identity.get(identity)
        if len(frames) == 2 and len(frames[1]) == 0:
            self._register(identity, engine)
            return
        client = self._clients.get(identity)
        try:
            if len(frames) > MAX_PARTS:
                raise ProtocolError(f"more than {MAX_PARTS} frames")
            header, length, end = codec.read_header(frames[1].buffer)
        except ProtocolError as exc:
            self._bad(identity, None, ErrorCode.MALFORMED, -1, str(exc), client)
            return
        if engine is not None:
            self._from_engine(engine, header, frames, length, end)
            return
        if header == Header.CONNECT:
            self._connect(identity, client, frames, length, end)
        elif client is None:
            self._count(Counter.NOT_CONNECTED)
            self._log.warn(
                "not_connected", f"dropped {header_name(header)} from a peer that never connected"
            )
        else:
            client.last_seen = self._tick
            self._from_client(client, header, frames, length, end)

    def _from_engine(
        self, engine: _Engine, header: int, frames: list[zmq.Frame], length: int, end: int
    ) -> None:
        if header == Header.ENGINE_REPLY or header == Header.ENGINE_REPLY_PARTIAL:
            self._reply(engine, frames)
        elif header == Header.HEARTBEAT:
            self._heartbeat(engine, frames)
        elif header == Header.DISCONNECT:
            if self._exact(frames, length, end):
                self._disconnect(engine)
            else:
                self._bad(engine.identity, None, ErrorCode.MALFORMED, header, "bad DISCONNECT")
        else:
            self._count(Counter.UNKNOWN_HEADER)
            self._log.warn(
                "unknown_header", f"dropped {header_name(header)} from engine {engine.rank}"
            )

    def _from_client(
        self, client: _Client, header: int, frames: list[zmq.Frame], length: int, end: int
    ) -> None:
        if header == Header.SUBMIT_REQUEST or header == Header.SUBMIT_REQUEST_WITH_KV:
            self._submit(client, header, frames)
        elif header == Header.ABORT_REQUEST:
            self._abort(client, frames)
        elif header == Header.RELEASE_KV:
            self._release_kv(client, frames)
        elif header in CONTROL_HEADERS:
            self._control(client, header, frames, length, end)
        elif header == Header.SHUTDOWN:
            if self._simple(client, header, frames, length, end):
                self._running = False
        elif header == Header.STATS:
            if self._simple(client, header, frames, length, end) and client.coordkit:
                self._send(client.identity, [packb([Header.STATS_REPLY]), packb(self.stats())])
        else:
            self._count(Counter.UNKNOWN_HEADER)
            self._error(client, None, ErrorCode.UNKNOWN_HEADER, header)

    # -- peers ---------------------------------------------------------------------

    def _register(self, identity: bytes, engine: _Engine | None) -> None:
        if engine is not None:
            if engine.state == ALIVE:
                self._count(Counter.DUPLICATE_REGISTER)
                return
            engine.state = ALIVE  # an engine that left or was declared gone comes back
            engine.heartbeats = False
            self._router.add_rank(engine.rank)
            return
        if identity in self._clients:
            self._bad(
                identity, None, ErrorCode.MALFORMED, -1, "a client sent an engine registration"
            )
            return
        rank = len(self._engines)
        if rank == self.max_engines:
            rank = next(
                (
                    e.rank
                    for e in self._engines
                    if e.state == GONE and not self._router.pending(e.rank)
                ),
                -1,
            )
            if rank < 0:
                self._count(Counter.TABLE_FULL)
                self._log.warn("engines_full", "engine table full: registration dropped")
                return
            del self._engine_by_identity[self._engines[rank].identity]
            self._engines[rank] = _Engine(rank, identity)
        else:
            self._engines.append(_Engine(rank, identity))
        self._engine_by_identity[identity] = self._engines[rank]
        self._router.add_rank(rank)

    def _connect(
        self,
        identity: bytes,
        client: _Client | None,
        frames: list[zmq.Frame],
        length: int,
        end: int,
    ) -> None:
        coordkit = read_connect(len(frames) - 1, frames[1].buffer, length, end)
        if coordkit is None:
            self._bad(identity, None, ErrorCode.MALFORMED, Header.CONNECT, "bad CONNECT")
            return
        if client is not None:
            self._count(Counter.DUPLICATE_CONNECT)
            client.coordkit = coordkit
            client.last_seen = self._tick
        else:
            if len(self._clients) >= self.max_clients and not self._evict_idle_client():
                self._count(Counter.TABLE_FULL)
                if coordkit:
                    self._count(Counter.ERRORS_SENT)
                    self._send(identity, [error_frame(None, ErrorCode.BUSY, Header.CONNECT)])
                return
            self._clients[identity] = _Client(identity, coordkit, self._tick)
        self._send(identity, [codec.write_header(Header.CONNECT_ACK)])

    def _evict_idle_client(self) -> bool:
        idle = [c for c in self._clients.values() if c.inflight == 0]
        if not idle:
            return False
        del self._clients[min(idle, key=lambda c: c.last_seen).identity]
        return True

    def _heartbeat(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        try:
            metadata = codec.decode(frames[1].buffer)
        except ProtocolError:
            metadata = None
        if not valid_heartbeat(len(frames) - 1, metadata):
            self._bad(engine.identity, None, ErrorCode.MALFORMED, Header.HEARTBEAT, "bad HEARTBEAT")
            return
        if engine.state != GONE:
            engine.heartbeats = True
            engine.last_heartbeat = time.monotonic()

    def _disconnect(self, engine: _Engine) -> None:
        if engine.state != ALIVE:
            return
        self._router.remove_rank(engine.rank)
        engine.state = DRAINING
        engine.drain_deadline = time.monotonic() + self.drain_timeout
        if self._router.pending(engine.rank) == 0:
            engine.state = GONE

    def _run_timers(self, now: float) -> None:
        for engine in self._engines:
            if engine.state == GONE:
                continue
            if engine.state == DRAINING and now >= engine.drain_deadline:
                self._engine_failed(engine, "drain timed out")
            elif (
                self.heartbeat_timeout
                and engine.heartbeats
                and now - engine.last_heartbeat > self.heartbeat_timeout
            ):
                self._engine_failed(engine, "no heartbeat")

    # -- requests ------------------------------------------------------------------

    def _submit(self, client: _Client, header: int, frames: list[zmq.Frame]) -> None:
        meta = frames[1].buffer
        try:
            _, length, rid, _ = codec.read_submit(meta)
        except ProtocolError as exc:
            self._bad(client.identity, exc.rid, ErrorCode.MALFORMED, header, str(exc), client)
            return
        n_payload = 1 if header == Header.SUBMIT_REQUEST else 2
        n_frames = len(frames) - 2
        hashes = frames[2 + n_payload].buffer if n_frames == n_payload + 1 else None
        if (
            length != 2 + n_payload
            or not n_payload <= n_frames <= n_payload + 1
            or (hashes is not None and len(hashes) % BLOCK_HASH_SIZE)
        ):
            self._bad(client.identity, rid, ErrorCode.MALFORMED, header, "bad frame layout", client)
            return
        if (client.identity, rid) in self._by_client:
            self._reject(
                client, rid, ErrorCode.DUPLICATE_REQUEST, header, Counter.DUPLICATE_REQUEST
            )
            return
        if len(self._requests) >= self.max_inflight:
            self._reject(client, rid, ErrorCode.BUSY, header, Counter.BUSY)
            return
        server_rid = self._allocate_rid()
        request = _Request(server_rid, client, rid, -1)
        out_meta = codec.rewrite_submit(meta, server_rid)
        try:
            self._route(request, hashes, [out_meta, *frames[2 : 2 + n_payload]])
        except _Unroutable as exc:
            counter = Counter.NO_ENGINES if exc.code == ErrorCode.NO_ENGINES else Counter.BUSY
            self._reject(client, rid, exc.code, header, counter)
            return
        # A KV submission's source blocks are tied to the engine chosen now: never re-sent.
        if header == Header.SUBMIT_REQUEST and self.keep_prompts:
            prompt = frames[2]
            request.meta = out_meta
            request.prompt = prompt.bytes if len(prompt) < COPY_BELOW else prompt
        self._requests[server_rid & self._mask] = request
        self._by_client[(client.identity, rid)] = request
        client.inflight += 1
        self._count(Counter.SUBMITTED)

    def _allocate_rid(self) -> int:
        rid = self._next_rid
        while (rid & self._mask) in self._requests:
            rid += 1
        self._next_rid = rid + 1
        return rid

    def _route(self, request: _Request, hashes: memoryview | None, message: list[Any]) -> None:
        """Choose a rank and send ``message`` there; engines found gone are failed."""
        while True:
            rank = self._router.choose(hashes, time.monotonic())
            if rank < 0:
                code = ErrorCode.NO_ENGINES if self._router.n_accepting == 0 else ErrorCode.BUSY
                raise _Unroutable(code)
            engine = self._engines[rank]
            request.rank = rank
            if self._send(engine.identity, message):
                return
            self._router.release(rank)
            request.rank = -1  # so failing that engine does not settle this request too
            self._engine_failed(engine, "unreachable")

    def _lookup(self, server_rid: int) -> _Request | None:
        request = self._requests.get(server_rid & self._mask)
        if request is None or request.server_rid != server_rid:
            return None
        return request

    def _free(self, request: _Request) -> None:
        del self._requests[request.server_rid & self._mask]
        del self._by_client[(request.client.identity, request.client_rid)]
        request.client.inflight -= 1
        if request.rank < 0:
            return
        self._router.release(request.rank)
        engine = self._engines[request.rank]
        if engine.state == DRAINING and self._router.pending(engine.rank) == 0:
            engine.state = GONE

    def _reply(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        try:
            header, entries = codec.read_reply(frames[1].buffer)
        except ProtocolError as exc:
            self._bad(engine.identity, None, ErrorCode.MALFORMED, -1, str(exc))
            return
        bodies = frames[2:]
        if len(entries) != len(bodies):
            self._bad(
                engine.identity,
                None,
                ErrorCode.MALFORMED,
                header,
                f"{len(entries)} entries but {len(bodies)} payload frames",
            )
            return
        final = header == Header.ENGINE_REPLY
        for (server_rid, needs_detokenize), body in zip(entries, bodies, strict=True):
            request = self._lookup(server_rid)
            if request is None or request.rank != engine.rank:
                self._count(Counter.UNKNOWN_REQUEST)
                continue
            client = request.client
            if final:
                self._free(request)
                self._count(Counter.REPLIES)
            else:
                request.produced = True
                self._count(Counter.PARTIALS)
            out: Any = body
            if needs_detokenize and self._detokenizer is not None:
                out = self._detokenize(body)
            if not self._send(
                client.identity, [codec.write_header_int(header, request.client_rid), out]
            ):
                self._client_gone(client)

    def _detokenize(self, body: zmq.Frame) -> zmq.Frame | bytes:
        try:
            out = detokenize(self._detokenizer, body.buffer)  # type: ignore[arg-type]
            self._count(Counter.DETOKENIZED)
            return out
        except Exception as exc:  # a bad body or a failing detokenizer: forward it untouched
            self._count(Counter.DETOKENIZE_ERRORS)
            self._log.warn("detokenize", f"detokenize failed, body forwarded as is: {exc!r}")
            return body

    def _abort(self, client: _Client, frames: list[zmq.Frame]) -> None:
        rid = self._read_rid(client, Header.ABORT_REQUEST, frames)
        if rid is None:
            return
        request = self._by_client.get((client.identity, rid))
        if request is None:
            self._reject(
                client,
                rid,
                ErrorCode.UNKNOWN_REQUEST,
                Header.ABORT_REQUEST,
                Counter.UNKNOWN_REQUEST,
            )
            return
        self._count(Counter.ABORTS)
        if request.aborted:
            return
        request.aborted = True
        engine = self._engines[request.rank]
        message = [codec.write_header_int(Header.ABORT_REQUEST, request.server_rid)]
        if not self._send(engine.identity, message):
            self._engine_failed(engine, "unreachable")

    def _release_kv(self, client: _Client, frames: list[zmq.Frame]) -> None:
        if self._read_rid(client, Header.RELEASE_KV, frames) is not None:
            self._count(Counter.RELEASE_KV)
            self._broadcast(frames[1])

    def _read_rid(self, client: _Client, header: int, frames: list[zmq.Frame]) -> int | None:
        """The rid of a ``[header, rid]`` message, or None after answering it as malformed."""
        try:
            _, length, rid, _ = codec.read_submit(frames[1].buffer)
        except ProtocolError as exc:
            self._bad(client.identity, exc.rid, ErrorCode.MALFORMED, header, str(exc), client)
            return None
        if length != 2 or len(frames) != 2:
            self._bad(client.identity, rid, ErrorCode.MALFORMED, header, "bad layout", client)
            return None
        return rid

    def _control(
        self, client: _Client, header: int, frames: list[zmq.Frame], length: int, end: int
    ) -> None:
        if header == Header.SET_GENERATION_EPOCH:
            if self._read_rid(client, header, frames) is None:
                return
        elif not self._simple(client, header, frames, length, end):
            return
        state = CONTROL_TRANSITIONS.get((self._state, header))
        if state is None:
            self._reject(client, None, ErrorCode.INVALID_STATE, header, Counter.INVALID_CONTROL)
            return
        self._count(Counter.CONTROL)
        self._state = ControlState(state)
        self._broadcast(frames[1])

    def _simple(
        self, client: _Client, header: int, frames: list[zmq.Frame], length: int, end: int
    ) -> bool:
        """Whether a ``[header]`` message is exactly that; answers it as malformed if not."""
        if self._exact(frames, length, end):
            return True
        self._bad(client.identity, None, ErrorCode.MALFORMED, header, "expected [header]", client)
        return False

    @staticmethod
    def _exact(frames: list[zmq.Frame], length: int, end: int) -> bool:
        return len(frames) == 2 and length == 1 and end == len(frames[1])

    def _broadcast(self, frame: zmq.Frame) -> None:
        unreachable = [
            engine
            for engine in self._engines
            if engine.state != GONE and not self._send(engine.identity, [frame])
        ]
        for engine in unreachable:
            self._engine_failed(engine, "unreachable")

    # -- failures ------------------------------------------------------------------

    def _sorted_requests(self, keep: Callable[[_Request], bool]) -> list[_Request]:
        return sorted((r for r in self._requests.values() if keep(r)), key=lambda r: r.server_rid)

    def _engine_failed(self, engine: _Engine, reason: str) -> None:
        """Take ``engine`` out of the pool; re-send or fail what it held."""
        if engine.state == GONE:
            return
        self._count(Counter.ENGINE_FAILURES)
        self._log.warn("engine_failed", f"engine {engine.rank} gone ({reason})")
        if engine.state == ALIVE:
            self._router.remove_rank(engine.rank)
        engine.state = GONE
        for request in self._sorted_requests(lambda r: r.rank == engine.rank):
            if self._lookup(request.server_rid) is not request or request.rank != engine.rank:
                continue  # settled by a nested failure meanwhile
            self._router.release(engine.rank)
            request.rank = -1
            if request.produced or request.aborted or request.meta is None:
                self._fail(request, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
                continue
            try:
                self._route(request, None, [request.meta, request.prompt])
                self._count(Counter.REROUTED)
            except _Unroutable as exc:
                self._fail(request, exc.code, Header.SUBMIT_REQUEST)

    def _fail(self, request: _Request, code: ErrorCode, header: int) -> None:
        """End ``request`` with ERROR(code): its one terminal reply."""
        self._free(request)
        if code == ErrorCode.ENGINE_FAILED:
            self._count(Counter.ENGINE_FAILED)
        if not self._error(request.client, request.client_rid, code, header):
            self._client_gone(request.client)

    def _client_gone(self, client: _Client) -> None:
        """A client that cannot be reached: abort its requests at their engines, forget it."""
        if self._clients.get(client.identity) is not client:
            return
        self._count(Counter.CLIENT_GONE)
        del self._clients[client.identity]
        unreachable = []
        for request in self._sorted_requests(lambda r: r.client is client):
            self._free(request)
            engine = self._engines[request.rank]
            if not request.aborted and engine.state != GONE:
                abort = [codec.write_header_int(Header.ABORT_REQUEST, request.server_rid)]
                if not self._send(engine.identity, abort):
                    unreachable.append(engine)
        for engine in unreachable:
            self._engine_failed(engine, "unreachable")

    # -- sending -------------------------------------------------------------------

    def _send(self, identity: bytes, frames: list[Any]) -> bool:
        """Send one message; False if the peer is gone (ROUTER_MANDATORY's EHOSTUNREACH)."""
        try:
            self._sock.send(identity, zmq.SNDMORE)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        self._sock.send_multipart(frames, copy=False)
        return True

    def _error(self, client: _Client, rid: int | None, code: ErrorCode, header: int) -> bool:
        """ERROR to a coordkit client (others cannot parse it); False if it is gone."""
        if not client.coordkit:
            return True
        self._count(Counter.ERRORS_SENT)
        return self._send(client.identity, [error_frame(rid, code, header)])

    def _reject(
        self, client: _Client, rid: int | None, code: ErrorCode, header: int, counter: Counter
    ) -> None:
        self._count(counter)
        if not self._error(client, rid, code, header):
            self._client_gone(client)

    def _bad(
        self,
        identity: bytes,
        rid: int | None,
        code: ErrorCode,
        header: int,
        detail: str,
        client: _Client | None = None,
    ) -> None:
        """A message that does not parse: count, log (rate-limited), answer a coordkit client."""
        self._log.warn("malformed", f"malformed {header_name(header)} from {identity!r}: {detail}")
        if client is None:
            self._count(Counter.MALFORMED)
            return
        self._reject(client, rid, code, header, Counter.MALFORMED)

    def _count(self, counter: Counter) -> None:
        self._counters[counter] += 1
