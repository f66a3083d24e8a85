/*
 * Every write checked, on each transport whose receiver mediates writes: tcp, and ucx on
 * its default "am" data path (when the ucx module loads here). One process: decode
 * instance 1 (TP1, no bootstrap of its own) reads room 41 from honest prefill instance
 * A, and rooms 40, 42 and 44 from prefill instances B and C, which are hostile: real
 * kvwire peers whose data connections (bound to their own sessions) are then used to
 *   1. (B) write A's room 41, a room B is no source of, into a page granted to it: the
 *      write is refused before a byte lands (counted as foreign), and room 41 is left
 *      alone;
 *   2. (C) complete its room 42 with a DONE claiming every byte, having written none:
 *      the room fails (BYTE_MISMATCH: the landing log, not the DONE, says what landed);
 *   3. (C) write its room 44's id into a page granted to no room: room 44 fails with a
 *      reason that names the write and the page (on ucx C's connection fails too,
 *      naming the refused write).
 * A's sender then completes room 41: Success, every byte of the decode's buffers equal
 * to the reference (the pages nobody was granted and the guards untouched).
 * On the "rma" data path the receiver sees no write: its caps must say so (no MEDIATED),
 * as the README's table does.
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
#define POOL_PAGES 24
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;
static const char *g_tl = "tcp";

/* The live peer of a prefill context (the one decode rank it serves here). */
static kvw_peer_t *live_peer(struct kvw_ctx *c)
{
    kvw_peer_t *found = NULL;
    for (uint32_t i = 0; i < kvw__peer_count(c); i++)
        if (!kvw__peer_at(c, i)->dead && !kvw__peer_at(c, i)->registering)
            found = kvw__peer_at(c, i);
    return found;
}

/* Whether prefill context `c` holds room `id`, requested by the decode rank. */
static bool wait_claimed(struct kvw_ctx *c, uint64_t id)
{
    for (uint64_t t0 = kvt_now_ns(); kvt_now_ns() - t0 < DEADLINE_NS; usleep(2000)) {
        pthread_mutex_lock(&c->mu);
        kvw_room_t *r = kvw__room_find(c, id);
        bool ok = r && r->dst_dp >= 0 && r->num_dsts > 0 && live_peer(c) != NULL;
        pthread_mutex_unlock(&c->mu);
        if (ok)
            return true;
    }
    return false;
}

/* What the decode room expects from its one source, once it knows (0: never). */
static uint64_t wait_expected(struct kvw_ctx *d, uint64_t id)
{
    for (uint64_t t0 = kvt_now_ns(); kvt_now_ns() - t0 < DEADLINE_NS; usleep(2000)) {
        pthread_mutex_lock(&d->mu);
        kvw_room_t *r = kvw__room_find(d, id);
        uint64_t e = r && r->num_srcs ? r->srcs[0].expected : 0;
        pthread_mutex_unlock(&d->mu);
        if (e)
            return e;
    }
    return 0;
}

static uint64_t foreign_writes(struct kvw_ctx *d)
{
    pthread_mutex_lock(&d->mu);
    uint64_t n = d->foreign_writes;
    pthread_mutex_unlock(&d->mu);
    return n;
}

static bool room_granted(const kvw_room_t *r, uint32_t pool, uint32_t page)
{
    for (uint32_t i = 0; r && i < r->num_granted[pool]; i++)
        if (r->granted[pool][i] == page)
            return true;
    return false;
}

/* A paged view of the decode rank and two pages of its pool: one granted to room 41, and
 * one granted to none of the rooms. */
typedef struct target {
    uint32_t buf;
    uint64_t stride;
    uint32_t granted41, nobodys;
} target_t;

static bool find_target(struct kvw_ctx *d, target_t *t)
{
    bool ok = false;
    pthread_mutex_lock(&d->mu);
    kvw_room_t *rooms[4] = {kvw__room_find(d, 40), kvw__room_find(d, 41), kvw__room_find(d, 42),
                            kvw__room_find(d, 44)};
    for (uint32_t i = 0; i < d->rank->num_views && !ok; i++) {
        const kvw_comp_view_t *v = &d->rank->views[i];
        if (v->comp == KVW_COMP_STATE || rooms[1] == NULL || rooms[1]->num_granted[v->pool] == 0)
            continue;
        t->buf = v->buf;
        t->stride = v->view.page_stride;
        t->granted41 = rooms[1]->granted[v->pool][0];
        for (uint32_t p = 0; p < POOL_PAGES && !ok; p++) {
            bool used = false;
            for (int k = 0; k < 4; k++)
                used |= room_granted(rooms[k], v->pool, p);
            if (!used) {
                t->nobodys = p;
                ok = true;
            }
        }
    }
    pthread_mutex_unlock(&d->mu);
    return ok;
}

