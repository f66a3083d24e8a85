/*
 * Compact plans: for one (source rank, destination rank, chunk), one segment per
 * (layer component, head route) plus each side's page list for the pages the chunk
 * touches. Validation happens here, before any byte moves.
 */
#include "core/mask.h"
#include "plan/rank.h"
#include "topo/topo.h"

#include <string.h>

/* Routes between the two ranks only, for one head count. */
typedef struct kvw_pair_routes {
    uint32_t n;
    kvw_route_t r[64];
} kvw_pair_routes_t;

static kvw_status_t kvw_pair_routes(kvw_rank_h src, kvw_rank_h dst, uint32_t heads,
                                    kvw_pair_routes_t *out)
{
    kvw_route_t stack[256];
    kvw_route_t *all = stack;
    size_t n = 0;
    kvw_status_t st = kvw__topo_routes_to(src->par.tp_size, dst->par.tp_size, heads,
                                          dst->par.tp_rank, stack, KVW_ARRAY_SIZE(stack), &n);
    if (st == KVW_ERR_BUFFER_TOO_SMALL) {
        all = malloc(n * sizeof(*all));
        if (all == NULL)
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory computing routes");
        st = kvw__topo_routes_to(src->par.tp_size, dst->par.tp_size, heads, dst->par.tp_rank, all,
                                 n, &n);
    }
    if (st != KVW_OK)
        goto out;
    out->n = 0;
    for (size_t i = 0; i < n; i++) {
        if (all[i].src_rank != src->par.tp_rank || all[i].dst_rank != dst->par.tp_rank)
            continue;
        if (out->n == KVW_ARRAY_SIZE(out->r)) {
            st = kvw__error(KVW_ERR_UNSUPPORTED, "more than %zu routes between one rank pair",
                            KVW_ARRAY_SIZE(out->r));
            goto out;
        }
        out->r[out->n++] = all[i];
    }
out:
    if (all != stack)
        free(all);
    return st;
}

typedef struct kvw_token_ranges {
    uint64_t full_begin, full_end;
    bool last;
} kvw_token_ranges_t;

static void kvw_swa_range(const kvw_chunk_t *c, uint32_t window, uint64_t *b, uint64_t *e)
{
    uint64_t ws = c->num_tokens > window ? c->num_tokens - window : 0;
    *b = KVW_MAX(ws, c->prefix_len);
    *e = c->num_tokens;
    if (*b > *e)
        *b = *e;
}

/*
 * Checks that a side's page list covers [tb, te), that the pages it needs are inside
 * the pool's buffers, and (destination) that no page is listed twice; then copies the
 * needed part into `store` and points `map` at it.
 */
static kvw_status_t kvw_map_pages(const char *side, const char *pool_name, const kvw_pages_t *pl,
                                  uint32_t page_size, uint64_t capacity, uint64_t tb, uint64_t te,
                                  bool check_dups, uint32_t *store, kvw_page_map_t *map)
{
    if (tb >= te) {
        map->pages = store;
        map->num_pages = 0;
        map->first_token = 0;
        return KVW_OK;
    }
    if (pl->first_token % page_size)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s %s pages: first token %llu is not a multiple "
                          "of the page size %u", side, pool_name,
                          (unsigned long long)pl->first_token, page_size);
    if (pl->num_pages && pl->pages == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s %s pages: NULL page list", side, pool_name);
    if (pl->first_token > (1ull << 40))
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "%s %s pages: first token %llu is beyond 2^40",
                          side, pool_name, (unsigned long long)pl->first_token);
    uint64_t covered_end = pl->first_token + (uint64_t)pl->num_pages * page_size;
    if (pl->first_token > tb || covered_end < te)
        return kvw__error(KVW_ERR_OUT_OF_RANGE,
                          "%s %s page list is too short: %u pages of %u tokens from token %llu "
                          "cover [%llu, %llu), the transfer needs [%llu, %llu)", side, pool_name,
                          pl->num_pages, page_size, (unsigned long long)pl->first_token,
                          (unsigned long long)pl->first_token, (unsigned long long)covered_end,
                          (unsigned long long)tb, (unsigned long long)te);
    uint64_t i0 = (tb - pl->first_token) / page_size;
    uint64_t i1 = (te - pl->first_token + page_size - 1) / page_size;
    uint32_t n = (uint32_t)(i1 - i0);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = pl->pages[i0 + i];
        if (p >= capacity)
            return kvw__error(KVW_ERR_OUT_OF_RANGE,
                              "%s %s page index %u (list entry %llu) is outside the buffers, "
                              "which hold %llu pages", side, pool_name, p,
                              (unsigned long long)(i0 + i), (unsigned long long)capacity);
        store[i] = p;
    }
    if (check_dups && n > 1) {
        /* A bitmap over the pool's capacity: linear time, no sorting. */
        uint64_t words = (capacity + 63) / 64;
        uint64_t stackbits[256];
        uint64_t *bits = words <= KVW_ARRAY_SIZE(stackbits) ? stackbits
                                                             : calloc(words, sizeof(uint64_t));
        if (bits == NULL)
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory checking pages");
        if (bits == stackbits)
            memset(bits, 0, words * sizeof(uint64_t));
        kvw_status_t st = KVW_OK;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t p = store[i];
            if (bits[p / 64] & (1ull << (p % 64))) {
                st = kvw__error(KVW_ERR_INVALID_PARAM,
                                "%s %s page %u is listed twice in one request", side, pool_name,
                                p);
                break;
            }
            bits[p / 64] |= 1ull << (p % 64);
        }
        if (bits != stackbits)
            free(bits);
        if (st != KVW_OK)
            return st;
    }
    map->pages = store;
    map->num_pages = n;
    map->first_token = pl->first_token + i0 * page_size;
    return KVW_OK;
}

