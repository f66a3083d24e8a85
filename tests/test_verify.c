/*
 * Verified rooms (KVW_VERIFY / kvw_ctx_params_t.verify): the end-to-end KV digest must
 * fail a room whose landed bytes are not the prefill's, naming where, on both sides, and
 * must never fail an honest one.
 *
 * Prefill and decode contexts in this process (one context per rank, real bootstrap,
 * control channels and data transport over loopback), over one transport (KVW_VERIFY_TL:
 * tcp, shm or ucx; default tcp), for each geometry below: TP1->TP4, TP4->TP1, TP3->TP2,
 * PP2->PP1, pages of 16 -> 64 (HND), MLA (TP1->TP2: a replicated head verified by each
 * replica), GDN state (TP2->TP1); every model has full-attention and sliding-window or
 * state layers.
 *
 * Each fault run moves two rooms side by side, each in two chunks: room A, whose bytes on
 * one decode rank are altered after they landed and before the room is checked, and room B,
 * untouched. The decode contexts run on the fault wrapper's "fault:NAME" transport, whose
 * notify hook (tests/fault) sees each completion before the receiver does: when the last
 * source's final completion of room A reaches the target decode rank, every byte of A
 * there has landed (writes precede their notification) and the hook applies the fault:
 *   corrupt  one byte of one row (one head, one token; GDN: a state group's row)
 *   swap     two heads of one token (MLA: two tokens of its one head)
 *   stale    one page left as it was before the transfer
 *   reorder  two pages' contents swapped
 *   drop     the first chunk's pages left as they were (its bytes never came)
 * Room A must fail on the target decode rank with BYTE_MISMATCH and a reason naming the
 * layer, component and (corrupt) the exact global head, and its prefill ranks must fail
 * too, with the decode's reason; room B must succeed on every rank with the bytes the test
 * kit's naive reference computes, guard bytes intact and no byte outside the two rooms'
 * pages changed; the metrics count the verified and the failed room. These runs use the
 * direct path (every byte in the pages when the completion arrives); a staged pass then
 * corrupts one byte of a staged window in the staging area before it is scattered, and
 * moves honest rooms, which must succeed. Last, a decode verifying half its rooms
 * (sample:0.5): the rooms verified and sampled out are exactly those the sampling rule,
 * written out again here, picks, and every honest room succeeds.
 *
 * GPU buffers (KVW_VERIFY_GPU=prefill, decode or both; on a GPU, or on the CPU stand-in of
 * the CUDA module given as KVW_CUDA_MODULE): that side's ranks hold their KV in device
 * memory, so its digest is the module's (the kernel, src/cuda/digest_core.h) while the
 * other side's is the CPU's: every verified room cross-checks the two implementations.
 * Faults in device buffers go through the host (mutate_dev). Not cuda_ipc: CUDA maps no
 * IPC handle into the process that exported it, and these contexts share one process.
 *
 * Env: KVW_VERIFY_TL=tcp|shm|ucx, KVW_VERIFY_ONLY=geometry name, KVW_VERIFY_REPEAT=N,
 * KVW_VERIFY_GPU=prefill|decode|both.
 * Exit: 0 pass, 1 fail, 77 skip (transport not usable here).
 */
#include "testkit.h"
#include "timeout.h"
#include "check.h"

#include <kvwire/xfer.h>

#include "fault/fault.h"
#include "proto/proto.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAXR 4
#define TOKENS 200
#define C1 128 /* the first chunk [0, C1): whole pages of every page size used */
#define DEADLINE_NS kvt_tmo_ns(60000000000ull)

typedef struct geo {
    const char *name, *model;
    uint32_t layers, heads; /* heads 0: the preset's */
    uint32_t ptp, dtp, ppp;
    uint32_t ppage, dpage;
    kvw_layout_t dlayout;
} geo_t;

static const geo_t geos[] = {
    {"tp1-tp4", "gpt-oss-120b", 2, 0, 1, 4, 1, 16, 16, KVW_LAYOUT_NHD},
    {"tp4-tp1", "gpt-oss-120b", 2, 0, 4, 1, 1, 16, 16, KVW_LAYOUT_HND},
    {"tp3-tp2", "gpt-oss-120b", 2, 6, 3, 2, 1, 16, 16, KVW_LAYOUT_NHD},
    {"pp2-pp1", "gpt-oss-120b", 2, 0, 1, 1, 2, 16, 16, KVW_LAYOUT_NHD},
    {"page16-64", "gpt-oss-120b", 2, 0, 1, 1, 1, 16, 64, KVW_LAYOUT_HND},
    {"mla-tp1-tp2", "deepseek-v3", 2, 0, 1, 2, 1, 16, 16, KVW_LAYOUT_NHD},
    {"gdn-tp2-tp1", "qwen3-next", 4, 0, 2, 1, 1, 16, 16, KVW_LAYOUT_NHD},
};

enum { F_CORRUPT, F_SWAP, F_STALE, F_REORDER, F_DROP, F_NUM };
static const char *const fault_names[F_NUM] = {"corrupt", "swap", "stale", "reorder", "drop"};

static const char *g_tl = "tcp";
static bool g_gpu_p, g_gpu_d; /* KVW_VERIFY_GPU: prefill or decode ranks on the "GPU" */
static char g_dtl[64];
static const char *g_verify = "every"; /* the decode contexts' mode */
static uint32_t g_sample_ppm;          /* sample:F, for the predictions below */
static uint64_t g_picked[2];           /* rooms predicted verified, not verified */

/* Whether room `id` is verified under g_verify: the sampling rule of xfer.h written out
 * again (splitmix64 of the id, below the fraction in parts per million). */
