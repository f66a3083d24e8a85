/*
 * The 0.2 API rules: field masks on every struct that crosses the API, and one room
 * handle for the calls both sides share.
 *
 * Field masks: a bit unknown to the library is refused (INVALID_PARAM, the message
 * names the struct, where it was passed and the unknown bits) on every kind of struct;
 * a required field left out is refused naming the field; an optional field left out
 * takes its documented default even when the caller's memory holds something else
 * there; a request struct (kvw_plan_stats_t, kvw_room_metrics_t) fills exactly the
 * fields asked for; report structs (routes, runs, config vars) come back with their
 * bits set.
 *
 * Room handle: in one process over tcp, a prefill TP1 and a decode TP1 rank move a room
 * sent and posted with minimal masks (the defaults make it a whole, last chunk), the
 * bytes are compared with the test kit's reference, and poll / wait / status / failure
 * / metrics / id / side work on both sides' room handles; a second room aborted through
 * the decode's room handle fails on both sides with the reason.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define UNKNOWN_BIT (1ull << 40)

static kvt_model_t model;

/* `st` is INVALID_PARAM and the last error contains every one of the needles. */
static void expect_refused(kvw_status_t st, const char *what, const char *n1, const char *n2,
                           const char *n3)
{
    const char *msg = kvw_last_error();
    CHECK(st == KVW_ERR_INVALID_PARAM, "%s: %s (want INVALID_PARAM): %s", what,
          kvw_status_string(st), msg);
    const char *needles[3] = {n1, n2, n3};
    for (int i = 0; i < 3; i++)
        if (needles[i])
            CHECK(kvt_contains(msg, needles[i]), "%s: message lacks '%s': %s", what, needles[i],
                  msg);
}

/* kvw_rank_create on a copy of `src`'s description where `edit` changed something. */
typedef struct rank_desc {
    kvw_model_t m;
    kvw_layer_desc_t layers[KVT_MAX_LAYERS];
    kvw_buffer_desc_t *bufs;
    kvw_rank_params_t p;
} rank_desc_t;

static void desc_copy(const kvt_rank_t *src, rank_desc_t *d)
{
    d->m = src->model.m;
    memcpy(d->layers, src->model.layers, sizeof(d->layers));
    d->m.layers = d->layers;
    d->bufs = malloc(sizeof(*d->bufs) * src->num_bufs);
    memcpy(d->bufs, src->bufs, sizeof(*d->bufs) * src->num_bufs);
    d->p = (kvw_rank_params_t){.field_mask = KVW_RANK_FIELDS_ALL, .model = &d->m,
                               .parallel = src->par, .buffers = d->bufs,
                               .num_buffers = src->num_bufs};
    d->p.parallel.field_mask = KVW_PARALLEL_FIELDS_ALL;
}

static kvw_status_t desc_create(rank_desc_t *d)
{
    kvw_rank_h h = NULL;
    kvw_status_t st = kvw_rank_create(&d->p, &h);
    kvw_rank_destroy(h);
    free(d->bufs);
    return st;
}

/* ---------------------------------------------------------------- rank descriptions */

