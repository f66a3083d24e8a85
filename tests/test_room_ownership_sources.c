/*
 * Rooms belong to their sources (xPyD over tcp, one process): decode instance 1 (TP1,
 * no bootstrap of its own) reads room 41 from prefill instance A and room 40 from
 * prefill instance B. B is hostile: through its own session with the decode rank (a
 * modified kvwire peer: frames queued on its authenticated control channel, a DONE
 * tagged with its own session key on its own bound data connection) it sends, for A's
 * room 41, a FAILED, a META, a DONE for the whole room and finally a STAGE_ASK. None of
 * them may touch room 41: it keeps waiting, and A's sender then completes it with every
 * byte checked against the reference. The STAGE_ASK costs B its connection and leaves
 * the staging area empty.
 * With the secret, a second decode instance (2) that holds it too posts the same room
 * id at A after instance 1 did: it is refused alone (its room fails naming the owner)
 * and instance 1's room still succeeds.
 * A third decode instance (3) sends A an ABORT for room 43 before anyone requested it:
 * instance 1 then requests room 43 and it succeeds with every byte checked.
 * Runs without a secret and with one.
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

#define TOKENS 40
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

/* The live peer of a context (the one decode rank a prefill rank serves here). */
static kvw_peer_t *live_peer(struct kvw_ctx *c)
{
    kvw_peer_t *found = NULL;
    for (uint32_t i = 0; i < kvw__peer_count(c); i++)
        if (!kvw__peer_at(c, i)->dead && !kvw__peer_at(c, i)->registering)
            found = kvw__peer_at(c, i);
    return found;
}

static bool wait_peer(struct kvw_ctx *c)
{
    for (uint64_t t0 = kvt_now_ns(); kvt_now_ns() - t0 < DEADLINE_NS; usleep(2000)) {
        pthread_mutex_lock(&c->mu);
        bool ok = live_peer(c) != NULL;
        pthread_mutex_unlock(&c->mu);
        if (ok)
            return true;
    }
    return false;
}

/* Whether prefill context `c` holds room `id` posted by some decode rank. */
static bool wait_claimed(struct kvw_ctx *c, uint64_t id)
{
    for (uint64_t t0 = kvt_now_ns(); kvt_now_ns() - t0 < DEADLINE_NS; usleep(2000)) {
        pthread_mutex_lock(&c->mu);
        kvw_room_t *r = kvw__room_find(c, id);
        bool ok = r && r->dst_dp >= 0 && r->num_dsts > 0;
        pthread_mutex_unlock(&c->mu);
        if (ok)
            return true;
    }
    return false;
}

static void pages_make(kvt_rank_t *src, kvt_rank_t *dst, uint64_t seed, kvt_req_pages_t *sp,
                       kvt_req_pages_t *dp)
{
    kvt_rng_t rng = {seed};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0, .swa_end = TOKENS,
                         .state_slot = -1};
    CHECK(kvt_req_pages_make(src, &rs, &rng, sp) == 0 && kvt_req_pages_make(dst, &rs, &rng, dp) == 0,
          "pages");
}