/* One write of `len` bytes at `off` of decode buffer `buf`, tagged `room`, on prefill
 * context c's own bound data connection. */
static kvw_status_t hostile_put(struct kvw_ctx *c, uint64_t room, uint32_t buf, uint64_t off,
                                uint64_t len)
{
    static uint8_t junk[512];
    memset(junk, 0xe7, sizeof(junk));
    pthread_mutex_lock(&c->mu);
    kvw_peer_t *p = live_peer(c);
    kvw_tl_ep_h ep = p ? p->ep : NULL;
    kvw_tl_rkey_h rk = p && buf < p->num_rkeys ? p->rkeys[buf] : NULL;
    pthread_mutex_unlock(&c->mu);
    CHECK(ep && rk, "[%s] the hostile instance has no data path to buffer %u", g_tl, buf);
    if (!ep || !rk)
        return KVW_ERR_INTERNAL;
    kvw_tl_put_t put = {.src = junk, .rkey = rk, .dst_off = off, .len = KVW_MIN(len, sizeof(junk))};
    return c->tl_ops->put(ep, room, &put, 1);
}

/* A completion for all of room `id` (`bytes` bytes), on c's own bound data connection,
 * tagged with its session key when it has one. */
static void hostile_done(struct kvw_ctx *c, uint64_t id, uint64_t bytes)
{
    pthread_mutex_lock(&c->mu);
    kvw_peer_t *p = live_peer(c);
    kvw_tl_ep_h ep = p ? p->ep : NULL;
    uint32_t as = p ? p->id_at_remote : 0;
    uint8_t k[32];
    bool authed = p && p->authed;
    if (authed)
        memcpy(k, p->skey, sizeof(k));
    pthread_mutex_unlock(&c->mu);
    CHECK(ep, "[%s] the hostile instance has no data path", g_tl);
    if (!ep)
        return;
    kvw_done_msg_t dm = {.room = id, .peer = as, .chunk_begin = 0, .chunk_end = TOKENS,
                         .bytes = bytes, .last_chunk = true, .final = true};
    kvw_wbuf_t w;
    kvw__done_encode(&w, &dm, authed ? k : NULL);
    CHECK(kvw__wb_finish(&w) == KVW_OK && c->tl_ops->notify(ep, w.p, w.len) == KVW_OK,
          "[%s] the hostile completion: %s", g_tl, kvw_last_error());
    kvw__wb_free(&w);
}

static void pages_make(kvt_rank_t *src, kvt_rank_t *dst, uint64_t seed, uint32_t tokens,
                       kvt_req_pages_t *sp, kvt_req_pages_t *dp)
{
    kvt_rng_t rng = {seed};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = tokens, .swa_begin = 0, .swa_end = tokens,
                         .state_slot = -1};
    CHECK(kvt_req_pages_make(src, &rs, &rng, sp) == 0 && kvt_req_pages_make(dst, &rs, &rng, dp) == 0,
          "pages");
}

static kvw_receiver_h post(kvw_ctx_h d, uint64_t id, const char *bs, kvw_side_pages_t pages,
                           uint32_t tokens)
{
    kvw_receiver_h rcv = NULL;
    kvw_recv_post_t rp = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = tokens,
                          .pages = pages};
    CHECK(kvw_receiver_create_from(d, id, bs, 0, &rcv) == KVW_OK &&
              kvw_receiver_post(rcv, &rp) == KVW_OK,
          "[%s] room %llu: %s", g_tl, (unsigned long long)id, kvw_last_error());
    return rcv;
}