static bool picked(uint64_t id)
{
    if (strcmp(g_verify, "every") == 0)
        return true;
    uint64_t z = id + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z % 1000000u < g_sample_ppm;
}

typedef struct setup {
    const geo_t *g;
    kvt_model_t model;
    uint32_t np, nd;
    kvt_rank_t p[MAXR * 2], d[MAXR];
    kvw_ctx_h pctx[MAXR * 2], dctx[MAXR];
    uint32_t pfull, pswa, dfull, dswa; /* pool pages */
    uint8_t ***pdev, ***ddev; /* KVW_VERIFY_GPU: the device copies (kvt_gpu_attach) */
} setup_t;

/* ------------------------------------------------------------------ the hook */

typedef struct mutation {
    int fault; /* F_*, or -1: corrupt a staged window */
    const kvt_rank_t *rank;
    uint8_t *const *data;      /* the buffers to alter */
    uint8_t *const *pre;       /* their contents before the transfer */
    const kvw_side_pages_t *pages;
    uint8_t **dev;             /* KVW_VERIFY_GPU: the rank's device copies (data: host) */
} mutation_t;

static void mutate(const mutation_t *m);

/* A fault in device buffers: the rank's bytes copied to its host image, altered there,
 * and only the bytes that changed copied back (a window still being scattered elsewhere
 * in the buffer is left alone). Works on a GPU and on the CPU stand-in alike. */
static void mutate_dev(const mutation_t *m)
{
    const kvt_rank_t *r = m->rank;
    uint8_t **snap = calloc(r->num_bufs, sizeof(*snap));
    for (uint32_t b = 0; snap && b < r->num_bufs; b++) {
        if ((snap[b] = malloc(r->alloc_len[b])) == NULL ||
            kvt_cuda_memcpy(m->data[b], m->dev[b] + r->guard, r->alloc_len[b], NULL) != KVW_OK) {
            CHECK(0, "fault: from the device: %s", kvt_cuda_error());
            goto out;
        }
        memcpy(snap[b], m->data[b], r->alloc_len[b]);
    }
    mutate(m);
    for (uint32_t b = 0; snap && b < r->num_bufs; b++)
        for (uint64_t i = 0; i < r->alloc_len[b];) {
            if (m->data[b][i] == snap[b][i]) {
                i++;
                continue;
            }
            uint64_t e = i;
            while (e < r->alloc_len[b] && m->data[b][e] != snap[b][e])
                e++;
            CHECK(kvt_cuda_memcpy(m->dev[b] + r->guard + i, m->data[b] + i, e - i, NULL) ==
                      KVW_OK, "fault: to the device: %s", kvt_cuda_error());
            i = e;
        }
out:
    for (uint32_t b = 0; snap && b < r->num_bufs; b++)
        free(snap[b]);
    free(snap);
}

static struct {
    pthread_mutex_t mu;
    uint64_t room; /* 0: none */
    kvw_ctx_h dctx[MAXR];
    uint32_t nd, target;
    uint32_t need[MAXR], got[MAXR];
    mutation_t mut;
    bool applied;
    bool staged_seen; /* the staged pass: a window of the room was altered */
    /* Last chunks' final completions seen, with the room's digest inside and without. */
    uint64_t dig_inline, dig_apart;
} H = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void hook(void *arg, const void *msg, size_t len)
{
    uint8_t type = 0;
    uint32_t plen = 0;
    if (len < KVW_WIRE_HDR || kvw__wire_header(msg, &type, &plen) != KVW_OK ||
        type != KVW_MSG_DONE || plen != len - KVW_WIRE_HDR)
        return;
    kvw_rbuf_t rb;
    kvw__rb_init(&rb, (const uint8_t *)msg + KVW_WIRE_HDR, plen);
    kvw_done_msg_t dm;
    if (kvw__done_decode(&rb, &dm) != KVW_OK)
        return;
    pthread_mutex_lock(&H.mu);
    if (dm.final && dm.last_chunk)
        *(dm.digest_n ? &H.dig_inline : &H.dig_apart) += 1;
    if (H.room && dm.room == H.room && H.nd && arg == (void *)H.dctx[H.target]) {
        if (H.mut.fault < 0) {
            /* Staged: the first window of the room, altered in the staging area. */
            uint8_t *win = NULL;
            if (dm.staged && !H.applied && dm.slen > 8 &&
                kvw__stage_window(arg, dm.goff, dm.slen, &win)) {
                win[dm.slen / 2] ^= 0x5a;
                H.applied = true;
            }
        } else if (dm.final && dm.last_chunk && ++H.got[H.target] == H.need[H.target] &&
                   !H.applied) {
            if (H.mut.dev)
                mutate_dev(&H.mut);
            else
                mutate(&H.mut);
            H.applied = true;
        }
    }
    pthread_mutex_unlock(&H.mu);
}

/* ------------------------------------------------------------------ ranks and pages */

static const kvw_buffer_desc_t *buf_of(const kvt_rank_t *r, uint32_t layer, kvw_role_t role,
                                       uint32_t *index)
{
    for (uint32_t b = 0; b < r->num_bufs; b++)
        if (r->bufs[b].layer == layer && r->bufs[b].role == role) {
            *index = b;
            return &r->bufs[b];
        }
    return NULL;
}

/* The first full-attention or MLA layer the rank holds, and its K (or latent) buffer. */
static uint32_t full_layer(const kvt_model_t *m)
{
    for (uint32_t l = 0; l < m->m.num_layers; l++)
        if (m->layers[l].kind == KVW_LAYER_FULL || m->layers[l].kind == KVW_LAYER_MLA)
            return l;
    return 0;
}

/* Byte offset of (token t, local head h) of a paged K/V/latent buffer, written out from
 * kvwire.h's layouts (not the library's addressing code). */
