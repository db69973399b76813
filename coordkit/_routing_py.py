"""The router: which engine rank gets the next request (pure-Python reference).

:class:`Router` is the reference for ``coordkit._routing_c.Router``: both make
the same decisions, bit for bit, given the same calls. The definitions below
are the contract.

Ranks and eligibility
    A rank is an integer in ``[0, max_ranks)``. ``n_ranks`` is 1 + the highest
    rank ever added; every scan covers ``[0, n_ranks)``. A rank is *accepting*
    between ``add_rank`` and ``remove_rank``; its pending count (requests
    chosen and not yet released) survives ``remove_rank``, because the
    coordinator releases them one by one. ``eligible(r)`` is
    ``accepting(r) and (rank_cap == 0 or pending(r) < rank_cap)``.
    ``choose`` returns ``-1`` when no rank is eligible, and otherwise adds 1
    to the pending count of the rank it returns.

``round_robin``
    For ``k`` in ``0 .. n_ranks - 1``: ``r = (cursor + k) % n_ranks``; the
    first eligible ``r`` wins and ``cursor = (r + 1) % n_ranks``.

``least_loaded``
    ``start = cursor % n_ranks``; scan ``r = (start + k) % n_ranks`` for ``k``
    in ``0 .. n_ranks - 1`` and keep the first eligible rank with strictly the
    fewest pending; then ``cursor = (start + 1) % n_ranks``. The rotating
    start spreads a burst over ranks of equal load instead of sending all of
    it to rank 0. The cursor only moves when a rank is chosen (both here and
    in ``round_robin``); the policies that fall back to this one share it.

``power_of_two``
    ``members`` lists the accepting ranks: ``add_rank`` appends, and
    ``remove_rank`` moves the last member into the removed one's place.
    With ``n = len(members)``: ``n == 0`` gives ``-1``; ``n == 1`` gives
    ``a = b = members[0]``; otherwise ``i = rand() % n``,
    ``j = rand() % (n - 1)``, ``j += 1`` if ``j >= i``, ``a = members[i]``,
    ``b = members[j]``. If both are eligible the winner is ``b`` when
    ``pending(b) < pending(a)``, else ``a``; if one is, that one; if neither,
    ``least_loaded`` decides. ``rand()`` is splitmix64 over a 64-bit state
    that starts at ``seed``::

        state += 0x9E3779B97F4A7C15
        z = state
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)                    # all modulo 2**64

Work
    Every rank has an outstanding *work*, in work units of one block of
    ``block_size`` tokens. A ``choose`` that returns a rank charges it
    ``charged`` units, readable right after (0 after a ``choose`` that returns
    ``-1``), and adds them to ``work(r)``; ``release(r, work)`` subtracts
    ``work`` (never below 0) and 1 from the pending count. A request's *new
    blocks* on a rank are the blocks that rank would have to prefill::

        size       = m                                          with m > 0 block hashes
                   = ceil(prompt_tokens / block_size)    without
        new(r)     = min(size - depth(r), MAX_BLOCKS)           depth(r) is 0 except under prefix
        decode     = min(ceil(prefix_decode_tokens / block_size), MAX_BLOCKS)
        charged    = new(r) + decode

    so ``charged`` is an int in ``[0, 2 * MAX_BLOCKS]``, whatever the policy.
    ``work`` survives ``remove_rank`` as the pending count does.

``prefix``
    Prefix-cache affinity over the request's block hashes ``h[0 .. m-1]``
    (see :func:`coordkit.protocol.block_hashes`), priced in work. The router
    keeps a table ``hash -> (ranks, last_used)`` in LRU order; an entry is
    *live* at ``now`` when ``now - last_used <= prefix_ttl``.

    * ``depth(r)`` of an eligible rank is the number of leading hashes
      ``h[0 .. d-1]`` that all have a live entry listing ``r`` (0 when
      ``m == 0``).
    * With ``weight = round(prefix_prefill_weight * WEIGHT_SCALE)`` (an int,
      fixed when the router is built), each eligible rank costs the integer::

          cost(r) = weight * new(r) + WEIGHT_SCALE * work(r)

      the blocks it would prefill, weighted, plus the work already queued on
      it. The lowest cost wins; ties go to fewer pending, then to the first
      rank in ``least_loaded``'s rotating order (``start = cursor % n_ranks``,
      then ``start + 1``, ...), and ``cursor = (start + 1) % n_ranks``. With no
      hashes, or no match, that is the eligible rank with the least work.
    * If ``m > 0``, the chain is then recorded for the chosen rank ``r``:
      first, while the LRU-oldest entry is not live, it is deleted; then for
      each ``h[i]`` in order, a live entry gains ``r``, an expired one is
      reset to ``{r}``, and a missing one is inserted as ``{r}`` (deleting
      the LRU-oldest entry first when the table holds ``prefix_max_entries``);
      the entry's ``last_used`` becomes ``now`` and it moves to the
      most-recent end. Scoring only reads the table.
    * ``remove_rank(r)`` clears ``r`` from every entry and deletes the
      entries left empty; the others keep their LRU order.

Block hashes
    ``h[0 .. m-1]`` are defined by :func:`coordkit.protocol.block_hashes`; the
    coordinator reads their frame in place.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from .protocol import BLOCK_HASH_SIZE

__all__ = [
    "Router",
    "POLICIES",
    "DEFAULT_PREFILL_WEIGHT",
    "DEFAULT_DECODE_TOKENS",
    "DEFAULT_BLOCK_SIZE",
    "WEIGHT_SCALE",
    "MAX_BLOCKS",
]

Buffer = bytes | bytearray | memoryview

#: The routing policies, in the order the error message names them.
POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix")
#: Bounds that keep every count in a C int and every mask word count small.
MAX_RANKS_LIMIT = 1 << 16
MAX_PREFIX_ENTRIES_LIMIT = (1 << 31) - 1

#: The prefix policy's defaults (the README's Routing section says why these).
DEFAULT_PREFILL_WEIGHT = 32.0
DEFAULT_DECODE_TOKENS = 512
DEFAULT_BLOCK_SIZE = 16
#: The prefill weight counts in steps of 1 / WEIGHT_SCALE: costs stay integers.
WEIGHT_SCALE = 256
#: A request's new blocks are capped here, and so is the decode share: a charge
#: fits 2 * MAX_BLOCKS, and 2**30 requests' work times WEIGHT_SCALE fits int64.
MAX_BLOCKS = 1 << 23
MAX_PREFILL_WEIGHT = 65536.0

_U64 = (1 << 64) - 1


def _check_args(
    policy: object,
    max_ranks: int,
    seed: int,
    rank_cap: int,
    prefix_prefill_weight: float,
    prefix_decode_tokens: int,
    block_size: int,
    prefix_max_entries: int,
) -> tuple[int, int]:
    """Validate the constructor's arguments (shared by both implementations);
    the prefill weight in units of 1 / WEIGHT_SCALE and the decode share in blocks."""
    if policy not in POLICIES:
        names = ", ".join(repr(p) for p in POLICIES)
        raise ValueError(f"policy must be one of {names}, not {policy!r}")
    if not 1 <= max_ranks <= MAX_RANKS_LIMIT:
        raise ValueError(f"max_ranks must be in [1, {MAX_RANKS_LIMIT}], not {max_ranks}")
    if not 0 <= seed <= _U64:
        raise ValueError(f"seed must be in [0, 2**64), not {seed}")
    if not 0 <= rank_cap < 1 << 63:
        raise ValueError(f"rank_cap must be in [0, 2**63), not {rank_cap}")
    if not 0.0 <= prefix_prefill_weight <= MAX_PREFILL_WEIGHT:  # False for NaN
        raise ValueError(
            f"prefix_prefill_weight must be in [0, {MAX_PREFILL_WEIGHT:g}], "
            f"not {prefix_prefill_weight}"
        )
    if not 0 <= prefix_decode_tokens <= 1 << 31:
        raise ValueError(f"prefix_decode_tokens must be in [0, 2**31], not {prefix_decode_tokens}")
    if not 1 <= block_size <= 1 << 31:
        raise ValueError(f"block_size must be in [1, 2**31], not {block_size}")
    if not 1 <= prefix_max_entries <= MAX_PREFIX_ENTRIES_LIMIT:
        raise ValueError(
            f"prefix_max_entries must be in [1, {MAX_PREFIX_ENTRIES_LIMIT}], "
            f"not {prefix_max_entries}"
        )
    weight = round(float(prefix_prefill_weight) * WEIGHT_SCALE)
    return weight, min(-(-prefix_decode_tokens // block_size), MAX_BLOCKS)


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
        self._weight, self._decode_blocks = _check_args(
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
        self._rng = state = (self._rng + 0x9E3779B97F4A7C15) & _U64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
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
