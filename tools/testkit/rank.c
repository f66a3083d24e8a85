/*
 * Rank builder: buffer tables, guarded host allocations, fill patterns and copies.
 *
 * Each buffer is allocated as [guard][data][guard]; the guards hold a position-
 * dependent sentinel so that a stray write of any value (including the sentinel's
 * neighbour values) shows up in kvt_rank_check_guards.
 */
#include "testkit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KVT_DEFAULT_GUARD 64u
/* Describe-only ranks get addresses here: canonical, page aligned, never touched. */
#define KVT_FAKE_BASE 0x100000000000ull

uint64_t kvt_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t kvt_rng_below(kvt_rng_t *rng, uint64_t n)
{
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t v;
    do {
        v = kvt_rng_next(rng);
    } while (v >= limit);
    return v % n;
}

int kvt_contains(const char *haystack, const char *needle)
{
    return haystack && needle && strcasestr(haystack, needle) != NULL;
}

static uint8_t kvt_guard_byte(uint64_t pos, uint32_t buf)
{
    return (uint8_t)(0xA5u ^ (uint8_t)(pos * 7u) ^ (uint8_t)(buf * 13u));
}

static const char *kvt_role_name(kvw_role_t role)
{
    switch (role) {
    case KVW_ROLE_K: return "K";
    case KVW_ROLE_V: return "V";
    case KVW_ROLE_KV: return "KV";
    case KVW_ROLE_LATENT: return "latent";
    case KVW_ROLE_STATE: return "state";
    case KVW_ROLE_K_SCALE: return "K-scale";
    case KVW_ROLE_V_SCALE: return "V-scale";
    }
    return "?";
}

/* Bytes of one page (or one state slot) of a buffer as the builder lays it out. */
static uint64_t kvt_unit_bytes(const kvw_buffer_desc_t *b, uint32_t tp, uint32_t tp_rank)
{
    if (b->pool == KVW_POOL_STATE) {
        uint64_t slot = 0;
        for (uint32_t g = 0; g < b->num_groups; g++) {
            uint32_t first, count;
            if (kvt_heads_owned(tp, tp_rank, b->groups[g].total_heads, &first, &count))
                return 0;
            slot += (uint64_t)count * b->groups[g].head_bytes;
        }
        return slot;
    }
    uint64_t per_token = (uint64_t)b->num_heads * (b->head_bytes + b->v_head_bytes);
    return per_token * b->page_size;
}

static kvw_status_t kvt_push(kvt_rank_t *r, uint32_t *cap, const kvw_buffer_desc_t *d)
{
    if (r->num_bufs == *cap) {
        uint32_t ncap = *cap ? *cap * 2 : 16;
        kvw_buffer_desc_t *nb = realloc(r->bufs, ncap * sizeof(*nb));
        if (!nb)
            return KVW_ERR_NO_MEMORY;
        r->bufs = nb;
        *cap = ncap;
    }
    r->bufs[r->num_bufs++] = *d;
    return KVW_OK;
}

static kvw_status_t kvt_add_paged(kvt_rank_t *r, uint32_t *cap, const kvt_rank_spec_t *spec,
                                  uint32_t layer, kvw_pool_t pool, kvw_role_t role,
                                  uint32_t heads, uint32_t head_bytes, uint32_t v_head_bytes)
{
    kvw_buffer_desc_t d;
    memset(&d, 0, sizeof(d));
    d.field_mask = KVW_BUFFER_FIELDS_ALL;
    d.pool = pool;
    d.layer = layer;
    d.role = role;
    d.layout = spec->layout;
    d.page_size = spec->page_size[pool];
    d.num_heads = heads;
    d.head_bytes = head_bytes;
    d.v_head_bytes = v_head_bytes;
    d.length = kvt_unit_bytes(&d, 1, 0) * spec->num_pages[pool];
    d.mem_kind = KVW_MEM_HOST;
    return kvt_push(r, cap, &d);
}

