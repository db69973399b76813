"""The engine core in Python: the reference twin of :mod:`coordkit._engine_c`.

:class:`coordkit.Engine` is the public face; under it a *core* receives what
the coordinator sent and turns it into events, and sends a step's replies as
one batched message. Both cores hand out the same events and put the same
frames on the wire:

* :meth:`EngineCore.poll` waits (or not) for the first message, then drains
  up to ``MAX_DRAIN`` messages: a SUBMIT_REQUEST (or SUBMIT_REQUEST_WITH_KV)
  is one :class:`~coordkit.engine.Request`, an ENGINE_SUBMIT_BATCH
  ``[95, [[rid, sampling_params], ...]]`` with one prompt frame per entry is
  one Request per entry, in order; ABORT, RELEASE_KV, SEND_KV and the control
  signals are one event each. An ERROR from the coordinator (a reply entry it could
  not deliver) is logged; an ENGINE_ACK (the coordinator took the engine's
  ENGINE_HELLO) goes to ``on_ack`` with what it granted. A message that does
  not parse is logged and dropped.
* :meth:`EngineCore.reply` sends ``[21, [[rid, needs_detokenize], ...]]`` and
  one body per entry, :meth:`EngineCore.reply_partial` ``[22, [rid, ...]]``
  likewise; a body that is not bytes-like is msgpack-packed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import zmq

from . import _codec_py, protocol
from ._events import Abort, Control, ReleaseKV, Request, SendKV, log, refused, take_traceparent
from ._held import Held, trailed
from .protocol import Header, ProtocolError, packb

__all__ = ["EngineCore", "MAX_DRAIN"]

#: Messages taken per poll, so that a flood cannot starve the step loop.
MAX_DRAIN = 4096

_BYTES_LIKE = (bytes, bytearray, memoryview, zmq.Frame)


def _body(body: Any) -> Any:
    return body if isinstance(body, _BYTES_LIKE) else packb(body)


class EngineCore:
    """What arrives, as events, and the replies of a step, as one message each.

    ``socket`` is the engine's registered DEALER. ``pending`` counts the
    requests received and not yet answered with a final reply. ``on_ack``
    takes the map of each ENGINE_ACK. ``held`` (a :class:`coordkit._held.Held`, or
    None) keeps what the rebuild needs: once the coordinator granted it, every
    request is followed by its trailer.
    """

    implementation = "py"

    def __init__(
        self,
        socket: zmq.Socket,
        on_ack: Callable[[dict[Any, Any]], None],
        held: Held | None = None,
    ):
        self.socket = socket
        self.pending = 0
        self._on_ack = on_ack
        self.held = held

    def poll(self, wait_ms: int) -> list[Any]:
        """Wait up to ``wait_ms`` for a message (0: do not wait), then take what is queued."""
        if wait_ms > 0 and not self.socket.poll(wait_ms, zmq.POLLIN):
            return []
        events: list[Any] = []
        for _ in range(MAX_DRAIN):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                self._parse(frames, events)
            except ProtocolError as exc:
                log.warning("coordkit engine: dropped a malformed message: %s", exc)
        return events

    def _parse(self, frames: list[zmq.Frame], events: list[Any]) -> None:
        header = _codec_py.read_header(frames[0].buffer)[0]  # as the C twin reads it
        held = self.held if self.held is not None and self.held.granted else None
        if header == Header.SUBMIT_BATCH:
            layout = None if held is None else self._trailed("ENGINE_SUBMIT_BATCH", frames)
            if layout is not None:
                frames = [frames[0], *(frames[at] for at, _, _ in layout)]
            entries, prompts = protocol.ENGINE_SUBMIT_BATCH.parse(frames)
            for (rid, sampling_params), prompt in zip(entries, prompts, strict=True):
                traceparent = take_traceparent(sampling_params)
                prompt = cast(zmq.Frame, prompt)
                events.append(Request(rid, sampling_params, prompt, traceparent=traceparent))
            if held is not None and layout is not None:
                for (rid, _), (_, trailer, hashes) in zip(entries, layout, strict=True):
                    held.track(rid, trailer, hashes)
            self.pending += len(entries)
        elif header == Header.SUBMIT_REQUEST:
            if held is not None and len(frames) > 4:
                raise ProtocolError("SUBMIT_REQUEST: bad layout")
            if held is not None and len(frames) < 3:
                raise ProtocolError("SUBMIT_REQUEST: no trailer")
            layout = None if held is None else self._trailed("SUBMIT_REQUEST", frames)
            submit = protocol.SUBMIT_REQUEST.parse(frames[:2] if held is not None else frames)
            traceparent = take_traceparent(submit.sampling_params)
            events.append(
                Request(submit.rid, submit.sampling_params, submit.prompt, traceparent=traceparent)
            )
            if held is not None and layout is not None:
                _, trailer, hashes = layout[0]
                held.track(submit.rid, trailer, hashes)
            self.pending += 1
        elif header == Header.SUBMIT_REQUEST_WITH_KV:
            submit = protocol.SUBMIT_REQUEST_WITH_KV.parse(frames)
            traceparent = take_traceparent(submit.sampling_params)
            events.append(
                Request(
                    submit.rid,
                    submit.sampling_params,
                    submit.prompt,
                    submit.kv_meta,
                    submit.src_block_ids,
                    traceparent,
                )
            )
            self.pending += 1
        elif header == Header.ABORT_REQUEST:
            rid = protocol.ABORT_REQUEST.parse(frames).rid
            events.append(Abort(rid))
            if self.held is not None:
                self.held.aborted(rid)
        elif header == Header.RELEASE_KV:  # one request's, or several
            try:
                rids = _codec_py.read_rids(frames[0].buffer)[1]
            except ProtocolError:
                rids = None
            if rids is None or len(frames) != 1:  # the C twin's words
                raise ProtocolError("RELEASE_KV: bad layout")
            for rid in rids:
                events.append(ReleaseKV(rid))
                if self.held is not None:
                    self.held.released(rid)
        elif header == Header.SEND_KV:
            send = protocol.SEND_KV.parse(frames)
            events.append(SendKV(send.rid, send.decode_meta, send.cached_prefix_blocks or 0))
        elif header in protocol.CONTROL:
            message = protocol.CONTROL[header].parse(frames)
            events.append(Control(Header(header), getattr(message, "epoch", None)))
        elif header == Header.ERROR:
            refused(protocol.ERROR.parse(frames))
        elif header == Header.ENGINE_ACK:
            self._on_ack(protocol.ENGINE_ACK.parse(frames).granted)
        elif self.held is None or not self.held.on_message(header, frames):
            raise ProtocolError(f"unexpected header {header!r}")

    @staticmethod
    def _trailed(name: str, frames: list[zmq.Frame]) -> list[Any]:
        return trailed(name, len(frames), lambda i: frames[i].buffer)

    def reply(self, finished: Iterable[Any]) -> None:
        """Send the final replies of one step as ONE batched ENGINE_REPLY."""
        entries, bodies = [], []
        for rid, body, *detokenize in finished:
            entries.append([rid, bool(detokenize and detokenize[0])])
            bodies.append(_body(body))
        if entries:
            self.socket.send_multipart(protocol.ENGINE_REPLY.pack(entries, bodies), copy=False)
            self.pending = max(self.pending - len(entries), 0)
            if self.held is not None:
                self.held.sent(True, [(e[0], b) for e, b in zip(entries, bodies, strict=True)])

    def reply_partial(self, partial: Iterable[Any]) -> None:
        """Send the partial replies of one step as ONE batched ENGINE_REPLY_PARTIAL."""
        entries, bodies = [], []
        for rid, body in partial:
            entries.append(rid)
            bodies.append(_body(body))
        if entries:
            frames = protocol.ENGINE_REPLY_PARTIAL.pack(entries, bodies)
            self.socket.send_multipart(frames, copy=False)
            if self.held is not None:
                self.held.sent(False, list(zip(entries, bodies, strict=True)))
