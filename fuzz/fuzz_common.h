/*
 * Shared scaffolding of the fuzz targets (fuzz_frame.c, fuzz_hello.c, fuzz_plan.c):
 * a byte reader over the fuzz input, a small model and rank builders with real guarded
 * host buffers, a stub transport whose put() checks every write against the remote
 * region it targets, and "mini contexts": a struct kvw_ctx filled in by hand, without
 * threads or sockets, so that the real frame handlers (kvw__handle_frame,
 * kvw__on_notify, kvw__check_write, kvw__prefill_handshake) can be driven directly.
 *
 * Everything here is harness code: it may print and it aborts (fzc_fail) when an
 * oracle sees something the library must never do. Static functions only, prefixed
 * fzc_, so that several targets can be included into one translation unit (the
 * regression replayer tests/test_fuzz_regressions.c does that).
 */
#ifndef KVW_FUZZ_COMMON_H
#define KVW_FUZZ_COMMON_H

#include "proto/proto.h"
#include "testkit.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------ failures */

__attribute__((noreturn, format(printf, 1, 2), unused)) static void fzc_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FUZZ ORACLE: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

/* KVW_FUZZ_VERBOSE=1: the targets say what each input reached (for checking seeds). */
__attribute__((unused)) static int fzc_verbose(void)
{
    static int v = -1;
    if (v < 0)
        v = getenv("KVW_FUZZ_VERBOSE") != NULL;
    return v;
}

#define FZC_SAY(...)                                                                      \
    do {                                                                                  \
        if (fzc_verbose())                                                                \
            fprintf(stderr, "  fuzz: " __VA_ARGS__);                                     \
    } while (0)

/* ------------------------------------------------------------------ input reader */

/* Reads fixed-width little-endian values; past the end every read returns 0. */
typedef struct fzc_in {
    const uint8_t *p;
    size_t n, pos;
} fzc_in_t;

__attribute__((unused)) static size_t fzc_left(const fzc_in_t *in)
{
    return in->n - in->pos;
}

__attribute__((unused)) static uint8_t fzc_u8(fzc_in_t *in)
{
    return in->pos < in->n ? in->p[in->pos++] : 0;
}

__attribute__((unused)) static uint16_t fzc_u16(fzc_in_t *in)
{
    uint16_t v = fzc_u8(in);
    return (uint16_t)(v | (uint16_t)fzc_u8(in) << 8);
}

__attribute__((unused)) static uint32_t fzc_u32(fzc_in_t *in)
{
    uint32_t v = fzc_u16(in);
    return v | (uint32_t)fzc_u16(in) << 16;
}

__attribute__((unused)) static uint64_t fzc_u64(fzc_in_t *in)
{
    uint64_t v = fzc_u32(in);
    return v | (uint64_t)fzc_u32(in) << 32;
}

/* Takes n bytes (fewer at the end) into a fresh exact-size allocation, so that
 * AddressSanitizer sees any read past what the harness handed over. */
__attribute__((unused)) static uint8_t *fzc_take(fzc_in_t *in, size_t want, size_t *got_p)
{
    size_t n = want < fzc_left(in) ? want : fzc_left(in);
    uint8_t *b = malloc(n ? n : 1);
    if (b == NULL)
        fzc_fail("harness out of memory");
    /* An empty take still hands out one byte, which must then hold a value: readers
     * get a defined buffer and GCC no longer sees indeterminate memory passed on. */
    if (n)
        memcpy(b, in->p + in->pos, n);
    else
        b[0] = 0;
    in->pos += n;
    *got_p = n;
    return b;
}

/* ------------------------------------------------------------------ model and ranks */

/*
 * A small hybrid model: layer 0 sliding window (12 tokens), layer 1 full attention,
 * layer 2 linear attention (one state tensor of two groups). 8 KV heads of 4 + 4
 * bf16 elements: 8 bytes per head per token for K and for V.
 */
