/*
 * Plans and the CPU executor against the naive reference of tools/testkit.
 *
 * Every case builds a whole source instance (TP x PP ranks) and a whole destination
 * instance with guarded host buffers, fills every buffer with a pattern unique to its
 * rank (so that reading the wrong replica shows), draws random page tables per rank,
 * and then, for every chunk and every (source rank, destination rank) pair:
 *
 *   - creates the plan, executes it on the CPU into the real destination buffers;
 *   - expands it and applies the runs with memcpy into a second copy of the
 *     destination, checking each run's bounds and that runs are coalesced;
 *   - checks kvw_plan_stats (bytes = sum of run lengths = what the reference says
 *     this source supplies; runs_coalesced = number of expanded runs).
 *
 * The reference (kvt_ref_transfer) independently copies every (token, head) slice
 * into a third copy. All three must agree byte for byte over the whole destination
 * (so untouched bytes must keep their initial pattern), every byte the reference writes
 * must be covered by exactly one run over all pairs, no guard byte may change and the
 * source buffers must be left as they were.
 *
 * Then: validation errors (status and message), and plan compactness at 128K tokens.
 * Exit status: 0 when every check passed, 1 otherwise.
 */
#include <kvwire/kvwire.h>

#include "check.h"
#include "testkit.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- case description */

typedef struct side_cfg {
    uint32_t tp, pp;
    uint32_t splits[4]; /* layers per PP stage; all zero: even split */
    kvw_layout_t layout;
    uint32_t ps_full, ps_swa;
    int fused;
    int consecutive;      /* pages k, k+1, ... instead of random */
    int full_from_prefix; /* full-pool page list starts at the prefix's page */
} side_cfg_t;

typedef struct case_cfg {
    const char *name;
    const char *model;
    uint32_t layers;   /* keep the first N layers (0: all) */
    uint32_t kv_heads; /* override the preset's KV heads (0: keep) */
    int mxfp8;
    uint32_t k_dim, v_dim; /* override head dims (0: keep) */
    uint32_t window2;      /* override the window of SWA layer 2 (0: keep) */
    side_cfg_t src, dst;
    uint64_t tokens, prefix;
    uint64_t chunk_ends[4]; /* ends of the chunks before the last (0-terminated) */
    uint32_t slots;
    int expect_whole_pages; /* runs_coalesced must be far below runs_raw */
} case_cfg_t;

/* One side's ranks, their page tables and their data pointers. */
typedef struct inst {
    uint32_t n;
    kvt_rank_t *r;
    kvt_req_pages_t *pg;
    uint8_t ***data;
} inst_t;

static void inst_free(inst_t *in)
{
    for (uint32_t i = 0; i < in->n; i++) {
        kvt_req_pages_free(&in->pg[i]);
        free(in->data[i]);
        kvt_rank_free(&in->r[i]);
    }
    free(in->r);
    free(in->pg);
    free(in->data);
    memset(in, 0, sizeof(*in));
}

static uint32_t max_window(const kvt_model_t *m)
{
    uint32_t w = 0;
    for (uint32_t l = 0; l < m->m.num_layers; l++)
        if (m->layers[l].kind == KVW_LAYER_SWA && m->layers[l].window > w)
            w = m->layers[l].window;
    return w;
}

static uint32_t div_up(uint64_t a, uint64_t b)
{
    return (uint32_t)((a + b - 1) / b);
}

