/* The bytes of msgpack for the header codec (_codec_c.pyx) and the endpoints:
 * big-endian loads and stores, a bounds-checked read cursor in the style of
 * asyncpg's pgproto, and the one writer of an int in its smallest form.
 *
 * msgpack is big-endian on the wire. The shift-and-or forms below compile to
 * a single load plus bswap on gcc and clang, and never read unaligned words.
 */
#ifndef COORDKIT_CURSOR_H
#define COORDKIT_CURSOR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "sysdep.h"

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

/* An int in msgpack's smallest form, the one msgpack.packb chooses; the bytes
 * it takes are returned. `out` must have room for 9 bytes (CK_INT_MAX)
 * whatever `v` is: a fixint (a header, a small id) is one byte; any other int
 * in [0, 2**32) -- a token id, a request id -- is written as one 8-byte store
 * built from tables, without a branch on its size (token ids are as often
 * above 0xffff as below, a branch missed half the time), and that store may
 * overwrite the 7 bytes after the int. */
static inline size_t ck_write_int(uint8_t *out, int64_t v)
{
    if ((uint64_t)v < 0x80) { /* a header, a small id: one byte, and a branch predicted */
        out[0] = (uint8_t)v;
        return 1;
    }
#if defined(__GNUC__) && !CK_BIG_ENDIAN
    if ((uint64_t)v <= 0xffffffffu) {
        static const uint8_t tags[4] = {0, 0xcc, 0xcd, 0xce};
        static const uint8_t shifts[4] = {24, 24, 16, 0};
        static const uint8_t places[4] = {0, 8, 8, 8};
        static const uint8_t sizes[4] = {1, 2, 3, 5};
        uint32_t u = (uint32_t)v;
        unsigned form = (u >= 0x80) + (u > 0xff) + (u > 0xffff);
        uint64_t be = __builtin_bswap32(u) >> shifts[form];
        uint64_t word = tags[form] | (be << places[form]);
        memcpy(out, &word, 8);
        return sizes[form];
    }
#endif
    if (v >= 0) {
        if (v <= 0xff) {
            out[0] = 0xcc;
            out[1] = (uint8_t)v;
            return 2;
        }
        if (v <= 0xffff) {
            out[0] = 0xcd;
            ck_store_be16(out + 1, (uint16_t)v);
            return 3;
        }
        if (v <= 0xffffffff) {
            out[0] = 0xce;
            ck_store_be32(out + 1, (uint32_t)v);
            return 5;
        }
        out[0] = 0xcf;
        ck_store_be64(out + 1, (uint64_t)v);
        return 9;
    }
    if (v >= -32) {
        out[0] = (uint8_t)v; /* negative fixint, 0xe0-0xff */
        return 1;
    }
    if (v >= -0x80) {
        out[0] = 0xd0;
        out[1] = (uint8_t)v;
        return 2;
    }
    if (v >= -0x8000) {
        out[0] = 0xd1;
        ck_store_be16(out + 1, (uint16_t)v);
        return 3;
    }
    if (v >= INT32_MIN) {
        out[0] = 0xd2;
        ck_store_be32(out + 1, (uint32_t)v);
        return 5;
    }
    out[0] = 0xd3;
    ck_store_be64(out + 1, (uint64_t)v);
    return 9;
}

/* A uint64 likewise (msgpack's uint64 form beyond int64), with the same room. */
static inline size_t ck_write_uint(uint8_t *out, uint64_t v)
{
    if (v <= (uint64_t)INT64_MAX)
        return ck_write_int(out, (int64_t)v);
    out[0] = 0xcf;
    ck_store_be64(out + 1, v);
    return 9;
}

#endif
