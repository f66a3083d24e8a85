/*
 * Authenticated bootstrap registrations and entries (shared secret "alpha"), against
 * hostile clients and a hostile endpoint, on loopback:
 *  1. An endpoint with the secret refuses, with a reason to the registrant: a
 *     registration without a MAC, one under another secret, a valid MAC over a changed
 *     address, one declaring another geometry (it would replace the instance), and a
 *     captured registration replayed (unchanged, with another address, on its own
 *     connection again, or on a new one). Only the honest entry is served.
 *  2. An endpoint without the secret still refuses replays; an unsigned entry it serves
 *     is refused by a decode with the secret, naming the rank.
 *  3. A hostile endpoint serving a forged entry (no MAC, another secret's MAC, a
 *     genuine entry with its address changed): a decode context with the secret fails
 *     with AUTH naming the endpoint, the rank and the address, and never connects there;
 *     so does a room of a decode context that names that endpoint per room.
 *  4. Honest contexts (prefill and decode with the secret, a standalone endpoint started
 *     through kvw_bootstrap_start_ex with it) move a verified room; a prefill rank
 *     without the secret, or with another, cannot register there.
 *  5. One-shot entries expire (a short TTL set here); held ones stay.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include "proto/proto.h"

#include <kvwire/xfer.h>

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SEC 1000000000ull

static kvt_model_t model;

/* ---------------------------------------------------------------- hostile client */

/* A raw connection to a bootstrap endpoint "host:port"; -1 on failure. */
static int bs_open(const char *addr)
{
    char host[128];
    uint16_t port;
    int fd = -1;
    if (kvw__parse_hostport(addr, host, sizeof(host), &port) != KVW_OK ||
        kvw__tcp_connect(host, port, kvt_now_ns() + kvt_tmo_ns(5 * SEC), &fd) != KVW_OK)
        return -1;
    return fd;
}

/* Sends the frame in w (freed) and reads the answer: its type (0 when none came) and, for
 * an error answer, its status and reason. */
static uint8_t bs_ask(int fd, kvw_wbuf_t *w, uint8_t *payload, uint32_t *len,
                      kvw_status_t *code, char *why, size_t cap)
{
    uint8_t type = 0, *p = NULL;
    uint32_t n = 0;
    uint64_t deadline = kvt_now_ns() + kvt_tmo_ns(5 * SEC);
    if (kvw__wb_finish(w) != KVW_OK || kvw__sock_send_all(fd, w->p, w->len, deadline) != KVW_OK ||
        kvw__sock_recv_frame(fd, deadline, &type, &p, &n) != KVW_OK)
        type = 0;
    kvw__wb_free(w);
    if (type == KVW_MSG_BS_ERROR && code && why) {
        kvw_rbuf_t r;
        kvw__rb_init(&r, p, n);
        *code = (kvw_status_t)(int32_t)kvw__rb_u32(&r);
        kvw__rb_str(&r, why, cap);
    }
    if (payload && len) {
        *len = n < *len ? n : *len;
        memcpy(payload, p, *len);
    }
    free(p);
    return type;
}

/* The endpoint's challenge to this connection; false if none came. */
static bool bs_challenge(int fd, uint8_t nonce[32])
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_BS_CHALLENGE);
    uint32_t len = 32;
    return bs_ask(fd, &w, nonce, &len, NULL, NULL, 0) == KVW_MSG_BS_CHALLENGE && len == 32;
}

/* Sends a registration of `e` exactly as given (nonce, MAC and flag included). Returns
 * KVW_OK on BS_OK, the error answer's status (reason in why), or KVW_ERR_IO. */
static kvw_status_t bs_send_entry(int fd, const kvw_bs_entry_t *e, char *why, size_t cap)
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_BS_REGISTER);
    kvw__bootstrap_put_entry(&w, e);
    kvw_status_t code = KVW_ERR_IO;
    why[0] = 0;
    uint8_t t = bs_ask(fd, &w, NULL, NULL, &code, why, cap);
    return t == KVW_MSG_BS_OK ? KVW_OK : t == KVW_MSG_BS_ERROR ? code : KVW_ERR_IO;
}

/* How many entries the endpoint serves now (-1 on error). */
static int bs_count(const char *addr)
{
    int fd = bs_open(addr);
    if (fd < 0)
        return -1;
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_BS_LOOKUP);
    uint8_t p[4];
    uint32_t len = 4;
    uint8_t t = bs_ask(fd, &w, p, &len, NULL, NULL, 0);
    close(fd);
    if (t != KVW_MSG_BS_TABLE || len < 4)
        return -1;
    return (int)(p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24);
}