/* Appends a segment, growing the array geometrically. */
static kvw_seg_t *kvw_plan_push(struct kvw_plan *plan, uint32_t *cap)
{
    if (plan->num_segs == *cap) {
        uint32_t ncap = *cap ? *cap * 2 : 64;
        kvw_seg_t *n = realloc(plan->segs, sizeof(*n) * ncap);
        if (n == NULL)
            return NULL;
        plan->segs = n;
        *cap = ncap;
    }
    return &plan->segs[plan->num_segs++];
}

static const char *kvw_pool_names[KVW_NUM_POOLS] = {"full-attention", "sliding-window", "state"};

static kvw_status_t kvw_plan_build(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                   const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                                   kvw_plan_h *plan_p);

/* The public entry: checks the field masks of the caller's structs and fills in the
 * defaults of the fields they leave out. */
kvw_status_t kvw_plan_create(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                             const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                             kvw_plan_h *plan_p)
{
    if (!src || !dst || !chunk || !sp || !dp || !plan_p)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_plan_create: NULL argument");
    kvw_chunk_t c;
    kvw_side_pages_t s, d;
    kvw_status_t st = kvw__chunk_norm(chunk, "kvw_plan_create: chunk", &c);
    if (st == KVW_OK)
        st = kvw__side_pages_norm(sp, "kvw_plan_create: src_pages", &s);
    if (st == KVW_OK)
        st = kvw__side_pages_norm(dp, "kvw_plan_create: dst_pages", &d);
    if (st != KVW_OK)
        return st;
    return kvw_plan_build(src, dst, &c, &s, &d, plan_p);
}

kvw_status_t kvw__plan_create(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                              const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                              kvw_plan_h *plan_p)
{
    if (!sp || !dp)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_plan_create: NULL argument");
    return kvw_plan_build(src, dst, chunk, sp, dp, plan_p);
}

/* Used by the protocol to know a sender's byte count and whether a pair exchanges
 * anything at all, before any page list exists. */
kvw_status_t kvw__plan_create_nopages(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                      kvw_plan_h *plan_p)
{
    return kvw_plan_build(src, dst, chunk, NULL, NULL, plan_p);
}

kvw_status_t kvw__plan_create_staged(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                     const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                                     kvw_plan_h *plan_p)
{
    if ((sp == NULL) == (dp == NULL))
        return kvw__error(KVW_ERR_INVALID_PARAM, "a staged plan takes the pages of exactly one "
                          "side");
    return kvw_plan_build(src, dst, chunk, sp, dp, plan_p);
}

/* A side given no pages: the map of a staged stream's far side, whose page indices never
 * matter, only where its pages begin (runs stay inside one page on both sides). Pages
 * start at multiples of the page size, so the first page holding token tb begins at tb
 * rounded down, whatever the far side's list. */
static void kvw_geometry_map(uint32_t page_size, uint64_t tb, uint64_t te, kvw_page_map_t *map)
{
    map->pages = NULL;
    map->num_pages = 0;
    map->first_token = tb < te ? tb - tb % page_size : 0;
}

/* One side's map of pool p (not the state pool) for tokens [tb, te): the side's page
 * list copied to *store_p, which then points past it, or with pages NULL its geometry
 * only. The destination's list is checked for repeated pages. */