static void test_rank_masks(const kvt_rank_t *r)
{
    rank_desc_t d;

    desc_copy(r, &d);
    CHECK(desc_create(&d) == KVW_OK, "the unchanged description: %s", kvw_last_error());

    desc_copy(r, &d);
    d.p.field_mask |= UNKNOWN_BIT;
    expect_refused(desc_create(&d), "rank params, unknown bit", "kvw_rank_params_t",
                   "0x10000000000", "unknown to this library");

    desc_copy(r, &d);
    d.m.field_mask |= UNKNOWN_BIT | (1ull << 63);
    expect_refused(desc_create(&d), "model, unknown bits", "params->model: kvw_model_t",
                   "bits 0x8000010000000000", "unknown");

    desc_copy(r, &d);
    d.layers[1].field_mask |= 1ull << 2;
    expect_refused(desc_create(&d), "layer, unknown bit", "params->model->layers[1]",
                   "kvw_layer_desc_t", "bits 0x4 unknown");

    desc_copy(r, &d);
    d.p.parallel.field_mask |= UNKNOWN_BIT;
    expect_refused(desc_create(&d), "parallel, unknown bit", "params->parallel",
                   "kvw_parallel_t", "0x10000000000");

    desc_copy(r, &d);
    d.bufs[2].field_mask |= 1ull << 13;
    expect_refused(desc_create(&d), "buffer, unknown bit", "params->buffers[2]",
                   "kvw_buffer_desc_t", "bits 0x2000 unknown");

    /* Required fields left out. */
    desc_copy(r, &d);
    d.m.field_mask &= ~(uint64_t)KVW_MODEL_FIELD_ELEM_SIZE;
    expect_refused(desc_create(&d), "model without elem_size", "kvw_model_t",
                   "required field elem_size", NULL);

    desc_copy(r, &d);
    d.bufs[1].field_mask &= ~(uint64_t)KVW_BUFFER_FIELD_LENGTH;
    expect_refused(desc_create(&d), "buffer without length", "params->buffers[1]",
                   "required field length", NULL);

    desc_copy(r, &d);
    d.p.field_mask &= ~(uint64_t)KVW_RANK_FIELD_BUFFERS;
    expect_refused(desc_create(&d), "rank params without buffers", "kvw_rank_params_t",
                   "required field buffers", NULL);

    /* gpt-oss starts with a sliding-window layer: its window is required. */
    desc_copy(r, &d);
    CHECK(d.layers[0].kind == KVW_LAYER_SWA, "layer 0 of the preset is not sliding-window");
    d.layers[0].field_mask = KVW_LAYER_FIELD_KIND;
    expect_refused(desc_create(&d), "SWA layer without window", "params->model->layers[0]",
                   "sliding-window layer requires field window", NULL);

    /* Optional fields left out take their defaults, whatever the memory holds. */
    desc_copy(r, &d);
    d.p.parallel.field_mask = KVW_PARALLEL_FIELD_TP_SIZE | KVW_PARALLEL_FIELD_TP_RANK;
    d.p.parallel.pp_size = 7;
    d.p.parallel.pp_rank = 5;
    d.p.parallel.layer_begin = 1;
    d.p.parallel.layer_end = 1000;
    d.p.parallel.dp_size = 9;
    d.p.parallel.dp_rank = 8;
    for (uint32_t i = 0; i < r->num_bufs; i++) {
        CHECK(d.bufs[i].pool == KVW_POOL_FULL || d.bufs[i].pool == KVW_POOL_SWA,
              "buffer %u of the preset is neither full nor SWA", i);
        if (d.bufs[i].pool == KVW_POOL_FULL)
            d.bufs[i].field_mask &= ~(uint64_t)KVW_BUFFER_FIELD_POOL;
        d.bufs[i].field_mask &= ~(uint64_t)(KVW_BUFFER_FIELD_LAYOUT | KVW_BUFFER_FIELD_MEM_KIND |
                                            KVW_BUFFER_FIELD_DEVICE |
                                            KVW_BUFFER_FIELD_V_HEAD_BYTES |
                                            KVW_BUFFER_FIELD_GROUPS);
        d.bufs[i].pool = d.bufs[i].pool == KVW_POOL_FULL ? KVW_POOL_STATE : d.bufs[i].pool;
        d.bufs[i].layout = KVW_LAYOUT_VECTORIZED_5D;
        d.bufs[i].mem_kind = KVW_MEM_CUDA;
        d.bufs[i].device = 3;
        d.bufs[i].v_head_bytes = 999;
        d.bufs[i].num_groups = 99;
    }
    d.m.field_mask &= ~(uint64_t)(KVW_MODEL_FIELD_MLA_DIM | KVW_MODEL_FIELD_SCALE_BLOCK |
                                  KVW_MODEL_FIELD_SCALE_ELEM_SIZE);
    d.m.mla_dim = 77;
    d.m.scale_block = 13;
    d.m.scale_elem_size = 5;
    kvw_rank_h h = NULL;
    kvw_status_t st = kvw_rank_create(&d.p, &h);
    CHECK(st == KVW_OK, "defaults of parallel, buffer and model fields: %s", kvw_last_error());
    if (st == KVW_OK) {
        const kvw_parallel_t *p = kvw_rank_parallel(h);
        CHECK(p->field_mask == KVW_PARALLEL_FIELDS_ALL && p->tp_size == 1 && p->tp_rank == 0 &&
                  p->pp_size == 1 && p->pp_rank == 0 && p->layer_begin == 0 &&
                  p->layer_end == model.m.num_layers && p->dp_size == 1 && p->dp_rank == 0,
              "parallel defaults: mask 0x%llx, TP %u/%u PP %u/%u layers [%u, %u) DP %u/%u",
              (unsigned long long)p->field_mask, p->tp_rank, p->tp_size, p->pp_rank, p->pp_size,
              p->layer_begin, p->layer_end, p->dp_rank, p->dp_size);
        const kvw_model_t *m = kvw_rank_model(h);
        CHECK(m->field_mask == KVW_MODEL_FIELDS_ALL && m->mla_dim == 0 && m->scale_block == 0 &&
                  m->scale_elem_size == 0 && m->layers[0].field_mask == KVW_LAYER_FIELDS_ALL &&
                  m->layers[0].window == model.layers[0].window,
              "model defaults: mask 0x%llx, mla %u, scales %u/%u",
              (unsigned long long)m->field_mask, m->mla_dim, m->scale_block, m->scale_elem_size);
        for (uint32_t i = 0; i < kvw_rank_num_buffers(h); i++) {
            const kvw_buffer_desc_t *b = kvw_rank_buffer(h, i);
            CHECK(b->field_mask == KVW_BUFFER_FIELDS_ALL && b->pool == r->bufs[i].pool &&
                      b->layout == KVW_LAYOUT_NHD && b->mem_kind == KVW_MEM_HOST &&
                      b->device == 0 && b->v_head_bytes == 0 && b->num_groups == 0 &&
                      b->addr == r->bufs[i].addr,
                  "buffer %u defaults: mask 0x%llx pool %d layout %d mem %d device %d v %u "
                  "groups %u", i, (unsigned long long)b->field_mask, b->pool, b->layout,
                  b->mem_kind, b->device, b->v_head_bytes, b->num_groups);
        }
    }
    kvw_rank_destroy(h);
    free(d.bufs);
}

