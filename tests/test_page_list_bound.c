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
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#define TOKENS 64
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_page_list_bound", &model))
        return 1;
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 16, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 16, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src, 3);
    kvt_rank_fill(&dst, 4);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
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
    kvw__peer_send(d, d->peers.tab[0], &w);
    pthread_mutex_unlock(&d->mu);
    kvw_room_state_t st = ip_wait_recv(bad, DEADLINE_NS);
    CHECK(st == KVW_ROOM_FAILED, "the oversized request's room ended %s",
          kvw_room_state_string(st));
    const char *why = kvw_room_failure(kvw_receiver_room(bad));
    CHECK(why && kvt_contains(why, "17 pages is longer than the pool (16 pages)"),
          "reason: %s", why ? why : "(none)");
    struct kvw_ctx *pc = pctx;
    pthread_mutex_lock(&pc->mu);
    bool kept = kvw__room_find(pc, 21) != NULL;
    pthread_mutex_unlock(&pc->mu);
    CHECK(!kept, "the prefill rank kept a room for the refused request");
    kvw_room_destroy(kvw_receiver_room(bad));

    /* The same peer's next room goes through. */
    ip_room_t room = {.id = 22, .tokens = TOKENS, .seed = 5, .deadline_ns = DEADLINE_NS,
                      .what = "honest room"};
    ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_page_list_bound");
}
