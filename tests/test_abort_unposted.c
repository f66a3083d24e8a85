/*
 * A decode room that ends before it posted its pages tells the prefill at once: the
 * prefill's sender room, waiting for the decode's request, fails within a bound far
 * under its wait timeout, with a reason saying the decode aborted, instead of timing
 * out. A real two-side room over tcp (one prefill and one decode context in this
 * process). Cases:
 *   A  the sender created and its whole request sent, then the receiver aborted;
 *   B  the receiver aborted before the sender exists: the sender fails on creation or
 *      soon after, never waits;
 *   C  the receiver destroyed without posting;
 *   D  a receiver naming its instance (kvw_receiver_create_from) on a decode context
 *      without one of its own, aborted at once, while the instance may still be being
 *      connected (the abort goes out once it is);
 * and a control: a room whose receiver is left alone is still waiting after the bound.
 */
#include "testkit.h"
#include "inproc.h"

static kvt_model_t model;
static kvt_rank_t src, dst;
static kvt_req_pages_t sp, dp;
static uint64_t bound_ns; /* how soon the sender must fail (wait timeout: 20x more) */

/* Polls the sender's room until it ends or the bound passes; *ns_p the time it took. */
static kvw_room_state_t wait_sender(kvw_sender_h snd, uint64_t *ns_p)
{
    uint64_t t0 = kvt_now_ns();
    kvw_room_state_t st;
    while ((st = kvw_room_poll(kvw_sender_room(snd))) != KVW_ROOM_FAILED &&
           st != KVW_ROOM_SUCCESS && kvt_now_ns() - t0 < bound_ns)
        usleep(1000);
    *ns_p = kvt_now_ns() - t0;
    return st;
}

static kvw_status_t start_send(kvw_ctx_h pctx, uint64_t room, kvw_sender_h *snd)
{
    kvw_status_t st = kvw_sender_create(pctx, room, snd);
    if (st != KVW_OK)
        return st;
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = 100,
                          .chunk_begin = 0, .chunk_end = 100, .last_chunk = 1,
                          .pages = sp.side};
    return kvw_sender_send(*snd, &c);
}

/* The sender of `room` must be Failed within the bound, ABORTED, its reason naming the
 * decode's abort and `why`. */
static void expect_failed(kvw_sender_h snd, const char *what, const char *why)
{
    uint64_t ns = 0;
    kvw_room_state_t st = wait_sender(snd, &ns);
    const char *reason = kvw_room_failure(kvw_sender_room(snd));
    CHECK(st == KVW_ROOM_FAILED, "%s: the sender is %s after %.1f s (bound %.1f s): %s", what,
          kvw_room_state_string(st), ns / 1e9, bound_ns / 1e9, reason ? reason : "");
    if (st != KVW_ROOM_FAILED)
        return;
    kvw_status_t rs = kvw_room_status(kvw_sender_room(snd));
    CHECK(rs == KVW_ERR_ABORTED, "%s: the sender failed with %s, not ABORTED: %s", what,
          kvw_status_string(rs), reason);
    CHECK(reason && kvt_contains(reason, "aborted by") && kvt_contains(reason, why),
          "%s: the sender's reason '%s' does not say it was aborted by the decode (%s)", what,
          reason ? reason : "(null)", why);
    printf("test_abort_unposted: %s: the sender failed after %.3f s: %s\n", what, ns / 1e9,
           reason);
}

static kvw_receiver_h make_receiver(kvw_ctx_h dctx, uint64_t room)
{
    kvw_receiver_h rcv = NULL;
    CHECK(kvw_receiver_create(dctx, room, 0, &rcv) == KVW_OK, "receiver %llu: %s",
          (unsigned long long)room, kvw_last_error());
    return rcv;
}

