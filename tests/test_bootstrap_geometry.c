/*
 * A decode context must fail closed on the prefill instance's geometry: whatever the
 * decode expects (prefill TP, PP and DP sizes) must agree with what the registered
 * prefill ranks declare, and the decode must wait for every rank of the declared
 * instance. Regression for a decode told prefill_tp=1 while the prefill instance was
 * TP2: it took the first registered rank as the whole instance and reached Success with
 * half of the heads never written.
 *
 * In one process: prefill TP2 (rank 0 hosts the bootstrap endpoint), decode TP1, tcp.
 * Expected values come from the instance sizes set here, not from the library.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


static kvt_model_t model;

static kvw_status_t make_prefill(kvt_rank_t *r, const char *bs, bool host, kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, r, "tcp", bs, host);
    p.bootstrap_timeout_ms = kvt_tmo_ms(5000);
    p.wait_timeout_ms = kvt_tmo_ms(10000);
    return kvw_ctx_create(&p, ctx);
}

/* A decode context expecting a prefill instance of TP tp, PP pp, DP dp (0: as declared). */
static kvw_status_t make_decode(kvt_rank_t *r, const char *bs, uint32_t tp, uint32_t pp,
                                uint32_t dp, uint32_t boot_ms, kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, r, "tcp", bs, false);
    p.field_mask = (p.field_mask & ~KVW_CTX_FIELD_HOST_BOOTSTRAP) | KVW_CTX_FIELD_PREFILL_SIZE;
    p.bootstrap_timeout_ms = boot_ms;
    p.wait_timeout_ms = kvt_tmo_ms(10000);
    p.prefill_tp = tp;
    p.prefill_pp = pp;
    p.prefill_dp = dp;
    *ctx = NULL;
    return kvw_ctx_create(&p, ctx);
}

/* Expects a refusal with status `want` whose message holds every needle. */
static void expect_refused(kvw_status_t st, kvw_ctx_h ctx, kvw_status_t want, const char *what,
                           const char *n1, const char *n2)
{
    CHECK(st == want, "%s: got %s (%s), want %s", what, kvw_status_string(st), kvw_last_error(),
          kvw_status_string(want));
    if (st == KVW_OK) {
        kvw_ctx_destroy(ctx);
        return;
    }
    CHECK(kvt_contains(kvw_last_error(), n1), "%s: message lacks '%s': %s", what, n1,
          kvw_last_error());
    if (n2)
        CHECK(kvt_contains(kvw_last_error(), n2), "%s: message lacks '%s': %s", what, n2,
              kvw_last_error());
}

