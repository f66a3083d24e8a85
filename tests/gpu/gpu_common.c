/* Cases and helpers shared by the CUDA executor's tests (see gpu_common.h). */
#include "gpu_common.h"

#include "plan/rank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NHD KVW_LAYOUT_NHD
#define HND KVW_LAYOUT_HND
#define SIDE(tp_, layout_, psf_, pss_)                                                   \
    {.tp = (tp_), .layout = (layout_), .ps_full = (psf_), .ps_swa = (pss_)}

/*
 * Every layout, ratio and layer kind the CPU executor handles, small enough that the
 * whole list runs in seconds on the CPU emulator and on the GPUs.
 */
const gc_case_t gc_cases[] = {
    {.name = "1->4 8 heads", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 64, 64), .dst = SIDE(4, NHD, 64, 64), .tokens = 1000},
    {.name = "4->1 8 heads", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, NHD, 64, 64), .dst = SIDE(1, NHD, 64, 64), .tokens = 1000},
    {.name = "1->4 2 heads (replicas)", .model = "gpt-oss-120b", .layers = 4, .kv_heads = 2,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 600},
    {.name = "2->4 8 heads", .model = "llama-3.1-70b", .layers = 3,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 700},
    {.name = "4->2 8 heads HND", .model = "llama-3.1-70b", .layers = 3,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(2, HND, 16, 16), .tokens = 700},
    {.name = "3->2 6 heads", .model = "gpt-oss-120b", .layers = 4, .kv_heads = 6,
     .src = SIDE(3, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 500},
    {.name = "2->3 6 heads HND", .model = "gpt-oss-120b", .layers = 4, .kv_heads = 6,
     .src = SIDE(2, HND, 16, 16), .dst = SIDE(3, HND, 16, 16), .tokens = 500},
    {.name = "equal TP2 whole pages", .model = "gpt-oss-120b", .layers = 4,
     .src = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .consecutive = 1},
     .dst = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .consecutive = 1},
     .tokens = 1000},
    {.name = "equal TP4 random pages", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 777},
    {.name = "equal TP1 HND whole pages", .model = "llama-3.1-70b", .layers = 2,
     .src = {.tp = 1, .layout = HND, .ps_full = 64, .ps_swa = 64, .consecutive = 1},
     .dst = {.tp = 1, .layout = HND, .ps_full = 64, .ps_swa = 64, .consecutive = 1},
     .tokens = 1000},
    {.name = "SWA window unaligned 1->4", .model = "gpt-oss-20b", .layers = 6,
     .src = SIDE(1, NHD, 64, 16), .dst = SIDE(4, HND, 32, 48), .tokens = 1003},
    {.name = "SWA window unaligned equal TP", .model = "gpt-oss-20b", .layers = 6,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 1003},
    {.name = "SWA request < window 4->2", .model = "gpt-oss-20b", .layers = 4,
     .src = SIDE(4, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 100},
    {.name = "MLA 2->4", .model = "deepseek-v3", .layers = 3,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(4, NHD, 16, 16), .tokens = 500},
    {.name = "MLA 4->2 page 16->64", .model = "deepseek-v3", .layers = 3,
     .src = SIDE(4, NHD, 16, 16), .dst = SIDE(2, NHD, 64, 64), .tokens = 500},
    {.name = "GDN hybrid 1->2", .model = "qwen3-next", .layers = 4,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 300},
    {.name = "GDN hybrid 4->1 HND->NHD", .model = "qwen3-next", .layers = 8,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(1, NHD, 16, 16), .tokens = 300},
    {.name = "page 64->16 1->2", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 64, 64), .dst = SIDE(2, NHD, 16, 16), .tokens = 1000},
    {.name = "page 48->32 4->2 NHD->HND", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, NHD, 48, 24), .dst = SIDE(2, HND, 32, 8), .tokens = 700},
    {.name = "NHD->HND 2->4", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(4, HND, 16, 16), .tokens = 500},
    {.name = "HND->NHD 4->2", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(2, NHD, 16, 16), .tokens = 500},
    {.name = "HND->HND 1->2", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, HND, 16, 16), .dst = SIDE(2, HND, 16, 16), .tokens = 500},
    {.name = "prefix 37 1->4 from prefix page", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 16, 16),
     .dst = {.tp = 4, .layout = HND, .ps_full = 16, .ps_swa = 16, .full_from_prefix = 1},
     .tokens = 500, .prefix = 37},
    {.name = "MXFP8 scales 4->2 HND->NHD", .model = "gpt-oss-120b", .layers = 4, .mxfp8 = 1,
     .src = SIDE(4, HND, 16, 16), .dst = SIDE(2, NHD, 64, 16), .tokens = 400},
    {.name = "fused KV 2->4 NHD->HND", .model = "gpt-oss-120b", .layers = 4,
     .src = {.tp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16, .fused = 1},
     .dst = {.tp = 4, .layout = HND, .ps_full = 16, .ps_swa = 16, .fused = 1}, .tokens = 300},
    {.name = "PP2 TP1 -> TP2", .model = "gpt-oss-120b", .layers = 6,
     .src = {.tp = 1, .pp = 2, .layout = NHD, .ps_full = 16, .ps_swa = 16},
     .dst = SIDE(2, NHD, 16, 16), .tokens = 300},
    {.name = "chunk [128,640) not last", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(4, NHD, 32, 32), .tokens = 1000,
     .chunk_begin = 128, .chunk_end = 640},
    {.name = "buffers +4 bytes (4-byte units)", .model = "gpt-oss-120b", .layers = 4,
     .src = SIDE(1, NHD, 16, 16), .dst = SIDE(2, HND, 16, 16), .tokens = 300, .misalign = 4},
    {.name = "buffers +1 byte (1-byte units)", .model = "gpt-oss-120b", .layers = 2,
     .src = SIDE(2, NHD, 16, 16), .dst = SIDE(1, NHD, 16, 16), .tokens = 300, .misalign = 1},
};
const uint32_t gc_num_cases = sizeof(gc_cases) / sizeof(gc_cases[0]);