static kvw_bs_entry_t tp1_entry(const char *addr)
{
    kvw_bs_entry_t e = {.dp_size = 1, .tp_size = 1, .pp_size = 1};
    snprintf(e.addr, sizeof(e.addr), "%s", addr);
    return e;
}

/* Expects a refusal `want` whose reason holds both needles. */
static void expect(kvw_status_t st, const char *why, kvw_status_t want, const char *what,
                   const char *n1, const char *n2)
{
    CHECK(st == want, "%s: got %s (%s), want %s", what, kvw_status_string(st), why,
          kvw_status_string(want));
    CHECK(kvt_contains(why, n1) && (n2 == NULL || kvt_contains(why, n2)),
          "%s: reason lacks '%s'/'%s': %s", what, n1, n2 ? n2 : "", why);
}

/* ---------------------------------------------------------------- 1, 2: endpoints */

static void hostile_registrations(void)
{
    kvw_bootstrap_t *bs = NULL;
    CHECK(kvw__bootstrap_start("127.0.0.1", 0, "alpha", &bs) == KVW_OK, "%s", kvw_last_error());
    if (bs == NULL)
        return;
    char addr[128], why[512];
    snprintf(addr, sizeof(addr), "%s", kvw__bootstrap_addr(bs));
    uint64_t dl = kvt_now_ns() + kvt_tmo_ns(5 * SEC);

    /* Through the library: no secret, another secret. */
    kvw_bs_entry_t e = tp1_entry("127.0.0.1:20001");
    kvw_status_t st = kvw__bootstrap_register(addr, &e, NULL, dl);
    expect(st, kvw_last_error(), KVW_ERR_AUTH, "registration without a secret",
           "rank dp0/tp0/pp0 at 127.0.0.1:20001 refused", "carries no MAC");
    st = kvw__bootstrap_register(addr, &e, "beta", dl);
    expect(st, kvw_last_error(), KVW_ERR_AUTH, "registration under another secret",
           "rank dp0/tp0/pp0", "does not match this endpoint's shared secret");
    int fd = -1;
    st = kvw__bootstrap_hold(addr, &e, "beta", dl, &fd);
    expect(st, kvw_last_error(), KVW_ERR_AUTH, "held registration under another secret",
           "does not match", NULL);
    CHECK(fd < 0, "a refused hold kept its connection");
    CHECK(bs_count(addr) == 0, "refused registrations entered the table");

    /* A valid MAC over a changed address. */
    fd = bs_open(addr);
    uint8_t nonce[32];
    CHECK(fd >= 0 && bs_challenge(fd, nonce), "no challenge");
    kvw_bs_entry_t f = tp1_entry("127.0.0.1:20001");
    memcpy(f.nonce, nonce, 32);
    f.has_mac = true;
    kvw__bootstrap_entry_mac("alpha", &f, f.mac);
    snprintf(f.addr, sizeof(f.addr), "127.0.0.1:6666");
    expect(bs_send_entry(fd, &f, why, sizeof(why)), why, KVW_ERR_AUTH,
           "MAC over another address", "does not match", NULL);
    close(fd);

    /* An honest registration on the wire (what an eavesdropper captures)... */
    fd = bs_open(addr);
    CHECK(fd >= 0 && bs_challenge(fd, nonce), "no challenge");
    kvw_bs_entry_t h = tp1_entry("127.0.0.1:20001");
    memcpy(h.nonce, nonce, 32);
    h.has_mac = true;
    kvw__bootstrap_entry_mac("alpha", &h, h.mac);
    st = bs_send_entry(fd, &h, why, sizeof(why));
    CHECK(st == KVW_OK, "honest raw registration: %s: %s", kvw_status_string(st), why);
    /* ... replayed on the same connection (its challenge is spent) ... */
    expect(bs_send_entry(fd, &h, why, sizeof(why)), why, KVW_ERR_AUTH,
           "replay on the same connection", "replayed registration", NULL);
    close(fd);
    /* ... on a new connection, unchanged and with another address ... */
    kvw_bs_entry_t moved = h;
    snprintf(moved.addr, sizeof(moved.addr), "127.0.0.1:6666");
    fd = bs_open(addr);
    expect(bs_send_entry(fd, &h, why, sizeof(why)), why, KVW_ERR_AUTH,
           "replay on a new connection", "replayed registration", NULL);
    expect(bs_send_entry(fd, &moved, why, sizeof(why)), why, KVW_ERR_AUTH,
           "replay with another address", "replayed registration", NULL);
    /* ... and after asking for a challenge of its own: the old nonce is still refused,
     * the new nonce under the old MAC does not match. */
    CHECK(bs_challenge(fd, nonce), "no challenge");
    expect(bs_send_entry(fd, &moved, why, sizeof(why)), why, KVW_ERR_AUTH,
           "replay beside a fresh challenge", "replayed registration", NULL);
    CHECK(bs_challenge(fd, nonce), "no challenge");
    memcpy(moved.nonce, nonce, 32);
    expect(bs_send_entry(fd, &moved, why, sizeof(why)), why, KVW_ERR_AUTH,
           "old MAC over a fresh challenge", "does not match", NULL);
    close(fd);

    /* A forged registration declaring another geometry would replace the whole
     * instance: refused before it can. */
    kvw_bs_entry_t wipe = {.tp = 1, .tp_size = 2, .dp_size = 1, .pp_size = 1};
    snprintf(wipe.addr, sizeof(wipe.addr), "127.0.0.1:6666");
    fd = bs_open(addr);
    expect(bs_send_entry(fd, &wipe, why, sizeof(why)), why, KVW_ERR_AUTH,
           "unsigned registration of another geometry", "rank dp0/tp1/pp0", "carries no MAC");
    close(fd);

    /* Only the honest entry is served, and it verifies. */
    kvw_bs_entry_t *tab = NULL;
    uint32_t n = 0;
    st = kvw__bootstrap_lookup(addr, 1, 1, 1, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC), &tab,
                               &n);
    CHECK(st == KVW_OK && n == 1 && !strcmp(tab[0].addr, "127.0.0.1:20001"),
          "lookup after hostile registrations: %s: %s (%s)", kvw_status_string(st),
          kvw_last_error(), st == KVW_OK && n ? tab[0].addr : "-");
    free(tab);
    /* The library's own registration goes in and replaces it. */
    e = tp1_entry("127.0.0.1:20002");
    st = kvw__bootstrap_register(addr, &e, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC));
    CHECK(st == KVW_OK, "signed registration: %s", kvw_last_error());
    tab = NULL;
    st = kvw__bootstrap_lookup(addr, 1, 1, 1, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC), &tab,
                               &n);
    CHECK(st == KVW_OK && n == 1 && !strcmp(tab[0].addr, "127.0.0.1:20002"),
          "lookup after the signed registration: %s", kvw_last_error());
    free(tab);
    kvw__bootstrap_stop(bs);

    /* 2. No secret at the endpoint: it takes unsigned entries (decodes with the secret
     * refuse them) and still refuses replays. */
    bs = NULL;
    CHECK(kvw__bootstrap_start("127.0.0.1", 0, NULL, &bs) == KVW_OK, "%s", kvw_last_error());
    if (bs == NULL)
        return;
    snprintf(addr, sizeof(addr), "%s", kvw__bootstrap_addr(bs));
    fd = bs_open(addr);
    expect(bs_send_entry(fd, &h, why, sizeof(why)), why, KVW_ERR_AUTH,
           "replay at an endpoint without the secret", "replayed registration", NULL);
    close(fd);
    e = tp1_entry("127.0.0.1:6666");
    st = kvw__bootstrap_register(addr, &e, NULL, kvt_now_ns() + kvt_tmo_ns(5 * SEC));
    CHECK(st == KVW_OK, "unsigned registration without a secret: %s", kvw_last_error());
    st = kvw__bootstrap_lookup(addr, 1, 1, 1, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC), &tab,
                               &n);
    expect(st, kvw_last_error(), KVW_ERR_AUTH, "unsigned entry looked up with the secret",
           "the entry of prefill rank dp0/tp0/pp0 (address 127.0.0.1:6666) carries no MAC",
           "not connecting to it");
    /* Signed entries pass through an endpoint that cannot check them. */
    e = tp1_entry("127.0.0.1:20003");
    st = kvw__bootstrap_register(addr, &e, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC));
    CHECK(st == KVW_OK, "signed registration at an endpoint without the secret: %s",
          kvw_last_error());
    tab = NULL;
    st = kvw__bootstrap_lookup(addr, 1, 1, 1, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC), &tab,
                               &n);
    CHECK(st == KVW_OK && n == 1 && !strcmp(tab[0].addr, "127.0.0.1:20003"),
          "signed entry through an endpoint without the secret: %s", kvw_last_error());
    free(tab);
    kvw__bootstrap_stop(bs);
}