/* B's frames for room `id`, on its own session with the decode rank. */
static void hostile_frames(struct kvw_ctx *b, uint64_t id, uint64_t expected_bytes, bool stage)
{
    pthread_mutex_lock(&b->mu);
    kvw_peer_t *p = live_peer(b);
    CHECK(p != NULL, "instance B has no decode peer");
    if (p && !stage) {
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_FAILED);
        kvw__wb_u64(&w, id);
        kvw__wb_u32(&w, (uint32_t)KVW_ERR_REMOTE_FAILED);
        kvw__wb_str(&w, "instance B fails a room it does not write");
        kvw__peer_send(b, p, &w);
        kvw__wb_init(&w, KVW_MSG_META);
        kvw__wb_u64(&w, id);
        kvw__wb_bytes(&w, "junk metadata", 13);
        kvw__peer_send(b, p, &w);
    } else if (p) {
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
        kvw__wb_u64(&w, id);
        kvw__wb_u64(&w, 4096);
        kvw__peer_send(b, p, &w);
    }
    kvw_tl_ep_h ep = p ? p->ep : NULL;
    uint32_t as = p ? p->id_at_remote : 0;
    const uint8_t *key = p && p->authed ? p->skey : NULL;
    uint8_t k[32];
    if (key)
        memcpy(k, key, sizeof(k));
    pthread_mutex_unlock(&b->mu);
    if (ep && !stage) {
        /* A completion for the whole room, on B's own bound data connection. */
        kvw_done_msg_t dm = {.room = id, .peer = as, .chunk_begin = 0, .chunk_end = TOKENS,
                             .bytes = expected_bytes, .last_chunk = true, .final = true};
        kvw_wbuf_t w;
        kvw__done_encode(&w, &dm, key ? k : NULL);
        CHECK(kvw__wb_finish(&w) == KVW_OK && b->tl_ops->notify(ep, w.p, w.len) == KVW_OK,
              "B's completion: %s", kvw_last_error());
        kvw__wb_free(&w);
    }
}