uint64_t gc_seed(const gc_case_t *c)
{
    uint64_t seed = 1469598103934665603ull; /* FNV-1a of the name */
    for (const char *p = c->name; *p; p++)
        seed = (seed ^ (uint8_t)*p) * 1099511628211ull;
    return seed % 1000003;
}

int gc_model(const gc_case_t *c, kvt_model_t *m)
{
    if (kvt_model_preset(c->model, m))
        return -1;
    if (c->layers && kvt_model_truncate(m, c->layers))
        return -1;
    if (c->kv_heads)
        m->m.num_kv_heads = c->kv_heads;
    if (c->mxfp8)
        kvt_model_set_block_scale(m, 32, 1);
    return 0;
}

kvw_chunk_t gc_chunk(const gc_case_t *c)
{
    if (c->chunk_end == 0)
        return (kvw_chunk_t){.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = c->tokens,
                             .chunk_begin = 0, .chunk_end = c->tokens,
                             .prefix_len = c->prefix, .last_chunk = 1};
    return (kvw_chunk_t){.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = c->tokens,
                         .chunk_begin = c->chunk_begin,
                         .chunk_end = c->chunk_end, .prefix_len = c->prefix,
                         .last_chunk = c->chunk_end == c->tokens};
}

static uint32_t gc_max_window(const kvt_model_t *m)
{
    uint32_t w = 0;
    for (uint32_t l = 0; l < m->m.num_layers; l++)
        if (m->layers[l].kind == KVW_LAYER_SWA && m->layers[l].window > w)
            w = m->layers[l].window;
    return w;
}

void gc_inst_free(gc_inst_t *in)
{
    for (uint32_t i = 0; i < in->n; i++) {
        if (in->pg)
            kvt_req_pages_free(&in->pg[i]);
        if (in->r)
            kvt_rank_free(&in->r[i]);
    }
    free(in->r);
    free(in->pg);
    memset(in, 0, sizeof(*in));
}