kvw_status_t kvt_rank_describe(const kvt_rank_spec_t *spec, kvt_rank_t *rank_p)
{
    kvt_rank_t r;
    uint32_t cap = 0;
    kvw_status_t st = KVW_OK;

    memset(&r, 0, sizeof(r));
    if (!spec || !spec->model || !rank_p)
        return KVW_ERR_INVALID_PARAM;
    r.model = *spec->model;
    kvt_model_relink(&r.model);
    r.par = spec->par;
    r.layout = spec->layout;
    r.page_size[0] = spec->page_size[0];
    r.page_size[1] = spec->page_size[1];
    r.guard = spec->guard_bytes ? spec->guard_bytes : KVT_DEFAULT_GUARD;
    r.describe_only = spec->describe_only;

    const kvw_model_t *m = &r.model.m;
    uint32_t first = 0, heads = 0;
    int have_attn = 0;
    for (uint32_t l = 0; l < m->num_layers; l++)
        if (m->layers[l].kind == KVW_LAYER_FULL || m->layers[l].kind == KVW_LAYER_SWA)
            have_attn = 1;
    if (have_attn &&
        kvt_heads_owned(spec->par.tp_size, spec->par.tp_rank, m->num_kv_heads, &first, &heads))
        return KVW_ERR_INVALID_PARAM;
    if (spec->par.layer_end > m->num_layers || spec->par.layer_begin > spec->par.layer_end)
        return KVW_ERR_INVALID_PARAM;

    uint32_t kb = m->k_head_dim * m->elem_size, vb = m->v_head_dim * m->elem_size;
    uint32_t ksb = 0, vsb = 0;
    if (m->scale_block) {
        ksb = m->k_head_dim / m->scale_block * m->scale_elem_size;
        vsb = m->v_head_dim / m->scale_block * m->scale_elem_size;
    }
    for (uint32_t l = spec->par.layer_begin; l < spec->par.layer_end && st == KVW_OK; l++) {
        kvw_layer_kind_t kind = m->layers[l].kind;
        if (kind == KVW_LAYER_FULL || kind == KVW_LAYER_SWA) {
            kvw_pool_t pool = kind == KVW_LAYER_FULL ? KVW_POOL_FULL : KVW_POOL_SWA;
            if (spec->fused_kv) {
                st = kvt_add_paged(&r, &cap, spec, l, pool, KVW_ROLE_KV, heads, kb, vb);
            } else {
                st = kvt_add_paged(&r, &cap, spec, l, pool, KVW_ROLE_K, heads, kb, 0);
                if (st == KVW_OK)
                    st = kvt_add_paged(&r, &cap, spec, l, pool, KVW_ROLE_V, heads, vb, 0);
            }
            if (st == KVW_OK && m->scale_block) {
                st = kvt_add_paged(&r, &cap, spec, l, pool, KVW_ROLE_K_SCALE, heads, ksb, 0);
                if (st == KVW_OK)
                    st = kvt_add_paged(&r, &cap, spec, l, pool, KVW_ROLE_V_SCALE, heads, vsb, 0);
            }
        } else if (kind == KVW_LAYER_MLA) {
            st = kvt_add_paged(&r, &cap, spec, l, KVW_POOL_FULL, KVW_ROLE_LATENT, 1,
                               m->mla_dim * m->elem_size, 0);
        } else if (kind == KVW_LAYER_STATE) {
            for (uint32_t s = 0; s < r.model.num_state_bufs && st == KVW_OK; s++) {
                kvw_buffer_desc_t d;
                memset(&d, 0, sizeof(d));
                d.field_mask = KVW_BUFFER_FIELDS_ALL;
                d.pool = KVW_POOL_STATE;
                d.layer = l;
                d.role = KVW_ROLE_STATE;
                d.layout = spec->layout;
                d.page_size = 1;
                d.num_groups = r.model.state[s].num_groups;
                memcpy(d.groups, r.model.state[s].groups, sizeof(d.groups));
                d.length = kvt_unit_bytes(&d, spec->par.tp_size, spec->par.tp_rank) *
                           spec->num_slots;
                d.mem_kind = KVW_MEM_HOST;
                st = kvt_push(&r, &cap, &d);
            }
        }
    }
    if (st != KVW_OK)
        goto err_free;

    r.mem = calloc(r.num_bufs ? r.num_bufs : 1, sizeof(*r.mem));
    r.alloc_len = calloc(r.num_bufs ? r.num_bufs : 1, sizeof(*r.alloc_len));
    if (!r.mem || !r.alloc_len) {
        st = KVW_ERR_NO_MEMORY;
        goto err_free;
    }
    uint64_t fake = KVT_FAKE_BASE;
    for (uint32_t i = 0; i < r.num_bufs; i++) {
        kvw_buffer_desc_t *d = &r.bufs[i];
        if (r.describe_only) {
            d->addr = (void *)(uintptr_t)fake;
            fake += (d->length + 4095) & ~4095ull;
            fake += 4096;
            continue;
        }
        uint64_t total = d->length + 2ull * r.guard;
        void *p = NULL;
        if (posix_memalign(&p, 64, total ? total : 64)) {
            st = KVW_ERR_NO_MEMORY;
            goto err_free;
        }
        r.mem[i] = p;
        r.alloc_len[i] = d->length;
        for (uint32_t g = 0; g < r.guard; g++) {
            r.mem[i][g] = kvt_guard_byte(g, i);
            r.mem[i][r.guard + d->length + g] = kvt_guard_byte(r.guard + g, i);
        }
        d->addr = r.mem[i] + r.guard;
    }
    *rank_p = r;
    return KVW_OK;

err_free:
    kvt_rank_free(&r);
    return st;
}