static void run(const char *secret)
{
    const char *mode = secret[0] ? "secret" : "no secret";
    kvt_rank_t ra = {0}, rb = {0}, rd = {0}, re = {0};
    CHECK(ip_rank(&model, 1, 0, 16, 1, &ra) == KVW_OK && ip_rank(&model, 1, 0, 16, 1, &rb) == KVW_OK &&
              ip_rank(&model, 1, 0, 16, 1, &rd) == KVW_OK && ip_rank(&model, 1, 0, 16, 1, &re) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&ra, 1);
    kvt_rank_fill(&rb, 2);
    kvt_rank_fill(&rd, 3);
    kvt_rank_fill(&re, 4);
    kvw_ctx_h a = NULL, b = NULL, d = NULL, e = NULL;
    CHECK(ip_ctx_instance(&ra, true, "tcp", secret, 0, &a) == KVW_OK &&
              ip_ctx_instance(&rb, true, "tcp", secret, 0, &b) == KVW_OK &&
              ip_ctx_instance(&rd, false, "tcp", secret, 1, &d) == KVW_OK,
          "[%s] contexts: %s", mode, kvw_last_error());
    if (!a || !b || !d)
        return;
    char bsa[128], bsb[128];
    snprintf(bsa, sizeof(bsa), "%s", kvw_ctx_bootstrap_addr(a));
    snprintf(bsb, sizeof(bsb), "%s", kvw_ctx_bootstrap_addr(b));

    kvt_req_pages_t sp, dp, bsp, bdp;
    pages_make(&ra, &rd, 41, &sp, &dp);
    /* B's room uses other pages of the decode rank: page lists of 3 of 16, distinct
     * from the victim's by another seed are not guaranteed, so B's post names none. */
    (void)bsp, (void)bdp;
    kvt_copy_t expect;
    kvt_copy_make(&rd, &expect);
    kvw_receiver_h victim = NULL, broom = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .pages = dp.side};
    CHECK(kvw_receiver_create_from(d, 41, bsa, 0, &victim) == KVW_OK &&
              kvw_receiver_post(victim, &post) == KVW_OK,
          "[%s] victim: %s", mode, kvw_last_error());
    /* B gets a room of its own (so that it is connected): room 40, nothing to write. */
    CHECK(kvw_receiver_create_from(d, 40, bsb, 0, &broom) == KVW_OK, "[%s] room 40: %s", mode,
          kvw_last_error());
    kvw_recv_post_t bpost = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 1,
                             .pages = dp.side};
    bpost.pages.full.num_pages = 1;
    bpost.pages.swa.num_pages = 1;
    CHECK(kvw_receiver_post(broom, &bpost) == KVW_OK, "[%s] post 40: %s", mode, kvw_last_error());
    CHECK(wait_peer(b) && wait_claimed(a, 41), "[%s] instances not connected", mode);

    uint64_t expected = 0;
    struct kvw_ctx *dc = d;
    pthread_mutex_lock(&dc->mu);
    kvw_room_t *vr = kvw__room_find(dc, 41);
    expected = vr && vr->num_srcs ? vr->srcs[0].expected : 0;
    pthread_mutex_unlock(&dc->mu);
    CHECK(expected > 0, "[%s] the victim expects no bytes", mode);

    hostile_frames(b, 41, expected, false);
    usleep(kvt_tmo_ms(300) * 1000);
    kvw_room_state_t s = kvw_room_poll(kvw_receiver_room(victim));
    CHECK(s == KVW_ROOM_WAITING_FOR_INPUT, "[%s] after B's FAILED, META and DONE the victim is "
          "%s: %s", mode, kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(victim)));
    hostile_frames(b, 41, expected, true);
    usleep(kvt_tmo_ms(300) * 1000);
    s = kvw_room_poll(kvw_receiver_room(victim));
    CHECK(s == KVW_ROOM_WAITING_FOR_INPUT, "[%s] after B's STAGE_ASK the victim is %s: %s", mode,
          kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(victim)));
    pthread_mutex_lock(&dc->mu);
    uint32_t spans = dc->stage.num_spans, waits = dc->stage.num_waits;
    pthread_mutex_unlock(&dc->mu);
    CHECK(spans == 0 && waits == 0, "[%s] B's STAGE_ASK left %u spans and %u waiters", mode,
          spans, waits);

    /* Instance 3 aborts room 43 at A before its owner requested it. */
    kvw_ctx_h x = NULL;
    kvw_receiver_h xrv = NULL;
    kvt_rank_t rx = {0};
    CHECK(ip_rank(&model, 1, 0, 16, 1, &rx) == KVW_OK &&
              ip_ctx_instance(&rx, false, "tcp", secret, 3, &x) == KVW_OK &&
              kvw_receiver_create_from(x, 44, bsa, 0, &xrv) == KVW_OK &&
              kvw_receiver_post(xrv, &bpost) == KVW_OK,
          "[%s] instance 3: %s", mode, kvw_last_error());
    if (x && wait_peer(x)) {
        struct kvw_ctx *xc = x;
        pthread_mutex_lock(&xc->mu);
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_ABORT);
        kvw__wb_u64(&w, 43);
        kvw__wb_u32(&w, (uint32_t)KVW_ERR_ABORTED);
        kvw__wb_str(&w, "instance 3 aborts a room it does not own");
        kvw__peer_send(xc, live_peer(xc), &w);
        pthread_mutex_unlock(&xc->mu);
    }
    usleep(kvt_tmo_ms(300) * 1000);

    kvw_receiver_h erv = NULL;
    if (secret[0]) {
        /* A second decode instance holding the secret claims room 41 at A. */
        CHECK(ip_ctx_instance(&re, false, "tcp", secret, 2, &e) == KVW_OK, "[%s] instance 2: %s", mode,
              kvw_last_error());
        kvt_req_pages_t esp, edp;
        pages_make(&ra, &re, 42, &esp, &edp);
        kvw_recv_post_t epost = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                                 .pages = edp.side};
        CHECK(e && kvw_receiver_create_from(e, 41, bsa, 0, &erv) == KVW_OK &&
                  kvw_receiver_post(erv, &epost) == KVW_OK,
              "[%s] instance 2's post: %s", mode, kvw_last_error());
        s = erv ? ip_wait_recv(erv, DEADLINE_NS) : KVW_ROOM_FAILED;
        CHECK(s == KVW_ROOM_FAILED && erv &&
                  kvt_contains(kvw_room_failure(kvw_receiver_room(erv)),
                               "belongs to decode instance 1"),
              "[%s] instance 2's claim on room 41: %s: %s", mode, kvw_room_state_string(s),
              erv ? kvw_room_failure(kvw_receiver_room(erv)) : "");
        kvt_req_pages_free(&esp);
        kvt_req_pages_free(&edp);
        s = kvw_room_poll(kvw_receiver_room(victim));
        CHECK(s == KVW_ROOM_WAITING_FOR_INPUT, "[%s] after instance 2's claim the victim is %s: "
              "%s", mode, kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(victim)));
    }

    /* A's real sender. */
    kvw_sender_h snd = NULL;
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                          .chunk_end = TOKENS, .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_create(a, 41, &snd) == KVW_OK && kvw_sender_send(snd, &c) == KVW_OK,
          "[%s] %s", mode, kvw_last_error());
    s = ip_wait_recv(victim, DEADLINE_NS);
    CHECK(s == KVW_ROOM_SUCCESS, "[%s] the victim: %s: %s", mode, kvw_room_state_string(s),
          kvw_room_failure(kvw_receiver_room(victim)));
    ip_ref(&model, &ra, 1, &sp.side, &rd, &dp.side, expect.data, TOKENS, NULL);
    char pre[64];
    snprintf(pre, sizeof(pre), "[%s] victim: ", mode);
    ip_verify(&rd, &expect, pre);

    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(victim));

    /* Room 43, which instance 3 aborted before anyone requested it. An engine drops
     * requests it never posted (the decode aborts before its REQ), and the prefill must
     * let go of them at once, so an abort before any request claims the room for its
     * instance, as a first REQ would, and fails it: the prefill's sender is Failed
     * (ABORTED) at once, not at its wait timeout, and a decode that posts the room later
     * is a second claimant whose room fails with a reason (it does not hang). */
    kvw_sender_h s43 = NULL;
    CHECK(kvw_sender_create(a, 43, &s43) == KVW_OK, "[%s] room 43: %s", mode, kvw_last_error());
    s = s43 ? kvw_room_poll(kvw_sender_room(s43)) : KVW_ROOM_SUCCESS;
    CHECK(s == KVW_ROOM_FAILED && kvw_room_status(kvw_sender_room(s43)) == KVW_ERR_ABORTED,
          "[%s] room 43's sender after an early abort: %s (%s)", mode, kvw_room_state_string(s),
          s43 ? kvw_room_failure(kvw_sender_room(s43)) : "");
    kvw_receiver_h r43 = NULL;
    CHECK(kvw_receiver_create_from(d, 43, bsa, 0, &r43) == KVW_OK &&
              kvw_receiver_post(r43, &post) == KVW_OK,
          "[%s] room 43: %s", mode, kvw_last_error());
    s = r43 ? ip_wait_recv(r43, DEADLINE_NS) : KVW_ROOM_SUCCESS;
    CHECK(s == KVW_ROOM_FAILED && r43 && kvw_room_failure(kvw_receiver_room(r43))[0],
          "[%s] room 43 posted after its early abort: %s", mode, kvw_room_state_string(s));
    if (s43)
        kvw_room_destroy(kvw_sender_room(s43));
    if (r43)
        kvw_room_destroy(kvw_receiver_room(r43));
    kvw_room_destroy(kvw_receiver_room(xrv));
    kvw_ctx_destroy(x);
    kvt_rank_free(&rx);
    kvw_room_destroy(kvw_receiver_room(broom));
    if (erv)
        kvw_room_destroy(kvw_receiver_room(erv));
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
    kvw_ctx_destroy(e);
    kvw_ctx_destroy(d);
    kvw_ctx_destroy(b);
    kvw_ctx_destroy(a);
    kvt_rank_free(&ra);
    kvt_rank_free(&rb);
    kvt_rank_free(&rd);
    kvt_rank_free(&re);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_room_ownership_sources", &model))
        return 1;
    run("");
    run("alpha");
    return ip_summary("test_room_ownership_sources");
}