/* Builds every rank of one side with pools large enough to scatter the request. */
static int inst_build(inst_t *in, const kvt_model_t *model, const side_cfg_t *sc,
                      const case_cfg_t *cc, uint64_t seed, int is_dst)
{
    memset(in, 0, sizeof(*in));
    uint32_t pp = sc->pp ? sc->pp : 1;
    in->n = sc->tp * pp;
    in->r = calloc(in->n, sizeof(*in->r));
    in->pg = calloc(in->n, sizeof(*in->pg));
    in->data = calloc(in->n, sizeof(*in->data));
    if (!in->r || !in->pg || !in->data)
        return -1;
    uint64_t n = cc->tokens;
    uint32_t w = max_window(model);
    uint64_t swa_tokens = w && w < n ? w : n;
    uint32_t need_full = div_up(n, sc->ps_full) + 1;
    uint32_t need_swa = div_up(swa_tokens, sc->ps_swa) + 1;
    kvt_rng_t rng = {seed * 7919 + 17};

    for (uint32_t p = 0; p < pp; p++) {
        uint32_t lb, le;
        kvt_pp_range(model->m.num_layers, pp, sc->splits[0] ? sc->splits : NULL, p, &lb, &le);
        for (uint32_t t = 0; t < sc->tp; t++) {
            uint32_t i = p * sc->tp + t;
            kvt_rank_spec_t spec;
            memset(&spec, 0, sizeof(spec));
            spec.model = model;
            spec.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = sc->tp,
                                        .tp_rank = t, .pp_size = pp,
                                        .pp_rank = p, .layer_begin = lb, .layer_end = le,
                                        .dp_size = 1, .dp_rank = 0};
            spec.layout = sc->layout;
            spec.page_size[KVW_POOL_FULL] = sc->ps_full;
            spec.page_size[KVW_POOL_SWA] = sc->ps_swa;
            spec.num_pages[KVW_POOL_FULL] = sc->consecutive ? need_full + 3 : 2 * need_full + 3;
            spec.num_pages[KVW_POOL_SWA] = sc->consecutive ? need_swa + 3 : 2 * need_swa + 3;
            spec.num_slots = cc->slots ? cc->slots : 3;
            spec.fused_kv = sc->fused;
            kvw_status_t st = kvt_rank_build(&spec, &in->r[i]);
            CHECK(st == KVW_OK, "%s rank %u: kvt_rank_build: %s (%s)", is_dst ? "dst" : "src", i,
                  kvw_status_string(st), kvw_last_error());
            if (st != KVW_OK)
                return -1;
            kvt_rank_fill(&in->r[i], seed * 1000 + i + 1);

            kvt_req_spec_t rs;
            memset(&rs, 0, sizeof(rs));
            rs.full_begin = is_dst && sc->full_from_prefix ? cc->prefix : 0;
            rs.full_end = n;
            rs.swa_begin = n > w ? n - w : 0;
            rs.swa_end = n;
            rs.state_slot = (int64_t)kvt_rng_below(&rng, spec.num_slots);
            rs.consecutive = sc->consecutive;
            rs.full_start = 2;
            rs.swa_start = 1;
            if (kvt_req_pages_make(&in->r[i], &rs, &rng, &in->pg[i])) {
                CHECK(0, "page tables for rank %u", i);
                return -1;
            }
            in->data[i] = calloc(in->r[i].num_bufs + 1, sizeof(uint8_t *));
            if (!in->data[i])
                return -1;
            for (uint32_t b = 0; b < in->r[i].num_bufs; b++)
                in->data[i][b] = kvt_rank_data(&in->r[i], b);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- expansion check */

typedef struct exp_ctx {
    const kvt_rank_t *src, *dst;
    kvt_copy_t *out;   /* destination copy the runs are applied to */
    kvt_copy_t *cover; /* per destination byte: how many runs wrote it */
    kvw_run_t prev;
    int have;
    uint64_t runs, bytes;
    char err[256];
} exp_ctx_t;

static kvw_status_t exp_cb(void *arg, const kvw_run_t *r)
{
    exp_ctx_t *c = arg;
    if (r->src_buf >= c->src->num_bufs || r->dst_buf >= c->dst->num_bufs || r->len == 0 ||
        r->src_off + r->len > c->src->bufs[r->src_buf].length ||
        r->dst_off + r->len > c->dst->bufs[r->dst_buf].length) {
        snprintf(c->err, sizeof(c->err), "run %llu out of bounds: src buf %u off %llu, dst buf "
                 "%u off %llu, len %llu", (unsigned long long)c->runs, r->src_buf,
                 (unsigned long long)r->src_off, r->dst_buf, (unsigned long long)r->dst_off,
                 (unsigned long long)r->len);
        return KVW_ERR_INTERNAL;
    }
    if (c->have && c->prev.src_buf == r->src_buf && c->prev.dst_buf == r->dst_buf &&
        c->prev.src_off + c->prev.len == r->src_off && c->prev.dst_off + c->prev.len == r->dst_off) {
        snprintf(c->err, sizeof(c->err), "runs %llu and %llu are adjacent on both sides but not "
                 "coalesced (src buf %u off %llu, dst buf %u off %llu)",
                 (unsigned long long)c->runs - 1, (unsigned long long)c->runs, r->src_buf,
                 (unsigned long long)r->src_off, r->dst_buf, (unsigned long long)r->dst_off);
        return KVW_ERR_INTERNAL;
    }
    memcpy(c->out->data[r->dst_buf] + r->dst_off, kvt_rank_data(c->src, r->src_buf) + r->src_off,
           r->len);
    uint8_t *cv = c->cover->data[r->dst_buf] + r->dst_off;
    for (uint64_t i = 0; i < r->len; i++)
        if (cv[i] < 255)
            cv[i]++;
    c->prev = *r;
    c->have = 1;
    c->runs++;
    c->bytes += r->len;
    return KVW_OK;
}

/* ---------------------------------------------------------------- running a case */

static int make_model(const case_cfg_t *cc, kvt_model_t *m)
{
    if (kvt_model_preset(cc->model, m))
        return -1;
    if (cc->layers && kvt_model_truncate(m, cc->layers))
        return -1;
    if (cc->kv_heads)
        m->m.num_kv_heads = cc->kv_heads;
    if (cc->k_dim)
        m->m.k_head_dim = cc->k_dim;
    if (cc->v_dim)
        m->m.v_head_dim = cc->v_dim;
    if (cc->window2)
        m->layers[2].window = cc->window2;
    if (cc->mxfp8)
        kvt_model_set_block_scale(m, 32, 1);
    return 0;
}

static void run_case(const case_cfg_t *cc)
{
    kvt_model_t model;
    inst_t S, D;
    char msg[512];
    uint64_t t_start = kvt_now_ns();
    cur_case = cc->name;
    memset(&S, 0, sizeof(S));
    memset(&D, 0, sizeof(D));

    if (make_model(cc, &model)) {
        CHECK(0, "unknown model %s", cc->model);
        return;
    }
    uint64_t seed = 1469598103934665603ull; /* FNV-1a of the case name */
    for (const char *c = cc->name; *c; c++)
        seed = (seed ^ (uint8_t)*c) * 1099511628211ull;
    seed %= 1000003;
    if (inst_build(&S, &model, &cc->src, cc, seed, 0) ||
        inst_build(&D, &model, &cc->dst, cc, seed + 1, 1)) {
        inst_free(&S);
        inst_free(&D);
        return;
    }

    kvt_copy_t *expect = calloc(D.n, sizeof(*expect));
    kvt_copy_t *expanded = calloc(D.n, sizeof(*expanded));
    kvt_copy_t *written = calloc(D.n, sizeof(*written));
    kvt_copy_t *cover = calloc(D.n, sizeof(*cover));
    kvt_ref_side_t *srefs = calloc(S.n, sizeof(*srefs));
    uint64_t *per_src = calloc(S.n, sizeof(*per_src));
    if (!expect || !expanded || !written || !cover || !srefs || !per_src) {
        CHECK(0, "out of memory");
        goto out;
    }
    for (uint32_t d = 0; d < D.n; d++) {
        if (kvt_copy_make(&D.r[d], &expect[d]) || kvt_copy_make(&D.r[d], &expanded[d]) ||
            kvt_copy_zeroed(&D.r[d], &written[d]) || kvt_copy_zeroed(&D.r[d], &cover[d])) {
            CHECK(0, "out of memory");
            goto out;
        }
    }
    for (uint32_t s = 0; s < S.n; s++)
        srefs[s] = kvt_ref_side(&S.r[s], &S.pg[s].side, S.data[s]);

    /* Chunks: the listed ends, then the last chunk up to num_tokens. */
    uint64_t ends[5];
    uint32_t nchunks = 0;
    for (uint32_t i = 0; i < 4 && cc->chunk_ends[i]; i++)
        ends[nchunks++] = cc->chunk_ends[i];
    ends[nchunks++] = cc->tokens;

    uint64_t runs_raw = 0, runs_co = 0, total_bytes = 0, ref_total = 0;
    uint64_t begin = 0;
    for (uint32_t c = 0; c < nchunks; c++) {
        kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = cc->tokens,
                          .chunk_begin = begin, .chunk_end = ends[c],
                          .prefix_len = cc->prefix, .last_chunk = c + 1 == nchunks};
        begin = ends[c];
        for (uint32_t d = 0; d < D.n; d++) {
            memset(per_src, 0, S.n * sizeof(*per_src));
            kvt_ref_side_t dref = kvt_ref_side(&D.r[d], &D.pg[d].side, expect[d].data);
            int rc = kvt_ref_transfer(&model.m, srefs, S.n, &dref, &ch, written[d].data, per_src,
                                      msg, sizeof(msg));
            CHECK(rc == 0, "reference failed (test bug): %s", msg);
            if (rc)
                goto out;
            for (uint32_t s = 0; s < S.n; s++) {
                kvw_plan_h plan = NULL;
                kvw_status_t st = kvw_plan_create(S.r[s].h, D.r[d].h, &ch, &S.pg[s].side,
                                                  &D.pg[d].side, &plan);
                CHECK(st == KVW_OK, "chunk %u src %u dst %u: kvw_plan_create: %s (%s)", c, s, d,
                      kvw_status_string(st), kvw_last_error());
                if (st != KVW_OK)
                    continue;
                kvw_plan_stats_t stats = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
                st = kvw_plan_stats(plan, &stats);
                CHECK(st == KVW_OK, "kvw_plan_stats: %s", kvw_status_string(st));
                CHECK(stats.bytes == per_src[s],
                      "chunk %u src %u dst %u: plan moves %llu bytes, reference %llu", c, s, d,
                      (unsigned long long)stats.bytes, (unsigned long long)per_src[s]);

                exp_ctx_t ex = {.src = &S.r[s], .dst = &D.r[d], .out = &expanded[d],
                                .cover = &cover[d]};
                st = kvw_plan_expand(plan, exp_cb, &ex);
                CHECK(st == KVW_OK, "chunk %u src %u dst %u: kvw_plan_expand: %s %s", c, s, d,
                      kvw_status_string(st), ex.err);
                CHECK(ex.bytes == stats.bytes, "expanded runs hold %llu bytes, stats say %llu",
                      (unsigned long long)ex.bytes, (unsigned long long)stats.bytes);
                CHECK(ex.runs == stats.runs_coalesced,
                      "expand gave %llu runs, stats.runs_coalesced %llu",
                      (unsigned long long)ex.runs, (unsigned long long)stats.runs_coalesced);
                CHECK(stats.runs_coalesced <= stats.runs_raw || stats.bytes == 0,
                      "more coalesced runs (%llu) than raw runs (%llu)",
                      (unsigned long long)stats.runs_coalesced,
                      (unsigned long long)stats.runs_raw);
                CHECK(stats.bytes == 0 || stats.num_segments > 0, "bytes without segments");
                runs_raw += stats.runs_raw;
                runs_co += stats.runs_coalesced;
                total_bytes += stats.bytes;
                ref_total += per_src[s];

                st = kvw_plan_exec_cpu(plan);
                CHECK(st == KVW_OK, "chunk %u src %u dst %u: kvw_plan_exec_cpu: %s (%s)", c, s, d,
                      kvw_status_string(st), kvw_last_error());
                kvw_plan_destroy(plan);
            }
        }
    }

    for (uint32_t d = 0; d < D.n; d++) {
        char what[64];
        snprintf(what, sizeof(what), "dst rank %u after exec_cpu", d);
        CHECK(kvt_copy_compare(&D.r[d], &expect[d], what, msg, sizeof(msg)) == 0, "%s", msg);
        snprintf(what, sizeof(what), "dst rank %u after applying expanded runs", d);
        CHECK(kvt_copy_compare2(&D.r[d], &expanded[d], &expect[d], what, msg, sizeof(msg)) == 0,
              "%s", msg);
        /* Coverage: exactly the reference's bytes, each written once. */
        snprintf(what, sizeof(what), "dst rank %u run coverage (1 = written once)", d);
        CHECK(kvt_copy_compare2(&D.r[d], &cover[d], &written[d], what, msg, sizeof(msg)) == 0,
              "%s", msg);
        CHECK(kvt_rank_check_guards(&D.r[d], msg, sizeof(msg)) == 0, "dst rank %u: %s", d, msg);
    }
    for (uint32_t s = 0; s < S.n; s++) {
        CHECK(kvt_rank_check_guards(&S.r[s], msg, sizeof(msg)) == 0, "src rank %u: %s", s, msg);
        CHECK(kvt_rank_verify_fill(&S.r[s], seed * 1000 + s + 1, msg, sizeof(msg)) == 0,
              "src rank %u: %s", s, msg);
    }
    CHECK(total_bytes == ref_total && ref_total > 0, "bytes: plans %llu, reference %llu",
          (unsigned long long)total_bytes, (unsigned long long)ref_total);
    if (cc->expect_whole_pages)
        CHECK(runs_co * 50 <= runs_raw, "whole pages expected: %llu coalesced runs for %llu raw",
              (unsigned long long)runs_co, (unsigned long long)runs_raw);
    printf("  %-44s %2ux%u -> %2ux%u  %9llu bytes  runs raw %7llu merged %6llu  %5.0f ms\n",
           cc->name, cc->src.tp, cc->src.pp ? cc->src.pp : 1, cc->dst.tp,
           cc->dst.pp ? cc->dst.pp : 1, (unsigned long long)total_bytes,
           (unsigned long long)runs_raw, (unsigned long long)runs_co,
           (kvt_now_ns() - t_start) / 1e6);

out:
    for (uint32_t d = 0; d < D.n; d++) {
        if (expect)
            kvt_copy_free(&expect[d]);
        if (expanded)
            kvt_copy_free(&expanded[d]);
        if (written)
            kvt_copy_free(&written[d]);
        if (cover)
            kvt_copy_free(&cover[d]);
    }
    free(expect);
    free(expanded);
    free(written);
    free(cover);
    free(srefs);
    free(per_src);
    inst_free(&S);
    inst_free(&D);
}

/* ---------------------------------------------------------------- the cases */

#define NHD KVW_LAYOUT_NHD
#define HND KVW_LAYOUT_HND
/* A side: TP, layout, full and SWA page sizes. */
#define SIDE(tp_, layout_, psf_, pss_) {.tp = (tp_), .layout = (layout_), .ps_full = (psf_), .ps_swa = (pss_)}

static const case_cfg_t cases[] = {
    /* ---- equal TP: whole pages ---- */
    {.name = "equal TP2, consecutive pages, NHD", .model = "gpt-oss-120b", .layers = 4,
     .src = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .consecutive = 1},
     .dst = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .consecutive = 1},
     .tokens = 1000, .expect_whole_pages = 1},
    {.name = "equal TP1, consecutive pages, HND", .model = "llama-3.1-70b", .layers = 3,
     .src = {.tp = 1, .layout = HND, .ps_full = 64, .ps_swa = 64, .consecutive = 1},
     .dst = {.tp = 1, .layout = HND, .ps_full = 64, .ps_swa = 64, .consecutive = 1},
     .tokens = 1000, .expect_whole_pages = 1},
    {.name = "equal TP4, random pages, NHD", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 777},

    /* ---- unequal TP, layouts ---- */
    {.name = "TP2->1 head slices NHD->NHD", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(1, NHD, 16, 16), .tokens = 500},
    {.name = "TP1->2 head slices HND->HND", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, HND, 16, 16), .dst = SIDE(2, HND, 16, 16), .tokens = 500},
    {.name = "TP2->4 NHD->HND", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(4, HND, 16, 16), .tokens = 500},
    {.name = "TP4->2 HND->NHD", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 500},
    {.name = "TP1->1 NHD->HND (layout conversion only)", .model = "gpt-oss-120b", .layers = 2,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(1, HND, 16, 16), .tokens = 300},

    /* ---- TP ratios ---- */
    {.name = "TP1->4", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 600},
    {.name = "TP4->1", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, NHD, 16, 16), .dst = SIDE(1, NHD, 16, 16), .tokens = 600},
    {.name = "TP2->4", .model = "llama-3.1-70b", .layers = 2,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 400},
    {.name = "TP4->2", .model = "llama-3.1-70b", .layers = 2,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(2, HND, 16, 16), .tokens = 400},
    {.name = "TP8->2", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(8, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 400},
    {.name = "TP3->2 with 6 heads", .model = "gpt-oss-120b", .layers = 4, .kv_heads = 6,
     .src = SIDE(3, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 400},
    {.name = "TP2->3 with 6 heads, HND", .model = "gpt-oss-120b", .layers = 4, .kv_heads = 6,
     .src = SIDE(2, HND, 16, 16), .dst = SIDE(3, HND, 16, 16), .tokens = 400},
    {.name = "TP1->4 with 2 heads (replicated dst)", .model = "gpt-oss-120b", .layers = 4,
     .kv_heads = 2, .src = SIDE(1, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 400},
    {.name = "TP8->4 with 2 heads (replicas both sides)", .model = "gpt-oss-120b", .layers = 4,
     .kv_heads = 2, .src = SIDE(8, NHD, 16, 16), .dst = SIDE(4, HND, 16, 16), .tokens = 300},
    {.name = "TP4->8 with 2 heads (replicas both sides)", .model = "gpt-oss-120b", .layers = 2,
     .kv_heads = 2, .src = SIDE(4, HND, 16, 16), .dst = SIDE(8, NHD, 16, 16), .tokens = 300},

    /* ---- page sizes ---- */
    {.name = "page 64 -> 16, TP1->2", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 64, 64), .dst = SIDE(2, NHD, 16, 16), .tokens = 1000},
    {.name = "page 16 -> 64, equal TP2", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(2, NHD, 64, 64), .tokens = 1000},
    {.name = "page 16 -> 1, TP2->1 HND->NHD", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(2, HND, 16, 16), .dst = SIDE(1, NHD, 1, 1), .tokens = 300},
    {.name = "page 1 -> 16, equal TP1", .model = "gpt-oss-120b", .layers = 2,
     .src = SIDE(1, NHD, 1, 1), .dst = SIDE(1, NHD, 16, 16), .tokens = 300},
    {.name = "page 48 -> 32 (not multiples), TP4->2", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, NHD, 48, 24), .dst = SIDE(2, HND, 32, 8), .tokens = 700},

    /* ---- decode prefix reuse ---- */
    {.name = "prefix 37, equal TP, full list", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 500, .prefix = 37},
    {.name = "prefix 37, TP1->4, list from prefix page", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 16, 16),
     .dst = {.tp = 4, .layout = HND, .ps_full = 16, .ps_swa = 16, .full_from_prefix = 1},
     .tokens = 500, .prefix = 37},
    {.name = "prefix 450 inside the SWA window", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, NHD, 64, 16), .dst = {.tp = 1, .layout = NHD, .ps_full = 16, .ps_swa = 16,
                                          .full_from_prefix = 1},
     .tokens = 500, .prefix = 450},

    /* ---- SWA windows not page aligned ---- */
    {.name = "SWA window unaligned, equal TP", .model = "gpt-oss-20b", .layers = 6,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 1003},
    {.name = "SWA window unaligned, TP1->4, pages 16/48", .model = "gpt-oss-20b", .layers = 6,
     .src = SIDE(1, NHD, 64, 16), .dst = SIDE(4, HND, 32, 48), .tokens = 1003},
    {.name = "SWA shorter request than window", .model = "gpt-oss-20b", .layers = 4,
     .src = SIDE(4, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 100},

    /* ---- MLA ---- */
    {.name = "MLA TP2->4 (more decode ranks)", .model = "deepseek-v3", .layers = 3,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 300},
    {.name = "MLA TP4->2 (fewer decode ranks)", .model = "deepseek-v3", .layers = 3,
     .src = SIDE(4, NHD, 16, 16), .dst = SIDE(2, NHD, 64, 64), .tokens = 300},
    {.name = "MLA TP3->2 pages 16->1", .model = "deepseek-v3", .layers = 2,
     .src = SIDE(3, NHD, 16, 16), .dst = SIDE(2, NHD, 1, 1), .tokens = 200},

    /* ---- state (GDN) ---- */
    {.name = "GDN state TP1->2", .model = "qwen3-next", .layers = 4,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 200, .slots = 3},
    {.name = "GDN state TP4->1", .model = "qwen3-next", .layers = 4,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(1, NHD, 16, 16), .tokens = 200, .slots = 3},
    {.name = "GDN state TP2->8 (replicated attention)", .model = "qwen3-next", .layers = 4,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(8, NHD, 32, 32), .tokens = 200, .slots = 2},

    /* ---- block scales ---- */
    {.name = "MXFP8 scales TP1->2", .model = "gpt-oss-120b", .layers = 4, .mxfp8 = 1,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 400},
    {.name = "MXFP8 scales TP4->2 HND->NHD", .model = "gpt-oss-120b", .layers = 4, .mxfp8 = 1,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(2, NHD, 64, 16), .tokens = 400},
    {.name = "MXFP8 scales equal TP2 whole pages", .model = "llama-3.1-70b", .layers = 2,
     .mxfp8 = 1,
     .src = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .consecutive = 1},
     .dst = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .consecutive = 1},
     .tokens = 400, .expect_whole_pages = 1},

    /* ---- fused KV buffers ---- */
    {.name = "fused KV both sides, TP2->4", .model = "gpt-oss-120b", .layers = 4,
     .src = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .fused = 1},
     .dst = {.tp = 4, .layout = HND, .ps_full = 16, .ps_swa = 16, .fused = 1}, .tokens = 300},
    {.name = "fused KV source, split destination", .model = "gpt-oss-120b", .layers = 4,
     .src = {.tp = 1, .layout = HND, .ps_full = 16, .ps_swa = 16, .fused = 1},
     .dst = SIDE(2, NHD, 16, 16), .tokens = 300},

    {.name = "fused KV, K dim 96 / V dim 32, TP4->1", .model = "gpt-oss-120b", .layers = 4,
     .k_dim = 96, .v_dim = 32,
     .src = {.tp = 4, .layout = HND, .ps_full = 16, .ps_swa = 8, .fused = 1},
     .dst = {.tp = 1, .layout = NHD, .ps_full = 32, .ps_swa = 16, .fused = 1}, .tokens = 300},
    {.name = "split K dim 96 / V dim 32 -> fused, TP2->4", .model = "gpt-oss-120b", .layers = 4,
     .k_dim = 96, .v_dim = 32, .src = SIDE(2, NHD, 16, 16),
     .dst = {.tp = 4, .layout = NHD, .ps_full = 16, .ps_swa = 16, .fused = 1}, .tokens = 300},

    /* ---- SWA layers with different windows ---- */
    {.name = "windows 128 and 37, TP2->4", .model = "gpt-oss-120b", .layers = 4, .window2 = 37,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(4, HND, 8, 8), .tokens = 501},
    {.name = "windows 128 and 700 (> tokens), TP1->2", .model = "gpt-oss-120b", .layers = 4,
     .window2 = 700, .src = SIDE(1, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 32), .tokens = 501},

    /* ---- pipeline parallel, uneven ---- */
    {.name = "PP2 10/26 -> PP3 12/12/12, TP1->2", .model = "gpt-oss-120b",
     .src = {.tp = 1, .pp = 2, .splits = {10, 26}, .layout = NHD, .ps_full = 16, .ps_swa = 16},
     .dst = {.tp = 2, .pp = 3, .splits = {12, 12, 12}, .layout = NHD, .ps_full = 16,
             .ps_swa = 16},
     .tokens = 200},
    {.name = "PP3 5/20/11 -> PP2 30/6, TP2->1", .model = "gpt-oss-120b",
     .src = {.tp = 2, .pp = 3, .splits = {5, 20, 11}, .layout = HND, .ps_full = 16, .ps_swa = 16},
     .dst = {.tp = 1, .pp = 2, .splits = {30, 6}, .layout = NHD, .ps_full = 64, .ps_swa = 16},
     .tokens = 150},
    {.name = "PP2 -> PP1 with GDN state", .model = "qwen3-next", .layers = 8,
     .src = {.tp = 2, .pp = 2, .splits = {3, 5}, .layout = NHD, .ps_full = 16, .ps_swa = 16},
     .dst = SIDE(1, NHD, 16, 16), .tokens = 100, .slots = 2},

    /* ---- chunked prefill ---- */
    {.name = "3 chunks, SWA on the last, TP1->4", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 1000,
     .chunk_ends = {300, 650}},
    {.name = "4 chunks, one empty, TP2->2 HND", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(2, HND, 16, 16), .dst = SIDE(2, HND, 16, 16), .tokens = 700,
     .chunk_ends = {300, 300, 650}},
    {.name = "3 chunks with prefix, TP4->2, pages 64/16", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, HND, 64, 64), .dst = SIDE(2, NHD, 16, 16), .tokens = 1000, .prefix = 100,
     .chunk_ends = {250, 700}},
    {.name = "3 chunks, state on the last, TP2->1", .model = "qwen3-next", .layers = 4,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(1, HND, 16, 16), .tokens = 300,
     .chunk_ends = {100, 200}, .slots = 2},
    {.name = "MLA 3 chunks, prefix 10", .model = "deepseek-v3", .layers = 2,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(1, NHD, 64, 64), .tokens = 300, .prefix = 10,
     .chunk_ends = {64, 65}},
};

