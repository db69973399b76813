/* Large outgoing frames in reused buffers.
 *
 * A single-frame SUBMIT of a long prompt is copied behind its rewritten head
 * into a new message, and libzmq frees that message on its I/O thread once
 * sent. Through malloc, a buffer that large is mapped and unmapped each time
 * (or the heap's top is grown and trimmed), so every request also pays page
 * faults over its whole size. Here the free function hands the buffer back
 * instead: it pushes it onto a lock-free stack, and the loop takes the whole
 * stack at once (one atomic exchange: with only pushes racing, no ABA) the
 * next time it needs a buffer. Buffers come in power-of-two classes from
 * CK_BUFFER_MIN up; each class caches a bounded number of them, the rest go
 * back to free().
 *
 * The pool outlives its loop while libzmq still holds buffers: `refs` counts
 * the loop and every buffer in flight, and whoever drops the last reference
 * frees what is left and the pool.
 */
#ifndef COORDKIT_FRAMEPOOL_H
#define COORDKIT_FRAMEPOOL_H

#include <stdint.h>
#include <stdlib.h>

#include "libzmq.h"

#define CK_BUFFER_MIN_SHIFT 16 /* 64 KiB: below, malloc reuses its own bins */
#define CK_BUFFER_CLASSES 11   /* up to 64 MiB; larger ones are not pooled */
#define CK_BUFFER_KEEP 64      /* cached buffers per class */

typedef struct ck_buffer {
    struct ck_buffer *next;
    int size_class;
} ck_buffer;

typedef struct {
    ck_buffer *returned;                  /* pushed by libzmq's threads */
    ck_buffer *cached[CK_BUFFER_CLASSES]; /* the loop's own */
    int n_cached[CK_BUFFER_CLASSES];
    long refs;   /* the loop, and every buffer libzmq holds */
    int closed;
} ck_buffer_pool;

static ck_buffer_pool *ck_buffer_pool_new(void)
{
    ck_buffer_pool *pool = (ck_buffer_pool *)calloc(1, sizeof(ck_buffer_pool));
    if (pool != NULL)
        pool->refs = 1;
    return pool;
}

static void ck_buffers_free_list(ck_buffer *buffer)
{
    while (buffer != NULL) {
        ck_buffer *next = buffer->next;
        free(buffer);
        buffer = next;
    }
}

static void ck_buffer_pool_unref(ck_buffer_pool *pool)
{
    if (__atomic_sub_fetch(&pool->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    ck_buffers_free_list(__atomic_exchange_n(&pool->returned, NULL, __ATOMIC_ACQUIRE));
    for (int c = 0; c < CK_BUFFER_CLASSES; c++)
        ck_buffers_free_list(pool->cached[c]);
    free(pool);
}

/* The loop is done with the pool: cached buffers are freed now, the ones
 * libzmq still holds when it lets them go. */
static void ck_buffer_pool_close(ck_buffer_pool *pool)
{
    __atomic_store_n(&pool->closed, 1, __ATOMIC_RELEASE);
    ck_buffers_free_list(__atomic_exchange_n(&pool->returned, NULL, __ATOMIC_ACQUIRE));
    for (int c = 0; c < CK_BUFFER_CLASSES; c++) {
        ck_buffers_free_list(pool->cached[c]);
        pool->cached[c] = NULL;
        pool->n_cached[c] = 0;
    }
    ck_buffer_pool_unref(pool);
}

/* libzmq's free function: any thread. */
static void ck_buffer_release(void *data, void *hint)
{
    ck_buffer_pool *pool = (ck_buffer_pool *)hint;
    ck_buffer *buffer = (ck_buffer *)data - 1;
    if (__atomic_load_n(&pool->closed, __ATOMIC_ACQUIRE)) {
        free(buffer);
    } else {
        ck_buffer *head = __atomic_load_n(&pool->returned, __ATOMIC_RELAXED);
        do {
            buffer->next = head;
        } while (!__atomic_compare_exchange_n(&pool->returned, &head, buffer, 1,
                                              __ATOMIC_RELEASE, __ATOMIC_RELAXED));
    }
    ck_buffer_pool_unref(pool);
}

/* Take back what libzmq released: into its class's cache, or freed past the cap. */
static void ck_buffer_pool_collect(ck_buffer_pool *pool)
{
    ck_buffer *buffer = __atomic_exchange_n(&pool->returned, NULL, __ATOMIC_ACQUIRE);
    while (buffer != NULL) {
        ck_buffer *next = buffer->next;
        int c = buffer->size_class;
        if (pool->n_cached[c] < CK_BUFFER_KEEP) {
            buffer->next = pool->cached[c];
            pool->cached[c] = buffer;
            pool->n_cached[c]++;
        } else {
            free(buffer);
        }
        buffer = next;
    }
}

/* Initialise `msg` with `size` bytes to write: from the pool when `size` is in
 * its classes, else (or when malloc fails) as ck_msg_init_size does, whose
 * result it returns. */
static int ck_buffer_msg(ck_buffer_pool *pool, zmq_msg_t *msg, size_t size)
{
    int c = 0;
    while (c < CK_BUFFER_CLASSES && ((size_t)1 << (CK_BUFFER_MIN_SHIFT + c)) < size)
        c++;
    if (size < ((size_t)1 << CK_BUFFER_MIN_SHIFT) / 2 || c == CK_BUFFER_CLASSES)
        return ck_msg_init_size(msg, size);
    if (pool->cached[c] == NULL)
        ck_buffer_pool_collect(pool);
    ck_buffer *buffer = pool->cached[c];
    if (buffer != NULL) {
        pool->cached[c] = buffer->next;
        pool->n_cached[c]--;
    } else {
        buffer = (ck_buffer *)malloc(sizeof(ck_buffer) + ((size_t)1 << (CK_BUFFER_MIN_SHIFT + c)));
        if (buffer == NULL)
            return ck_msg_init_size(msg, size);
        buffer->size_class = c;
    }
    __atomic_add_fetch(&pool->refs, 1, __ATOMIC_RELAXED);
    if (ck_msg_init_data(msg, buffer + 1, size, ck_buffer_release, pool) != 0) {
        ck_buffer_release(buffer + 1, pool);
        return ck_msg_init_size(msg, size);
    }
    return 0;
}

#endif
