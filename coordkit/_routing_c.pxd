# cython: language_level=3
"""The Cython router, for the loop core to call without the GIL.

``choose_c``, ``release_c``, ``accepting_c`` and ``remove_rank_c`` touch only
the C tables below, all allocated by the constructor. The rules are those of
coordkit._policies, which its twin _routing_py follows too.
"""

cimport cython
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from .includes.kvindex cimport ck_kvindex
from .includes.tables cimport ck_prefix, ck_prefix_entry


cdef struct Choice:  # a prefix decision's best rank so far, by the contract's key
    int rank  # -1: none yet
    int pos  # its place in the rotating order
    int64_t cost
    int64_t pending
    int64_t new  # the blocks it would prefill
    int64_t depth  # the blocks it has


@cython.final
cdef class Router:
    cdef:
        str _policy
        int policy_id
        int max_ranks
        int n_ranks          # 1 + the highest rank ever added
        int cursor           # rotating start, in [0, n_ranks)
        int n_members
        int64_t pending_limit  # rank_cap, or INT64_MAX without a cap: eligible below it
        int64_t* capacity    # per rank: what it declared (0: pending_limit holds)
        uint64_t rng_state   # splitmix64
        uint8_t* is_accepting
        int64_t* pending_count
        int64_t* work_units  # per rank: the work charged and not yet released
        int* members         # the accepting ranks, compact: power_of_two draws from it
        int* member_pos      # rank -> its index in members

        # The eligible ranks in the policy's order, kept as they change (see _update):
        # a tree over ``leaves`` ranks (a power of two >= n_ranks), node i over the
        # leaves below it, holding the first of them in that order (-1: none
        # eligible). Leaf r is node leaves + r; the root is node 1.
        int* ranking         # NULL when the policy never asks it (power_of_two, no cap)
        int leaves
        bint by_work         # prefix: ordered by work, then pending, then rank
        bint by_pending      # least_loaded, power_of_two: by pending, then rank
        uint64_t* eligible   # prefix: the eligible ranks as a mask, max_stride words

        # The work model (see coordkit._policies): every policy charges.
        readonly int64_t charged  # what the last choose_c charged its rank (0: none)
        int64_t new_blocks   # the blocks the chosen rank has to prefill (set by the policy)
        int64_t weight       # prefix_prefill_weight in units of 1 / WEIGHT_SCALE
        int64_t decode_blocks  # prefix_decode_tokens in blocks
        uint64_t block_size

        # The prefix policy's decisions with block hashes, their blocks, and the
        # blocks the chosen rank had cached: the metrics read them.
        uint64_t prefix_decisions
        uint64_t prefix_blocks
        uint64_t prefix_matched_blocks

        # The prefix table: allocated for the prefix policy only, NULL otherwise.
        double prefix_ttl
        uint32_t max_entries
        uint32_t n_entries
        uint32_t n_used      # pool high-water mark; below it, freed entries are on free_list
        uint32_t free_list
        uint32_t lru_oldest
        uint32_t lru_newest
        size_t stride        # mask words per entry: enough for n_ranks, doubled as it grows
        size_t max_stride    # ceil(max_ranks / 64): the words the masks have room for
        ck_prefix_entry* entries
        ck_prefix table      # hash -> entry
        uint64_t* masks      # each entry's ranks, stride words
        int group            # mask words per bit of an entry's summary: ceil(stride / 64)
        uint64_t* running    # scratch: candidate ranks along the chain
        uint64_t* matched    # scratch: the ranks of the chain's first entry (depth > 0)
        int* matched_words   # scratch: the words of matched that are not 0, n_matched_words
        int n_matched_words
        int* depth           # scratch: matched depth per rank
        uint32_t* chain      # scratch: the live entries leading a request's chain
        int* hidden          # scratch: the ranks a walk took out of the ranking
        # The engines' own events (loop/kvindex.pyx's index), NULL when none publish:
        # the ranks it knows are priced by it, and the table never lists a publisher.
        ck_kvindex* kv
        object kv_owner  # what holds kv's tables (the loop's KVIndex): alive while read

    cdef int choose_c(self, const uint8_t* hashes, size_t n_hashes, uint64_t prompt_tokens,
                      double now) noexcept nogil
    cdef void release_c(self, int rank, int64_t work) noexcept nogil
    cdef bint accepting_c(self, int rank) noexcept nogil
    cdef void remove_rank_c(self, int rank) noexcept nogil
    cdef void forget_c(self, int rank) noexcept nogil
    cdef void attach_kv_c(self, ck_kvindex* kv) noexcept nogil

    # Internals (a cdef class declared in a .pxd declares all its C methods here).
    cdef bint _eligible(self, int rank) noexcept nogil
    cdef void _update(self, int rank) noexcept nogil
    cdef void _set_leaf(self, int rank, bint ok) noexcept nogil
    cdef void _build(self, int leaves) noexcept nogil
    cdef bint has_room_c(self) noexcept nogil
    cdef _ranked(self)
    cdef bint _ahead(self, int a, int b) noexcept nogil
    cdef int _first(self, int a, int b) noexcept nogil
    cdef int _first_from(self, int start) noexcept nogil
    cdef int _round_robin(self) noexcept nogil
    cdef int _least_loaded(self) noexcept nogil
    cdef uint64_t _rand(self) noexcept nogil
    cdef int _power_of_two(self) noexcept nogil
    cdef int _prefix(self, const uint8_t* hashes, size_t n_hashes, double now) noexcept nogil
    cdef void _consider(self, Choice* best, int rank, int64_t depth, int start,
                        int64_t size) noexcept nogil
    cdef int _chain_of(self, const uint8_t* hashes, size_t n_hashes, double now) noexcept nogil
    cdef int _depth_along(self, int rank, int d, int length) noexcept nogil
    cdef bint _affine(self, int start, int length, int64_t size, Choice* best) noexcept nogil
    cdef void _scan(self, const uint8_t* hashes, size_t n_hashes, double now, int start,
                    int64_t size, Choice* best) noexcept nogil
    cdef int _match(self, const uint8_t* hashes, size_t n_hashes, double now) noexcept nogil
    cdef void _count_prefix(self, size_t n_hashes, int64_t matched) noexcept nogil
    cdef void _record(self, const uint8_t* hashes, size_t n_hashes, int rank,
                      double now) noexcept nogil
    cdef uint32_t _insert(self, uint64_t h) noexcept nogil
    cdef void _delete(self, uint32_t e) noexcept nogil
    cdef void _unlink(self, uint32_t e) noexcept nogil
    cdef void _append(self, uint32_t e) noexcept nogil
    cdef void _widen(self, size_t stride) noexcept nogil
