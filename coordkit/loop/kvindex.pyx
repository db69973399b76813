# The prefix index from the engines' own KV-cache events (loop/kvindex.pxd). Included
# by _loop_c.pyx. The rules are coordkit/_loop_py/kvindex.py's, its twin.

from .includes.kvindex cimport (
    CK_KV_KNOWN,
    CK_KV_LOCK_BLOCKS,
    CK_KV_NONE,
    ck_kvcell,
    ck_kvindex_depth,
    ck_kvindex_free,
    ck_kvindex_init,
    ck_kvindex_lock,
    ck_kvindex_unlock,
    ck_kvmap,
    ck_kvmap_clear,
    ck_kvmap_delete,
    ck_kvmap_find,
    ck_kvmap_vacant,
)
from .includes.sysdep cimport ck_load_le64

from array import array

from . import _kvevents

if (
    (_kvevents.OP_CLEAR, _kvevents.OP_REMOVE, _kvevents.OP_STATE, _kvevents.OP_HASHED)
    != (KV_CLEAR, KV_REMOVE, KV_STATE, KV_HASHED)
    or (_kvevents.HEAD.size, _kvevents.REMOVE.size, _kvevents.STATE.size, _kvevents.HASHED.size)
    != (KV_HEAD, KV_REMOVE_HEAD, KV_STATE_SIZE, KV_HASHED_HEAD)
    or (_kvevents.STATE_NONE, _kvevents.STATE_KNOWN) != (CK_KV_NONE, CK_KV_KNOWN)
):
    raise ImportError("loop/kvindex.pxd's records differ from coordkit._kvevents': rebuild")


cdef inline uint32_t kv_u32(const uint8_t* p) noexcept nogil:
    return p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline void kv_unname(ck_kvmap* blocks, uint64_t block) noexcept nogil:
    """A key no longer names ``block``: it goes with the last one."""
    cdef ck_kvcell* cell = ck_kvmap_find(blocks, block)
    if cell == NULL:
        return
    cell.count -= 1
    if cell.count == 0:
        ck_kvmap_delete(blocks, cell)