__attribute__((unused)) static void fzc_model(kvt_model_t *m)
{
    memset(m, 0, sizeof(*m));
    snprintf(m->name, sizeof(m->name), "fuzz-hybrid");
    m->m.num_layers = 3;
    m->layers[0] = (kvw_layer_desc_t){KVW_LAYER_FIELDS_ALL, KVW_LAYER_SWA, 12};
    m->layers[1] = (kvw_layer_desc_t){KVW_LAYER_FIELDS_ALL, KVW_LAYER_FULL, 0};
    m->layers[2] = (kvw_layer_desc_t){KVW_LAYER_FIELDS_ALL, KVW_LAYER_STATE, 0};
    m->m.num_kv_heads = 8;
    m->m.k_head_dim = 4;
    m->m.v_head_dim = 4;
    m->m.elem_size = 2;
    m->num_state_bufs = 1;
    m->state[0].num_groups = 2;
    m->state[0].groups[0] = (kvw_state_group_t){KVW_STATE_GROUP_FIELDS_ALL, 8, 6};
    m->state[0].groups[1] = (kvw_state_group_t){KVW_STATE_GROUP_FIELDS_ALL, 4, 10};
    kvt_model_relink(m);
}

#define FZC_FULL_PAGES 24
#define FZC_SWA_PAGES 16
#define FZC_SLOTS 3

typedef struct fzc_rank_cfg {
    uint32_t tp, rank;
    uint32_t page_full, page_swa;
    kvw_layout_t layout;
    int fused;
    int describe_only;
} fzc_rank_cfg_t;

/* Builds (once per process, by the caller) a rank of the fuzz model with guarded
 * buffers filled with a pattern. Aborts on failure: the harness is broken then. */
__attribute__((unused)) static kvt_rank_t *fzc_rank_build(const fzc_rank_cfg_t *c, uint64_t seed)
{
    static kvt_model_t model; /* kvt_rank_describe copies it */
    fzc_model(&model);
    kvt_rank_spec_t s = {.model = &model, .layout = c->layout,
                         .page_size = {c->page_full, c->page_swa},
                         .num_pages = {FZC_FULL_PAGES, FZC_SWA_PAGES},
                         .num_slots = FZC_SLOTS, .fused_kv = c->fused,
                         .describe_only = c->describe_only};
    s.par = (kvw_parallel_t){.field_mask = KVW_PARALLEL_FIELDS_ALL, .tp_size = c->tp,
                             .tp_rank = c->rank, .pp_size = 1, .pp_rank = 0,
                             .layer_begin = 0, .layer_end = model.m.num_layers, .dp_size = 1,
                             .dp_rank = 0};
    kvt_rank_t *r = calloc(1, sizeof(*r));
    if (r == NULL || kvt_rank_build(&s, r) != KVW_OK)
        fzc_fail("cannot build a tp%u/%u rank: %s", c->tp, c->rank, kvw_last_error());
    kvt_model_relink(&r->model); /* the struct was copied into *r */
    if (!c->describe_only)
        kvt_rank_fill(r, seed);
    return r;
}

/* A fresh handle with the same description (remote ranks have addr = NULL, as after
 * kvw__wire_get_rank). The caller owns it. */
__attribute__((unused)) static kvw_rank_h fzc_rank_clone(kvw_rank_h src)
{
    uint32_t nb = kvw_rank_num_buffers(src);
    kvw_buffer_desc_t *b = calloc(nb ? nb : 1, sizeof(*b));
    if (b == NULL)
        fzc_fail("harness out of memory");
    for (uint32_t i = 0; i < nb; i++) {
        b[i] = *kvw_rank_buffer(src, i);
        b[i].addr = NULL;
    }
    kvw_rank_params_t p = {.field_mask = KVW_RANK_FIELD_MODEL | KVW_RANK_FIELD_PARALLEL |
                                         KVW_RANK_FIELD_BUFFERS,
                           .model = kvw_rank_model(src), .parallel = *kvw_rank_parallel(src),
                           .buffers = b, .num_buffers = nb};
    kvw_rank_h h = NULL;
    if (kvw_rank_create(&p, &h) != KVW_OK)
        fzc_fail("cannot clone a rank description: %s", kvw_last_error());
    free(b);
    return h;
}

/* Page lists covering tokens [0, n) of both pools with pages 0, 1, 2, ... (SWA pages
 * from the window start, rounded down to the page size). */
typedef struct fzc_pages {
    kvw_side_pages_t side;
    uint32_t full[FZC_FULL_PAGES], swa[FZC_SWA_PAGES];
} fzc_pages_t;