static uint64_t row_off(const kvw_buffer_desc_t *b, const kvw_pages_t *pl, uint64_t t, uint32_t h)
{
    uint64_t ps = b->page_size, H = b->num_heads, hb = b->head_bytes;
    uint64_t page = pl->pages[(t - pl->first_token) / ps], x = (t - pl->first_token) % ps;
    uint64_t pbytes = ps * H * hb;
    return b->layout == KVW_LAYOUT_HND ? page * pbytes + h * ps * hb + x * hb
                                       : page * pbytes + x * H * hb + h * hb;
}

static void swap_bytes(uint8_t *a, uint8_t *b, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) {
        uint8_t t = a[i];
        a[i] = b[i];
        b[i] = t;
    }
}

/* The fault's row, page and expected reason for rank r (its model, TP rank). */
typedef struct target {
    uint32_t buf;
    const kvw_buffer_desc_t *b;
    uint32_t layer;
    const char *comp;
    uint32_t head0; /* the global head of local head 0 */
} target_t;

static int target_of(const kvt_rank_t *r, target_t *t)
{
    uint32_t l = full_layer(&r->model);
    bool mla = r->model.layers[l].kind == KVW_LAYER_MLA;
    t->layer = l;
    t->comp = mla ? "latent" : "K";
    t->b = buf_of(r, l, mla ? KVW_ROLE_LATENT : KVW_ROLE_K, &t->buf);
    uint32_t count = 0;
    if (t->b == NULL ||
        kvt_heads_owned(r->par.tp_size, r->par.tp_rank, mla ? 1 : r->model.m.num_kv_heads,
                        &t->head0, &count))
        return -1;
    return 0;
}

static void mutate(const mutation_t *m)
{
    target_t t;
    if (target_of(m->rank, &t))
        return;
    const kvw_buffer_desc_t *b = t.b;
    uint8_t *d = m->data[t.buf];
    const uint8_t *pre = m->pre[t.buf];
    const kvw_pages_t *pl = &m->pages->full;
    uint64_t pbytes = (uint64_t)b->page_size * b->num_heads * b->head_bytes;
    switch (m->fault) {
    case F_CORRUPT: {
        /* GDN: a row of the first state buffer's last group; else the last local head. */
        uint32_t sb;
        const kvw_buffer_desc_t *s = buf_of(m->rank, 0, KVW_ROLE_STATE, &sb);
        if (s) {
            uint64_t slot = 0, off = 0;
            for (uint32_t g = 0; g < s->num_groups; g++) {
                uint32_t f, c;
                kvt_heads_owned(m->rank->par.tp_size, m->rank->par.tp_rank,
                                s->groups[g].total_heads, &f, &c);
                slot += (uint64_t)c * s->groups[g].head_bytes;
                if (g + 1 < s->num_groups)
                    off += (uint64_t)c * s->groups[g].head_bytes;
            }
            m->data[sb][(uint64_t)m->pages->state_slot * slot + off + 7] ^= 0x5a;
        } else {
            d[row_off(b, pl, 37, b->num_heads - 1) + 5] ^= 0x5a;
        }
        break;
    }
    case F_SWAP:
        if (b->num_heads >= 2)
            swap_bytes(d + row_off(b, pl, 37, 0), d + row_off(b, pl, 37, 1), b->head_bytes);
        else
            swap_bytes(d + row_off(b, pl, 37, 0), d + row_off(b, pl, 38, 0), b->head_bytes);
        break;
    case F_STALE: {
        uint64_t p = pl->pages[1];
        memcpy(d + p * pbytes, pre + p * pbytes, pbytes);
        break;
    }
    case F_REORDER:
        swap_bytes(d + (uint64_t)pl->pages[0] * pbytes, d + (uint64_t)pl->pages[1] * pbytes,
                   pbytes);
        break;
    case F_DROP:
        /* Every full-attention buffer of the rank: the pages of [0, C1) as before. */
        for (uint32_t k = 0; k < m->rank->num_bufs; k++) {
            const kvw_buffer_desc_t *x = &m->rank->bufs[k];
            if (x->pool != KVW_POOL_FULL)
                continue;
            uint64_t xb = (uint64_t)x->page_size * x->num_heads * x->head_bytes;
            if (x->role == KVW_ROLE_KV)
                xb = (uint64_t)x->page_size * x->num_heads * (x->head_bytes + x->v_head_bytes);
            for (uint64_t i = 0; i < C1 / x->page_size; i++)
                memcpy(m->data[k] + pl->pages[i] * xb, m->pre[k] + pl->pages[i] * xb, xb);
        }
        break;
    default:
        break;
    }
}

/* The expected substring of the reason (`buf`). */
static void expected_where(const kvt_rank_t *r, int fault, char *buf, size_t cap)
{
    target_t t;
    if (target_of(r, &t)) {
        snprintf(buf, cap, "?");
        return;
    }
    uint32_t sb;
    const kvw_buffer_desc_t *s = buf_of(r, 0, KVW_ROLE_STATE, &sb);
    if (fault == F_CORRUPT && s) {
        uint32_t g = s->num_groups - 1, f = 0, c = 0;
        kvt_heads_owned(r->par.tp_size, r->par.tp_rank, s->groups[g].total_heads, &f, &c);
        snprintf(buf, cap, "KV digest mismatch at layer 0 state 0 group %u head %u ", g, f);
    } else if (fault == F_CORRUPT) {
        snprintf(buf, cap, "KV digest mismatch at layer %u %s head %u tokens [", t.layer, t.comp,
                 t.head0 + t.b->num_heads - 1);
    } else if (fault == F_DROP) {
        snprintf(buf, cap, "KV digest mismatch at layer ");
    } else {
        snprintf(buf, cap, "KV digest mismatch at layer %u %s head ", t.layer, t.comp);
    }
}

