/*
 * Room ownership without a shared secret (one prefill rank, decode instance 1): a
 * registration that reuses instance 1's live identity (instance and rank) is refused
 * with BUSY and a reason, instance 1 keeps working, and once it is gone the identity
 * registers again (the new registration retries while the departure is being noticed).
 * (Two instances claiming one room and an abort from an instance that does not own the
 * room are rows of test_proto_fail's failure table.)
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#define TOKENS 48
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

/* One room of a decode instance, verified against the reference. */
static void one_room(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx, kvt_rank_t *dst,
                     uint64_t id)
{
    ip_room_t room = {.id = id, .tokens = TOKENS, .seed = 9, .deadline_ns = DEADLINE_NS,
                      .what = "room"};
    ip_room_verified(&model, pctx, src, dctx, dst, &room);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_room_ownership", &model))
        return 1;
    kvt_rank_t src = {0}, da = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &da) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&da, 2);
    kvw_ctx_h pctx = NULL, a = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    ip_params_decode(&p, pctx, &da, bs, sizeof(bs));
    p.field_mask |= KVW_CTX_FIELD_INSTANCE;
    p.instance_id = 1;
    CHECK(kvw_ctx_create(&p, &a) == KVW_OK, "decode A: %s", kvw_last_error());
    if (a == NULL)
        return 1;

    /* Instance 1's identity, reused while it lives. */
    kvt_rank_t dc = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &dc) == KVW_OK, "%s", kvw_last_error());
    kvt_rank_fill(&dc, 5);
    kvw_ctx_h c = NULL;
    p.rank = dc.h;
    p.instance_id = 1;
    p.bootstrap_timeout_ms = kvt_tmo_ms(1500); /* BUSY is retried until then */
    kvw_status_t st = kvw_ctx_create(&p, &c);
    char msg[900];
    CHECK(kvt_expect_failure("a second registration of a live identity", st, KVW_ERR_BUSY,
                             kvw_last_error(), "decode instance 1 rank dp0/tp0/pp0 is already "
                             "registered here and alive", msg, sizeof(msg)) == 0,
          "%s", msg);
    if (c)
        kvw_ctx_destroy(c);
    c = NULL;
    one_room(pctx, &src, a, &da, 8);
    kvw_ctx_destroy(a);
    a = NULL;
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    st = kvw_ctx_create(&p, &c);
    CHECK(st == KVW_OK, "the identity once its holder left: %s: %s", kvw_status_string(st),
          kvw_last_error());
    if (c) {
        one_room(pctx, &src, c, &dc, 9);
        kvw_ctx_destroy(c);
    }
    kvt_rank_free(&dc);

    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&da);
    return ip_summary("test_room_ownership");
}