kvw_status_t kvt_rank_open(kvt_rank_t *rank)
{
    kvw_rank_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL | KVW_RANK_FIELD_BUFFERS;
    kvt_model_relink(&rank->model);
    p.model = &rank->model.m;
    p.parallel = rank->par;
    p.parallel.field_mask = KVW_PARALLEL_FIELDS_ALL;
    p.buffers = rank->bufs;
    p.num_buffers = rank->num_bufs;
    return kvw_rank_create(&p, &rank->h);
}

kvw_status_t kvt_rank_build(const kvt_rank_spec_t *spec, kvt_rank_t *rank_p)
{
    kvt_rank_t r;
    kvw_status_t st = kvt_rank_describe(spec, &r);
    if (st != KVW_OK)
        return st;
    st = kvt_rank_open(&r);
    if (st != KVW_OK) {
        kvt_rank_free(&r);
        return st;
    }
    *rank_p = r;
    return KVW_OK;
}

void kvt_rank_free(kvt_rank_t *rank)
{
    if (!rank)
        return;
    if (rank->h)
        kvw_rank_destroy(rank->h);
    if (rank->mem)
        for (uint32_t i = 0; i < rank->num_bufs; i++)
            free(rank->mem[i]);
    free(rank->mem);
    free(rank->alloc_len);
    free(rank->bufs);
    memset(rank, 0, sizeof(*rank));
}

uint8_t *kvt_rank_data(const kvt_rank_t *rank, uint32_t i)
{
    if (rank->describe_only || !rank->mem || !rank->mem[i])
        return NULL;
    return rank->mem[i] + rank->guard;
}

int kvt_rank_check_guards(const kvt_rank_t *rank, char *msg, size_t cap)
{
    if (rank->describe_only)
        return 0;
    for (uint32_t i = 0; i < rank->num_bufs; i++) {
        const uint8_t *m = rank->mem[i];
        uint64_t len = rank->alloc_len[i];
        for (uint32_t g = 0; g < rank->guard; g++) {
            if (m[g] != kvt_guard_byte(g, i)) {
                snprintf(msg, cap, "buffer %u (layer %u %s): guard byte %u before the buffer "
                         "was overwritten", i, rank->bufs[i].layer,
                         kvt_role_name(rank->bufs[i].role), rank->guard - g);
                return -1;
            }
            if (m[rank->guard + len + g] != kvt_guard_byte(rank->guard + g, i)) {
                snprintf(msg, cap, "buffer %u (layer %u %s): guard byte %u after the buffer "
                         "was overwritten", i, rank->bufs[i].layer,
                         kvt_role_name(rank->bufs[i].role), g);
                return -1;
            }
        }
    }
    return 0;
}