static uint32_t pages_for(uint64_t n, uint32_t ps)
{
    return (uint32_t)((n + ps - 1) / ps);
}

/* Disjoint random pages for rooms A and B on one side (pools of nf and ns pages). */
static int room_pages(kvt_rng_t *rng, uint32_t ps, uint32_t nf, uint32_t ns, uint32_t *store,
                      kvw_side_pages_t out[2])
{
    uint32_t need = pages_for(TOKENS, ps);
    uint32_t *pf = store, *psw = store + nf;
    if (kvt_pages_random(rng, nf, 2 * need, pf) || kvt_pages_random(rng, ns, 2 * need, psw))
        return -1;
    for (int i = 0; i < 2; i++) {
        out[i] = (kvw_side_pages_t){.field_mask = KVW_SIDE_PAGES_FIELDS_ALL, .state_slot = i};
        out[i].full = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, pf + i * need, need, 0};
        out[i].swa = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, psw + i * need, need, 0};
    }
    return 0;
}

/* ------------------------------------------------------------------ contexts */

static void setup_down(setup_t *s)
{
    for (uint32_t k = 0; k < s->nd; k++)
        if (s->dctx[k])
            kvw_ctx_destroy(s->dctx[k]), s->dctx[k] = NULL;
    for (uint32_t j = 0; j < s->np; j++)
        if (s->pctx[j])
            kvw_ctx_destroy(s->pctx[j]), s->pctx[j] = NULL;
    kvt_gpu_free(s->d, s->nd, s->ddev);
    kvt_gpu_free(s->p, s->np, s->pdev);
    s->ddev = s->pdev = NULL;
    for (uint32_t k = 0; k < s->nd; k++)
        kvt_rank_free(&s->d[k]);
    for (uint32_t j = 0; j < s->np; j++)
        kvt_rank_free(&s->p[j]);
}

/* KVW_VERIFY_GPU: the host images (just filled) copied to the device copies. */
static void push(kvt_rank_t *r, uint32_t n, uint8_t ***dev)
{
    for (uint32_t k = 0; dev && k < n; k++)
        for (uint32_t b = 0; b < r[k].num_bufs; b++)
            CHECK(kvt_cuda_memcpy(dev[k][b], r[k].mem[b], r[k].alloc_len[b] + 2ull * r[k].guard,
                                  NULL) == KVW_OK, "to the device: %s", kvt_cuda_error());
}

static int setup_up(setup_t *s, const geo_t *g)
{
    memset(s, 0, sizeof(*s));
    s->g = g;
    if (kvt_model_preset(g->model, &s->model) || kvt_model_truncate(&s->model, g->layers))
        return -1;
    if (g->heads)
        s->model.m.num_kv_heads = g->heads;
    kvt_model_relink(&s->model);
    s->np = g->ptp * g->ppp;
    s->nd = g->dtp;
    s->pfull = s->pswa = 2 * pages_for(TOKENS, g->ppage) + 3;
    s->dfull = s->dswa = 2 * pages_for(TOKENS, g->dpage) + 3;
    for (uint32_t j = 0; j < s->np; j++) {
        uint32_t stage = j / g->ptp, lb, le;
        kvt_pp_range(g->layers, g->ppp, NULL, stage, &lb, &le);
        kvt_rank_spec_t rs = {.model = &s->model, .layout = j % 2 ? KVW_LAYOUT_HND : KVW_LAYOUT_NHD,
                              .page_size = {g->ppage, g->ppage},
                              .num_pages = {s->pfull, s->pswa}, .num_slots = 2};
        rs.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = g->ptp,
                                  .tp_rank = j % g->ptp, .pp_size = g->ppp, .pp_rank = stage,
                                  .layer_begin = lb, .layer_end = le, .dp_size = 1};
        CHECK(kvt_rank_build(&rs, &s->p[j]) == KVW_OK, "%s: prefill rank %u: %s", g->name, j,
              kvw_last_error());
        if (failures)
            return -1;
        kvt_model_relink(&s->p[j].model);
    }
    for (uint32_t k = 0; k < s->nd; k++) {
        kvt_rank_spec_t rs = {.model = &s->model, .layout = g->dlayout,
                              .page_size = {g->dpage, g->dpage},
                              .num_pages = {s->dfull, s->dswa}, .num_slots = 2};
        rs.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = g->dtp,
                                  .tp_rank = k, .pp_size = 1, .layer_begin = 0,
                                  .layer_end = g->layers, .dp_size = 1};
        CHECK(kvt_rank_build(&rs, &s->d[k]) == KVW_OK, "%s: decode rank %u: %s", g->name, k,
              kvw_last_error());
        if (failures)
            return -1;
        kvt_model_relink(&s->d[k].model);
    }
    char msg[256];
    CHECK((!g_gpu_p || kvt_gpu_attach(s->p, s->np, 0, &s->pdev, msg, sizeof(msg)) == 0) &&
              (!g_gpu_d || kvt_gpu_attach(s->d, s->nd, 0, &s->ddev, msg, sizeof(msg)) == 0),
          "%s: GPU copies: %s", g->name, msg);
    if (failures)
        return -1;
    char bs[160] = "127.0.0.1:0";
    for (uint32_t j = 0; j < s->np; j++) {
        kvw_ctx_params_t p = {
            .field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK | KVW_CTX_FIELD_TRANSPORT |
                          KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_HOST_BOOTSTRAP |
                          KVW_CTX_FIELD_TIMEOUTS,
            .side = KVW_SIDE_PREFILL, .rank = s->p[j].h, .transport = g_tl,
            .bootstrap_addr = bs, .host_bootstrap = j == 0,
            .bootstrap_timeout_ms = kvt_tmo_ms(20000), .wait_timeout_ms = kvt_tmo_ms(30000)};
        CHECK(kvw_ctx_create(&p, &s->pctx[j]) == KVW_OK, "%s: prefill ctx %u: %s", g->name, j,
              kvw_last_error());
        if (failures)
            return -1;
        if (j == 0)
            snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(s->pctx[0]));
    }
    for (uint32_t k = 0; k < s->nd; k++) {
        kvw_ctx_params_t p = {
            .field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK | KVW_CTX_FIELD_TRANSPORT |
                          KVW_CTX_FIELD_BOOTSTRAP | KVW_CTX_FIELD_TIMEOUTS |
                          KVW_CTX_FIELD_PREFILL_SIZE | KVW_CTX_FIELD_VERIFY,
            .side = KVW_SIDE_DECODE, .rank = s->d[k].h, .transport = g_dtl,
            .bootstrap_addr = bs, .bootstrap_timeout_ms = kvt_tmo_ms(20000),
            .wait_timeout_ms = kvt_tmo_ms(30000), .prefill_tp = g->ptp, .prefill_pp = g->ppp,
            .prefill_dp = 1, .verify = g_verify};
        CHECK(kvw_ctx_create(&p, &s->dctx[k]) == KVW_OK, "%s: decode ctx %u: %s", g->name, k,
              kvw_last_error());
        if (failures)
            return -1;
    }
    return 0;
}

