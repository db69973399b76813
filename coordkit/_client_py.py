"""The client core in Python: the reference twin of :mod:`coordkit._client_c`.

:class:`coordkit.Client` is the public face; under it a *core* owns the socket
I/O, the table of pending requests and the encoding and decoding of frames.
Both cores put the same frames on the wire and resolve the same futures with
the same values:

* sends go straight to the socket, non-blocking. Only when libzmq would block
  (the high-water mark is reached) is the message kept in an outbox, in
  order, until the socket says POLLOUT;
* one reader callback on the socket's ``zmq.FD`` drains every message that is
  ready and resolves the waiting futures in one pass. ZeroMQ's FD is
  edge-triggered: the reader reads ``zmq.EVENTS`` before it receives (which
  re-arms the FD), drains until EAGAIN, and every burst of sends made outside
  the reader is followed, once per event-loop iteration, by another look at
  the socket, since a send may have consumed the edge of a message that
  arrived meanwhile;
* when the coordinator granted batches (CONNECT_ACK ``{"batch": 1}``), the
  submissions of one event-loop iteration are coalesced into SUBMIT_BATCH
  messages (a lone one goes as a plain SUBMIT_REQUEST), flushed by a
  ``loop.call_soon`` callback or before any other message; replies may then
  come as REPLY_BATCH.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import msgpack
import zmq

from . import _codec_py, protocol
from ._checks import BYTES_LIKE, pack_params, token_ids
from ._shared import logger, never_ran
from .protocol import ErrorCode, Header, ProtocolError, block_hashes, packb, unpackb

__all__ = [
    "ClientCore",
    "MAX_BATCH_ENTRIES",
    "MAX_BATCH_BYTES",
    "MAX_DRAIN",
    "encode_prompt",
    "pack_tokens",
]

log = logger.getChild("client")

#: Requests in one SUBMIT_BATCH at most; a longer burst goes as several.
MAX_BATCH_ENTRIES = 1024
#: Payload bytes (prompts and block hashes) in one SUBMIT_BATCH before it is sent.
MAX_BATCH_BYTES = 4 << 20
#: Messages the reader takes in one callback before it lets other callbacks run.
MAX_DRAIN = 4096

_HEADER_SUBMIT = packb(Header.SUBMIT_REQUEST)
_HEADER_BATCH = packb(Header.SUBMIT_BATCH)
# pack and pack_array_header run in C without releasing the GIL: one shared Packer is safe.
_packer = msgpack.Packer()

# asyncio.Future's own methods, called unbound (a ReplyFuture overrides cancel() only).
_set_result = asyncio.Future.set_result
_future_done = asyncio.Future.done


def pack_tokens(tokens: Any, prompt_index: int | None = None) -> bytes:
    """``msgpack.packb`` of the token ids as plain ints.

    A list, a tuple, anything with ``tolist()`` (numpy arrays, ``array.array``)
    or any other sequence, of ints in ``[0, 2**32)``; anything else raises
    TypeError or ValueError naming the first bad token (see ``_checks.token_ids``).
    """
    return packb(token_ids(tokens, prompt_index))


def encode_prompt(prompt: Any, prompt_index: int | None = None) -> Any:
    """A prompt's frame: bytes-like as it is, a str or token ids msgpack-packed;
    TypeError or ValueError, before anything is sent, for anything else."""
    if isinstance(prompt, BYTES_LIKE):
        return prompt
    if isinstance(prompt, str):
        return packb(prompt)
    return pack_tokens(prompt, prompt_index)


#: A request's QoS fields packed (_checks.qos_fields), or empty for none.
Qos = bytes


def submit_frames(
    rid: int, params: bytes, frame: Any, hashes: bytes | None, qos: Qos = b""
) -> list[Any]:
    """SUBMIT_REQUEST ``[20, rid, params]`` with the params already packed, or
    ``[20, rid, priority, deadline_ms, params]`` with its QoS fields."""
    head = _packer.pack_array_header(5 if qos else 3) + _HEADER_SUBMIT
    metadata = head + _packer.pack(rid) + qos + params
    return [metadata, frame] if hashes is None else [metadata, frame, hashes]


def submit_batch_frames(requests: list[tuple[int, bytes, Any, bytes | None, Qos]]) -> list[Any]:
    """SUBMIT_BATCH ``[95, [[rid, params, hashed], ...]]`` (an entry with its QoS fields
    ``[rid, priority, deadline_ms, params, hashed]``), then each prompt (and its hashes)."""
    parts = [_packer.pack_array_header(2), _HEADER_BATCH, _packer.pack_array_header(len(requests))]
    frames: list[Any] = [b""]
    for rid, params, frame, hashes, qos in requests:
        head = b"\x95" if qos else b"\x93"
        parts += [head, _packer.pack(rid), qos, params, b"\xc2" if hashes is None else b"\xc3"]
        frames.append(frame)
        if hashes is not None:
            frames.append(hashes)
    frames[0] = b"".join(parts)
    return frames


def _hashes(prompt: Any, block_size: int | None) -> bytes | None:
    if block_size is None:
        return None
    if isinstance(prompt, (str, *BYTES_LIKE)):
        raise ValueError("block hashes need a prompt of token ids")
    return block_hashes(prompt, block_size)


def _length(frame: Any) -> int:
    return len(frame.buffer) if isinstance(frame, zmq.Frame) else memoryview(frame).nbytes


class ClientCore:
    """The socket, the pending requests and the frames of one :class:`coordkit.Client`.

    ``socket`` is a connected, acknowledged DEALER (a plain ``zmq.Socket``);
    ``batch`` says whether the coordinator granted batches (the client sets it
    again after a reconnection). The callbacks take
    an ERROR's ``(rid or None, code, message)``, a STATS_REPLY's body, and the
    exception of a socket that failed.
    """

    implementation = "py"

    def __init__(
        self,
        socket: zmq.Socket,
        *,
        loop: asyncio.AbstractEventLoop,
        batch: bool,
        future_types: tuple[type, type],
        stream_type: type,
        on_error: Callable[[int | None, int, str], None],
        on_stats: Callable[[Any], None],
        on_failure: Callable[[BaseException], None],
        on_resend: Callable[[list[int]], None] | None = None,
    ):
        self.socket = socket
        self.loop = loop
        self.batch = batch
        self.pending: dict[int, Any] = {}
        self.closed = False
        # No coordinator for now (a rebuild client riding through its loss): the
        # submissions are not sent (their ids wait in ``unsent``, sent again at
        # release()), every other message (ABORT, control, STATS) waits in ``_later``.
        self.held = False
        self._later: deque[list[Any]] = deque()
        # The pending requests never handed to libzmq since the loss: at no engine,
        # so the REJOIN leaves them out and release() sends them again at once.
        self.unsent: set[int] = set()
        self.next_rid = 0
        self._future_types = future_types  # decoded, raw
        self._stream_type: Any = stream_type
        self._on_error = on_error
        self._on_stats = on_stats
        self._on_failure = on_failure
        self._on_resend = on_resend
        self._outbox: deque[list[Any]] = deque()  # whole messages libzmq refused, in order
        # submissions to coalesce
        self._open: list[tuple[int, bytes, Any, bytes | None, Qos]] = []
        self._open_bytes = 0
        self._flush_scheduled = False
        self._check_scheduled = False

    @property
    def queued(self) -> int:
        """Messages libzmq refused for now, waiting in the outbox for POLLOUT."""
        return len(self._outbox)

    @property
    def count(self) -> int:
        """Requests sent (or coalescing) and not yet ended."""
        return len(self.pending)

    def pop(self, rid: int) -> Any:
        """The pending request ``rid``, taken out of the table; None when it is not pending."""
        return self.pending.pop(rid, None)

    def get(self, rid: int) -> Any:
        """The pending request ``rid``, left in the table; None when it is not pending."""
        return self.pending.get(rid)

    def targets(self) -> list[Any]:
        """The pending requests, by id."""
        return [self.pending[rid] for rid in sorted(self.pending)]

    # -- requests --------------------------------------------------------------------

    def submit(
        self,
        prompt: Any,
        sampling_params: Any,
        block_size: int | None,
        raw: bool,
        block_hashes: Any = None,
        qos: Qos = b"",
    ) -> Any:
        return self._one(False, prompt, sampling_params, block_size, raw, block_hashes, qos)

    def stream(
        self,
        prompt: Any,
        sampling_params: Any,
        block_size: int | None,
        raw: bool,
        block_hashes: Any = None,
        qos: Qos = b"",
    ) -> Any:
        return self._one(True, prompt, sampling_params, block_size, raw, block_hashes, qos)

    def _one(
        self,
        streaming: bool,
        prompt: Any,
        sampling_params: Any,
        block_size: int | None,
        raw: bool,
        block_hashes: Any,
        qos: Qos,
    ) -> Any:
        """One request, answered to a future, or to a stream when ``streaming``."""
        self._check_open()
        params = pack_params(sampling_params)
        frame = encode_prompt(prompt)
        hashes = _hashes(prompt, block_size) if block_size is not None else block_hashes
        make = self._stream_type if streaming else self._future
        target = make(self.next_rid, raw)
        self._request(target, params, frame, hashes, qos)
        return target

    def resend(
        self,
        rid: int,
        prompt: Any,
        sampling_params: Any,
        block_size: int | None,
        block_hashes: Any = None,
        qos: Qos = b"",
    ) -> None:
        """Send the pending request ``rid`` again, under its id (RESEND, a rejoin)."""
        self._check_open()
        params = pack_params(sampling_params)
        frame = encode_prompt(prompt)
        hashes = _hashes(prompt, block_size) if block_size is not None else block_hashes
        self._send_request(rid, params, frame, hashes, qos, True)

    def submit_many(
        self,
        prompts: Iterable[Any],
        sampling_params: Any,
        block_size: int | None,
        raw: bool,
        qos: Qos = b"",
        own_params: dict[int, Any] | None = None,
    ) -> list[Any]:
        """One future per prompt, all with the same ``qos``; everything is encoded before
        anything is sent. ``own_params`` (by the prompt's index) replace
        ``sampling_params`` for some prompts: the traced ones, whose params carry their
        traceparent."""
        self._check_open()
        params = pack_params(sampling_params)
        own = {i: pack_params(p) for i, p in own_params.items()} if own_params else None
        encoded = [(encode_prompt(p, i), _hashes(p, block_size)) for i, p in enumerate(prompts)]
        futures = []
        self.flush()  # what this iteration coalesced so far goes first
        for i, (frame, hashes) in enumerate(encoded):
            future = self._future(self.next_rid, raw)
            futures.append(future)
            packed = params if own is None else own.get(i, params)
            self._request(future, packed, frame, hashes, qos, scheduled=False)
        self.flush()
        return futures

    def _future(self, rid: int, raw: bool) -> Any:
        # Given its loop, a future does not look it up (a getpid() system call each time).
        future = self._future_types[raw](loop=self.loop)
        future.request_id = rid
        return future

    def _request(
        self,
        target: Any,
        params: bytes,
        frame: Any,
        hashes: bytes | None,
        qos: Qos,
        scheduled: bool = True,
    ) -> None:
        rid = self.next_rid
        self.next_rid += 1
        self.pending[rid] = target
        self._send_request(rid, params, frame, hashes, qos, scheduled)

    def _send_request(
        self, rid: int, params: bytes, frame: Any, hashes: bytes | None, qos: Qos, scheduled: bool
    ) -> None:
        if self.held:
            self.unsent.add(rid)
            return
        if not self.batch:
            self._send_message(submit_frames(rid, params, frame, hashes, qos))
            return
        self._open.append((rid, params, frame, hashes, qos))
        self._open_bytes += _length(frame) + (len(hashes) if hashes is not None else 0)
        if len(self._open) >= MAX_BATCH_ENTRIES or self._open_bytes >= MAX_BATCH_BYTES:
            self.flush()
        elif scheduled and not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the submissions coalesced so far: one SUBMIT_BATCH, or a SUBMIT for one."""
        self._flush_scheduled = False
        requests, self._open, self._open_bytes = self._open, [], 0
        if len(requests) == 1:
            self._send_message(submit_frames(*requests[0]))
        elif requests:
            self._send_message(submit_batch_frames(requests))

    def hold(self) -> None:
        """No coordinator for now: until release(), submissions are not sent (nor those
        coalesced or waiting in the outbox): their ids are kept in ``unsent``, and
        every other message is kept, in order, for the coordinator that accepts the
        client again."""
        self.held = True
        self.unsent.update(rid for rid, *_ in self._open)
        self._open, self._open_bytes = [], 0
        kept, rids = protocol.rejoin_covers(self._outbox)
        self._later.extend(kept)
        self.unsent.update(rids)
        self._outbox.clear()

    def release(self, first: list[Any] | None) -> None:
        """A coordinator accepted the client again: ``first`` (its REJOIN), the requests
        never sent since the loss (as on RESEND), then what was kept while held, in the
        order it was issued."""
        self.held = False
        later, self._later = self._later, deque()
        unsent, self.unsent = sorted(self.unsent), set()
        if first is not None:
            self.send(first)
        if unsent and self._on_resend is not None:
            self._on_resend(unsent)
            self.flush()
        for frames in later:
            self.send(frames)

    def abort(self, rid: int) -> bool:
        """Send ABORT for a pending request; False (nothing sent) when it is not pending."""
        if self.closed or rid not in self.pending:
            return False
        if rid in self.unsent:  # never sent: it ends here, there is nothing to abort
            self.unsent.discard(rid)
            self._on_error(rid, ErrorCode.UNKNOWN_REQUEST, never_ran(rid))
            return True
        self.send(protocol.ABORT_REQUEST.pack(rid))
        return True

    def cancelled(self, rid: int) -> None:
        """A ReplyFuture was cancelled: abort its request at the engine."""
        self.abort(rid)

    # -- sending -----------------------------------------------------------------------

    def send(self, frames: list[Any]) -> None:
        """Send one message after the coalesced submissions (control, ABORT, STATS)."""
        self._check_open()
        self.flush()
        if self.held:
            self._later.append(frames)
            return
        self._send_message(frames)

    def _send_message(self, frames: list[Any]) -> None:
        if not self._outbox:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                self._failed(exc)
                return
            else:
                self._sent()
                return
        self._outbox.append(frames)
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        """Send what libzmq refused, in order, for as long as it takes it."""
        while self._outbox:
            try:
                self.socket.send_multipart(self._outbox[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not self._events() & zmq.POLLOUT:
                    return  # the reader tries again when the FD says the socket changed
                continue
            except zmq.ZMQError as exc:
                self._failed(exc)
                return
            self._outbox.popleft()
        self._sent()

    def _events(self) -> int:
        """The socket's ZMQ_EVENTS; reading them re-arms its FD."""
        return cast(int, self.socket.getsockopt(zmq.EVENTS))

    def _sent(self) -> None:
        """After sends made outside the reader: look at the socket once this iteration."""
        if not self._check_scheduled:
            self._check_scheduled = True
            self.loop.call_soon(self._check)

    def _check(self) -> None:
        self._check_scheduled = False
        self.on_readable()

    # -- receiving ---------------------------------------------------------------------

    def on_readable(self) -> None:
        """The reader callback: drain what is ready, resolve it, send what waited."""
        received = 0
        while not self.closed:
            try:
                events = self._events()
            except zmq.ZMQError as exc:
                self._failed(exc)
                return
            if self._outbox and events & zmq.POLLOUT:
                self._flush_outbox()
            if not events & zmq.POLLIN:
                return
            before = received
            while not self.closed and received < MAX_DRAIN:
                try:
                    frames = self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    self._failed(exc)
                    return
                received += 1
                try:
                    self._dispatch(frames)
                except ProtocolError as exc:
                    log.warning("coordkit client: dropped a malformed message: %s", exc)
            if received >= MAX_DRAIN:
                self.loop.call_soon(self.on_readable)  # more may wait: let others run first
                return
            if received == before:
                return

    def _dispatch(self, frames: list[bytes]) -> None:
        header = _codec_py.read_header(frames[0])[0]
        if header == Header.ENGINE_REPLY or header == Header.ENGINE_REPLY_PARTIAL:
            rid = _codec_py.read_header_int(frames[0])[1]
            if len(frames) != 2:
                raise ProtocolError(f"{Header(header).name}: expected 2 frames, got {len(frames)}")
            self._deliver(rid, frames[1], header == Header.ENGINE_REPLY)
        elif header == Header.REPLY_BATCH:
            try:
                entries = _codec_py.read_reply_batch(frames[0])
            except ProtocolError as exc:
                self._fail_named(exc.rids, str(exc))
                return
            if len(entries) != len(frames) - 1:
                text = f"REPLY_BATCH: {len(entries)} entries but {len(frames) - 1} payload frames"
                self._fail_named([rid for rid, _ in entries], text)
                return
            for (rid, final), body in zip(entries, frames[1:], strict=True):
                self._deliver(rid, body, final)
        elif header == Header.ERROR:
            error = protocol.ERROR.parse(frames)
            self._on_error(error.rid, error.code, error.message)
        elif header == Header.STATS_REPLY:
            self._on_stats(unpackb(protocol.STATS_REPLY.parse(frames).stats))
        elif header == Header.RESEND and self._on_resend is not None:
            self._on_resend(protocol.RESEND.parse(frames)[0])
        elif header == Header.REPLAYED:
            entries, bodies = protocol.CLIENT_REPLAYED.parse(frames)
            for entry, body in zip(entries, cast(list[bytes], bodies), strict=True):
                rid, index, final = cast(list[Any], entry)
                if final or index >= getattr(self.pending.get(rid), "partials", index):
                    self._deliver(rid, body, final)
        elif header != Header.CONNECT_ACK:  # a repeated ACK is harmless
            raise ProtocolError(f"unexpected header {header!r}")

    def _fail_named(self, rids: Sequence[int], text: str) -> None:
        """A REPLY_BATCH that does not read whole, or whose bodies do not match its
        entries: the requests it names fail, rather than wait for replies that
        will not come."""
        log.warning("coordkit client: %s", text)
        for rid in rids:
            target = self.pending.pop(rid, None)
            if target is not None:
                self._fail(target, ProtocolError(text, rid))

    def _deliver(self, rid: int, body: Any, final: bool) -> None:
        target = self.pending.pop(rid, None) if final else self.pending.get(rid)
        if target is None:
            log.debug("coordkit client: reply for request %s, which is not pending", rid)
            return
        stream = type(target) is self._stream_type
        if not final and not stream:
            return  # partials are for streams only
        try:
            value = body if target.raw else unpackb(body)
        except ProtocolError as exc:
            self.pending.pop(rid, None)
            self._fail(target, ProtocolError(f"reply body is {exc}", rid))
            return
        if stream:
            target._put(final, value)
        elif not _future_done(target):  # a cancelled one does not want its final reply
            _set_result(target, value)

    # -- failures and the end ------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        """The socket failed: nothing more will arrive."""
        log.error("coordkit client: socket failed: %r", exc)
        self.closed = True
        self._on_failure(ConnectionError(f"coordkit client: socket failed: {exc!r}"))

    def fail_all(self, exc: BaseException) -> None:
        """Fail every pending request with ``exc``; drop what was not sent yet (the
        coalesced requests, the outbox, what was held), lest it reach a coordinator that
        never knew them."""
        self._outbox.clear()
        self._later.clear()
        self.unsent.clear()
        self._open, self._open_bytes = [], 0
        pending, self.pending = self.pending, {}
        for target in pending.values():
            self._fail(target, exc)

    def _fail(self, target: Any, exc: BaseException) -> None:
        if type(target) is self._stream_type:
            target._fail(exc)
        elif not _future_done(target):
            target.set_exception(exc)

    def close(self, exc: BaseException) -> None:
        """No more sends; what libzmq refused gets one more try; pending requests fail."""
        if self._outbox:
            self._flush_outbox()
        self.closed = True
        self._outbox.clear()
        self.fail_all(exc)

    def _check_open(self) -> None:
        if self.closed:
            raise ConnectionError("coordkit client is closed")
