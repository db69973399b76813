/* A Megatron PR #6675 prefill's finished request read for its handoff, in place.
 *
 * The room used to decode the record whole (msgpack-python), read its
 * disaggregated_params, put the NIXL agents' blobs back into kv_meta and pack
 * kv_meta and block_ids again: about half the CPU of a #6675 P/D request. Here
 * the record is walked once, and when packing the decoded kv_meta and
 * block_ids again would give back the bytes that came (canonical msgpack as
 * msgpack-python writes it, no map key twice), their spans are forwarded, the
 * blobs spliced in as they are written. Anything else (an ext, a key not a
 * str, a float32 or a wider form than needed under kv_meta, an agent not
 * registered, a blob that differs, nesting past CK_HANDOFF_DEPTH) is
 * CK_HANDOFF_SLOW: the Python reading (_pd.handoff_of, restore_nixl_blobs)
 * decides, its outcome and its texts unchanged. */
#ifndef COORDKIT_HANDOFF_H
#define COORDKIT_HANDOFF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cursor.h"

#define CK_HANDOFF_DEPTH 32
#define CK_HANDOFF_KEYS 64 /* keys of one map under kv_meta checked for repeats */
#define CK_HANDOFF_SPLICES 32 /* blobs put back into one kv_meta, two splices each */

enum { CK_HANDOFF_OK = 0, CK_HANDOFF_SLOW = 1 };

typedef struct {
    const uint8_t *name; /* the agent's name, packed (a str) */
    size_t name_size;
    const uint8_t *blob; /* its registered blob, packed */
    size_t blob_size;
} ck_agent;

/* One splice of the blobs put back, at `at` in kv_meta (in order of `at`): a map's
 * head rewritten for one pair more, a nil blob replaced, the blob's pair appended. */
enum { CK_HF_HEAD, CK_HF_REPLACE, CK_HF_APPEND };

typedef struct {
    const uint8_t *at;
    size_t old_size; /* the bytes it replaces */
    int kind;
    uint32_t count;        /* CK_HF_HEAD's pairs */
    const ck_agent *agent; /* whose blob */
} ck_hf_splice;

typedef struct {
    const uint8_t *kv_meta; /* its span in the record */
    size_t kv_meta_size;
    const uint8_t *blocks; /* block_ids' span */
    size_t blocks_size;
    size_t restored_size; /* kv_meta's size with the blobs put back */
    int ssm;              /* kv_meta's "ssm" is truthy (_pd.decode_slots) */
    size_t n_splices;     /* 0: kv_meta forwarded as it came */
    ck_hf_splice splices[CK_HANDOFF_SPLICES];
} ck_handoff;

typedef struct {
    const ck_agent *agents; /* NULL: nothing put back (not NIXL) */
    size_t n_agents;
    ck_handoff *out;    /* where its splices go */
    const uint8_t *ssm; /* the value of the walked map's own "ssm" key */
} ck_hf_ctx;

#define CK_HF_AGENT "agent_name"
#define CK_HF_BLOB "agent_metadata_b64"

/* UTF-8 as Python's strict decoder takes it (no overlong form, no surrogate). */
static inline int ck_hf_utf8(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t b = s[i];
        if (b < 0x80) {
            i++;
            continue;
        }
        size_t more;
        uint8_t lo = 0x80, hi = 0xBF;
        if (b >= 0xC2 && b <= 0xDF) {
            more = 1;
        } else if (b >= 0xE0 && b <= 0xEF) {
            more = 2;
            if (b == 0xE0)
                lo = 0xA0;
            else if (b == 0xED)
                hi = 0x9F;
        } else if (b >= 0xF0 && b <= 0xF4) {
            more = 3;
            if (b == 0xF0)
                lo = 0x90;
            else if (b == 0xF4)
                hi = 0x8F;
        } else {
            return 0;
        }
        if (n - i <= more)
            return 0;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (size_t k = 2; k <= more; k++)
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
        i += more + 1;
    }
    return 1;
}