int gc_inst_build(gc_inst_t *in, const kvt_model_t *model, const gc_case_t *c, int is_dst,
                  uint64_t seed, char *msg, size_t cap)
{
    const gc_side_t *sc = is_dst ? &c->dst : &c->src;
    uint32_t pp = sc->pp ? sc->pp : 1;
    memset(in, 0, sizeof(*in));
    in->n = sc->tp * pp;
    in->r = calloc(in->n, sizeof(*in->r));
    in->pg = calloc(in->n, sizeof(*in->pg));
    if (!in->r || !in->pg) {
        snprintf(msg, cap, "out of memory");
        goto err;
    }
    uint64_t n = c->tokens;
    uint32_t w = gc_max_window(model);
    uint64_t swa_tokens = w && w < n ? w : n;
    uint32_t need_full = (uint32_t)((n + sc->ps_full - 1) / sc->ps_full) + 1;
    uint32_t need_swa = (uint32_t)((swa_tokens + sc->ps_swa - 1) / sc->ps_swa) + 1;
    kvt_rng_t rng = {seed * 7919 + 17};
    for (uint32_t p = 0; p < pp; p++) {
        uint32_t lb, le;
        kvt_pp_range(model->m.num_layers, pp, NULL, p, &lb, &le);
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
            spec.num_slots = 3;
            spec.fused_kv = sc->fused;
            kvw_status_t st = kvt_rank_build(&spec, &in->r[i]);
            if (st != KVW_OK) {
                snprintf(msg, cap, "%s rank %u: kvt_rank_build: %s (%s)",
                         is_dst ? "destination" : "source", i, kvw_status_string(st),
                         kvw_last_error());
                goto err;
            }
            kvt_rank_fill(&in->r[i], seed * 1000 + i + 1);
            kvt_req_spec_t rs;
            memset(&rs, 0, sizeof(rs));
            rs.full_begin = is_dst && sc->full_from_prefix ? c->prefix : 0;
            rs.full_end = n;
            rs.swa_begin = n > w ? n - w : 0;
            rs.swa_end = n;
            rs.state_slot = (int64_t)kvt_rng_below(&rng, spec.num_slots);
            rs.consecutive = sc->consecutive;
            rs.full_start = 2;
            rs.swa_start = 1;
            if (kvt_req_pages_make(&in->r[i], &rs, &rng, &in->pg[i])) {
                snprintf(msg, cap, "page tables for rank %u", i);
                goto err;
            }
        }
    }
    return 0;
err:
    gc_inst_free(in);
    return -1;
}

static kvw_status_t gc_rank_clone_as(const kvt_rank_t *r, kvw_mem_kind_t kind, int32_t device,
                                     uint8_t *const *addrs, bool check_mem, kvw_rank_h *h_p)
{
    kvw_buffer_desc_t *bufs = calloc(r->num_bufs ? r->num_bufs : 1, sizeof(*bufs));
    if (bufs == NULL)
        return KVW_ERR_NO_MEMORY;
    for (uint32_t i = 0; i < r->num_bufs; i++) {
        bufs[i] = r->bufs[i];
        bufs[i].addr = addrs ? addrs[i] : NULL;
        bufs[i].mem_kind = kind;
        bufs[i].device = device;
    }
    /* The rank's model points at its own layer table only after a relink. */
    kvt_model_t model = r->model;
    kvt_model_relink(&model);
    kvw_rank_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL | KVW_RANK_FIELD_BUFFERS;
    p.model = &model.m;
    p.parallel = r->par;
    p.buffers = bufs;
    p.num_buffers = r->num_bufs;
    kvw_status_t st = kvw__rank_create_as(&p, check_mem, h_p);
    free(bufs);
    return st;
}

kvw_status_t gc_rank_clone(const kvt_rank_t *r, kvw_mem_kind_t kind, int32_t device,
                           uint8_t *const *addrs, kvw_rank_h *h_p)
{
    return gc_rank_clone_as(r, kind, device, addrs, true, h_p);
}