static kvw_status_t kvw_side_map(kvw_rank_h rank, const kvw_side_pages_t *pages, int p, bool dst,
                                 uint64_t tb, uint64_t te, uint32_t **store_p,
                                 kvw_page_map_t *map)
{
    uint32_t page_size = KVW_MAX(rank->pool_page_size[p], 1);
    if (pages == NULL) {
        kvw_geometry_map(page_size, tb, te, map);
        return KVW_OK;
    }
    kvw_status_t st = kvw_map_pages(dst ? "destination" : "source", kvw_pool_names[p],
                                    p == KVW_POOL_FULL ? &pages->full : &pages->swa, page_size,
                                    rank->pool_capacity[p], tb, te, dst, *store_p, map);
    if (st == KVW_OK)
        *store_p += map->num_pages;
    return st;
}

/* A chunk's token range must fit its request (and kvwire's limit on requests). */
static kvw_status_t kvw_chunk_check(const kvw_chunk_t *chunk)
{
    if (chunk->chunk_begin > chunk->chunk_end || chunk->chunk_end > chunk->num_tokens ||
        chunk->prefix_len > chunk->num_tokens)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "chunk [%llu, %llu) with prefix %llu does not fit a %llu-token request",
                          (unsigned long long)chunk->chunk_begin,
                          (unsigned long long)chunk->chunk_end,
                          (unsigned long long)chunk->prefix_len,
                          (unsigned long long)chunk->num_tokens);
    if (chunk->num_tokens > (1ull << 40))
        return kvw__error(KVW_ERR_INVALID_PARAM, "a request of %llu tokens is beyond kvwire's "
                          "limit of 2^40", (unsigned long long)chunk->num_tokens);
    if (chunk->last_chunk && chunk->chunk_end != chunk->num_tokens)
        return kvw__error(KVW_ERR_INVALID_PARAM, "the last chunk must end at token %llu, not %llu",
                          (unsigned long long)chunk->num_tokens,
                          (unsigned long long)chunk->chunk_end);
    return KVW_OK;
}

/* The token range [need_b, need_e) each pool needs over layers [lb, le) of the chunk
 * (model m, over the layers the destination holds views of; empty: need_b >= need_e);
 * returns whether state layers move (the last chunk). */
static bool kvw_pool_needs(const kvw_model_t *m, kvw_rank_h dst, const kvw_chunk_t *chunk,
                           uint32_t lb, uint32_t le, uint64_t need_b[KVW_NUM_POOLS],
                           uint64_t need_e[KVW_NUM_POOLS])
{
    for (int p = 0; p < KVW_NUM_POOLS; p++)
        need_b[p] = UINT64_MAX, need_e[p] = 0;
    bool any_state = false;
    uint64_t fb = KVW_MAX(chunk->chunk_begin, chunk->prefix_len), fe = chunk->chunk_end;
    for (uint32_t l = lb; l < le; l++) {
        if (dst->layer_view_begin[l] == dst->layer_view_begin[l + 1])
            continue;
        uint64_t b = 0, e = 0;
        switch (m->layers[l].kind) {
        case KVW_LAYER_FULL:
        case KVW_LAYER_MLA:
            b = fb, e = fe;
            break;
        case KVW_LAYER_SWA:
            if (chunk->last_chunk)
                kvw_swa_range(chunk, m->layers[l].window, &b, &e);
            break;
        case KVW_LAYER_STATE:
            any_state |= chunk->last_chunk != 0;
            break;
        default:
            break;
        }
        kvw_pool_t pool = m->layers[l].kind == KVW_LAYER_SWA ? KVW_POOL_SWA : KVW_POOL_FULL;
        if (b < e) {
            need_b[pool] = KVW_MIN(need_b[pool], b);
            need_e[pool] = KVW_MAX(need_e[pool], e);
        }
    }
    return any_state;
}

/* The segments of one state view (buffers sb and db): each group is sharded on its own;
 * its units sit side by side in a slot. */