/* A str at c (moved past it): its bytes; 0 when not a valid str (canon: in its
 * smallest form). */
static inline int ck_hf_str(ck_cursor *c, int canon, const uint8_t **data, size_t *size)
{
    const uint8_t *p = ck_take(c, 1);
    size_t n;
    if (p == NULL)
        return 0;
    if ((p[0] & 0xE0) == 0xA0) {
        n = p[0] & 0x1F;
    } else if (p[0] == 0xD9) {
        if ((p = ck_take(c, 1)) == NULL)
            return 0;
        n = p[0];
        if (canon && n < 32)
            return 0;
    } else if (p[0] == 0xDA) {
        if ((p = ck_take(c, 2)) == NULL)
            return 0;
        n = ck_load_be16(p);
        if (canon && n < 256)
            return 0;
    } else if (p[0] == 0xDB) {
        if ((p = ck_take(c, 4)) == NULL)
            return 0;
        n = ck_load_be32(p);
        if (canon && n < 65536)
            return 0;
    } else {
        return 0;
    }
    if ((p = ck_take(c, n)) == NULL || !ck_hf_utf8(p, n))
        return 0;
    *data = p;
    *size = n;
    return 1;
}

/* Whether the str's bytes are the literal `name`. */
#define ck_hf_is(data, size, name) \
    ((size) == sizeof(name) - 1 && memcmp((data), (name), sizeof(name) - 1) == 0)

/* A container's element count (a map's pairs) at c, moved past its head; 0 when
 * not a container of `map`'s kind (canon: in its smallest form). */
static inline int ck_hf_count(ck_cursor *c, int map, int canon, uint32_t *count)
{
    const uint8_t *p = ck_take(c, 1);
    uint8_t fix = map ? 0x80 : 0x90, h16 = map ? 0xDE : 0xDC, h32 = map ? 0xDF : 0xDD;
    if (p == NULL)
        return 0;
    if ((p[0] & 0xF0) == fix) {
        *count = p[0] & 0x0F;
    } else if (p[0] == h16) {
        if ((p = ck_take(c, 2)) == NULL)
            return 0;
        *count = ck_load_be16(p);
        if (canon && *count < 16)
            return 0;
    } else if (p[0] == h32) {
        if ((p = ck_take(c, 4)) == NULL)
            return 0;
        *count = ck_load_be32(p);
        if (canon && *count < 65536)
            return 0;
    } else {
        return 0;
    }
    return 1;
}

static inline size_t ck_hf_count_size(uint32_t count)
{
    return count <= 0x0F ? 1 : count <= 0xFFFF ? 3 : 5;
}

static int ck_hf_value(ck_cursor *c, int depth, int canon, ck_hf_ctx *ctx);

/* A splice, kept in order of `at` (a map's splices come after those inside it at the
 * same place: its appended pair after theirs); 0 when there is no room. */
static inline int ck_hf_splice_add(ck_handoff *out, const uint8_t *at, size_t old_size,
                                   int kind, uint32_t count, const ck_agent *agent)
{
    size_t i = out->n_splices;
    if (i == CK_HANDOFF_SPLICES)
        return 0;
    while (i > 0 && out->splices[i - 1].at > at) {
        out->splices[i] = out->splices[i - 1];
        i--;
    }
    out->splices[i].at = at;
    out->splices[i].old_size = old_size;
    out->splices[i].kind = kind;
    out->splices[i].count = count;
    out->splices[i].agent = agent;
    out->n_splices++;
    return 1;
}

/* A map at c whose keys are all str: each value walked; under kv_meta (canon) no
 * key twice, and with ctx->agents an agent's blob put back (its splices noted). */
