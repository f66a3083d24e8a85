/*
 * One decode context serving several prefill instances (kvw_receiver_create_from).
 *
 * In one process, over tcp and shm: a decode rank (TP1) created without a bootstrap
 * address reads rooms from prefill instance A (TP1) and instance B (TP2) at once. B goes
 * away while some of its rooms are open: those fail naming B, A's rooms still succeed.
 * B registers with a standalone bootstrap endpoint (kvw_bootstrap_start) and comes back
 * there: the next room connects again and succeeds. Rooms naming an address that cannot be reached fail at once with the
 * reason. Every destination byte (and the guard bytes) is checked against the test
 * kit's reference after each phase; failed rooms must leave their pages untouched.
 */
#include "testkit.h"
#include "inproc.h"


#define TOKENS 40
#define PAGES_PER_ROOM 3 /* 40 tokens in pages of 16 */

static kvt_model_t model;
static const char *g_tl;

typedef struct inst {
    uint32_t tp;
    kvt_rank_t r[2];
    kvw_ctx_h ctx[2];
    char bs[128];
} inst_t;

static kvw_status_t make_rank(uint32_t tp, uint32_t rank, kvt_rank_t *r)
{
    return ip_rank(&model, tp, rank, 64, 2, r);
}

static kvw_status_t ctx_open(kvt_rank_t *r, bool prefill, const char *bs, bool host,
                             kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p =
        ip_params(prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, r, g_tl, bs, host);
    if (bs == NULL)
        p.field_mask &= ~KVW_CTX_FIELD_BOOTSTRAP;
    p.heartbeat_ms = 100;
    p.peer_timeout_ms = kvt_tmo_ms(3000);
    p.bootstrap_timeout_ms = kvt_tmo_ms(20000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    return kvw_ctx_create(&p, ctx);
}

/* Starts a prefill instance of TP tp. host: its rank 0 hosts the bootstrap at `bs`
 * ("host:0" picks a port); else every rank registers with the endpoint at `bs`. */
static kvw_status_t inst_start(inst_t *in, uint32_t tp, uint32_t fill, const char *bs, bool host)
{
    memset(in, 0, sizeof(*in));
    in->tp = tp;
    for (uint32_t k = 0; k < tp; k++) {
        if (make_rank(tp, k, &in->r[k]) != KVW_OK)
            return KVW_ERR_INTERNAL;
        kvt_rank_fill(&in->r[k], fill + k);
    }
    kvw_status_t st = ctx_open(&in->r[0], true, bs, host, &in->ctx[0]);
    if (st != KVW_OK)
        return st;
    snprintf(in->bs, sizeof(in->bs), "%s", host ? kvw_ctx_bootstrap_addr(in->ctx[0]) : bs);
    for (uint32_t k = 1; k < tp && st == KVW_OK; k++)
        st = ctx_open(&in->r[k], true, in->bs, false, &in->ctx[k]);
    return st;
}

static void inst_stop(inst_t *in)
{
    for (int k = 1; k >= 0; k--) {
        kvw_ctx_destroy(in->ctx[k]);
        in->ctx[k] = NULL;
    }
    for (uint32_t k = 0; k < in->tp; k++)
        kvt_rank_free(&in->r[k]);
}

/* Pages of a room: room slot s uses pages [3s, 3s + 3) of both pools on both sides. */
typedef struct pages {
    uint32_t full[PAGES_PER_ROOM], swa[PAGES_PER_ROOM];
    kvw_side_pages_t side;
} pages_t;

static void room_pages(int slot, pages_t *p)
{
    for (int i = 0; i < PAGES_PER_ROOM; i++)
        p->full[i] = p->swa[i] = (uint32_t)(slot * PAGES_PER_ROOM + i);
    p->side = (kvw_side_pages_t){.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                                 .full = {KVW_PAGES_FIELDS_ALL, p->full, PAGES_PER_ROOM, 0},
                                 .swa = {KVW_PAGES_FIELDS_ALL, p->swa, PAGES_PER_ROOM,
                                         0}, .state_slot = -1};
}

typedef struct room {
    uint64_t id;
    int slot;
    inst_t *src; /* the instance that writes it */
    kvw_receiver_h rv;
    kvw_sender_h s[2];
} room_t;

static void d_open(kvw_ctx_h dctx, room_t *rm, const char *bs)
{
    pages_t p;
    room_pages(rm->slot, &p);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .pages = p.side};
    CHECK(kvw_receiver_create_from(dctx, rm->id, bs, 0, &rm->rv) == KVW_OK, "[%s] room %llu: %s",
          g_tl, (unsigned long long)rm->id, kvw_last_error());
    CHECK(kvw_receiver_post(rm->rv, &post) == KVW_OK, "[%s] post room %llu: %s", g_tl,
          (unsigned long long)rm->id, kvw_last_error());
}