/* ---------------------------------------------------------------- the reference itself */

/*
 * The reference is only worth something if it is right on its own, so it is checked
 * against data written out by hand: the worked examples of DESIGN.md section 3
 * (which source rank and offsets serve each destination head), a tiny transfer whose
 * every destination byte is listed literally, and the guard check catching a write.
 */
typedef struct rule_row {
    uint32_t S, D, H;
    /* per destination rank, per owned head: source rank and source-local head */
    uint32_t src[8][8], src_off[8][8];
} rule_row_t;

static const rule_row_t rule_rows[] = {
    /* 1 -> 4, H=2: d0,d1 own head 0; d2,d3 own head 1; all from s0. */
    {1, 4, 2, {{0}, {0}, {0}, {0}}, {{0}, {0}, {1}, {1}}},
    /* 4 -> 2, H=8: d0 heads 0-3 from s0 (0,1) and s1 (2,3). */
    {4, 2, 8, {{0, 0, 1, 1}, {2, 2, 3, 3}}, {{0, 1, 0, 1}, {0, 1, 0, 1}}},
    /* 2 -> 4, H=8. */
    {2, 4, 8, {{0, 0}, {0, 0}, {1, 1}, {1, 1}}, {{0, 1}, {2, 3}, {0, 1}, {2, 3}}},
    /* 8 -> 2, H=8: d0 <- s0..s3, d1 <- s4..s7, one head each. */
    {8, 2, 8, {{0, 1, 2, 3}, {4, 5, 6, 7}}, {{0, 0, 0, 0}, {0, 0, 0, 0}}},
    /* 8 -> 4, H=2: d0 <- s0, d1 <- s1 (head 0); d2 <- s4, d3 <- s5 (head 1). */
    {8, 4, 2, {{0}, {1}, {4}, {5}}, {{0}, {0}, {0}, {0}}},
    /* 3 -> 2, H=6: d0 heads 0,1,2 <- s0,s0,s1; d1 heads 3,4,5 <- s1,s2,s2. */
    {3, 2, 6, {{0, 0, 1}, {1, 2, 2}}, {{0, 1, 0}, {1, 0, 1}}},
    /* MLA as one head: destination d reads from source d mod S. */
    {2, 4, 1, {{0}, {1}, {0}, {1}}, {{0}, {0}, {0}, {0}}},
    {4, 3, 1, {{0}, {1}, {2}}, {{0}, {0}, {0}}},
};

