/*
 * Room ownership without a shared secret (one prefill rank, two decode instances):
 *  - a room posted by two decode instances fails for both, with a reason that names the
 *    owner and the second claimant; the prefill side fails it too;
 *  - an abort of decode A's room sent by decode B is refused: A's room still succeeds
 *    with the reference bytes, and B is told the room is not its own;
 *  - a registration that reuses A's live identity (instance and rank) is refused with
 *    BUSY and a reason, A keeps working, and once A is gone the identity registers again
 *    (the new registration retries while A's departure is being noticed).
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#define TOKENS 48
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;
static kvw_ctx_h g_b; /* decode instance 2 */
static kvt_req_pages_t *g_bpages; /* pages for B's own room */
static kvw_receiver_h g_bsync;    /* B's own room (destroyed at the end) */

static kvw_ctx_h g_p; /* the prefill rank */

/* Whether the prefill rank holds room `id` with a decode owner (mu taken). */
static bool prefill_has_room(uint64_t id)
{
    struct kvw_ctx *p = g_p;
    pthread_mutex_lock(&p->mu);
    kvw_room_t *r = kvw__room_find(p, id);
    bool has = r && r->dst_dp >= 0;
    pthread_mutex_unlock(&p->mu);
    return has;
}

static void wait_prefill_room(uint64_t id)
{
    uint64_t t0 = kvt_now_ns();
    while (!prefill_has_room(id) && kvt_now_ns() - t0 < DEADLINE_NS)
        usleep(1000);
    CHECK(prefill_has_room(id), "the prefill rank never saw room %llu", (unsigned long long)id);
}

/* Decode B sends an ABORT for a room of decode A, on its own control channel (the
 * frame any decode rank can send), then posts a room of its own. The prefill rank
 * handles one connection's frames in order, so once B's room exists there, the abort
 * has been handled. */
static void foreign_abort(uint64_t id)
{
    wait_prefill_room(id); /* A's request came first: the room has its owner */
    struct kvw_ctx *b = g_b;
    pthread_mutex_lock(&b->mu);
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_ABORT);
    kvw__wb_u64(&w, id);
    kvw__wb_u32(&w, (uint32_t)(int32_t)KVW_ERR_ABORTED);
    kvw__wb_str(&w, "not mine");
    kvw__peer_send(b, b->peers[0], &w);
    pthread_mutex_unlock(&b->mu);
    kvw_receiver_h h = NULL;
    CHECK(kvw_receiver_create(g_b, id + 1000, 0, &h) == KVW_OK, "%s", kvw_last_error());
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .prefix_len = 0, .pages = g_bpages->side};
    CHECK(kvw_receiver_post(h, &post) == KVW_OK, "%s", kvw_last_error());
    wait_prefill_room(id + 1000);
    g_bsync = h;
}

/* One room of decode A, verified against the reference; `inject` runs once the room
 * is posted. */