/* which: 0 verified, 1 failed, 2 sampled out. */
static uint64_t verify_metric(kvw_ctx_h ctx, int which)
{
    kvw_ctx_metrics_t m = {.field_mask = KVW_CTX_METRICS_FIELD_ROOMS_VERIFIED |
                                         KVW_CTX_METRICS_FIELD_ROOMS_VERIFY_FAILED |
                                         KVW_CTX_METRICS_FIELD_ROOMS_VERIFY_SKIPPED};
    if (kvw_ctx_metrics(ctx, &m) != KVW_OK)
        return UINT64_MAX;
    return which == 1 ? m.rooms_verify_failed : which == 2 ? m.rooms_verify_skipped
                                                           : m.rooms_verified;
}

static bool terminal(kvw_room_state_t s)
{
    return s == KVW_ROOM_SUCCESS || s == KVW_ROOM_FAILED;
}

static kvw_room_state_t wait_room(kvw_room_h room)
{
    uint64_t t0 = kvt_now_ns();
    kvw_room_state_t st;
    while (!terminal(st = kvw_room_poll(room)) && kvt_now_ns() - t0 < DEADLINE_NS)
        usleep(1000);
    return st;
}

/*
 * One run: rooms A (fault `fault`; -1: staged window corrupted; -2: none) and B on the
 * setup's contexts, ids a and a + 1. Every check is made here.
 */