static int ck_hf_map(ck_cursor *c, int depth, int canon, ck_hf_ctx *ctx)
{
    uint32_t count, i, j;
    const uint8_t *keys[CK_HANDOFF_KEYS];
    size_t sizes[CK_HANDOFF_KEYS];
    const uint8_t *start = c->p, *head_end, *key, *name = NULL, *blob = NULL;
    size_t key_size, name_size = 0, blob_size = 0;
    if (!ck_hf_count(c, 1, canon, &count))
        return CK_HANDOFF_SLOW;
    head_end = c->p;
    if (canon && count > CK_HANDOFF_KEYS)
        return CK_HANDOFF_SLOW;
    for (i = 0; i < count; i++) {
        if (!ck_hf_str(c, canon, &key, &key_size))
            return CK_HANDOFF_SLOW;
        if (canon) {
            for (j = 0; j < i; j++)
                if (sizes[j] == key_size && memcmp(keys[j], key, key_size) == 0)
                    return CK_HANDOFF_SLOW;
            keys[i] = key;
            sizes[i] = key_size;
        }
        const uint8_t *value = c->p;
        if (ck_hf_value(c, depth + 1, canon, ctx) != CK_HANDOFF_OK)
            return CK_HANDOFF_SLOW;
        if (depth == 0 && ck_hf_is(key, key_size, "ssm"))
            ctx->ssm = value;
        if (canon && ctx->agents != NULL) {
            if (ck_hf_is(key, key_size, CK_HF_AGENT) && value[0] != 0xC0) {
                name = value;
                name_size = (size_t)(c->p - value);
            } else if (ck_hf_is(key, key_size, CK_HF_BLOB)) {
                blob = value;
                blob_size = (size_t)(c->p - value);
            }
        }
    }
    if (name == NULL)
        return CK_HANDOFF_OK;
    /* restore_nixl_blobs: a registered agent, its blob absent, nil or the same */
    if (!((name[0] & 0xE0) == 0xA0 || (name[0] >= 0xD9 && name[0] <= 0xDB)))
        return CK_HANDOFF_SLOW;
    ck_handoff *out = ctx->out;
    for (i = 0; i < ctx->n_agents; i++) {
        const ck_agent *agent = &ctx->agents[i];
        if (agent->name_size != name_size || memcmp(agent->name, name, name_size) != 0)
            continue;
        if (blob == NULL) {
            return ck_hf_splice_add(out, start, (size_t)(head_end - start), CK_HF_HEAD,
                                    count + 1, agent) &&
                           ck_hf_splice_add(out, c->p, 0, CK_HF_APPEND, 0, agent)
                       ? CK_HANDOFF_OK
                       : CK_HANDOFF_SLOW;
        }
        if (blob[0] == 0xC0) {
            return ck_hf_splice_add(out, blob, 1, CK_HF_REPLACE, 0, agent) ? CK_HANDOFF_OK
                                                                           : CK_HANDOFF_SLOW;
        }
        if (agent->blob_size == blob_size && memcmp(agent->blob, blob, blob_size) == 0)
            return CK_HANDOFF_OK;
        return CK_HANDOFF_SLOW;
    }
    return CK_HANDOFF_SLOW;
}

/* One object at c, walked (c moved past it): OK when msgpack-python decodes it (no
 * ext, str keys only) and, canon, packs it back to the same bytes. */