static kvw_status_t kvw_plan_state_segs(struct kvw_plan *plan, uint32_t *seg_cap,
                                        const kvw_seg_t *base, const kvw_buffer_desc_t *sb,
                                        const kvw_buffer_desc_t *db, uint32_t *nroutes)
{
    kvw_rank_h src = plan->src, dst = plan->dst;
    uint64_t soff = 0, doff = 0;
    for (uint32_t g = 0; g < db->num_groups; g++) {
        kvw_pair_routes_t gr;
        uint32_t first, scount, dcount;
        kvw_status_t st = kvw_pair_routes(src, dst, db->groups[g].total_heads, &gr);
        if (st != KVW_OK)
            return st;
        kvw_topo_heads(src->par.tp_size, src->par.tp_rank, sb->groups[g].total_heads,
                       &first, &scount);
        kvw_topo_heads(dst->par.tp_size, dst->par.tp_rank, db->groups[g].total_heads,
                       &first, &dcount);
        uint32_t hb = db->groups[g].head_bytes;
        for (uint32_t r = 0; r < gr.n; r++) {
            kvw_seg_t *s = kvw_plan_push(plan, seg_cap);
            if (s == NULL)
                return kvw__error(KVW_ERR_NO_MEMORY, "out of memory building a plan");
            *s = *base;
            s->head_bytes = hb;
            s->num_heads = gr.r[r].num_heads;
            s->src_head = gr.r[r].src_head_start;
            s->dst_head = gr.r[r].dst_head_start;
            s->src.plane_off = soff;
            s->dst.plane_off = doff;
            s->src.head_stride = s->dst.head_stride = hb;
        }
        *nroutes = KVW_MAX(*nroutes, gr.n);
        soff += (uint64_t)scount * hb;
        doff += (uint64_t)dcount * hb;
    }
    return KVW_OK;
}