__attribute__((unused)) static void fzc_pages_simple(const kvt_rank_t *r, uint64_t n, int64_t slot,
                                                     uint32_t full_start, fzc_pages_t *pg)
{
    memset(pg, 0, sizeof(*pg));
    uint32_t pf = r->page_size[0], ps = r->page_size[1];
    uint32_t nf = (uint32_t)((n + pf - 1) / pf);
    uint64_t ws = n > 12 ? n - 12 : 0;
    uint64_t swb = ws / ps * ps;
    uint32_t ns = n > swb ? (uint32_t)((n - swb + ps - 1) / ps) : 0;
    if (nf + full_start > FZC_FULL_PAGES || ns > FZC_SWA_PAGES)
        fzc_fail("harness request of %llu tokens does not fit the pools", (unsigned long long)n);
    for (uint32_t i = 0; i < nf; i++)
        pg->full[i] = full_start + i;
    for (uint32_t i = 0; i < ns; i++)
        pg->swa[i] = (i * 3 + 1) % FZC_SWA_PAGES;
    pg->side.full = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, pg->full, nf, 0};
    pg->side.swa = (kvw_pages_t){KVW_PAGES_FIELDS_ALL, pg->swa, ns, swb};
    pg->side.field_mask = KVW_SIDE_PAGES_FIELDS_ALL;
    pg->side.state_slot = slot;
}

/* ------------------------------------------------------------------ stub transport */

/* Remote keys are 12 bytes: region id (u32) and region length (u64). */
typedef struct fzc_rkey {
    uint32_t region;
    uint64_t len;
} fzc_rkey_t;

static char fzc_ep_dummy;

__attribute__((unused)) static void fzc_key_pack(uint8_t out[12], uint32_t region, uint64_t len)
{
    for (int i = 0; i < 4; i++)
        out[i] = (uint8_t)(region >> (8 * i));
    for (int i = 0; i < 8; i++)
        out[4 + i] = (uint8_t)(len >> (8 * i));
}

static kvw_status_t fzc_tl_connect(kvw_tl_h tl, const void *addr, size_t len, kvw_tl_ep_h *ep_p)
{
    (void)tl;
    (void)addr;
    (void)len;
    *ep_p = (kvw_tl_ep_h)(void *)&fzc_ep_dummy;
    return KVW_OK;
}

static kvw_status_t fzc_tl_rkey_unpack(kvw_tl_ep_h ep, const void *rkey, size_t len,
                                       kvw_tl_rkey_h *rkey_p)
{
    (void)ep;
    if (len != 12)
        return kvw__error(KVW_ERR_MALFORMED, "stub key of %zu bytes", len);
    const uint8_t *b = rkey;
    fzc_rkey_t *k = calloc(1, sizeof(*k));
    if (k == NULL)
        return KVW_ERR_NO_MEMORY;
    for (int i = 0; i < 4; i++)
        k->region |= (uint32_t)b[i] << (8 * i);
    for (int i = 0; i < 8; i++)
        k->len |= (uint64_t)b[4 + i] << (8 * i);
    *rkey_p = (kvw_tl_rkey_h)(void *)k;
    return KVW_OK;
}

static void fzc_tl_rkey_release(kvw_tl_rkey_h rkey)
{
    free(rkey);
}

static volatile uint64_t fzc_sink;
static uint64_t fzc_puts, fzc_put_bytes, fzc_notifies;

/* The oracle of the prefill data path: a write lands inside the remote region. The
 * source bytes are read, so AddressSanitizer checks the source side too. */
static kvw_status_t fzc_tl_put(kvw_tl_ep_h ep, uint64_t room, const kvw_tl_put_t *puts, size_t n)
{
    (void)ep;
    (void)room;
    for (size_t i = 0; i < n; i++) {
        const fzc_rkey_t *k = (const fzc_rkey_t *)(const void *)puts[i].rkey;
        if (k == NULL)
            fzc_fail("put without a remote key");
        if (puts[i].dst_off > k->len || puts[i].len > k->len - puts[i].dst_off)
            fzc_fail("put of %llu bytes at offset %llu outside remote region %u of %llu bytes",
                     (unsigned long long)puts[i].len, (unsigned long long)puts[i].dst_off,
                     k->region, (unsigned long long)k->len);
        const uint8_t *s = puts[i].src;
        uint64_t acc = 0;
        for (uint64_t j = 0; j < puts[i].len; j++)
            acc += s[j];
        fzc_sink += acc;
        __atomic_add_fetch(&fzc_puts, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&fzc_put_bytes, puts[i].len, __ATOMIC_RELAXED);
    }
    return KVW_OK;
}

