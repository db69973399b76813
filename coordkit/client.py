"""The asyncio client: submit prompts to a coordinator and await the engines' replies.

::

    async with await Client.connect("ipc:///tmp/coordkit.sock") as client:
        reply = await client.submit([1, 2, 3], {"max_tokens": 8})
        async for part in client.stream("hello"):
            print(part)

One :class:`Client` is one DEALER socket and one reader callback on the
running event loop; use it from that loop only. Replies are matched to
requests by the client's own request ids (0, 1, 2, ...). Under it runs a
*core* -- the Cython one (:mod:`coordkit._client_c`) or its pure-Python twin
(:mod:`coordkit._client_py`), chosen as the coordinator's is -- that owns the
socket I/O, the pending requests and the frames; both put the same frames on
the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, cast

import zmq

from . import protocol
from ._checks import check_tenant, qos_fields, streaming_params
from ._implementation import load_implementation, selected
from ._liveness import (
    ACK_WINDOW,
    CANDIDATE_WINDOW,
    DEFAULT_COORDINATOR_TIMEOUT,
    Candidates,
    ConnectionWatch,
    Following,
    prepare,
)
from ._shared import never_ran
from .cluster import client_candidates, is_cluster
from .curve import KeySource, ServerKey
from .election import parse_endpoint
from .protocol import (
    BATCH_FEATURE,
    COORDKIT_HELLO,
    EPOCH_KEY,
    HOLD_KEY,
    QOS_FEATURE,
    REBUILD_FEATURE,
    TENANT_KEY,
    ErrorCode,
    Header,
    ProtocolError,
)
from .tracing import end_span, follow_future, request_span, tracer_of

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Client", "CoordinatorError", "ReplyFuture", "Stream"]

log = logging.getLogger(__name__)

#: A prompt: text, token ids (a sequence of ints, or an ``array.array`` or numpy
#: array of an integer type), or bytes sent as they are.
Prompt = str | bytes | bytearray | memoryview | zmq.Frame | Sequence[int] | Any

_CLOSE_LINGER_MS = 1000  # lets a last message (SHUTDOWN, ABORT) leave after close()
_SEND_RETRY = 0.01  # seconds between tries of a CONNECT that libzmq has no pipe for yet


class CoordinatorError(Exception):
    """An ERROR message from the coordinator.

    ``code`` is an :class:`~coordkit.ErrorCode` (a plain int if this version
    does not know it), ``message`` the coordinator's text, ``request_id`` the
    client's id of the request it concerns, or None.
    """

    def __init__(self, code: int, message: str, request_id: int | None = None):
        with contextlib.suppress(ValueError):
            code = ErrorCode(code)
        name = code.name if isinstance(code, ErrorCode) else f"error {code}"
        where = "" if request_id is None else f" (request {request_id})"
        super().__init__(f"{name}{where}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ReplyFuture(asyncio.Future[Any]):
    """The future :meth:`Client.submit` returns; ``request_id`` is its client id,
    ``raw`` whether it resolves to the body's bytes.

    Cancelling it (``cancel()``, or the cancellation of a task or a
    ``wait_for`` awaiting it) aborts the request at its engine.

    Each client makes two subclasses of it, for decoded and raw replies, whose
    class attributes say ``raw`` and refer to the client's core: a future
    carries its id only, which keeps the many made by ``submit_many`` cheap.
    """

    __slots__ = ("request_id", "_kept")

    request_id: int
    _kept: tuple[Any, ...]  # what sends it again after a coordinator's loss (rebuild)
    raw: bool = False
    _core: weakref.ref[Any] | None = None  # the client's core, told of a cancellation

    def cancel(self, msg: Any | None = None) -> bool:
        if not super().cancel(msg):
            return False
        core = self._core() if self._core is not None else None
        if core is not None:
            core.cancelled(self.request_id)
        return True


def _future_types() -> tuple[type[ReplyFuture], type[ReplyFuture]]:
    """A client's own ReplyFuture classes: decoded replies, raw replies."""
    return tuple(  # type: ignore[return-value]
        type("ReplyFuture", (ReplyFuture,), {"__slots__": (), "raw": raw, "__module__": __name__})
        for raw in (False, True)
    )


class Stream:
    """The async iterator :meth:`Client.stream` returns: partial replies, then the final.

    Iteration raises :class:`CoordinatorError` if the request fails.
    """

    _span: Any = None  # a traced request's span (coordkit.tracing): it ends with the final

    def __init__(self, request_id: int, raw: bool):
        self.request_id = request_id
        self.raw = raw
        self.partials = 0  # partial replies received: a replay after a rebuild skips them
        self._kept: tuple[Any, ...] = ()
        self._queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        self._ended = False

    def _put(self, final: bool, value: Any) -> None:
        if not final:
            self.partials += 1
        elif self._span is not None:
            end_span(self._span)
        self._queue.put_nowait((final, value))

    def _fail(self, exc: BaseException) -> None:
        if self._span is not None:
            end_span(self._span, exc)
        self._queue.put_nowait((True, exc))

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        final, value = await self._queue.get()
        self._ended = final
        if isinstance(value, BaseException):
            raise value
        return value


