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
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memmove, memset

from ._constants cimport (
    BLOCK_HASH_SIZE,
    MAX_BLOCKS,
    POLICY_LEAST_LOADED,
    POLICY_POWER_OF_TWO,
    POLICY_PREFIX,
    POLICY_ROUND_ROBIN,
    SPARSE_RANKS,
    WALK_MAX,
    WEIGHT_SCALE,
    generated_constants,
)
from .includes.kvindex cimport (
    CK_KV_NONE,
    ck_kvindex,
    ck_kvindex_depth,
    ck_kvindex_lock,
    ck_kvindex_unlock,
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

cdef enum:
    CHAIN_MAX = 4096  # live entries of a chain the affine decision holds; longer: the scan


cdef int _check_rank(Router self, int rank) except -1:
    if not 0 <= rank < self.max_ranks:
        raise ValueError(f"rank {rank} is out of range [0, {self.max_ranks})")
    return 0


cdef int _check_hash_frame(Py_buffer* frame) except -1:
    if frame.len % BLOCK_HASH_SIZE:
        raise ValueError(
            f"the block-hash frame is {frame.len} bytes, not a multiple of {BLOCK_HASH_SIZE}"
        )
    return 0


@cython.final
cdef class Router:
    """Picks a rank per request; the rules are coordkit._policies'."""

    def __cinit__(
        self,
        policy,
        max_ranks=4096,
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
        self.capacity = <int64_t*>calloc(self.max_ranks, sizeof(int64_t))
        if (self.is_accepting == NULL or self.pending_count == NULL
                or self.work_units == NULL or self.members == NULL
                or self.member_pos == NULL or self.capacity == NULL):
            raise MemoryError()
        self.by_work = self.policy_id == POLICY_PREFIX
        self.by_pending = self.policy_id != POLICY_ROUND_ROBIN
        # power_of_two draws accepting ranks, all eligible without a cap: no fallback.
        if self.policy_id != POLICY_POWER_OF_TWO or rank_cap:
            self._ranked()
        self.stride = self.group = 1  # (remove_rank_c divides by group, whatever the policy)
        if self.policy_id != POLICY_PREFIX:
            return
        # The pools can be large (1M entries x 4096 ranks = 512 MB of masks), but
        # calloc maps fresh zero pages, the pool fills from its start and an
        # entry's mask is as wide as the ranks added so far (_widen): memory
        # grows with the entries actually used, times the fleet actually seen.
        self.max_entries = prefix_max_entries
        self.max_stride = (self.max_ranks + 63) >> 6
        self.entries = <ck_prefix_entry*>calloc(self.max_entries, sizeof(ck_prefix_entry))
        self.masks = <uint64_t*>calloc(self.max_entries * self.max_stride, sizeof(uint64_t))
        self.eligible = <uint64_t*>calloc(self.max_stride, sizeof(uint64_t))
        self.running = <uint64_t*>calloc(self.max_stride, sizeof(uint64_t))
        self.matched = <uint64_t*>calloc(self.max_stride, sizeof(uint64_t))
        self.matched_words = <int*>calloc(self.max_stride, sizeof(int))
        self.depth = <int*>calloc(self.max_ranks, sizeof(int))
        self.chain = <uint32_t*>malloc(CHAIN_MAX * sizeof(uint32_t))
        self.hidden = <int*>malloc(WALK_MAX * sizeof(int))
        if (self.entries == NULL or self.masks == NULL or self.eligible == NULL
                or self.running == NULL or self.matched == NULL or self.matched_words == NULL
                or self.depth == NULL or self.chain == NULL or self.hidden == NULL
                or ck_prefix_init(&self.table, self.entries, self.max_entries) != 0):
            raise MemoryError()

    def __dealloc__(self):
        free(self.is_accepting)
        free(self.pending_count)
        free(self.work_units)
        free(self.members)
        free(self.member_pos)
        free(self.capacity)
        free(self.ranking)
        free(self.eligible)
        free(self.entries)
        free(self.masks)
        free(self.table.cells)
        free(self.running)
        free(self.matched)
        free(self.matched_words)
        free(self.depth)
        free(self.chain)
        free(self.hidden)

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
        cdef int leaves
        cdef size_t stride
        _check_rank(self, rank)
        if self.is_accepting[rank]:
            return
        self.is_accepting[rank] = 1
        self.member_pos[rank] = self.n_members
        self.members[self.n_members] = rank
        self.n_members += 1
        if rank >= self.n_ranks:
            self.n_ranks = rank + 1
        if self.ranking != NULL and rank >= self.leaves:
            leaves = self.leaves
            while leaves <= rank:
                leaves <<= 1
            self._build(leaves)
        if self.entries != NULL and <size_t>rank >> 6 >= self.stride:
            stride = self.stride
            while stride << 6 <= <size_t>rank:
                stride <<= 1
            self._widen(min(stride, self.max_stride))
        self._update(rank)

    def set_capacity(self, int rank, int64_t capacity) -> None:
        """``rank`` takes at most ``capacity`` requests at once, what it declared at
        registration (0: the router's ``rank_cap``, if any)."""
        _check_rank(self, rank)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        self.capacity[rank] = capacity
        if capacity and self.ranking == NULL:
            self._ranked()  # power_of_two's fallback, now that a rank can be full
        self._update(rank)

    @property
    def has_room(self) -> bool:
        return self.has_room_c()

    cdef bint has_room_c(self) noexcept nogil:
        """Whether choose would pick a rank now: one is eligible."""
        if self.ranking != NULL:
            return self.ranking[1] >= 0
        return self.n_members > 0

    cdef _ranked(self):
        """The ranking, allocated for max_ranks and built over the ranks so far."""
        cdef int leaves = 1
        while leaves < self.max_ranks:
            leaves <<= 1
        self.ranking = <int*>malloc(2 * leaves * sizeof(int))
        if self.ranking == NULL:
            raise MemoryError()
        leaves = 1
        while leaves < self.n_ranks:
            leaves <<= 1
        self._build(leaves)

    def remove_rank(self, int rank) -> None:
        _check_rank(self, rank)
        self.remove_rank_c(rank)

    cdef void remove_rank_c(self, int rank) noexcept nogil:
        """``remove_rank`` of a rank in range."""
        cdef int pos, last
        if not self.is_accepting[rank]:
            return
        self.is_accepting[rank] = 0
        self.n_members -= 1
        last = self.members[self.n_members]
        pos = self.member_pos[rank]
        self.members[pos] = last
        self.member_pos[last] = pos
        self._update(rank)
        self.forget_c(rank)

    cdef void forget_c(self, int rank) noexcept nogil:
        """``rank`` is no longer listed in the prefix table (it left, or its own events
        say what it holds from now on)."""
        cdef uint32_t e, newer
        cdef uint64_t* mask
        cdef uint64_t bit = (<uint64_t>1) << (rank & 63)
        cdef size_t word = rank >> 6, group = word // self.group, w
        cdef bint empty
        # Walk oldest to newest: deleting an entry leaves the others' order alone.
        e = self.lru_oldest
        while e != CK_NIL:
            newer = self.entries[e].newer
            mask = self.masks + e * self.stride
            if mask[word] & bit:
                mask[word] ^= bit
                self.entries[e].count -= 1
                if not mask[word]:
                    empty = True
                    for w in range(group * self.group,
                                   min((group + 1) * self.group, self.stride)):
                        if mask[w]:
                            empty = False
                            break
                    if empty:
                        self.entries[e].summary ^= (<uint64_t>1) << group
                if not self.entries[e].count:
                    self._delete(e)
            e = newer

    def forget(self, int rank) -> None:
        """``rank`` is no longer listed in the prefix table (its own events say what it
        holds from now on)."""
        _check_rank(self, rank)
        self.forget_c(rank)

    def attach_kv(self, index) -> None:
        """Under ``prefix``, price the ranks ``index`` (the loop's KVIndex) knows by their
        own events: the approximate table neither credits nor records a rank that
        publishes."""
        index.attach(self)
        self.kv_owner = index

    cdef void attach_kv_c(self, ck_kvindex* kv) noexcept nogil:
        """``attach_kv`` of the index whose tables are ``kv``."""
        self.kv = kv

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
            _check_hash_frame(&frame)
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
            _check_hash_frame(&frame)
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
        return [r for r in range(min(self.max_ranks, <int>self.stride << 6))
                if mask[r >> 6] >> (r & 63) & 1]

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
        self._update(rank)
        return rank

    cdef void release_c(self, int rank, int64_t work) noexcept nogil:
        if 0 <= rank < self.max_ranks:
            if self.pending_count[rank] > 0:
                self.pending_count[rank] -= 1
            if self.work_units[rank] > work:
                self.work_units[rank] -= work
            else:
                self.work_units[rank] = 0
            self._update(rank)

    cdef bint accepting_c(self, int rank) noexcept nogil:
        return 0 <= rank < self.max_ranks and self.is_accepting[rank]

    # -- the ranking: the eligible ranks in the policy's order, as they change ----

    cdef inline bint _eligible(self, int rank) noexcept nogil:
        cdef int64_t limit = self.capacity[rank] or self.pending_limit
        return self.is_accepting[rank] and self.pending_count[rank] < limit

    cdef void _update(self, int rank) noexcept nogil:
        """``rank``'s eligibility, pending count or work changed: mend its path to the root.

        O(log n_ranks), and it stops where a node's first rank stays another one.
        """
        cdef bint ok
        if rank >= self.n_ranks:
            return  # never added: never eligible
        ok = self._eligible(rank)
        if self.eligible != NULL:
            if ok:
                self.eligible[rank >> 6] |= (<uint64_t>1) << (rank & 63)
            else:
                self.eligible[rank >> 6] &= ~((<uint64_t>1) << (rank & 63))
        if self.ranking != NULL:
            self._set_leaf(rank, ok)

    cdef void _set_leaf(self, int rank, bint ok) noexcept nogil:
        """``rank`` in the ranking (``ok``) or out of it, and the nodes above it mended."""
        cdef int node = self.leaves + rank, first
        if not self.by_pending and (self.ranking[node] >= 0) == ok:
            return  # round_robin orders by rank alone: only eligibility moves it
        self.ranking[node] = rank if ok else -1
        node >>= 1
        while node:
            first = self._first(self.ranking[2 * node], self.ranking[2 * node + 1])
            if first == self.ranking[node] and first != rank:
                return  # the same rank, its key unchanged: so is every node above
            self.ranking[node] = first
            node >>= 1

    cdef void _build(self, int leaves) noexcept nogil:
        """The ranking over ``leaves`` leaves, from scratch (when n_ranks outgrows it)."""
        cdef int r, node
        self.leaves = leaves
        for r in range(leaves):
            self.ranking[leaves + r] = r if r < self.n_ranks and self._eligible(r) else -1
        for node in range(leaves - 1, 0, -1):
            self.ranking[node] = self._first(self.ranking[2 * node], self.ranking[2 * node + 1])

    cdef inline bint _ahead(self, int a, int b) noexcept nogil:
        """``a``'s key is below ``b``'s: (work, pending) for prefix, pending for
        least_loaded and power_of_two, none for round_robin."""
        if self.by_work and self.work_units[a] != self.work_units[b]:
            return self.work_units[a] < self.work_units[b]
        return self.by_pending and self.pending_count[a] < self.pending_count[b]

    cdef inline int _first(self, int a, int b) noexcept nogil:
        """The first of two ranks (-1: none) by key, then rank."""
        if a < 0:
            return b
        if b < 0 or self._ahead(a, b):
            return a
        if self._ahead(b, a):
            return b
        return a if a < b else b

    cdef int _first_from(self, int start) noexcept nogil:
        """The eligible rank of the least key, the first from ``start`` in the rotating
        order (start, start + 1, ..., n_ranks - 1, 0, ...) among equals; -1 if none.

        The root holds the least key's lowest rank: the answer unless it is below
        start, when the first of [start, leaves) wins if its key is the same.
        """
        cdef int* ranking = self.ranking
        cdef int first = ranking[1], rest = -1
        cdef int lo = start + self.leaves, hi = 2 * self.leaves
        if first < 0 or first >= start:
            return first
        while lo < hi:  # the nodes that cover [start, leaves) exactly
            if lo & 1:
                rest = self._first(rest, ranking[lo])
                lo += 1
            lo >>= 1
            hi >>= 1
        if rest >= 0 and not self._ahead(first, rest):
            return rest
        return first

    # -- policies ---------------------------------------------------------

    cdef int _round_robin(self) noexcept nogil:
        cdef int r = self._first_from(self.cursor)
        if r >= 0:
            self.cursor = (r + 1) % self.n_ranks
        return r

    cdef int _least_loaded(self) noexcept nogil:
        cdef int n = self.n_ranks, start, best
        if n == 0:
            return -1
        start = self.cursor % n
        best = self._first_from(start)
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
        """The contract's winner without pricing every rank (docs/design.md, Routing):
        the affine decision over the chain's live entries, or when it cannot settle
        it, the scan of the first entry's ranks."""
        cdef Choice best
        cdef int n = self.n_ranks, start, length = 0, i, r
        cdef int64_t d
        # A request's blocks: its hashes, else its prompt's (new_blocks, capped already).
        cdef int64_t size = <int64_t>n_hashes if n_hashes else self.new_blocks
        if self.ranking[1] < 0:
            return -1  # none eligible
        start = self.cursor % n
        self.cursor = (start + 1) % n
        best.rank = -1
        if n_hashes:
            length = self._chain_of(hashes, n_hashes, now)
        if length == 0:  # no match: the least work, then the fewest pending
            self._consider(&best, self._first_from(start), 0, start, size)
        elif length < 0 or not self._affine(start, length, size, &best):
            best.rank = -1
            self._scan(hashes, n_hashes, now, start, size, &best)
        if self.kv != NULL and n_hashes and self.kv.n_known:
            # The table priced every rank that publishes as holding nothing: those its
            # events say hold a prefix are priced again, by that (the events' thread
            # writes their maps: read under its lock).
            ck_kvindex_lock(self.kv)
            for i in range(self.kv.n_known):
                r = self.kv.known[i]
                if r < n and self._eligible(r):
                    d = ck_kvindex_depth(self.kv, r, hashes, n_hashes)
                    if d:
                        self._consider(&best, r, d, start, size)
            ck_kvindex_unlock(self.kv)
        self.new_blocks = best.new
        if n_hashes:
            self._count_prefix(n_hashes, best.depth)
            self._record(hashes, n_hashes, best.rank, now)
        return best.rank

    cdef void _consider(self, Choice* best, int rank, int64_t depth, int start,
                        int64_t size) noexcept nogil:
        """``rank``, which has ``depth`` blocks, in place of ``best`` if its key is lower:
        (cost, pending, place in the rotating order)."""
        cdef int64_t new = min(size - depth, <int64_t>MAX_BLOCKS)
        cdef int64_t cost = self.weight * new + WEIGHT_SCALE * self.work_units[rank]
        cdef int64_t p = self.pending_count[rank]
        cdef int pos = rank - start if rank >= start else rank - start + self.n_ranks
        if (best.rank < 0 or cost < best.cost or (cost == best.cost and (
                p < best.pending or (p == best.pending and pos < best.pos)))):
            best.rank = rank
            best.pos = pos
            best.cost = cost
            best.pending = p
            best.new = new
            best.depth = depth

    cdef int _chain_of(self, const uint8_t* hashes, size_t n_hashes, double now) noexcept nogil:
        """The live entries leading the request's chain, into ``chain``: how many, or
        -1 when more than CHAIN_MAX."""
        cdef size_t i
        cdef uint32_t e
        for i in range(n_hashes):
            e = ck_prefix_find(&self.table, ck_load_le64(hashes + 8 * i))
            if e == CK_NIL or now - self.entries[e].last_used > self.prefix_ttl:
                return <int>i
            if i == CHAIN_MAX:
                return -1
            self.chain[i] = e
        return <int>n_hashes

    cdef inline int _depth_along(self, int rank, int d, int length) noexcept nogil:
        """The depth of ``rank`` in the chain's first ``length`` entries, the first
        ``d`` of which list it."""
        cdef size_t word = rank >> 6
        cdef uint64_t bit = (<uint64_t>1) << (rank & 63)
        while d < length and self.masks[self.chain[d] * self.stride + word] & bit:
            d += 1
        return d

    cdef bint _affine(self, int start, int length, int64_t size, Choice* best) noexcept nogil:
        """The winner from the chain's ``length`` live entries and the ranking alone;
        False when the walk hid WALK_MAX ranks without settling it.

        Entry k is the first that lists at most SPARSE_RANKS ranks (k = length if
        none): every rank deeper than k is one of them, each priced. The others
        are found walking the ranking, best (work, pending) first: a rank can only
        win if it is deeper than every rank before it (one before it at least as
        deep costs no more, and wins a tie), so the walk prices those, and it ends
        at a rank of depth k or more (none after can win), at one whose work
        alone prices it above the best so far, or with the ranking.
        """
        cdef int k = 0, w, end, r, g, d, deepest = -1, n_hidden = 0, i
        cdef uint64_t groups, bits
        cdef uint64_t* mask
        cdef int64_t floor
        cdef bint settled = False
        while k < length and self.entries[self.chain[k]].count > SPARSE_RANKS:
            k += 1
        if k < length:
            mask = self.masks + self.chain[k] * self.stride
            groups = self.entries[self.chain[k]].summary
            while groups:
                w = ck_ctz64(groups) * self.group
                groups &= groups - 1
                end = min(w + self.group, <int>self.stride)
                while w < end:
                    bits = mask[w] & self.eligible[w]
                    while bits:
                        r = (w << 6) + ck_ctz64(bits)
                        bits &= bits - 1
                        if self._depth_along(r, 0, k) == k:
                            self._consider(best, r, self._depth_along(r, k + 1, length), start,
                                           size)
                    w += 1
        # Every rank the walk has not priced yet has depth <= k: new blocks >= this.
        floor = self.weight * min(size - k, <int64_t>MAX_BLOCKS)
        while True:
            g = self._first_from(start)
            if g < 0 or (best.rank >= 0
                         and best.cost < floor + WEIGHT_SCALE * self.work_units[g]):
                settled = True
                break
            d = self._depth_along(g, 0, length)
            if d > deepest:
                self._consider(best, g, d, start, size)
                deepest = d
            if d >= k:
                settled = True
                break
            if n_hidden == WALK_MAX:
                break
            self._set_leaf(g, False)  # the next one, until put back below
            self.hidden[n_hidden] = g
            n_hidden += 1
        for i in range(n_hidden):
            self._set_leaf(self.hidden[i], True)
        return settled

    cdef void _scan(self, const uint8_t* hashes, size_t n_hashes, double now, int start,
                    int64_t size, Choice* best) noexcept nogil:
        """Every rank of the chain's first entry priced, then the least-worked one:
        the unmatched ranks all have the same new blocks, so that one beats or
        ties-and-wins each of them."""
        cdef int k, w, r, c
        cdef uint64_t bits
        if self._match(hashes, n_hashes, now) > 0:
            for k in range(self.n_matched_words):
                w = self.matched_words[k]
                bits = self.matched[w]
                while bits:
                    r = (w << 6) + ck_ctz64(bits)
                    bits &= bits - 1
                    self._consider(best, r, self.depth[r], start, size)
        c = self._first_from(start)
        self._consider(best, c, self.depth[c] if self.matched[c >> 6] >> (c & 63) & 1 else 0,
                       start, size)
        for k in range(self.n_matched_words):  # the scratch is all zero between decisions
            self.matched[self.matched_words[k]] = 0
        self.n_matched_words = 0

    cdef void _count_prefix(self, size_t n_hashes, int64_t matched) noexcept nogil:
        self.prefix_decisions += 1
        self.prefix_blocks += n_hashes
        self.prefix_matched_blocks += <uint64_t>matched

    cdef int _match(self, const uint8_t* hashes, size_t n_hashes, double now) noexcept nogil:
        """Narrow the candidates along the chain and return the deepest match.

        When that is > 0, ``matched`` holds the eligible ranks of the first entry
        (in the words listed by ``matched_words``) and ``depth`` their depths; the
        other candidates have depth 0. The candidates only shrink, so a rank's depth
        is the step it drops out at, and only the words of the first entry's ranks
        are ever read: its summary finds them, whatever the number of ranks.
        """
        cdef uint64_t* running = self.running
        cdef uint64_t* mask
        cdef uint64_t kept, dropped, alive, groups
        cdef uint32_t e
        cdef size_t i
        cdef int d = 0, k, w, end, n_words = 0
        for i in range(n_hashes):
            e = ck_prefix_find(&self.table, ck_load_le64(hashes + 8 * i))
            if e == CK_NIL or now - self.entries[e].last_used > self.prefix_ttl:
                break
            mask = self.masks + e * self.stride
            if i == 0:
                groups = self.entries[e].summary
                while groups:
                    w = ck_ctz64(groups) * self.group
                    groups &= groups - 1
                    end = min(w + self.group, <int>self.stride)
                    while w < end:
                        kept = self.eligible[w] & mask[w]
                        if kept:
                            running[w] = kept
                            self.matched[w] = kept
                            self.matched_words[n_words] = w
                            n_words += 1
                        w += 1
                self.n_matched_words = n_words
                if not n_words:
                    return 0
            else:
                alive = 0
                for k in range(n_words):
                    w = self.matched_words[k]
                    kept = running[w] & mask[w]
                    dropped = running[w] ^ kept
                    running[w] = kept
                    alive |= kept
                    while dropped:
                        self.depth[(w << 6) + ck_ctz64(dropped)] = d
                        dropped &= dropped - 1
                if not alive:
                    return d
            d += 1
        for k in range(n_words):
            w = self.matched_words[k]
            kept = running[w]
            while kept:
                self.depth[(w << 6) + ck_ctz64(kept)] = d
                kept &= kept - 1
        return d

    cdef void _record(self, const uint8_t* hashes, size_t n_hashes, int rank,
                      double now) noexcept nogil:
        cdef size_t i, word = rank >> 6
        cdef uint64_t bit = (<uint64_t>1) << (rank & 63)
        cdef uint64_t group_bit = (<uint64_t>1) << (word // self.group)
        cdef uint64_t h
        cdef uint32_t e
        if self.kv != NULL and self.kv.state[rank] != CK_KV_NONE:
            return  # its events say what it holds: no guess
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
                    self.entries[e].summary = 0
                    self.entries[e].count = 0
                self._unlink(e)
            if not self.masks[e * self.stride + word] & bit:
                self.entries[e].count += 1
            self.masks[e * self.stride + word] |= bit
            self.entries[e].summary |= group_bit
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
        self.entries[e].summary = 0
        self.entries[e].count = 0
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

    cdef void _widen(self, size_t stride) noexcept nogil:
        """Masks of ``stride`` words, for a rank beyond the present ones: each entry's
        mask moves to its wider place, the last first so that none is overwritten
        before it moved. When that changes the summary's grouping, every live
        entry's summary is recomputed."""
        cdef uint32_t e = self.n_used
        cdef size_t old = self.stride, w
        cdef int group = <int>((stride + 63) >> 6)
        cdef uint64_t* mask
        while e > 0:
            e -= 1
            memmove(self.masks + e * stride, self.masks + e * old, old * sizeof(uint64_t))
            memset(self.masks + e * stride + old, 0, (stride - old) * sizeof(uint64_t))
        self.stride = stride
        if group == self.group:
            return
        self.group = group
        e = self.lru_oldest
        while e != CK_NIL:
            mask = self.masks + e * stride
            self.entries[e].summary = 0
            for w in range(stride):
                if mask[w]:
                    self.entries[e].summary |= (<uint64_t>1) << (w // group)
            e = self.entries[e].newer
