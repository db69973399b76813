/* coordkit's C tables, for the Cython loop core and router.
 *
 * Three hash tables share one scheme: open addressing with linear probing
 * over uint32 cells that hold an entry's index + 1 (0 is an empty cell), at
 * most half full, and one deletion routine (ck_cells_remove) that shifts the
 * rest of a probe run back instead of leaving tombstones, so lookups never
 * walk dead cells. Each table only says where an entry's home cell is.
 *
 *   ck_ids       a peer's ZeroMQ routing id -> its index (clients, engines)
 *   ck_requests  the requests in flight: a pool of slots reused most recently
 *                freed first (a small working set), found by server id through
 *                a direct-mapped index (and, for the few adopted from an
 *                earlier life whose position was held, a hashed side table)
 *                and by (client, client rid) by hashing
 *   ck_prefix    the router's block hash -> prefix entry
 *
 * Nothing here allocates after init, and nothing needs the GIL.
 */
#ifndef COORDKIT_TABLES_H
#define COORDKIT_TABLES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CK_GOLDEN 0x9E3779B97F4A7C15ULL /* 2**64 / phi: splitmix64, Fibonacci hashing */

/* ---- the shared scheme ----------------------------------------------------- */

typedef uint64_t (*ck_home_fn)(const void *table, uint32_t cell);

/* Cells for `entries` entries at load factor <= 1/2: a power of two. */
static inline uint64_t ck_cells_for(uint64_t entries)
{
    uint64_t n = 2;
    while (n < 2 * entries)
        n <<= 1;
    return n;
}

/* The first empty cell from `home` on (there is one: the table is half empty). */
static inline uint64_t ck_cells_vacant(const uint32_t *cells, uint64_t mask, uint64_t home)
{
    while (cells[home] != 0)
        home = (home + 1) & mask;
    return home;
}

/* Empty the cell at `pos`: each later cell of its probe run moves back into
 * the hole unless its home lies cyclically after the hole. */
static inline void ck_cells_remove(uint32_t *cells, uint64_t mask, uint64_t pos,
                                   ck_home_fn home, const void *table)
{
    uint64_t hole = pos, j = pos;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t cell = cells[j];
        if (cell == 0)
            break;
        if (((j - home(table, cell)) & mask) >= ((j - hole) & mask)) {
            cells[hole] = cell;
            hole = j;
        }
    }
    cells[hole] = 0;
}

static inline uint64_t ck_mix64(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* ---- ck_ids: routing id -> index -------------------------------------------- */

/* A ZeroMQ routing id is at most 255 bytes: stored as its length, then its bytes. */
#define CK_ID_STRIDE 256

typedef struct {
    uint8_t *ids; /* CK_ID_STRIDE bytes per index */
    uint32_t *cells;
    uint64_t mask;
} ck_ids;

static inline uint64_t ck_ids_hash(const uint8_t *data, size_t n) /* FNV-1a */
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ data[i]) * 16777619u;
    return h;
}

static inline const uint8_t *ck_ids_get(const ck_ids *t, int32_t index, size_t *n)
{
    const uint8_t *stored = t->ids + (size_t)index * CK_ID_STRIDE;
    *n = stored[0];
    return stored + 1;
}

static inline uint64_t ck_ids_home(const void *table, uint32_t cell)
{
    const ck_ids *t = (const ck_ids *)table;
    size_t n;
    const uint8_t *id = ck_ids_get(t, (int32_t)cell - 1, &n);
    return ck_ids_hash(id, n) & t->mask;
}

static inline int ck_ids_init(ck_ids *t, uint32_t capacity)
{
    uint64_t n_cells = ck_cells_for(capacity);
    t->ids = (uint8_t *)calloc(capacity, CK_ID_STRIDE);
    t->cells = (uint32_t *)calloc(n_cells, sizeof(uint32_t));
    t->mask = n_cells - 1;
    return t->ids != NULL && t->cells != NULL ? 0 : -1;
}

static inline void ck_ids_free(ck_ids *t)
{
    free(t->ids);
    free(t->cells);
    t->ids = NULL;
    t->cells = NULL;
}

/* The index of routing id `id`, or -1. */
static inline int32_t ck_ids_find(const ck_ids *t, const uint8_t *id, size_t n)
{
    uint64_t pos = ck_ids_hash(id, n) & t->mask;
    for (;;) {
        uint32_t cell = t->cells[pos];
        if (cell == 0)
            return -1;
        size_t stored_n;
        const uint8_t *stored = ck_ids_get(t, (int32_t)cell - 1, &stored_n);
        if (stored_n == n && memcmp(stored, id, n) == 0)
            return (int32_t)cell - 1;
        pos = (pos + 1) & t->mask;
    }
}