static void run_pair(setup_t *s, int fault, uint64_t a, uint64_t seed)
{
    const geo_t *g = s->g;
    char what[96];
    snprintf(what, sizeof(what), "%s%s/%s/%s", g_tl,
             g_gpu_p && g_gpu_d ? "/gpu" : g_gpu_p ? "/gpu-prefill" : g_gpu_d ? "/gpu-decode" : "",
             g->name,
             fault >= 0 ? fault_names[fault] : fault == -1 ? "staged-corrupt" : "honest");
    kvt_rng_t rng = {seed};
    uint32_t *pstore = malloc(sizeof(uint32_t) * (s->pfull + s->pswa));
    uint32_t *dstore = malloc(sizeof(uint32_t) * (s->dfull + s->dswa));
    kvw_side_pages_t sp[2], dp[2];
    CHECK(pstore && dstore && room_pages(&rng, g->ppage, s->pfull, s->pswa, pstore, sp) == 0 &&
              room_pages(&rng, g->dpage, s->dfull, s->dswa, dstore, dp) == 0,
          "%s: pages", what);
    for (uint32_t j = 0; j < s->np; j++)
        kvt_rank_fill(&s->p[j], seed * 31 + j);
    kvt_copy_t pre[MAXR], expect[MAXR], maskA[MAXR];
    uint32_t target = s->nd - 1;
    uint64_t per_src[MAXR][MAXR * 2];
    memset(per_src, 0, sizeof(per_src));
    kvt_ref_side_t ss[MAXR * 2];
    uint8_t **sd[MAXR * 2];
    for (uint32_t j = 0; j < s->np; j++) {
        sd[j] = calloc(s->p[j].num_bufs, sizeof(uint8_t *));
        for (uint32_t b = 0; b < s->p[j].num_bufs; b++)
            sd[j][b] = kvt_rank_data(&s->p[j], b);
    }
    kvw_chunk_t whole = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                         .chunk_end = TOKENS, .last_chunk = 1};
    char msg[512];
    for (uint32_t k = 0; k < s->nd; k++) {
        kvt_rank_fill(&s->d[k], seed * 17 + 100 + k);
        kvt_copy_make(&s->d[k], &pre[k]);
        kvt_copy_make(&s->d[k], &expect[k]);
        kvt_copy_zeroed(&s->d[k], &maskA[k]);
        /* A's bytes go to a scratch copy (only where they land matters here). */
        kvt_copy_t scratch;
        kvt_copy_make(&s->d[k], &scratch);
        for (uint32_t j = 0; j < s->np; j++)
            ss[j] = kvt_ref_side(&s->p[j], &sp[0], sd[j]);
        kvt_ref_side_t ds = kvt_ref_side(&s->d[k], &dp[0], scratch.data);
        CHECK(kvt_ref_transfer(&s->model.m, ss, s->np, &ds, &whole, maskA[k].data, per_src[k],
                               msg, sizeof(msg)) == 0, "%s: reference A: %s", what, msg);
        kvt_copy_free(&scratch);
        for (uint32_t j = 0; j < s->np; j++)
            ss[j] = kvt_ref_side(&s->p[j], &sp[1], sd[j]);
        ds = kvt_ref_side(&s->d[k], &dp[1], expect[k].data);
        CHECK(kvt_ref_transfer(&s->model.m, ss, s->np, &ds, &whole, NULL, NULL, msg,
                               sizeof(msg)) == 0, "%s: reference B: %s", what, msg);
    }
    push(s->p, s->np, s->pdev);
    push(s->d, s->nd, s->ddev);
    uint64_t ver0 = verify_metric(s->dctx[target], 0), bad0 = verify_metric(s->dctx[target], 1);
    uint64_t skip0 = verify_metric(s->dctx[target], 2);

    pthread_mutex_lock(&H.mu);
    H.room = fault == -2 ? 0 : a;
    H.nd = s->nd;
    H.target = target;
    for (uint32_t k = 0; k < s->nd; k++) {
        H.dctx[k] = s->dctx[k];
        H.got[k] = 0;
        H.need[k] = 0;
        for (uint32_t j = 0; j < s->np; j++)
            H.need[k] += per_src[k][j] > 0;
    }
    H.mut = (mutation_t){.fault = fault, .rank = &s->d[target], .data = NULL,
                         .pre = pre[target].data, .pages = &dp[0]};
    uint8_t *live[64];
    for (uint32_t b = 0; b < s->d[target].num_bufs && b < 64; b++)
        live[b] = kvt_rank_data(&s->d[target], b);
    H.mut.dev = s->ddev ? s->ddev[target] : NULL;
    H.mut.data = live;
    H.applied = false;
    pthread_mutex_unlock(&H.mu);

    kvw_receiver_h rcv[2][MAXR] = {{0}};
    kvw_sender_h snd[2][MAXR * 2] = {{0}};
    for (int i = 0; i < 2; i++)
        for (uint32_t k = 0; k < s->nd; k++) {
            kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL,
                                    .num_tokens = TOKENS, .pages = dp[i]};
            CHECK(kvw_receiver_create(s->dctx[k], a + i, 0, &rcv[i][k]) == KVW_OK &&
                      kvw_receiver_post(rcv[i][k], &post) == KVW_OK,
                  "%s: post: %s", what, kvw_last_error());
        }
    for (int i = 0; i < 2; i++)
        for (uint32_t j = 0; j < s->np; j++)
            CHECK(kvw_sender_create(s->pctx[j], a + i, &snd[i][j]) == KVW_OK, "%s: sender: %s",
                  what, kvw_last_error());
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 2; i++)
            for (uint32_t j = 0; j < s->np; j++) {
                kvw_send_chunk_t ch = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL,
                                       .num_tokens = TOKENS, .chunk_begin = c ? C1 : 0,
                                       .chunk_end = c ? TOKENS : C1, .last_chunk = c,
                                       .pages = sp[i]};
                if (snd[i][j])
                    CHECK(kvw_sender_send(snd[i][j], &ch) == KVW_OK, "%s: send: %s", what,
                          kvw_last_error());
            }
    kvw_room_state_t st[2][MAXR];
    for (int i = 0; i < 2; i++)
        for (uint32_t k = 0; k < s->nd; k++)
            st[i][k] = rcv[i][k] ? wait_room(kvw_receiver_room(rcv[i][k])) : KVW_ROOM_FAILED;
    kvw_room_state_t pst[2][MAXR * 2];
    for (int i = 0; i < 2; i++)
        for (uint32_t j = 0; j < s->np; j++)
            pst[i][j] = snd[i][j] ? wait_room(kvw_sender_room(snd[i][j])) : KVW_ROOM_FAILED;

    pthread_mutex_lock(&H.mu);
    bool applied = H.applied;
    H.room = 0;
    pthread_mutex_unlock(&H.mu);
    if (s->ddev) /* what the checks below read: the device's bytes, guards included */
        CHECK(kvt_gpu_pull(s->d, s->nd, s->ddev, msg, sizeof(msg)) == 0, "%s: %s", what, msg);

    /* Room B: Success everywhere. */
    for (uint32_t k = 0; k < s->nd; k++)
        CHECK(st[1][k] == KVW_ROOM_SUCCESS, "%s: untouched room on decode rank %u ended %s: %s",
              what, k, kvw_room_state_string(st[1][k]),
              rcv[1][k] ? kvw_room_failure(kvw_receiver_room(rcv[1][k])) : "");
    for (uint32_t j = 0; j < s->np; j++)
        CHECK(pst[1][j] == KVW_ROOM_SUCCESS, "%s: untouched room on prefill rank %u ended %s: %s",
              what, j, kvw_room_state_string(pst[1][j]),
              snd[1][j] ? kvw_room_failure(kvw_sender_room(snd[1][j])) : "");
    if (fault == -2) {
        for (uint32_t k = 0; k < s->nd; k++)
            CHECK(st[0][k] == KVW_ROOM_SUCCESS, "%s: honest room A on decode rank %u ended %s: "
                  "%s", what, k, kvw_room_state_string(st[0][k]),
                  kvw_room_failure(kvw_receiver_room(rcv[0][k])));
    } else {
        CHECK(applied, "%s: the fault was never applied (no completion seen)", what);
        char where[160];
        if (fault >= 0)
            expected_where(&s->d[target], fault, where, sizeof(where));
        else
            snprintf(where, sizeof(where), "KV digest mismatch at layer ");
        const char *why = rcv[0][target] ? kvw_room_failure(kvw_receiver_room(rcv[0][target]))
                                         : "";
        CHECK(st[0][target] == KVW_ROOM_FAILED &&
                  kvw_room_status(kvw_receiver_room(rcv[0][target])) == KVW_ERR_BYTE_MISMATCH &&
                  strstr(why, where) != NULL,
              "%s: faulted room on decode rank %u ended %s (%d) '%s', wanted Failed naming '%s'",
              what, target, kvw_room_state_string(st[0][target]),
              rcv[0][target] ? (int)kvw_room_status(kvw_receiver_room(rcv[0][target])) : 0, why,
              where);
        /* The prefill ranks that write the target fail too, with the decode's reason. */
        for (uint32_t j = 0; j < s->np; j++) {
            if (per_src[target][j] == 0 || snd[0][j] == NULL)
                continue;
            const char *pw = kvw_room_failure(kvw_sender_room(snd[0][j]));
            CHECK(pst[0][j] == KVW_ROOM_FAILED && strstr(pw, "KV digest mismatch at ") != NULL,
                  "%s: faulted room on prefill rank %u ended %s '%s'", what, j,
                  kvw_room_state_string(pst[0][j]), pw);
        }
        /* And every other rank of room A ends with it, not at its wait timeout: a decode
         * rank failed by one source aborts the room on its other sources. */
        for (uint32_t j = 0; j < s->np; j++) {
            const char *pw = snd[0][j] ? kvw_room_failure(kvw_sender_room(snd[0][j])) : "";
            CHECK(strstr(pw, "timed out") == NULL, "%s: faulted room on prefill rank %u ended "
                  "at its wait timeout: '%s'", what, j, pw);
        }
        for (uint32_t k = 0; k < s->nd; k++) {
            const char *dw = rcv[0][k] ? kvw_room_failure(kvw_receiver_room(rcv[0][k])) : "";
            CHECK(strstr(dw, "timed out") == NULL, "%s: faulted room on decode rank %u ended at "
                  "its wait timeout: '%s'", what, k, dw);
        }
        CHECK(verify_metric(s->dctx[target], 1) == bad0 + 1,
              "%s: rooms_verify_failed %llu, wanted %llu", what,
              (unsigned long long)verify_metric(s->dctx[target], 1),
              (unsigned long long)(bad0 + 1));
    }
    /* Verified: room B (if picked), and A when honest (if picked); sampling counts the
     * others (every: none). */
    uint64_t want_ver = picked(a + 1) + (fault == -2 && picked(a));
    g_picked[0] += want_ver;
    g_picked[1] += (uint64_t)(1 + (fault == -2)) - want_ver;
    uint64_t want_skip = strcmp(g_verify, "every") ? (uint64_t)(1 + (fault == -2)) - want_ver : 0;
    CHECK(verify_metric(s->dctx[target], 0) == ver0 + want_ver &&
              verify_metric(s->dctx[target], 2) == skip0 + want_skip,
          "%s: rooms_verified %llu, sampled out %llu, wanted %llu and %llu", what,
          (unsigned long long)(verify_metric(s->dctx[target], 0) - ver0),
          (unsigned long long)(verify_metric(s->dctx[target], 2) - skip0),
          (unsigned long long)want_ver, (unsigned long long)want_skip);

    /* Bytes: B's as the reference has them, nothing outside A's pages changed, guards. */
    for (uint32_t k = 0; k < s->nd; k++) {
        for (uint32_t b = 0; b < s->d[k].num_bufs; b++) {
            const uint8_t *got = kvt_rank_data(&s->d[k], b);
            uint64_t bad = UINT64_MAX;
            for (uint64_t i = 0; i < expect[k].len[b] && bad == UINT64_MAX; i++)
                if (!maskA[k].data[b][i] && got[i] != expect[k].data[b][i])
                    bad = i;
            CHECK(bad == UINT64_MAX, "%s: decode rank %u buffer %u (layer %u role %d) byte %llu "
                  "differs from the reference", what, k, b, s->d[k].bufs[b].layer,
                  (int)s->d[k].bufs[b].role, (unsigned long long)bad);
        }
        CHECK(kvt_rank_check_guards(&s->d[k], msg, sizeof(msg)) == 0, "%s: %s", what, msg);
    }
    if (fault == -2) {
        /* The honest room A: every byte of the reference on every decode rank. */
        for (uint32_t k = 0; k < s->nd; k++) {
            for (uint32_t j = 0; j < s->np; j++)
                ss[j] = kvt_ref_side(&s->p[j], &sp[0], sd[j]);
            kvt_ref_side_t ds = kvt_ref_side(&s->d[k], &dp[0], expect[k].data);
            CHECK(kvt_ref_transfer(&s->model.m, ss, s->np, &ds, &whole, NULL, NULL, msg,
                                   sizeof(msg)) == 0, "%s: reference A: %s", what, msg);
            CHECK(kvt_copy_compare(&s->d[k], &expect[k], "decode", msg, sizeof(msg)) == 0,
                  "%s: decode rank %u: %s", what, k, msg);
        }
    }

    for (int i = 0; i < 2; i++) {
        for (uint32_t j = 0; j < s->np; j++)
            if (snd[i][j])
                kvw_room_destroy(kvw_sender_room(snd[i][j]));
        for (uint32_t k = 0; k < s->nd; k++)
            if (rcv[i][k])
                kvw_room_destroy(kvw_receiver_room(rcv[i][k]));
    }
    for (uint32_t k = 0; k < s->nd; k++) {
        kvt_copy_free(&pre[k]);
        kvt_copy_free(&expect[k]);
        kvt_copy_free(&maskA[k]);
    }
    for (uint32_t j = 0; j < s->np; j++)
        free(sd[j]);
    free(pstore);
    free(dstore);
    if (getenv("KVW_VERIFY_VERBOSE"))
        printf("  %s: decode rank %u: %s\n", what, target,
               fault == -2 ? "honest rooms verified" : "faulted room failed as expected");
}