/* One room from prefill TP2 (both ranks) to decode TP1, every byte and guard checked. */
static void transfer_verified(kvw_ctx_h pctx[2], kvt_rank_t src[2], kvw_ctx_h dctx,
                              kvt_rank_t *dst)
{
    kvt_rng_t rng = {11};
    kvt_req_spec_t spec = {.full_begin = 0, .full_end = 40, .swa_begin = 0, .swa_end = 40,
                           .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&src[0], &spec, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(dst, &spec, &rng, &dp) == 0, "destination pages");
    kvt_copy_t expect;
    kvt_copy_make(dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd[2] = {NULL, NULL};
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 40,
                            .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_create(dctx, 5, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = 40,
                          .chunk_begin = 0, .chunk_end = 40, .last_chunk = 1,
                          .pages = sp.side};
    for (int k = 0; k < 2; k++) {
        CHECK(kvw_sender_create(pctx[k], 5, &snd[k]) == KVW_OK, "%s", kvw_last_error());
        CHECK(kvw_sender_send(snd[k], &c) == KVW_OK, "%s", kvw_last_error());
    }
    /* kvw_room_wait blocks until the state change (a generous bound, never reached
     * unless the room hangs). */
    kvw_room_state_t st = kvw_room_wait(kvw_receiver_room(rcv), kvt_tmo_ms(30000));
    CHECK(st == KVW_ROOM_SUCCESS, "room ended %s: %s", kvw_room_state_string(st),
          kvw_room_failure(kvw_receiver_room(rcv)));
    for (int k = 0; k < 2; k++) {
        kvw_room_state_t ps = kvw_room_wait(kvw_sender_room(snd[k]), kvt_tmo_ms(30000));
        CHECK(ps == KVW_ROOM_SUCCESS, "sender %d ended %s: %s", k, kvw_room_state_string(ps),
              kvw_room_failure(kvw_sender_room(snd[k])));
        /* Each side stamps its own hops, in protocol order. */
        kvw_room_metrics_t pm = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
        kvw_room_metrics(kvw_sender_room(snd[k]), &pm);
        const uint64_t *h = pm.hop_ns;
        CHECK(h[KVW_HOP_REQ_RX] && h[KVW_HOP_SEND] && h[KVW_HOP_WORKER] && h[KVW_HOP_BYTES_OUT] &&
                  h[KVW_HOP_ACK_RX] && h[KVW_HOP_SUCCESS],
              "sender %d lacks a hop stamp", k);
        CHECK(h[KVW_HOP_POST] == 0 && h[KVW_HOP_DONE_RX] == 0, "sender %d has decode hops", k);
        CHECK(h[KVW_HOP_WORKER] <= h[KVW_HOP_BYTES_OUT] && h[KVW_HOP_BYTES_OUT] <= h[KVW_HOP_ACK_RX] &&
                  h[KVW_HOP_ACK_RX] <= h[KVW_HOP_SUCCESS] && h[KVW_HOP_SEND] <= h[KVW_HOP_WORKER],
              "sender %d hops out of order", k);
    }
    kvw_room_metrics_t dm = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
    kvw_room_metrics(kvw_receiver_room(rcv), &dm);
    CHECK(dm.hop_ns[KVW_HOP_POST] && dm.hop_ns[KVW_HOP_DONE_RX] && dm.hop_ns[KVW_HOP_SUCCESS] &&
              dm.hop_ns[KVW_HOP_POST] <= dm.hop_ns[KVW_HOP_DONE_RX] &&
              dm.hop_ns[KVW_HOP_DONE_RX] <= dm.hop_ns[KVW_HOP_SUCCESS],
          "receiver hops missing or out of order");
    CHECK(dm.hop_ns[KVW_HOP_WORKER] == 0 && dm.hop_ns[KVW_HOP_ACK_RX] == 0,
          "receiver has prefill hops");
    /* A terminal room: wait returns at once, also with a zero timeout. */
    CHECK(kvw_room_wait(kvw_receiver_room(rcv), 0) == KVW_ROOM_SUCCESS,
          "wait(0) on a finished room");
    uint64_t per_src[2] = {0, 0};
    ip_ref(&model, src, 2, &sp.side, dst, &dp.side, expect.data, 40, per_src);
    CHECK(per_src[0] > 0 && per_src[1] > 0, "both prefill ranks must contribute heads");
    kvw_room_metrics_t mt = {.field_mask = KVW_ROOM_METRICS_FIELDS_ALL};
    kvw_room_metrics(kvw_receiver_room(rcv), &mt);
    CHECK(mt.bytes == per_src[0] + per_src[1], "%llu bytes confirmed, the reference moves %llu",
          (unsigned long long)mt.bytes, (unsigned long long)(per_src[0] + per_src[1]));
    ip_verify(dst, &expect, "");
    for (int k = 0; k < 2; k++)
        kvw_room_destroy(kvw_sender_room(snd[k]));
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
}

int main(void)
{
    kvt_model_preset("gpt-oss-120b", &model);
    kvt_model_truncate(&model, 2);
    kvt_rank_t src[2], dst;
    memset(src, 0, sizeof(src));
    memset(&dst, 0, sizeof(dst));
    CHECK(ip_rank(&model, 2, 0, 32, 2, &src[0]) == KVW_OK, "%s", kvw_last_error());
    CHECK(ip_rank(&model, 2, 1, 32, 2, &src[1]) == KVW_OK, "%s", kvw_last_error());
    CHECK(ip_rank(&model, 1, 0, 32, 2, &dst) == KVW_OK, "%s", kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src[0], 1);
    kvt_rank_fill(&src[1], 2);
    kvt_rank_fill(&dst, 3);

    kvw_ctx_h pctx[2] = {NULL, NULL}, dctx = NULL;
    CHECK(make_prefill(&src[0], "127.0.0.1:0", true, &pctx[0]) == KVW_OK, "%s", kvw_last_error());
    if (failures)
        return 1;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx[0]));

    /* Only prefill rank 0 of TP2 has registered. A decode expecting TP1 is refused at
     * once (before the fix it connected to rank 0 alone and took half the heads for all). */
    kvw_status_t st = make_decode(&dst, bs, 1, 1, 1, kvt_tmo_ms(3000), &dctx);
    expect_refused(st, dctx, KVW_ERR_INCOMPATIBLE, "prefill_tp=1 against TP2 rank 0",
                   "expects a prefill instance of TP 1", "declare TP 2");
    /* The same for PP and DP. */
    st = make_decode(&dst, bs, 2, 2, 1, kvt_tmo_ms(3000), &dctx);
    expect_refused(st, dctx, KVW_ERR_INCOMPATIBLE, "prefill_pp=2 against PP1", "PP 2", "PP 1");
    st = make_decode(&dst, bs, 2, 1, 2, kvt_tmo_ms(3000), &dctx);
    expect_refused(st, dctx, KVW_ERR_INCOMPATIBLE, "prefill_dp=2 against DP1", "DP 2", "DP 1");
    /* Sizes taken from the table (0) or given right: the decode waits for rank 1 and says
     * how many ranks registered at its timeout. */
    st = make_decode(&dst, bs, 0, 0, 0, kvt_tmo_ms(600), &dctx);
    expect_refused(st, dctx, KVW_ERR_TIMEOUT, "sizes from the table, rank 1 missing",
                   "1 of 2 prefill ranks registered", NULL);
    st = make_decode(&dst, bs, 2, 1, 1, kvt_tmo_ms(600), &dctx);
    expect_refused(st, dctx, KVW_ERR_TIMEOUT, "TP2 expected, rank 1 missing",
                   "1 of 2 prefill ranks registered", NULL);

    /* Rank 1 registers: a decode expecting TP2 connects and receives every head. Prefill
     * rank 1 and the decode busy-poll (KVW_BUSY_POLL_US), prefill rank 0 sleeps: both
     * ways of waiting for events move the same verified bytes. */
    setenv("KVW_BUSY_POLL_US", "200", 1);
    CHECK(make_prefill(&src[1], bs, false, &pctx[1]) == KVW_OK, "%s", kvw_last_error());
    st = make_decode(&dst, bs, 2, 1, 1, kvt_tmo_ms(5000), &dctx);
    unsetenv("KVW_BUSY_POLL_US");
    CHECK(st == KVW_OK, "TP2 decode: %s", kvw_last_error());
    if (st == KVW_OK) {
        transfer_verified(pctx, src, dctx, &dst);
        /* A room no prefill rank sends: kvw_room_wait returns at its timeout with the
         * room still open. */
        kvw_receiver_h idle = NULL;
        uint32_t pg[3] = {0, 1, 2};
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 40,
                                .pages = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                                          .full = {KVW_PAGES_FIELDS_ALL, pg, 3,
                                                   0}, .swa = {KVW_PAGES_FIELDS_ALL, pg, 3,
                                                               0}, .state_slot = -1}};
        CHECK(kvw_receiver_create(dctx, 9, 0, &idle) == KVW_OK, "%s", kvw_last_error());
        CHECK(kvw_receiver_post(idle, &post) == KVW_OK, "%s", kvw_last_error());
        kvw_room_state_t ws = kvw_room_wait(kvw_receiver_room(idle), kvt_tmo_ms(300));
        CHECK(ws == KVW_ROOM_WAITING_FOR_INPUT, "idle room after wait(300): %s",
              kvw_room_state_string(ws));
        kvw_room_destroy(kvw_receiver_room(idle));
        kvw_ctx_destroy(dctx);
    }
    /* With the whole instance registered, TP1 is still refused (n >= want is not enough). */
    st = make_decode(&dst, bs, 1, 0, 0, kvt_tmo_ms(3000), &dctx);
    expect_refused(st, dctx, KVW_ERR_INCOMPATIBLE, "prefill_tp=1 against the full TP2",
                   "TP 1", "TP 2");

    /* A rank that goes away takes its bootstrap entry with it (its registration
     * connection closes): a decode then waits for the instance to be whole again instead
     * of connecting to a rank that no longer exists. When the rank comes back, the
     * instance is whole again. */
    kvw_ctx_destroy(pctx[1]);
    pctx[1] = NULL;
    st = make_decode(&dst, bs, 2, 1, 1, kvt_tmo_ms(3000), &dctx);
    expect_refused(st, dctx, KVW_ERR_TIMEOUT, "TP2 decode after rank 1 went away",
                   "1 of 2 prefill ranks registered", NULL);
    CHECK(make_prefill(&src[1], bs, false, &pctx[1]) == KVW_OK, "%s", kvw_last_error());
    st = make_decode(&dst, bs, 2, 1, 1, kvt_tmo_ms(5000), &dctx);
    CHECK(st == KVW_OK, "TP2 decode after rank 1 came back: %s", kvw_last_error());
    if (st == KVW_OK)
        kvw_ctx_destroy(dctx);

    kvw_ctx_destroy(pctx[1]);
    kvw_ctx_destroy(pctx[0]);
    for (int k = 0; k < 2; k++)
        kvt_rank_free(&src[k]);
    kvt_rank_free(&dst);
    return ip_summary("test_bootstrap_geometry");
}