/* ---------------------------------------------------------------- 3: hostile endpoint */

typedef struct fake_bs {
    int listen_fd;
    char addr[64];
    kvw_bs_entry_t entry; /* the one entry it serves */
    pthread_mutex_t mu;
    atomic_bool stop;
    pthread_t thread;
} fake_bs_t;

static void *fake_main(void *arg)
{
    fake_bs_t *f = arg;
    while (!atomic_load(&f->stop)) {
        struct pollfd pf = {.fd = f->listen_fd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0)
            continue;
        int fd = accept(f->listen_fd, NULL, NULL);
        if (fd < 0)
            continue;
        uint8_t type, *p = NULL;
        uint32_t len;
        uint64_t dl = kvt_now_ns() + kvt_tmo_ns(5 * SEC);
        if (kvw__sock_recv_frame(fd, dl, &type, &p, &len) == KVW_OK &&
            type == KVW_MSG_BS_LOOKUP) {
            kvw_wbuf_t w;
            kvw__wb_init(&w, KVW_MSG_BS_TABLE);
            kvw__wb_u32(&w, 1);
            pthread_mutex_lock(&f->mu);
            kvw__bootstrap_put_entry(&w, &f->entry);
            pthread_mutex_unlock(&f->mu);
            if (kvw__wb_finish(&w) == KVW_OK)
                kvw__sock_send_all(fd, w.p, w.len, dl);
            kvw__wb_free(&w);
        }
        free(p);
        close(fd);
    }
    return NULL;
}

