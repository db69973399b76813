/* The cursors of a ring one thread fills and another empties, without a lock.
 *
 * The producer (the loop's thread, no GIL) writes an entry at `head`, then
 * publishes it by storing head + 1 with release order; the consumer (another
 * thread) loads `head` with acquire order, so every entry below it is written,
 * reads them, and gives their room back by storing `tail` with release order,
 * which the producer loads with acquire order before it writes over them. Each
 * cursor has one writer; they sit on cache lines of their own, so that the two
 * threads do not share one. `dropped` counts what the producer could not put in
 * (its own writes, read relaxed by the consumer).
 *
 * The ring's entries are the caller's: an array of a power of two of them,
 * indexed by a cursor & (size - 1).
 */
#ifndef COORDKIT_RING_H
#define COORDKIT_RING_H

#include <stdint.h>

typedef struct {
    uint64_t head; /* the producer's: entries below it are written */
    uint64_t dropped;
    char apart[48];
    uint64_t tail; /* the consumer's: entries below it are read */
} ck_ring;

/* The producer: whether an entry may be written at `head` (the ring holds `size`). */
static inline int ck_ring_room(ck_ring *r, uint64_t size)
{
    return r->head - __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE) < size;
}

/* The producer: the entry at `head` is written. */
static inline void ck_ring_push(ck_ring *r)
{
    __atomic_store_n(&r->head, r->head + 1, __ATOMIC_RELEASE);
}

/* The producer: one entry it could not put in. */
static inline void ck_ring_drop(ck_ring *r)
{
    __atomic_store_n(&r->dropped, r->dropped + 1, __ATOMIC_RELAXED);
}

/* The consumer: the head, every entry below it written. */
static inline uint64_t ck_ring_filled(ck_ring *r)
{
    return __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
}

/* The consumer: the entries below `tail` are read, their room free again. */
static inline void ck_ring_taken(ck_ring *r, uint64_t tail)
{
    __atomic_store_n(&r->tail, tail, __ATOMIC_RELEASE);
}

/* Either: how many the producer dropped so far. */
static inline uint64_t ck_ring_dropped(ck_ring *r)
{
    return __atomic_load_n(&r->dropped, __ATOMIC_RELAXED);
}

#endif