kvw_status_t gc_rank_clone_unchecked(const kvt_rank_t *r, kvw_mem_kind_t kind, int32_t device,
                                     uint8_t *const *addrs, kvw_rank_h *h_p)
{
    return gc_rank_clone_as(r, kind, device, addrs, false, h_p);
}

int gc_expected(const kvt_model_t *model, const gc_case_t *c, gc_inst_t *S, gc_inst_t *D,
                kvt_copy_t *exp, uint64_t *bytes_p, char *msg, size_t cap)
{
    kvw_chunk_t ch = gc_chunk(c);
    uint64_t bytes = 0;
    int rc = -1;
    kvt_ref_side_t *srefs = calloc(S->n, sizeof(*srefs));
    uint8_t ***sdata = calloc(S->n, sizeof(*sdata));
    if (!srefs || !sdata) {
        snprintf(msg, cap, "out of memory");
        goto out;
    }
    for (uint32_t s = 0; s < S->n; s++) {
        sdata[s] = calloc(S->r[s].num_bufs + 1, sizeof(uint8_t *));
        if (!sdata[s]) {
            snprintf(msg, cap, "out of memory");
            goto out;
        }
        for (uint32_t b = 0; b < S->r[s].num_bufs; b++)
            sdata[s][b] = kvt_rank_data(&S->r[s], b);
        srefs[s] = kvt_ref_side(&S->r[s], &S->pg[s].side, sdata[s]);
    }
    for (uint32_t d = 0; d < D->n; d++) {
        kvt_copy_t naive;
        if (kvt_copy_make(&D->r[d], &naive) != KVW_OK) {
            snprintf(msg, cap, "out of memory");
            goto out;
        }
        kvt_ref_side_t dref = kvt_ref_side(&D->r[d], &D->pg[d].side, naive.data);
        char rmsg[256];
        if (kvt_ref_transfer(&model->m, srefs, S->n, &dref, &ch, NULL, NULL, rmsg,
                             sizeof(rmsg))) {
            snprintf(msg, cap, "naive reference failed (test bug): %s", rmsg);
            kvt_copy_free(&naive);
            goto out;
        }
        kvw_rank_h hd = NULL;
        kvw_status_t st = gc_rank_clone(&D->r[d], KVW_MEM_HOST, 0, exp[d].data, &hd);
        for (uint32_t s = 0; s < S->n && st == KVW_OK; s++) {
            kvw_plan_h plan = NULL;
            st = kvw_plan_create(S->r[s].h, hd, &ch, &S->pg[s].side, &D->pg[d].side, &plan);
            if (st == KVW_OK) {
                st = kvw_plan_exec_cpu(plan);
                kvw_plan_stats_t stats = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
                if (kvw_plan_stats(plan, &stats) == KVW_OK)
                    bytes += stats.bytes;
                kvw_plan_destroy(plan);
            }
        }
        if (st != KVW_OK)
            snprintf(msg, cap, "CPU reference for destination rank %u: %s (%s)", d,
                     kvw_status_string(st), kvw_last_error());
        kvw_rank_destroy(hd);
        if (st == KVW_OK) {
            char what[64];
            snprintf(what, sizeof(what), "dst rank %u: kvw_plan_exec_cpu vs naive reference", d);
            if (kvt_copy_compare2(&D->r[d], &exp[d], &naive, what, msg, cap))
                st = KVW_ERR_INTERNAL;
        }
        kvt_copy_free(&naive);
        if (st != KVW_OK)
            goto out;
    }
    *bytes_p = bytes;
    rc = 0;
out:
    if (sdata)
        for (uint32_t s = 0; s < S->n; s++)
            free(sdata[s]);
    free(sdata);
    free(srefs);
    return rc;
}

typedef struct gc_gather_ctx {
    const kvt_rank_t *src;
    uint8_t *out;
    uint64_t pos;
} gc_gather_ctx_t;

