/* Big-endian loads and stores and a bounds-checked read cursor for the
 * msgpack header codec (_codec_c.pyx), in the style of asyncpg's pgproto.
 *
 * msgpack is big-endian on the wire. The shift-and-or forms below compile to
 * a single load plus bswap on gcc and clang, and never read unaligned words.
 */
#ifndef COORDKIT_CURSOR_H
#define COORDKIT_CURSOR_H

#include <stddef.h>
#include <stdint.h>

static inline uint16_t ck_load_be16(const uint8_t *p)
{
    return (uint16_t)(((uint16_t)p[0] << 8) | p[1]);
}

static inline uint32_t ck_load_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t ck_load_be64(const uint8_t *p)
{
    return ((uint64_t)ck_load_be32(p) << 32) | ck_load_be32(p + 4);
}

static inline void ck_store_be16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static inline void ck_store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static inline void ck_store_be64(uint8_t *p, uint64_t v)
{
    ck_store_be32(p, (uint32_t)(v >> 32));
    ck_store_be32(p + 4, (uint32_t)v);
}

/* A read position in [p, end): every read goes through ck_take, so no read
 * can pass `end` however the lengths in the data lie. */
typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} ck_cursor;

static inline size_t ck_left(const ck_cursor *c)
{
    return (size_t)(c->end - c->p);
}

/* The next n bytes, advancing past them; NULL (cursor unmoved) if fewer are left. */
static inline const uint8_t *ck_take(ck_cursor *c, size_t n)
{
    const uint8_t *p = c->p;
    if ((size_t)(c->end - p) < n)
        return NULL;
    c->p = p + n;
    return p;
}

#endif
