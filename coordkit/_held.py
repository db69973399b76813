"""What a rebuild engine keeps so that a coordinator's loss costs nothing.

Both engine cores hold one :class:`Held` (the rare path of the rebuild: the
cores' hot paths only hand it the trailer of each request and the bodies of
each reply message). It keeps, for each request a rebuild client sent (its
trailer names the client), the client's id and request id, the partials sent
and whether the final was, and the bodies of the replies no HANDLED covers
yet; a prefill hop it handed off, until a RELEASE_KV or ABORT names it (its
blocks pinned); and it answers the coordinator's rebuild messages:

* ENGINE_ACK (the rebuild granted; the Engine passes its map on): HELD, what
  it holds, and the block hashes of the requests it was sent lately (a bounded
  window, :data:`DEFAULT_HELD_HASHES`): a new coordinator's prefix policy learns
  them for this rank, so that affinity outlives the coordinator;
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
from .protocol import (
    BLOCK_HASH_SIZE,
    EPOCH_KEY,
    HELD_ALL_KEY,
    REBUILD_FEATURE,
    Header,
    ProtocolError,
    Trailer,
    parse_trailer,
)

__all__ = ["DEFAULT_HELD_HASHES", "Held", "trailed"]

#: The block hashes a rebuild engine keeps of the requests it was sent lately, to
#: report in HELD (8 bytes each on the wire: 256 KiB at most).
DEFAULT_HELD_HASHES = 32768

#: Where a request's prompt is, its trailer, and its block-hash frame (or None).
Trailed = tuple[int, Trailer, Any]


def trailed(name: str, n_frames: int, frame: Callable[[int], Any]) -> list[Trailed]:
    """A message ``name`` to a rebuild engine, ``n_frames`` frames (``frame(i)`` the
    i-th's bytes): where each entry's prompt is, its trailer and its block hashes.
    After each prompt comes its trailer, then the block hashes when the trailer
    says so."""
    layout = []
    at = 1
    while at < n_frames:
        if at + 1 >= n_frames:
            raise ProtocolError(f"{name}: a prompt without its trailer")
        trailer = parse_trailer(frame(at + 1))
        hashes = None
        if trailer.hashed and at + 2 < n_frames:
            hashes = frame(at + 2)
            if len(hashes) % BLOCK_HASH_SIZE:
                raise ProtocolError(f"{name}: the block-hash frame is not whole hashes")
        layout.append((at, trailer, hashes))
        at += 3 if trailer.hashed else 2
    if at != n_frames:
        raise ProtocolError(f"{name}: a trailer's block hashes are missing")
    return layout


class _Kept:
    """One request held; for a rebuild client's (``client_id``), ``bodies`` are
    ``[index, number, body, final]``: the partial's place (the final's: the partials
    before it), the reply message it was last sent in. Another's keeps no bodies: it
    is only listed in HELD (when asked: HELD_ALL_KEY) until its final goes out."""

    __slots__ = ("client_rid", "client_id", "partials", "final", "bodies")

    def __init__(self, client_rid: int, client_id: bytes | None):
        self.client_rid = client_rid
        self.client_id = client_id
        self.partials = 0
        self.final = False
        self.bodies: list[list[Any]] = []


class Held:
    """The requests a rebuild engine holds and the replies it has not seen handled."""

    def __init__(self, socket: zmq.Socket, hashes: int = DEFAULT_HELD_HASHES):
        self.socket = socket
        self.granted = False  # the coordinator said rebuild in its ENGINE_ACK
        self.epoch: int | None = None
        self.next_number = 1  # of the next reply message
        self.requests: dict[int, _Kept] = {}
        self._messages: deque[tuple[int, list[int]]] = deque()  # (number, held rids in it)
        # The block-hash frames of the latest requests, oldest first, as they came (one
        # append per request; repeats are dropped only when reported), at most
        # ``_max_hashes`` hashes in all.
        self._max_hashes = hashes
        self._hash_frames: deque[bytes] = deque()
        self._n_hashes = 0

    def track(self, server_rid: int, trailer: Trailer, hashes: Any = None) -> None:
        """A request came with its trailer (and its block hashes, when the trailer
        says so): hold it; keep its hashes."""
        self.requests[server_rid] = _Kept(trailer.client_rid, trailer.client_id)
        if hashes is not None and len(hashes):
            self._keep_hashes(hashes)

    def _keep_hashes(self, hashes: Any) -> None:
        limit = self._max_hashes * BLOCK_HASH_SIZE
        frame = bytes(hashes[:limit])  # the chain's head is what a match needs
        if not frame:
            return
        frames = self._hash_frames
        frames.append(frame)
        self._n_hashes += len(frame) // BLOCK_HASH_SIZE
        while self._n_hashes > self._max_hashes:
            self._n_hashes -= len(frames.popleft()) // BLOCK_HASH_SIZE

    def recent_hashes(self) -> bytes:
        """HELD's block-hash frame: each hash kept once, in the order of its latest
        request (oldest first, as the prefix policy learns them)."""
        size = BLOCK_HASH_SIZE
        latest: dict[bytes, None] = {}
        for frame in reversed(self._hash_frames):
            for at in range(len(frame) - size, -1, -size):
                latest.setdefault(frame[at : at + size])
        return b"".join(reversed(latest))

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
            if kept.client_id is None:  # nothing to replay: listed until its final
                if final:
                    del self.requests[rid]
                else:
                    kept.partials += 1
                continue
            kept.bodies.append([kept.partials, number, body, final])
            if final:
                kept.final = True
            else:
                kept.partials += 1
            rids.append(rid)
        if rids:
            self._messages.append((number, rids))

    def handed_off(self, server_rids: Sequence[int]) -> None:
        """Prefill hops handed off (HANDOFF): their decode engines run them now, and
        their blocks stay pinned here. Each is listed in HELD, its final sent, until a
        RELEASE_KV (or an ABORT) names it: a coordinator that never knew of the handoff
        (one that took over) releases its pins."""
        for rid in server_rids:
            kept = self.requests.get(rid)
            if kept is not None:  # no client's to replay: the room's, to release
                kept.client_id, kept.final, kept.bodies = None, True, []

    def released(self, server_rid: int) -> None:
        """RELEASE_KV: a handoff's pins are gone."""
        self.requests.pop(server_rid, None)

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
            every = granted.get(HELD_ALL_KEY) == 1
            entries = [
                [rid, k.client_rid, k.client_id, k.partials, k.final]
                for rid, k in self.requests.items()
                if every or k.client_id is not None
            ]
            self.socket.send_multipart(protocol.HELD.pack(entries, self.recent_hashes()))

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
