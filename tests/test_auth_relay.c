/*
 * With a shared secret, the handshake MACs bind the whole transcript and every later
 * control frame carries a session tag: a relay between a decode and a prefill rank can
 * neither alter the registration nor inject frames.
 *
 * Setup (one process, tcp): prefill TP1 with secret "alpha" hosting its bootstrap; a
 * relay thread listens on its own port; a registration signed with the secret re-points
 * the prefill rank's entry at the relay (standing for a redirect on the network: the
 * table itself is authenticated, test_bootstrap_auth), so the decode connects through
 * the relay, which forwards to the real control port.
 *   1. The relay flips one byte of the registration body (the decode's identity and
 *      data address live there): the prefill refuses it (AUTH), the decode fails.
 *   2. The relay forwards the handshake untouched and, once the room is posted, injects
 *      a frame towards the decode: the decode drops the connection and the room fails
 *      naming the session authentication, never Success.
 *   3. No tampering: the relayed session moves a room whose bytes match the reference.
 */
#include "testkit.h"
#include "inproc.h"

#include "core/sha256.h"
#include "proto/proto.h"

#include <kvwire/xfer.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>


static kvt_model_t model;

enum { MODE_TAMPER_HELLO = 1, MODE_INJECT = 2, MODE_CLEAN = 3 };

typedef struct relay {
    int listen_fd;
    uint16_t port;
    char target[128]; /* the real control port, host:port */
    int mode;
    atomic_bool stop;
    atomic_bool inject; /* MODE_INJECT: write the forged frame now */
    pthread_t thread;
} relay_t;

#define RELAY_IO_NS kvt_tmo_ns(10ull * 1000000000ull) /* one frame's reads and writes, at most */

/* Moves one whole frame from `from` to `to` (the library's own socket helpers and frame
 * header reader); `tamper` flips a byte of its payload at `at`. Returns the frame type,
 * or -1. */
static int relay_frame(int from, int to, bool tamper, size_t at)
{
    uint8_t h[KVW_WIRE_HDR], type;
    uint32_t len;
    uint64_t deadline = kvw__now_ns() + RELAY_IO_NS;
    if (kvw__sock_recv_all(from, h, sizeof(h), deadline) != KVW_OK ||
        kvw__wire_header(h, &type, &len) != KVW_OK)
        return -1;
    uint8_t *p = malloc(len ? len : 1);
    if (p == NULL || kvw__sock_recv_all(from, p, len, deadline) != KVW_OK) {
        free(p);
        return -1;
    }
    if (tamper && at < len)
        p[at] ^= 0x01;
    int rc = kvw__sock_send_all(to, h, sizeof(h), deadline) != KVW_OK ||
                     kvw__sock_send_all(to, p, len, deadline) != KVW_OK
                 ? -1
                 : type;
    free(p);
    return rc;
}

/* Waits until fd is readable (10 s at most, scaled) or the relay is stopped. */
static bool relay_wait(relay_t *r, int fd)
{
    for (uint32_t i = 0; i < kvt_tmo_ms(10000) / 100 && !atomic_load(&r->stop); i++) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 100) > 0)
            return true;
    }
    return false;
}

