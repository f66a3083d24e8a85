/*
 * With a shared secret the data plane is part of the session (tcp, one process, a
 * prefill TP1 hosting its bootstrap and a decode TP1, both with secret "alpha"):
 *   1. A third party that read the decode's data address (its tcp token) and its BIND
 *      nonce in the clear (both travel in HELLO; the test takes the same bytes from the
 *      decode's memory) opens its own data connection, BINDs as the prefill rank with
 *      that nonce and sends the room's completion, with no bytes: the room does not
 *      move. The real sender then completes it with the reference bytes.
 *   2. The same third party also writes its own bytes into every byte of the room's
 *      granted pages (the plan the prefill rank would run) before its completion: its
 *      connection is bound to no source of the room, so every one of those writes is
 *      refused before a byte lands (counted as foreign) and the room does not move; the
 *      real sender then completes it, and the pages hold the reference bytes, not the
 *      third party's.
 *   3. A STAGE_ASK for a room already at Success, sent by the room's own prefill rank
 *      through its authenticated session, is not granted: the staging area holds no
 *      span afterwards, and a staged room after it still succeeds.
 *   4. A genuine entry that is not the prefill rank's own (signed with the secret, with
 *      another nonce: a stale registration, or one redirected) fails the handshake.
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

static kvw_status_t make_ctx(kvt_rank_t *r, bool prefill, const char *bs, kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p =
        ip_params(prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, r, "tcp", bs, prefill);
    p.field_mask |= KVW_CTX_FIELD_SECRET;
    p.secret = "alpha";
    p.bootstrap_timeout_ms = kvt_tmo_ms(5000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    return kvw_ctx_create(&p, ctx);
}

static void ignore_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    (void)arg, (void)ep, (void)msg, (void)len;
}

/* The one registered prefill peer of a decode context: its id and the nonce its
 * registration sent in the clear. */
static uint32_t decode_peer(struct kvw_ctx *d, uint8_t nonce[32])
{
    uint32_t id = UINT32_MAX;
    pthread_mutex_lock(&d->mu);
    for (uint32_t i = 0; i < kvw__peer_count(d); i++) {
        const kvw_peer_t *p = kvw__peer_at(d, i);
        if (!p->dead && !p->registering) {
            id = p->id;
            memcpy(nonce, p->bind_nonce, 32);
        }
    }
    pthread_mutex_unlock(&d->mu);
    return id;
}

typedef struct forger {
    const kvw_tl_ops_t *ops;
    kvw_tl_h tl;
    kvw_tl_ep_h ep;
    kvw_tl_rkey_h rk[64];
    uint32_t nb;
    uint64_t puts;
    uint64_t room; /* the tag its writes carry */
} forger_t;

/* A data connection of our own to the decode rank, with the keys its HELLO carries. */
static int forger_open(forger_t *f, struct kvw_ctx *d)
{
    memset(f, 0, sizeof(*f));
    uint8_t addr[KVW_TL_MAX_ADDR];
    size_t alen = KVW_TL_MAX_ADDR;
    f->ops = kvw__tl_find("tcp");
    kvw_tl_params_t tp = {.cb = {.on_notify = ignore_notify}, .timeout_ms = kvt_tmo_ms(10000)};
    bool ok = f->ops && d->tl_ops->address(d->tl, addr, &alen) == KVW_OK &&
              f->ops->init(&tp, &f->tl) == KVW_OK &&
              f->ops->connect(f->tl, addr, alen, &f->ep) == KVW_OK;
    CHECK(ok, "forger: %s", kvw_last_error());
    if (!ok)
        return -1;
    f->nb = kvw_rank_num_buffers(d->rank);
    for (uint32_t i = 0; i < f->nb && i < 64; i++) {
        if (d->hello_rkey_lens[i] == 0)
            continue;
        ok = f->ops->rkey_unpack(f->ep, d->hello_rkeys + (size_t)i * KVW_TL_MAX_RKEY,
                                 d->hello_rkey_lens[i], &f->rk[i]) == KVW_OK;
        CHECK(ok, "forger key %u: %s", i, kvw_last_error());
        if (!ok)
            return -1;
    }
    return 0;
}