/* sp or dp NULL: that side has geometry only (kvw_geometry_map). */
static kvw_status_t kvw_plan_build(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                   const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                                   kvw_plan_h *plan_p)
{
    kvw_status_t st;
    if (!src || !dst || !chunk || !plan_p)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_plan_create: NULL argument");
    if ((st = kvw_chunk_check(chunk)) != KVW_OK)
        return st;
    st = kvw_rank_check_compatible(src, dst);
    if (st != KVW_OK)
        return st;

    const kvw_model_t *m = &src->model;
    uint32_t lb = KVW_MAX(src->par.layer_begin, dst->par.layer_begin);
    uint32_t le = KVW_MIN(src->par.layer_end, dst->par.layer_end);

    /* Token ranges each pool needs over the layers both ranks hold. */
    uint64_t need_b[KVW_NUM_POOLS], need_e[KVW_NUM_POOLS];
    bool any_state = kvw_pool_needs(m, dst, chunk, lb, le, need_b, need_e);
    uint64_t fb = KVW_MAX(chunk->chunk_begin, chunk->prefix_len), fe = chunk->chunk_end;
    if (any_state && (sp || dp)) {
        /* A side without pages has no slot either: checked as slot 0. */
        int64_t ss = sp ? sp->state_slot : 0, ds = dp ? dp->state_slot : 0;
        if (ss < 0 || ds < 0)
            return kvw__error(KVW_ERR_INVALID_PARAM, "the model has state layers but the %s side "
                              "gave no state slot", ss < 0 ? "source" : "destination");
        if ((sp && (uint64_t)ss >= src->pool_capacity[KVW_POOL_STATE]) ||
            (dp && (uint64_t)ds >= dst->pool_capacity[KVW_POOL_STATE]))
            return kvw__error(KVW_ERR_OUT_OF_RANGE,
                              "state slot %lld (source, %llu slots) or %lld (destination, %llu "
                              "slots) is out of range", (long long)ss,
                              (unsigned long long)src->pool_capacity[KVW_POOL_STATE],
                              (long long)ds,
                              (unsigned long long)dst->pool_capacity[KVW_POOL_STATE]);
    }

    /* Page storage: the needed part of each paged list on both sides, plus state slots.
     * Bounded by the lists the caller gave (which must cover the range, checked below),
     * never by the token count alone. */
    uint64_t npages = 2;
    for (int p = 0; p < KVW_POOL_STATE; p++) {
        if (need_b[p] >= need_e[p])
            continue;
        if (sp)
            npages += (p == KVW_POOL_FULL ? &sp->full : &sp->swa)->num_pages;
        if (dp)
            npages += (p == KVW_POOL_FULL ? &dp->full : &dp->swa)->num_pages;
    }

    /* Segments: count first. */
    kvw_pair_routes_t attn = {0}, mla = {0};
    if (m->num_kv_heads) {
        bool has_attn = false;
        for (uint32_t l = lb; l < le; l++)
            has_attn |= m->layers[l].kind == KVW_LAYER_FULL || m->layers[l].kind == KVW_LAYER_SWA;
        if (has_attn && (st = kvw_pair_routes(src, dst, m->num_kv_heads, &attn)) != KVW_OK)
            return st;
    }
    if ((st = kvw_pair_routes(src, dst, 1, &mla)) != KVW_OK)
        return st;

    struct kvw_plan *plan = calloc(1, sizeof(*plan));
    if (plan == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory building a plan");
    plan->src = src;
    plan->dst = dst;
    uint32_t seg_cap = 0;
    plan->page_storage = malloc(sizeof(uint32_t) * npages);
    if (plan->page_storage == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory building a plan");
        goto err_free;
    }

    uint32_t *store = plan->page_storage;
    for (int p = 0; p < KVW_POOL_STATE; p++) {
        uint64_t b = need_b[p] < need_e[p] ? need_b[p] : 0, e = need_b[p] < need_e[p] ? need_e[p] : 0;
        if ((st = kvw_side_map(src, sp, p, false, b, e, &store, &plan->src_maps[p])) != KVW_OK ||
            (st = kvw_side_map(dst, dp, p, true, b, e, &store, &plan->dst_maps[p])) != KVW_OK)
            goto err_free;
    }
    if (any_state) {
        if (sp)
            *store = (uint32_t)sp->state_slot;
        plan->src_maps[KVW_POOL_STATE] = (kvw_page_map_t){sp ? store++ : NULL, sp ? 1 : 0, 0};
        if (dp)
            *store = (uint32_t)dp->state_slot;
        plan->dst_maps[KVW_POOL_STATE] = (kvw_page_map_t){dp ? store++ : NULL, dp ? 1 : 0, 0};
    }

    uint32_t nroutes = 0;
    for (uint32_t l = lb; l < le; l++) {
        kvw_layer_kind_t kind = m->layers[l].kind;
        uint64_t tb = 0, te = 0;
        if (kind == KVW_LAYER_FULL || kind == KVW_LAYER_MLA)
            tb = fb, te = fe;
        else if (kind == KVW_LAYER_SWA && chunk->last_chunk)
            kvw_swa_range(chunk, m->layers[l].window, &tb, &te);
        else if (kind == KVW_LAYER_STATE && any_state)
            tb = 0, te = 1;
        if (tb >= te)
            continue;
        for (uint32_t i = dst->layer_view_begin[l]; i < dst->layer_view_begin[l + 1]; i++) {
            const kvw_comp_view_t *dv = &dst->views[i];
            const kvw_comp_view_t *sv = kvw__rank_find_view(src, dv);
            kvw_seg_t base = {.src_buf = sv->buf, .dst_buf = dv->buf, .pool = dv->pool,
                              .tok_begin = tb, .tok_end = te, .layer = l, .src = sv->view,
                              .dst = dv->view};
            if (dv->comp == KVW_COMP_STATE) {
                if ((st = kvw_plan_state_segs(plan, &seg_cap, &base, &src->bufs[sv->buf],
                                              &dst->bufs[dv->buf], &nroutes)) != KVW_OK)
                    goto err_free;
                continue;
            }
            const kvw_pair_routes_t *rt = kind == KVW_LAYER_MLA ? &mla : &attn;
            nroutes = KVW_MAX(nroutes, rt->n);
            for (uint32_t r = 0; r < rt->n; r++) {
                kvw_seg_t *s = kvw_plan_push(plan, &seg_cap);
                if (s == NULL) {
                    st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory building a plan");
                    goto err_free;
                }
                *s = base;
                s->head_bytes = dv->head_bytes;
                s->num_heads = rt->r[r].num_heads;
                s->src_head = rt->r[r].src_head_start;
                s->dst_head = rt->r[r].dst_head_start;
            }
        }
    }
    plan->num_routes = nroutes;
    for (uint32_t i = 0; i < plan->num_segs; i++)
        plan->bytes += kvw__seg_bytes(&plan->segs[i]);
    plan->alloc_bytes = sizeof(*plan) + sizeof(*plan->segs) * seg_cap +
                        sizeof(uint32_t) * npages;
    *plan_p = plan;
    return KVW_OK;

err_free:
    kvw_plan_destroy(plan);
    return st;
}

void kvw__plan_keep_layers(struct kvw_plan *plan, const uint8_t *keep, uint32_t layer_begin,
                           uint32_t n)
{
    uint32_t kept = 0;
    plan->bytes = 0;
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        uint32_t l = plan->segs[i].layer;
        if (l < layer_begin || l - layer_begin >= n || !keep[l - layer_begin])
            continue;
        plan->segs[kept++] = plan->segs[i];
        plan->bytes += kvw__seg_bytes(&plan->segs[i]);
    }
    plan->num_segs = kept;
}

void kvw_plan_destroy(kvw_plan_h plan)
{
    if (plan == NULL)
        return;
    free(plan->segs);
    free(plan->page_storage);
    free(plan);
}
