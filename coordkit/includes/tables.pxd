# cython: language_level=3
"""Declarations of tables.h: the loop's peer and request tables, the router's prefix table."""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef extern from "includes/tables.h" nogil:
    uint64_t CK_GOLDEN
    uint32_t CK_NIL

    # -- the shared scheme: open addressing over uint32 cells holding an index + 1

    ctypedef uint64_t (*ck_home_fn)(const void* table, uint32_t cell) noexcept nogil

    uint64_t ck_cells_for(uint64_t entries)
    uint64_t ck_cells_vacant(const uint32_t* cells, uint64_t mask, uint64_t home)
    void ck_cells_remove(uint32_t* cells, uint64_t mask, uint64_t pos, ck_home_fn home,
                         const void* table)
    uint64_t ck_mix64(uint64_t x)

    # -- ck_ids: a peer's routing id -> its index

    ctypedef struct ck_ids:
        pass

    int ck_ids_init(ck_ids* t, uint32_t capacity)
    void ck_ids_free(ck_ids* t)
    int32_t ck_ids_find(const ck_ids* t, const uint8_t* id, size_t n)
    void ck_ids_insert(ck_ids* t, int32_t index, const uint8_t* id, size_t n)
    void ck_ids_remove(ck_ids* t, int32_t index)
    const uint8_t* ck_ids_get(const ck_ids* t, int32_t index, size_t* n)

    # -- ck_requests: the requests in flight, by server id and by (client, client rid)

    ctypedef struct ck_request:
        int64_t server_rid
        int64_t client_rid
        void* kept
        uint32_t client
        uint32_t flags
        int32_t rank

    ctypedef struct ck_requests:
        ck_request* pool
        uint32_t used
        uint32_t live
        uint64_t next_rid

    int ck_requests_init(
        ck_requests* t, uint32_t capacity, uint64_t index_size, uint64_t window_min,
        int64_t first_rid,
    )
    void ck_requests_free(ck_requests* t)
    int64_t ck_requests_find(const ck_requests* t, int64_t server_rid)
    int64_t ck_requests_find_client(const ck_requests* t, uint32_t client, int64_t client_rid)
    uint32_t ck_requests_add(ck_requests* t, uint32_t client, int64_t client_rid)
    uint32_t ck_requests_adopt(
        ck_requests* t, uint32_t client, int64_t client_rid, int64_t server_rid
    )
    void ck_requests_remove(ck_requests* t, uint32_t slot)

    # -- ck_prefix: the router's block hash -> prefix entry

    ctypedef struct ck_prefix_entry:
        uint64_t hash
        double last_used
        uint32_t older  # LRU neighbours, CK_NIL at the ends; older links the free list
        uint32_t newer
        uint64_t summary  # bit b: a rank in the b-th group of its mask's words
        uint32_t count  # the ranks in its mask

    ctypedef struct ck_prefix:
        uint32_t* cells

    int ck_prefix_init(ck_prefix* t, ck_prefix_entry* entries, uint32_t max_entries)
    uint32_t ck_prefix_find(const ck_prefix* t, uint64_t hash)
    void ck_prefix_insert(ck_prefix* t, uint32_t e)
    void ck_prefix_remove(ck_prefix* t, uint32_t e)