static void forger_close(forger_t *f)
{
    if (f->tl == NULL)
        return;
    for (uint32_t i = 0; i < f->nb && i < 64; i++)
        if (f->rk[i])
            f->ops->rkey_release(f->rk[i]);
    if (f->ep)
        f->ops->ep_close(f->ep);
    f->ops->close(f->tl);
    f->ops->stop(f->tl);
    f->ops->fini(f->tl);
}

static void forger_notify(forger_t *f, kvw_wbuf_t *w)
{
    CHECK(kvw__wb_finish(w) == KVW_OK && f->ops->notify(f->ep, w->p, w->len) == KVW_OK,
          "forger notify: %s", kvw_last_error());
    kvw__wb_free(w);
}

static void forger_bind(forger_t *f, uint32_t peer, const uint8_t nonce[32])
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_BIND);
    kvw__wb_u32(&w, peer);
    for (int i = 0; i < 32; i++)
        kvw__wb_u8(&w, nonce[i]);
    forger_notify(f, &w);
}

/* One run of the plan, written with the forger's own bytes (0x5a). */
static kvw_status_t forger_run(void *arg, const kvw_run_t *run)
{
    forger_t *f = arg;
    uint8_t *junk = malloc(run->len ? run->len : 1);
    if (junk == NULL || run->dst_buf >= 64 || f->rk[run->dst_buf] == NULL) {
        free(junk);
        return KVW_ERR_INTERNAL;
    }
    memset(junk, 0x5a, run->len);
    kvw_tl_put_t put = {.src = junk, .rkey = f->rk[run->dst_buf], .dst_off = run->dst_off,
                        .len = run->len};
    kvw_status_t st = f->ops->put(f->ep, f->room, &put, 1);
    free(junk);
    f->puts++;
    return st;
}

/* Pages of one room on both sides. */
typedef struct room_pages {
    kvt_req_pages_t sp, dp;
} room_pages_t;

static void pages_make(kvt_rank_t *src, kvt_rank_t *dst, uint64_t seed, room_pages_t *rp)
{
    kvt_rng_t rng = {seed};
    kvt_req_spec_t rs = {.full_begin = 0, .full_end = TOKENS, .swa_begin = 0, .swa_end = TOKENS,
                         .state_slot = -1};
    CHECK(kvt_req_pages_make(src, &rs, &rng, &rp->sp) == 0 &&
              kvt_req_pages_make(dst, &rs, &rng, &rp->dp) == 0,
          "pages");
}

/* The forged completion: the whole room from peer `peer`, `bytes` bytes, no tag. */
static void forger_done(forger_t *f, uint64_t room, uint32_t peer, uint64_t bytes)
{
    kvw_done_msg_t dm = {.room = room, .peer = peer, .chunk_begin = 0, .chunk_end = TOKENS,
                         .bytes = bytes, .last_chunk = true, .final = true};
    kvw_wbuf_t w;
    kvw__done_encode(&w, &dm, NULL);
    forger_notify(f, &w);
}