static void test_reference_rules(void)
{
    cur_case = "reference rules";
    for (size_t i = 0; i < sizeof(rule_rows) / sizeof(rule_rows[0]); i++) {
        const rule_row_t *r = &rule_rows[i];
        for (uint32_t d = 0; d < r->D; d++) {
            uint32_t df, dc;
            CHECK(kvt_heads_owned(r->D, d, r->H, &df, &dc) == 0, "ownership");
            for (uint32_t k = 0; k < dc; k++) {
                uint32_t s = kvt_source_rank(r->S, r->D, r->H, d, df + k), sf, sc;
                CHECK(kvt_heads_owned(r->S, s, r->H, &sf, &sc) == 0, "ownership");
                CHECK(s == r->src[d][k] && df + k - sf == r->src_off[d][k],
                      "%u->%u H=%u: dst %u head %u from src %u offset %u, table says %u/%u",
                      r->S, r->D, r->H, d, df + k, s, df + k - sf, r->src[d][k],
                      r->src_off[d][k]);
            }
        }
    }
}

static void test_reference_literal(void)
{
    cur_case = "reference literal";
    /* One full-attention layer, 2 KV heads of 1 bf16 element: 2 bytes per head. */
    kvt_model_t m;
    memset(&m, 0, sizeof(m));
    m.m.num_layers = 1;
    m.layers[0].kind = KVW_LAYER_FULL;
    m.m.num_kv_heads = 2;
    m.m.k_head_dim = m.m.v_head_dim = 1;
    m.m.elem_size = 2;
    kvt_model_relink(&m);
    kvt_rank_t s, d;
    kvt_rank_spec_t spec = {.model = &m,
                            .par = {.tp_size = 1, .pp_size = 1, .layer_end = 1, .dp_size = 1},
                            .layout = NHD,
                            .page_size = {2, 2},
                            .num_pages = {2, 2}};
    memset(&s, 0, sizeof(s));
    memset(&d, 0, sizeof(d));
    CHECK(kvt_rank_build(&spec, &s) == KVW_OK, "src: %s", kvw_last_error());
    spec.layout = HND;
    CHECK(kvt_rank_build(&spec, &d) == KVW_OK, "dst: %s", kvw_last_error());
    if (!s.h || !d.h || s.num_bufs != 2 || d.num_bufs != 2 || s.bufs[0].length != 16) {
        CHECK(0, "unexpected tiny ranks");
        kvt_rank_free(&s);
        kvt_rank_free(&d);
        return;
    }
    /* Source byte at offset o of K is o, of V is 100 + o. NHD offset of (page p, slot i,
     * head h) = p*8 + i*4 + h*2. Source pages [1, 0]: token 0 -> page 1 slot 0, token 1
     * -> page 1 slot 1, token 2 -> page 0 slot 0. */
    for (uint32_t o = 0; o < 16; o++) {
        kvt_rank_data(&s, 0)[o] = (uint8_t)o;
        kvt_rank_data(&s, 1)[o] = (uint8_t)(100 + o);
    }
    kvt_rank_clear(&d, 0xEE);
    /* Destination HND offset of (page p, head h, slot i) = p*8 + h*4 + i*2, pages [0, 1]:
     *   t0 (page 0 slot 0): h0 -> 0..1 <- {8,9},   h1 -> 4..5   <- {10,11}
     *   t1 (page 0 slot 1): h0 -> 2..3 <- {12,13}, h1 -> 6..7   <- {14,15}
     *   t2 (page 1 slot 0): h0 -> 8..9 <- {0,1},   h1 -> 12..13 <- {2,3}
     * and bytes 10, 11, 14, 15 (slot 1 of page 1) stay 0xEE. */
    static const uint8_t want_k[16] = {8, 9, 12, 13, 10, 11, 14, 15,
                                       0, 1, 0xEE, 0xEE, 2, 3, 0xEE, 0xEE};
    uint8_t want_v[16];
    for (int i = 0; i < 16; i++)
        want_v[i] = want_k[i] == 0xEE ? 0xEE : (uint8_t)(want_k[i] + 100);

    uint32_t sp_pages[2] = {1, 0}, dp_pages[2] = {0, 1};
    kvw_side_pages_t sp = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL, .full = {KVW_PAGES_FIELDS_ALL,
                                                                             sp_pages, 2, 0},
    .state_slot = -1};
    kvw_side_pages_t dp = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL, .full = {KVW_PAGES_FIELDS_ALL,
                                                                             dp_pages, 2, 0},
    .state_slot = -1};
    kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = 3, .chunk_end = 3,
                      .last_chunk = 1};

    kvt_copy_t exp;
    char msg[256];
    CHECK(kvt_copy_make(&d, &exp) == KVW_OK, "copy");
    uint8_t *sdata[2] = {kvt_rank_data(&s, 0), kvt_rank_data(&s, 1)};
    kvt_ref_side_t sr = kvt_ref_side(&s, &sp, sdata), dr = kvt_ref_side(&d, &dp, exp.data);
    uint64_t bytes = 0;
    CHECK(kvt_ref_transfer(&m.m, &sr, 1, &dr, &ch, NULL, &bytes, msg, sizeof(msg)) == 0, "%s",
          msg);
    CHECK(bytes == 24, "reference moved %llu bytes, expected 3 tokens x 2 heads x 2 B x K,V",
          (unsigned long long)bytes);
    CHECK(!memcmp(exp.data[0], want_k, 16) && !memcmp(exp.data[1], want_v, 16),
          "reference disagrees with the hand-written bytes");

    kvw_plan_h plan = NULL;
    CHECK(kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan) == KVW_OK, "%s", kvw_last_error());
    if (plan) {
        CHECK(kvw_plan_exec_cpu(plan) == KVW_OK, "%s", kvw_last_error());
        CHECK(!memcmp(kvt_rank_data(&d, 0), want_k, 16) &&
                  !memcmp(kvt_rank_data(&d, 1), want_v, 16),
              "library disagrees with the hand-written bytes");
        kvw_plan_destroy(plan);
    }
    CHECK(kvt_rank_check_guards(&d, msg, sizeof(msg)) == 0, "%s", msg);
    /* The guard check must see a stray byte on either side of a buffer. */
    uint8_t *k = kvt_rank_data(&d, 0);
    k[-1] ^= 1;
    CHECK(kvt_rank_check_guards(&d, msg, sizeof(msg)) != 0, "guard before K not noticed");
    k[-1] ^= 1;
    k[16] ^= 0x80;
    CHECK(kvt_rank_check_guards(&d, msg, sizeof(msg)) != 0, "guard after K not noticed");
    k[16] ^= 0x80;
    CHECK(kvt_rank_check_guards(&d, msg, sizeof(msg)) == 0, "%s", msg);
    kvt_copy_free(&exp);
    kvt_rank_free(&s);
    kvt_rank_free(&d);
}

