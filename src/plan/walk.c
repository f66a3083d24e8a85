/*
 * Walking a plan: a segment is cut into token runs that stay inside one page on both
 * sides; each run is a box of (tokens x heads) elements of head_bytes each, copied in
 * the loop order that makes contiguous chunks longest on both sides.
 */
#include "core/mask.h"
#include "plan/walk.h"

void kvw__box_make(const kvw_seg_t *s, uint64_t L, kvw_box_t *b)
{
    uint64_t hb = s->head_bytes, n = s->num_heads;
    /* Order A: tokens outer, heads inner. Order B: heads outer, tokens inner. */
    struct {
        uint64_t on, in, os_s, os_d, is_s, is_d;
    } o[2] = {{L, n, s->src.token_stride, s->dst.token_stride, s->src.head_stride,
               s->dst.head_stride},
              {n, L, s->src.head_stride, s->dst.head_stride, s->src.token_stride,
               s->dst.token_stride}};
    int best = 0;
    uint64_t best_chunk = 0;
    bool best_whole = false;
    for (int k = 0; k < 2; k++) {
        bool inner = o[k].in == 1 || (o[k].is_s == hb && o[k].is_d == hb);
        bool whole = inner && (o[k].on == 1 || (o[k].os_s == o[k].in * hb &&
                                                o[k].os_d == o[k].in * hb));
        uint64_t chunk = whole ? o[k].on * o[k].in * hb : inner ? o[k].in * hb : hb;
        if (chunk > best_chunk || (whole && !best_whole)) {
            best = k, best_chunk = chunk, best_whole = whole;
        }
    }
    b->chunk = best_chunk;
    if (best_whole) {
        b->outer_n = b->inner_n = 1;
        b->os_s = b->os_d = b->is_s = b->is_d = 0;
    } else if (best_chunk == o[best].in * hb) {
        b->outer_n = o[best].on;
        b->inner_n = 1;
        b->os_s = o[best].os_s, b->os_d = o[best].os_d;
        b->is_s = b->is_d = 0;
    } else {
        b->outer_n = o[best].on;
        b->inner_n = o[best].in;
        b->os_s = o[best].os_s, b->os_d = o[best].os_d;
        b->is_s = o[best].is_s, b->is_d = o[best].is_d;
    }
}

kvw_status_t kvw__seg_walk(const struct kvw_plan *plan, const kvw_seg_t *s, kvw_emit_fn emit,
                           void *arg)
{
    const kvw_page_map_t *sm = &plan->src_maps[s->pool], *dm = &plan->dst_maps[s->pool];
    uint64_t t = s->tok_begin;
    while (t < s->tok_end) {
        uint64_t L = kvw__run_len(s, sm, dm, t);
        uint64_t so = kvw__view_offset(&s->src, sm, t, s->src_head);
        uint64_t doff = kvw__view_offset(&s->dst, dm, t, s->dst_head);
        kvw_box_t b;
        kvw__box_make(s, L, &b);
        for (uint64_t i = 0; i < b.outer_n; i++)
            for (uint64_t j = 0; j < b.inner_n; j++) {
                kvw_status_t st = emit(arg, s, so + i * b.os_s + j * b.is_s,
                                       doff + i * b.os_d + j * b.is_d, b.chunk);
                if (st != KVW_OK)
                    return st;
            }
        t += L;
    }
    return KVW_OK;
}

typedef struct kvw_expand_ctx {
    kvw_run_cb_t cb;
    void *arg;
    kvw_run_t pending;
    bool have;
    uint64_t count;
} kvw_expand_ctx_t;

static kvw_status_t kvw_expand_emit(void *arg, const kvw_seg_t *s, uint64_t so, uint64_t doff,
                                    uint64_t len)
{
    kvw_expand_ctx_t *c = arg;
    kvw_run_t *p = &c->pending;
    if (c->have && p->src_buf == s->src_buf && p->dst_buf == s->dst_buf &&
        p->src_off + p->len == so && p->dst_off + p->len == doff) {
        p->len += len;
        return KVW_OK;
    }
    if (c->have) {
        c->count++;
        if (c->cb) {
            kvw_status_t st = c->cb(c->arg, p);
            if (st != KVW_OK)
                return st;
        }
    }
    *p = (kvw_run_t){.field_mask = KVW_RUN_FIELDS_ALL, .src_buf = s->src_buf,
                     .dst_buf = s->dst_buf, .src_off = so, .dst_off = doff, .len = len};
    c->have = true;
    return KVW_OK;
}

static kvw_status_t kvw_plan_expand_count(kvw_plan_h plan, kvw_run_cb_t cb, void *arg,
                                          uint64_t *count)
{
    kvw_expand_ctx_t c = {.cb = cb, .arg = arg};
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        kvw_status_t st = kvw__seg_walk(plan, &plan->segs[i], kvw_expand_emit, &c);
        if (st != KVW_OK)
            return st;
    }
    if (c.have) {
        c.count++;
        if (cb) {
            kvw_status_t st = cb(arg, &c.pending);
            if (st != KVW_OK)
                return st;
        }
    }
    if (count)
        *count = c.count;
    return KVW_OK;
}

kvw_status_t kvw_plan_expand(kvw_plan_h plan, kvw_run_cb_t cb, void *arg)
{
    if (plan == NULL || cb == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_plan_expand: NULL argument");
    return kvw_plan_expand_count(plan, cb, arg, NULL);
}

kvw_status_t kvw_plan_stats(kvw_plan_h plan, kvw_plan_stats_t *stats_p)
{
    kvw_status_t s = kvw__mask_query_check(&kvw__spec_plan_stats, plan, stats_p,
                                           "kvw_plan_stats");
    if (s != KVW_OK)
        return s;
    const uint64_t want = stats_p->field_mask;
    uint64_t runs_raw = 0, runs_coalesced = 0;
    if (want & KVW_PLAN_STATS_FIELD_RUNS_RAW)
        for (uint32_t i = 0; i < plan->num_segs; i++)
            runs_raw += (plan->segs[i].tok_end - plan->segs[i].tok_begin) *
                        plan->segs[i].num_heads;
    if ((want & KVW_PLAN_STATS_FIELD_RUNS_COALESCED) &&
        (s = kvw_plan_expand_count(plan, NULL, NULL, &runs_coalesced)) != KVW_OK)
        return s;
    const kvw_plan_stats_t all = {.bytes = plan->bytes,
                                  .num_routes = plan->num_routes,
                                  .num_segments = plan->num_segs,
                                  .runs_raw = runs_raw,
                                  .runs_coalesced = runs_coalesced,
                                  .plan_bytes = plan->alloc_bytes};
    kvw__mask_copy(&kvw__spec_plan_stats, want, &all, stats_p);
    return KVW_OK;
}
