"""What a rebuild engine keeps so that a coordinator's loss costs nothing.

Both engine cores hold one :class:`Held` (the rare path of the rebuild: the
cores' hot paths only hand it the trailer of each request and the bodies of
each reply message). It keeps, for each request a rebuild client sent (its
trailer names the client), the client's id and request id, the partials sent
and whether the final was, and the bodies of the replies no HANDLED covers
yet; and it answers the coordinator's rebuild messages:

* ENGINE_ACK (the rebuild granted; the Engine passes its map on): HELD, what
  it holds;
* REPLAY: REPLAYED, the bodies kept from the partial asked for on;
* HANDLED: the bodies of reply messages up to that number are dropped, and a
  request whose final is among them is forgotten.

Reply messages (ENGINE_REPLY, ENGINE_REPLY_PARTIAL, REPLAYED) are numbered
from 1 in the order they are sent; an ENGINE_HELLO says the next number
(``base``), so that the coordinator's HANDLED counts in the same numbers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from . import protocol
from .protocol import EPOCH_KEY, REBUILD_FEATURE, Header, ProtocolError, Trailer, parse_trailer

__all__ = ["Held", "trailed"]


def trailed(n_frames: int, frame: Callable[[int], Any]) -> list[tuple[int, Trailer]]:
    """A batch to a rebuild engine, ``n_frames`` frames (``frame(i)`` the i-th's bytes):
    where each entry's prompt is and its trailer. After each prompt comes its
    trailer, then the block hashes when the trailer says so."""
    layout = []
    at = 1
    while at < n_frames:
        if at + 1 >= n_frames:
            raise ProtocolError("ENGINE_SUBMIT_BATCH: a prompt without its trailer")
        trailer = parse_trailer(frame(at + 1))
        layout.append((at, trailer))
        at += 3 if trailer.hashed else 2
    if at != n_frames:
        raise ProtocolError("ENGINE_SUBMIT_BATCH: a trailer's block hashes are missing")
    return layout


class _Kept:
    """One request held for a rebuild client; ``bodies`` are ``[index, number, body,
    final]``: the partial's place (the final's: the partials before it), the reply
    message it was last sent in."""

    __slots__ = ("client_rid", "client_id", "partials", "final", "bodies")

    def __init__(self, client_rid: int, client_id: bytes):
        self.client_rid = client_rid
        self.client_id = client_id
        self.partials = 0
        self.final = False
        self.bodies: list[list[Any]] = []


class Held:
    """The requests a rebuild engine holds and the replies it has not seen handled."""

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self.granted = False  # the coordinator said rebuild in its ENGINE_ACK
        self.epoch: int | None = None
        self.next_number = 1  # of the next reply message
        self.requests: dict[int, _Kept] = {}
        self._messages: deque[tuple[int, list[int]]] = deque()  # (number, held rids in it)

    def track(self, server_rid: int, trailer: Trailer) -> None:
        """A request came with its trailer: hold it when a rebuild client sent it."""
        if trailer.client_id is not None:
            self.requests[server_rid] = _Kept(trailer.client_rid, trailer.client_id)

    def sent(self, final: bool, entries: Sequence[tuple[int, Any]]) -> None:
        """A reply message went out with these (server rid, body) entries."""
        number = self.next_number
        self.next_number += 1
        if not self.requests:
            return
        rids = []
        for rid, body in entries:
            kept = self.requests.get(rid)
            if kept is None or kept.final:
                continue
            kept.bodies.append([kept.partials, number, body, final])
            if final:
                kept.final = True
            else:
                kept.partials += 1
            rids.append(rid)
        if rids:
            self._messages.append((number, rids))

    def aborted(self, server_rid: int) -> None:
        """ABORT: a request whose final already went is not awaited any more."""
        kept = self.requests.get(server_rid)
        if kept is not None and kept.final:
            del self.requests[server_rid]

    def acknowledged(self, granted: dict[Any, Any]) -> None:
        """An ENGINE_ACK's map: when the rebuild is granted, report what it holds (HELD)."""
        self.granted = granted.get(REBUILD_FEATURE) == 1
        self.epoch = granted.get(EPOCH_KEY)
        if self.granted:
            entries = [
                [rid, k.client_rid, k.client_id, k.partials, k.final]
                for rid, k in self.requests.items()
            ]
            self.socket.send_multipart(protocol.HELD.pack(entries, b""))

    def on_message(self, header: int, frames: Sequence[Any]) -> bool:
        """HANDLED or REPLAY; False for any other header."""
        if header == Header.HANDLED:
            self._handled(protocol.HANDLED.parse(frames).count)
        elif header == Header.REPLAY:
            self._replay(protocol.REPLAY.parse(frames)[0])
        else:
            return False
        return True

    def _handled(self, count: int) -> None:
        messages = self._messages
        while messages and messages[0][0] <= count:
            _, rids = messages.popleft()
            for rid in rids:
                kept = self.requests.get(rid)
                if kept is None:
                    continue
                if kept.final and kept.bodies and kept.bodies[-1][1] <= count:
                    del self.requests[rid]  # its final was handled: nothing more is asked
                else:
                    kept.bodies = [body for body in kept.bodies if body[1] > count]

    def _replay(self, entries: list[Any]) -> None:
        number = self.next_number
        self.next_number += 1
        out, bodies, rids = [], [], []
        for rid, start in entries:
            kept = self.requests.get(rid)
            if kept is None:
                out.append([rid, -1, 0, False])
                continue
            chosen = [body for body in kept.bodies if start < 0 or body[0] >= start]
            first = chosen[0][0] if chosen else kept.partials
            out.append([rid, first, len(chosen), bool(chosen) and chosen[-1][3]])
            for body in chosen:
                body[1] = number
                bodies.append(body[2])
            if chosen:
                rids.append(rid)
        if rids:
            self._messages.append((number, rids))
        self.socket.send_multipart(protocol.REPLAYED.pack(out, bodies), copy=False)
