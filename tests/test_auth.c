/*
 * Shared-secret authentication at the handshake: a decode rank with the wrong secret,
 * or none, is refused with a clear message; a prefill rank that cannot prove the secret
 * is refused by the decode rank; matching secrets move verified bytes.
 */
#include "testkit.h"

#include <kvwire/xfer.h>

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

static kvt_model_t model;

static kvw_status_t make_rank(uint32_t tp, uint32_t rank, kvt_rank_t *r)
{
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {32, 32}, .num_slots = 2};
    s.par = (kvw_parallel_t){.tp_size = tp, .tp_rank = rank, .pp_size = 1, .layer_begin = 0,
                             .layer_end = model.m.num_layers, .dp_size = 1};
    return kvt_rank_build(&s, r);
}

static kvw_status_t make_ctx(kvw_side_t side, kvt_rank_t *r, const char *bs, const char *secret,
                             kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                        KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                        KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_SECRET |
                                        KVW_CTX_FIELD_TIMEOUTS,
                          .side = side, .rank = r->h, .transport = "tcp", .bootstrap_addr = bs,
                          .host_bootstrap = side == KVW_SIDE_PREFILL, .secret = secret,
                          .bootstrap_timeout_ms = 3000, .wait_timeout_ms = 5000};
    return kvw_ctx_create(&p, ctx);
}

/* One verified room from prefill TP1 to decode TP2 rank 0. */
static void transfer_once(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx, kvt_rank_t *dst)
{
    kvt_rng_t rng = {7};
    kvt_req_spec_t spec = {.full_begin = 0, .full_end = 40, .swa_begin = 0, .swa_end = 40,
                           .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(src, &spec, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(dst, &spec, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect;
    kvt_copy_make(dst, &expect);
    kvw_receiver_h rcv;
    kvw_sender_h snd;
    kvw_recv_post_t post = {.num_tokens = 40, .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_create(dctx, 77, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, 77, &snd) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.num_tokens = 40, .chunk_begin = 0, .chunk_end = 40, .last_chunk = 1,
                          .pages = sp.side};
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
    uint64_t t0 = kvt_now_ns();
    kvw_room_state_t st;
    while ((st = kvw_receiver_poll(rcv)) != KVW_ROOM_SUCCESS && st != KVW_ROOM_FAILED &&
           kvt_now_ns() - t0 < 10000000000ull)
        usleep(1000);
    CHECK(st == KVW_ROOM_SUCCESS, "room ended %s: %s", kvw_room_state_string(st),
          kvw_receiver_failure(rcv));
    uint8_t **sdata = calloc(src->num_bufs, sizeof(uint8_t *));
    for (uint32_t b = 0; b < src->num_bufs; b++)
        sdata[b] = kvt_rank_data(src, b);
    kvt_ref_side_t ss = kvt_ref_side(src, &sp.side, sdata);
    kvt_ref_side_t ds = kvt_ref_side(dst, &dp.side, expect.data);
    kvw_chunk_t chunk = {.num_tokens = 40, .chunk_end = 40, .last_chunk = 1};
    char msg[512];
    CHECK(kvt_ref_transfer(&model.m, &ss, 1, &ds, &chunk, NULL, NULL, msg, sizeof(msg)) == 0,
          "%s", msg);
    CHECK(kvt_copy_compare(dst, &expect, "decode", msg, sizeof(msg)) == 0, "%s", msg);
    CHECK(kvt_rank_check_guards(dst, msg, sizeof(msg)) == 0, "%s", msg);
    free(sdata);
    kvw_sender_destroy(snd);
    kvw_receiver_destroy(rcv);
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

int main(void)
{
    kvt_model_preset("gpt-oss-120b", &model);
    kvt_model_truncate(&model, 2);
    /* Only decode rank 0 of TP2 registers here, so the prefill instance is TP1 and the
     * decode side is described as TP2 rank 0. */
    kvt_rank_t src = {0}, dst = {0}, src2 = {0};
    CHECK(make_rank(1, 0, &src) == KVW_OK, "%s", kvw_last_error());
    CHECK(make_rank(2, 0, &dst) == KVW_OK, "%s", kvw_last_error());
    CHECK(make_rank(1, 0, &src2) == KVW_OK, "%s", kvw_last_error());
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&dst, 2);
    if (failures)
        return 1;

    kvw_ctx_h pctx, dctx;
    CHECK(make_ctx(KVW_SIDE_PREFILL, &src, "127.0.0.1:0", "alpha", &pctx) == KVW_OK, "%s",
          kvw_last_error());
    if (failures)
        return 1;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));

    char why[512];
    CHECK(kvw_ctx_refusals(pctx, why, sizeof(why)) == 0 && why[0] == 0, "refusals before any");
    kvw_status_t st = make_ctx(KVW_SIDE_DECODE, &dst, bs, "beta", &dctx);
    CHECK(st == KVW_ERR_AUTH, "wrong secret: got %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "does not match"), "message: %s", kvw_last_error());
    /* The prefill side can tell too (the refusal is counted before the answer is sent). */
    CHECK(kvw_ctx_refusals(pctx, why, sizeof(why)) == 1 && kvt_contains(why, "does not match"),
          "prefill's view of the refusal: %s", why);

    st = make_ctx(KVW_SIDE_DECODE, &dst, bs, NULL, &dctx);
    CHECK(st == KVW_ERR_AUTH, "no secret: got %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "requires a shared secret"), "message: %s",
          kvw_last_error());

    st = make_ctx(KVW_SIDE_DECODE, &dst, bs, "alpha", &dctx);
    CHECK(st == KVW_OK, "right secret: %s: %s", kvw_status_string(st), kvw_last_error());
    if (st == KVW_OK) {
        transfer_once(pctx, &src, dctx, &dst);
        kvw_ctx_destroy(dctx);
    }
    kvw_ctx_destroy(pctx);

    /* A prefill rank without the secret cannot prove it: the decode rank refuses. */
    CHECK(make_ctx(KVW_SIDE_PREFILL, &src2, "127.0.0.1:0", NULL, &pctx) == KVW_OK, "%s",
          kvw_last_error());
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    st = make_ctx(KVW_SIDE_DECODE, &dst, bs, "alpha", &dctx);
    CHECK(st == KVW_ERR_AUTH, "unproven prefill: got %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "did not prove"), "message: %s", kvw_last_error());
    kvw_ctx_destroy(pctx);

    kvt_rank_free(&src);
    kvt_rank_free(&src2);
    kvt_rank_free(&dst);
    if (failures) {
        fprintf(stderr, "test_auth: %d failures\n", failures);
        return 1;
    }
    printf("test_auth: all checks passed\n");
    return 0;
}