/* ---------------------------------------------------------------- validation errors */

static kvw_status_t build_simple(const kvt_model_t *m, uint32_t tp, uint32_t rank,
                                 kvw_layout_t layout, kvt_rank_t *r)
{
    kvt_rank_spec_t spec;
    memset(&spec, 0, sizeof(spec));
    spec.model = m;
    spec.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = tp,
                                .tp_rank = rank, .pp_size = 1, .layer_begin = 0,
                                .layer_end = m->m.num_layers, .dp_size = 1};
    spec.layout = layout;
    spec.page_size[0] = spec.page_size[1] = 16;
    spec.num_pages[0] = spec.num_pages[1] = 32;
    spec.num_slots = 2;
    return kvt_rank_build(&spec, r);
}

/* Expects `st` == `want` and the last error to mention every needle. */
static void expect_error(const char *what, kvw_status_t st, kvw_status_t want, const char *n1,
                         const char *n2)
{
    const char *msg = kvw_last_error();
    CHECK(st == want, "%s: got %s, expected %s (%s)", what, kvw_status_string(st),
          kvw_status_string(want), msg);
    CHECK(!n1 || kvt_contains(msg, n1), "%s: message '%s' does not mention '%s'", what, msg, n1);
    CHECK(!n2 || kvt_contains(msg, n2), "%s: message '%s' does not mention '%s'", what, msg, n2);
}