/* ---------------------------------------------------------------- plans */

static void test_plan_masks(const kvt_rank_t *src, const kvt_rank_t *dst)
{
    kvt_rng_t rng = {5};
    kvt_req_spec_t rs = {.full_end = 50, .swa_end = 50, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(src, &rs, &rng, &sp) == 0 && kvt_req_pages_make(dst, &rs, &rng,
                                                                             &dp) == 0,
          "pages");
    const kvw_chunk_t full = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = 50,
                              .chunk_end = 50, .last_chunk = 1};
    kvw_plan_h a = NULL, b = NULL;
    CHECK(kvw_plan_create(src->h, dst->h, &full, &sp.side, &dp.side, &a) == KVW_OK, "%s",
          kvw_last_error());

    /* Only num_tokens: the chunk is the whole request, last, without prefix. The page
     * lists' first_token bits are left out too where the lists start at token 0. */
    kvw_chunk_t least = {.field_mask = KVW_CHUNK_FIELD_NUM_TOKENS, .num_tokens = 50,
                         .chunk_begin = 20, .chunk_end = 30, .prefix_len = 10, .last_chunk = 0};
    kvw_side_pages_t s2 = sp.side, d2 = dp.side;
    CHECK(s2.full.first_token == 0 && d2.full.first_token == 0, "full pages start at 0");
    s2.full.field_mask &= ~(uint64_t)KVW_PAGES_FIELD_FIRST_TOKEN;
    s2.full.first_token = 8;
    s2.field_mask &= ~(uint64_t)KVW_SIDE_PAGES_FIELD_STATE_SLOT;
    s2.state_slot = 1234;
    CHECK(kvw_plan_create(src->h, dst->h, &least, &s2, &d2, &b) == KVW_OK,
          "chunk of num_tokens only: %s", kvw_last_error());
    kvw_plan_stats_t sa = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
    kvw_plan_stats_t sb = {.field_mask = KVW_PLAN_STATS_FIELDS_ALL};
    CHECK(a && b && kvw_plan_stats(a, &sa) == KVW_OK && kvw_plan_stats(b, &sb) == KVW_OK,
          "stats: %s", kvw_last_error());
    CHECK(sa.bytes && sa.bytes == sb.bytes && sa.runs_coalesced == sb.runs_coalesced,
          "defaults give another plan: %llu vs %llu bytes",
          (unsigned long long)sa.bytes, (unsigned long long)sb.bytes);

    /* A request struct: only the fields asked for are written. */
    kvw_plan_stats_t part;
    memset(&part, 0xAB, sizeof(part));
    part.field_mask = KVW_PLAN_STATS_FIELD_BYTES | KVW_PLAN_STATS_FIELD_NUM_ROUTES;
    CHECK(kvw_plan_stats(a, &part) == KVW_OK, "%s", kvw_last_error());
    CHECK(part.bytes == sa.bytes && part.num_routes == sa.num_routes &&
              part.runs_coalesced == 0xABABABABABABABABull &&
              part.plan_bytes == 0xABABABABABABABABull &&
              part.field_mask == (KVW_PLAN_STATS_FIELD_BYTES | KVW_PLAN_STATS_FIELD_NUM_ROUTES),
          "partial stats: bytes %llu, runs_coalesced 0x%llx",
          (unsigned long long)part.bytes, (unsigned long long)part.runs_coalesced);
    part.field_mask = KVW_PLAN_STATS_FIELDS_ALL | UNKNOWN_BIT;
    expect_refused(kvw_plan_stats(a, &part), "plan stats, unknown bit", "kvw_plan_stats_t",
                   "0x10000000000", "unknown");

    /* Unknown bits and required fields of the plan's inputs. */
    kvw_plan_h x = NULL;
    kvw_chunk_t bad = full;
    bad.field_mask |= UNKNOWN_BIT;
    expect_refused(kvw_plan_create(src->h, dst->h, &bad, &sp.side, &dp.side, &x),
                   "chunk, unknown bit", "kvw_plan_create: chunk", "kvw_chunk_t",
                   "0x10000000000");
    bad = full;
    bad.field_mask &= ~(uint64_t)KVW_CHUNK_FIELD_NUM_TOKENS;
    expect_refused(kvw_plan_create(src->h, dst->h, &bad, &sp.side, &dp.side, &x),
                   "chunk without num_tokens", "kvw_chunk_t", "required field num_tokens", NULL);
    s2 = sp.side;
    s2.swa.field_mask |= 1ull << 3;
    expect_refused(kvw_plan_create(src->h, dst->h, &full, &s2, &dp.side, &x),
                   "pages, unknown bit", "src_pages.swa", "kvw_pages_t", "bits 0x8 unknown");
    d2 = dp.side;
    d2.field_mask |= UNKNOWN_BIT;
    expect_refused(kvw_plan_create(src->h, dst->h, &full, &sp.side, &d2, &x),
                   "side pages, unknown bit", "dst_pages", "kvw_side_pages_t", "0x10000000000");
    CHECK(x == NULL, "a refused plan was returned");

    /* Report structs come back with every bit set. */
    kvw_route_t routes[8];
    memset(routes, 0, sizeof(routes));
    size_t n = 0;
    CHECK(kvw_topo_routes(2, 4, 8, routes, 8, &n) == KVW_OK && n == 4, "routes: %s",
          kvw_last_error());
    for (size_t i = 0; i < n && i < 8; i++)
        CHECK(routes[i].field_mask == KVW_ROUTE_FIELDS_ALL, "route %zu mask 0x%llx", i,
              (unsigned long long)routes[i].field_mask);
    size_t nv = 0;
    const kvw_config_var_t *vars = kvw_config_vars(&nv);
    CHECK(nv > 0, "no config vars");
    for (size_t i = 0; i < nv; i++)
        CHECK(vars[i].field_mask == KVW_CONFIG_VAR_FIELDS_ALL, "config var %s mask 0x%llx",
              vars[i].name, (unsigned long long)vars[i].field_mask);

    kvw_plan_destroy(a);
    kvw_plan_destroy(b);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