/* Cases 1 and 2: a third party's BIND, (writes,) completion on a room of its own id. */
static void forged_room(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx, kvt_rank_t *dst,
                        uint64_t id, bool write)
{
    const char *what = write ? "forged writes and completion" : "forged completion";
    room_pages_t rp;
    pages_make(src, dst, id, &rp);
    kvt_copy_t expect;
    kvt_copy_make(dst, &expect);
    kvw_receiver_h rcv = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .pages = rp.dp.side};
    CHECK(kvw_receiver_create(dctx, id, 0, &rcv) == KVW_OK && kvw_receiver_post(rcv, &post) ==
              KVW_OK, "%s", kvw_last_error());
    uint8_t nonce[32];
    uint32_t peer = decode_peer(dctx, nonce);
    CHECK(peer != UINT32_MAX, "no registered prefill peer");
    kvw_chunk_t c = {.field_mask = KVW_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                     .chunk_end = TOKENS, .last_chunk = 1};
    kvw_plan_h plan = NULL;
    CHECK(kvw__plan_create(src->h, dst->h, &c, &rp.sp.side, &rp.dp.side, &plan) == KVW_OK,
          "plan: %s", kvw_last_error());
    struct kvw_ctx *dc = dctx;
    pthread_mutex_lock(&dc->mu);
    uint64_t foreign0 = dc->foreign_writes, forged_puts = 0;
    pthread_mutex_unlock(&dc->mu);
    forger_t f;
    if (plan && forger_open(&f, dctx) == 0) {
        forger_bind(&f, peer, nonce);
        f.room = id;
        if (write)
            CHECK(kvw_plan_expand(plan, forger_run, &f) == KVW_OK && f.puts > 0,
                  "forger writes: %s", kvw_last_error());
        forged_puts = f.puts;
        forger_done(&f, id, peer, plan->bytes);
        usleep(kvt_tmo_ms(300) * 1000);
        kvw_room_state_t s = kvw_room_poll(kvw_receiver_room(rcv));
        CHECK(s == KVW_ROOM_WAITING_FOR_INPUT, "%s: the room is %s (%s), expected it to wait "
              "for its sender", what, kvw_room_state_string(s),
              kvw_room_failure(kvw_receiver_room(rcv)));
    }
    /* The forger's writes are refused in order, before the completion behind them. */
    for (uint64_t t0 = kvt_now_ns(); kvt_now_ns() - t0 < DEADLINE_NS; usleep(2000)) {
        pthread_mutex_lock(&dc->mu);
        bool all = dc->foreign_writes - foreign0 >= forged_puts;
        pthread_mutex_unlock(&dc->mu);
        if (all)
            break;
    }
    forger_close(&f);
    kvw_plan_destroy(plan);
    /* The real sender. */
    kvw_sender_h snd = NULL;
    kvw_send_chunk_t sc = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                           .chunk_end = TOKENS, .last_chunk = 1, .pages = rp.sp.side};
    CHECK(kvw_sender_create(pctx, id, &snd) == KVW_OK && kvw_sender_send(snd, &sc) == KVW_OK,
          "%s", kvw_last_error());
    kvw_room_state_t s = ip_wait_recv(rcv, DEADLINE_NS);
    CHECK(s == KVW_ROOM_SUCCESS, "%s, then the real sender: %s (%s)", what,
          kvw_room_state_string(s), kvw_room_failure(kvw_receiver_room(rcv)));
    ip_ref(&model, src, 1, &rp.sp.side, dst, &rp.dp.side, expect.data, TOKENS, NULL);
    ip_verify(dst, &expect, write ? "after forged writes: " : "after a forged completion: ");
    struct kvw_ctx *d = dctx;
    pthread_mutex_lock(&d->mu);
    uint64_t foreign = d->foreign_writes - foreign0;
    pthread_mutex_unlock(&d->mu);
    CHECK(foreign == (write ? forged_puts : 0), "%s: %llu writes refused as foreign, the third "
          "party made %llu", what, (unsigned long long)foreign, (unsigned long long)forged_puts);
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));
    kvt_copy_free(&expect);
    kvt_req_pages_free(&rp.sp);
    kvt_req_pages_free(&rp.dp);
}