static void one_room(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx, kvt_rank_t *dst,
                     uint64_t id, void (*inject)(uint64_t id))
{
    ip_room_t room = {.id = id, .tokens = TOKENS, .seed = 9, .deadline_ns = DEADLINE_NS,
                      .what = "room", .posted = inject};
    ip_room_verified(&model, pctx, src, dctx, dst, &room);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_room_ownership", &model))
        return 1;
    kvt_rank_t src = {0}, da = {0}, db = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &da) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &db) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&da, 2);
    kvt_rank_fill(&db, 3);
    kvw_ctx_h pctx = NULL, a = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    g_p = pctx;
    char bs[128];
    ip_params_decode(&p, pctx, &da, bs, sizeof(bs));
    p.field_mask |= KVW_CTX_FIELD_INSTANCE;
    p.instance_id = 1;
    CHECK(kvw_ctx_create(&p, &a) == KVW_OK, "decode A: %s", kvw_last_error());
    p.rank = db.h;
    p.instance_id = 2;
    CHECK(kvw_ctx_create(&p, &g_b) == KVW_OK, "decode B: %s", kvw_last_error());
    if (a == NULL || g_b == NULL)
        return 1;

    /* 1. Two claimants of one room. */
    kvt_rng_t rng = {4};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0,
                         .swa_end = TOKENS, .state_slot = -1};
    kvt_req_pages_t pa, pb;
    CHECK(kvt_req_pages_make(&da, &rs, &rng, &pa) == 0, "pages");
    CHECK(kvt_req_pages_make(&db, &rs, &rng, &pb) == 0, "pages");
    kvw_receiver_h ra = NULL, rb = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .prefix_len = 0, .pages = pa.side};
    CHECK(kvw_receiver_create(a, 5, 0, &ra) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(ra, &post) == KVW_OK, "%s", kvw_last_error());
    wait_prefill_room(5); /* A's request is the first the prefill rank sees */
    post.pages = pb.side;
    CHECK(kvw_receiver_create(g_b, 5, 0, &rb) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_receiver_post(rb, &post) == KVW_OK, "%s", kvw_last_error());
    kvw_room_state_t sa = ip_wait_recv(ra, DEADLINE_NS), sb = ip_wait_recv(rb, DEADLINE_NS);
    const char *want = "posted for DP group 0, but the room belongs to instance 1 group 0";
    CHECK(sa == KVW_ROOM_FAILED && kvt_contains(kvw_room_failure(kvw_receiver_room(ra)), want),
          "owner: %s: %s", kvw_room_state_string(sa), kvw_room_failure(kvw_receiver_room(ra)));
    CHECK(sb == KVW_ROOM_FAILED && kvt_contains(kvw_room_failure(kvw_receiver_room(rb)), want) &&
              kvt_contains(kvw_room_failure(kvw_receiver_room(rb)), "decode instance 2"),
          "second claimant: %s: %s", kvw_room_state_string(sb),
          kvw_room_failure(kvw_receiver_room(rb)));
    kvw_sender_h s5 = NULL;
    CHECK(kvw_sender_create(pctx, 5, &s5) == KVW_OK, "%s", kvw_last_error());
    CHECK(kvw_room_poll(kvw_sender_room(s5)) == KVW_ROOM_FAILED &&
          kvt_contains(kvw_room_failure(kvw_sender_room(s5)), want),
          "prefill: %s: %s", kvw_room_state_string(kvw_room_poll(kvw_sender_room(s5))),
          kvw_room_failure(kvw_sender_room(s5)));
    kvw_room_destroy(kvw_sender_room(s5));
    kvw_room_destroy(kvw_receiver_room(ra));
    kvw_room_destroy(kvw_receiver_room(rb));
    kvt_req_pages_free(&pa);
    kvt_req_pages_free(&pb);

    /* 2. B aborts A's room: refused; A's room succeeds with verified bytes. */
    kvt_req_pages_t bp;
    CHECK(kvt_req_pages_make(&db, &rs, &rng, &bp) == 0, "pages");
    g_bpages = &bp;
    one_room(pctx, &src, a, &da, 6, foreign_abort);
    kvw_room_destroy(kvw_receiver_room(g_bsync));
    kvt_req_pages_free(&bp);

    /* 3. A's identity, reused while A lives. */
    kvt_rank_t dc = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &dc) == KVW_OK, "%s", kvw_last_error());
    kvt_rank_fill(&dc, 5);
    kvw_ctx_h c = NULL;
    p.rank = dc.h;
    p.instance_id = 1;
    p.bootstrap_timeout_ms = kvt_tmo_ms(1500); /* BUSY is retried until then */
    kvw_status_t st = kvw_ctx_create(&p, &c);
    CHECK(st == KVW_ERR_BUSY, "a second registration of a live identity: %s",
          kvw_status_string(st));
    CHECK(kvt_contains(kvw_last_error(), "decode instance 1 rank dp0/tp0/pp0 is already "
                                         "registered here and alive"),
          "message: %s", kvw_last_error());
    if (c)
        kvw_ctx_destroy(c);
    c = NULL;
    one_room(pctx, &src, a, &da, 8, NULL);
    kvw_ctx_destroy(a);
    a = NULL;
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    st = kvw_ctx_create(&p, &c);
    CHECK(st == KVW_OK, "the identity once its holder left: %s: %s", kvw_status_string(st),
          kvw_last_error());
    if (c) {
        one_room(pctx, &src, c, &dc, 9, NULL);
        kvw_ctx_destroy(c);
    }
    kvt_rank_free(&dc);

    kvw_ctx_destroy(g_b);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&da);
    kvt_rank_free(&db);
    return ip_summary("test_room_ownership");
}
