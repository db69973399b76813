"""The rare paths' frames as Python bytes: read, parsed, sent (loop/answers.pyx)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import zmq

from .. import _codec_py as codec
from .. import protocol
from .._shared import Counter, detokenize
from ..protocol import Buffer, MessageSpec, ProtocolError
from .message import _buffers, _send_all
from .tables import _Client
from .traffic import SENT

if TYPE_CHECKING:
    from .loop import Loop


class Answers:
    """The rare paths' frames as Python bytes: the message at hand read and parsed by its spec,
    answers sent to a peer or to the sender, and counted."""

    def __init__(self, loop: Loop):
        self._loop = loop

    def parse(
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
            self._loop._refusals.malformed(client, exc.rid, header, str(exc), frames)
            return None

    def detokenized(self, body: Buffer) -> Buffer:
        """A reply body with its generated_text; on failure the body as it is."""
        try:
            out = detokenize(self._loop._options.detokenizer, body)  # type: ignore[arg-type]
        except Exception as exc:  # a bad body or a failing detokenizer
            self._loop._counters[Counter.DETOKENIZE_ERRORS] += 1
            self._loop._log.warn("detokenize", f"detokenize failed, body forwarded as is: {exc!r}")
            return body
        self._loop._counters[Counter.DETOKENIZED] += 1
        return out

    def send(self, identity: bytes, frames: list[Any]) -> bool:
        """Send one message to a peer; False when it is gone."""
        if not self._loop._send_identity(identity):
            return False
        try:
            header = codec.read_header(frames[0])[0]
        except ProtocolError:
            header = -1
        self._loop._traffic.count(SENT, header, _send_all(self._loop._sock, frames))
        return True
