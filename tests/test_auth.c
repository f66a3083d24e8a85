/*
 * Shared-secret authentication at the handshake: a decode rank with the wrong secret
 * refuses the bootstrap entries (their MACs do not match its secret), one with none is
 * refused by the prefill with a clear message; a prefill rank without the secret leaves
 * entries the decode refuses, and, given an entry signed by someone else, cannot prove
 * the secret at the handshake; matching secrets move verified bytes.
 */
#include "testkit.h"
#include "inproc.h"

#include "proto/proto.h"

#include <stdlib.h>

static kvt_model_t model;

static kvw_status_t make_ctx(kvw_side_t side, kvt_rank_t *r, const char *bs, const char *secret,
                             kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = ip_params(side, r, "tcp", bs, side == KVW_SIDE_PREFILL);
    p.field_mask |= KVW_CTX_FIELD_SECRET;
    p.secret = secret;
    p.bootstrap_timeout_ms = kvt_tmo_ms(3000);
    p.wait_timeout_ms = kvt_tmo_ms(5000);
    return kvw_ctx_create(&p, ctx);
}

int main(void)
{
    kvt_model_preset("gpt-oss-120b", &model);
    kvt_model_truncate(&model, 2);
    /* Only decode rank 0 of TP2 registers here, so the prefill instance is TP1 and the
     * decode side is described as TP2 rank 0. */
    kvt_rank_t src = {0}, dst = {0}, src2 = {0};
    CHECK(ip_rank(&model, 1, 0, 32, 2, &src) == KVW_OK, "%s", kvw_last_error());
    CHECK(ip_rank(&model, 2, 0, 32, 2, &dst) == KVW_OK, "%s", kvw_last_error());
    CHECK(ip_rank(&model, 1, 0, 32, 2, &src2) == KVW_OK, "%s", kvw_last_error());
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
    /* A wrong secret: the entry's MAC does not match it, so the decode never connects. */
    kvw_status_t st = make_ctx(KVW_SIDE_DECODE, &dst, bs, "beta", &dctx);
    CHECK(st == KVW_ERR_AUTH, "wrong secret: got %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "dp0/tp0/pp0") &&
              kvt_contains(kvw_last_error(), "does not match the shared secret"),
          "message: %s", kvw_last_error());
    CHECK(kvw_ctx_refusals(pctx, why, sizeof(why)) == 0, "the prefill saw a handshake: %s", why);

    st = make_ctx(KVW_SIDE_DECODE, &dst, bs, NULL, &dctx);
    CHECK(st == KVW_ERR_AUTH, "no secret: got %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "requires a shared secret"), "message: %s",
          kvw_last_error());
    /* The prefill side can tell too (the refusal is counted before the answer is sent). */
    CHECK(kvw_ctx_refusals(pctx, why, sizeof(why)) == 1 &&
              kvt_contains(why, "requires a shared secret"),
          "prefill's view of the refusal: %s", why);

    st = make_ctx(KVW_SIDE_DECODE, &dst, bs, "alpha", &dctx);
    CHECK(st == KVW_OK, "right secret: %s: %s", kvw_status_string(st), kvw_last_error());
    if (st == KVW_OK) {
        /* One verified room from prefill TP1 to decode TP2 rank 0. */
        ip_room_t room = {.id = 77, .tokens = 40, .seed = 7,
                          .deadline_ns = kvt_tmo_ns(10000000000ull),
                          .what = "room"};
        ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
        kvw_ctx_destroy(dctx);
    }
    kvw_ctx_destroy(pctx);

    /* A prefill rank without the secret registers without a MAC: the decode refuses the
     * entry. Signed by someone who has the secret, the entry leads the decode to the
     * handshake, where the prefill rank cannot prove the secret. */
    CHECK(make_ctx(KVW_SIDE_PREFILL, &src2, "127.0.0.1:0", NULL, &pctx) == KVW_OK, "%s",
          kvw_last_error());
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    st = make_ctx(KVW_SIDE_DECODE, &dst, bs, "alpha", &dctx);
    CHECK(st == KVW_ERR_AUTH, "unsigned entry: got %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "dp0/tp0/pp0") &&
              kvt_contains(kvw_last_error(), "carries no MAC"),
          "message: %s", kvw_last_error());
    kvw_bs_entry_t *e = NULL;
    uint32_t n = 0;
    st = kvw__bootstrap_lookup(bs, 1, 1, 1, NULL, kvt_now_ns() + 5000000000ull, &e, &n);
    CHECK(st == KVW_OK && n == 1, "lookup: %s", kvw_last_error());
    if (st == KVW_OK) {
        st = kvw__bootstrap_register(bs, &e[0], "alpha", kvt_now_ns() + 5000000000ull);
        CHECK(st == KVW_OK, "signed registration: %s", kvw_last_error());
        free(e);
    }
    st = make_ctx(KVW_SIDE_DECODE, &dst, bs, "alpha", &dctx);
    CHECK(st == KVW_ERR_AUTH, "unproven prefill: got %s", kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "did not prove"), "message: %s", kvw_last_error());
    kvw_ctx_destroy(pctx);

    kvt_rank_free(&src);
    kvt_rank_free(&src2);
    kvt_rank_free(&dst);
    return ip_summary("test_auth");
}
