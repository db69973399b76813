/* What depends on the host and the compiler, written once: the byte order and
 * the loads and stores that follow it, a count of trailing zeros, and the
 * DEBUG switch of the Cython modules (COORDKIT_DEBUG=1, `make debug`).
 *
 * Every other header and module takes these from here; none tests
 * __BYTE_ORDER__ or COORDKIT_DEBUG itself.
 */
#ifndef COORDKIT_SYSDEP_H
#define COORDKIT_SYSDEP_H

#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define CK_BIG_ENDIAN 1
#else
#define CK_BIG_ENDIAN 0
#endif

#ifdef COORDKIT_DEBUG
#define CK_DEBUG 1
#else
#define CK_DEBUG 0
#endif

/* Little-endian words at any address (a zmq message body has no alignment
 * guarantee): one load or store, plus a byte swap on a big-endian host. */
static inline uint64_t ck_load_le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if CK_BIG_ENDIAN
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void ck_store_le64(uint8_t *p, uint64_t v)
{
#if CK_BIG_ENDIAN
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, sizeof v);
}

static inline void ck_store_le32(uint8_t *p, uint32_t v)
{
#if CK_BIG_ENDIAN
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, sizeof v);
}

/* The index of the lowest set bit of x, which is not 0. */
static inline int ck_ctz64(uint64_t x)
{
#if defined(__GNUC__)
    return __builtin_ctzll(x);
#else
    int n = 0;
    while (!(x & 1)) {
        x >>= 1;
        n++;
    }
    return n;
#endif
}

#endif