/* Give `index` the routing id `id` (n <= 255); the index must be unused. */
static inline void ck_ids_insert(ck_ids *t, int32_t index, const uint8_t *id, size_t n)
{
    uint8_t *stored = t->ids + (size_t)index * CK_ID_STRIDE;
    stored[0] = (uint8_t)n;
    memcpy(stored + 1, id, n);
    t->cells[ck_cells_vacant(t->cells, t->mask, ck_ids_hash(id, n) & t->mask)] = (uint32_t)index + 1;
}

static inline void ck_ids_remove(ck_ids *t, int32_t index)
{
    uint64_t pos = ck_ids_home(t, (uint32_t)index + 1);
    while (t->cells[pos] != (uint32_t)index + 1)
        pos = (pos + 1) & t->mask;
    ck_cells_remove(t->cells, t->mask, pos, ck_ids_home, t);
}

/* ---- ck_requests: the requests in flight ------------------------------------ */

typedef struct {
    int64_t server_rid; /* -1 while the slot is free */
    int64_t client_rid; /* while free: the next free slot */
    void *kept;         /* what re-sends the request if its engine dies, or NULL */
    uint32_t client : 24; /* a client index (max_clients <= 2**24) */
    uint32_t flags : 8;   /* RequestFlag bits */
    int32_t rank;         /* -1 while it is being re-sent or failed */
} ck_request;

typedef struct {
    ck_request *pool;  /* `capacity` slots; those below `used` have been handed out */
    uint32_t capacity, used, live;
    uint32_t free_head; /* the most recently freed slot, or UINT32_MAX */
    /* server_rid & index_mask -> slot + 1. Server ids advance by one, skipping an
     * id whose position is held, so a request is found without hashing. While
     * few requests are in flight, ids are drawn only at positions below `window`
     * (a power of two, at least twice the requests in flight): the id jumps to
     * the index's next lap instead of walking on, so the index's working set
     * stays small however many requests pass. */
    uint32_t *index;
    uint64_t index_mask;
    uint64_t window, window_min;
    uint64_t next_rid;
    uint32_t *by_client; /* (client, client_rid) -> slot + 1, hashed */
    uint64_t by_client_mask;
    /* Requests adopted after a coordinator's loss keep the server ids an earlier
     * life gave them; one whose index position is held by another is filed here
     * instead (server_rid -> slot + 1, hashed), consulted only when the index
     * misses and only while there is one. */
    uint32_t *adopted;
    uint32_t n_adopted;
} ck_requests;

/* A client's ids in runs of 2**CK_RUN_BITS: a run hashed to a random block of cells,
 * its ids on every other cell of it. A client numbers its requests in order, so the
 * cells of the requests in flight share a few cache lines instead of each costing a
 * miss in a table sized for max_inflight; the cell between two ids keeps them from
 * forming a cluster that every removal would walk (ck_cells_remove); the ids' high
 * bits still spread. */
#define CK_RUN_BITS 6
static inline uint64_t ck_requests_client_hash(const ck_requests *t, uint32_t client, int64_t rid)
{
    uint64_t run = ck_mix64(((uint64_t)rid >> CK_RUN_BITS) * CK_GOLDEN ^ client);
    uint64_t within = (uint64_t)rid & ((1u << CK_RUN_BITS) - 1);
    return (run << (CK_RUN_BITS + 1) | within << 1) & t->by_client_mask;
}

static inline uint64_t ck_requests_client_home(const void *table, uint32_t cell)
{
    const ck_requests *t = (const ck_requests *)table;
    const ck_request *r = &t->pool[cell - 1];
    return ck_requests_client_hash(t, r->client, r->client_rid);
}

/* Room for `capacity` requests; `index_size` is a power of two >= capacity, and
 * `window_min` the smallest window (a power of two). calloc: pages of the pool
 * and index that are never reached cost no memory. */
static inline uint64_t ck_requests_adopted_hash(const ck_requests *t, int64_t server_rid)
{
    return ck_mix64((uint64_t)server_rid) & t->by_client_mask; /* as many cells as by_client */
}

static inline uint64_t ck_requests_adopted_home(const void *table, uint32_t cell)
{
    const ck_requests *t = (const ck_requests *)table;
    return ck_requests_adopted_hash(t, t->pool[cell - 1].server_rid);
}

/* Room for `capacity` requests; `index_size` is a power of two >= capacity, and
 * `window_min` the smallest window (a power of two); server ids start at
 * `first_rid`. calloc: pages of the pool and index that are never reached cost
 * no memory. */