int main(void)
{
    if (ip_model("test_abort_unposted", &model) != 0)
        return 1;
    /* The wait timeout the sender would otherwise run into, 20 times the bound. */
    uint32_t wait_ms = kvt_tmo_ms(30000);
    bound_ns = (uint64_t)wait_ms * 1000000ull / 20;
    kvw_ctx_h pctx = NULL, dctx = NULL, dctx2 = NULL;
    CHECK(ip_rank(&model, 1, 0, 32, 2, &src) == KVW_OK, "%s", kvw_last_error());
    CHECK(ip_rank(&model, 1, 0, 32, 2, &dst) == KVW_OK, "%s", kvw_last_error());
    kvt_rng_t rng = {17};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = 100, .swa_begin = 0, .swa_end = 100,
                         .state_slot = -1};
    CHECK(kvt_req_pages_make(&src, &rs, &rng, &sp) == 0, "source pages");
    CHECK(kvt_req_pages_make(&dst, &rs, &rng, &dp) == 0, "destination pages");
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.peer_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = wait_ms;
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill context: %s", kvw_last_error());
    if (failures)
        goto out;
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode context: %s", kvw_last_error());
    if (failures)
        goto out;

    /* A: sent, then the receiver aborted before it posted. */
    kvw_receiver_h rcv = make_receiver(dctx, 1);
    kvw_sender_h snd = NULL;
    CHECK(start_send(pctx, 1, &snd) == KVW_OK, "A: send: %s", kvw_last_error());
    usleep(20000); /* the sender is waiting for the decode's request */
    CHECK(kvw_room_poll(kvw_sender_room(snd)) == KVW_ROOM_BOOTSTRAPPING,
          "A: the sender is %s before the abort",
          kvw_room_state_string(kvw_room_poll(kvw_sender_room(snd))));
    kvw_room_abort(kvw_receiver_room(rcv));
    expect_failed(snd, "A: aborted after the send", "aborted by the decode engine");
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));

    /* B: aborted before the sender exists. */
    rcv = make_receiver(dctx, 2);
    kvw_room_abort(kvw_receiver_room(rcv));
    usleep(50000); /* the abort reaches the prefill first */
    snd = NULL;
    kvw_status_t st = start_send(pctx, 2, &snd);
    if (st != KVW_OK) {
        CHECK(st == KVW_ERR_ABORTED && kvt_contains(kvw_last_error(), "decode engine"),
              "B: the sender refused with %s: %s", kvw_status_string(st), kvw_last_error());
        printf("test_abort_unposted: B: the sender was refused: %s\n", kvw_last_error());
    }
    if (snd && st == KVW_OK)
        expect_failed(snd, "B: aborted before the sender existed", "decode engine");
    if (snd)
        kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));

    /* C: the receiver destroyed without posting. */
    rcv = make_receiver(dctx, 3);
    CHECK(start_send(pctx, 3, &snd) == KVW_OK, "C: send: %s", kvw_last_error());
    kvw_room_destroy(kvw_receiver_room(rcv));
    expect_failed(snd, "C: receiver destroyed unposted", "destroyed before it finished");
    kvw_room_destroy(kvw_sender_room(snd));

    /* D: a room naming its instance on a decode context without one, aborted at once. */
    p.bootstrap_addr = NULL;
    p.field_mask &= ~(uint64_t)KVW_CTX_FIELD_BOOTSTRAP;
    kvt_rank_t dst2;
    CHECK(ip_rank(&model, 1, 0, 32, 2, &dst2) == KVW_OK, "%s", kvw_last_error());
    p.rank = dst2.h;
    p.field_mask |= KVW_CTX_FIELD_INSTANCE; /* a decode instance of its own */
    p.instance_id = 0x5eed2;
    CHECK(kvw_ctx_create(&p, &dctx2) == KVW_OK, "second decode context: %s", kvw_last_error());
    if (dctx2) {
        CHECK(start_send(pctx, 4, &snd) == KVW_OK, "D: send: %s", kvw_last_error());
        rcv = NULL;
        CHECK(kvw_receiver_create_from(dctx2, 4, bs, 0, &rcv) == KVW_OK, "D: receiver: %s",
              kvw_last_error());
        if (rcv)
            kvw_room_abort(kvw_receiver_room(rcv));
        expect_failed(snd, "D: aborted while its instance was being connected",
                      "aborted by the decode engine");
        CHECK(rcv && kvw_room_poll(kvw_receiver_room(rcv)) == KVW_ROOM_FAILED,
              "D: the receiver is %s",
              rcv ? kvw_room_state_string(kvw_room_poll(kvw_receiver_room(rcv))) : "missing");
        kvw_room_destroy(kvw_sender_room(snd));
        kvw_room_destroy(kvw_receiver_room(rcv));
    }

    /* Control: a receiver left alone; its sender keeps waiting (no spurious failure). */
    rcv = make_receiver(dctx, 5);
    CHECK(start_send(pctx, 5, &snd) == KVW_OK, "control: send: %s", kvw_last_error());
    uint64_t ns = 0;
    kvw_room_state_t cs = wait_sender(snd, &ns);
    CHECK(cs == KVW_ROOM_BOOTSTRAPPING, "control: the sender is %s after %.1f s: %s",
          kvw_room_state_string(cs), ns / 1e9, kvw_room_failure(kvw_sender_room(snd)));
    /* ... and once posted, the room completes. */
    kvt_copy_t expect;
    kvt_copy_make(&dst, &expect);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 100,
                            .prefix_len = 0, .pages = dp.side};
    CHECK(kvw_receiver_post(rcv, &post) == KVW_OK, "control: post: %s", kvw_last_error());
    kvw_room_state_t rsd = ip_wait_recv(rcv, kvt_tmo_ns(30ull * 1000000000ull));
    CHECK(rsd == KVW_ROOM_SUCCESS, "control: the receiver ended %s: %s",
          kvw_room_state_string(rsd), kvw_room_failure(kvw_receiver_room(rcv)));
    ip_ref(&model, &src, 1, &sp.side, &dst, &dp.side, expect.data, 100, NULL);
    ip_verify(&dst, &expect, "control: ");
    kvt_copy_free(&expect);
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvw_ctx_destroy(dctx2);
    kvt_rank_free(&dst2);
out:
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_abort_unposted");
}
