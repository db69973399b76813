"""One batch fan-out for both directions (loop/fanout.pyx)."""

from __future__ import annotations

from typing import Any

import zmq

from ..protocol import Buffer
from .message import _send_all
from .tables import _packer


class Fanout:
    """The entries of the batch at hand bound for peers that take batches (a
    SUBMIT_BATCH's to batched engines, a reply batch's to batched clients), sent
    once every entry is handled, one batch per peer in the order the peers were
    first chosen: a head ``[header, [[rid, <tail>], ...]]``, then the frames as the
    same messages."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        # (peer, rid, tail, frames) in the order they were routed: the peer an _Engine
        # or a _Client, the rid its server id or its client's, the tail what follows
        # the rid in its entry (its params, or the final flag), the frames its prompt
        # (and its trailer to a rebuild engine) or its body.
        self.entries: list[tuple[Any, int, Buffer, list[Any]]] = []

    def add(self, to: Any, rid: int, tail: Buffer, frames: list[Any]) -> None:
        self.entries.append((to, rid, tail, frames))

    def by_peer(self) -> dict[Any, list[tuple[int, Buffer, list[Any]]]]:
        """The entries by peer, the peers in the order they first came; the fan-out
        is then empty."""
        peers: dict[Any, list[tuple[int, Buffer, list[Any]]]] = {}
        for to, rid, tail, frames in self.entries:
            peers.setdefault(to, []).append((rid, tail, frames))
        self.entries.clear()
        return peers

    @staticmethod
    def send(sock: zmq.Socket, header: int, entries: list[tuple[int, Buffer, list[Any]]]) -> int:
        """One peer's batch after its routing id: the head, then the frames; the bytes
        sent."""
        head = [_packer.pack_array_header(2), _packer.pack(int(header))]
        head.append(_packer.pack_array_header(len(entries)))
        head += [b"\x92" + _packer.pack(rid) + bytes(tail) for rid, tail, _ in entries]
        return _send_all(sock, [b"".join(head), *(f for *_, frames in entries for f in frames)])