static void run(const char *secret)
{
    const char *mode = secret[0] ? "secret" : "no secret";
    kvt_rank_t ra = {0}, rb = {0}, rc = {0}, rd = {0};
    CHECK(ip_rank(&model, 1, 0, POOL_PAGES, 1, &ra) == KVW_OK &&
              ip_rank(&model, 1, 0, POOL_PAGES, 1, &rb) == KVW_OK &&
              ip_rank(&model, 1, 0, POOL_PAGES, 1, &rc) == KVW_OK &&
              ip_rank(&model, 1, 0, POOL_PAGES, 1, &rd) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&ra, 1);
    kvt_rank_fill(&rb, 2);
    kvt_rank_fill(&rc, 3);
    kvt_rank_fill(&rd, 4);
    kvw_ctx_h a = NULL, b = NULL, c = NULL, d = NULL;
    CHECK(ip_ctx_instance(&ra, true, g_tl, secret, 0, &a) == KVW_OK &&
              ip_ctx_instance(&rb, true, g_tl, secret, 0, &b) == KVW_OK &&
              ip_ctx_instance(&rc, true, g_tl, secret, 0, &c) == KVW_OK &&
              ip_ctx_instance(&rd, false, g_tl, secret, 1, &d) == KVW_OK,
          "[%s, %s] contexts: %s", g_tl, mode, kvw_last_error());
    if (!a || !b || !c || !d)
        goto out_ctx;
    struct kvw_ctx *dc = d, *bc = b, *cc = c;
    CHECK(kvw__tl_caps(dc->tl_ops, dc->tl) & KVW_TL_CAP_MEDIATED,
          "[%s] the decode's transport does not mediate writes", g_tl);
    char bsa[128], bsb[128], bsc[128];
    snprintf(bsa, sizeof(bsa), "%s", kvw_ctx_bootstrap_addr(a));
    snprintf(bsb, sizeof(bsb), "%s", kvw_ctx_bootstrap_addr(b));
    snprintf(bsc, sizeof(bsc), "%s", kvw_ctx_bootstrap_addr(c));

    /* Room 41 (A's) and 42 (C's) take TOKENS tokens, 40 (B's) and 44 (C's) one page. */
    kvt_req_pages_t sp, dp, p42s, p42d, p1s, p1d, p44s, p44d;
    pages_make(&ra, &rd, 41, TOKENS, &sp, &dp);
    pages_make(&rc, &rd, 42, TOKENS, &p42s, &p42d);
    pages_make(&rb, &rd, 40, 1, &p1s, &p1d);
    pages_make(&rc, &rd, 44, 1, &p44s, &p44d);
    kvt_copy_t expect;
    kvt_copy_make(&rd, &expect);
    kvw_receiver_h victim = post(d, 41, bsa, dp.side, TOKENS);
    kvw_receiver_h r40 = post(d, 40, bsb, p1d.side, 1);
    kvw_receiver_h r42 = post(d, 42, bsc, p42d.side, TOKENS);
    kvw_receiver_h r44 = post(d, 44, bsc, p44d.side, 1);
    CHECK(victim && r40 && r42 && r44, "[%s, %s] posts", g_tl, mode);
    if (!victim || !r40 || !r42 || !r44)
        goto out_rooms;
    CHECK(wait_claimed(a, 41) && wait_claimed(bc, 40) && wait_claimed(cc, 42) &&
              wait_claimed(cc, 44),
          "[%s, %s] instances not connected", g_tl, mode);
    uint64_t expected42 = wait_expected(dc, 42);
    CHECK(expected42 > 0 && wait_expected(dc, 41) > 0 && wait_expected(dc, 44) > 0,
          "[%s, %s] the rooms expect no bytes", g_tl, mode);
    target_t t = {0};
    CHECK(find_target(dc, &t), "[%s, %s] no paged view with a page granted to no room", g_tl,
          mode);
    bool tcp = strcmp(g_tl, "tcp") == 0;
    kvw_status_t st;
    char msg[512];

    /* 1. B writes A's room 41, into a page granted to it. */
    uint64_t f0 = foreign_writes(dc);
    st = hostile_put(bc, 41, t.buf, t.granted41 * t.stride, 512);
    CHECK(st == KVW_OK || !tcp, "[%s, %s] B's put: %s", g_tl, mode, kvw_last_error());
    uint64_t t0 = kvt_now_ns();
    while (foreign_writes(dc) == f0 && kvt_now_ns() - t0 < DEADLINE_NS)
        usleep(2000);
    CHECK(foreign_writes(dc) == f0 + 1, "[%s, %s] B's write for room 41 was not refused as "
          "foreign (%llu refusals)", g_tl, mode, (unsigned long long)(foreign_writes(dc) - f0));
    kvw_room_state_t s = kvw_room_poll(kvw_receiver_room(victim));
    CHECK(s == KVW_ROOM_WAITING_FOR_INPUT, "[%s, %s] after B's write room 41 is %s: %s", g_tl,
          mode, kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(victim)));

    /* 2. C completes room 42 without writing a byte of it. */
    hostile_done(cc, 42, expected42);
    s = ip_wait_recv(r42, DEADLINE_NS);
    const char *why = kvw_room_failure(kvw_receiver_room(r42));
    CHECK(s == KVW_ROOM_FAILED && kvw_room_status(kvw_receiver_room(r42)) ==
                                      KVW_ERR_BYTE_MISMATCH &&
              kvt_contains(why, "0 distinct bytes landed"),
          "[%s, %s] room 42 after a DONE for bytes never written: %s (%s): %s", g_tl, mode,
          kvw_room_state_string(s), kvw_status_string(kvw_room_status(kvw_receiver_room(r42))),
          why);

    /* 3. C writes its room 44's id into a page granted to no room. */
    st = hostile_put(cc, 44, t.buf, t.nobodys * t.stride, 512);
    CHECK(st == KVW_OK || !tcp, "[%s, %s] C's put: %s", g_tl, mode, kvw_last_error());
    s = ip_wait_recv(r44, DEADLINE_NS);
    why = kvw_room_failure(kvw_receiver_room(r44));
    char want[160];
    snprintf(want, sizeof(want), "touches page %u, which this room was not granted", t.nobodys);
    CHECK(s == KVW_ROOM_FAILED && kvt_contains(why, "room 44: a write to buffer") &&
              kvt_contains(why, want),
          "[%s, %s] room 44 after a write outside its grant: %s: %s (expected \"%s\")", g_tl, mode,
          kvw_room_state_string(s), why, want);
    s = kvw_room_poll(kvw_receiver_room(victim));
    CHECK(s == KVW_ROOM_WAITING_FOR_INPUT, "[%s, %s] after C's writes room 41 is %s: %s", g_tl,
          mode, kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(victim)));

    /* A's real sender: room 41 succeeds with the reference bytes, and nothing the hostile
     * instances wrote is anywhere in the decode's buffers. */
    kvw_sender_h snd = NULL;
    kvw_send_chunk_t ch = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                           .chunk_end = TOKENS, .last_chunk = 1, .pages = sp.side};
    CHECK(kvw_sender_create(a, 41, &snd) == KVW_OK && kvw_sender_send(snd, &ch) == KVW_OK,
          "[%s, %s] %s", g_tl, mode, kvw_last_error());
    s = ip_wait_recv(victim, DEADLINE_NS);
    CHECK(s == KVW_ROOM_SUCCESS, "[%s, %s] room 41: %s: %s", g_tl, mode,
          kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(victim)));
    ip_ref(&model, &ra, 1, &sp.side, &rd, &dp.side, expect.data, TOKENS, NULL);
    char pre[64];
    snprintf(pre, sizeof(pre), "[%s, %s] decode buffers: ", g_tl, mode);
    ip_verify(&rd, &expect, pre);
    CHECK(kvt_rank_check_guards(&rd, msg, sizeof(msg)) == 0, "[%s, %s] %s", g_tl, mode, msg);
    if (snd)
        kvw_room_destroy(kvw_sender_room(snd));
