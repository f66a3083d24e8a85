/* The KV digest: per-unit sums of seeded 64-bit row hashes over a plan (digest.h). */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "plan/digest.h"
#include "plan/digest_seed.h"
#include "plan/rank.h"

#include <stdio.h>
#include <string.h>

uint64_t kvw__digest_seed(uint32_t layer, uint32_t comp, uint32_t head, uint64_t token)
{
    return kvw_digest_seed_of(kvw_digest_seed_base(layer, comp), head, token);
}

uint64_t kvw__digest_row(const void *row, size_t len, uint64_t seed)
{
    return XXH3_64bits_withSeed(row, len, seed);
}

/* Component codes in the seed: the paged components by kvw_comp_t; a state view's
 * group g of state buffer i as 16 + i * KVW_MAX_STATE_GROUPS + g. */
#define KVW_DIGEST_STATE_CODE 16u

static uint32_t kvw_view_units(kvw_rank_h r, const kvw_comp_view_t *v)
{
    if (v->comp != KVW_COMP_STATE)
        return v->num_heads;
    const kvw_buffer_desc_t *b = &r->bufs[v->buf];
    uint32_t n = 0;
    for (uint32_t g = 0; g < b->num_groups; g++) {
        uint32_t first = 0, count = 0;
        kvw_topo_heads(r->par.tp_size, r->par.tp_rank, b->groups[g].total_heads, &first, &count);
        n += count;
    }
    return n;
}

uint32_t kvw__digest_units(kvw_rank_h dst)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < dst->num_views; i++)
        n += kvw_view_units(dst, &dst->views[i]);
    return n;
}

/* Where a segment's heads sit in the destination's unit table, and what they are. */
typedef struct kvw_seg_unit {
    uint32_t unit;  /* the unit of the segment's first head */
    uint32_t comp;  /* component code of the seed */
    uint32_t head0; /* global head of the segment's first head (in its group, for state) */
    const kvw_comp_view_t *view;
    uint32_t group;
} kvw_seg_unit_t;

/* The unit base of view `vi` (views before it, all layers). */
static uint32_t kvw_view_base(kvw_rank_h dst, uint32_t vi)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < vi; i++)
        n += kvw_view_units(dst, &dst->views[i]);
    return n;
}

static bool kvw_seg_unit(kvw_rank_h dst, const kvw_seg_t *s, kvw_seg_unit_t *u)
{
    if (s->layer >= dst->model.num_layers)
        return false;
    for (uint32_t i = dst->layer_view_begin[s->layer]; i < dst->layer_view_begin[s->layer + 1];
         i++) {
        const kvw_comp_view_t *v = &dst->views[i];
        if (v->buf != s->dst_buf)
            continue;
        if (v->comp == KVW_COMP_STATE) {
            const kvw_buffer_desc_t *b = &dst->bufs[v->buf];
            uint64_t off = 0;
            uint32_t ub = 0;
            for (uint32_t g = 0; g < b->num_groups; g++) {
                uint32_t first = 0, count = 0;
                kvw_topo_heads(dst->par.tp_size, dst->par.tp_rank, b->groups[g].total_heads,
                               &first, &count);
                if (off == s->dst.plane_off) {
                    *u = (kvw_seg_unit_t){.unit = kvw_view_base(dst, i) + ub + s->dst_head,
                                          .comp = KVW_DIGEST_STATE_CODE +
                                                  v->state_index * KVW_MAX_STATE_GROUPS + g,
                                          .head0 = first + s->dst_head, .view = v, .group = g};
                    return true;
                }
                off += (uint64_t)count * b->groups[g].head_bytes;
                ub += count;
            }
            return false;
        }
        if (v->view.plane_off != s->dst.plane_off)
            continue;
        uint32_t total = dst->model.layers[s->layer].kind == KVW_LAYER_MLA
                             ? 1 : dst->model.num_kv_heads;
        uint32_t first = 0, count = 0;
        kvw_topo_heads(dst->par.tp_size, dst->par.tp_rank, total, &first, &count);
        *u = (kvw_seg_unit_t){.unit = kvw_view_base(dst, i) + s->dst_head, .comp = v->comp,
                              .head0 = first + s->dst_head, .view = v};
        return true;
    }
    return false;
}