static void mismatch(const char *what, const kvt_model_t *a, const kvt_model_t *b,
                     const char *n1, const char *n2)
{
    kvt_rank_t ra, rb;
    memset(&ra, 0, sizeof(ra));
    memset(&rb, 0, sizeof(rb));
    kvw_status_t st = build_simple(a, 1, 0, NHD, &ra);
    CHECK(st == KVW_OK, "%s: source rank: %s", what, kvw_last_error());
    st = build_simple(b, 1, 0, NHD, &rb);
    CHECK(st == KVW_OK, "%s: destination rank: %s", what, kvw_last_error());
    if (ra.h && rb.h) {
        char w[128];
        snprintf(w, sizeof(w), "%s (check_compatible)", what);
        expect_error(w, kvw_rank_check_compatible(ra.h, rb.h), KVW_ERR_INCOMPATIBLE, n1, n2);
        uint32_t pages[4] = {0, 1, 2, 3};
        kvw_side_pages_t sp = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                               .full = {KVW_PAGES_FIELDS_ALL, pages, 4,
                                        0}, .swa = {KVW_PAGES_FIELDS_ALL, pages, 4,
                                                    0}, .state_slot = 0};
        kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = 50, .chunk_end = 50,
                          .last_chunk = 1};
        kvw_plan_h plan = NULL;
        snprintf(w, sizeof(w), "%s (plan_create)", what);
        expect_error(w, kvw_plan_create(ra.h, rb.h, &ch, &sp, &sp, &plan), KVW_ERR_INCOMPATIBLE,
                     n1, n2);
        CHECK(plan == NULL, "%s: plan written on error", what);
    }
    kvt_rank_free(&ra);
    kvt_rank_free(&rb);
}

static void test_validation(void)
{
    kvt_model_t m, b;
    kvt_rank_t r, s, d;
    kvw_status_t st;
    cur_case = "validation";
    kvt_model_preset("gpt-oss-120b", &m);
    kvt_model_truncate(&m, 4);

    /* Unsupported layout: rejected when the rank is described. */
    memset(&r, 0, sizeof(r));
    kvt_rank_spec_t spec = {.model = &m,
                            .par = {.tp_size = 1, .pp_size = 1, .layer_end = 4, .dp_size = 1},
                            .layout = KVW_LAYOUT_VECTORIZED_5D,
                            .page_size = {16, 16},
                            .num_pages = {8, 8}};
    st = kvt_rank_describe(&spec, &r);
    CHECK(st == KVW_OK, "describe");
    expect_error("vectorized 5-D layout", kvt_rank_open(&r), KVW_ERR_UNSUPPORTED, "layout",
                 "5-D");
    CHECK(r.h == NULL, "rank handle written on error");
    kvt_rank_free(&r);

    /* Model mismatches, each found by the compatibility check and by plan_create. */
    b = m;
    kvt_model_relink(&b);
    b.m.num_kv_heads = 4;
    mismatch("KV heads 8 vs 4", &m, &b, "head", NULL);
    b = m;
    kvt_model_relink(&b);
    b.m.k_head_dim = 128;
    mismatch("K head dim 64 vs 128", &m, &b, "K head dim", NULL);
    b = m;
    kvt_model_relink(&b);
    b.m.v_head_dim = 32;
    mismatch("V head dim 64 vs 32", &m, &b, "V head dim", NULL);
    b = m;
    kvt_model_relink(&b);
    b.m.elem_size = 1;
    mismatch("element size 2 vs 1", &m, &b, "element size", NULL);
    b = m;
    kvt_model_relink(&b);
    b.layers[1].kind = KVW_LAYER_SWA;
    b.layers[1].window = 128;
    mismatch("layer 1 full vs sliding", &m, &b, "layer 1", "sliding");
    b = m;
    kvt_model_relink(&b);
    b.layers[2].window = 256;
    mismatch("layer 2 window 128 vs 256", &m, &b, "window", "256");

    /* Buffer length that is not a whole number of pages. */
    memset(&r, 0, sizeof(r));
    spec.layout = NHD;
    CHECK(kvt_rank_describe(&spec, &r) == KVW_OK, "describe");
    r.bufs[1].length -= 64;
    expect_error("length not whole pages", kvt_rank_open(&r), KVW_ERR_INVALID_PARAM, "length",
                 "page");
    r.bufs[1].length += 64;
    /* Head count that contradicts TP. */
    r.bufs[0].num_heads = 4;
    expect_error("buffer holds 4 of 8 heads on TP1", kvt_rank_open(&r), KVW_ERR_INCOMPATIBLE,
                 "heads", NULL);
    r.bufs[0].num_heads = 8;
    /* Head bytes that contradict the model. */
    r.bufs[0].head_bytes = 64;
    r.bufs[0].length /= 2;
    expect_error("buffer head bytes 64 vs model 128", kvt_rank_open(&r), KVW_ERR_INCOMPATIBLE,
                 "bytes per head", NULL);
    kvt_rank_free(&r);

    /* Page list problems at plan creation. */
    memset(&s, 0, sizeof(s));
    memset(&d, 0, sizeof(d));
    CHECK(build_simple(&m, 1, 0, NHD, &s) == KVW_OK, "src: %s", kvw_last_error());
    CHECK(build_simple(&m, 2, 0, NHD, &d) == KVW_OK, "dst: %s", kvw_last_error());
    if (s.h && d.h) {
        uint32_t sp_full[8] = {0, 1, 2, 3, 4, 5, 6, 7}, dp_full[8] = {9, 8, 7, 6, 5, 4, 3, 2};
        kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = 100, .chunk_end = 100,
                          .last_chunk = 1};
        /* 100 tokens, page 16: 7 pages; window 128 covers everything: SWA needs 7 too. */
        kvw_side_pages_t sp = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                               .full = {KVW_PAGES_FIELDS_ALL, sp_full, 7,
                                        0}, .swa = {KVW_PAGES_FIELDS_ALL, sp_full, 7,
                                                    0}, .state_slot = -1};
        kvw_side_pages_t dp = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                               .full = {KVW_PAGES_FIELDS_ALL, dp_full, 7,
                                        0}, .swa = {KVW_PAGES_FIELDS_ALL, dp_full + 1, 7, 0},
                               .state_slot = -1};
        kvw_plan_h plan = NULL;
        st = kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan);
        CHECK(st == KVW_OK, "baseline plan: %s", kvw_last_error());
        kvw_plan_destroy(plan);
        plan = NULL;

        dp.full.num_pages = 6;
        expect_error("destination page list too short", kvw_plan_create(s.h, d.h, &ch, &sp, &dp,
                                                                         &plan),
                     KVW_ERR_OUT_OF_RANGE, "page list", "short");
        dp.full.num_pages = 7;
        sp.swa.num_pages = 6;
        expect_error("source SWA page list too short", kvw_plan_create(s.h, d.h, &ch, &sp, &dp,
                                                                       &plan),
                     KVW_ERR_OUT_OF_RANGE, "source", "short");
        sp.swa.num_pages = 7;
        sp.full.first_token = 16; /* starts after the tokens it must cover */
        expect_error("source page list starts too late", kvw_plan_create(s.h, d.h, &ch, &sp, &dp,
                                                                         &plan),
                     KVW_ERR_OUT_OF_RANGE, "page list", NULL);
        sp.full.first_token = 0;

        dp_full[3] = 32; /* the pool holds pages 0..31 */
        expect_error("destination page 32 outside a 32-page buffer",
                     kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan), KVW_ERR_OUT_OF_RANGE, "32",
                     "outside");
        dp_full[3] = 6;
        sp_full[5] = 1000000;
        expect_error("source page 1000000 outside its buffer",
                     kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan), KVW_ERR_OUT_OF_RANGE,
                     "1000000", "source");
        sp_full[5] = 5;

        dp_full[4] = 9; /* dp_full[0] is 9 too */
        expect_error("destination page 9 twice", kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan),
                     KVW_ERR_INVALID_PARAM, "9", "twice");
        dp_full[4] = 5;
        /* A repeated source page is legal (reading twice is harmless). */
        sp_full[4] = 0;
        st = kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan);
        CHECK(st == KVW_OK, "repeated source page rejected: %s", kvw_last_error());
        kvw_plan_destroy(plan);
        plan = NULL;
        sp_full[4] = 4;

        /* A cached prefix: the destination list may start at the prefix's page. */
        kvw_chunk_t chp = ch;
        chp.prefix_len = 40;
        kvw_side_pages_t dpp = dp;
        dpp.full = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, dp_full, 5, 32};
        st = kvw_plan_create(s.h, d.h, &chp, &sp, &dpp, &plan);
        CHECK(st == KVW_OK, "destination pages from the prefix page: %s", kvw_last_error());
        kvw_plan_destroy(plan);
        plan = NULL;
        dpp.full.first_token = 40;
        expect_error("first token not on a page boundary",
                     kvw_plan_create(s.h, d.h, &chp, &sp, &dpp, &plan), KVW_ERR_INVALID_PARAM,
                     "first token", NULL);
        CHECK(plan == NULL, "plan written on error");

    }
    kvt_rank_free(&s);
    kvt_rank_free(&d);

    /* State slots out of range. */
    kvt_model_t q;
    kvt_model_preset("qwen3-next", &q);
    kvt_model_truncate(&q, 4);
    memset(&s, 0, sizeof(s));
    memset(&d, 0, sizeof(d));
    CHECK(build_simple(&q, 1, 0, NHD, &s) == KVW_OK, "src: %s", kvw_last_error());
    CHECK(build_simple(&q, 2, 1, NHD, &d) == KVW_OK, "dst: %s", kvw_last_error());
    if (s.h && d.h) {
        uint32_t pages[8] = {0, 1, 2, 3, 4, 5, 6, 7};
        kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = 50, .chunk_end = 50,
                          .last_chunk = 1};
        kvw_side_pages_t sp = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                               .full = {KVW_PAGES_FIELDS_ALL, pages, 4,
                                        0}, .swa = {KVW_PAGES_FIELDS_ALL, pages, 0,
                                                    0}, .state_slot = 1};
        kvw_side_pages_t dp = sp;
        dp.state_slot = 2; /* two slots: 0 and 1 */
        kvw_plan_h plan = NULL;
        expect_error("destination state slot 2 of 2",
                     kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan), KVW_ERR_OUT_OF_RANGE,
                     "slot", NULL);
        dp.state_slot = -1;
        expect_error("no destination state slot", kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan),
                     KVW_ERR_INVALID_PARAM, "slot", NULL);
        /* Not the last chunk: state does not move, so no slot is needed. */
        ch.last_chunk = 0;
        ch.chunk_end = 32;
        st = kvw_plan_create(s.h, d.h, &ch, &sp, &dp, &plan);
        CHECK(st == KVW_OK, "non-last chunk without slot: %s", kvw_last_error());
        kvw_plan_destroy(plan);
    }
    kvt_rank_free(&s);
    kvt_rank_free(&d);
}