static void *relay_main(void *arg)
{
    relay_t *r = arg;
    if (!relay_wait(r, r->listen_fd))
        return NULL;
    int dfd = accept(r->listen_fd, NULL, NULL);
    if (dfd < 0)
        return NULL;
    char host[128];
    uint16_t port;
    int pfd = -1;
    if (kvw__parse_hostport(r->target, host, sizeof(host), &port) != KVW_OK ||
        kvw__tcp_connect(host, port, kvw__now_ns() + kvt_tmo_ns(5000000000ull), &pfd) != KVW_OK) {
        close(dfd);
        return NULL;
    }
    fcntl(dfd, F_SETFL, fcntl(dfd, F_GETFL) & ~O_NONBLOCK);
    fcntl(pfd, F_SETFL, fcntl(pfd, F_GETFL) & ~O_NONBLOCK);
    /* The handshake, frame by frame: CHALLENGE, HELLO (tampered in mode 1, two bytes
     * into its body, which starts after has_mac, mac and the decode's nonce: 1 + 32 + 32
     * bytes), ACCEPT. */
    int t = relay_wait(r, pfd) ? relay_frame(pfd, dfd, false, 0) : -1;
    int h = t >= 0 && relay_wait(r, dfd)
                ? relay_frame(dfd, pfd, r->mode == MODE_TAMPER_HELLO, 1 + 32 + 32 + 2)
                : -1;
    int a = h >= 0 && relay_wait(r, pfd) ? relay_frame(pfd, dfd, false, 0) : -1;
    bool injected = false;
    /* Then plain forwarding both ways until stopped; in MODE_INJECT, once the test says
     * so (its room is posted through the session by then), a heartbeat made up by the
     * relay, without the session tag, goes to the decode rank. */
    uint8_t buf[65536];
    while (a >= 0 && !atomic_load(&r->stop)) {
        if (r->mode == MODE_INJECT && !injected && atomic_load(&r->inject)) {
            uint8_t f[KVW_WIRE_HDR] = {0x4b, 0x56, 0x57, 0x31, KVW_WIRE_VERSION,
                                       KVW_MSG_HEARTBEAT};
            kvw__sock_send_all(dfd, f, sizeof(f), kvw__now_ns() + RELAY_IO_NS);
            injected = true;
        }
        struct pollfd pf[2] = {{.fd = dfd, .events = POLLIN}, {.fd = pfd, .events = POLLIN}};
        if (poll(pf, 2, 100) <= 0)
            continue;
        bool gone = false;
        for (int i = 0; i < 2; i++) {
            if (!pf[i].revents)
                continue;
            ssize_t k = recv(pf[i].fd, buf, sizeof(buf), 0);
            if (k <= 0 ||
                kvw__sock_send_all(pf[1 - i].fd, buf, (size_t)k, kvw__now_ns() + RELAY_IO_NS))
                gone = true;
        }
        if (gone)
            break;
    }
    close(dfd);
    close(pfd);
    return NULL;
}

static int relay_start(relay_t *r, const char *target, int mode)
{
    memset(r, 0, sizeof(*r));
    snprintf(r->target, sizeof(r->target), "%s", target);
    r->mode = mode;
    if (kvw__tcp_listen("127.0.0.1", 0, &r->listen_fd, &r->port) != KVW_OK)
        return -1;
    return pthread_create(&r->thread, NULL, relay_main, r) ? -1 : 0;
}

static void relay_stop(relay_t *r)
{
    atomic_store(&r->stop, true);
    shutdown(r->listen_fd, SHUT_RDWR);
    pthread_join(r->thread, NULL);
    close(r->listen_fd);
}

/* Re-points the bootstrap entry of prefill rank dp0/tp0/pp0 (TP1) at `addr` with a
 * registration under the secret. Returns the address it replaced. The handshake binds
 * the entry a decode came through (its nonce and address) to the one the prefill rank
 * holds, so a redirected entry alone fails it (test_auth_dataplane); here the prefill
 * rank is made to hold the new entry as its own, standing for a rank that advertises an
 * address which forwards to it. */
static void forge_entry(kvw_ctx_h pctx, const char *bs, const char *addr, char *old, size_t cap)
{
    kvw_bs_entry_t *e = NULL;
    uint32_t n = 0;
    kvw_status_t st = kvw__bootstrap_lookup(bs, 1, 1, 1, "alpha",
                                            kvw__now_ns() + kvt_tmo_ns(5000000000ull), &e, &n);
    CHECK(st == KVW_OK && n == 1, "lookup: %s", kvw_last_error());
    if (n == 1 && old)
        snprintf(old, cap, "%s", e[0].addr);
    kvw_bs_entry_t f = {.dp = 0, .tp = 0, .pp = 0, .dp_size = 1, .tp_size = 1, .pp_size = 1};
    snprintf(f.addr, sizeof(f.addr), "%s", addr);
    st = kvw__bootstrap_register(bs, &f, "alpha", kvw__now_ns() + kvt_tmo_ns(5000000000ull));
    CHECK(st == KVW_OK && f.has_mac, "%s", kvw_last_error());
    struct kvw_ctx *pc = pctx;
    pthread_mutex_lock(&pc->mu);
    kvw__entry_bind(f.nonce, f.addr, pc->bs_bind);
    pc->bs_bound = true;
    pthread_mutex_unlock(&pc->mu);
    free(e);
}