static kvw_status_t make_decode(kvt_rank_t *r, const char *bs, kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = ip_params(KVW_SIDE_DECODE, r, "tcp", bs, false);
    if (bs == NULL)
        p.field_mask &= ~(uint64_t)KVW_CTX_FIELD_BOOTSTRAP;
    p.field_mask |= KVW_CTX_FIELD_SECRET;
    p.secret = "alpha";
    p.bootstrap_timeout_ms = kvt_tmo_ms(3000);
    p.wait_timeout_ms = kvt_tmo_ms(5000);
    *ctx = NULL;
    return kvw_ctx_create(&p, ctx);
}

/* A connection waiting on the attacker's listener, i.e. someone came. */
static bool came(int lfd)
{
    struct pollfd pf = {.fd = lfd, .events = POLLIN};
    return poll(&pf, 1, 0) > 0;
}

static void hostile_endpoint(void)
{
    kvt_rank_t dst = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK, "%s", kvw_last_error());
    /* The attacker's control address: a listener nobody should ever connect to. */
    int evil = -1;
    uint16_t evil_port = 0;
    CHECK(kvw__tcp_listen("127.0.0.1", 0, &evil, &evil_port) == KVW_OK, "%s", kvw_last_error());
    char evil_addr[64];
    snprintf(evil_addr, sizeof(evil_addr), "127.0.0.1:%u", evil_port);

    fake_bs_t f = {.listen_fd = -1};
    uint16_t port = 0;
    CHECK(kvw__tcp_listen("127.0.0.1", 0, &f.listen_fd, &port) == KVW_OK, "%s",
          kvw_last_error());
    snprintf(f.addr, sizeof(f.addr), "127.0.0.1:%u", port);
    pthread_mutex_init(&f.mu, NULL);
    if (evil < 0 || f.listen_fd < 0 || pthread_create(&f.thread, NULL, fake_main, &f) != 0) {
        CHECK(0, "cannot start the hostile endpoint");
        kvt_rank_free(&dst);
        return;
    }

    /* A genuine entry of a real endpoint, to be tampered with. */
    kvw_bootstrap_t *real = NULL;
    kvw_bs_entry_t genuine = {0}, *tab = NULL;
    uint32_t n = 0;
    CHECK(kvw__bootstrap_start("127.0.0.1", 0, "alpha", &real) == KVW_OK, "%s", kvw_last_error());
    kvw_bs_entry_t e = tp1_entry("127.0.0.1:20004");
    CHECK(real && kvw__bootstrap_register(kvw__bootstrap_addr(real), &e, "alpha",
                                          kvt_now_ns() + kvt_tmo_ns(5 * SEC)) == KVW_OK &&
              kvw__bootstrap_lookup(kvw__bootstrap_addr(real), 1, 1, 1, "alpha",
                                    kvt_now_ns() + kvt_tmo_ns(5 * SEC), &tab, &n) == KVW_OK &&
              n == 1,
          "genuine entry: %s", kvw_last_error());
    if (tab)
        genuine = tab[0];
    free(tab);
    kvw__bootstrap_stop(real);

    struct {
        const char *what, *needle;
    } cases[3] = {{"no MAC", "carries no MAC"},
                  {"another secret's MAC", "does not match the shared secret"},
                  {"a genuine entry re-pointed", "does not match the shared secret"}};
    for (int k = 0; k < 3; k++) {
        kvw_bs_entry_t forged = tp1_entry(evil_addr);
        if (k == 1) {
            forged.has_mac = true;
            memset(forged.nonce, 7, sizeof(forged.nonce));
            kvw__bootstrap_entry_mac("beta", &forged, forged.mac);
        } else if (k == 2) {
            forged = genuine;
            snprintf(forged.addr, sizeof(forged.addr), "%s", evil_addr);
        }
        pthread_mutex_lock(&f.mu);
        f.entry = forged;
        pthread_mutex_unlock(&f.mu);
        char what[96];
        snprintf(what, sizeof(what), "hostile endpoint, %s", cases[k].what);
        kvw_ctx_h dctx = NULL;
        kvw_status_t st = make_decode(&dst, f.addr, &dctx);
        expect(st, kvw_last_error(), KVW_ERR_AUTH, what, "dp0/tp0/pp0", cases[k].needle);
        char want[256];
        snprintf(want, sizeof(want), "bootstrap %s: the entry of prefill rank dp0/tp0/pp0 "
                 "(address %s)", f.addr, evil_addr);
        CHECK(kvt_contains(kvw_last_error(), want), "%s: message lacks '%s': %s", what, want,
              kvw_last_error());
        if (st == KVW_OK)
            kvw_ctx_destroy(dctx);
        CHECK(!came(evil), "%s: the decode connected to the forged address", what);
    }

    /* A room naming the hostile endpoint fails with the reason; nobody connects there. */
    kvw_ctx_h dctx = NULL;
    kvw_status_t st = make_decode(&dst, NULL, &dctx);
    CHECK(st == KVW_OK, "decode without a bootstrap: %s", kvw_last_error());
    if (st == KVW_OK) {
        kvw_receiver_h rv = NULL;
        st = kvw_receiver_create_from(dctx, 5, f.addr, 0, &rv);
        if (st == KVW_OK) {
            kvw_room_state_t s = ip_wait_recv(rv, kvt_tmo_ns(5 * SEC));
            const char *why = kvw_room_failure(kvw_receiver_room(rv));
            CHECK(s == KVW_ROOM_FAILED && why && kvt_contains(why, "dp0/tp0/pp0") &&
                      kvt_contains(why, "not connecting to it"),
                  "room naming a hostile endpoint: %s: %s", kvw_room_state_string(s),
                  why ? why : "-");
            kvw_room_destroy(kvw_receiver_room(rv));
        } else {
            CHECK(kvt_contains(kvw_last_error(), "not connecting to it"),
                  "room naming a hostile endpoint refused at creation: %s", kvw_last_error());
        }
        kvw_ctx_destroy(dctx);
    }
    CHECK(!came(evil), "a room's connection went to the forged address");

    atomic_store(&f.stop, true);
    pthread_join(f.thread, NULL);
    pthread_mutex_destroy(&f.mu);
    close(f.listen_fd);
    close(evil);
    kvt_rank_free(&dst);
}