/*
 * Linear-attention state groups that do not split over TP are refused by name, before
 * the buffer length check: the test kit sizes a state buffer from the rank's share of
 * each group and so describes it with length 0 there, which used to be the only reason
 * given. qwen3-next's conv state has groups of 16, 16 and 32 heads, its SSM state one
 * group of 32 (tools/testkit/model.c); layers 0-2 are state layers, layer 3 full
 * attention with 2 KV heads, and each state layer holds the conv buffer then the SSM
 * buffer, so buffer 0 is layer 0's conv state.
 */
static void expect_split_refusal(const char *what, const kvt_model_t *q, uint32_t tp,
                                 const char *text)
{
    for (uint32_t rank = 0; rank < tp; rank += tp - 1) {
        kvt_rank_t r;
        memset(&r, 0, sizeof(r));
        kvw_status_t st = build_simple(q, tp, rank, NHD, &r);
        expect_error(what, st, KVW_ERR_INCOMPATIBLE, text,
                     "(need heads % TP == 0 or TP % heads == 0)");
        CHECK(!kvt_contains(kvw_last_error(), "length"), "%s: message '%s' is about the length",
              what, kvw_last_error());
        CHECK(r.h == NULL, "%s: rank handle written on error", what);
        kvt_rank_free(&r);
        if (tp == 1)
            break;
    }
}

static void test_state_group_split(void)
{
    kvt_model_t q;
    kvt_rank_t r;
    cur_case = "state group split";
    kvt_model_preset("qwen3-next", &q);

    /* TP 6: the 2 KV heads split (6 % 2 == 0), the 16-head group 0 does not
     * (16 % 6 == 4, 6 % 16 == 6). Only state layers kept, then all four layers. */
    kvt_model_truncate(&q, 3);
    expect_split_refusal("TP 6, state layers only", &q, 6,
                         "state group 0 of buffer 0 (layer 0): 16 heads cannot be split over "
                         "TP 6");
    kvt_model_preset("qwen3-next", &q);
    kvt_model_truncate(&q, 4);
    expect_split_refusal("TP 6, with the attention layer", &q, 6,
                         "state group 0 of buffer 0 (layer 0): 16 heads cannot be split over "
                         "TP 6");
    /* TP 3: with 6 KV heads the attention layer splits (6 % 3 == 0); group 0 does not. */
    q.m.num_kv_heads = 6;
    expect_split_refusal("TP 3, 6 KV heads", &q, 3,
                         "state group 0 of buffer 0 (layer 0): 16 heads cannot be split over "
                         "TP 3");
    /* The group named is the first that does not split: with 16, 16 and 24 heads,
     * TP 16 splits groups 0 and 1 and refuses group 2 (24 % 16 == 8, 16 % 24 == 16). */
    kvt_model_preset("qwen3-next", &q);
    kvt_model_truncate(&q, 3);
    q.state[0].groups[2].total_heads = 24;
    expect_split_refusal("TP 16, third group of 24", &q, 16,
                         "state group 2 of buffer 0 (layer 0): 24 heads cannot be split over "
                         "TP 16");
    /* The same refusal where the caller gave the buffer a length of its own. */
    kvt_model_preset("qwen3-next", &q);
    kvt_model_truncate(&q, 4);
    kvt_rank_spec_t spec = {.model = &q,
                            .par = {.tp_size = 6, .tp_rank = 1, .pp_size = 1, .layer_end = 4,
                                    .dp_size = 1},
                            .layout = NHD,
                            .page_size = {16, 16},
                            .num_pages = {8, 8},
                            .num_slots = 2,
                            .describe_only = 1};
    memset(&r, 0, sizeof(r));
    CHECK(kvt_rank_describe(&spec, &r) == KVW_OK, "describe TP 6");
    if (r.num_bufs) {
        r.bufs[0].length = 4096;
        expect_error("TP 6, buffer of 4096 bytes", kvt_rank_open(&r), KVW_ERR_INCOMPATIBLE,
                     "state group 0 of buffer 0 (layer 0): 16 heads cannot be split over TP 6",
                     NULL);
    }
    kvt_rank_free(&r);

    /* TP 2, 4 and 8 split every group (16 and 32 are multiples of each) and the 2 KV
     * heads (2 % 2 == 0, 4 % 2 == 0, 8 % 2 == 0): every rank validates. */
    static const uint32_t ok_tp[] = {2, 4, 8};
    for (size_t k = 0; k < sizeof(ok_tp) / sizeof(ok_tp[0]); k++)
        for (uint32_t rank = 0; rank < ok_tp[k]; rank++) {
            memset(&r, 0, sizeof(r));
            kvw_status_t st = build_simple(&q, ok_tp[k], rank, NHD, &r);
            CHECK(st == KVW_OK, "TP %u rank %u: %s: %s", ok_tp[k], rank, kvw_status_string(st),
                  kvw_last_error());
            kvt_rank_free(&r);
        }
}

