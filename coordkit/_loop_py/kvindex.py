"""The prefix index built from the engines' own KV-cache events, in Python.

The twin of ``loop/kvindex.pyx``. It applies the records of
:mod:`coordkit._kvevents` (the thread that reads the publishers makes them) and
answers the prefix policy: how many leading blocks of a request's chain an engine
holds, according to that engine's events.

Per engine it keeps the blocks it holds, keyed by coordkit's own chained block
hashes (:func:`coordkit.protocol.block_hashes` over each stored block's tokens,
chained from its parent's: the events' thread chains them, its HASHED records
carry them), each counted once per engine key that names it; and the engine's
keys (its own block hashes, opaque), each mapped to its block and counted as
often as it was stored, so that a BlockRemoved finds what it removes and a block
stored twice goes when removed twice.

Two threads share it: the events' thread counts the blocks (:meth:`KVIndex.apply_blocks`),
the loop applies the states (:meth:`KVIndex.apply`: a rank that starts publishing
leaves the router's table) and reads the blocks under :attr:`KVIndex.lock`.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

from .._kvevents import (
    HASHED,
    HEAD,
    OP_CLEAR,
    OP_HASHED,
    OP_REMOVE,
    OP_STATE,
    REMOVE,
    STATE,
    STATE_KNOWN,
    STATE_NONE,
    STATE_UNKNOWN,
)

if TYPE_CHECKING:
    from .._kvevents import Subscriber
    from .._routing_py import Router

__all__ = ["KVIndex", "STATE_NAMES"]

STATE_NAMES = {STATE_NONE: "none", STATE_UNKNOWN: "unknown", STATE_KNOWN: "exact"}


class KVIndex:
    """Every publishing engine's blocks, from its events."""

    __slots__ = ("_blocks", "_keys", "_state", "known", "applied", "lock")

    def __init__(self) -> None:
        self._blocks: dict[int, dict[int, int]] = {}  # rank -> block hash -> keys naming it
        self._keys: dict[int, dict[int, list[int]]] = {}  # rank -> key -> [block hash, count]
        self._state: dict[int, int] = {}  # rank -> STATE_* (absent: STATE_NONE)
        #: The ranks whose index is known, ascending: the prefix policy prices them by it.
        self.known: list[int] = []
        self.applied = 0  # records applied
        #: Held while the blocks are counted or read: the states are the loop's alone.
        self.lock = threading.Lock()

    def attach(self, router: Router) -> None:
        """``router`` reads this index (``Router.attach_kv``)."""
        router.attach_kv(self)

    def publishes(self, rank: int) -> bool:
        """``rank`` has a publisher: the approximate table is not to credit it."""
        return self._state.get(rank, STATE_NONE) != STATE_NONE

    def depth(self, rank: int, hashes: bytes) -> int:
        """The leading blocks of ``hashes`` (one LE u64 each) that ``rank`` holds."""
        with self.lock:
            return self.held(rank, struct.unpack(f"<{len(hashes) // 8}Q", hashes))

    def held(self, rank: int, hashes: tuple[int, ...]) -> int:
        """The leading blocks of the chain ``hashes`` that ``rank`` holds: O(len(hashes)).
        Under :attr:`lock`."""
        blocks = self._blocks.get(rank)
        if not blocks:
            return 0
        d = 0
        for h in hashes:
            if h not in blocks:
                break
            d += 1
        return d

    def take(self, events: Subscriber, router: Router) -> None:
        """The STATE records the events' thread has waiting, applied in order."""
        for record in events.take():
            self.apply(record, router)

    def apply(self, record: bytes, router: Router) -> None:
        """One record, on the loop's thread (any record: a STATE one only here)."""
        if len(record) == STATE.size and record[0] == OP_STATE:
            _, rank, state = STATE.unpack(record)
            with self.lock:
                self.applied += 1
            self._set_state(rank, state, router)
        else:
            self.apply_blocks(record)

    def apply_blocks(self, record: bytes) -> None:
        """A CLEAR, HASHED or REMOVE record, from the events' thread; a malformed one is
        ignored (that thread made them)."""
        if len(record) < HEAD.size:
            return
        with self.lock:
            self._apply_blocks(record)

    def _apply_blocks(self, record: bytes) -> None:
        op, rank = HEAD.unpack_from(record)
        self.applied += 1
        if op == OP_CLEAR:
            self._blocks.pop(rank, None)
            self._keys.pop(rank, None)
        elif op == OP_HASHED and len(record) >= HASHED.size:
            n = HASHED.unpack_from(record)[2]
            if len(record) == HASHED.size + 16 * n:
                pairs = struct.unpack_from(f"<{2 * n}Q", record, HASHED.size)
                self._store(rank, pairs[:n], pairs[n:])
        elif op == OP_REMOVE and len(record) >= REMOVE.size:
            n = REMOVE.unpack_from(record)[2]
            if len(record) == REMOVE.size + 8 * n:
                self._remove(rank, struct.unpack_from(f"<{n}Q", record, REMOVE.size))

    def _set_state(self, rank: int, state: int, router: Router) -> None:
        was = self._state.get(rank, STATE_NONE)
        if state == STATE_NONE:
            self._state.pop(rank, None)
        else:
            self._state[rank] = state
            if was == STATE_NONE:
                router.forget(rank)  # its guesses go: its events say what it holds
        if (was == STATE_KNOWN) != (state == STATE_KNOWN):
            if state == STATE_KNOWN:
                self.known.append(rank)
                self.known.sort()
            else:
                self.known.remove(rank)

    def _store(self, rank: int, stored: tuple[int, ...], hashes: tuple[int, ...]) -> None:
        keys = self._keys.setdefault(rank, {})
        blocks = self._blocks.setdefault(rank, {})
        for key, block in zip(stored, hashes, strict=True):
            node = keys.get(key)
            if node is not None:
                node[1] += 1  # the same key stored again: removed as often
                continue
            keys[key] = [block, 1]
            blocks[block] = blocks.get(block, 0) + 1

    def _unname(self, blocks: dict[int, int], block: int) -> None:
        left = blocks[block] - 1
        if left:
            blocks[block] = left
        else:
            del blocks[block]

    def _remove(self, rank: int, removed: tuple[int, ...]) -> None:
        keys = self._keys.get(rank)
        if keys is None:
            return
        blocks = self._blocks[rank]
        for key in removed:
            node = keys.get(key)
            if node is None:
                continue  # stored before its history was known, or never counted
            node[1] -= 1
            if node[1] == 0:
                del keys[key]
                self._unname(blocks, node[0])

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "engines": {
                    rank: {"state": STATE_NAMES[state], "blocks": len(self._blocks.get(rank, ()))}
                    for rank, state in sorted(self._state.items())
                },
                "applied": self.applied,
            }
