"""The router in Python: which engine rank gets the next request.

The twin of :mod:`coordkit._routing_c`, which makes the same decisions bit for
bit given the same calls; the rules both follow, their constants and their
argument check are :mod:`coordkit._policies`'.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from ._policies import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DECODE_TOKENS,
    DEFAULT_PREFILL_WEIGHT,
    MAX_BLOCKS,
    U64_MASK,
    WEIGHT_SCALE,
    check_args,
)
from .protocol import BLOCK_HASH_SIZE

__all__ = ["Router"]

Buffer = bytes | bytearray | memoryview


def _hash_frame(block_hashes: Buffer | None) -> memoryview:
    if block_hashes is None:
        return memoryview(b"")
    frame = memoryview(block_hashes).cast("B")
    if len(frame) % BLOCK_HASH_SIZE:
        raise ValueError(
            f"the block-hash frame is {len(frame)} bytes, not a multiple of {BLOCK_HASH_SIZE}"
        )
    return frame


class Router:
    """Picks a rank per request; see the module docstring for the exact rules."""

    __slots__ = (
        "_policy",
        "_choose",
        "_max_ranks",
        "_rank_cap",
        "_weight",
        "_decode_blocks",
        "_block_size",
        "_prefix_counts",
        "_ttl",
        "_max_entries",
        "_accepting",
        "_pending",
        "_work",
        "_charged",
        "_n_ranks",
        "_cursor",
        "_members",
        "_member_pos",
        "_rng",
        "_table",
    )

    def __init__(
        self,
        policy: str,
        max_ranks: int = 1024,
        *,
        seed: int = 0,
        rank_cap: int = 0,
        prefix_prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
        prefix_decode_tokens: int = DEFAULT_DECODE_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_ttl: float = 600.0,
        prefix_max_entries: int = 1_000_000,
    ) -> None:
        self._weight, self._decode_blocks = check_args(
            policy,
            max_ranks,
            seed,
            rank_cap,
            prefix_prefill_weight,
            prefix_decode_tokens,
            block_size,
            prefix_max_entries,
        )
        self._policy = policy
        self._choose = {
            "round_robin": self._round_robin,
            "least_loaded": self._least_loaded,
            "power_of_two": self._power_of_two,
            "prefix": self._prefix,
        }[policy]
        self._max_ranks = max_ranks
        self._rank_cap = rank_cap
        self._block_size = block_size
        self._ttl = float(prefix_ttl)
        self._max_entries = prefix_max_entries
        self._accepting = [False] * max_ranks
        self._pending = [0] * max_ranks
        self._work = [0] * max_ranks
        self._charged = 0
        self._prefix_counts = [0, 0, 0]  # decisions with hashes, their blocks, blocks matched
        self._n_ranks = 0
        self._cursor = 0  # in [0, n_ranks)
        self._members: list[int] = []
        self._member_pos = [0] * max_ranks
        self._rng = seed
        # hash -> [rank bitmask, last_used], oldest first
        self._table: OrderedDict[int, list] = OrderedDict()

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def n_accepting(self) -> int:
        return len(self._members)

    @property
    def prefix_len(self) -> int:
        """Entries in the prefix table, expired ones included until purged."""
        return len(self._table)

    @property
    def prefix_counts(self) -> tuple[int, int, int]:
        """Prefix decisions with block hashes, their blocks, and the blocks the
        chosen rank had cached."""
        decisions, blocks, matched = self._prefix_counts
        return decisions, blocks, matched

    @property
    def charged(self) -> int:
        """The work units the last ``choose`` charged to its rank (0 if it returned -1)."""
        return self._charged

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self._max_ranks:
            raise ValueError(f"rank {rank} is out of range [0, {self._max_ranks})")

    def add_rank(self, rank: int) -> None:
        self._check_rank(rank)
        if self._accepting[rank]:
            return
        self._accepting[rank] = True
        self._member_pos[rank] = len(self._members)
        self._members.append(rank)
        if rank >= self._n_ranks:
            self._n_ranks = rank + 1

    def remove_rank(self, rank: int) -> None:
        self._check_rank(rank)
        if not self._accepting[rank]:
            return
        self._accepting[rank] = False
        members = self._members
        last = members.pop()
        if last != rank:
            pos = self._member_pos[rank]
            members[pos] = last
            self._member_pos[last] = pos
        bit = 1 << rank
        table = self._table
        for h, entry in list(table.items()):
            if entry[0] & bit:
                entry[0] ^= bit
                if not entry[0]:
                    del table[h]

    def accepting(self, rank: int) -> bool:
        self._check_rank(rank)
        return self._accepting[rank]

    def pending(self, rank: int) -> int:
        """Requests chosen for ``rank`` and not yet released."""
        self._check_rank(rank)
        return self._pending[rank]

    def work(self, rank: int) -> int:
        """Work units charged to ``rank`` and not yet released."""
        self._check_rank(rank)
        return self._work[rank]

    def release(self, rank: int, work: int = 0) -> None:
        """A request of ``rank`` ended: ``work`` is what ``choose`` charged for it."""
        self._check_rank(rank)
        if self._pending[rank] > 0:
            self._pending[rank] -= 1
        self._work[rank] = max(self._work[rank] - work, 0)

    def hold(self, rank: int) -> None:
        """A request already at ``rank`` (taken over after a coordinator's loss): one
        more pending there, charged the decode share (``charged``)."""
        self._check_rank(rank)
        self._charged = self._decode_blocks
        self._pending[rank] += 1
        self._work[rank] += self._charged

    def learn(self, rank: int, block_hashes: Buffer, now: float) -> None:
        """Under ``prefix``, record the chains of ``block_hashes`` (an engine's report,
        oldest first) for ``rank`` as a decision records its chain; else nothing."""
        self._check_rank(rank)
        frame = _hash_frame(block_hashes)
        m = len(frame) // BLOCK_HASH_SIZE
        if self._policy == "prefix" and m:
            self._record(struct.unpack(f"<{m}Q", frame), rank, float(now))

    def choose(
        self, block_hashes: Buffer | None = None, now: float = 0.0, prompt_tokens: int = 0
    ) -> int:
        """The rank for the next request, or -1 when none is eligible.

        ``prompt_tokens`` sizes a request without block hashes; what the
        chosen rank is charged is :attr:`charged`.
        """
        frame = _hash_frame(block_hashes)
        m = len(frame) // BLOCK_HASH_SIZE
        if m:
            size = m
        else:
            size = -(-max(int(prompt_tokens), 0) // self._block_size)
        rank, new = self._choose(frame, float(now), size)
        if rank < 0:
            self._charged = 0
            return rank
        self._charged = min(new, MAX_BLOCKS) + self._decode_blocks
        self._pending[rank] += 1
        self._work[rank] += self._charged
        return rank

    def prefix_ranks(self, hash: int, now: float) -> list[int]:
        """The ranks recorded for ``hash``, ascending; [] if absent or expired."""
        entry = self._table.get(hash)
        if entry is None or now - entry[1] > self._ttl:
            return []
        mask = entry[0]
        return [r for r in range(mask.bit_length()) if mask >> r & 1]

    # -- policies: each returns (rank, the request's new blocks there) ------

    def _eligible(self, rank: int) -> bool:
        return self._accepting[rank] and (
            self._rank_cap == 0 or self._pending[rank] < self._rank_cap
        )

    def _round_robin(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        n = self._n_ranks
        for k in range(n):
            r = (self._cursor + k) % n
            if self._eligible(r):
                self._cursor = (r + 1) % n
                return r, size
        return -1, 0

    def _least_loaded(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        n = self._n_ranks
        if n == 0:
            return -1, 0
        start = self._cursor % n
        pending = self._pending
        best = -1
        for k in range(n):
            r = (start + k) % n
            if self._eligible(r) and (best < 0 or pending[r] < pending[best]):
                best = r
        if best >= 0:
            self._cursor = (start + 1) % n
        return best, size

    def _rand(self) -> int:
        self._rng = state = (self._rng + 0x9E3779B97F4A7C15) & U64_MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64_MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64_MASK
        return z ^ (z >> 31)

    def _power_of_two(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        members = self._members
        n = len(members)
        if n == 0:
            return -1, 0
        if n == 1:
            a = b = members[0]
        else:
            i = self._rand() % n
            j = self._rand() % (n - 1)
            if j >= i:
                j += 1
            a, b = members[i], members[j]
        a_ok, b_ok = self._eligible(a), self._eligible(b)
        if a_ok and b_ok:
            return (b if self._pending[b] < self._pending[a] else a), size
        if a_ok:
            return a, size
        if b_ok:
            return b, size
        return self._least_loaded(frame, now, size)

    def _prefix(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        n = self._n_ranks
        if n == 0:
            return -1, 0
        start = self._cursor % n
        order = [r for r in (*range(start, n), *range(start)) if self._eligible(r)]
        if not order:
            return -1, 0
        m = len(frame) // BLOCK_HASH_SIZE
        hashes = struct.unpack(f"<{m}Q", frame)
        depth = self._depths(hashes, order, now) if m else None
        pending, work, weight = self._pending, self._work, self._weight
        rank, best_new, best_key = -1, 0, (0, 0)
        for r in order:  # the rotating order: the first of equal keys wins
            new = min(size - (depth[r] if depth is not None else 0), MAX_BLOCKS)
            key = (weight * new + WEIGHT_SCALE * work[r], pending[r])
            if rank < 0 or key < best_key:
                rank, best_new, best_key = r, new, key
        self._cursor = (start + 1) % n
        if m:
            counts = self._prefix_counts
            counts[0] += 1
            counts[1] += m
            counts[2] += depth[rank] if depth is not None else 0
            self._record(hashes, rank, now)
        return rank, best_new

    def _depths(self, hashes: tuple[int, ...], eligible: list[int], now: float) -> list[int] | None:
        """Matched depth per rank (indexed by rank), or None when nothing matched.

        The running mask of candidates only shrinks along the chain, so a rank's
        depth is the step at which it drops out.
        """
        table, ttl = self._table, self._ttl
        running = 0
        for r in eligible:
            running |= 1 << r
        depth = [0] * self._n_ranks
        d = 0
        for h in hashes:
            entry = table.get(h)
            if entry is None or now - entry[1] > ttl:
                break
            kept = running & entry[0]
            dropped = running ^ kept
            while dropped:
                low = dropped & -dropped
                depth[low.bit_length() - 1] = d
                dropped ^= low
            running = kept
            if not running:
                break
            d += 1
        if d == 0:
            return None
        while running:
            low = running & -running
            depth[low.bit_length() - 1] = d
            running ^= low
        return depth

    def _record(self, hashes: tuple[int, ...], rank: int, now: float) -> None:
        table, ttl = self._table, self._ttl
        while table:
            oldest = next(iter(table.values()))
            if now - oldest[1] <= ttl:
                break
            table.popitem(last=False)
        bit = 1 << rank
        for h in hashes:
            entry = table.get(h)
            if entry is None:
                if len(table) >= self._max_entries:
                    table.popitem(last=False)
                table[h] = [bit, now]
                continue
            if now - entry[1] > ttl:
                entry[0] = bit
            else:
                entry[0] |= bit
            entry[1] = now
            table.move_to_end(h)