/* Adds the row hashes of one token's heads [head0, head0 + nh) (rows `stride` apart from
 * `row0`) to acc[0 .. nh). The same XXH3_64bits_withSeed whatever the length; for the
 * common row lengths it is instantiated with a constant length, so that the compiler
 * drops XXH3's dispatch by length and unrolls the one path taken (about 15% faster on
 * 128-byte rows in cache). */
static inline __attribute__((always_inline)) void
kvw_hash_rows(uint64_t *acc, const uint8_t *row0, uint64_t stride, uint32_t nh, size_t len,
              uint64_t base0, uint32_t head0, uint64_t t)
{
    for (uint32_t k = 0; k < nh; k++)
        acc[k] += XXH3_64bits_withSeed(row0 + (uint64_t)k * stride, len,
                                       kvw_digest_seed_of(base0, head0 + k, t));
}

static void kvw_hash_token(uint64_t *acc, const uint8_t *row0, uint64_t stride, uint32_t nh,
                           size_t len, uint64_t base0, uint32_t head0, uint64_t t)
{
    switch (len) {
    case 64: kvw_hash_rows(acc, row0, stride, nh, 64, base0, head0, t); break;
    case 128: kvw_hash_rows(acc, row0, stride, nh, 128, base0, head0, t); break;
    case 256: kvw_hash_rows(acc, row0, stride, nh, 256, base0, head0, t); break;
    default: kvw_hash_rows(acc, row0, stride, nh, len, base0, head0, t); break;
    }
}

/* One cache line asked for. Written as a volatile asm where the instruction is known:
 * GCC 12 deletes a loop whose body is only __builtin_prefetch (it counts as having no
 * effect), and these loops are exactly that. */
static inline void kvw_prefetch(const uint8_t *p)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p));
#elif defined(__aarch64__)
    __asm__ volatile("prfm pldl1keep, %0" : : "Q"(*(const char *)p));
#else
    __builtin_prefetch(p);
#endif
}

/* Asks for one token's rows ahead of their hashing. A head slice's rows sit a whole
 * token's row apart (a TP1 source read for one of four decode ranks: 256 of every 1024
 * bytes), a stride the hardware prefetchers do not follow: without this the hash waits
 * on memory row by row (13 MB in 10.3 ms on the 2-core development host, 1.6 ms with
 * it). */
static inline void kvw_prefetch_rows(const uint8_t *row0, uint64_t stride, uint32_t nh,
                                     size_t len)
{
    for (uint32_t k = 0; k < nh; k++)
        for (size_t o = 0; o < len; o += 64)
            kvw_prefetch(row0 + (uint64_t)k * stride + o);
}

/* How many tokens ahead the rows are asked for: enough to cover a memory latency with a
 * few hundred bytes hashed per token. */
#define KVW_DIGEST_PREFETCH 8u

static const uint8_t *kvw_buf_base(kvw_rank_h r, uint32_t b)
{
    return b < r->num_bufs ? (const uint8_t *)r->bufs[b].addr : NULL;
}