/* ---------------------------------------------------------------- 4: honest contexts */

static kvw_status_t make_prefill(kvt_rank_t *r, const char *bs, const char *secret,
                                 kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, r, "tcp", bs, false);
    if (secret) {
        p.field_mask |= KVW_CTX_FIELD_SECRET;
        p.secret = secret;
    }
    p.bootstrap_timeout_ms = kvt_tmo_ms(3000);
    p.wait_timeout_ms = kvt_tmo_ms(5000);
    *ctx = NULL;
    return kvw_ctx_create(&p, ctx);
}

static void honest_contexts(void)
{
    kvw_bootstrap_params_t bp = {.field_mask = KVW_BOOTSTRAP_FIELD_ADDR |
                                               KVW_BOOTSTRAP_FIELD_SECRET,
                                 .addr = "127.0.0.1:0", .secret = "alpha"};
    kvw_bootstrap_h bs = NULL;
    CHECK(kvw_bootstrap_start_ex(&bp, &bs) == KVW_OK, "%s", kvw_last_error());
    if (bs == NULL)
        return;
    char addr[128];
    snprintf(addr, sizeof(addr), "%s", kvw_bootstrap_address(bs));
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&src, 3);
    kvt_rank_fill(&dst, 4);

    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_status_t st = make_prefill(&src, addr, NULL, &pctx);
    expect(st, kvw_last_error(), KVW_ERR_AUTH, "prefill without the secret",
           "carries no MAC and this endpoint requires the shared secret", NULL);
    if (st == KVW_OK)
        kvw_ctx_destroy(pctx);
    st = make_prefill(&src, addr, "beta", &pctx);
    expect(st, kvw_last_error(), KVW_ERR_AUTH, "prefill under another secret",
           "does not match this endpoint's shared secret", NULL);
    if (st == KVW_OK)
        kvw_ctx_destroy(pctx);

    st = make_prefill(&src, addr, "alpha", &pctx);
    CHECK(st == KVW_OK, "honest prefill: %s", kvw_last_error());
    if (st == KVW_OK) {
        st = make_decode(&dst, addr, &dctx);
        CHECK(st == KVW_OK, "honest decode: %s", kvw_last_error());
        if (st == KVW_OK) {
            ip_room_t room = {.id = 9, .tokens = 40, .seed = 9,
                              .deadline_ns = kvt_tmo_ns(10 * SEC),
                              .what = "honest room"};
            ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
            kvw_ctx_destroy(dctx);
        }
        kvw_ctx_destroy(pctx);
    }
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    kvw_bootstrap_stop(bs);
}

