"""The thread's half of the KV-event index (included by _codec_c.pyx after kvevents.pyx,
whose records it takes): KVChains chains the stored blocks' hashes, so that the loop
only counts them."""

from libc.stdlib cimport calloc
from libc.string cimport memcpy

from .includes.blake2b cimport (
    ck_blake2b_final,
    ck_blake2b_init,
    ck_blake2b_state,
    ck_blake2b_update,
)
from .includes.kvindex cimport (
    ck_kvcell,
    ck_kvmap,
    ck_kvmap_clear,
    ck_kvmap_delete,
    ck_kvmap_find,
    ck_kvmap_vacant,
)


cdef inline uint32_t _kv_u32(const uint8_t* p) noexcept nogil:
    return p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


@cython.final
cdef class KVChains:
    """The thread's half of the index (coordkit._kvevents.Chains, its twin): each
    engine's keys, to coordkit's chained hash and the times stored, kept by the records
    handed in the order they are handed, so that the thread chains the hashes (without
    the GIL) and the loop only counts them."""

    cdef ck_kvmap* keys  # per rank
    cdef uint32_t max_ranks
    cdef readonly uint64_t unresolved

    def __cinit__(self, int max_ranks):
        self.max_ranks = max(max_ranks, 0)
        self.keys = <ck_kvmap*>calloc(max(self.max_ranks, 1), sizeof(ck_kvmap))
        if self.keys == NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef uint32_t rank
        if self.keys != NULL:
            for rank in range(self.max_ranks):
                ck_kvmap_clear(&self.keys[rank])
            free(self.keys)

    def hand(self, bytes record not None):
        """What the loop gets for ``record``: a STORE's HASHED (None: its parent is
        unknown, or it is malformed), any other record as it is."""
        cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(record)
        cdef size_t n = <size_t>PyBytes_GET_SIZE(record)
        cdef uint32_t rank, count, size
        cdef bytes out
        cdef uint8_t* into
        cdef bint resolved
        if n < _CLEAR_SIZE:
            return record
        rank = _kv_u32(p + 1)
        if rank >= self.max_ranks:
            return record
        if p[0] == _OP_CLEAR:
            ck_kvmap_clear(&self.keys[rank])
        elif p[0] == _OP_REMOVE and n >= _REMOVE_HEAD:
            count = _kv_u32(p + 5)
            if n == _REMOVE_HEAD + 8 * <size_t>count:
                self._remove(&self.keys[rank], p + _REMOVE_HEAD, count)
        elif p[0] == _OP_STORE and n >= _STORE_HEAD:
            count, size = _kv_u32(p + 14), _kv_u32(p + 18)
            if n != _STORE_HEAD + (8 + 4 * <size_t>size) * count:
                return None
            out = PyBytes_FromStringAndSize(NULL, _REMOVE_HEAD + 16 * <size_t>count)
            into = <uint8_t*>PyBytes_AS_STRING(out)
            with nogil:
                resolved = self._store(&self.keys[rank], p, count, size, into)
            if not resolved:
                self.unresolved += 1
                return None
            return out
        return record

    cdef void _remove(self, ck_kvmap* keys, const uint8_t* removed,
                      uint32_t count) noexcept nogil:
        cdef uint32_t i
        cdef ck_kvcell* cell
        for i in range(count):
            cell = ck_kvmap_find(keys, ck_load_le64(removed + 8 * <size_t>i))
            if cell != NULL:
                cell.count -= 1
                if cell.count == 0:
                    ck_kvmap_delete(keys, cell)

    cdef bint _store(self, ck_kvmap* keys, const uint8_t* record, uint32_t count,
                     uint32_t size, uint8_t* out) noexcept nogil:
        """A STORE's HASHED into ``out`` (its head copied from the record's); False when
        its parent is unknown."""
        cdef const uint8_t* stored = record + _STORE_HEAD
        cdef const uint8_t* tokens = stored + 8 * <size_t>count
        cdef uint8_t* hashes = out + _REMOVE_HEAD + 8 * <size_t>count
        cdef uint64_t prev = 0, key
        cdef uint8_t digest[8]
        cdef ck_blake2b_state state
        cdef ck_kvcell* cell
        cdef uint32_t i
        if record[5]:  # its parent: a block the engine's events named
            cell = ck_kvmap_find(keys, ck_load_le64(record + 6))
            if cell == NULL:
                return False
            prev = cell.value
        out[0] = _OP_HASHED
        memcpy(out + 1, record + 1, 4)  # the rank
        _kv_le32(out + 5, count)
        memcpy(out + _REMOVE_HEAD, stored, 8 * <size_t>count)
        for i in range(count):
            ck_blake2b_init(&state, 8)
            ck_store_le64(digest, prev)
            ck_blake2b_update(&state, digest, 8)
            ck_blake2b_update(&state, tokens + 4 * <size_t>size * i, 4 * <size_t>size)
            ck_blake2b_final(&state, digest)
            prev = ck_load_le64(digest)
            ck_store_le64(hashes + 8 * <size_t>i, prev)
            key = ck_load_le64(stored + 8 * <size_t>i)
            cell = ck_kvmap_find(keys, key)
            if cell != NULL:
                cell.count += 1  # the same key stored again: removed as often
                continue
            cell = ck_kvmap_vacant(keys, key)
            if cell != NULL:  # (memory short: not kept, a store on it is unresolved)
                cell.value = prev
                cell.count = 1
        return True