static kvw_status_t gc_gather_cb(void *arg, const kvw_run_t *run)
{
    gc_gather_ctx_t *g = arg;
    memcpy(g->out + g->pos, kvt_rank_data(g->src, run->src_buf) + run->src_off, run->len);
    g->pos += run->len;
    return KVW_OK;
}

kvw_status_t gc_expand_gather(kvw_plan_h plan, const kvt_rank_t *src, uint8_t *out)
{
    gc_gather_ctx_t g = {.src = src, .out = out};
    return kvw_plan_expand(plan, gc_gather_cb, &g);
}

uint32_t gc_total_bufs(const gc_inst_t *in)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < in->n; r++)
        n += in->r[r].num_bufs;
    return n;
}

uint32_t gc_buf_index(const gc_inst_t *in, uint32_t rank, uint32_t buf)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < rank; r++)
        n += in->r[r].num_bufs;
    return n + buf;
}

#define GC_GUARD 256u

uint64_t gc_arena_layout(const gc_inst_t *in, uint32_t misalign, uint64_t *offs)
{
    uint64_t cur = 0;
    uint32_t k = 0;
    for (uint32_t r = 0; r < in->n; r++)
        for (uint32_t b = 0; b < in->r[r].num_bufs; b++) {
            uint64_t off = (cur + GC_GUARD + 255) / 256 * 256 + misalign;
            offs[k++] = off;
            cur = off + in->r[r].bufs[b].length;
        }
    return (cur + GC_GUARD + 255) / 256 * 256;
}

void gc_arena_image(const gc_inst_t *in, const uint64_t *offs, uint64_t total, uint8_t *img)
{
    for (uint64_t i = 0; i < total; i++)
        img[i] = gc_poison(i);
    uint32_t k = 0;
    for (uint32_t r = 0; r < in->n; r++)
        for (uint32_t b = 0; b < in->r[r].num_bufs; b++, k++)
            memcpy(img + offs[k], kvt_rank_data(&in->r[r], b), in->r[r].bufs[b].length);
}

int gc_arena_check_poison(const gc_inst_t *in, const uint64_t *offs, uint64_t total,
                          const uint8_t *img, char *msg, size_t cap)
{
    uint64_t pos = 0;
    uint32_t k = 0;
    for (uint32_t r = 0; r <= in->n; r++) {
        uint32_t nb = r < in->n ? in->r[r].num_bufs : 1;
        for (uint32_t b = 0; b < nb; b++, k++) {
            int last = r == in->n;
            uint64_t end = last ? total : offs[k];
            for (uint64_t i = pos; i < end; i++)
                if (img[i] != gc_poison(i)) {
                    snprintf(msg, cap, "guard byte at arena offset %llu changed (0x%02x, "
                             "expected 0x%02x), %lld bytes %s buffer %u of rank %u",
                             (unsigned long long)i, img[i], gc_poison(i),
                             last ? (long long)(i - pos) : (long long)(end - i),
                             last ? "after the last" : "before", last ? 0 : b, last ? 0 : r);
                    return -1;
                }
            if (last)
                return 0;
            pos = offs[k] + in->r[r].bufs[b].length;
        }
    }
    return 0;
}

int gc_arena_view(const gc_inst_t *in, uint32_t rank, const uint64_t *offs, uint8_t *img,
                  kvt_copy_t *view)
{
    const kvt_rank_t *r = &in->r[rank];
    view->num_bufs = r->num_bufs;
    view->data = calloc(r->num_bufs + 1, sizeof(uint8_t *));
    view->len = calloc(r->num_bufs + 1, sizeof(uint64_t));
    if (!view->data || !view->len) {
        gc_view_free(view);
        return -1;
    }
    for (uint32_t b = 0; b < r->num_bufs; b++) {
        view->data[b] = img + offs[gc_buf_index(in, rank, b)];
        view->len[b] = r->bufs[b].length;
    }
    return 0;
}

void gc_view_free(kvt_copy_t *view)
{
    free(view->data);
    free(view->len);
    view->data = NULL;
    view->len = NULL;
}
