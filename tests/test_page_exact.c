/*
 * Page-exact completion on the transports whose receiver mediates writes: tcp, and ucx
 * on its default "am" data path (run when the ucx module loads here). The receiver
 * records where every admitted write landed, so a sender's DONE is never the only
 * evidence of what landed.
 * A sender whose byte count is right but which writes one range twice and leaves another
 * unwritten (the fault wrapper's mislay_put) must fail the room on both sides with a
 * reason that says so, instead of reaching Success with stale bytes in the room's pages.
 * A staged window that was only partly written fails the room before it is scattered.
 * Honest transfers, direct and staged, still succeed with the bytes the test kit's
 * reference computes, and nothing outside the room's pages changes.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"
#include "fault/fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#define TOKENS 120
#define DEADLINE_NS kvt_tmo_ns(30000000000ull) /* generous: a loaded 2-core machine, sanitizers */

static kvt_model_t model;

/* Puts the prefill context's transport behind the fault wrapper before any decode rank
 * registers (as tests/test_fault.c does). */
static int wrap_ctx(kvw_ctx_h h, const char *spec)
{
    struct kvw_ctx *c = h;
    const kvw_tl_ops_t *fops = kvw__tl_fault_wrap(c->tl_ops, "");
    kvw_tl_h ftl;
    if (fops == NULL || kvw__tl_fault_attach(fops, c->tl, spec, &ftl) != KVW_OK)
        return -1;
    pthread_mutex_lock(&c->mu);
    c->tl_ops = fops;
    c->tl = ftl;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

static bool terminal(kvw_room_state_t s)
{
    return s == KVW_ROOM_SUCCESS || s == KVW_ROOM_FAILED;
}

/* One room from a fresh prefill/decode pair over tcp. `path` is KVW_PATH ("direct" or
 * "staged"); `spec` the prefill's faults. With `hostile` the room must fail on both
 * sides naming `needle`; otherwise it must succeed with verified bytes. */
static const char *g_tl = "tcp";

static void run_room(const char *path, const char *spec, bool hostile, const char *needle,
                     kvw_fault_kind_t kind, uint64_t seed)
{
    setenv("KVW_PATH", path, 1);
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 48, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 48, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return;
    kvt_rank_fill(&src, seed);
    kvt_rank_fill(&dst, seed + 1);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, g_tl, "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        goto out;
    CHECK(wrap_ctx(pctx, spec) == 0, "wrap '%s': %s", spec, kvw_last_error());
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (dctx == NULL)
        goto out;
    struct kvw_ctx *dc = dctx;
    CHECK(kvw__tl_caps(dc->tl_ops, dc->tl) & KVW_TL_CAP_MEDIATED,
          "[%s] the decode's transport does not mediate writes", g_tl);

    /* Random (scattered) pages on both sides, so the plan has many runs of equal length. */
    kvt_rng_t rng = {seed};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0,
                         .swa_end = TOKENS, .state_slot = -1};
    kvt_req_pages_t sp, dp;
    CHECK(kvt_req_pages_make(&src, &rs, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(&dst, &rs, &rng, &dp) == 0, "destination pages");
    kvt_copy_t before, expect;
    kvt_copy_make(&dst, &before);
    kvt_copy_make(&dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_create(dctx, 5, 0, &rcv) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_sender_create(pctx, 5, &snd) == KVW_OK, "%s", kvw_last_error());
    /* Two chunks: the second must not be mistaken for a rewrite of the first. */
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                          .chunk_begin = 0, .chunk_end = 50,
                          .pages = sp.side};
    CHECK(kvw_sender_send(snd, &c) == KVW_OK, "%s", kvw_last_error());
    c.chunk_begin = 50;
    c.chunk_end = TOKENS;
    c.last_chunk = 1;
    /* With a hostile sender the room may already have failed on the first chunk. */
    kvw_status_t sst2 = kvw_sender_send(snd, &c);
    CHECK(sst2 == KVW_OK || hostile, "%s", kvw_last_error());
    uint64_t t0 = kvt_now_ns();
    kvw_room_state_t rst, sst;
    while ((!terminal(rst = kvw_room_poll(kvw_receiver_room(rcv))) ||
            !terminal(sst = kvw_room_poll(kvw_sender_room(snd)))) &&
           kvt_now_ns() - t0 < DEADLINE_NS)
        usleep(1000);
    sst = kvw_room_poll(kvw_sender_room(snd));
    char msg[512];
    if (hostile) {
        uint64_t f[KVW_FAULT_NUM_KINDS];
        kvw__tl_fault_stats(f);
        CHECK(f[kind] > 0, "the fault was never injected (%s, %s)", path, spec);
        CHECK(rst == KVW_ROOM_FAILED, "[%s] decode room ended %s with a mislaid put (%s)", g_tl,
              kvw_room_state_string(rst), path);
        const char *why = kvw_room_failure(kvw_receiver_room(rcv));
        CHECK(why && kvt_contains(why, needle), "decode reason '%s' lacks '%s'",
              why ? why : "(none)", needle);
        CHECK(sst == KVW_ROOM_FAILED, "prefill room ended %s", kvw_room_state_string(sst));
        why = kvw_room_failure(kvw_sender_room(snd));
        CHECK(why && why[0], "prefill room failed without a reason");
    } else {
        CHECK(rst == KVW_ROOM_SUCCESS, "[%s] decode room ended %s: %s (%s)", g_tl,
              kvw_room_state_string(rst), kvw_room_failure(kvw_receiver_room(rcv)), path);
        CHECK(sst == KVW_ROOM_SUCCESS, "prefill room ended %s: %s",
              kvw_room_state_string(sst), kvw_room_failure(kvw_sender_room(snd)));
        ip_ref(&model, &src, 1, &sp.side, &dst, &dp.side, expect.data, TOKENS, NULL);
        /* The reference starts from the same bytes, so this also proves nothing outside
         * the room's pages changed. */
        CHECK(kvt_copy_compare(&dst, &expect, "decode", msg, sizeof(msg)) == 0, "%s (%s)", msg,
              path);
    }
    CHECK(kvt_rank_check_guards(&dst, msg, sizeof(msg)) == 0, "%s", msg);
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvt_copy_free(&before);
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
out:
    if (dctx)
        kvw_ctx_destroy(dctx);
    if (pctx)
        kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    unsetenv("KVW_PATH");
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    setenv("KVW_STAGING_MB", "4", 0);
    if (ip_model("test_page_exact", &model))
        return 1;
    static const char *const tls[] = {"tcp", "ucx"};
    for (size_t t = 0; t < 2; t++) {
        g_tl = tls[t];
        if (kvw__tl_find(g_tl) == NULL) {
            printf("test_page_exact: %s not available here (%s): skipped\n", g_tl,
                   kvw_last_error());
            continue;
        }
        printf("test_page_exact: over %s\n", g_tl);
        run_room("direct", "", false, NULL, 0, 11);
        run_room("staged", "", false, NULL, 0, 21);
        kvw__tl_fault_stats_reset();
        run_room("direct", "mislay_put=1", true, "written twice", KVW_FAULT_MISLAY_PUT, 31);
        /* A staged window only partly written is refused before it is scattered (stale
         * staging bytes would otherwise land in the room's pages). */
        kvw__tl_fault_stats_reset();
        run_room("staged", "trunc_put=1", true, "not written exactly once",
                 KVW_FAULT_TRUNC_PUT, 41);
    }

    return ip_summary("test_page_exact");
}