void kvt_fill_pattern(void *dst, uint64_t len, uint64_t seed, uint64_t stream)
{
    uint8_t *p = dst;
    uint64_t base = kvt_mix64(seed ^ kvt_mix64(stream + 0x51ed27u));
    uint64_t w = 0;
    for (; (w + 1) * 8 <= len; w++) {
        uint64_t v = kvt_mix64(base + w);
        memcpy(p + w * 8, &v, 8);
    }
    if (w * 8 < len) {
        uint64_t v = kvt_mix64(base + w);
        memcpy(p + w * 8, &v, len - w * 8);
    }
}

void kvt_rank_fill(kvt_rank_t *rank, uint64_t seed)
{
    for (uint32_t i = 0; i < rank->num_bufs; i++) {
        uint8_t *d = kvt_rank_data(rank, i);
        if (d)
            kvt_fill_pattern(d, rank->bufs[i].length, seed, i);
    }
}

void kvt_rank_clear(kvt_rank_t *rank, uint8_t value)
{
    for (uint32_t i = 0; i < rank->num_bufs; i++) {
        uint8_t *d = kvt_rank_data(rank, i);
        if (d)
            memset(d, value, rank->bufs[i].length);
    }
}

/* Describes where byte `off` of buffer `i` lies, for failure messages. */
static void kvt_locate(const kvt_rank_t *rank, uint32_t i, uint64_t off, char *out, size_t cap)
{
    const kvw_buffer_desc_t *b = &rank->bufs[i];
    uint64_t unit = kvt_unit_bytes(b, rank->par.tp_size, rank->par.tp_rank);
    if (unit == 0) {
        snprintf(out, cap, "buffer %u offset %llu", i, (unsigned long long)off);
        return;
    }
    uint64_t page = off / unit, in = off % unit;
    if (b->pool == KVW_POOL_STATE) {
        snprintf(out, cap, "buffer %u (layer %u state) slot %llu byte %llu", i, b->layer,
                 (unsigned long long)page, (unsigned long long)in);
        return;
    }
    uint64_t plane_bytes = (uint64_t)b->page_size * b->num_heads * b->head_bytes;
    const char *plane = "";
    uint32_t hb = b->head_bytes;
    if (b->role == KVW_ROLE_KV) {
        plane = in < plane_bytes ? " K part" : " V part";
        if (in >= plane_bytes) {
            in -= plane_bytes;
            hb = b->v_head_bytes;
        }
    }
    uint64_t tok, head, byte;
    if (b->layout == KVW_LAYOUT_HND) {
        head = in / ((uint64_t)b->page_size * hb);
        tok = (in / hb) % b->page_size;
    } else {
        tok = in / ((uint64_t)b->num_heads * hb);
        head = (in / hb) % b->num_heads;
    }
    byte = in % hb;
    snprintf(out, cap,
             "buffer %u (layer %u %s %s pool)%s page %llu token-in-page %llu local head %llu "
             "byte %llu",
             i, b->layer, kvt_role_name(b->role), b->pool == KVW_POOL_SWA ? "swa" : "full", plane,
             (unsigned long long)page, (unsigned long long)tok, (unsigned long long)head,
             (unsigned long long)byte);
}

int kvt_rank_verify_fill(const kvt_rank_t *rank, uint64_t seed, char *msg, size_t cap)
{
    for (uint32_t i = 0; i < rank->num_bufs; i++) {
        const uint8_t *d = kvt_rank_data(rank, i);
        if (!d)
            continue;
        uint64_t len = rank->bufs[i].length;
        uint8_t tmp[4096];
        for (uint64_t off = 0; off < len; off += sizeof(tmp)) {
            /* Regenerate the pattern block by block; the pattern is word-indexed, so
             * a 4096-byte block starts at word off / 8. */
            uint64_t n = len - off < sizeof(tmp) ? len - off : sizeof(tmp);
            uint64_t base = kvt_mix64(seed ^ kvt_mix64(i + 0x51ed27u));
            for (uint64_t w = 0; w * 8 < n; w++) {
                uint64_t v = kvt_mix64(base + off / 8 + w);
                memcpy(tmp + w * 8, &v, n - w * 8 < 8 ? n - w * 8 : 8);
            }
            if (memcmp(tmp, d + off, n)) {
                uint64_t j = 0;
                while (tmp[j] == d[off + j])
                    j++;
                char where[256];
                kvt_locate(rank, i, off + j, where, sizeof(where));
                snprintf(msg, cap, "source byte changed: %s", where);
                return -1;
            }
        }
    }
    return 0;
}

