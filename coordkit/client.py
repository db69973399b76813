"""The asyncio client: submit prompts to a coordinator and await the engines' replies.

::

    async with await Client.connect("ipc:///tmp/coordkit.sock") as client:
        reply = await client.submit([1, 2, 3], {"max_tokens": 8})
        async for part in client.stream("hello"):
            print(part)

One :class:`Client` is one DEALER socket and one receive task on the running
event loop; use it from that loop only. Replies are matched to requests by
the client's own request ids (0, 1, 2, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.asyncio

from . import protocol
from .protocol import (
    COORDKIT_HELLO,
    STREAM_KEY,
    ErrorCode,
    Header,
    ProtocolError,
    block_hashes,
    packb,
    unpackb,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Client", "CoordinatorError", "ReplyFuture", "Stream"]

log = logging.getLogger(__name__)

#: A prompt: text, token ids, or bytes sent as they are.
Prompt = str | bytes | bytearray | memoryview | zmq.Frame | Sequence[int]

_BYTES_LIKE = (bytes, bytearray, memoryview, zmq.Frame)
_CLOSE_LINGER_MS = 1000  # lets a last message (SHUTDOWN, ABORT) leave after close()


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
    """The future :meth:`Client.submit` returns; ``request_id`` is its client id.

    Cancelling it aborts the request at its engine.
    """

    request_id: int
    raw: bool


class Stream:
    """The async iterator :meth:`Client.stream` returns: partial replies, then the final.

    Iteration raises :class:`CoordinatorError` if the request fails.
    """

    def __init__(self, request_id: int, raw: bool):
        self.request_id = request_id
        self.raw = raw
        self._queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        self._ended = False

    def _put(self, final: bool, value: Any) -> None:
        self._queue.put_nowait((final, value))

    def _fail(self, exc: BaseException) -> None:
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


class Client:
    """A connection to a coordinator; create it with :meth:`connect`.

    ERRORs that concern no pending request (a control signal the coordinator's
    state machine refused, an abort of a request it no longer holds) are
    logged, kept in :attr:`errors` (the latest 100) and passed to ``on_error``.
    """

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        address: str,
        on_error: Callable[[CoordinatorError], None] | None = None,
    ):
        self.address = address
        self.errors: deque[CoordinatorError] = deque(maxlen=100)
        self._on_error = on_error
        self._socket = socket
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count()
        self._pending: dict[int, ReplyFuture | Stream] = {}
        self._stats_waiters: deque[asyncio.Future[dict[str, Any]]] = deque()
        self._closed = False
        self._reader = self._loop.create_task(self._read(), name=f"coordkit-client {address}")

    @classmethod
    async def connect(
        cls,
        address: str,
        *,
        timeout: float = 10.0,
        context: zmq.asyncio.Context | None = None,
        on_error: Callable[[CoordinatorError], None] | None = None,
    ) -> Client:
        """Connect to the coordinator at ``address`` and wait for its CONNECT_ACK.

        Raises :class:`ConnectionError` if no CONNECT_ACK comes within ``timeout`` seconds.
        """
        socket = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        try:
            socket.connect(address)
            await asyncio.wait_for(_handshake(socket), timeout)
        except asyncio.TimeoutError:
            socket.close(linger=0)
            raise ConnectionError(
                f"coordkit: no coordinator answered at {address} within {timeout} s"
            ) from None
        except BaseException:
            socket.close(linger=0)
            raise
        return cls(socket, address, on_error)

    # -- requests ------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        sampling_params: Any = None,
        *,
        block_size: int | None = None,
        raw: bool = False,
        block_hashes: bytes | None = None,
    ) -> ReplyFuture:
        """Send one request; the future resolves to its final reply body.

        ``prompt`` is a ``str`` (sent msgpack-packed), a sequence of token ids
        (msgpack-packed, as Megatron's engines expect) or a bytes-like object,
        sent as it is without a copy: do not modify it until the reply came.
        ``block_size`` adds the prefix-routing block hashes (token-id prompts
        only), or ``block_hashes`` sends a block-hash frame as given. The body
        is msgpack-decoded unless ``raw``, which gives bytes.
        Partial replies are not delivered here; use :meth:`stream` for them.
        An ERROR for the request fails the future with :class:`CoordinatorError`.
        """
        future = ReplyFuture(loop=self._loop)
        future.request_id = next(self._ids)
        future.raw = raw
        self._send_submit(future, prompt, sampling_params, block_size, block_hashes)
        future.add_done_callback(self._abort_if_cancelled)
        return future

    def stream(
        self,
        prompt: Prompt,
        sampling_params: Any = None,
        *,
        block_size: int | None = None,
        raw: bool = False,
        block_hashes: bytes | None = None,
    ) -> Stream:
        """Send one request with ``{STREAM_KEY: True}`` added to its sampling params.

        The request is sent now; the returned :class:`Stream` yields each
        partial reply and ends with the final one.
        """
        params = {**(sampling_params or {}), STREAM_KEY: True}
        stream = Stream(next(self._ids), raw)
        self._send_submit(stream, prompt, params, block_size, block_hashes)
        return stream

    async def abort(self, request: ReplyFuture | Stream | int) -> None:
        """Abort a request (its future, stream or id); a no-op if it already ended.

        The engine still sends a final reply, which resolves the request as usual.
        """
        rid = request if isinstance(request, int) else request.request_id
        if rid in self._pending:
            await self._send(protocol.ABORT_REQUEST.pack(rid))

    def _send_submit(
        self,
        target: ReplyFuture | Stream,
        prompt: Prompt,
        sampling_params: Any,
        block_size: int | None,
        hashes: bytes | None = None,
    ) -> None:
        self._check_open()
        rid = target.request_id
        params = {} if sampling_params is None else sampling_params
        if block_size is not None:
            if isinstance(prompt, (str, *_BYTES_LIKE)):
                raise ValueError("block hashes need a prompt of token ids")
            hashes = block_hashes(prompt, block_size)
        frames = protocol.SUBMIT_REQUEST.pack(rid, params, _encode_prompt(prompt), hashes)
        self._pending[rid] = target
        sent = cast("asyncio.Future[Any]", self._socket.send_multipart(frames, copy=False))
        sent.add_done_callback(lambda done: self._on_sent(rid, done))

    def _on_sent(self, rid: int, sent: asyncio.Future[Any]) -> None:
        error = None if sent.cancelled() else sent.exception()
        if error is not None and (target := self._pending.pop(rid, None)) is not None:
            _fail(target, error)

    def _abort_if_cancelled(self, future: ReplyFuture) -> None:
        if future.cancelled() and not self._closed and future.request_id in self._pending:
            self._socket.send_multipart(protocol.ABORT_REQUEST.pack(future.request_id))

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

    async def stats(self, timeout: float | None = 10.0) -> dict[str, Any]:
        """The coordinator's counters, engines and state (raises TimeoutError)."""
        self._check_open()
        waiter: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        # Replies carry no id: they come in order, and a timed-out waiter still takes its own.
        self._stats_waiters.append(waiter)
        await self._send(protocol.STATS.pack())
        return await asyncio.wait_for(waiter, timeout)

    async def wait_for_engines(self, count: int, timeout: float = 10.0) -> None:
        """Wait until ``count`` engines are registered and alive (polls :meth:`stats`)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = await self.stats(timeout=max(deadline - time.monotonic(), 0.001))
            alive = sum(engine["state"] == "alive" for engine in stats["engines"])
            if alive >= count:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{alive} of {count} engines registered after {timeout} s")
            # The protocol has no registration event for clients, so ask again shortly.
            await asyncio.sleep(0.02)

    # -- lifecycle -----------------------------------------------------------------

    async def close(self) -> None:
        """Close the socket; pending requests fail with ConnectionError."""
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._fail_all(ConnectionError("coordkit client closed with the request pending"))
        self._socket.close(linger=_CLOSE_LINGER_MS)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def pending(self) -> int:
        """Requests sent and not yet ended."""
        return len(self._pending)

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionError("coordkit client is closed")

    async def _send(self, frames: list[Any]) -> None:
        self._check_open()
        await self._socket.send_multipart(frames)

    def _fail_all(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for target in pending.values():
            _fail(target, exc)
        while self._stats_waiters:
            waiter = self._stats_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)

    # -- receiving -----------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                frames = await self._socket.recv_multipart()
                try:
                    self._dispatch(frames)
                except ProtocolError as exc:
                    log.warning("coordkit client: dropped a malformed message: %s", exc)
        except Exception as exc:  # the socket failed: nothing more will arrive
            log.error("coordkit client: receive failed: %r", exc)
            self._fail_all(ConnectionError(f"coordkit client: receive failed: {exc!r}"))

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            header = unpackb(frames[0])[0]
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"unreadable metadata frame ({exc!r})") from None
        if header == Header.ENGINE_REPLY:
            reply = protocol.CLIENT_REPLY.parse(frames)
            self._deliver(reply.rid, reply.body, final=True)
        elif header == Header.ENGINE_REPLY_PARTIAL:
            reply = protocol.CLIENT_REPLY_PARTIAL.parse(frames)
            self._deliver(reply.rid, reply.body, final=False)
        elif header == Header.ERROR:
            error = protocol.ERROR.parse(frames)
            self._error(CoordinatorError(error.code, error.message, error.rid))
        elif header == Header.STATS_REPLY:
            stats = unpackb(protocol.STATS_REPLY.parse(frames).stats)
            while self._stats_waiters:
                waiter = self._stats_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(stats)
                    break
        elif header != Header.CONNECT_ACK:  # a repeated ACK is harmless
            raise ProtocolError(f"unexpected header {header!r}")

    def _deliver(self, rid: int, body: bytes, final: bool) -> None:
        target = self._pending.pop(rid, None) if final else self._pending.get(rid)
        if target is None:
            log.debug("coordkit client: reply for request %s, which is not pending", rid)
            return
        try:
            value = body if target.raw else unpackb(body)
        except Exception as exc:  # msgpack raises several unrelated types
            self._pending.pop(rid, None)
            _fail(target, ProtocolError(f"reply body is not msgpack ({exc!r})", rid))
            return
        if isinstance(target, Stream):
            target._put(final, value)
        elif final and not target.done():
            target.set_result(value)

    def _error(self, error: CoordinatorError) -> None:
        target = None if error.request_id is None else self._pending.pop(error.request_id, None)
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


async def _handshake(socket: zmq.asyncio.Socket) -> None:
    await socket.send_multipart(protocol.CONNECT_COORDKIT.pack(COORDKIT_HELLO))
    frames = await socket.recv_multipart()
    try:
        protocol.CONNECT_ACK.parse(frames)
    except ProtocolError:
        error = protocol.ERROR.parse(frames)  # a full client table answers ERROR(BUSY)
        refusal = CoordinatorError(error.code, error.message)
        raise ConnectionError(
            f"coordkit: the coordinator refused the connection: {refusal}"
        ) from None


def _encode_prompt(prompt: Prompt) -> Any:
    if isinstance(prompt, _BYTES_LIKE):
        return prompt
    if isinstance(prompt, str):
        return packb(prompt)
    # numpy arrays and the like: tolist() gives plain ints, which msgpack packs.
    tokens = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    return packb(tokens)


def _fail(target: ReplyFuture | Stream, exc: BaseException) -> None:
    if isinstance(target, Stream):
        target._fail(exc)
    elif not target.done():
        target.set_exception(exc)