/* ---------------------------------------------------------------- 5: expiry */

static void oneshot_expiry(void)
{
    kvw_bootstrap_t *bs = NULL;
    CHECK(kvw__bootstrap_start("127.0.0.1", 0, "alpha", &bs) == KVW_OK, "%s", kvw_last_error());
    if (bs == NULL)
        return;
    kvw__bootstrap_set_ttl(bs, 300);
    char addr[128];
    snprintf(addr, sizeof(addr), "%s", kvw__bootstrap_addr(bs));
    kvw_bs_entry_t one = {.tp = 0, .tp_size = 2, .dp_size = 1, .pp_size = 1};
    kvw_bs_entry_t held = {.tp = 1, .tp_size = 2, .dp_size = 1, .pp_size = 1};
    snprintf(one.addr, sizeof(one.addr), "127.0.0.1:20005");
    snprintf(held.addr, sizeof(held.addr), "127.0.0.1:20006");
    int hfd = -1;
    uint64_t dl = kvt_now_ns() + kvt_tmo_ns(5 * SEC);
    CHECK(kvw__bootstrap_register(addr, &one, "alpha", dl) == KVW_OK &&
              kvw__bootstrap_hold(addr, &held, "alpha", dl, &hfd) == KVW_OK,
          "%s", kvw_last_error());
    int before = bs_count(addr);
    usleep(600000);
    int after = bs_count(addr);
    CHECK(before == 2 && after == 1, "entries: %d before the TTL, %d after (want 2, 1)", before,
          after);
    /* Registering again restarts the clock. */
    CHECK(kvw__bootstrap_register(addr, &one, "alpha", kvt_now_ns() + kvt_tmo_ns(5 * SEC)) ==
              KVW_OK,
          "%s", kvw_last_error());
    CHECK(bs_count(addr) == 2, "a re-registration did not come back");
    if (hfd >= 0)
        close(hfd);
    kvw__bootstrap_stop(bs);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_bootstrap_auth", &model))
        return 1;
    hostile_registrations();
    printf("hostile registrations refused\n");
    hostile_endpoint();
    printf("forged entries refused by the decode\n");
    honest_contexts();
    printf("honest contexts move a verified room\n");
    oneshot_expiry();
    printf("one-shot entries expire\n");
    return ip_summary("test_bootstrap_auth");
}