static inline int ck_requests_init(ck_requests *t, uint32_t capacity, uint64_t index_size,
                                   uint64_t window_min, int64_t first_rid)
{
    uint64_t n_cells = ck_cells_for(capacity);
    t->pool = (ck_request *)calloc(capacity, sizeof(ck_request));
    t->index = (uint32_t *)calloc(index_size, sizeof(uint32_t));
    t->by_client = (uint32_t *)calloc(n_cells, sizeof(uint32_t));
    t->adopted = (uint32_t *)calloc(n_cells, sizeof(uint32_t));
    t->capacity = capacity;
    t->used = t->live = t->n_adopted = 0;
    t->free_head = UINT32_MAX;
    t->index_mask = index_size - 1;
    t->window_min = index_size < window_min ? index_size : window_min;
    t->window = t->window_min;
    t->next_rid = (uint64_t)first_rid;
    t->by_client_mask = n_cells - 1;
    return t->pool != NULL && t->index != NULL && t->by_client != NULL && t->adopted != NULL
               ? 0
               : -1;
}

static inline void ck_requests_free(ck_requests *t)
{
    free(t->pool);
    free(t->index);
    free(t->by_client);
    free(t->adopted);
    t->pool = NULL;
    t->index = NULL;
    t->by_client = NULL;
    t->adopted = NULL;
}

/* An adopted request whose index position was held, by server id: its slot, or -1. */
static inline int64_t ck_requests_find_adopted(const ck_requests *t, int64_t server_rid)
{
    uint64_t pos = ck_requests_adopted_hash(t, server_rid);
    for (;;) {
        uint32_t cell = t->adopted[pos];
        if (cell == 0)
            return -1;
        if (t->pool[cell - 1].server_rid == server_rid)
            return (int64_t)cell - 1;
        pos = (pos + 1) & t->by_client_mask;
    }
}

/* The slot of the request in flight with this server id, or -1. */
static inline int64_t ck_requests_find(const ck_requests *t, int64_t server_rid)
{
    if (server_rid < 0)
        return -1;
    uint32_t cell = t->index[(uint64_t)server_rid & t->index_mask];
    if (cell != 0 && t->pool[cell - 1].server_rid == server_rid)
        return (int64_t)cell - 1;
    return t->n_adopted ? ck_requests_find_adopted(t, server_rid) : -1;
}

/* The slot of this client's request `client_rid` in flight, or -1. */
static inline int64_t ck_requests_find_client(const ck_requests *t, uint32_t client,
                                              int64_t client_rid)
{
    uint64_t pos = ck_requests_client_hash(t, client, client_rid);
    for (;;) {
        uint32_t cell = t->by_client[pos];
        if (cell == 0)
            return -1;
        const ck_request *r = &t->pool[cell - 1];
        if (r->client == client && r->client_rid == client_rid)
            return (int64_t)cell - 1;
        pos = (pos + 1) & t->by_client_mask;
    }
}

/* A slot for request `server_rid` of `client` (live < capacity), filed by client,
 * with flags 0 and rank -1; the caller files it by server id. */
static inline uint32_t ck_requests_take(ck_requests *t, uint32_t client, int64_t client_rid,
                                        int64_t server_rid)
{
    uint32_t slot;
    if (t->free_head != UINT32_MAX) {
        slot = t->free_head;
        t->free_head = (uint32_t)t->pool[slot].client_rid;
    } else {
        slot = t->used++;
    }
    ck_request *r = &t->pool[slot];
    r->server_rid = server_rid;
    r->client_rid = client_rid;
    r->kept = NULL;
    r->client = client;
    r->flags = 0;
    r->rank = -1;
    uint64_t home = ck_requests_client_hash(t, client, client_rid);
    t->by_client[ck_cells_vacant(t->by_client, t->by_client_mask, home)] = slot + 1;
    t->live++;
    return slot;
}

/* A new request of `client` (live < capacity): it gets the next server id
 * whose index position is free and a slot, flags 0 and rank -1. */
static inline uint32_t ck_requests_add(ck_requests *t, uint32_t client, int64_t client_rid)
{
    uint64_t rid = t->next_rid;
    if ((rid & t->index_mask) >= t->window) { /* the window's end: a new lap */
        rid = (rid | t->index_mask) + 1;
        while (t->window > t->window_min && 4 * (uint64_t)t->live < t->window)
            t->window >>= 1;
    }
    while (2 * (uint64_t)(t->live + 1) > t->window && t->window <= t->index_mask)
        t->window <<= 1;
    while (t->index[rid & t->index_mask] != 0)
        rid++;
    t->next_rid = rid + 1;
    uint32_t slot = ck_requests_take(t, client, client_rid, (int64_t)rid);
    t->index[rid & t->index_mask] = slot + 1;
    return slot;
}

/* A request an engine holds from an earlier life of the coordinator, under the
 * server id it has (live < capacity, no request in flight has it): filed in the
 * index when its position is free, else apart. Server ids drawn later are above it. */