/* The expand callback's status stops the walk. */
static kvw_status_t stop_cb(void *arg, const kvw_run_t *r)
{
    (void)r;
    (*(int *)arg)++;
    return KVW_ERR_ABORTED;
}

static void test_expand_stop(void)
{
    kvt_model_t m;
    kvt_rank_t s, d;
    cur_case = "expand stop";
    kvt_model_preset("llama-3.1-70b", &m);
    kvt_model_truncate(&m, 2);
    memset(&s, 0, sizeof(s));
    memset(&d, 0, sizeof(d));
    CHECK(build_simple(&m, 1, 0, NHD, &s) == KVW_OK, "src: %s", kvw_last_error());
    CHECK(build_simple(&m, 4, 1, NHD, &d) == KVW_OK, "dst: %s", kvw_last_error());
    if (s.h && d.h) {
        uint32_t pages[8] = {7, 6, 5, 4, 3, 2, 1, 0};
        kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = 100, .chunk_end = 100,
                          .last_chunk = 1};
        kvw_side_pages_t sp = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                               .full = {KVW_PAGES_FIELDS_ALL, pages, 7, 0}, .state_slot = -1};
        kvw_plan_h plan = NULL;
        CHECK(kvw_plan_create(s.h, d.h, &ch, &sp, &sp, &plan) == KVW_OK, "%s", kvw_last_error());
        int calls = 0;
        kvw_status_t st = plan ? kvw_plan_expand(plan, stop_cb, &calls) : KVW_ERR_ABORTED;
        CHECK(st == KVW_ERR_ABORTED && (calls == 1 || !plan), "expand returned %s after %d calls",
              kvw_status_string(st), calls);
        kvw_plan_destroy(plan);
    }
    kvt_rank_free(&s);
    kvt_rank_free(&d);
}

/* ---------------------------------------------------------------- compactness */

/* Plan of src rank 0 -> dst rank 0 for a gpt-oss-120b request of n tokens, page size ps,
 * on describe-only ranks (no memory behind the buffers). */
static int compact_plan(uint32_t src_tp, uint32_t dst_tp, uint64_t n, uint32_t ps,
                        kvw_plan_stats_t *out)
{
    kvt_model_t m;
    kvt_rank_t s, d;
    kvt_req_pages_t sp, dp;
    int rc = -1;
    memset(&s, 0, sizeof(s));
    memset(&d, 0, sizeof(d));
    memset(&sp, 0, sizeof(sp));
    memset(&dp, 0, sizeof(dp));
    kvt_model_preset("gpt-oss-120b", &m);
    uint32_t pages = (uint32_t)((n + ps - 1) / ps) + 1;
    kvt_rank_spec_t spec = {.model = &m,
                            .par = {.tp_size = src_tp, .pp_size = 1, .layer_end = 36,
                                    .dp_size = 1},
                            .layout = NHD,
                            .page_size = {ps, ps},
                            .num_pages = {pages * 2, pages * 2},
                            .describe_only = 1};
    if (kvt_rank_build(&spec, &s) != KVW_OK)
        goto out;
    spec.par.tp_size = dst_tp;
    if (kvt_rank_build(&spec, &d) != KVW_OK)
        goto out;
    kvt_rng_t rng = {42};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = n, .swa_begin = n - 128, .swa_end = n,
                         .state_slot = -1};
    if (kvt_req_pages_make(&s, &rs, &rng, &sp) || kvt_req_pages_make(&d, &rs, &rng, &dp))
        goto out;
    kvw_chunk_t ch = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = n, .chunk_end = n,
                      .last_chunk = 1};
    kvw_plan_h plan = NULL;
    if (kvw_plan_create(s.h, d.h, &ch, &sp.side, &dp.side, &plan) != KVW_OK)
        goto out;
    out->field_mask = KVW_PLAN_STATS_FIELDS_ALL;
    rc = kvw_plan_stats(plan, out) == KVW_OK ? 0 : -1;
    kvw_plan_destroy(plan);
out:
    if (rc)
        CHECK(0, "compact plan %u->%u n=%llu ps=%u: %s", src_tp, dst_tp, (unsigned long long)n,
              ps, kvw_last_error());
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
    kvt_rank_free(&s);
    kvt_rank_free(&d);
    return rc;
}

static void test_compactness(void)
{
    cur_case = "compactness";
    const uint64_t n = 128 * 1024;
    kvw_plan_stats_t a, b, c, e;
    if (compact_plan(1, 4, n, 64, &a) || compact_plan(1, 4, n, 16, &b) ||
        compact_plan(1, 4, n / 2, 64, &c) || compact_plan(4, 4, n, 64, &e))
        return;
    /* Page entries each plan holds: full pool pages on both sides plus the SWA window. */
    uint64_t pages64 = 2 * (n / 64 + 128 / 64 + 1), pages16 = 2 * (n / 16 + 128 / 16 + 1);
    uint64_t grow = b.plan_bytes - a.plan_bytes;
    uint64_t predicted = (pages16 - pages64) * sizeof(uint32_t);
    printf("  compactness: 128K tokens x 36 layers, TP1->TP4 pair (0,0): plan %llu B (page 64), "
           "%llu B (page 16), %llu B (64K tokens, page 64); %llu segments\n",
           (unsigned long long)a.plan_bytes, (unsigned long long)b.plan_bytes,
           (unsigned long long)c.plan_bytes, (unsigned long long)a.num_segments);
    CHECK(a.num_segments == b.num_segments && a.num_segments == c.num_segments,
          "segments depend on tokens or pages: %llu %llu %llu",
          (unsigned long long)a.num_segments, (unsigned long long)b.num_segments,
          (unsigned long long)c.num_segments);
    CHECK(b.plan_bytes > a.plan_bytes && grow >= predicted * 9 / 10 &&
              grow <= predicted * 11 / 10 + 256,
          "page 16 vs 64 grew the plan by %llu bytes; page storage predicts %llu",
          (unsigned long long)grow, (unsigned long long)predicted);
    uint64_t half = a.plan_bytes - c.plan_bytes, half_pred = 2 * (n / 2 / 64) * sizeof(uint32_t);
    CHECK(a.plan_bytes > c.plan_bytes && half >= half_pred * 9 / 10 &&
              half <= half_pred * 11 / 10 + 256,
          "doubling tokens grew the plan by %llu bytes; page storage predicts %llu",
          (unsigned long long)half, (unsigned long long)half_pred);
    /* Far from one entry per (token, layer): 128K x 36 x 8 bytes would be 37 MB. */
    CHECK(b.plan_bytes < 256 * 1024, "plan of %llu bytes for 128K tokens",
          (unsigned long long)b.plan_bytes);
    CHECK(b.plan_bytes * 100 < n * 36 * 8, "plan not compact");
    /* Bytes: TP1->TP4 rank 0 gets 2 of 8 heads (2 x 128 B per token) for K and V, 18 full
     * layers over all tokens, 18 SWA layers over the last 128 tokens. */
    uint64_t want = 18 * 2 * n * 256 + 18 * 2 * 128 * 256;
    CHECK(a.bytes == want && b.bytes == want, "bytes %llu / %llu, expected %llu",
          (unsigned long long)a.bytes, (unsigned long long)b.bytes, (unsigned long long)want);
    CHECK(e.runs_coalesced * 64 <= e.runs_raw, "equal TP page 64: %llu runs for %llu slices",
          (unsigned long long)e.runs_coalesced, (unsigned long long)e.runs_raw);
}

int main(void)
{
    test_reference_rules();
    test_reference_literal();
    printf("plan/exec cases:\n");
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_case(&cases[i]);
    test_validation();
    test_state_group_split();
    test_expand_stop();
    test_compactness();
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
