"""The routing contract read literally: every decision a scan over every rank.

``ScanningRouter`` is the Python router with its decisions replaced by the
definitions of ``coordkit._policies`` as they are written (``for k in 0 ..
n_ranks - 1``, the full cost of every eligible rank), so that the routers'
structures (the ranking tree, the eligible masks, the prefix entries'
summaries) are tested against the rules rather than against themselves. It
keeps the Python router's bookkeeping (pending counts, work, members, the
prefix table), which the C router, compared too, implements on its own.
"""

from __future__ import annotations

import struct

from coordkit._policies import MAX_BLOCKS, WEIGHT_SCALE
from coordkit._routing_py import Router
from coordkit.protocol import BLOCK_HASH_SIZE


class ScanningRouter(Router):
    __slots__ = ()

    def _rotation(self, start: int) -> list[int]:
        """The eligible ranks in the rotating order from ``start``."""
        n = self._n_ranks
        return [r for r in ((start + k) % n for k in range(n)) if self._eligible(r)]

    def _round_robin(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        for r in self._rotation(self._cursor):
            self._cursor = (r + 1) % self._n_ranks
            return r, size
        return -1, 0

    def _least_loaded(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        n = self._n_ranks
        if n == 0:
            return -1, 0
        start = self._cursor % n
        best = -1
        for r in self._rotation(start):
            if best < 0 or self._pending[r] < self._pending[best]:
                best = r
        if best >= 0:
            self._cursor = (start + 1) % n
        return best, size

    def _prefix(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        n = self._n_ranks
        if n == 0:
            return -1, 0
        start = self._cursor % n
        order = self._rotation(start)
        if not order:
            return -1, 0
        m = len(frame) // BLOCK_HASH_SIZE
        hashes = struct.unpack(f"<{m}Q", frame)
        rank, best_new, best_key = -1, 0, (0, 0)
        for r in order:  # the rotating order: the first of equal keys wins
            new = min(size - self._depth(hashes, r, now), MAX_BLOCKS)
            key = (self._weight * new + WEIGHT_SCALE * self._work[r], self._pending[r])
            if rank < 0 or key < best_key:
                rank, best_new, best_key = r, new, key
        self._cursor = (start + 1) % n
        if m:
            counts = self._prefix_counts
            counts[0] += 1
            counts[1] += m
            counts[2] += self._depth(hashes, rank, now)
            self._record(hashes, rank, now)
        return rank, best_new

    def _depth(self, hashes: tuple[int, ...], rank: int, now: float) -> int:
        """The leading hashes whose live entries all list ``rank``."""
        d = 0
        for h in hashes:
            entry = self._table.get(h)
            if entry is None or now - entry[1] > self._ttl or not entry[0] >> rank & 1:
                break
            d += 1
        return d