static kvw_status_t make_ctx(kvt_rank_t *r, bool prefill, const char *bs, kvw_ctx_h *ctx)
{
    kvw_ctx_params_t p =
        ip_params(prefill ? KVW_SIDE_PREFILL : KVW_SIDE_DECODE, r, "tcp", bs, prefill);
    p.field_mask |= KVW_CTX_FIELD_SECRET;
    p.secret = "alpha";
    p.bootstrap_timeout_ms = kvt_tmo_ms(5000);
    p.wait_timeout_ms = kvt_tmo_ms(10000);
    return kvw_ctx_create(&p, ctx);
}

/* HMAC-SHA256 against RFC 4231 test case 2, one-shot and in parts. */
static void hmac_vectors(void)
{
    static const uint8_t want[32] = {
        0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24, 0x26, 0x08, 0x95, 0x75, 0xc7,
        0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27, 0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
    const char *msg = "what do ya want for nothing?";
    uint8_t out[32];
    kvw__hmac_sha256("Jefe", 4, msg, strlen(msg), out);
    CHECK(memcmp(out, want, 32) == 0, "HMAC-SHA256 differs from RFC 4231 case 2");
    kvw_hmac_t h;
    kvw__hmac_init(&h, "Jefe", 4);
    kvw__hmac_update(&h, msg, 7);
    kvw__hmac_update(&h, msg + 7, strlen(msg) - 7);
    kvw__hmac_final(&h, out);
    CHECK(memcmp(out, want, 32) == 0, "incremental HMAC-SHA256 differs from RFC 4231 case 2");
}

int main(void)
{
    hmac_vectors();
    kvt_model_preset("gpt-oss-120b", &model);
    kvt_model_truncate(&model, 2);
    kvt_rank_t src, dst;
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    kvt_rank_fill(&src, 3);
    kvt_rank_fill(&dst, 4);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    CHECK(make_ctx(&src, true, "127.0.0.1:0", &pctx) == KVW_OK, "%s", kvw_last_error());
    if (failures)
        return 1;
    char bs[128], ctl[128] = "";
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));

    /* 1. A tampered registration is refused. */
    relay_t r;
    CHECK(relay_start(&r, "", MODE_TAMPER_HELLO) == 0, "relay");
    char raddr[64];
    snprintf(raddr, sizeof(raddr), "127.0.0.1:%u", r.port);
    forge_entry(pctx, bs, raddr, ctl, sizeof(ctl));
    snprintf(r.target, sizeof(r.target), "%s", ctl);
    kvw_status_t st = make_ctx(&dst, false, bs, &dctx);
    CHECK(st == KVW_ERR_AUTH && kvt_contains(kvw_last_error(), "does not match"),
          "tampered registration: %s: %s", kvw_status_string(st), kvw_last_error());
    if (st == KVW_OK)
        kvw_ctx_destroy(dctx);
    relay_stop(&r);

    /* 2. A frame injected after the handshake drops the session; the room fails. */
    CHECK(relay_start(&r, ctl, MODE_INJECT) == 0, "relay");
    snprintf(raddr, sizeof(raddr), "127.0.0.1:%u", r.port);
    forge_entry(pctx, bs, raddr, NULL, 0);
    st = make_ctx(&dst, false, bs, &dctx);
    CHECK(st == KVW_OK, "relayed handshake: %s", kvw_last_error());
    if (st == KVW_OK) {
        uint32_t pg[2] = {0, 1};
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 20,
                                .pages = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                                          .full = {KVW_PAGES_FIELDS_ALL, pg, 2,
                                                   0}, .swa = {KVW_PAGES_FIELDS_ALL, pg, 2,
                                                               0}, .state_slot = -1}};
        kvw_receiver_h rv = NULL;
        CHECK(kvw_receiver_create(dctx, 7, 0, &rv) == KVW_OK, "%s", kvw_last_error());
        CHECK(kvw_receiver_post(rv, &post) == KVW_OK, "post through the relay: %s",
              kvw_last_error());
        atomic_store(&r.inject, true);
        kvw_room_state_t s = kvw_room_wait(kvw_receiver_room(rv), kvt_tmo_ms(20000));
        CHECK(s == KVW_ROOM_FAILED && kvt_contains(kvw_room_failure(kvw_receiver_room(rv)),
                                                   "authentic"),
              "room after an injected frame: %s: %s", kvw_room_state_string(s),
              kvw_room_failure(kvw_receiver_room(rv)));
        kvw_room_destroy(kvw_receiver_room(rv));
        kvw_ctx_destroy(dctx);
    }
    relay_stop(&r);

    /* 3. An honest relay (a plain TCP forwarder) changes nothing: verified bytes. */
    CHECK(relay_start(&r, ctl, MODE_CLEAN) == 0, "relay");
    snprintf(raddr, sizeof(raddr), "127.0.0.1:%u", r.port);
    forge_entry(pctx, bs, raddr, NULL, 0);
    st = make_ctx(&dst, false, bs, &dctx);
    CHECK(st == KVW_OK, "clean relay: %s", kvw_last_error());
    if (st == KVW_OK) {
        uint32_t pg[2] = {2, 3};
        kvw_side_pages_t pages = {.field_mask = KVW_SIDE_PAGES_FIELDS_ALL,
                                  .full = {KVW_PAGES_FIELDS_ALL, pg, 2,
                                           0}, .swa = {KVW_PAGES_FIELDS_ALL, pg, 2,
                                                       0}, .state_slot = -1};
        kvw_recv_post_t post = {.field_mask = KVW_RECV_POST_FIELDS_ALL, .num_tokens = 20,
                                .pages = pages};
        kvw_send_chunk_t c = {.field_mask = KVW_SEND_CHUNK_FIELDS_ALL, .num_tokens = 20,
                              .chunk_end = 20, .last_chunk = 1, .pages = pages};
        kvt_copy_t expect;
        kvt_copy_make(&dst, &expect);
        kvw_receiver_h rv = NULL;
        kvw_sender_h s = NULL;
        CHECK(kvw_receiver_create(dctx, 8, 0, &rv) == KVW_OK && kvw_receiver_post(rv, &post) == KVW_OK,
              "%s", kvw_last_error());
        CHECK(kvw_sender_create(pctx, 8, &s) == KVW_OK && kvw_sender_send(s, &c) == KVW_OK, "%s",
              kvw_last_error());
        CHECK(kvw_room_wait(kvw_receiver_room(rv), kvt_tmo_ms(20000)) == KVW_ROOM_SUCCESS, "%s",
              kvw_room_failure(kvw_receiver_room(rv)));
        CHECK(kvw_room_wait(kvw_sender_room(s), kvt_tmo_ms(20000)) == KVW_ROOM_SUCCESS, "%s",
              kvw_room_failure(kvw_sender_room(s)));
        ip_ref(&model, &src, 1, &pages, &dst, &pages, expect.data, 20, NULL);
        ip_verify(&dst, &expect, "");
        kvt_copy_free(&expect);
        kvw_room_destroy(kvw_sender_room(s));
        kvw_room_destroy(kvw_receiver_room(rv));
        kvw_ctx_destroy(dctx);
    }
    relay_stop(&r);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_auth_relay");
}