class Client(Following):
    """A connection to a coordinator; create it with :meth:`connect`.

    ERRORs that concern no pending request (a control signal the coordinator's
    state machine refused, an abort of a request it no longer holds) are
    logged, kept in :attr:`errors` (the latest 100) and passed to ``on_error``.

    ``batch`` is whether the coordinator granted batched messages
    (:meth:`connect` asks for them); ``qos`` whether it takes priorities and
    deadlines (it queues requests: docs/queueing.md); ``tenant`` is the name the
    client gave :meth:`connect`; ``implementation`` names the core, ``"c"`` or
    ``"py"``.

    When the connection to the coordinator ends (it died, or its heartbeats
    stopped: see :meth:`connect`) and the coordinator granted the rebuild
    (``failover_timeout`` > 0, the default), the client rides through it:
    pending requests stay pending, new ones and control calls wait, and once a
    coordinator acknowledges it again the client REJOINs with the requests it
    waits for and sends again those no engine holds (docs/failover.md); an
    ABORT or control call issued meanwhile goes out after the REJOIN, in order.
    The same coordinator keeps the client's requests for ``failover_timeout``
    once its connection ends, so a blip costs no work done twice. Past
    ``failover_timeout`` seconds without one, what is pending fails with
    :class:`ConnectionError`, as it does at once with ``failover_timeout=0``:
    every pending request fails with
    :class:`ConnectionError` naming the coordinator's address and
    :attr:`connected` turns False; while it is False, sending anything raises
    :class:`ConnectionError` at once. libzmq reconnects by itself; on the new
    connection the client sends CONNECT again, and once the coordinator
    acknowledged it :attr:`connected` is True and submissions go through.

    Traces (the ``otel`` extra): with a tracer provider (``tracer_provider``, or the
    application's global one, as it is when the client connects), each request has a
    span from its submission to its final reply (``coordkit.submit``,
    ``coordkit.stream``), a child of the current span; a request the provider's sampler
    samples carries its traceparent in its sampling params to the engine
    (:mod:`coordkit.tracing`). Without one, nothing is traced or sent.
    """

    def __init__(
        self,
        socket: zmq.Socket,
        address: str,
        on_error: Callable[[CoordinatorError], None] | None = None,
        *,
        batch: bool = False,
        implementation: str | None = None,
        watch: ConnectionWatch | None = None,
        ask_batch: bool | None = None,
        handshake_timeout: float = 10.0,
        rebuild: bool = False,
        failover_timeout: float = 0.0,
        candidates: Candidates | None = None,
        tracer_provider: Any = None,
        qos: bool = False,
        tenant: str | None = None,
    ):
        impl = load_implementation(implementation) if implementation else selected()
        self._tracer = tracer_of(tracer_provider)
        self._candidates = candidates or Candidates(address)
        self._connected = True
        self.errors: deque[CoordinatorError] = deque(maxlen=100)
        self._on_error = on_error
        self._socket = socket
        self._loop = asyncio.get_running_loop()
        self._stats_waiters: deque[asyncio.Future[dict[str, Any]]] = deque()
        self._closed = False
        future_types = _future_types()
        self._core = impl.client.ClientCore(
            socket,
            loop=self._loop,
            batch=batch,
            future_types=future_types,
            stream_type=Stream,
            on_error=self._error,
            on_stats=self._stats,
            on_failure=self._failure,
            on_resend=self._resend,
        )
        for future_type in future_types:
            future_type._core = weakref.ref(self._core)
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._core.on_readable)
        # Messages that came during the handshake may have consumed the FD's edge.
        self._loop.call_soon(self._core.on_readable)
        # Without a watch (a socket connected by the caller) a lost coordinator goes unnoticed.
        self._watch = watch
        self._ask_batch = batch if ask_batch is None else ask_batch
        self._handshake_timeout = handshake_timeout
        self._rejoining: asyncio.Task[None] | None = None
        # The ride through a coordinator's loss: whether the coordinator granted the
        # rebuild (the requests then keep what sends them again), the timer that ends
        # the ride.
        self._rebuild = rebuild
        self._failover_timeout = failover_timeout
        self._qos = qos
        #: The tenant it named in its CONNECT (None: a tenant of its own).
        self.tenant = tenant
        self._expiry: asyncio.TimerHandle | None = None
        self._up = asyncio.Event()
        self._up.set()
        if watch is not None:
            self._loop.add_reader(watch.fd, self._on_connection_event)
            self._loop.call_soon(self._on_connection_event)  # events from before add_reader

    @classmethod
    async def connect(
        cls,
        address: str | Sequence[str],
        *,
        timeout: float = 10.0,
        context: zmq.Context | None = None,
        on_error: Callable[[CoordinatorError], None] | None = None,
        batch: bool = True,
        implementation: str | None = None,
        coordinator_timeout: float | None = DEFAULT_COORDINATOR_TIMEOUT,
        curve_server_key: ServerKey | None = None,
        curve_keys: KeySource | None = None,
        failover_timeout: float = 30.0,
        tracer_provider: Any = None,
        tenant: str | None = None,
    ) -> Client:
        """Connect to the coordinator at ``address`` and wait for its CONNECT_ACK.

        The CONNECT asks for batched messages unless ``batch`` is False; they
        are used only when the coordinator grants them. ``tenant`` names the
        client's tenant (a str of 1 to 128 bytes in UTF-8): the clients that
        name the same one share its place in the coordinator's queue, in
        proportion to its weight (``coordkit serve --tenant-weight``); a client
        that names none is a tenant of its own (docs/queueing.md). The CONNECT
        also says that the client may send priorities and deadlines, which it
        then sends only to a coordinator that granted them (:attr:`qos`). ``implementation``
        (``"c"`` or ``"py"``) picks the core; by default the one chosen at import.
        ``address`` is ``tcp://HOST:PORT``, ``ipc:///path`` or ``inproc://name``
        (ValueError otherwise, before anything is opened), or several split by
        commas (``"tcp://a:5555,tcp://b:5555"``: the standbys of one ``--ha``
        NAME). The client then follows one coordinator at a time
        (:attr:`address` is the one followed): the first, in turn, that
        connects within 0.5 s and acknowledges it (within 2 s, or ``timeout``
        if shorter) with an epoch no older than the highest it has seen; when
        the connection ends it looks again among all of them. This needs the
        rebuild (the epoch comes with it): ValueError with ``failover_timeout=0``.
        A cluster (coordinators serving at once: docs/scaling.md) is
        ``"etcd://HOST:PORT/NAME"``, whose live members are read from etcd, or a
        list of its members' addresses: the client follows the first member of its
        rendezvous order (a hash of its routing id and each member's address) that
        admits it, and when that one is gone, its next choice among the members
        then live, where it REJOINs. This needs the rebuild too.
        Raises :class:`ConnectionError` if no CONNECT_ACK comes within
        ``timeout`` seconds (also what a CURVE coordinator that refuses the
        key looks like), or at once if the coordinator refuses the client.

        ``coordinator_timeout`` (seconds) sets ZMTP heartbeats on the socket:
        a coordinator silent that long is deemed lost, as one whose
        connection closed is at once (see :class:`Client`); None sends no
        heartbeats. ``timeout`` also bounds each CONNECT of a reconnection.

        With CURVE, ``curve_server_key`` is the coordinator's public key (its
        ``.key`` file, or the z85 bytes) and ``curve_keys`` the client's own
        pair (its ``.key_secret`` file, or ``(public, secret)`` z85 bytes, as
        ``zmq.auth.load_certificate`` returns them); both or neither.

        ``failover_timeout`` (seconds) is how long the client rides through a
        lost coordinator (see :class:`Client`); 0 asks for no rebuild, and a
        loss fails what is pending at once. With it, every request keeps a
        reference to its prompt until it ends: do not modify a prompt meanwhile.

        ``tracer_provider`` (an OpenTelemetry ``TracerProvider``) traces its requests
        (see :class:`Client`); by default the global one, if the application set one.
        """
        check_tenant(tenant)
        if not failover_timeout >= 0:
            raise ValueError(f"failover_timeout must be >= 0 seconds, got {failover_timeout!r}")
        # A routing id of its own, the same at every coordinator: the one a ROUTER would
        # generate is its count of peers, which a restarted coordinator hands out again,
        # in another order. Hex text, so that stats, traces and `coordkit top` show every
        # client's the same way. A cluster's members are ordered by it (rendezvous).
        identity = b"c" + os.urandom(7).hex().encode()
        cluster = is_cluster(address)
        candidates: Candidates
        if cluster:
            if failover_timeout == 0:
                raise ValueError(
                    "coordkit: a client of a cluster needs failover_timeout > 0: "
                    "it moves to its next member with the rebuild"
                )
            if isinstance(address, str):
                parse_endpoint(address)  # a malformed one fails before etcd is asked
            candidates = await asyncio.get_running_loop().run_in_executor(
                None, client_candidates, address, identity
            )
        else:
            candidates = Candidates(cast(str, address))
        if candidates.several and failover_timeout == 0:
            raise ValueError(
                "coordkit: a client given several coordinator addresses needs "
                "failover_timeout > 0: the epoch that chooses among them comes with the rebuild"
            )
        if implementation is not None:
            load_implementation(implementation)  # an unknown or unbuilt one fails here
        socket = zmq.Socket(context or zmq.Context.instance(), zmq.DEALER)
        watch = None
        try:
            prepare(socket, coordinator_timeout, curve_server_key, curve_keys)
            if failover_timeout > 0:
                socket.setsockopt(zmq.IDENTITY, identity)
            watch = ConnectionWatch(socket)  # before connect(): the first events count too
            socket.connect(candidates.current)
            if candidates.several:
                handshake = _choose(
                    socket, watch, candidates, batch, failover_timeout, timeout, tenant
                )
            else:
                handshake = _handshake(socket, batch, failover_timeout, tenant=tenant)
            granted = await asyncio.wait_for(handshake, timeout)
        except BaseException as exc:
            if watch is not None:
                watch.close()
            socket.close(linger=0)
            if isinstance(exc, asyncio.TimeoutError):
                raise ConnectionError(
                    f"coordkit: no coordinator answered at {address} within {timeout} s"
                ) from None
            raise
        return cls(
            socket,
            candidates.current,
            on_error,
            batch=granted.batch,
            implementation=implementation,
            watch=watch,
            ask_batch=batch,
            handshake_timeout=timeout,
            rebuild=granted.rebuild,
            failover_timeout=failover_timeout,
            candidates=candidates,
            tracer_provider=tracer_provider,
            qos=granted.qos,
            tenant=tenant,
        )

    @property
    def coordinator_epoch(self) -> int | None:
        """Of several addresses: the highest epoch a coordinator it followed announced."""
        return self._candidates.epoch

    @property
    def connected(self) -> bool:
        """Whether the coordinator acknowledged the current connection (see
        :class:`Client`); False once closed."""
        return self._connected

    @property
    def batch(self) -> bool:
        """Whether the coordinator granted batched messages (SUBMIT_BATCH, REPLY_BATCH)."""
        return bool(self._core.batch)

    @property
    def qos(self) -> bool:
        """Whether the coordinator takes priorities and deadlines (it granted ``"qos"``):
        only then are they sent. One that does not queue has nothing they could change."""
        return self._qos

    @property
    def implementation(self) -> str:
        """``"c"`` or ``"py"``: the core this client runs on."""
        return str(self._core.implementation)

    # -- requests ------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        sampling_params: Any = None,
        *,
        block_size: int | None = None,
        raw: bool = False,
        block_hashes: bytes | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> ReplyFuture:
        """Send one request; the future resolves to its final reply body.

        ``prompt`` is a ``str`` (sent msgpack-packed), token ids (msgpack-packed,
        as Megatron's engines expect: a sequence of ints in ``[0, 2**32)``, or an
        ``array.array`` or numpy array of an integer type, packed from its
        buffer) or a bytes-like object (``bytes``, ``bytearray``,
        ``memoryview``, ``zmq.Frame``), sent as it is: do not modify it until
        the reply came. ``sampling_params`` is a map (a ``dict``) or None.
        Anything else raises TypeError, or ValueError for a token id out of
        range, naming what was given (a token by its index and value), and
        nothing is sent. ``block_size`` adds the prefix-routing block hashes
        (token-id prompts only), or ``block_hashes`` sends a block-hash frame
        as given. The body is msgpack-decoded unless ``raw``, which gives bytes.
        Partial replies are not delivered here; use :meth:`stream` for them.
        An ERROR for the request fails the future with :class:`CoordinatorError`.

        ``priority`` (an int in [-128, 127], lower first) and ``deadline``
        (seconds, or None) matter where requests wait at the coordinator
        (docs/queueing.md): a lower priority is always dispatched first, and a
        request still waiting ``deadline`` seconds after it arrived ends with
        ``CoordinatorError`` (``TIMED_OUT``) and never reaches an engine. A bad
        one raises TypeError or ValueError and nothing is sent; a coordinator
        that did not grant them (:attr:`qos`) is not sent them.

        The request leaves at once, or, when the coordinator granted batches,
        with the others submitted in the same event-loop iteration.
        """
        if not self._connected and self._expiry is None:
            self._raise_not_connected()
        qos = self._qos_fields(priority, deadline)
        if self._tracer is not None:
            kept = (prompt, sampling_params, block_size, block_hashes, priority, deadline)
            return cast(ReplyFuture, self._traced(False, kept, raw, qos))
        future: ReplyFuture = self._core.submit(
            prompt, sampling_params, block_size, raw, block_hashes, qos
        )
        if self._rebuild:
            kept = (prompt, sampling_params, block_size, block_hashes, priority, deadline)
            self._keep(future, kept)
        return future

    def submit_many(
        self,
        prompts: Iterable[Prompt],
        sampling_params: Any = None,
        *,
        block_size: int | None = None,
        raw: bool = False,
        priority: int = 0,
        deadline: float | None = None,
    ) -> list[ReplyFuture]:
        """Send many requests in one call; one future per prompt, in order.

        Every prompt is as for :meth:`submit` and they share ``sampling_params``
        (packed once), ``priority`` and ``deadline``. All are encoded before any
        is sent: a bad prompt raises (its error names its index in ``prompts``)
        and nothing is sent. With batches granted they leave as one SUBMIT_BATCH
        (several for a very large call), otherwise as one SUBMIT_REQUEST each, at
        once. Their ids are consecutive.
        """
        if not self._connected and self._expiry is None:
            self._raise_not_connected()
        qos = self._qos_fields(priority, deadline)
        if self._tracer is not None:
            qos_kept = (priority, deadline)
            return self._traced_many(list(prompts), sampling_params, block_size, raw, qos, qos_kept)
        if self._rebuild and not isinstance(prompts, list):
            prompts = list(prompts)
        futures: list[ReplyFuture] = self._core.submit_many(
            prompts, sampling_params, block_size, raw, qos
        )
        if self._rebuild:
            for future, prompt in zip(futures, cast(list[Any], prompts), strict=True):
                kept = (prompt, sampling_params, block_size, None, priority, deadline)
                self._keep(future, kept)
        return futures

    def stream(
        self,
        prompt: Prompt,
        sampling_params: Any = None,
        *,
        block_size: int | None = None,
        raw: bool = False,
        block_hashes: bytes | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> Stream:
        """Send one request with ``{STREAM_KEY: True}`` added to its sampling params.

        The request is sent now; the returned :class:`Stream` yields each
        partial reply and ends with the final one. ``priority`` and ``deadline``
        are :meth:`submit`'s.
        """
        if not self._connected and self._expiry is None:
            self._raise_not_connected()
        params = streaming_params(sampling_params)
        qos = self._qos_fields(priority, deadline)
        if self._tracer is not None:
            kept = (prompt, params, block_size, block_hashes, priority, deadline)
            return cast(Stream, self._traced(True, kept, raw, qos))
        stream: Stream = self._core.stream(prompt, params, block_size, raw, block_hashes, qos)
        if self._rebuild:
            self._keep(stream, (prompt, params, block_size, block_hashes, priority, deadline))
        return stream

    def _traced(
        self, streaming: bool, kept: tuple[Any, ...], raw: bool, qos: bytes
    ) -> ReplyFuture | Stream:
        """submit(), or stream() when ``streaming``, of a client that traces: the
        request's span, and its traceparent in its params when sampled. ``kept`` is what
        sends it again (its prompt, params, block size, hashes, priority, deadline)."""
        assert self._tracer is not None
        prompt, sampling_params, block_size, block_hashes, *qos_kept = kept
        name = "coordkit.stream" if streaming else "coordkit.submit"
        params, span = request_span(self._tracer, name, sampling_params)
        send = self._core.stream if streaming else self._core.submit
        try:
            target = send(prompt, params, block_size, raw, block_hashes, qos)
        except BaseException as exc:
            if span is not None:
                end_span(span, exc)
            raise
        if self._rebuild:
            self._keep(target, (prompt, params, block_size, block_hashes, *qos_kept))
        if span is not None:
            if isinstance(target, Stream):
                span.set_attribute("coordkit.request_id", target.request_id)
                target._span = span
            else:
                follow_future(span, target)
        return cast(ReplyFuture | Stream, target)

    def _traced_many(
        self,
        prompts: list[Any],
        sampling_params: Any,
        block_size: int | None,
        raw: bool,
        qos: bytes,
        qos_kept: tuple[int, float | None],
    ) -> list[ReplyFuture]:
        """submit_many() of a client that traces: a span per request, each sampled one's
        params its own (with its traceparent), the others' shared."""
        assert self._tracer is not None
        traced = [request_span(self._tracer, "coordkit.submit", sampling_params) for _ in prompts]
        own = {i: params for i, (params, span) in enumerate(traced) if span is not None}
        try:
            futures: list[ReplyFuture] = self._core.submit_many(
                prompts, sampling_params, block_size, raw, qos, own or None
            )
        except BaseException as exc:
            for _, span in traced:
                if span is not None:
                    end_span(span, exc)
            raise
        for i, (future, (params, span)) in enumerate(zip(futures, traced, strict=True)):
            if self._rebuild:
                self._keep(future, (prompts[i], params, block_size, None, *qos_kept))
            if span is not None:
                follow_future(span, future)
        return futures

    async def abort(self, request: ReplyFuture | Stream | int) -> None:
        """Abort a request (its future, stream or id); a no-op if it already ended.

        The engine still sends a final reply, which resolves the request as usual.
        While no coordinator is reachable the abort waits, and goes out once one
        accepted the client again; a request no engine held by then is never run:
        it fails with :class:`CoordinatorError` (``UNKNOWN_REQUEST``), at once when
        it was submitted meanwhile (it was never sent).
        """
        rid = request if isinstance(request, int) else request.request_id
        target = self._core.get(rid)
        if target is not None:
            target._kept = ()  # an aborted request is never sent again (RESEND)
        self._core.abort(rid)

    # -- control -----------------------------------------------------------------

    async def pause(self) -> None:
        await self._send(protocol.CONTROL[Header.PAUSE].pack())

    async def unpause(self) -> None:
        await self._send(protocol.CONTROL[Header.UNPAUSE].pack())

    async def suspend(self) -> None:
        await self._send(protocol.CONTROL[Header.SUSPEND].pack())

    async def resume(self) -> None:
        await self._send(protocol.CONTROL[Header.RESUME].pack())

    async def stop_engines(self) -> None:
        """Send STOP (the coordinator allows it only while paused or suspended)."""
        await self._send(protocol.CONTROL[Header.STOP].pack())

    async def set_generation_epoch(self, epoch: int) -> None:
        await self._send(protocol.SET_GENERATION_EPOCH.pack(epoch))

    async def shutdown_coordinator(self) -> None:
        """Ask the coordinator to stop; requests still in flight get ERROR(SHUTTING_DOWN)."""
        await self._send(protocol.SHUTDOWN.pack())

    async def stats(self, timeout: float | None = 10.0, metrics: bool = False) -> dict[str, Any]:
        """The coordinator's counters, engines and state (raises TimeoutError); with
        ``metrics``, its :meth:`Coordinator.metrics` too, under ``"metrics"`` (traffic,
        failures by code and, when it measures them, the latency histograms)."""
        if not self._connected and self._expiry is None:
            self._raise_not_connected()
        waiter: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        # Replies carry no id: they come in order, and a timed-out waiter still takes its own.
        self._stats_waiters.append(waiter)
        await self._send(protocol.STATS.pack({protocol.METRICS_FEATURE: 1} if metrics else None))
        return await asyncio.wait_for(waiter, timeout)

    async def wait_for_engines(self, count: int, timeout: float = 10.0) -> None:
        """Wait until ``count`` engines are registered and alive (polls :meth:`stats`).

        It waits through a failover the client rides through: a poll the lost
        coordinator never answered is asked again of the next one.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                stats = await self.stats(timeout=max(deadline - time.monotonic(), 0.001))
            except ConnectionError:
                if self._expiry is None:  # not riding through: nothing comes back
                    raise
                continue
            alive = sum(engine["state"] == "alive" for engine in stats["engines"])
            if alive >= count:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{alive} of {count} engines registered after {timeout} s")
            # The protocol has no registration event for clients, so ask again shortly.
            await asyncio.sleep(0.02)

    # -- lifecycle -----------------------------------------------------------------

    async def close(self) -> None:
        """Close the socket; pending requests fail with ConnectionError.

        The coordinator is told (DISCONNECT ``[60]``): it forgets the client at
        once and aborts its requests at their engines.
        """
        if self._closed:
            return
        self._closed = True
        acknowledged, self._connected = self._connected, False
        self._loop.remove_reader(self._fd)
        if self._rejoining is not None:
            self._rejoining.cancel()
            # Its readers go before the FDs they watch close (and their numbers are reused).
            await asyncio.gather(self._rejoining, return_exceptions=True)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._up.set()  # what waits for a coordinator sees the client closed
        if self._watch is not None:
            self._loop.remove_reader(self._watch.fd)
            self._watch.close()
        exc = ConnectionError("coordkit client closed with the request pending")
        self._core.close(exc)
        self._fail_stats(exc)
        if acknowledged:
            # Past the core (closed: its requests are dropped); a full pipe or a failed socket
            # is no reason to wait: the coordinator then learns it from the connection's end.
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send_multipart(protocol.DISCONNECT.pack(), zmq.NOBLOCK)
        self._socket.close(linger=_CLOSE_LINGER_MS)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def pending(self) -> int:
        """Requests sent and not yet ended."""
        return int(self._core.count)

    def _raise_not_connected(self) -> NoReturn:
        if self._closed:
            raise ConnectionError("coordkit client is closed")
        raise ConnectionError(
            f"coordkit: not connected to the coordinator at {self.address} (reconnecting)"
        )

    async def _send(self, frames: list[Any]) -> None:
        if not self._connected and self._expiry is not None:
            # Riding through: the core keeps it, in order with the ABORTs, for the
            # coordinator that accepts the REJOIN; the call returns once one did.
            self._core.send(frames)
            await self._up.wait()
            if not self._connected:  # the ride's end: what was kept was dropped
                self._raise_not_connected()
            return
        if not self._connected:
            self._raise_not_connected()
        self._core.send(frames)

    def _qos_fields(self, priority: int, deadline: float | None) -> bytes:
        """A request's QoS fields for the wire: checked whatever the coordinator, sent
        only to one that granted them."""
        fields = qos_fields(priority, deadline)
        return fields if self._qos else b""

    def _keep(self, target: ReplyFuture | Stream, kept: tuple[Any, ...]) -> None:
        """What sends ``target`` again (its prompt, params, hashes, priority and
        deadline): RESEND, or a ride through a coordinator's loss (what is submitted
        meanwhile is not sent)."""
        target._kept = kept

    def _resend(self, rids: list[int]) -> None:
        """RESEND: the coordinator asks for these requests again (no engine holds them)."""
        for rid in rids:
            target = self._core.get(rid)
            if target is None:
                continue
            if not target._kept:  # aborted: it must not run, and no engine holds it
                self._core.pop(rid)
                _fail(target, CoordinatorError(ErrorCode.UNKNOWN_REQUEST, never_ran(rid), rid))
                continue
            prompt, params, block_size, hashes, priority, deadline = target._kept
            try:
                qos = self._qos_fields(priority, deadline)
                self._core.resend(rid, prompt, params, block_size, hashes, qos)
            except (ValueError, TypeError, AttributeError) as exc:
                self._core.pop(rid)
                _fail(
                    target, ConnectionError(f"coordkit: could not send request {rid} again: {exc}")
                )

    def _fail_stats(self, exc: BaseException) -> None:
        while self._stats_waiters:
            waiter = self._stats_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)

    # -- the connection --------------------------------------------------------------------

    def _on_connection_event(self) -> None:
        """The monitor's reader: the connection ended, or a new one was made."""
        assert self._watch is not None
        if self._closed:  # a call scheduled before close() closed the watch
            return
        for event in self._watch.events(self._candidates.others):
            if event == zmq.EVENT_DISCONNECTED:
                self._lost()
                if self._candidates.several and self._rejoining is None:  # look at once
                    self._rejoining = self._loop.create_task(self._rejoin())
                    return  # it reads the watch until it follows a coordinator
            elif not self._connected and self._rejoining is None:  # a new handshake
                self._rejoining = self._loop.create_task(self._rejoin())

    def _lost(self) -> None:
        if self._rejoining is not None:
            self._rejoining.cancel()  # its connection ended too; the next one starts another
            self._rejoining = None
        if not self._connected or self._closed:
            return
        self._connected = False
        self._core.on_readable()  # replies that arrived before the end are delivered first
        exc = ConnectionError(f"coordkit: lost the coordinator at {self.address}")
        self._fail_stats(exc)
        if not self._rebuild:
            log.warning("%s; failing %d pending requests", exc, self._core.count)
            self._core.fail_all(exc)
            return
        # Ride through: nothing is sent (not even what coalesced) until a coordinator
        # accepts the REJOIN; what was not sent goes right after it.
        self._core.hold()
        self._up.clear()
        self._expiry = self._loop.call_later(self._failover_timeout, self._expire)
        log.warning(
            "%s; %d pending requests wait up to %s s for a coordinator",
            exc,
            self._core.count,
            self._failover_timeout,
        )

    def _expire(self) -> None:
        """No coordinator within failover_timeout: what is pending fails."""
        self._expiry = None
        if self._connected or self._closed:
            return
        exc = ConnectionError(
            f"coordkit: lost the coordinator at {self.address}; none answered within "
            f"failover_timeout={self._failover_timeout} s"
        )
        log.warning("%s; failing %d pending requests", exc, self._core.count)
        self._core.fail_all(exc)
        self._up.set()

    async def _rejoin(self) -> None:
        """CONNECT on the new connection, until the coordinator acknowledges it."""
        # Until then this task reads the socket: its first message is the CONNECT_ACK.
        self._loop.remove_reader(self._fd)
        try:
            while True:
                try:
                    granted = await self._reconnect()
                    break
                except (asyncio.TimeoutError, ConnectionError, ProtocolError) as exc:
                    log.warning("coordkit client: reconnecting to %s: %r", self.address, exc)
                    if not isinstance(exc, asyncio.TimeoutError):
                        await asyncio.sleep(self._handshake_timeout)  # refused: ask again later
        finally:
            if not self._closed:
                self._loop.add_reader(self._fd, self._core.on_readable)
        self._rejoining = None
        self._core.batch = granted.batch
        self._qos = granted.qos  # before release(): what it sends again is this one's
        self._connected = True
        rejoin = None
        if self._expiry is not None:  # riding through
            self._expiry.cancel()
            self._expiry = None
            rejoin = self._rejoined(granted.rebuild)
        # The REJOIN first, then the requests never sent (unsent), then the ABORTs and
        # control messages issued meanwhile.
        self._core.release(rejoin)
        self._rebuild = granted.rebuild
        self._up.set()
        self._loop.call_soon(self._core.on_readable)
        log.info("coordkit client: connected again to %s", self.address)

    def _reconnect(self) -> Awaitable[Granted]:
        """The handshake on the new connection; of several addresses, a new choice."""
        if self._candidates.several:
            return self._follow()
        return asyncio.wait_for(
            _handshake(self._socket, self._ask_batch, self._failover_timeout, tenant=self.tenant),
            self._handshake_timeout,
        )

    async def _follow(self) -> Granted:
        """Several addresses, the connection ended: from the next address on, the first
        coordinator that admits the client (the watch is read there meanwhile)."""
        watch = cast(ConnectionWatch, self._watch)
        self._loop.remove_reader(watch.fd)
        try:
            # A cluster's live members read again (etcd's answer awaited off the loop).
            await self._loop.run_in_executor(None, self._candidates.refresh)
            self._candidates.move(self._socket)
            return await _choose(
                self._socket,
                watch,
                self._candidates,
                self._ask_batch,
                self._failover_timeout,
                self._handshake_timeout,
                self.tenant,
            )
        finally:
            if not self._closed:
                self._loop.add_reader(watch.fd, self._on_connection_event)
                self._loop.call_soon(self._on_connection_event)  # what came after the choice

    def _rejoined(self, rebuild: bool) -> list[Any] | None:
        """After a ride through: the REJOIN with every pending request handed to libzmq
        before the loss, None when nothing is pending; the coordinator finds each at its
        engine, or asks for it again (RESEND) once the engines had time to report. Those
        never sent since (``unsent``: at no engine) are left out, and sent again right
        after it; the REJOIN goes even without an entry so that the coordinator defers
        them, not refuses them, while no engine is back. A coordinator without the
        rebuild fails them all."""
        if not rebuild:
            exc = ConnectionError(f"coordkit: the coordinator at {self.address} cannot rebuild")
            self._core.fail_all(exc)
            return None
        if not self._core.count:
            return None
        unsent = self._core.unsent
        entries = [
            [target.request_id, getattr(target, "partials", 0)]
            for target in self._core.targets()
            if target.request_id not in unsent
        ]
        return protocol.REJOIN.pack(entries)

    # -- what the core hands up -----------------------------------------------------------

    def _stats(self, stats: Any) -> None:
        while self._stats_waiters:
            waiter = self._stats_waiters.popleft()
            if not waiter.done():
                waiter.set_result(stats)
                break

    def _failure(self, exc: BaseException) -> None:
        """The socket failed: nothing more will arrive."""
        if self._closed:
            return
        self._loop.remove_reader(self._fd)
        if self._watch is not None:  # a reconnection could not help a failed socket
            self._loop.remove_reader(self._watch.fd)
        self._core.fail_all(exc)
        self._fail_stats(exc)

    def _error(self, rid: int | None, code: int, message: str) -> None:
        error = CoordinatorError(code, message, rid)
        target = None if rid is None else self._core.pop(rid)
        if target is not None:
            _fail(target, error)
            return
        log.warning("coordkit client: %s", error)
        self.errors.append(error)
        if self._on_error is not None:
            try:
                self._on_error(error)
            except Exception:
                log.exception("coordkit client: on_error callback failed")