kvw_status_t kvw__plan_digest(const struct kvw_plan *plan, bool dst_side, const uint8_t *take,
                              uint32_t layer_begin, uint64_t *units, uint32_t num_units)
{
    kvw_rank_h side = dst_side ? plan->dst : plan->src;
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        if (take && (s->layer < layer_begin || !take[s->layer - layer_begin]))
            continue;
        if (s->tok_begin >= s->tok_end || s->num_heads == 0)
            continue;
        kvw_seg_unit_t u;
        if (!kvw_seg_unit(plan->dst, s, &u) || u.unit + s->num_heads > num_units)
            return kvw__error(KVW_ERR_INTERNAL, "digest: segment %u (layer %u) names no unit "
                              "of the destination", i, s->layer);
        const kvw_view_t *v = dst_side ? &s->dst : &s->src;
        const kvw_page_map_t *m = dst_side ? &plan->dst_maps[s->pool] : &plan->src_maps[s->pool];
        const uint8_t *base = kvw_buf_base(side, dst_side ? s->dst_buf : s->src_buf);
        uint32_t h0 = dst_side ? s->dst_head : s->src_head;
        if (base == NULL || m->pages == NULL)
            return kvw__error(KVW_ERR_INTERNAL, "digest: segment %u (layer %u) has no %s pages",
                              i, s->layer, dst_side ? "destination" : "source");
        uint64_t *acc = units + u.unit;
        uint64_t base0 = kvw_digest_seed_base(s->layer, u.comp);
        uint32_t ps = v->page_size ? v->page_size : 1;
        for (uint64_t t = s->tok_begin; t < s->tok_end;) {
            uint64_t rel = t - m->first_token;
            uint64_t in = rel % ps;
            const uint8_t *pb = base + (uint64_t)m->pages[rel / ps] * v->page_stride +
                                v->plane_off;
            uint64_t n = KVW_MIN(ps - in, s->tok_end - t);
            const uint8_t *r0 = pb + (uint64_t)h0 * v->head_stride;
            for (uint64_t j = 0; j < KVW_MIN(n, (uint64_t)KVW_DIGEST_PREFETCH); j++)
                kvw_prefetch_rows(r0 + (in + j) * v->token_stride, v->head_stride,
                                  s->num_heads, s->head_bytes);
            for (uint64_t j = 0; j < n; j++) {
                if (j + KVW_DIGEST_PREFETCH < n)
                    kvw_prefetch_rows(r0 + (in + j + KVW_DIGEST_PREFETCH) * v->token_stride,
                                      v->head_stride, s->num_heads, s->head_bytes);
                kvw_hash_token(acc, r0 + (in + j) * v->token_stride, v->head_stride,
                               s->num_heads, s->head_bytes, base0, u.head0, t + j);
            }
            t += n;
        }
    }
    return KVW_OK;
}

static const char *kvw_comp_name(kvw_comp_t c)
{
    switch (c) {
    case KVW_COMP_K: return "K";
    case KVW_COMP_V: return "V";
    case KVW_COMP_LATENT: return "latent";
    case KVW_COMP_STATE: return "state";
    case KVW_COMP_K_SCALE: return "K scale";
    case KVW_COMP_V_SCALE: return "V scale";
    }
    return "?";
}

void kvw__digest_locate(const struct kvw_plan *plan, uint32_t unit, char *buf, size_t cap)
{
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        const kvw_seg_t *s = &plan->segs[i];
        kvw_seg_unit_t u;
        if (!kvw_seg_unit(plan->dst, s, &u) || unit < u.unit || unit >= u.unit + s->num_heads)
            continue;
        uint32_t head = u.head0 + (unit - u.unit);
        if (u.view->comp == KVW_COMP_STATE)
            snprintf(buf, cap, "layer %u state %u group %u head %u", s->layer,
                     u.view->state_index, u.group, head);
        else
            snprintf(buf, cap, "layer %u %s head %u tokens [%llu, %llu)", s->layer,
                     kvw_comp_name(u.view->comp), head, (unsigned long long)s->tok_begin,
                     (unsigned long long)s->tok_end);
        return;
    }
    snprintf(buf, cap, "unit %u", unit);
}

bool kvw__digest_seg(const struct kvw_plan *plan, uint32_t i, uint32_t *unit_p,
                     uint64_t *seed_base_p, uint32_t *head0_p)
{
    kvw_seg_unit_t u;
    if (i >= plan->num_segs || !kvw_seg_unit(plan->dst, &plan->segs[i], &u))
        return false;
    *unit_p = u.unit;
    *seed_base_p = kvw_digest_seed_base(plan->segs[i].layer, u.comp);
    *head0_p = u.head0;
    return true;
}

void kvw__digest_secret(uint64_t words[KVW_DIGEST_SECRET_WORDS])
{
    uint8_t b[8 * KVW_DIGEST_SECRET_WORDS];
    _Static_assert(sizeof(b) == XXH3_SECRET_DEFAULT_SIZE, "XXH3's default secret is 192 bytes");
    XXH3_generateSecret_fromSeed(b, 0); /* seed 0: the default secret itself */
    for (unsigned i = 0; i < KVW_DIGEST_SECRET_WORDS; i++) {
        uint64_t w = 0;
        for (unsigned k = 0; k < 8; k++)
            w |= (uint64_t)b[8 * i + k] << (8 * k);
        words[i] = w;
    }
}