static kvw_status_t run_mask(void *arg, const kvw_run_t *run)
{
    uint64_t *bad = arg;
    if (run->field_mask != KVW_RUN_FIELDS_ALL)
        (*bad)++;
    return KVW_OK;
}

static void test_run_masks(const kvt_rank_t *src, const kvt_rank_t *dst)
{
    kvt_rng_t rng = {6};
    kvt_req_spec_t rs = {.full_end = 20, .swa_end = 20, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(src, &rs, &rng, &sp) == 0 && kvt_req_pages_make(dst, &rs, &rng,
                                                                             &dp) == 0,
          "pages");
    kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELD_NUM_TOKENS, .num_tokens = 20};
    kvw_plan_h plan = NULL;
    uint64_t bad = 0;
    CHECK(kvw_plan_create(src->h, dst->h, &c, &sp.side, &dp.side, &plan) == KVW_OK &&
              kvw_plan_expand(plan, run_mask, &bad) == KVW_OK && bad == 0,
          "runs without their mask: %llu (%s)", (unsigned long long)bad, kvw_last_error());
    kvw_plan_destroy(plan);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

/* ---------------------------------------------------------------- contexts and rooms */

typedef struct env {
    kvt_rank_t src, dst;
    kvw_ctx_h pctx, dctx;
} env_t;