static int ck_hf_value(ck_cursor *c, int depth, int canon, ck_hf_ctx *ctx)
{
    const uint8_t *p, *data;
    size_t size;
    uint32_t count, i;
    if (depth > CK_HANDOFF_DEPTH || ck_left(c) == 0)
        return CK_HANDOFF_SLOW;
    uint8_t b = c->p[0];
    if (b <= 0x7F || b >= 0xE0 || b == 0xC0 || b == 0xC2 || b == 0xC3) {
        c->p++;
        return CK_HANDOFF_OK;
    }
    if ((b & 0xF0) == 0x80 || b == 0xDE || b == 0xDF)
        return ck_hf_map(c, depth, canon, ctx);
    if ((b & 0xF0) == 0x90 || b == 0xDC || b == 0xDD) {
        if (!ck_hf_count(c, 0, canon, &count))
            return CK_HANDOFF_SLOW;
        for (i = 0; i < count; i++)
            if (ck_hf_value(c, depth + 1, canon, ctx) != CK_HANDOFF_OK)
                return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    }
    if ((b & 0xE0) == 0xA0 || (b >= 0xD9 && b <= 0xDB))
        return ck_hf_str(c, canon, &data, &size) ? CK_HANDOFF_OK : CK_HANDOFF_SLOW;
    c->p++;
    switch (b) {
    case 0xC4: /* bin 8, 16, 32 */
    case 0xC5:
    case 0xC6: {
        size_t width = b == 0xC4 ? 1 : b == 0xC5 ? 2 : 4;
        if ((p = ck_take(c, width)) == NULL)
            return CK_HANDOFF_SLOW;
        size = width == 1 ? p[0] : width == 2 ? ck_load_be16(p) : ck_load_be32(p);
        if (canon && ((width == 2 && size < 256) || (width == 4 && size < 65536)))
            return CK_HANDOFF_SLOW;
        return ck_take(c, size) == NULL ? CK_HANDOFF_SLOW : CK_HANDOFF_OK;
    }
    case 0xCA: /* float32: packed back as a float64 */
        return canon || ck_take(c, 4) == NULL ? CK_HANDOFF_SLOW : CK_HANDOFF_OK;
    case 0xCB:
        return ck_take(c, 8) == NULL ? CK_HANDOFF_SLOW : CK_HANDOFF_OK;
    case 0xCC: /* uint: msgpack-python's smallest form for a non-negative int */
        if ((p = ck_take(c, 1)) == NULL || (canon && p[0] < 0x80))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    case 0xCD:
        if ((p = ck_take(c, 2)) == NULL || (canon && ck_load_be16(p) < 0x100))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    case 0xCE:
        if ((p = ck_take(c, 4)) == NULL || (canon && ck_load_be32(p) < 0x10000))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    case 0xCF:
        if ((p = ck_take(c, 8)) == NULL || (canon && ck_load_be64(p) < 0x100000000ULL))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    case 0xD0: /* int: only a negative one, in its smallest form */
        if ((p = ck_take(c, 1)) == NULL || (canon && (int8_t)p[0] >= -32))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    case 0xD1:
        if ((p = ck_take(c, 2)) == NULL || (canon && (int16_t)ck_load_be16(p) >= -128))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    case 0xD2:
        if ((p = ck_take(c, 4)) == NULL || (canon && (int32_t)ck_load_be32(p) >= -32768))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    case 0xD3:
        if ((p = ck_take(c, 8)) == NULL ||
            (canon && (int64_t)ck_load_be64(p) >= -2147483648LL))
            return CK_HANDOFF_SLOW;
        return CK_HANDOFF_OK;
    default: /* ext, and 0xC1 */
        return CK_HANDOFF_SLOW;
    }
}

/* The value of the last `name` key of the map at p into *found (NULL: none);
 * CK_HANDOFF_SLOW when it is not a map ck_hf_value takes. */
static inline int ck_hf_lookup(const uint8_t *p, const uint8_t *end, const char *name,
                               size_t name_size, const uint8_t **found)
{
    ck_cursor c = {p, end};
    ck_hf_ctx none = {NULL, 0, NULL, NULL};
    const uint8_t *key;
    size_t key_size;
    uint32_t count, i;
    *found = NULL;
    if (!ck_hf_count(&c, 1, 0, &count))
        return CK_HANDOFF_SLOW;
    for (i = 0; i < count; i++) {
        if (!ck_hf_str(&c, 0, &key, &key_size))
            return CK_HANDOFF_SLOW;
        if (key_size == name_size && memcmp(key, name, name_size) == 0)
            *found = c.p;
        if (ck_hf_value(&c, 1, 0, &none) != CK_HANDOFF_OK)
            return CK_HANDOFF_SLOW;
    }
    return CK_HANDOFF_OK;
}