class Granted(NamedTuple):
    """What a coordinator granted in its CONNECT_ACK."""

    batch: bool  # batched messages
    rebuild: bool  # the rebuild after its loss (with an epoch)
    qos: bool  # priorities and deadlines: it queues requests


async def _choose(
    socket: zmq.Socket,
    watch: ConnectionWatch,
    candidates: Candidates,
    batch: bool,
    failover: float,
    ack_timeout: float,
    tenant: str | None,
) -> Granted:
    """Several addresses: from the current one on, in turn, the first coordinator that
    admits the client (see :func:`_attempt`); what the others sent is dropped."""
    while True:
        granted = await _attempt(socket, watch, candidates, batch, failover, ack_timeout, tenant)
        if granted is not None:
            return granted
        # A cluster's members read again (a member may have joined since); off the loop.
        await asyncio.get_running_loop().run_in_executor(None, candidates.refresh)
        candidates.move(socket, discard=True)


async def _attempt(
    socket: zmq.Socket,
    watch: ConnectionWatch,
    candidates: Candidates,
    batch: bool,
    failover: float,
    ack_timeout: float,
    tenant: str | None,
) -> Granted | None:
    """The current candidate's CONNECT_ACK, if it connects within CANDIDATE_WINDOW and
    acknowledges the client within ACK_WINDOW (or ``ack_timeout``, if shorter), its
    connection lasting, with an epoch no older than any seen; None otherwise."""
    others = candidates.others
    try:
        connected = _watched(watch, zmq.EVENT_HANDSHAKE_SUCCEEDED, others)
        await asyncio.wait_for(connected, CANDIDATE_WINDOW)
    except asyncio.TimeoutError:
        return None
    handshake = asyncio.ensure_future(_handshake(socket, batch, failover, candidates, tenant))
    ended = asyncio.ensure_future(_watched(watch, zmq.EVENT_DISCONNECTED, others))
    try:
        await asyncio.wait(
            {handshake, ended},
            timeout=min(ack_timeout, ACK_WINDOW),
            return_when="FIRST_COMPLETED",
        )
    finally:
        lasted = not ended.done()
        answered = handshake.done()
        ended.cancel()
        handshake.cancel()  # nothing when it is done
        # Their readers are gone before another is added on the same FD.
        await asyncio.gather(ended, handshake, return_exceptions=True)
    if not answered:
        return None
    exc = handshake.exception()
    if isinstance(exc, ConnectionError | ProtocolError):
        log.warning("coordkit client: %s", exc)
        return None
    if exc is not None:
        raise exc
    return handshake.result() if lasted else None