static kvw_status_t make_ctx(kvt_rank_t *r, bool prefill, const char *bs, bool host,
                             kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p =
        ip_params(prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, r, "tcp", bs, host);
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    /* Fields whose bit is clear are never read: junk prefill sizes without
     * KVW_CTX_FIELD_PREFILL_SIZE must not make the decode wait for a TP 7 instance. */
    p.prefill_tp = 7, p.prefill_pp = 5, p.prefill_dp = 3;
    return kvw_ctx_create(&p, ctx);
}

static void test_param_masks(env_t *e)
{
    kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, &e->dst, "tcp", "127.0.0.1:1", false);
    p.field_mask |= UNKNOWN_BIT;
    kvw_ctx_h ctx = NULL;
    expect_refused(kvw_ctx_create(&p, &ctx), "context params, unknown bit", "kvw_ctx_params_t",
                   "0x10000000000", "unknown");
    CHECK(ctx == NULL, "a refused context was returned");
    kvw_bootstrap_params_t bp = {.field_mask = KVW_BOOTSTRAP_FIELDS_ALL | UNKNOWN_BIT,
                                 .addr = "127.0.0.1:0"};
    kvw_bootstrap_h bs = NULL;
    expect_refused(kvw_bootstrap_start_ex(&bp, &bs), "bootstrap params, unknown bit",
                   "kvw_bootstrap_params_t", "0x10000000000", NULL);
    CHECK(bs == NULL, "a refused bootstrap was returned");
}