/* Whether #6675 may refuse the sampling params `params` (_pd.refuses_prompt_log_probs):
 * 0 when they are a map whose "return_log_probs" is absent, nil, false or 0, or whose
 * "skip_prompt_log_probs" is absent or true (no decoding needed); 1 when the Python
 * reading must say. */
static inline int ck_pd_may_refuse(const uint8_t *params, size_t n)
{
    const uint8_t *asked, *skipped;
    if (ck_hf_lookup(params, params + n, "return_log_probs", 16, &asked) != CK_HANDOFF_OK ||
        ck_hf_lookup(params, params + n, "skip_prompt_log_probs", 21, &skipped) !=
            CK_HANDOFF_OK)
        return 1;
    if (asked == NULL || asked[0] == 0xC0 || asked[0] == 0xC2 || asked[0] == 0x00)
        return 0; /* not asked */
    return !(skipped == NULL || skipped[0] == 0xC3); /* skipped: absent counts as set */
}

/* Python's truth of the canonical value at p (kv_meta's "ssm"). */
static inline int ck_hf_truthy(const uint8_t *p)
{
    static const uint8_t zero[8] = {0};
    switch (p[0]) {
    case 0xC0: case 0xC2: case 0x00: case 0xA0: case 0x90: case 0x80:
        return 0;
    case 0xC4:
        return p[1] != 0;
    case 0xCB: /* 0.0 or -0.0 */
        return !(memcmp(p + 1, zero, 8) == 0 ||
                 (p[1] == 0x80 && memcmp(p + 2, zero, 7) == 0));
    default:
        return 1;
    }
}

/* The record `rec` (one entry of a #6675 prefill's ENGINE_REPLY) read for its
 * handoff in one walk: kv_meta (a map) and block_ids (ints) of its last
 * disaggregated_params, with `agents`' blobs to put back (NULL: none);
 * CK_HANDOFF_SLOW unless forwarding their bytes is what decoding and packing them
 * again would send. */