static kvw_status_t kvt_copy_alloc(const kvt_rank_t *rank, kvt_copy_t *c, int copy)
{
    memset(c, 0, sizeof(*c));
    c->num_bufs = rank->num_bufs;
    c->data = calloc(rank->num_bufs ? rank->num_bufs : 1, sizeof(*c->data));
    c->len = calloc(rank->num_bufs ? rank->num_bufs : 1, sizeof(*c->len));
    if (!c->data || !c->len)
        goto err;
    for (uint32_t i = 0; i < rank->num_bufs; i++) {
        c->len[i] = rank->bufs[i].length;
        c->data[i] = malloc(c->len[i] ? c->len[i] : 1);
        if (!c->data[i])
            goto err;
        const uint8_t *src = kvt_rank_data(rank, i);
        if (copy && src)
            memcpy(c->data[i], src, c->len[i]);
        else
            memset(c->data[i], 0, c->len[i]);
    }
    return KVW_OK;
err:
    kvt_copy_free(c);
    return KVW_ERR_NO_MEMORY;
}

kvw_status_t kvt_copy_make(const kvt_rank_t *rank, kvt_copy_t *copy_p)
{
    return kvt_copy_alloc(rank, copy_p, 1);
}

kvw_status_t kvt_copy_zeroed(const kvt_rank_t *rank, kvt_copy_t *copy_p)
{
    return kvt_copy_alloc(rank, copy_p, 0);
}

void kvt_copy_free(kvt_copy_t *copy)
{
    if (copy->data)
        for (uint32_t i = 0; i < copy->num_bufs; i++)
            free(copy->data[i]);
    free(copy->data);
    free(copy->len);
    memset(copy, 0, sizeof(*copy));
}

static int kvt_compare_bytes(const kvt_rank_t *rank, uint32_t i, const uint8_t *got,
                             const uint8_t *want, uint64_t len, const char *what, char *msg,
                             size_t cap)
{
    if (!memcmp(got, want, len))
        return 0;
    uint64_t j = 0, ndiff = 0, first = UINT64_MAX;
    for (j = 0; j < len; j++)
        if (got[j] != want[j]) {
            if (first == UINT64_MAX)
                first = j;
            ndiff++;
        }
    char where[256];
    kvt_locate(rank, i, first, where, sizeof(where));
    snprintf(msg, cap, "%s: %llu bytes differ; first at %s: got 0x%02x, expected 0x%02x", what,
             (unsigned long long)ndiff, where, got[first], want[first]);
    return -1;
}

int kvt_copy_compare(const kvt_rank_t *rank, const kvt_copy_t *copy, const char *what, char *msg,
                     size_t cap)
{
    for (uint32_t i = 0; i < rank->num_bufs; i++) {
        const uint8_t *d = kvt_rank_data(rank, i);
        if (d && kvt_compare_bytes(rank, i, d, copy->data[i], rank->bufs[i].length, what, msg,
                                   cap))
            return -1;
    }
    return 0;
}

int kvt_copy_compare2(const kvt_rank_t *rank, const kvt_copy_t *a, const kvt_copy_t *b,
                      const char *what, char *msg, size_t cap)
{
    for (uint32_t i = 0; i < rank->num_bufs; i++)
        if (kvt_compare_bytes(rank, i, a->data[i], b->data[i], rank->bufs[i].length, what, msg,
                              cap))
            return -1;
    return 0;
}