static kvw_status_t fzc_tl_notify(kvw_tl_ep_h ep, const void *msg, size_t len)
{
    (void)ep;
    if (len > KVW_TL_MAX_NOTIFY)
        fzc_fail("notification of %zu bytes", len);
    const uint8_t *b = msg;
    uint64_t acc = 0;
    for (size_t i = 0; i < len; i++)
        acc += b[i];
    fzc_sink += acc;
    __atomic_add_fetch(&fzc_notifies, 1, __ATOMIC_RELAXED);
    return KVW_OK;
}

static void fzc_tl_ep_close(kvw_tl_ep_h ep)
{
    (void)ep;
}

__attribute__((unused)) static const kvw_tl_ops_t fzc_tl_ops = {
    .name = "tcp", /* what the fuzzed registrations name */
    .connect = fzc_tl_connect,
    .rkey_unpack = fzc_tl_rkey_unpack,
    .rkey_release = fzc_tl_rkey_release,
    .put = fzc_tl_put,
    .notify = fzc_tl_notify,
    .ep_close = fzc_tl_ep_close,
};

/* ------------------------------------------------------------------ mini contexts */

/* A context with no threads, sockets or transport instance: kvw_ctx_destroy tears it
 * down (it skips whatever was never started). */
__attribute__((unused)) static struct kvw_ctx *fzc_ctx_new(kvw_side_t side, kvw_rank_h rank)
{
    struct kvw_ctx *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        fzc_fail("harness out of memory");
    ctx->side = side;
    ctx->rank = rank;
    /* The memory kind as kvw_ctx_create sets it (a rank mixing kinds is left to the
     * code under test). */
    if (kvw__rank_memops(rank, NULL, &ctx->mem, &ctx->mem_dev) != KVW_OK)
        fzc_fail("harness: cannot tell the rank's memory kind");
    ctx->tl_ops = &fzc_tl_ops;
    ctx->listen_fd = -1;
    ctx->bs_fd = -1;
    snprintf(ctx->listen_host, sizeof(ctx->listen_host), "127.0.0.1");
    snprintf(ctx->bootstrap_addr, sizeof(ctx->bootstrap_addr), "127.0.0.1:1");
    ctx->heartbeat_ms = 200;
    ctx->peer_timeout_ms = 300;
    ctx->bootstrap_timeout_ms = 300;
    ctx->wait_timeout_ms = 30000;
    if (pipe2(ctx->wake_fd, O_CLOEXEC | O_NONBLOCK) < 0)
        fzc_fail("pipe2 failed");
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_cond_init(&ctx->cv, NULL);
    kvw__queue_init(ctx);
    kvw__ctx_cfg_read(ctx); /* the KVW_* variables, as kvw_ctx_create reads them */
    pthread_cond_init(&ctx->done_cv, NULL);
    if (side == KVW_SIDE_DECODE) {
        /* The context's own prefill instance, connected (its peers are added below). */
        int i0 = kvw__inst_find_or_add(ctx, ctx->bootstrap_addr);
        if (i0 != 0)
            fzc_fail("harness: no prefill instance");
        ctx->insts.tab[0].gen = 1;
        ctx->insts.tab[0].state = KVW_INST_READY;
    }
    return ctx;
}

__attribute__((unused)) static void fzc_ctx_drain_wake(struct kvw_ctx *ctx)
{
    char b[256];
    while (read(ctx->wake_fd[0], b, sizeof(b)) > 0) {
    }
}

/* Adds a peer whose rank description `remote` the peer takes over (as the handshake
 * does). Prefill side: gives it a data endpoint and one stub key per remote buffer. */