int main(void)
{
    const char *tl = getenv("KVW_VERIFY_TL");
    if (tl && tl[0])
        g_tl = tl;
    snprintf(g_dtl, sizeof(g_dtl), "fault:%s@", g_tl);
    /* Up to four decode contexts at once: a small staging area each (windows of 2 MiB)
     * keeps the shared-memory footprint small beside the other tests ctest runs. */
    setenv("KVW_STAGING_MB", "8", 0);
    const char *gpu = getenv("KVW_VERIFY_GPU");
    g_gpu_p = gpu && (strcmp(gpu, "prefill") == 0 || strcmp(gpu, "both") == 0);
    g_gpu_d = gpu && (strcmp(gpu, "decode") == 0 || strcmp(gpu, "both") == 0);
    if (gpu && gpu[0] && !g_gpu_p && !g_gpu_d) {
        fprintf(stderr, "test_verify: KVW_VERIFY_GPU=%s: prefill, decode or both\n", gpu);
        return 1;
    }
    void *probe = NULL;
    if ((g_gpu_p || g_gpu_d) && kvt_cuda_malloc(64, &probe) != KVW_OK) {
        printf("test_verify: KVW_VERIFY_GPU=%s: no CUDA module (%s): skipped\n", gpu,
               kvt_cuda_error());
        return 77;
    }
    if (probe)
        kvt_cuda_free(probe);
    kvw__tl_fault_register();
    kvw__tl_fault_set_notify_hook(hook);
    bool usable = false;
    for (const char *const *n = kvw_transport_names(); *n; n++)
        usable |= strcmp(*n, g_tl) == 0;
    if (!usable) {
        printf("test_verify: transport %s not available here: skipped\n", g_tl);
        return 77;
    }
    const char *only = getenv("KVW_VERIFY_ONLY");
    const char *rep = getenv("KVW_VERIFY_REPEAT");
    int repeat = rep ? atoi(rep) : 1;
    uint64_t room = 1000;
    for (int it = 0; it < (repeat > 0 ? repeat : 1); it++)
        for (size_t gi = 0; gi < KVW_ARRAY_SIZE(geos); gi++) {
            if (only && only[0] && strcmp(only, geos[gi].name) != 0)
                continue;
            setup_t s;
            /* Direct path: every byte of a chunk is in the pages when its completion
             * arrives. */
            /* The room's digest inside the last completion or in its own frame (DIGEST,
             * on the control channel): one geometry in three with the default rule (inside
             * when the last step is at most 256 KiB), one always apart, one always inside. */
            setenv("KVW_PATH", "direct", 1);
            int dig_mode = (int)(gi % 3);
            bool apart = dig_mode == 1;
            if (dig_mode)
                setenv("KVW_VERIFY_INLINE_KB", apart ? "0" : "65536", 1);
            pthread_mutex_lock(&H.mu);
            H.dig_inline = H.dig_apart = 0;
            pthread_mutex_unlock(&H.mu);
            if (setup_up(&s, &geos[gi]) == 0) {
                for (int f = 0; f < F_NUM; f++, room += 2)
                    run_pair(&s, f, room, room * 7 + (uint64_t)it);
                run_pair(&s, -2, room, room * 7 + (uint64_t)it);
                room += 2;
            }
            setup_down(&s);
            unsetenv("KVW_VERIFY_INLINE_KB");
            pthread_mutex_lock(&H.mu);
            CHECK(dig_mode == 0 || (apart ? H.dig_inline == 0 && H.dig_apart > 0
                                          : H.dig_inline > 0 && H.dig_apart == 0),
                  "%s: digests %s: %llu final completions carried one, %llu did not",
                  geos[gi].name, apart ? "apart" : dig_mode ? "inside" : "by size",
                  (unsigned long long)H.dig_inline, (unsigned long long)H.dig_apart);
            pthread_mutex_unlock(&H.mu);
            /* Staged path: a window altered in the staging area, and honest rooms. */
            setenv("KVW_PATH", "staged", 1);
            if (setup_up(&s, &geos[gi]) == 0) {
                run_pair(&s, -1, room, room * 7 + (uint64_t)it);
                room += 2;
                run_pair(&s, -2, room, room * 7 + (uint64_t)it);
                room += 2;
            }
            setup_down(&s);
            unsetenv("KVW_PATH");
            printf("test_verify: %s %s done (%d failures so far)\n", g_tl, geos[gi].name,
                   failures);
            fflush(stdout);
        }
    /* Sampled: half the rooms, the same ones on every decode rank and both sides (the
     * prefill computes what each request asks); honest rooms all succeed. */
    if (!only || !only[0]) {
        setup_t s;
        g_verify = "sample:0.5";
        g_sample_ppm = 500000;
        setenv("KVW_PATH", "direct", 1);
        g_picked[0] = g_picked[1] = 0;
        if (setup_up(&s, &geos[0]) == 0)
            for (int k = 0; k < 8; k++, room += 2)
                run_pair(&s, -2, room, room * 7);
        CHECK(g_picked[0] > 0 && g_picked[1] > 0, "sampling picked %llu rooms of %llu",
              (unsigned long long)g_picked[0], (unsigned long long)(g_picked[0] + g_picked[1]));
        setup_down(&s);
        unsetenv("KVW_PATH");
        printf("test_verify: %s sampled rooms done (%d failures so far)\n", g_tl, failures);
    }
    kvw__tl_fault_set_notify_hook(NULL);
    if (failures) {
        fprintf(stderr, "test_verify: %d failures\n", failures);
        return 1;
    }
    printf("test_verify: all checks passed\n");
    return 0;
}