/* Opens a room naming an address that cannot work. Its connection may already have
 * failed by the time of the post (an unreachable address fails at once): the post then
 * returns the room's failure, which must name the address; otherwise the room fails
 * later (expect_room). */
static void d_open_bad(kvw_ctx_h dctx, room_t *rm, const char *bs, const char *needle)
{
    pages_t p;
    room_pages(rm->slot, &p);
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .pages = p.side};
    CHECK(kvw_receiver_create_from(dctx, rm->id, bs, 0, &rm->rv) == KVW_OK, "[%s] room %llu: %s",
          g_tl, (unsigned long long)rm->id, kvw_last_error());
    kvw_status_t st = kvw_receiver_post(rm->rv, &post);
    CHECK(st == KVW_OK || kvt_contains(kvw_last_error(), needle),
          "[%s] post room %llu: %s: %s", g_tl, (unsigned long long)rm->id,
          kvw_status_string(st), kvw_last_error());
}

static void p_open(room_t *rm)
{
    for (uint32_t k = 0; k < rm->src->tp; k++)
        CHECK(kvw_sender_create(rm->src->ctx[k], rm->id, &rm->s[k]) == KVW_OK, "%s",
              kvw_last_error());
}

static void p_send(room_t *rm)
{
    pages_t p;
    room_pages(rm->slot, &p);
    kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                          .chunk_end = TOKENS, .last_chunk = 1,
                          .pages = p.side};
    for (uint32_t k = 0; k < rm->src->tp; k++)
        CHECK(kvw_sender_send(rm->s[k], &c) == KVW_OK, "%s", kvw_last_error());
}

static void expect_room(room_t *rm, kvw_room_state_t want, const char *needle)
{
    kvw_room_state_t s = kvw_room_wait(kvw_receiver_room(rm->rv), kvt_tmo_ms(30000));
    CHECK(s == want, "[%s] room %llu: %s (want %s): %s", g_tl, (unsigned long long)rm->id,
          kvw_room_state_string(s), kvw_room_state_string(want),
          kvw_room_failure(kvw_receiver_room(rm->rv)));
    if (s == KVW_ROOM_FAILED && needle)
        CHECK(kvt_contains(kvw_room_failure(kvw_receiver_room(rm->rv)), needle),
              "[%s] room %llu: reason lacks "
              "'%s': %s", g_tl, (unsigned long long)rm->id, needle,
              kvw_room_failure(kvw_receiver_room(rm->rv)));
}

/* Adds room rm's reference writes (from its instance's ranks) to `expect`. */
static void ref_room(const kvt_rank_t *dst, kvt_copy_t *expect, const room_t *rm)
{
    pages_t p;
    room_pages(rm->slot, &p);
    ip_ref(&model, rm->src->r, rm->src->tp, &p.side, dst, &p.side, expect->data, TOKENS, NULL);
}

static void verify(const kvt_rank_t *dst, const kvt_copy_t *expect, const char *when)
{
    char prefix[128];
    snprintf(prefix, sizeof(prefix), "[%s] %s: ", g_tl, when);
    ip_verify(dst, expect, prefix);
}