async def _watched(watch: ConnectionWatch, event: int, others: tuple[str, ...]) -> None:
    """Until ``watch`` reports ``event`` of an endpoint not in ``others`` (the events
    reported meanwhile are dropped)."""
    fd = watch.fd  # read once: a close() meanwhile closes the watch
    while event not in watch.events(others):
        await _readable(fd)


async def _handshake(
    socket: zmq.Socket,
    batch: bool,
    failover: float,
    candidates: Candidates | None = None,
    tenant: str | None = None,
) -> Granted:
    """Send CONNECT (asking for the rebuild when ``failover``, the client's
    failover_timeout, is > 0: the coordinator keeps its requests that long once its
    connection ends; naming ``tenant``), wait for CONNECT_ACK; what was granted. With
    ``candidates``, ConnectionError for a coordinator they do not admit."""
    rebuild = failover > 0
    hello: dict[str, Any] = {**COORDKIT_HELLO, QOS_FEATURE: 1}
    if tenant is not None:
        hello[TENANT_KEY] = tenant
    if batch:
        hello[BATCH_FEATURE] = 1
    if rebuild:
        hello[REBUILD_FEATURE] = 1
        hello[HOLD_KEY] = math.ceil(failover * 1000)
    connect = protocol.CONNECT_COORDKIT.pack(hello)
    while True:
        try:
            socket.send_multipart(connect, zmq.NOBLOCK)
            break
        except zmq.Again:
            # No pipe to queue it on: libzmq drops a connection's pipe when a CURVE
            # handshake is refused. A blocking send would stall the event loop for good;
            # the caller's timeout bounds this wait.
            await asyncio.sleep(_SEND_RETRY)
    frames = await _receive(socket)
    try:
        features = protocol.CONNECT_ACK_BATCH.parse(frames).features
    except ProtocolError:
        try:
            protocol.CONNECT_ACK.parse(frames)
        except ProtocolError:
            error = protocol.ERROR.parse(frames)  # a full client table answers ERROR(BUSY)
            refusal = CoordinatorError(error.code, error.message)
            raise ConnectionError(
                f"coordkit: the coordinator refused the connection: {refusal}"
            ) from None
        features = {}
    if candidates is not None and (stale := candidates.admit(features)) is not None:
        raise ConnectionError(f"coordkit: not following it: {stale}")
    return Granted(
        batch and features.get(BATCH_FEATURE) == 1,
        rebuild and features.get(REBUILD_FEATURE) == 1 and EPOCH_KEY in features,
        features.get(QOS_FEATURE) == 1,
    )


async def _receive(socket: zmq.Socket) -> list[bytes]:
    """The next message, awaited on the socket's FD (edge-triggered: check EVENTS first)."""
    fd = cast(int, socket.getsockopt(zmq.FD))
    while not cast(int, socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        await _readable(fd)
    return socket.recv_multipart(zmq.NOBLOCK)


async def _readable(fd: int) -> None:
    """Until a ZeroMQ FD signals (edge-triggered: the caller checks what is there first)."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _wake, readable)
    try:
        await readable
    finally:
        loop.remove_reader(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _fail(target: ReplyFuture | Stream, exc: BaseException) -> None:
    if isinstance(target, Stream):
        target._fail(exc)
    elif not target.done():
        target.set_exception(exc)
