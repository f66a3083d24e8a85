/*
 * A registration's staging area is checked when it arrives: a decode rank declaring a
 * 2-byte staging area (which made a prefill worker spin until the room timed out) is
 * refused with a reason, its room fails naming the size, the prefill rank counts the
 * refusal and adds no peer; an honest decode rank then moves a room with every byte
 * checked.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOKENS 48
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_stage_declared", &model))
        return 1;
    kvt_rank_t src = {0}, bad = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &bad) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&dst, 2);
    kvw_ctx_h pctx = NULL, b = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(5000);
    p.wait_timeout_ms = kvt_tmo_ms(10000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    ip_params_decode(&p, pctx, &bad, bs, sizeof(bs));
    kvw_ctx_params_t q = p;
    q.field_mask &= ~(uint64_t)KVW_CTX_FIELD_BOOTSTRAP; /* connects on demand */
    q.field_mask |= KVW_CTX_FIELD_INSTANCE;
    q.instance_id = 7;
    CHECK(kvw_ctx_create(&q, &b) == KVW_OK, "decode: %s", kvw_last_error());
    if (b == NULL)
        return 1;
    struct kvw_ctx *d = b, *pc = pctx;
    pthread_mutex_lock(&d->mu);
    CHECK(d->hello_staging_len >= (1u << 20), "the decode has no staging area to shrink");
    d->hello_staging_len = 2;
    pthread_mutex_unlock(&d->mu);
    kvw_receiver_h rv = NULL;
    CHECK(kvw_receiver_create_from(b, 5, bs, 0, &rv) == KVW_OK, "%s", kvw_last_error());
    if (rv) {
        kvt_rng_t rng = {3};
        kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0,
                             .swa_end = TOKENS, .state_slot = -1};
        kvt_req_pages_t dp;
        CHECK(kvt_req_pages_make(&bad, &rs, &rng, &dp) == 0, "destination pages");
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                                .prefix_len = 0, .pages = dp.side};
        CHECK(kvw_receiver_post(rv, &post) == KVW_OK, "%s", kvw_last_error());
        kvw_room_state_t st = ip_wait_recv(rv, DEADLINE_NS);
        const char *why = kvw_room_failure(kvw_receiver_room(rv));
        CHECK(st == KVW_ROOM_FAILED && why &&
                  kvt_contains(why, "declares a staging area of 2 bytes (accepted: 0, or 1 MiB"),
              "the room of the decode with a 2-byte staging area ended %s: %s",
              kvw_room_state_string(st), why ? why : "(no reason)");
        kvw_room_destroy(kvw_receiver_room(rv));
        kvt_req_pages_free(&dp);
    }
    pthread_mutex_lock(&pc->mu);
    uint64_t refusals = pc->hs.refusals;
    uint32_t live = 0;
    for (uint32_t i = 0; i < pc->peers.num; i++)
        live += !pc->peers.tab[i]->dead;
    pthread_mutex_unlock(&pc->mu);
    CHECK(refusals >= 1 && live == 0, "%llu refusals, %u live peers after the refused "
          "registration", (unsigned long long)refusals, live);
    kvw_ctx_destroy(b);

    /* An honest decode rank. */
    p.rank = dst.h;
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "honest decode: %s", kvw_last_error());
    if (dctx) {
        ip_room_t room = {.id = 6, .tokens = TOKENS, .seed = 9, .deadline_ns = DEADLINE_NS,
                          .what = "honest room"};
        ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
        kvw_ctx_destroy(dctx);
    }
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&bad);
    kvt_rank_free(&dst);
    return ip_summary("test_stage_declared");
}