@cython.final
cdef class KVIndex:
    """Every publishing engine's blocks, from its events (coordkit._loop_py.kvindex.KVIndex).

    The events' thread counts the blocks (``apply_blocks``: CLEAR, HASHED and REMOVE
    records, the GIL released); the loop applies the STATE records (``apply``, between
    two messages: a rank that starts publishing leaves the router's table). The
    router reads ``t`` without the GIL (``ck_kvindex_depth``, under ``t.lock``).
    """

    def __cinit__(self, int max_ranks):
        if ck_kvindex_init(&self.t, max_ranks) < 0:
            ck_kvindex_free(&self.t)
            raise MemoryError()

    def __dealloc__(self):
        ck_kvindex_free(&self.t)

    def attach(self, Router router not None) -> None:
        """``router`` reads this index (``Router.attach_kv``)."""
        router.attach_kv_c(&self.t)

    @property
    def known(self) -> list:
        return [self.t.known[i] for i in range(self.t.n_known)]

    def publishes(self, int rank) -> bool:
        return 0 <= rank < self.t.max_ranks and self.t.state[rank] != CK_KV_NONE

    def depth(self, int rank, hashes) -> int:
        """The leading blocks of ``hashes`` (one LE u64 each) that ``rank`` holds."""
        cdef const uint8_t[::1] frame = hashes
        cdef int64_t d
        if not 0 <= rank < self.t.max_ranks or frame.shape[0] == 0:
            return 0
        with nogil:
            ck_kvindex_lock(&self.t)
            d = ck_kvindex_depth(&self.t, rank, &frame[0], <size_t>frame.shape[0] >> 3)
            ck_kvindex_unlock(&self.t)
        return d

    def apply(self, bytes record, Router router not None) -> None:
        """One record, on the loop's thread (any record: a STATE one only here)."""
        cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(record)
        cdef size_t n = len(record)
        with nogil:  # the lock is never waited for holding the GIL (see stats)
            if n == KV_STATE_SIZE and p[0] == KV_STATE:
                self.apply_state_c(p, router)
            else:
                self.apply_blocks_c(p, n)

    def apply_blocks(self, bytes record) -> None:
        """A CLEAR, HASHED or REMOVE record, from the events' thread, the GIL released
        (``record`` is immutable and held by the caller meanwhile)."""
        cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(record)
        cdef size_t n = len(record)
        with nogil:
            self.apply_blocks_c(p, n)

    def take(self, events, Router router not None) -> None:
        """The STATE records the events' thread has waiting, applied in order."""
        cdef bytes record
        for record in events.take():
            self.apply(record, router)

    def stats(self) -> dict:
        # The counts are copied under the lock, the GIL released, and read after: a
        # thread holding the lock never waits for the GIL, nor one holding the GIL for
        # the lock (the events' thread counts holding the lock and not the GIL).
        cdef int rank
        cdef uint64_t applied
        cdef uint64_t[::1] used = array("Q", bytes(8 * self.t.max_ranks))
        cdef uint8_t[::1] states = bytearray(self.t.max_ranks)  # each read once: the loop's
        with nogil:
            ck_kvindex_lock(&self.t)
            applied = self.t.applied
            for rank in range(self.t.max_ranks):
                used[rank] = self.t.blocks[rank].used
                states[rank] = self.t.state[rank]
            ck_kvindex_unlock(&self.t)
        names = {1: "unknown", 2: "exact"}
        return {
            "engines": {
                rank: {"state": names[states[rank]], "blocks": used[rank]}
                for rank in range(self.t.max_ranks) if states[rank] != CK_KV_NONE
            },
            "applied": applied,
        }

    cdef int _rank_of(self, const uint8_t* record, size_t n) noexcept nogil:
        """The record's rank; -1 when it is too short or names no rank of the index."""
        cdef int rank
        if n < KV_HEAD:
            return -1
        rank = <int>kv_u32(record + 1)
        return rank if 0 <= rank < self.t.max_ranks else -1

    cdef void apply_state_c(self, const uint8_t* record, Router router) noexcept nogil:
        """A STATE record (KV_STATE_SIZE bytes), on the loop's thread."""
        cdef int rank = self._rank_of(record, KV_STATE_SIZE)
        if rank < 0:
            return
        ck_kvindex_lock(&self.t)
        self.t.applied += 1
        ck_kvindex_unlock(&self.t)
        if record[5] <= CK_KV_KNOWN:
            self._set_state(rank, record[5], router)

    cdef void apply_blocks_c(self, const uint8_t* record, size_t n) noexcept nogil:
        """Any other record, under the lock; a malformed one is ignored (the events'
        thread made them)."""
        cdef int rank = self._rank_of(record, n)
        if rank < 0:
            return
        ck_kvindex_lock(&self.t)
        self.t.applied += 1
        if record[0] == KV_CLEAR:
            ck_kvmap_clear(&self.t.blocks[rank])
            ck_kvmap_clear(&self.t.keys[rank])
        elif record[0] == KV_HASHED and n >= KV_HASHED_HEAD:
            self._hashed(rank, record, n)
        elif record[0] == KV_REMOVE and n >= KV_REMOVE_HEAD:
            self._remove(rank, record, n)
        ck_kvindex_unlock(&self.t)

    cdef inline void _pause(self, uint32_t i) noexcept nogil:
        """Every CK_KV_LOCK_BLOCKS blocks of a long record the lock is let go once, so
        that a routing decision waits no longer than that."""
        if i and i % CK_KV_LOCK_BLOCKS == 0:
            ck_kvindex_unlock(&self.t)
            ck_kvindex_lock(&self.t)

    cdef void _set_state(self, int rank, int state, Router router) noexcept nogil:
        cdef int was = self.t.state[rank], i, j
        self.t.state[rank] = state
        if was == CK_KV_NONE and state != CK_KV_NONE:
            router.forget_c(rank)  # its guesses go: its events say what it holds
        if (was == CK_KV_KNOWN) == (state == CK_KV_KNOWN):
            return
        if state == CK_KV_KNOWN:  # into the list, kept ascending
            i = self.t.n_known
            while i > 0 and self.t.known[i - 1] > rank:
                self.t.known[i] = self.t.known[i - 1]
                i -= 1
            self.t.known[i] = rank
            self.t.n_known += 1
        else:
            for i in range(self.t.n_known):
                if self.t.known[i] == rank:
                    for j in range(i + 1, self.t.n_known):
                        self.t.known[j - 1] = self.t.known[j]
                    self.t.n_known -= 1
                    break

    cdef void _hashed(self, int rank, const uint8_t* record, size_t n) noexcept nogil:
        """The keys of a HASHED record and coordkit's hashes of their blocks, the
        events' thread's chaining (_codec_c.KVChains): counted. Under the lock."""
        cdef uint32_t blocks = kv_u32(record + 5), i
        cdef const uint8_t* keys = record + KV_HASHED_HEAD
        cdef const uint8_t* hashes = keys + 8 * <size_t>blocks
        cdef uint64_t block, key
        cdef ck_kvcell* cell
        if n != KV_HASHED_HEAD + 16 * <size_t>blocks:
            return
        for i in range(blocks):
            self._pause(i)
            key = ck_load_le64(keys + 8 * <size_t>i)
            block = ck_load_le64(hashes + 8 * <size_t>i)
            cell = ck_kvmap_find(&self.t.keys[rank], key)
            if cell != NULL:
                cell.count += 1  # the same key stored again: removed as often
                continue
            cell = ck_kvmap_vacant(&self.t.keys[rank], key)
            if cell == NULL:
                return  # memory short: the block is not listed (priced as uncached)
            cell.value = block
            cell.count = 1
            cell = ck_kvmap_find(&self.t.blocks[rank], block)
            if cell == NULL:
                cell = ck_kvmap_vacant(&self.t.blocks[rank], block)
                if cell == NULL:
                    ck_kvmap_delete(&self.t.keys[rank], ck_kvmap_find(&self.t.keys[rank], key))
                    return
            cell.count += 1

    cdef void _remove(self, int rank, const uint8_t* record, size_t n) noexcept nogil:
        cdef uint32_t count = kv_u32(record + 5), i
        cdef ck_kvcell* cell
        cdef uint64_t block
        if n != KV_REMOVE_HEAD + 8 * <size_t>count:
            return
        for i in range(count):
            self._pause(i)
            cell = ck_kvmap_find(&self.t.keys[rank], ck_load_le64(record + KV_REMOVE_HEAD + 8 * i))
            if cell == NULL:
                continue  # stored before its history was known, or never counted
            cell.count -= 1
            if cell.count == 0:
                block = cell.value
                ck_kvmap_delete(&self.t.keys[rank], cell)
                kv_unname(&self.t.blocks[rank], block)