__attribute__((unused)) static kvw_peer_t *fzc_peer_add(struct kvw_ctx *ctx, kvw_rank_h remote)
{
    if (ctx->peers.num == ctx->peers.cap) {
        uint32_t cap = ctx->peers.cap ? ctx->peers.cap * 2 : 4;
        kvw_peer_t **n = realloc(ctx->peers.tab, sizeof(*n) * cap);
        if (n == NULL)
            fzc_fail("harness out of memory");
        ctx->peers.tab = n;
        ctx->peers.cap = cap;
    }
    kvw_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        fzc_fail("harness out of memory");
    p->id = ctx->peers.num;
    p->fd = -1;
    p->last_rx_ns = p->last_tx_ns = kvw__now_ns();
    p->remote = remote;
    const kvw_parallel_t *rp = kvw_rank_parallel(remote);
    p->dp = rp->dp_rank, p->tp = rp->tp_rank, p->pp = rp->pp_rank;
    p->remote_group_size = rp->tp_size * KVW_MAX(rp->pp_size, 1);
    /* Whether the pair exchanges bytes, as the handshake decides it. */
    kvw_rank_h src = ctx->side == KVW_SIDE_PREFILL ? ctx->rank : remote;
    kvw_rank_h dst = ctx->side == KVW_SIDE_PREFILL ? remote : ctx->rank;
    kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = 1, .chunk_begin = 0,
                     .chunk_end = 1, .last_chunk = 1};
    kvw_plan_h plan;
    if (kvw__plan_create_nopages(src, dst, &c, &plan) == KVW_OK) {
        p->needed = plan->num_segs > 0;
        kvw_plan_destroy(plan);
    }
    snprintf(p->desc, sizeof(p->desc), "fuzz peer %u (tp%u)", p->id, p->tp);
    p->inst = 0, p->inst_gen = 1; /* decode: the context's own instance */
    if (ctx->side == KVW_SIDE_PREFILL) {
        p->ep = (kvw_tl_ep_h)(void *)&fzc_ep_dummy;
        p->id_at_remote = p->id;
        p->num_rkeys = kvw_rank_num_buffers(remote);
        p->rkeys = calloc(p->num_rkeys ? p->num_rkeys : 1, sizeof(*p->rkeys));
        if (p->rkeys == NULL)
            fzc_fail("harness out of memory");
        for (uint32_t i = 0; i < p->num_rkeys; i++) {
            uint8_t k[12];
            fzc_key_pack(k, i, kvw_rank_buffer(remote, i)->length);
            if (fzc_tl_rkey_unpack(p->ep, k, sizeof(k), &p->rkeys[i]) != KVW_OK)
                fzc_fail("harness out of memory");
        }
    }
    ctx->peers.tab[ctx->peers.num++] = p;
    return p;
}

/* Runs the real prefill worker (kvw__worker_main) until the room queue is empty and no
 * room has a job in flight, then stops it. Returns 0, or -1 if it did not go idle
 * within `ms` (a hang: the caller decides). */
__attribute__((unused)) static int fzc_run_worker(struct kvw_ctx *ctx, unsigned ms)
{
    pthread_t t;
    ctx->stopping = false;
    if (pthread_create(&t, NULL, kvw__worker_main, ctx) != 0)
        fzc_fail("cannot start the worker thread");
    int rc = -1;
    uint64_t deadline = kvw__now_ns() + (uint64_t)ms * 1000000ull;
    while (kvw__now_ns() < deadline) {
        pthread_mutex_lock(&ctx->mu);
        bool idle = kvw__queue_empty(ctx);
        for (kvw_room_t *r = kvw__room_first(ctx); idle && r; r = kvw__room_next(ctx, r))
            idle &= r->inflight == 0;
        pthread_mutex_unlock(&ctx->mu);
        if (idle) {
            rc = 0;
            break;
        }
        usleep(50);
    }
    pthread_mutex_lock(&ctx->mu);
    ctx->stopping = true;
    pthread_cond_broadcast(&ctx->cv);
    kvw__queue_stop(ctx, true);
    pthread_mutex_unlock(&ctx->mu);
    pthread_join(t, NULL);
    ctx->stopping = false;
    kvw__queue_stop(ctx, false);
    return rc;
}

/* Checks the guard bytes of a rank with real buffers; aborts on damage. */
__attribute__((unused)) static void fzc_check_guards(const kvt_rank_t *r, const char *what)
{
    char msg[512];
    if (kvt_rank_check_guards(r, msg, sizeof(msg)))
        fzc_fail("%s: guard bytes changed: %s", what, msg);
}

#endif