static void close_room(room_t *rm)
{
    for (int k = 0; k < 2; k++) {
        kvw_room_destroy(kvw_sender_room(rm->s[k]));
        rm->s[k] = NULL;
    }
    kvw_room_destroy(kvw_receiver_room(rm->rv));
    rm->rv = NULL;
}

static void run(const char *tl)
{
    g_tl = tl;
    kvt_rank_t dst;
    kvw_ctx_h dctx = NULL;
    inst_t a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    CHECK(make_rank(1, 0, &dst) == KVW_OK, "%s", kvw_last_error());
    kvt_rank_fill(&dst, 7);
    kvt_copy_t expect;
    kvt_copy_make(&dst, &expect);
    /* A hosts its bootstrap endpoint; B registers with a standalone one, which outlives
     * B's ranks. */
    kvw_bootstrap_h bsb = NULL;
    CHECK(kvw_bootstrap_start("127.0.0.1:0", &bsb) == KVW_OK, "%s", kvw_last_error());
    kvw_status_t st = inst_start(&a, 1, 41, "127.0.0.1:0", true);
    if (st == KVW_ERR_UNSUPPORTED) {
        printf("test_multi_instance: %s unavailable here, skipped\n", tl);
        goto out;
    }
    CHECK(st == KVW_OK, "instance A: %s", kvw_last_error());
    CHECK(bsb && inst_start(&b, 2, 51, kvw_bootstrap_address(bsb), false) == KVW_OK,
          "instance B: %s", kvw_last_error());
    /* The decode context names no instance of its own. */
    CHECK(ctx_open(&dst, false, NULL, false, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (failures)
        goto out;
    kvw_receiver_h none = NULL;
    st = kvw_receiver_create(dctx, 99, 0, &none);
    CHECK(st == KVW_ERR_INVALID_PARAM && kvt_contains(kvw_last_error(), "names no prefill instance"),
          "default room without an instance: %s: %s", kvw_status_string(st), kvw_last_error());

    /* Phase 1: rooms from A and B at once (posted while both connect). */
    room_t ra[2] = {{.id = 1, .slot = 0, .src = &a}, {.id = 2, .slot = 1, .src = &a}};
    room_t rb[3] = {{.id = 11, .slot = 2, .src = &b}, {.id = 12, .slot = 3, .src = &b},
                    {.id = 13, .slot = 4, .src = &b}};
    for (int i = 0; i < 2; i++)
        d_open(dctx, &ra[i], a.bs);
    for (int i = 0; i < 3; i++)
        d_open(dctx, &rb[i], b.bs);
    p_open(&ra[0]), p_send(&ra[0]);
    p_open(&rb[0]), p_send(&rb[0]);
    p_open(&rb[1]); /* B's room 12 is open on B, never sent */
    expect_room(&ra[0], KVW_ROOM_SUCCESS, NULL);
    expect_room(&rb[0], KVW_ROOM_SUCCESS, NULL);
    ref_room(&dst, &expect, &ra[0]);
    ref_room(&dst, &expect, &rb[0]);
    verify(&dst, &expect, "A and B at once");

    /* Phase 2: B goes away with rooms 12 and 13 open: they fail naming B; A is not
     * affected (room 2 is sent after B is gone). */
    char b_addr[128];
    snprintf(b_addr, sizeof(b_addr), "%s", b.bs);
    for (int i = 1; i < 3; i++)
        for (int k = 0; k < 2; k++) {
            kvw_room_destroy(kvw_sender_room(rb[i].s[k]));
            rb[i].s[k] = NULL;
        }
    inst_stop(&b);
    expect_room(&rb[1], KVW_ROOM_FAILED, b_addr);
    expect_room(&rb[2], KVW_ROOM_FAILED, b_addr);
    p_open(&ra[1]), p_send(&ra[1]);
    expect_room(&ra[1], KVW_ROOM_SUCCESS, NULL);
    ref_room(&dst, &expect, &ra[1]);
    verify(&dst, &expect, "B gone, A served");

    /* Phase 3: B restarts and registers again; a new room reconnects. */
    st = inst_start(&b, 2, 61, b_addr, false);
    CHECK(st == KVW_OK, "B again at %s: %s", b_addr, kvw_last_error());
    if (st == KVW_OK) {
        room_t r3 = {.id = 21, .slot = 5, .src = &b};
        d_open(dctx, &r3, b_addr);
        p_open(&r3), p_send(&r3);
        expect_room(&r3, KVW_ROOM_SUCCESS, NULL);
        ref_room(&dst, &expect, &r3);
        verify(&dst, &expect, "B restarted");
        close_room(&r3);
    }

    /* Addresses that cannot work fail the room at once, with the reason. */
    room_t bad1 = {.id = 31, .slot = 6}, bad2 = {.id = 32, .slot = 7};
    d_open_bad(dctx, &bad1, "no-such-host.invalid:5000", "no-such-host.invalid");
    d_open_bad(dctx, &bad2, "127.0.0.1:1", "127.0.0.1:1");
    expect_room(&bad1, KVW_ROOM_FAILED, "no-such-host.invalid");
    expect_room(&bad2, KVW_ROOM_FAILED, "127.0.0.1:1");
    close_room(&bad1);
    close_room(&bad2);

    /* A room aborted while its instance is still being connected (the instance's
     * bootstrap endpoint is up, its rank not yet): once the rank is there, it hears of
     * the abort, and its sender fails "aborted" instead of waiting for a timeout. */
    kvw_bootstrap_h bsc = NULL;
    CHECK(kvw_bootstrap_start("127.0.0.1:0", &bsc) == KVW_OK, "%s", kvw_last_error());
    if (bsc) {
        char c_addr[128];
        snprintf(c_addr, sizeof(c_addr), "%s", kvw_bootstrap_address(bsc));
        room_t rc = {.id = 41, .slot = 8};
        d_open(dctx, &rc, c_addr);
        CHECK(kvw_room_poll(kvw_receiver_room(rc.rv)) == KVW_ROOM_BOOTSTRAPPING,
              "room 41 before its instance: %s",
              kvw_room_state_string(kvw_room_poll(kvw_receiver_room(rc.rv))));
        kvw_room_abort(kvw_receiver_room(rc.rv));
        CHECK(kvw_room_poll(kvw_receiver_room(rc.rv)) == KVW_ROOM_FAILED, "aborted room 41 is %s",
              kvw_room_state_string(kvw_room_poll(kvw_receiver_room(rc.rv))));
        kvw_room_destroy(kvw_receiver_room(rc.rv));
        inst_t c;
        CHECK(inst_start(&c, 1, 71, c_addr, false) == KVW_OK, "instance C: %s", kvw_last_error());
        kvw_sender_h s = NULL;
        CHECK(kvw_sender_create(c.ctx[0], 41, &s) == KVW_OK, "%s", kvw_last_error());
        kvw_room_state_t ps = kvw_room_wait(kvw_sender_room(s), kvt_tmo_ms(30000));
        CHECK(ps == KVW_ROOM_FAILED && kvt_contains(kvw_room_failure(kvw_sender_room(s)), "abort"),
              "[%s] C's sender of the aborted room: %s: %s", g_tl, kvw_room_state_string(ps),
              kvw_room_failure(kvw_sender_room(s)));
        kvw_room_destroy(kvw_sender_room(s));
        inst_stop(&c);
        kvw_bootstrap_stop(bsc);
    }
    verify(&dst, &expect, "the end");

    for (int i = 0; i < 2; i++)
        close_room(&ra[i]);
    for (int i = 0; i < 3; i++)
        close_room(&rb[i]);
out:
    kvw_ctx_destroy(dctx);
    inst_stop(&b);
    inst_stop(&a);
    kvw_bootstrap_stop(bsb);
    kvt_copy_free(&expect);
    kvt_rank_free(&dst);
}

int main(void)
{
    kvt_model_preset("gpt-oss-120b", &model);
    kvt_model_truncate(&model, 2);
    run("tcp");
    run("shm");
    return ip_summary("test_multi_instance");
}
