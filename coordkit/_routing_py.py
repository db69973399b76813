"""The router in Python: which engine rank gets the next request.

The twin of :mod:`coordkit._routing_c`, which makes the same decisions bit for
bit given the same calls; the rules both follow, their constants and their
argument check are :mod:`coordkit._policies`'.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from ._policies import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DECODE_TOKENS,
    DEFAULT_PREFILL_WEIGHT,
    MAX_BLOCKS,
    SPARSE_RANKS,
    U64_MASK,
    WALK_MAX,
    WEIGHT_SCALE,
    check_args,
)
from .protocol import BLOCK_HASH_SIZE

__all__ = ["Router"]

Buffer = bytes | bytearray | memoryview
#: A prefix decision's best rank so far: its key (cost, pending, place in the rotating
#: order), the rank, the blocks it would prefill and the blocks it has.
Choice = tuple[tuple[int, int, int], int, int, int]


def _hash_frame(block_hashes: Buffer | None) -> memoryview:
    if block_hashes is None:
        return memoryview(b"")
    frame = memoryview(block_hashes).cast("B")
    if len(frame) % BLOCK_HASH_SIZE:
        raise ValueError(
            f"the block-hash frame is {len(frame)} bytes, not a multiple of {BLOCK_HASH_SIZE}"
        )
    return frame


class PrefixIndex(Protocol):
    """What the router reads of the exact prefix index (``_loop_py/kvindex.py``'s KVIndex,
    named and not imported: the index tells the router what it forgets)."""

    known: list[int]  # the ranks whose events are known, in order
    lock: threading.Lock  # held while ``held`` is asked: the events' thread writes it

    def publishes(self, rank: int) -> bool: ...

    def held(self, rank: int, hashes: tuple[int, ...]) -> int: ...


class Router:
    """Picks a rank per request; see the module docstring for the exact rules."""

    __slots__ = (
        "_policy",
        "_choose",
        "_max_ranks",
        "_rank_cap",
        "_capacity",
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
        "_key",
        "_leaves",
        "_ranking",
        "_eligible_mask",
        "_kv",
    )

    def __init__(
        self,
        policy: str,
        max_ranks: int = 4096,
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
        self._capacity = [0] * max_ranks  # what each declared (0: rank_cap holds)
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
        # The eligible ranks in the policy's order, kept as they change (see _update):
        # a tree over ``_leaves`` ranks (a power of two >= n_ranks), node i over the
        # leaves below it, holding the first of them by (key, rank), -1 when none is
        # eligible; leaf r is node leaves + r, the root node 1. power_of_two draws
        # accepting ranks, all eligible without a cap: it never asks.
        pending, work = self._pending, self._work
        self._key: Callable[[int], Any] = {
            "round_robin": lambda r: 0,
            "least_loaded": pending.__getitem__,
            "power_of_two": pending.__getitem__,
            "prefix": lambda r: (work[r], pending[r]),
        }[policy]
        self._leaves = 1
        self._ranking: list[int] | None = None
        if policy != "power_of_two" or rank_cap:
            self._ranking = [-1, -1]
        self._eligible_mask = 0  # prefix: the eligible ranks as bits
        self._kv: PrefixIndex | None = None  # the engines' own events, when they publish

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
        if self._ranking is not None and rank >= self._leaves:
            leaves = self._leaves
            while leaves <= rank:
                leaves <<= 1
            self._build(leaves)
        self._update(rank)

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
        self._update(rank)
        self.forget(rank)

    def forget(self, rank: int) -> None:
        """``rank`` is no longer listed in the prefix table (it left, or its own events
        say what it holds from now on)."""
        bit = 1 << rank
        table = self._table
        for h, entry in list(table.items()):
            if entry[0] & bit:
                entry[0] ^= bit
                if not entry[0]:
                    del table[h]

    def attach_kv(self, index: PrefixIndex) -> None:
        """Under ``prefix``, price the ranks ``index`` knows by their own events: the
        approximate table neither credits nor records a rank that publishes."""
        self._kv = index

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
        self._update(rank)

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
        self._update(rank)
        return rank

    def prefix_ranks(self, hash: int, now: float) -> list[int]:
        """The ranks recorded for ``hash``, ascending; [] if absent or expired."""
        entry = self._table.get(hash)
        if entry is None or now - entry[1] > self._ttl:
            return []
        mask = entry[0]
        return [r for r in range(mask.bit_length()) if mask >> r & 1]

    # -- the ranking: the eligible ranks in the policy's order, as they change --

    def _eligible(self, rank: int) -> bool:
        cap = self._capacity[rank] or self._rank_cap
        return self._accepting[rank] and (cap == 0 or self._pending[rank] < cap)

    def set_capacity(self, rank: int, capacity: int) -> None:
        """``rank`` takes at most ``capacity`` requests at once, what it declared at
        registration (0: the router's ``rank_cap``, if any)."""
        self._check_rank(rank)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        self._capacity[rank] = capacity
        if capacity and self._ranking is None:  # power_of_two's fallback, now that a
            leaves = 1  # rank can be full
            while leaves < self._n_ranks:
                leaves <<= 1
            self._build(leaves)
        self._update(rank)

    @property
    def has_room(self) -> bool:
        """Whether choose would pick a rank now: one is eligible."""
        if self._ranking is not None:
            return self._ranking[1] >= 0
        return bool(self._members)

    def _update(self, rank: int) -> None:
        """``rank``'s eligibility, pending count or work changed: mend its path to the root.

        O(log n_ranks), and it stops where a node's first rank stays another one.
        """
        if rank >= self._n_ranks:
            return  # never added: never eligible
        ok = self._eligible(rank)
        if self._policy == "prefix" and ok != bool(self._eligible_mask >> rank & 1):
            self._eligible_mask ^= 1 << rank
        if self._ranking is not None:
            self._set_leaf(rank, ok)

    def _set_leaf(self, rank: int, ok: bool) -> None:
        """``rank`` in the ranking (``ok``) or out of it, and the nodes above it mended."""
        ranking = self._ranking
        assert ranking is not None
        node = self._leaves + rank
        if self._policy == "round_robin" and (ranking[node] >= 0) == ok:
            return  # round_robin orders by rank alone: only eligibility moves it
        ranking[node] = rank if ok else -1
        node >>= 1
        while node:
            first = self._first(ranking[2 * node], ranking[2 * node + 1])
            if first == ranking[node] and first != rank:
                return  # the same rank, its key unchanged: so is every node above
            ranking[node] = first
            node >>= 1

    def _build(self, leaves: int) -> None:
        """The ranking over ``leaves`` leaves, from scratch (when n_ranks outgrows it)."""
        n = self._n_ranks
        ranking = [-1] * leaves + [r if r < n and self._eligible(r) else -1 for r in range(leaves)]
        for node in range(leaves - 1, 0, -1):
            ranking[node] = self._first(ranking[2 * node], ranking[2 * node + 1])
        self._leaves, self._ranking = leaves, ranking

    def _first(self, a: int, b: int) -> int:
        """The first of two ranks (-1: none) by key, then rank."""
        if a < 0:
            return b
        if b < 0:
            return a
        key_a, key_b = self._key(a), self._key(b)
        if key_a != key_b:
            return a if key_a < key_b else b
        return a if a < b else b

    def _first_from(self, start: int) -> int:
        """The eligible rank of the least key, the first from ``start`` in the rotating
        order (start, start + 1, ..., n_ranks - 1, 0, ...) among equals; -1 if none.

        The root holds the least key's lowest rank: the answer unless it is below
        start, when the first of [start, leaves) wins if its key is the same.
        """
        ranking = self._ranking
        assert ranking is not None
        first = ranking[1]
        if first < 0 or first >= start:
            return first
        rest = -1
        lo, hi = start + self._leaves, 2 * self._leaves
        while lo < hi:  # the nodes that cover [start, leaves) exactly
            if lo & 1:
                rest = self._first(rest, ranking[lo])
                lo += 1
            lo >>= 1
            hi >>= 1
        if rest >= 0 and self._key(rest) == self._key(first):
            return rest
        return first

    # -- policies: each returns (rank, the request's new blocks there) ------

    def _round_robin(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        r = self._first_from(self._cursor)
        if r >= 0:
            self._cursor = (r + 1) % self._n_ranks
        return r, size

    def _least_loaded(self, frame: memoryview, now: float, size: int) -> tuple[int, int]:
        n = self._n_ranks
        if n == 0:
            return -1, 0
        start = self._cursor % n
        best = self._first_from(start)
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
        """The contract's winner without pricing every rank (docs/design.md, Routing):
        the affine decision over the chain's live entries, or when it cannot settle
        it, the scan of the first entry's ranks."""
        ranking = self._ranking
        assert ranking is not None
        if ranking[1] < 0:
            return -1, 0  # none eligible
        n = self._n_ranks
        start = self._cursor % n
        self._cursor = (start + 1) % n
        m = len(frame) // BLOCK_HASH_SIZE
        hashes = struct.unpack(f"<{m}Q", frame)
        chain = self._chain(hashes, now)
        if not chain:  # no match: the least work, then the fewest pending
            best = self._consider(None, self._first_from(start), 0, start, size)
        else:
            best = self._affine(chain, start, size) or self._scan(hashes, now, start, size)
        kv = self._kv
        if kv is not None and m and kv.known:
            # The table priced every rank that publishes as holding nothing: those its
            # events say hold a prefix are priced again, by that.
            with kv.lock:
                for r in kv.known:
                    if r < n and self._eligible(r) and (d := kv.held(r, hashes)):
                        best = self._consider(best, r, d, start, size)
        _, rank, new, depth = best
        if m:
            counts = self._prefix_counts
            counts[0] += 1
            counts[1] += m
            counts[2] += depth
            self._record(hashes, rank, now)
        return rank, new

    def _consider(
        self, best: Choice | None, rank: int, depth: int, start: int, size: int
    ) -> Choice:
        """``rank``, which has ``depth`` blocks, in place of ``best`` if its key is lower:
        (cost, pending, place in the rotating order)."""
        new = min(size - depth, MAX_BLOCKS)
        key = (
            self._weight * new + WEIGHT_SCALE * self._work[rank],
            self._pending[rank],
            (rank - start) % self._n_ranks,
        )
        if best is None or key < best[0]:
            return key, rank, new, depth
        return best

    def _chain(self, hashes: tuple[int, ...], now: float) -> list[int]:
        """The rank masks of the live entries leading the request's chain."""
        table, ttl = self._table, self._ttl
        chain = []
        for h in hashes:
            entry = table.get(h)
            if entry is None or now - entry[1] > ttl:
                break
            chain.append(entry[0])
        return chain

    @staticmethod
    def _depth_along(chain: list[int], rank: int, d: int, length: int) -> int:
        """The depth of ``rank`` in the chain's first ``length`` entries, the first
        ``d`` of which list it."""
        while d < length and chain[d] >> rank & 1:
            d += 1
        return d

    def _affine(self, chain: list[int], start: int, size: int) -> Choice | None:
        """The winner from the chain's live entries and the ranking alone; None when
        the walk hid WALK_MAX ranks without settling it.

        Entry k is the first that lists at most SPARSE_RANKS ranks (k = len(chain)
        if none): every rank deeper than k is one of them, each priced. The others
        are found walking the ranking, best (work, pending) first: a rank can only
        win if it is deeper than every rank before it (one before it at least as
        deep costs no more, and wins a tie), so the walk prices those, and it ends
        at a rank of depth k or more (none after can win), at one whose work
        alone prices it above the best so far, or with the ranking.
        """
        length = len(chain)
        k = next((i for i, mask in enumerate(chain) if mask.bit_count() <= SPARSE_RANKS), length)
        best: Choice | None = None
        if k < length:
            bits = chain[k] & self._eligible_mask
            while bits:
                low = bits & -bits
                bits ^= low
                r = low.bit_length() - 1
                if self._depth_along(chain, r, 0, k) == k:
                    depth = self._depth_along(chain, r, k + 1, length)
                    best = self._consider(best, r, depth, start, size)
        # Every rank the walk has not priced yet has depth <= k: new blocks >= this.
        floor = self._weight * min(size - k, MAX_BLOCKS)
        hidden: list[int] = []
        settled = False
        deepest = -1
        while True:
            g = self._first_from(start)
            if g < 0 or (best is not None and best[0][0] < floor + WEIGHT_SCALE * self._work[g]):
                settled = True
                break
            d = self._depth_along(chain, g, 0, length)
            if d > deepest:
                best = self._consider(best, g, d, start, size)
                deepest = d
            if d >= k:
                settled = True
                break
            if len(hidden) == WALK_MAX:
                break
            self._set_leaf(g, False)  # the next one, until put back below
            hidden.append(g)
        for g in hidden:
            self._set_leaf(g, True)
        return best if settled else None

    def _scan(self, hashes: tuple[int, ...], now: float, start: int, size: int) -> Choice:
        """Every rank of the chain's first entry priced, then the least-worked one:
        the unmatched ranks all have the same new blocks, so that one beats or
        ties-and-wins each of them."""
        depth = self._depths(hashes, now)
        best = None
        for r, d in depth.items():
            best = self._consider(best, r, d, start, size)
        c = self._first_from(start)
        return self._consider(best, c, depth.get(c, 0), start, size)

    def _depths(self, hashes: tuple[int, ...], now: float) -> dict[int, int]:
        """The eligible ranks of the first hash's live entry, with their matched depth;
        every other rank has depth 0.

        The candidates only shrink along the chain, so a rank's depth is the step
        at which it drops out.
        """
        table, ttl = self._table, self._ttl
        depth: dict[int, int] = {}
        running = 0
        for d, h in enumerate(hashes):
            entry = table.get(h)
            if entry is None or now - entry[1] > ttl:
                break
            kept = running & entry[0] if d else self._eligible_mask & entry[0]
            dropped = running ^ kept if d else 0
            running = kept
            while dropped:
                low = dropped & -dropped
                depth[low.bit_length() - 1] = d
                dropped ^= low
            if not running:
                break
        else:
            d = len(hashes)
        while running:
            low = running & -running
            depth[low.bit_length() - 1] = d
            running ^= low
        return depth

    def _record(self, hashes: tuple[int, ...], rank: int, now: float) -> None:
        if self._kv is not None and self._kv.publishes(rank):
            return  # its events say what it holds: no guess
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
