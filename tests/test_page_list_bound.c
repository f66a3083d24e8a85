/*
 * Page lists are bounded by the pool: a request whose page list is longer than the
 * decode rank's pool holds is refused when the prefill rank parses it, before anything
 * is copied. Only that room fails, with a reason naming both counts; the prefill rank
 * keeps no state for it, and the same peer's next honest room succeeds with the
 * reference bytes.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int failures;
#define CHECK(c, ...)                                                                    \
    do {                                                                                 \
        if (!(c)) {                                                                      \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #c);       \
            fprintf(stderr, __VA_ARGS__);                                                \
            fprintf(stderr, "\n");                                                       \
            failures++;                                                                  \
        }                                                                                \
    } while (0)

#define TOKENS 64
#define DEADLINE_NS 30000000000ull

static kvt_model_t model;

static kvw_status_t make_rank(uint32_t tp, uint32_t rank, kvt_rank_t *r)
{
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {16, 16}, .num_slots = 1};
    s.par = (kvw_parallel_t){.tp_size = tp, .tp_rank = rank, .pp_size = 1, .layer_begin = 0,
                             .layer_end = model.m.num_layers, .dp_size = 1};
    return kvt_rank_build(&s, r);
}


static kvw_room_state_t wait_end(kvw_receiver_h rcv)
{
    uint64_t t0 = kvt_now_ns();
    kvw_room_state_t st;
    while ((st = kvw_receiver_poll(rcv)) != KVW_ROOM_SUCCESS && st != KVW_ROOM_FAILED &&
           kvt_now_ns() - t0 < DEADLINE_NS)
        usleep(1000);
    return st;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (kvt_model_preset("gpt-oss-120b", &model) || kvt_model_truncate(&model, 2)) {
        fprintf(stderr, "test_page_list_bound: no gpt-oss-120b preset\n");
        return 1;
    }
    kvt_rank_t src = {0}, dst = {0};
    CHECK(make_rank(1, 0, &src) == KVW_OK && make_rank(1, 0, &dst) == KVW_OK, "%s",
          kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src, 3);
    kvt_rank_fill(&dst, 4);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                        KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                        KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_TIMEOUTS,
                          .side = KVW_SIDE_PREFILL, .rank = src.h, .transport = "tcp",
                          .bootstrap_addr = "127.0.0.1:0", .host_bootstrap = 1,
                          .bootstrap_timeout_ms = 10000, .wait_timeout_ms = 20000};
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    p.side = KVW_SIDE_DECODE;
    p.rank = dst.h;
    p.bootstrap_addr = bs;
    p.host_bootstrap = 0;
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (dctx == NULL) {
        kvw_ctx_destroy(pctx);
        return 1;
    }

    /* The hostile request, sent on the decode rank's own control channel: a full-pool
     * list one page longer than the pool (16 pages). */
    kvw_receiver_h bad = NULL;
    CHECK(kvw_receiver_create(dctx, 21, 0, &bad) == KVW_OK, "%s", kvw_last_error());
    struct kvw_ctx *d = dctx;
    const uint32_t n = 17;
    pthread_mutex_lock(&d->mu);
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_REQ);
    kvw__wb_u64(&w, 21);
    kvw__wb_u32(&w, 0);  /* dp */
    kvw__wb_u64(&w, 16); /* tokens */
    kvw__wb_u64(&w, 0);  /* prefix */
    kvw__wb_u64(&w, 0);  /* full: first token */
    kvw__wb_u32(&w, n);
    for (uint32_t i = 0; i < n; i++)
        kvw__wb_u32(&w, i);
    kvw__wb_u64(&w, 0); /* swa: empty */
    kvw__wb_u32(&w, 0);
    kvw__wb_u64(&w, (uint64_t)-1); /* no state slot */
    kvw__peer_send(d, d->peers[0], &w);
    pthread_mutex_unlock(&d->mu);
    kvw_room_state_t st = wait_end(bad);
    CHECK(st == KVW_ROOM_FAILED, "the oversized request's room ended %s",
          kvw_room_state_string(st));
    const char *why = kvw_receiver_failure(bad);
    CHECK(why && kvt_contains(why, "17 pages is longer than the pool (16 pages)"),
          "reason: %s", why ? why : "(none)");
    struct kvw_ctx *pc = pctx;
    pthread_mutex_lock(&pc->mu);
    bool kept = kvw__room_find(pc, 21) != NULL;
    pthread_mutex_unlock(&pc->mu);
    CHECK(!kept, "the prefill rank kept a room for the refused request");
    kvw_receiver_destroy(bad);

    /* The same peer's next room goes through. */
    kvt_rng_t rng = {5};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0,
                         .swa_end = TOKENS, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&src, &rs, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(&dst, &rs, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect;
    kvt_copy_make(&dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.num_tokens = TOKENS, .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_create(dctx, 22, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, 22, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.num_tokens = TOKENS, .chunk_begin = 0, .chunk_end = TOKENS,
                          .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
    st = wait_end(rcv);
    CHECK(st == KVW_ROOM_SUCCESS, "honest room ended %s: %s", kvw_room_state_string(st),
          kvw_receiver_failure(rcv));
    uint8_t **sdata = calloc(src.num_bufs, sizeof(uint8_t *));
    for (uint32_t b = 0; b < src.num_bufs; b++)
        sdata[b] = kvt_rank_data(&src, b);
    kvt_ref_side_t ss = kvt_ref_side(&src, &sp.side, sdata);
    kvt_ref_side_t ds = kvt_ref_side(&dst, &dp.side, expect.data);
    kvw_chunk_t chunk = {.num_tokens = TOKENS, .chunk_end = TOKENS, .last_chunk = 1};
    char msg[512];
    CHECK(kvt_ref_transfer(&model.m, &ss, 1, &ds, &chunk, NULL, NULL, msg, sizeof(msg)) == 0,
          "%s", msg);
    CHECK(kvt_copy_compare(&dst, &expect, "decode", msg, sizeof(msg)) == 0, "%s", msg);
    CHECK(kvt_rank_check_guards(&dst, msg, sizeof(msg)) == 0, "%s", msg);
    free(sdata);
    kvw_sender_destroy(snd);
    kvw_receiver_destroy(rcv);
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    if (failures) {
        fprintf(stderr, "test_page_list_bound: %d failures\n", failures);
        return 1;
    }
    printf("test_page_list_bound: all checks passed\n");
    return 0;
}
