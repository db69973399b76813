/* kvindex.h: the prefix index built from the engines' own KV-cache events.
 *
 * Per engine rank two maps from a u64 to a (u64, count) cell, open addressing
 * with linear probing at most half full, grown by doubling, deleted by shifting
 * the rest of a probe run back (no tombstones; a count of 0 is an empty cell):
 *
 *   blocks  coordkit's chained block hash -> the engine keys naming it
 *   keys    an engine's own block hash (a key) -> its block hash, times stored
 *
 * and each rank's state (none, unknown, known), with the known ranks listed in
 * ascending order: what the prefix policy reads (ck_kvindex_depth), without the
 * GIL and without a Python object. loop/kvindex.pyx applies the events to it;
 * the rules are coordkit/_loop_py/kvindex.py's. The events' thread keeps a keys
 * map of its own by the same rules (_codec_c.KVChains), to chain the hashes.
 *
 * Two threads share it: the events' thread writes the maps, the loop's thread
 * writes the states and reads both. The maps are read and written under `lock`
 * (held for a bounded number of blocks at a time, CK_KV_LOCK_BLOCKS); the states
 * and the known list are the loop's alone.
 */
#ifndef COORDKIT_KVINDEX_H
#define COORDKIT_KVINDEX_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sysdep.h"
#include "tables.h"

#define CK_KV_NONE 0
#define CK_KV_UNKNOWN 1
#define CK_KV_KNOWN 2
#define CK_KV_MIN_CELLS 16
/* The blocks a writer counts in one hold of the lock: some 10 us, so that a
 * routing decision waiting for it spins rather than sleeps. */
#define CK_KV_LOCK_BLOCKS 128

typedef struct {
    uint64_t key;
    uint64_t value;
    uint64_t count; /* 0: an empty cell */
} ck_kvcell;

typedef struct {
    ck_kvcell *cells; /* NULL until the first insert */
    uint64_t mask;    /* cells - 1 */
    uint64_t used;
} ck_kvmap;

typedef struct {
    int max_ranks;
    ck_kvmap *blocks;  /* per rank */
    ck_kvmap *keys;    /* per rank */
    uint8_t *state;    /* per rank: CK_KV_* */
    int *known;        /* the ranks whose state is CK_KV_KNOWN, ascending */
    int n_known;
    uint64_t applied; /* records applied */
    pthread_mutex_t lock; /* the maps' (see above) */
} ck_kvindex;

static inline ck_kvcell *ck_kvmap_find(const ck_kvmap *m, uint64_t key)
{
    if (m->cells == NULL)
        return NULL;
    for (uint64_t i = ck_mix64(key) & m->mask;; i = (i + 1) & m->mask) {
        ck_kvcell *c = &m->cells[i];
        if (c->count == 0)
            return NULL;
        if (c->key == key)
            return c;
    }
}

/* The vacant cell where `key` (absent) goes, growing the map first when half
 * full; NULL when memory is short. The caller sets its count above 0. */
static inline ck_kvcell *ck_kvmap_vacant(ck_kvmap *m, uint64_t key)
{
    if (m->cells == NULL || 2 * (m->used + 1) > m->mask + 1) {
        uint64_t n = m->cells == NULL ? CK_KV_MIN_CELLS : 2 * (m->mask + 1);
        ck_kvcell *cells = (ck_kvcell *)calloc(n, sizeof(ck_kvcell));
        if (cells == NULL)
            return NULL;
        if (m->cells != NULL) {
            for (uint64_t j = 0; j <= m->mask; j++) {
                if (m->cells[j].count == 0)
                    continue;
                uint64_t i = ck_mix64(m->cells[j].key) & (n - 1);
                while (cells[i].count != 0)
                    i = (i + 1) & (n - 1);
                cells[i] = m->cells[j];
            }
            free(m->cells);
        }
        m->cells = cells;
        m->mask = n - 1;
    }
    uint64_t i = ck_mix64(key) & m->mask;
    while (m->cells[i].count != 0)
        i = (i + 1) & m->mask;
    m->used++;
    m->cells[i].key = key;
    return &m->cells[i];
}

/* Empty `c`: each later cell of its probe run moves back into the hole unless
 * its home lies cyclically after the hole. */
static inline void ck_kvmap_delete(ck_kvmap *m, ck_kvcell *c)
{
    uint64_t hole = (uint64_t)(c - m->cells), j = hole;
    for (;;) {
        j = (j + 1) & m->mask;
        if (m->cells[j].count == 0)
            break;
        uint64_t home = ck_mix64(m->cells[j].key) & m->mask;
        if (((j - home) & m->mask) >= ((j - hole) & m->mask)) {
            m->cells[hole] = m->cells[j];
            hole = j;
        }
    }
    m->cells[hole].count = 0;
    m->used--;
}

static inline void ck_kvmap_clear(ck_kvmap *m)
{
    free(m->cells);
    m->cells = NULL;
    m->mask = 0;
    m->used = 0;
}

static inline int ck_kvindex_init(ck_kvindex *t, int max_ranks)
{
    memset(t, 0, sizeof(*t));
    t->max_ranks = max_ranks;
    t->blocks = (ck_kvmap *)calloc((size_t)max_ranks, sizeof(ck_kvmap));
    t->keys = (ck_kvmap *)calloc((size_t)max_ranks, sizeof(ck_kvmap));
    t->state = (uint8_t *)calloc((size_t)max_ranks, 1);
    t->known = (int *)calloc((size_t)max_ranks, sizeof(int));
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
#ifdef PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP
    /* glibc's adaptive mutex spins a while before it sleeps: holds are short. */
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
#endif
    pthread_mutex_init(&t->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    return t->blocks && t->keys && t->state && t->known ? 0 : -1;
}

static inline void ck_kvindex_lock(ck_kvindex *t)
{
    pthread_mutex_lock(&t->lock);
}

static inline void ck_kvindex_unlock(ck_kvindex *t)
{
    pthread_mutex_unlock(&t->lock);
}

static inline void ck_kvindex_free(ck_kvindex *t)
{
    if (t->blocks != NULL && t->keys != NULL) {
        for (int r = 0; r < t->max_ranks; r++) {
            ck_kvmap_clear(&t->blocks[r]);
            ck_kvmap_clear(&t->keys[r]);
        }
    }
    free(t->blocks);
    free(t->keys);
    free(t->state);
    free(t->known);
    pthread_mutex_destroy(&t->lock);
    memset(t, 0, sizeof(*t));
}

/* The leading blocks of the chain `hashes` (n little-endian u64s) that `rank`
 * holds according to its events: O(n). Under the lock. */
static inline int64_t ck_kvindex_depth(const ck_kvindex *t, int rank, const uint8_t *hashes,
                                       size_t n)
{
    const ck_kvmap *m = &t->blocks[rank];
    size_t d = 0;
    if (m->used == 0)
        return 0;
    while (d < n && ck_kvmap_find(m, ck_load_le64(hashes + 8 * d)) != NULL)
        d++;
    return (int64_t)d;
}

#endif
