/* BLAKE2b (RFC 7693), unkeyed, any digest size from 1 to 64 bytes.
 *
 * Written from the RFC for the coordinator's block hashes
 * (coordkit.protocol.block_hashes: blake2b with digest_size=8), so that a
 * token-id prompt can be hashed in C with no Python object per token. No
 * dependencies, no allocation; every function is static inline.
 *
 *     ck_blake2b_state s;
 *     ck_blake2b_init(&s, 8);
 *     ck_blake2b_update(&s, data, n);          (any number of times)
 *     ck_blake2b_update_le32(&s, token);       (4 bytes, little-endian)
 *     ck_blake2b_final(&s, out);               (writes s.outlen bytes)
 *
 * Inputs are buffered so that the last block is compressed by final() with
 * the finalization flag set, as the RFC requires, even when the message
 * length is a multiple of the 128-byte block.
 */
#ifndef COORDKIT_BLAKE2B_H
#define COORDKIT_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "sysdep.h"

#define CK_BLAKE2B_BLOCK 128
#define CK_BLAKE2B_MAX_OUT 64

typedef struct {
    uint64_t h[8];                  /* chained state */
    uint64_t t[2];                  /* bytes compressed so far, 128-bit counter */
    uint8_t b[CK_BLAKE2B_BLOCK];    /* input not yet compressed */
    size_t c;                       /* bytes in b */
    size_t outlen;                  /* digest size in bytes */
} ck_blake2b_state;

static const uint64_t ck_blake2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL,
    0xA54FF53A5F1D36F1ULL, 0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL,
    0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

/* The message word schedule of each round (rounds 10 and 11 repeat 0 and 1). */
static const uint8_t ck_blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t ck_rotr64(uint64_t x, unsigned n)
{
    return (x >> n) | (x << (64 - n));
}

/* The mixing function G (RFC 7693, 3.1). */
#define CK_BLAKE2B_G(a, b, c, d, x, y)        \
    do {                                      \
        v[a] = v[a] + v[b] + (x);             \
        v[d] = ck_rotr64(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];                   \
        v[b] = ck_rotr64(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);             \
        v[d] = ck_rotr64(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];                   \
        v[b] = ck_rotr64(v[b] ^ v[c], 63);    \
    } while (0)

/* The compression function F (RFC 7693, 3.2) over the block in s->b. */
static inline void ck_blake2b_compress(ck_blake2b_state *s, int last)
{
    uint64_t v[16], m[16];
    int i;
    for (i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = ck_blake2b_iv[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last)
        v[14] = ~v[14];
    for (i = 0; i < 16; i++)
        m[i] = ck_load_le64(s->b + 8 * i);
    for (i = 0; i < 12; i++) {
        const uint8_t *z = ck_blake2b_sigma[i];
        CK_BLAKE2B_G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        CK_BLAKE2B_G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        CK_BLAKE2B_G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        CK_BLAKE2B_G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        CK_BLAKE2B_G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        CK_BLAKE2B_G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        CK_BLAKE2B_G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        CK_BLAKE2B_G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

#undef CK_BLAKE2B_G

/* Count the buffered block as compressed (the 128-bit counter t). */
static inline void ck_blake2b_count(ck_blake2b_state *s, size_t n)
{
    s->t[0] += n;
    if (s->t[0] < n)
        s->t[1]++;
}

/* outlen in 1..CK_BLAKE2B_MAX_OUT (not checked: the caller's contract). */
static inline void ck_blake2b_init(ck_blake2b_state *s, size_t outlen)
{
    int i;
    for (i = 0; i < 8; i++)
        s->h[i] = ck_blake2b_iv[i];
    /* the parameter block: digest length, no key, fanout 1, depth 1 */
    s->h[0] ^= 0x01010000ULL ^ (uint64_t)outlen;
    s->t[0] = 0;
    s->t[1] = 0;
    s->c = 0;
    s->outlen = outlen;
}

static inline void ck_blake2b_update(ck_blake2b_state *s, const uint8_t *in, size_t n)
{
    while (n > 0) {
        if (s->c == CK_BLAKE2B_BLOCK) {  /* more input follows: not the last block */
            ck_blake2b_count(s, CK_BLAKE2B_BLOCK);
            ck_blake2b_compress(s, 0);
            s->c = 0;
        }
        size_t take = CK_BLAKE2B_BLOCK - s->c;
        if (take > n)
            take = n;
        memcpy(s->b + s->c, in, take);
        s->c += take;
        in += take;
        n -= take;
    }
}

/* Four bytes, v little-endian: the per-token step of the block hashes. */
static inline void ck_blake2b_update_le32(ck_blake2b_state *s, uint32_t v)
{
    if (s->c == CK_BLAKE2B_BLOCK) {
        ck_blake2b_count(s, CK_BLAKE2B_BLOCK);
        ck_blake2b_compress(s, 0);
        s->c = 0;
    }
    if (s->c + 4 <= CK_BLAKE2B_BLOCK) {
        ck_store_le32(s->b + s->c, v);
        s->c += 4;
    } else {  /* straddles a block boundary: only after an unaligned update */
        uint8_t tmp[4];
        ck_store_le32(tmp, v);
        ck_blake2b_update(s, tmp, 4);
    }
}

/* Writes s->outlen bytes: the first bytes of h, little-endian. */
static inline void ck_blake2b_final(ck_blake2b_state *s, uint8_t *out)
{
    uint8_t digest[CK_BLAKE2B_MAX_OUT];
    int i;
    ck_blake2b_count(s, s->c);
    memset(s->b + s->c, 0, CK_BLAKE2B_BLOCK - s->c);
    ck_blake2b_compress(s, 1);
    for (i = 0; i < 8; i++)
        ck_store_le64(digest + 8 * i, s->h[i]);
    memcpy(out, digest, s->outlen);
}

#endif