/* Case 3: STAGE_ASK from the room's own prefill rank once the room is at Success. */
static void stage_ask_after_success(kvw_ctx_h pctx, kvt_rank_t *src, kvw_ctx_h dctx,
                                    kvt_rank_t *dst)
{
    struct kvw_ctx *p = pctx, *d = dctx;
    room_pages_t rp;
    pages_make(src, dst, 31, &rp);
    kvw_receiver_h rcv = NULL;
    kvw_sender_h snd = NULL;
    kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = TOKENS,
                            .pages = rp.dp.side};
    kvw_send_chunk_t sc = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = TOKENS,
                           .chunk_end = TOKENS, .last_chunk = 1, .pages = rp.sp.side};
    CHECK(kvw_receiver_create(dctx, 31, 0, &rcv) == KVW_OK && kvw_receiver_post(rcv, &post) ==
              KVW_OK && kvw_sender_create(pctx, 31, &snd) == KVW_OK &&
              kvw_sender_send(snd, &sc) == KVW_OK, "%s", kvw_last_error());
    kvw_room_state_t s = ip_wait_recv(rcv, DEADLINE_NS);
    CHECK(s == KVW_ROOM_SUCCESS, "room 31: %s (%s)", kvw_room_state_string(s),
          kvw_room_failure(kvw_receiver_room(rcv)));
    pthread_mutex_lock(&d->mu);
    uint64_t area = d->stage.len;
    uint32_t spans0 = d->stage.num_spans;
    pthread_mutex_unlock(&d->mu);
    CHECK(area > 0 && spans0 == 0, "staging area %llu bytes, %u spans before the ask",
          (unsigned long long)area, spans0);
    /* The prefill rank's own session sends it (tagged, in sequence). */
    pthread_mutex_lock(&p->mu);
    for (uint32_t i = 0; i < kvw__peer_count(p); i++) {
        kvw_peer_t *pp = kvw__peer_at(p, i);
        if (pp->dead)
            continue;
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
        kvw__wb_u64(&w, 31);
        kvw__wb_u64(&w, area);
        kvw__peer_send(p, pp, &w);
    }
    pthread_mutex_unlock(&p->mu);
    usleep(kvt_tmo_ms(300) * 1000);
    pthread_mutex_lock(&d->mu);
    uint32_t spans = d->stage.num_spans, waits = d->stage.num_waits;
    pthread_mutex_unlock(&d->mu);
    CHECK(spans == 0 && waits == 0, "a STAGE_ASK for a room at Success left %u staging spans "
          "and %u waiters", spans, waits);
    kvw_room_destroy(kvw_sender_room(snd));
    kvw_room_destroy(kvw_receiver_room(rcv));
    pthread_mutex_lock(&d->mu);
    spans = d->stage.num_spans;
    pthread_mutex_unlock(&d->mu);
    CHECK(spans == 0, "%u staging spans after the room left", spans);
    kvt_req_pages_free(&rp.sp);
    kvt_req_pages_free(&rp.dp);
    /* The whole area is still there: a staged room succeeds with verified bytes. */
    setenv("KVW_PATH", "staged", 1);
    ip_room_t room = {.id = 32, .tokens = TOKENS, .seed = 32, .deadline_ns = DEADLINE_NS,
                      .what = "staged room after the refused ask"};
    ip_room_verified(&model, pctx, src, dctx, dst, &room);
    unsetenv("KVW_PATH");
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_auth_dataplane", &model))
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
    CHECK(make_ctx(&src, true, "127.0.0.1:0", &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    CHECK(make_ctx(&dst, false, bs, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (dctx == NULL)
        return 1;

    forged_room(pctx, &src, dctx, &dst, 11, false);
    kvt_rank_fill(&dst, 4);
    forged_room(pctx, &src, dctx, &dst, 12, true);
    kvt_rank_fill(&dst, 4);
    stage_ask_after_success(pctx, &src, dctx, &dst);
    kvw_ctx_destroy(dctx);
    dctx = NULL;

    /* 4. A genuine entry that is not the rank's own: the same address under a fresh
     * nonce, as a stale registration of this rank would be. */
    kvw_bs_entry_t *e = NULL;
    uint32_t n = 0;
    CHECK(kvw__bootstrap_lookup(bs, 1, 1, 1, "alpha", kvw__now_ns() + kvt_tmo_ns(5000000000ull),
                                &e, &n) == KVW_OK && n == 1,
          "lookup: %s", kvw_last_error());
    if (n == 1) {
        kvw_bs_entry_t f = e[0];
        CHECK(kvw__bootstrap_register(bs, &f, "alpha", kvw__now_ns() + kvt_tmo_ns(5000000000ull)) ==
                  KVW_OK && memcmp(f.nonce, e[0].nonce, 32) != 0,
              "re-registration: %s", kvw_last_error());
        kvw_status_t st = make_ctx(&dst, false, bs, &dctx);
        CHECK(st == KVW_ERR_AUTH && kvt_contains(kvw_last_error(), "not this rank's own"),
              "a decode through an entry that is not the rank's own: %s: %s",
              kvw_status_string(st), kvw_last_error());
        if (dctx)
            kvw_ctx_destroy(dctx);
    }
    free(e);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_auth_dataplane");
}