static inline uint32_t ck_requests_adopt(ck_requests *t, uint32_t client, int64_t client_rid,
                                         int64_t server_rid)
{
    uint32_t slot = ck_requests_take(t, client, client_rid, server_rid);
    uint32_t *cell = &t->index[(uint64_t)server_rid & t->index_mask];
    if (*cell == 0) {
        *cell = slot + 1;
    } else {
        uint64_t home = ck_requests_adopted_hash(t, server_rid);
        t->adopted[ck_cells_vacant(t->adopted, t->by_client_mask, home)] = slot + 1;
        t->n_adopted++;
    }
    if ((uint64_t)server_rid >= t->next_rid)
        t->next_rid = (uint64_t)server_rid + 1;
    return slot;
}

/* Forget the request at `slot` (its kept prompt is the caller's to release). */
static inline void ck_requests_remove(ck_requests *t, uint32_t slot)
{
    ck_request *r = &t->pool[slot];
    uint64_t pos = ck_requests_client_hash(t, r->client, r->client_rid);
    while (t->by_client[pos] != slot + 1)
        pos = (pos + 1) & t->by_client_mask;
    ck_cells_remove(t->by_client, t->by_client_mask, pos, ck_requests_client_home, t);
    uint32_t *cell = &t->index[(uint64_t)r->server_rid & t->index_mask];
    if (*cell == slot + 1) {
        *cell = 0;
    } else { /* an adopted request filed apart */
        pos = ck_requests_adopted_hash(t, r->server_rid);
        while (t->adopted[pos] != slot + 1)
            pos = (pos + 1) & t->by_client_mask;
        ck_cells_remove(t->adopted, t->by_client_mask, pos, ck_requests_adopted_home, t);
        t->n_adopted--;
    }
    r->server_rid = -1;
    r->kept = NULL;
    r->client_rid = t->free_head;
    t->free_head = slot;
    t->live--;
}

/* ---- ck_prefix: the router's block hash -> prefix entry --------------------- */

#define CK_NIL UINT32_MAX /* no entry: the ends of the LRU list and of the free list */

typedef struct {
    uint64_t hash;
    double last_used;
    uint32_t older; /* LRU neighbours, CK_NIL at the ends; older links the free list */
    uint32_t newer;
    uint64_t summary; /* bit b: a rank in the b-th group of its mask's words (the router's) */
    uint32_t count;   /* the ranks in its mask */
} ck_prefix_entry;

typedef struct {
    ck_prefix_entry *entries;
    uint32_t *cells;
    uint64_t mask;
    int shift; /* 64 - log2(cells) */
} ck_prefix;

static inline uint64_t ck_prefix_hash(const ck_prefix *t, uint64_t hash)
{
    return (hash * CK_GOLDEN) >> t->shift; /* Fibonacci: spreads small test hashes too */
}

static inline uint64_t ck_prefix_home(const void *table, uint32_t cell)
{
    const ck_prefix *t = (const ck_prefix *)table;
    return ck_prefix_hash(t, t->entries[cell - 1].hash);
}

/* Cells for `max_entries` entries (the entries themselves are the router's). */
static inline int ck_prefix_init(ck_prefix *t, ck_prefix_entry *entries, uint32_t max_entries)
{
    uint64_t n_cells = ck_cells_for(max_entries);
    t->entries = entries;
    t->cells = (uint32_t *)calloc(n_cells, sizeof(uint32_t));
    t->mask = n_cells - 1;
    t->shift = 64;
    while (n_cells > 1) {
        n_cells >>= 1;
        t->shift--;
    }
    return t->cells != NULL ? 0 : -1;
}

/* The entry of `hash`, or UINT32_MAX. */
static inline uint32_t ck_prefix_find(const ck_prefix *t, uint64_t hash)
{
    uint64_t pos = ck_prefix_hash(t, hash);
    for (;;) {
        uint32_t cell = t->cells[pos];
        if (cell == 0)
            return UINT32_MAX;
        if (t->entries[cell - 1].hash == hash)
            return cell - 1;
        pos = (pos + 1) & t->mask;
    }
}

/* File entry `e`, whose hash is set, under that hash. */
static inline void ck_prefix_insert(ck_prefix *t, uint32_t e)
{
    uint64_t home = ck_prefix_hash(t, t->entries[e].hash);
    t->cells[ck_cells_vacant(t->cells, t->mask, home)] = e + 1;
}

static inline void ck_prefix_remove(ck_prefix *t, uint32_t e)
{
    uint64_t pos = ck_prefix_hash(t, t->entries[e].hash);
    while (t->cells[pos] != e + 1)
        pos = (pos + 1) & t->mask;
    ck_cells_remove(t->cells, t->mask, pos, ck_prefix_home, t);
}

#endif
