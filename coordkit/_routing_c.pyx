# cython: language_level=3, embedsignature=True
# cython: cdivision=True, boundscheck=False, wraparound=False
"""The router in Cython: which engine rank gets the next request, over C tables.

The twin of :mod:`coordkit._routing_py`, which makes the same decisions bit
for bit; the rules both follow, their constants and their argument check are
:mod:`coordkit._policies`' (WEIGHT_SCALE and MAX_BLOCKS reach here as
generated constants). Every table is allocated by the constructor (the prefix
table's hash part is ``includes/tables.h``'s ck_prefix), so a decision
allocates nothing and needs neither the GIL nor a Python object (see
``Router.choose_c``).
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport INT64_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from ._constants cimport (
    BLOCK_HASH_SIZE,
    MAX_BLOCKS,
    POLICY_LEAST_LOADED,
    POLICY_POWER_OF_TWO,
    POLICY_PREFIX,
    POLICY_ROUND_ROBIN,
    WEIGHT_SCALE,
    generated_constants,
)
from .includes.sysdep cimport ck_ctz64, ck_load_le64
from .includes.tables cimport (
    CK_GOLDEN,
    CK_NIL,
    ck_prefix_find,
    ck_prefix_init,
    ck_prefix_insert,
    ck_prefix_remove,
)

from ._policies import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DECODE_TOKENS,
    DEFAULT_PREFILL_WEIGHT,
    POLICIES,
    check_args,
)
from ._shared import check_constants

check_constants(generated_constants())

__all__ = ["Router"]


cdef int _check_rank(Router self, int rank) except -1:
    if not 0 <= rank < self.max_ranks:
        raise ValueError(f"rank {rank} is out of range [0, {self.max_ranks})")
    return 0


@cython.final
cdef class Router:
    """Picks a rank per request; the rules are coordkit._policies'."""

    def __cinit__(
        self,
        policy,
        max_ranks=1024,
        *,
        seed=0,
        rank_cap=0,
        prefix_prefill_weight=DEFAULT_PREFILL_WEIGHT,
        prefix_decode_tokens=DEFAULT_DECODE_TOKENS,
        block_size=DEFAULT_BLOCK_SIZE,
        double prefix_ttl=600.0,
        prefix_max_entries=1_000_000,
    ):
        self.weight, self.decode_blocks = check_args(
            policy,
            max_ranks,
            seed,
            rank_cap,
            prefix_prefill_weight,
            prefix_decode_tokens,
            block_size,
            prefix_max_entries,
        )
        self.block_size = block_size
        self._policy = policy
        self.policy_id = POLICIES.index(policy)
        self.max_ranks = max_ranks
        self.pending_limit = rank_cap if rank_cap else INT64_MAX
        self.rng_state = seed
        self.prefix_ttl = prefix_ttl
        self.free_list = self.lru_oldest = self.lru_newest = CK_NIL
        self.is_accepting = <uint8_t*>calloc(self.max_ranks, sizeof(uint8_t))
        self.pending_count = <int64_t*>calloc(self.max_ranks, sizeof(int64_t))
        self.work_units = <int64_t*>calloc(self.max_ranks, sizeof(int64_t))
        self.members = <int*>calloc(self.max_ranks, sizeof(int))
        self.member_pos = <int*>calloc(self.max_ranks, sizeof(int))
        if (self.is_accepting == NULL or self.pending_count == NULL
                or self.work_units == NULL or self.members == NULL
                or self.member_pos == NULL):
            raise MemoryError()
        if self.policy_id != POLICY_PREFIX:
            return
        # The pools can be large (1M entries x 1024 ranks = 128 MB of masks),
        # but calloc maps fresh zero pages and the pool fills from its start,
        # so memory grows with the entries actually used.
        self.max_entries = prefix_max_entries
        self.stride = (self.max_ranks + 63) >> 6
        self.entries = <ck_prefix_entry*>calloc(self.max_entries, sizeof(ck_prefix_entry))
        self.masks = <uint64_t*>calloc(self.max_entries * self.stride, sizeof(uint64_t))
        self.running = <uint64_t*>calloc(self.stride, sizeof(uint64_t))
        self.matched = <uint64_t*>calloc(self.stride, sizeof(uint64_t))
        self.depth = <int*>calloc(self.max_ranks, sizeof(int))
        if (self.entries == NULL or self.masks == NULL or self.running == NULL
                or self.matched == NULL or self.depth == NULL
                or ck_prefix_init(&self.table, self.entries, self.max_entries) != 0):
            raise MemoryError()

    def __dealloc__(self):
        free(self.is_accepting)
        free(self.pending_count)
        free(self.work_units)
        free(self.members)
        free(self.member_pos)
        free(self.entries)
        free(self.masks)
        free(self.table.cells)
        free(self.running)
        free(self.matched)
        free(self.depth)

    # -- Python API -------------------------------------------------------

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def n_accepting(self) -> int:
        return self.n_members

    @property
    def prefix_len(self) -> int:
        """Entries in the prefix table, expired ones included until purged."""
        return self.n_entries

    @property
    def prefix_counts(self) -> tuple[int, int, int]:
        """Prefix decisions with block hashes, their blocks, and the blocks the
        chosen rank had cached."""
        return self.prefix_decisions, self.prefix_blocks, self.prefix_matched_blocks

    # ``charged`` (readonly, declared in the .pxd): the work units the last
    # choose charged to its rank (0 if it returned -1).

    def add_rank(self, int rank) -> None:
        _check_rank(self, rank)
        if self.is_accepting[rank]:
            return
        self.is_accepting[rank] = 1
        self.member_pos[rank] = self.n_members
        self.members[self.n_members] = rank
        self.n_members += 1
        if rank >= self.n_ranks:
            self.n_ranks = rank + 1

    def remove_rank(self, int rank) -> None:
        _check_rank(self, rank)
        self.remove_rank_c(rank)

    cdef void remove_rank_c(self, int rank) noexcept nogil:
        """``remove_rank`` of a rank in range."""
        cdef int pos, last
        cdef uint32_t e, newer
        cdef uint64_t* mask
        cdef uint64_t bit = (<uint64_t>1) << (rank & 63)
        cdef size_t w
        cdef bint empty
        if not self.is_accepting[rank]:
            return
        self.is_accepting[rank] = 0
        self.n_members -= 1
        last = self.members[self.n_members]
        pos = self.member_pos[rank]
        self.members[pos] = last
        self.member_pos[last] = pos
        # Walk oldest to newest: deleting an entry leaves the others' order alone.
        e = self.lru_oldest
        while e != CK_NIL:
            newer = self.entries[e].newer
            mask = self.masks + e * self.stride
            if mask[rank >> 6] & bit:
                mask[rank >> 6] ^= bit
                empty = True
                for w in range(self.stride):
                    if mask[w]:
                        empty = False
                        break
                if empty:
                    self._delete(e)
            e = newer

    def accepting(self, int rank) -> bool:
        _check_rank(self, rank)
        return self.is_accepting[rank] != 0

    def pending(self, int rank) -> int:
        """Requests chosen for ``rank`` and not yet released."""
        _check_rank(self, rank)
        return self.pending_count[rank]

    def work(self, int rank) -> int:
        """Work units charged to ``rank`` and not yet released."""
        _check_rank(self, rank)
        return self.work_units[rank]

    def release(self, int rank, int64_t work=0) -> None:
        """A request of ``rank`` ended: ``work`` is what ``choose`` charged for it."""
        _check_rank(self, rank)
        self.release_c(rank, work)

    def hold(self, int rank) -> None:
        """A request already at ``rank`` (taken over after a coordinator's loss): one
        more pending there, charged the decode share (``charged``)."""
        _check_rank(self, rank)
        self.charged = self.decode_blocks
        self.pending_count[rank] += 1
        self.work_units[rank] += self.charged

    def learn(self, int rank, block_hashes, double now) -> None:
        """Under ``prefix``, record the chains of ``block_hashes`` (an engine's report,
        oldest first) for ``rank`` as a decision records its chain; else nothing."""
        cdef Py_buffer frame
        _check_rank(self, rank)
        PyObject_GetBuffer(block_hashes, &frame, PyBUF_SIMPLE)
        try:
            if frame.len % BLOCK_HASH_SIZE:
                raise ValueError(
                    f"the block-hash frame is {frame.len} bytes, "
                    f"not a multiple of {BLOCK_HASH_SIZE}"
                )
            if self.policy_id == POLICY_PREFIX and frame.len:
                self._record(<const uint8_t*>frame.buf, <size_t>frame.len >> 3, rank, now)
        finally:
            PyBuffer_Release(&frame)

    def choose(self, block_hashes=None, double now=0.0, int64_t prompt_tokens=0) -> int:
        """The rank for the next request, or -1 when none is eligible.

        ``prompt_tokens`` sizes a request without block hashes; what the
        chosen rank is charged is :attr:`charged`.
        """
        cdef Py_buffer frame
        cdef int rank
        cdef uint64_t tokens = prompt_tokens if prompt_tokens > 0 else 0
        if block_hashes is None:
            return self.choose_c(NULL, 0, tokens, now)
        PyObject_GetBuffer(block_hashes, &frame, PyBUF_SIMPLE)
        try:
            if frame.len % BLOCK_HASH_SIZE:
                raise ValueError(
                    f"the block-hash frame is {frame.len} bytes, "
                    f"not a multiple of {BLOCK_HASH_SIZE}"
                )
            rank = self.choose_c(
                <const uint8_t*>frame.buf, <size_t>frame.len >> 3, tokens, now
            )
        finally:
            PyBuffer_Release(&frame)
        return rank

    def prefix_ranks(self, uint64_t hash, double now) -> list:
        """The ranks recorded for ``hash``, ascending; [] if absent or expired."""
        cdef uint32_t e
        cdef uint64_t* mask
        cdef int r
        if self.entries == NULL:
            return []
        e = ck_prefix_find(&self.table, hash)
        if e == CK_NIL or now - self.entries[e].last_used > self.prefix_ttl:
            return []
        mask = self.masks + e * self.stride
        return [r for r in range(self.max_ranks) if mask[r >> 6] >> (r & 63) & 1]

    # -- C API ------------------------------------------------------------

    cdef int choose_c(self, const uint8_t* hashes, size_t n_hashes, uint64_t prompt_tokens,
                      double now) noexcept nogil:
        """``choose`` over a frame of ``n_hashes`` LE u64s (unaligned is fine);
        ``charged`` then holds the chosen rank's charge."""
        cdef int rank
        cdef uint64_t size = n_hashes
        if n_hashes == 0:
            size = prompt_tokens // self.block_size + (prompt_tokens % self.block_size != 0)
        # Capped here already: min(size - depth, MAX_BLOCKS) is then the same.
        self.new_blocks = <int64_t>(size if size < MAX_BLOCKS else MAX_BLOCKS)
        if self.policy_id == POLICY_ROUND_ROBIN:
            rank = self._round_robin()
        elif self.policy_id == POLICY_LEAST_LOADED:
            rank = self._least_loaded()
        elif self.policy_id == POLICY_POWER_OF_TWO:
            rank = self._power_of_two()
        else:
            rank = self._prefix(hashes, n_hashes, now)
        if rank < 0:
            self.charged = 0
            return rank
        self.charged = self.new_blocks + self.decode_blocks
        self.pending_count[rank] += 1
        self.work_units[rank] += self.charged
        return rank

    cdef void release_c(self, int rank, int64_t work) noexcept nogil:
        if 0 <= rank < self.max_ranks:
            if self.pending_count[rank] > 0:
                self.pending_count[rank] -= 1
            if self.work_units[rank] > work:
                self.work_units[rank] -= work
            else:
                self.work_units[rank] = 0

    cdef bint accepting_c(self, int rank) noexcept nogil:
        return 0 <= rank < self.max_ranks and self.is_accepting[rank]

    # -- policies ---------------------------------------------------------

    cdef inline bint _eligible(self, int rank) noexcept nogil:
        return self.is_accepting[rank] and self.pending_count[rank] < self.pending_limit

    cdef int _round_robin(self) noexcept nogil:
        cdef int n = self.n_ranks, k, r
        for k in range(n):
            r = (self.cursor + k) % n
            if self._eligible(r):
                self.cursor = (r + 1) % n
                return r
        return -1

    cdef int _least_loaded(self) noexcept nogil:
        cdef int n = self.n_ranks, start, r, best = -1
        cdef const uint8_t* accepting = self.is_accepting
        cdef const int64_t* pending = self.pending_count
        # Eligible and strictly below the best so far: one compare does both.
        cdef int64_t limit = self.pending_limit
        if n == 0:
            return -1
        start = self.cursor % n
        for r in range(start, n):
            if accepting[r] and pending[r] < limit:
                best = r
                limit = pending[r]
        for r in range(start):
            if accepting[r] and pending[r] < limit:
                best = r
                limit = pending[r]
        if best >= 0:
            self.cursor = (start + 1) % n
        return best

    cdef uint64_t _rand(self) noexcept nogil:
        cdef uint64_t z
        self.rng_state += CK_GOLDEN
        z = self.rng_state
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
        return z ^ (z >> 31)

    cdef int _power_of_two(self) noexcept nogil:
        cdef int n = self.n_members, i, j, a, b
        cdef bint a_ok, b_ok
        if n == 0:
            return -1
        if n == 1:
            a = b = self.members[0]
        else:
            i = <int>(self._rand() % <uint64_t>n)
            j = <int>(self._rand() % <uint64_t>(n - 1))
            if j >= i:
                j += 1
            a = self.members[i]
            b = self.members[j]
        a_ok = self._eligible(a)
        b_ok = self._eligible(b)
        if a_ok and b_ok:
            return b if self.pending_count[b] < self.pending_count[a] else a
        if a_ok:
            return a
        if b_ok:
            return b
        return self._least_loaded()

    cdef int _prefix(self, const uint8_t* hashes, size_t n_hashes, double now) noexcept nogil:
        cdef int n = self.n_ranks, start, r, w, pos, best_pos = 0, rank = -1, c
        cdef int64_t size = <int64_t>n_hashes  # a request with hashes: its blocks
        cdef const uint8_t* accepting = self.is_accepting
        cdef const int64_t* pending = self.pending_count
        cdef const int64_t* work = self.work_units
        cdef int64_t limit = self.pending_limit, least = 0, p, q, new
        cdef int64_t cost, best_cost = 0, best_new = 0, least_work = 0, c_pending = 0
        cdef int64_t depth = 0  # the chosen rank's matched blocks
        cdef uint64_t word, bits, eligible = 0
        cdef bint c_matched
        if n == 0:
            return -1
        start = self.cursor % n
        # The eligible ranks: the candidates to match, as masks built in a register.
        for w in range((n + 63) >> 6):
            word = 0
            for r in range(w << 6, min(n, (w + 1) << 6)):
                if accepting[r] and pending[r] < limit:
                    word |= (<uint64_t>1) << (r & 63)
            self.running[w] = word
            eligible |= word
        if not eligible:
            return -1
        self.cursor = (start + 1) % n
        if n_hashes and self._match(hashes, n_hashes, now) > 0:
            # The best of the (few) matched ranks, on the reference's full key.
            for w in range((n + 63) >> 6):
                bits = self.matched[w]
                while bits:
                    r = (w << 6) + ck_ctz64(bits)
                    bits &= bits - 1
                    new = min(size - self.depth[r], <int64_t>MAX_BLOCKS)
                    cost = self.weight * new + WEIGHT_SCALE * work[r]
                    p = pending[r]
                    pos = r - start if r >= start else r - start + n
                    if (rank < 0 or cost < best_cost or (cost == best_cost and (
                            p < least or (p == least and pos < best_pos)))):
                        rank = r
                        best_cost = cost
                        best_new = new
                        least = p
                        best_pos = pos
            # An unmatched rank costs at least weight * new_blocks (its work is >= 0):
            # strictly below that, no other rank can win, nor tie.
            if best_cost < self.weight * self.new_blocks:
                self.new_blocks = best_new
                self._count_prefix(n_hashes, self.depth[rank])
                self._record(hashes, n_hashes, rank, now)
                return rank
        # Otherwise the winner is the best matched rank or the first eligible rank in
        # the rotating order with the least work, then the fewest pending: all the
        # unmatched ranks have the same new blocks, so that one beats or ties-and-wins
        # each of them. (_match narrowed running: eligibility is read again.)
        c = -1
        for r in range(start, n):
            p = pending[r]
            if accepting[r] and p < limit:
                q = work[r]
                if c < 0 or q < least_work or (q == least_work and p < c_pending):
                    c = r
                    least_work = q
                    c_pending = p
        for r in range(start):
            p = pending[r]
            if accepting[r] and p < limit:
                q = work[r]
                if c < 0 or q < least_work or (q == least_work and p < c_pending):
                    c = r
                    least_work = q
                    c_pending = p
        new = self.new_blocks
        c_matched = rank >= 0 and self.matched[c >> 6] >> (c & 63) & 1
        if rank >= 0:  # the best matched rank, until c beats it
            depth = self.depth[rank]
        if c_matched:
            new = min(size - self.depth[c], <int64_t>MAX_BLOCKS)
        cost = self.weight * new + WEIGHT_SCALE * least_work
        pos = c - start if c >= start else c - start + n
        if (rank < 0 or cost < best_cost
                or (cost == best_cost and (c_pending < least
                                           or (c_pending == least and pos < best_pos)))):
            rank = c
            best_new = new
            depth = self.depth[c] if c_matched else 0
        self.new_blocks = best_new
        if n_hashes:
            self._count_prefix(n_hashes, depth)
            self._record(hashes, n_hashes, rank, now)
        return rank

    cdef void _count_prefix(self, size_t n_hashes, int64_t matched) noexcept nogil:
        self.prefix_decisions += 1
        self.prefix_blocks += n_hashes
        self.prefix_matched_blocks += <uint64_t>matched

    cdef int _match(self, const uint8_t* hashes, size_t n_hashes, double now) noexcept nogil:
        """Narrow ``running`` along the chain and return the deepest match.

        When that is > 0, ``matched`` holds the ranks of the first entry and
        ``depth`` their depths; the other candidates have depth 0. The
        candidates only shrink, so a rank's depth is the step it drops out at,
        and only the (few) ranks of the first entry need a depth written.
        """
        cdef size_t nw = (self.n_ranks + 63) >> 6, w, i
        cdef uint64_t* running = self.running
        cdef uint64_t* mask
        cdef uint64_t kept, dropped, alive
        cdef uint32_t e
        cdef int d = 0
        for i in range(n_hashes):
            e = ck_prefix_find(&self.table, ck_load_le64(hashes + 8 * i))
            if e == CK_NIL or now - self.entries[e].last_used > self.prefix_ttl:
                break
            mask = self.masks + e * self.stride
            alive = 0
            for w in range(nw):
                kept = running[w] & mask[w]
                dropped = running[w] ^ kept
                running[w] = kept
                alive |= kept
                while dropped and i:
                    self.depth[(w << 6) + ck_ctz64(dropped)] = d
                    dropped &= dropped - 1
            if not alive:
                return d
            if i == 0:
                memcpy(self.matched, running, nw * sizeof(uint64_t))
            d += 1
        for w in range(nw):
            kept = running[w]
            while kept:
                self.depth[(w << 6) + ck_ctz64(kept)] = d
                kept &= kept - 1
        return d

    cdef void _record(self, const uint8_t* hashes, size_t n_hashes, int rank,
                      double now) noexcept nogil:
        cdef size_t i, word = rank >> 6
        cdef uint64_t bit = (<uint64_t>1) << (rank & 63)
        cdef uint64_t h
        cdef uint32_t e
        while (self.lru_oldest != CK_NIL
               and now - self.entries[self.lru_oldest].last_used > self.prefix_ttl):
            self._delete(self.lru_oldest)
        for i in range(n_hashes):
            h = ck_load_le64(hashes + 8 * i)
            e = ck_prefix_find(&self.table, h)
            if e == CK_NIL:
                if self.n_entries == self.max_entries:
                    self._delete(self.lru_oldest)
                e = self._insert(h)
            else:
                if now - self.entries[e].last_used > self.prefix_ttl:
                    memset(self.masks + e * self.stride, 0, self.stride * sizeof(uint64_t))
                self._unlink(e)
            self.masks[e * self.stride + word] |= bit
            self.entries[e].last_used = now
            self._append(e)

    # -- prefix table: entries in a pool, found by hash (ck_prefix), in an LRU list --

    cdef uint32_t _insert(self, uint64_t h) noexcept nogil:
        """A new entry for ``h`` with no ranks, filed under ``h`` but not yet in the LRU list."""
        cdef uint32_t e
        if self.free_list != CK_NIL:
            e = self.free_list
            self.free_list = self.entries[e].older
        else:
            e = self.n_used
            self.n_used += 1
        self.entries[e].hash = h
        memset(self.masks + e * self.stride, 0, self.stride * sizeof(uint64_t))
        ck_prefix_insert(&self.table, e)
        self.n_entries += 1
        return e

    cdef void _delete(self, uint32_t e) noexcept nogil:
        self._unlink(e)
        ck_prefix_remove(&self.table, e)
        self.entries[e].older = self.free_list
        self.free_list = e
        self.n_entries -= 1

    cdef void _unlink(self, uint32_t e) noexcept nogil:
        cdef uint32_t older = self.entries[e].older, newer = self.entries[e].newer
        if older != CK_NIL:
            self.entries[older].newer = newer
        else:
            self.lru_oldest = newer
        if newer != CK_NIL:
            self.entries[newer].older = older
        else:
            self.lru_newest = older

    cdef void _append(self, uint32_t e) noexcept nogil:
        self.entries[e].older = self.lru_newest
        self.entries[e].newer = CK_NIL
        if self.lru_newest != CK_NIL:
            self.entries[self.lru_newest].newer = e
        else:
            self.lru_oldest = e
        self.lru_newest = e