static int ck_pd_handoff(const uint8_t *rec, size_t n, const ck_agent *agents,
                         size_t n_agents, ck_handoff *out)
{
    ck_cursor c = {rec, rec + n};
    ck_hf_ctx none = {NULL, 0, NULL, NULL}, ctx = {agents, n_agents, out, NULL};
    const uint8_t *key, *value;
    size_t key_size;
    uint32_t count, pairs = 0, i, j;
    int params = 0; /* the last disaggregated_params is a map */
    out->kv_meta = out->blocks = NULL;
    if (!ck_hf_count(&c, 1, 0, &count))
        return CK_HANDOFF_SLOW;
    for (i = 0; i < count; i++) {
        if (!ck_hf_str(&c, 0, &key, &key_size))
            return CK_HANDOFF_SLOW;
        value = c.p;
        if (!ck_hf_is(key, key_size, "disaggregated_params") || ck_left(&c) == 0 ||
            !((value[0] & 0xF0) == 0x80 || value[0] == 0xDE || value[0] == 0xDF)) {
            if (ck_hf_is(key, key_size, "disaggregated_params"))
                params = 0;
            if (ck_hf_value(&c, 1, 0, &none) != CK_HANDOFF_OK)
                return CK_HANDOFF_SLOW;
            continue;
        }
        /* the handoff: its last kv_meta and block_ids walked as they must be sent */
        params = 1;
        out->kv_meta = out->blocks = NULL;
        ck_hf_count(&c, 1, 0, &pairs);
        for (j = 0; j < pairs; j++) {
            if (!ck_hf_str(&c, 0, &key, &key_size))
                return CK_HANDOFF_SLOW;
            value = c.p;
            if (ck_hf_is(key, key_size, "kv_meta")) {
                out->kv_meta = NULL;
                out->n_splices = 0;
                ctx.ssm = NULL;
                if (ck_left(&c) && ((value[0] & 0xF0) == 0x80 || value[0] == 0xDE ||
                                    value[0] == 0xDF)) {
                    if (ck_hf_value(&c, 0, 1, &ctx) != CK_HANDOFF_OK) /* depth 0: its own ssm */
                        return CK_HANDOFF_SLOW;
                    out->kv_meta = value;
                    out->kv_meta_size = (size_t)(c.p - value);
                    out->ssm = ctx.ssm != NULL && ck_hf_truthy(ctx.ssm);
                    continue;
                }
            } else if (ck_hf_is(key, key_size, "block_ids")) {
                out->blocks = NULL;
                uint32_t blocks, k;
                if (ck_left(&c) && ((value[0] & 0xF0) == 0x90 || value[0] == 0xDC ||
                                    value[0] == 0xDD)) {
                    if (!ck_hf_count(&c, 0, 1, &blocks))
                        return CK_HANDOFF_SLOW;
                    for (k = 0; k < blocks; k++) {
                        uint8_t b = ck_left(&c) ? c.p[0] : 0xC1;
                        if (!(b <= 0x7F || b >= 0xE0 || (b >= 0xCC && b <= 0xD3)))
                            return CK_HANDOFF_SLOW;
                        if (ck_hf_value(&c, 3, 1, &none) != CK_HANDOFF_OK)
                            return CK_HANDOFF_SLOW;
                    }
                    out->blocks = value;
                    out->blocks_size = (size_t)(c.p - value);
                    continue;
                }
            }
            if (ck_hf_value(&c, 2, 0, &none) != CK_HANDOFF_OK)
                return CK_HANDOFF_SLOW;
        }
    }
    if (c.p != c.end || !params || out->kv_meta == NULL || out->blocks == NULL)
        return CK_HANDOFF_SLOW;
    /* the growth ck_hf_map counted is kv_meta's last walk's alone */
    out->restored_size = out->kv_meta_size;
    for (i = 0; i < out->n_splices; i++) {
        const ck_hf_splice *splice = &out->splices[i];
        if (splice->kind == CK_HF_HEAD)
            out->restored_size += ck_hf_count_size(splice->count) - splice->old_size;
        else if (splice->kind == CK_HF_REPLACE)
            out->restored_size += splice->agent->blob_size - splice->old_size;
        else
            out->restored_size += sizeof(CK_HF_BLOB) + splice->agent->blob_size;
    }
    return CK_HANDOFF_OK;
}

static size_t ck_hf_write_count(uint8_t *out, uint32_t count)
{
    if (count <= 0x0F) {
        out[0] = (uint8_t)(0x80 | count);
        return 1;
    }
    if (count <= 0xFFFF) {
        out[0] = 0xDE;
        ck_store_be16(out + 1, (uint16_t)count);
        return 3;
    }
    out[0] = 0xDF;
    ck_store_be32(out + 1, count);
    return 5;
}

/* kv_meta as ck_pd_handoff found it, its splices made: h->restored_size bytes. */
static inline void ck_pd_restore(const ck_handoff *h, uint8_t *out)
{
    const uint8_t *p = h->kv_meta, *end = h->kv_meta + h->kv_meta_size;
    size_t i;
    for (i = 0; i < h->n_splices; i++) {
        const ck_hf_splice *splice = &h->splices[i];
        memcpy(out, p, (size_t)(splice->at - p));
        out += splice->at - p;
        p = splice->at + splice->old_size;
        if (splice->kind == CK_HF_HEAD) {
            out += ck_hf_write_count(out, splice->count);
            continue;
        }
        if (splice->kind == CK_HF_APPEND) { /* the key: a fixstr */
            *out++ = (uint8_t)(0xA0 | (sizeof(CK_HF_BLOB) - 1));
            memcpy(out, CK_HF_BLOB, sizeof(CK_HF_BLOB) - 1);
            out += sizeof(CK_HF_BLOB) - 1;
        }
        memcpy(out, splice->agent->blob, splice->agent->blob_size);
        out += splice->agent->blob_size;
    }
    memcpy(out, p, (size_t)(end - p));
}

#endif