/* A room sent and posted with minimal masks, then checked through both room handles. */
static void test_room_handle(env_t *e)
{
    enum { TOKENS = 45 };
    kvt_rng_t rng = {11};
    kvt_req_spec_t rs = {.full_end = TOKENS, .swa_end = TOKENS, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&e->src, &rs, &rng, &sp) == 0 &&
              kvt_req_pages_make(&e->dst, &rs, &rng, &dp) == 0,
          "pages");
    kvt_copy_t expect;
    kvt_copy_make(&e->dst, &expect);

    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    CHECK(kvw_receiver_create(e->dctx, 77, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(e->pctx, 77, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_room_h rr = kvw_receiver_room(rcv), sr = kvw_sender_room(snd);
    CHECK(rr && sr && rr != sr, "room handles %p / %p", (void *)rr, (void *)sr);
    CHECK(kvw_room_id(rr) == 77 && kvw_room_id(sr) == 77, "room ids %llu / %llu",
          (unsigned long long)kvw_room_id(rr), (unsigned long long)kvw_room_id(sr));
    CHECK(kvw_room_side(rr) == KVW_SIDE_DECODE && kvw_room_side(sr) == KVW_SIDE_PREFILL,
          "room sides %d / %d", kvw_room_side(rr), kvw_room_side(sr));
    CHECK(kvw_room_status(rr) == KVW_INPROGRESS && kvw_room_status(sr) == KVW_INPROGRESS,
          "status before the transfer: %s / %s", kvw_status_string(kvw_room_status(rr)),
          kvw_status_string(kvw_room_status(sr)));
    CHECK(kvw_room_wait(rr, 0) < KVW_ROOM_SUCCESS, "wait(0) before the transfer: %s",
          kvw_room_state_string(kvw_room_wait(rr, 0)));

    /* Post: prefix_len left out (0) although the memory says 30. */
    kvw_recv_post_t post = {.field_mask =
                                KVW_RECV_POST_FIELD_NUM_TOKENS | KVW_RECV_POST_FIELD_PAGES,
                            .num_tokens = TOKENS, .prefix_len = 30, .pages = dp.side};
    kvw_recv_post_t bad = post;
    bad.field_mask |= UNKNOWN_BIT;
    expect_refused(kvw_receiver_post(rcv, &bad), "post, unknown bit",
                   "kvw_receiver_post: post: kvw_recv_post_t", "0x10000000000", NULL);
    bad = post;
    bad.field_mask = KVW_RECV_POST_FIELD_PAGES;
    expect_refused(kvw_receiver_post(rcv, &bad), "post without num_tokens", "kvw_recv_post_t",
                   "required field num_tokens", NULL);
    bad = post;
    bad.pages.full.field_mask |= UNKNOWN_BIT;
    expect_refused(kvw_receiver_post(rcv, &bad), "post, unknown bit in its pages",
                   "post->pages.full: kvw_pages_t", "0x10000000000", NULL);
    CHECK(kvw_room_poll(rr) == KVW_ROOM_BOOTSTRAPPING ||
          kvw_room_poll(rr) == KVW_ROOM_WAITING_FOR_INPUT,
          "a refused post changed the room: %s", kvw_room_state_string(kvw_room_poll(rr)));
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "post: %s", kvw_last_error());

    /* Send: the chunk range and last_chunk left out (the whole request, last) although
     * the memory says [10, 20) and not last; the state slot left out (none). */
    kvw_send_chunk_t c = {.field_mask =
                              KVW_SEND_CHUNK_FIELD_NUM_TOKENS | KVW_SEND_CHUNK_FIELD_PAGES,
                          .num_tokens = TOKENS, .chunk_begin = 10, .chunk_end = 20,
                          .last_chunk = 0, .pages = sp.side};
    c.pages.field_mask &= ~(uint64_t)KVW_SIDE_PAGES_FIELD_STATE_SLOT;
    c.pages.state_slot = 5;
    kvw_send_chunk_t bads = c;
    bads.field_mask |= UNKNOWN_BIT;
    expect_refused(kvw_sender_send(snd, &bads), "send, unknown bit",
                   "kvw_sender_send: chunk: kvw_send_chunk_t", "0x10000000000", NULL);
    bads = c;
    bads.field_mask = KVW_SEND_CHUNK_FIELD_NUM_TOKENS;
    expect_refused(kvw_sender_send_streamed(snd, &bads), "streamed send without pages",
                   "kvw_sender_send_streamed: chunk", "required field pages", NULL);
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "send: %s", kvw_last_error());

    kvw_room_state_t ds = kvw_room_wait(rr, kvt_tmo_ms(30000));
    kvw_room_state_t ps = kvw_room_wait(sr, kvt_tmo_ms(30000));
    CHECK(ds == KVW_ROOM_SUCCESS && ps == KVW_ROOM_SUCCESS, "room ended %s / %s: %s / %s",
          kvw_room_state_string(ds), kvw_room_state_string(ps), kvw_room_failure(rr),
          kvw_room_failure(sr));
    CHECK(kvw_room_poll(rr) == KVW_ROOM_SUCCESS && kvw_room_poll(sr) == KVW_ROOM_SUCCESS,
          "poll after success");
    CHECK(kvw_room_status(rr) == KVW_OK && kvw_room_status(sr) == KVW_OK, "status %s / %s",
          kvw_status_string(kvw_room_status(rr)), kvw_status_string(kvw_room_status(sr)));
    CHECK(!strcmp(kvw_room_failure(rr), "") && !strcmp(kvw_room_failure(sr), ""),
          "failure text of a successful room");

    uint64_t per_src = 0;
    ip_ref(&model, &e->src, 1, &sp.side, &e->dst, &dp.side, expect.data, TOKENS, &per_src);
    ip_verify(&e->dst, &expect, "minimal masks: ");

    kvw_room_metrics_t dm = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
    kvw_room_metrics_t pm = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
    CHECK(kvw_room_metrics(rr, &dm) == KVW_OK && kvw_room_metrics(sr, &pm) == KVW_OK, "%s",
          kvw_last_error());
    CHECK(dm.bytes == per_src && pm.bytes == per_src && per_src > 0,
          "bytes: decode %llu, prefill %llu, reference %llu", (unsigned long long)dm.bytes,
          (unsigned long long)pm.bytes, (unsigned long long)per_src);
    CHECK(dm.hop_ns[KVW_HOP_POST] && dm.hop_ns[KVW_HOP_SUCCESS] && pm.hop_ns[KVW_HOP_SEND] &&
              pm.hop_ns[KVW_HOP_SUCCESS] && pm.runs > 0 && pm.path && pm.path[0],
          "hops and runs of both sides");
    /* A request for some fields leaves the others alone; unknown bits are refused. */
    kvw_room_metrics_t part;
    memset(&part, 0xCD, sizeof(part));
    part.field_mask = KVW_ROOM_METRICS_FIELD_BYTES;
    CHECK(kvw_room_metrics(sr, &part) == KVW_OK && part.bytes == per_src &&
              part.runs == 0xCDCDCDCDCDCDCDCDull && part.hop_ns[0] == 0xCDCDCDCDCDCDCDCDull,
          "partial metrics: bytes %llu runs 0x%llx", (unsigned long long)part.bytes,
          (unsigned long long)part.runs);
    part.field_mask = UNKNOWN_BIT;
    expect_refused(kvw_room_metrics(rr, &part), "metrics, unknown bit", "kvw_room_metrics_t",
                   "0x10000000000", NULL);
    kvw_room_destroy(sr);
    kvw_room_destroy(rr);

    /* A second room, aborted through the decode's room handle. */
    CHECK(kvw_receiver_create(e->dctx, 78, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(e->pctx, 78, &snd) == KVW_OK, "%s", kvw_last_error());
    rr = kvw_receiver_room(rcv);
    sr = kvw_sender_room(snd);
    post.num_tokens = TOKENS;
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "post: %s", kvw_last_error());
    kvw_room_abort(rr);
    CHECK(kvw_room_poll(rr) == KVW_ROOM_FAILED && kvw_room_status(rr) == KVW_ERR_ABORTED &&
              kvt_contains(kvw_room_failure(rr), "aborted by the decode engine"),
          "decode after its abort: %s, %s: %s", kvw_room_state_string(kvw_room_poll(rr)),
          kvw_status_string(kvw_room_status(rr)), kvw_room_failure(rr));
    ps = kvw_room_wait(sr, kvt_tmo_ms(30000));
    CHECK(ps == KVW_ROOM_FAILED && kvw_room_status(sr) != KVW_OK &&
              kvt_contains(kvw_room_failure(sr), "abort"),
          "prefill after the decode's abort: %s, %s: %s", kvw_room_state_string(ps),
          kvw_status_string(kvw_room_status(sr)), kvw_room_failure(sr));
    kvw_room_destroy(sr);
    kvw_room_destroy(rr);

    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

static void test_null_handles(void)
{
    CHECK(kvw_sender_room(NULL) == NULL && kvw_receiver_room(NULL) == NULL, "room of NULL");
    CHECK(kvw_room_poll(NULL) == KVW_ROOM_FAILED && kvw_room_wait(NULL, 10) == KVW_ROOM_FAILED,
          "poll / wait of NULL");
    CHECK(kvw_room_status(NULL) == KVW_ERR_INVALID_PARAM && kvw_room_id(NULL) == 0,
          "status / id of NULL");
    CHECK(!strcmp(kvw_room_failure(NULL), "NULL handle"), "failure of NULL");
    kvw_room_metrics_t m = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
    expect_refused(kvw_room_metrics(NULL, &m), "metrics of NULL", "kvw_room_metrics",
                   "NULL argument", NULL);
    kvw_room_abort(NULL);
    kvw_room_destroy(NULL);
}

int main(void)
{
    env_t e;
    memset(&e, 0, sizeof(e));
    if (ip_model("test_api_masks", &model))
        return 1;
    CHECK(ip_rank(&model, 1, 0, 32, 2, &e.src) == KVW_OK &&
              ip_rank(&model, 1, 0, 32, 2, &e.dst) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return ip_summary("test_api_masks");
    kvt_rank_fill(&e.src, 41);
    kvt_rank_fill(&e.dst, 42);

    test_null_handles();
    test_rank_masks(&e.src);
    test_plan_masks(&e.src, &e.dst);
    test_run_masks(&e.src, &e.dst);
    test_param_masks(&e);

    kvw_status_t st = make_ctx(&e.src, true, "127.0.0.1:0", true, &e.pctx);
    CHECK(st == KVW_OK, "prefill context: %s", kvw_last_error());
    if (st == KVW_OK) {
        char bs[128];
        snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(e.pctx));
        st = make_ctx(&e.dst, false, bs, false, &e.dctx);
        CHECK(st == KVW_OK, "decode context: %s", kvw_last_error());
        if (st == KVW_OK)
            test_room_handle(&e);
    }
    kvw_ctx_destroy(e.dctx);
    kvw_ctx_destroy(e.pctx);
    kvt_rank_free(&e.src);
    kvt_rank_free(&e.dst);
    return ip_summary("test_api_masks");
}