out_rooms:
    if (victim)
        kvw_room_destroy(kvw_receiver_room(victim));
    if (r40)
        kvw_room_destroy(kvw_receiver_room(r40));
    if (r42)
        kvw_room_destroy(kvw_receiver_room(r42));
    if (r44)
        kvw_room_destroy(kvw_receiver_room(r44));
    kvt_copy_free(&expect);
    kvt_req_pages_free(&sp);
    kvt_req_pages_free(&dp);
    kvt_req_pages_free(&p42s);
    kvt_req_pages_free(&p42d);
    kvt_req_pages_free(&p1s);
    kvt_req_pages_free(&p1d);
    kvt_req_pages_free(&p44s);
    kvt_req_pages_free(&p44d);
out_ctx:
    kvw_ctx_destroy(d);
    kvw_ctx_destroy(c);
    kvw_ctx_destroy(b);
    kvw_ctx_destroy(a);
    kvt_rank_free(&ra);
    kvt_rank_free(&rb);
    kvt_rank_free(&rc);
    kvt_rank_free(&rd);
}

/* The "rma" data path: one-sided, unchecked, and its caps say so. */
static void rma_caps(void)
{
    kvt_rank_t r = {0};
    CHECK(ip_rank(&model, 1, 0, POOL_PAGES, 1, &r) == KVW_OK, "%s", kvw_last_error());
    setenv("KVW_UCX_PUT", "rma", 1);
    kvw_ctx_h d = NULL;
    CHECK(ip_ctx_instance(&r, false, g_tl, "", 1, &d) == KVW_OK, "[ucx rma] decode: %s",
          kvw_last_error());
    unsetenv("KVW_UCX_PUT");
    if (d) {
        struct kvw_ctx *dc = d;
        uint64_t caps = kvw__tl_caps(dc->tl_ops, dc->tl);
        CHECK(!(caps & KVW_TL_CAP_MEDIATED), "[ucx rma] caps 0x%llx claim mediated writes",
              (unsigned long long)caps);
        kvw_ctx_destroy(d);
    }
    kvt_rank_free(&r);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_room_ownership_writes", &model))
        return 1;
    static const char *const tls[] = {"tcp", "ucx"};
    for (size_t i = 0; i < 2; i++) {
        g_tl = tls[i];
        if (kvw__tl_find(g_tl) == NULL) {
            printf("test_room_ownership_writes: %s not available here (%s): skipped\n", g_tl,
                   kvw_last_error());
            continue;
        }
        printf("test_room_ownership_writes: over %s\n", g_tl);
        run("");
        run("alpha");
        if (strcmp(g_tl, "ucx") == 0)
            rma_caps();
    }
    return ip_summary("test_room_ownership_writes");
}
