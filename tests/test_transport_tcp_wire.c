/*
 * Hostile input against the tcp transport's receiver, from raw sockets that speak
 * (or misspeak) the wire format of src/transport/tcp/tcp_wire.h.
 *
 * Every bad connection must be dropped alone, with on_ep_error naming the problem,
 * without a byte landing outside what the frame was allowed to write; and after each
 * one a well-behaved endpoint, connected before all of them, must still get its
 * writes and notifications through. Also: check_write refusal on a raw stream (the
 * payload is discarded and the stream stays in sync), frames dribbled one byte at a
 * time, connections that stall (dropped after the timeout), and a seeded fuzz loop of
 * mutated headers.
 */
#include "timeout.h"
#include "transport/tcp/tcp_wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* A failed check ends the case (check.h). */
#define CHECK_END return 1
#define CHECK_CASE g_case
#include "check.h"

static const char *g_case = "-";
static const kvw_tl_ops_t *T;

#define REGION_ID 5
#define REGION_LEN 65536
#define GUARD 4096
#define TIMEOUT_MS kvt_tmo_ms(1500)

/* ---------------------------------------------------------------- receiver state */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t notes;
    kvw_tl_ep_h last_note_ep;
    char last_note[64];
    size_t errs;
    kvw_tl_ep_h last_err_ep;
    kvw_status_t last_err;
    char last_reason[512];
    size_t checks, runs;
    uint64_t refuse_room;
} S = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void on_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    (void)arg;
    pthread_mutex_lock(&S.mu);
    S.notes++;
    S.last_note_ep = ep;
    snprintf(S.last_note, sizeof(S.last_note), "%.*s", (int)KVW_MIN(len, (size_t)60),
             (const char *)msg);
    pthread_cond_broadcast(&S.cv);
    pthread_mutex_unlock(&S.mu);
}

static void on_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason)
{
    (void)arg;
    pthread_mutex_lock(&S.mu);
    S.errs++;
    S.last_err_ep = ep;
    S.last_err = status;
    snprintf(S.last_reason, sizeof(S.last_reason), "%s", reason);
    pthread_cond_broadcast(&S.cv);
    pthread_mutex_unlock(&S.mu);
}

static kvw_status_t check_write(void *arg, kvw_tl_ep_h ep, uint64_t room, uint64_t region,
                                uint64_t off, uint64_t len)
{
    (void)arg;
    (void)ep;
    (void)region;
    (void)off;
    (void)len;
    pthread_mutex_lock(&S.mu);
    S.checks++;
    bool refuse = room == S.refuse_room;
    pthread_mutex_unlock(&S.mu);
    return refuse ? KVW_ERR_REJECTED : KVW_OK;
}

/* The receiver asks about runs of whole PUTs at once: the same answers, counted per
 * write. */
static void check_writes(void *arg, kvw_tl_ep_h ep, const kvw_tl_write_t *w, size_t n,
                         kvw_status_t *st)
{
    pthread_mutex_lock(&S.mu);
    S.runs++;
    pthread_mutex_unlock(&S.mu);
    for (size_t i = 0; i < n; i++)
        st[i] = check_write(arg, ep, w[i].room, w[i].region_id, w[i].off, w[i].len);
}

static bool wait_counter(const size_t *c, size_t n, unsigned ms)
{
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += ms / 1000;
    dl.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&S.mu);
    while (*c < n && pthread_cond_timedwait(&S.cv, &S.mu, &dl) != ETIMEDOUT)
        ;
    bool ok = *c >= n;
    pthread_mutex_unlock(&S.mu);
    return ok;
}

static size_t get(const size_t *c)
{
    pthread_mutex_lock(&S.mu);
    size_t v = *c;
    pthread_mutex_unlock(&S.mu);
    return v;
}

/* ---------------------------------------------------------------- fixtures */

static kvw_tl_h g_rx, g_tx;
static kvw_tl_ep_h g_good;
static kvw_tl_rkey_h g_rkey;
static uint8_t g_addr[KVW_TL_MAX_ADDR];
static size_t g_addr_len;
static kvw_tcp_addr_t g_a;
static uint8_t *g_buf;    /* GUARD | region | GUARD */
static uint8_t *g_expect; /* what g_buf must hold */
static unsigned g_round;

static uint8_t *region(void)
{
    return g_buf + GUARD;
}

static int raw_connect(void)
{
    int fd = socket(g_a.family == 6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_storage ss;
    socklen_t sl = kvw_tcp_addr_sockaddr(&g_a, &ss);
    if (connect(fd, (struct sockaddr *)&ss, sl) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int send_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t r = send(fd, b, n, MSG_NOSIGNAL);
        if (r <= 0)
            return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

static int send_hdr(int fd, uint8_t type, uint64_t room, uint64_t region, uint64_t off,
                    uint64_t len)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, type, room, region, off, len);
    return send_all(fd, h, sizeof(h));
}

/* A raw connection that completed the handshake, or -1. */
static int raw_hello(void)
{
    int fd = raw_connect();
    if (fd < 0)
        return -1;
    uint8_t ack[KVW_TCP_ACK_LEN];
    size_t got = 0;
    if (send_hdr(fd, KVW_TCP_HELLO, g_a.token, 0, 0, 0) != 0)
        goto fail;
    while (got < sizeof(ack)) {
        ssize_t r = recv(fd, ack + got, sizeof(ack) - got, 0);
        if (r <= 0)
            goto fail;
        got += (size_t)r;
    }
    if (ack[5] != KVW_TCP_HELLO_ACK || kvw__le64_get(ack + 8) != g_a.token)
        goto fail;
    return fd;
fail:
    close(fd);
    return -1;
}

/* The receiver must close a dropped connection: EOF or reset within 5 s. */
static bool peer_closed(int fd)
{
    uint8_t b[256];
    for (int i = 0; i < 1000; i++) {
        ssize_t r = recv(fd, b, sizeof(b), 0);
        if (r == 0 || (r < 0 && (errno == ECONNRESET || errno == EPIPE)))
            return true;
        if (r < 0)
            return false; /* timeout */
    }
    return false;
}

/* The region and its guards hold exactly g_expect; `what` names the moment. */
static int check_memory(const char *what)
{
    if (memcmp(g_buf, g_expect, REGION_LEN + 2 * GUARD) != 0) {
        size_t i = 0;
        while (g_buf[i] == g_expect[i])
            i++;
        FAILF("%smemory differs at byte %zd of the region (%s)", what, (ssize_t)i - GUARD,
              i < GUARD || i >= GUARD + REGION_LEN ? "a guard byte" : "inside");
    }
    return 0;
}

/* After every case: the good endpoint still writes and notifies, and the region holds
 * exactly what it should, guards included. */
static int good_round(void)
{
    uint8_t data[3000];
    unsigned k = ++g_round;
    for (size_t i = 0; i < sizeof(data); i++)
        data[i] = (uint8_t)(k * 31 + i);
    uint64_t off = (k * 4099u) % (REGION_LEN - sizeof(data));
    kvw_tl_put_t p = {.src = data, .rkey = g_rkey, .dst_off = off, .len = sizeof(data)};
    size_t n0 = get(&S.notes);
    CHECK_OK(T->put(g_good, 1, &p, 1));
    char msg[32];
    int ml = snprintf(msg, sizeof(msg), "good %u", k);
    CHECK_OK(T->notify(g_good, msg, (size_t)ml));
    CHECK(wait_counter(&S.notes, n0 + 1, kvt_tmo_ms(5000)),
          "good endpoint: notification %u missing", k);
    pthread_mutex_lock(&S.mu);
    bool same = strcmp(S.last_note, msg) == 0;
    pthread_mutex_unlock(&S.mu);
    CHECK(same, "good endpoint: wrong notification (%s)", S.last_note);
    memcpy(g_expect + GUARD + off, data, sizeof(data));
    return check_memory("");
}

/* Waits for the next on_ep_error and checks it. */
static int expect_drop(size_t errs_before, kvw_status_t want, const char *substr, int fd)
{
    CHECK(wait_counter(&S.errs, errs_before + 1, kvt_tmo_ms(5000)),
          "no on_ep_error (want %s, '%s')",
          kvw_status_string(want), substr);
    pthread_mutex_lock(&S.mu);
    kvw_status_t st = S.last_err;
    char reason[512];
    snprintf(reason, sizeof(reason), "%s", S.last_reason);
    pthread_mutex_unlock(&S.mu);
    CHECK(st == want && strstr(reason, substr) != NULL, "got %s '%s', want %s '%s'",
          kvw_status_string(st), reason, kvw_status_string(want), substr);
    if (getenv("KVW_VERBOSE"))
        fprintf(stderr, "    dropped: %s\n", reason);
    if (fd >= 0)
        CHECK(peer_closed(fd), "the receiver kept the connection open: %s", "");
    return good_round();
}

/* ---------------------------------------------------------------- cases */

typedef int (*case_fn)(void);

static int c_garbage(void)
{
    int fd = raw_connect();
    CHECK(fd >= 0, "connect: %s", strerror(errno));
    uint8_t junk[100];
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (uint8_t)(i * 77 + 3);
    size_t e = get(&S.errs);
    send_all(fd, junk, sizeof(junk));
    int rc = expect_drop(e, KVW_ERR_MALFORMED, "bad frame magic", fd);
    close(fd);
    return rc;
}

static int c_wrong_token(void)
{
    int fd = raw_connect();
    CHECK(fd >= 0, "connect: %s", strerror(errno));
    size_t e = get(&S.errs);
    send_hdr(fd, KVW_TCP_HELLO, g_a.token ^ 1, 0, 0, 0);
    int rc = expect_drop(e, KVW_ERR_REJECTED, "HELLO for receiver token", fd);
    close(fd);
    return rc;
}

static int c_put_before_hello(void)
{
    int fd = raw_connect();
    CHECK(fd >= 0, "connect: %s", strerror(errno));
    size_t e = get(&S.errs);
    send_hdr(fd, KVW_TCP_PUT, 1, REGION_ID, 0, 8);
    send_all(fd, "AAAAAAAA", 8);
    int rc = expect_drop(e, KVW_ERR_MALFORMED, "expected HELLO first", fd);
    close(fd);
    return rc;
}

/* After a good HELLO, one bad header. */
static int bad_after_hello(const uint8_t *hdr, size_t n, const void *tail, size_t tail_len,
                           kvw_status_t want, const char *substr)
{
    int fd = raw_hello();
    CHECK(fd >= 0, "raw handshake failed: %s", strerror(errno));
    size_t e = get(&S.errs);
    send_all(fd, hdr, n);
    if (tail_len)
        send_all(fd, tail, tail_len);
    int rc = expect_drop(e, want, substr, fd);
    close(fd);
    return rc;
}

static int c_bad_version(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, 0, 8);
    h[4] = KVW_TCP_VERSION + 1;
    return bad_after_hello(h, sizeof(h), "BBBBBBBB", 8, KVW_ERR_MALFORMED,
                           "unsupported frame version");
}

static int c_bad_magic(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_NOTIFY, 0, 0, 0, 4);
    h[0] ^= 0xff;
    return bad_after_hello(h, sizeof(h), "CCCC", 4, KVW_ERR_MALFORMED, "bad frame magic");
}

static int c_bad_flags(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_NOTIFY, 0, 0, 0, 4);
    h[6] = 1;
    return bad_after_hello(h, sizeof(h), "DDDD", 4, KVW_ERR_MALFORMED, "unknown flags");
}

static int c_unknown_type(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, 99, 0, 0, 0, 0);
    return bad_after_hello(h, sizeof(h), NULL, 0, KVW_ERR_MALFORMED, "unknown frame type 99");
}

static int c_second_hello(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_HELLO, g_a.token, 0, 0, 0);
    return bad_after_hello(h, sizeof(h), NULL, 0, KVW_ERR_MALFORMED, "second HELLO");
}

static int c_huge_notify(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_NOTIFY, 0, 0, 0, 1ull << 40);
    return bad_after_hello(h, sizeof(h), "EEEE", 4, KVW_ERR_MALFORMED, "exceeds the limit");
}

static int c_notify_with_fields(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_NOTIFY, 7, 0, 0, 4);
    return bad_after_hello(h, sizeof(h), "FFFF", 4, KVW_ERR_MALFORMED, "non-zero");
}

static int c_put_huge_len(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, 0, UINT64_MAX);
    return bad_after_hello(h, sizeof(h), "GGGG", 4, KVW_ERR_OUT_OF_RANGE, "outside region 5");
}

/* The classic: a PUT whose offset is in range but whose end is not. None of its
 * payload may land (the guard after the region would show it). */
static int c_put_out_of_range(void)
{
    uint8_t h[KVW_TCP_HDR_LEN], payload[64];
    memset(payload, 0xee, sizeof(payload));
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, REGION_LEN - 32, sizeof(payload));
    return bad_after_hello(h, sizeof(h), payload, sizeof(payload), KVW_ERR_OUT_OF_RANGE,
                           "outside region 5");
}

static int c_put_offset_past_end(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, REGION_LEN + 1, 0);
    return bad_after_hello(h, sizeof(h), NULL, 0, KVW_ERR_OUT_OF_RANGE, "outside region 5");
}

static int c_put_wrapping(void)
{
    uint8_t h[KVW_TCP_HDR_LEN], payload[16];
    memset(payload, 0xdd, sizeof(payload));
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, UINT64_MAX - 5, sizeof(payload));
    return bad_after_hello(h, sizeof(h), payload, sizeof(payload), KVW_ERR_OUT_OF_RANGE,
                           "outside region 5");
}

static int c_put_unknown_region(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, 999, 0, 8);
    return bad_after_hello(h, sizeof(h), "HHHHHHHH", 8, KVW_ERR_OUT_OF_RANGE,
                           "unregistered region 999");
}

static int c_half_header(void)
{
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, 0, 8);
    int fd = raw_hello();
    CHECK(fd >= 0, "raw handshake failed: %s", strerror(errno));
    size_t e = get(&S.errs);
    send_all(fd, h, 17);
    close(fd);
    return expect_drop(e, KVW_ERR_MALFORMED, "truncated frame: peer closed after 17 of 40", -1);
}

/* A PUT whose payload stops half way: the connection is dropped; the bytes that did
 * arrive were inside the checked range, so the expectation includes them. */
static int c_half_payload(void)
{
    uint8_t h[KVW_TCP_HDR_LEN], payload[100];
    memset(payload, 0x11, sizeof(payload));
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, 1000, 200);
    int fd = raw_hello();
    CHECK(fd >= 0, "raw handshake failed: %s", strerror(errno));
    size_t e = get(&S.errs);
    send_all(fd, h, sizeof(h));
    send_all(fd, payload, sizeof(payload));
    close(fd);
    memcpy(g_expect + GUARD + 1000, payload, sizeof(payload));
    return expect_drop(e, KVW_ERR_MALFORMED, "100 payload bytes missing", -1);
}

/* A peer that stops in the middle of a frame, or never says HELLO, is dropped after
 * the timeout, while the good endpoint keeps working meanwhile. */
static int c_stalls(void)
{
    int fds[6];
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_PUT, 1, REGION_ID, 0, 64);
    size_t e = get(&S.errs);
    for (int i = 0; i < 6; i++) {
        fds[i] = i < 2 ? raw_connect() : raw_hello();
        CHECK(fds[i] >= 0, "connect %d: %s", i, strerror(errno));
        if (i == 1)
            send_all(fds[i], h, 10); /* part of a HELLO */
        if (i == 2) {
            uint8_t n[KVW_TCP_HDR_LEN];
            kvw_tcp_hdr_encode(n, KVW_TCP_NOTIFY, 0, 0, 0, 10);
            send_all(fds[i], n, sizeof(n)); /* a notification missing its payload */
        }
        if (i == 3)
            send_all(fds[i], h, 20); /* half a header */
        if (i == 4) {
            send_all(fds[i], h, sizeof(h)); /* a header and some payload */
            send_all(fds[i], "12345", 5);
        }
        /* i == 5: idle at a frame boundary, which is fine and must not time out */
    }
    memcpy(g_expect + GUARD, "12345", 5);
    for (int k = 0; k < 3; k++) /* stays usable during the stall */
        if (good_round() != 0)
            return 1;
    CHECK(wait_counter(&S.errs, e + 5, TIMEOUT_MS + kvt_tmo_ms(3000)),
          "only %zu of 5 stalled peers dropped",
          get(&S.errs) - e);
    pthread_mutex_lock(&S.mu);
    kvw_status_t st = S.last_err;
    pthread_mutex_unlock(&S.mu);
    CHECK(st == KVW_ERR_TIMEOUT, "status %s", kvw_status_string(st));
    for (int i = 0; i < 5; i++)
        CHECK(peer_closed(fds[i]), "stalled connection %d not closed", i);
    usleep(300000);
    CHECK(get(&S.errs) == e + 5, "an idle connection was dropped: %s", S.last_reason);
    for (int i = 0; i < 6; i++)
        close(fds[i]);
    return good_round();
}

/* check_write refuses room 66: the payload is read and discarded, the stream stays in
 * sync (a NOTIFY after it is delivered), and the connection stays up. Then an allowed
 * PUT dribbled one byte per send lands exactly. */
static int c_refused_and_dribbled(void)
{
    int fd = raw_hello();
    CHECK(fd >= 0, "raw handshake failed: %s", strerror(errno));
    size_t e = get(&S.errs), n0 = get(&S.notes), c0 = get(&S.checks);
    pthread_mutex_lock(&S.mu);
    S.refuse_room = 66;
    pthread_mutex_unlock(&S.mu);
    static uint8_t big[200000];
    memset(big, 0x99, sizeof(big));
    send_hdr(fd, KVW_TCP_PUT, 66, REGION_ID, 0, REGION_LEN); /* refused */
    send_all(fd, big, REGION_LEN);
    send_hdr(fd, KVW_TCP_PUT, 66, REGION_ID, 100, 0); /* empty: never asks check_write */
    send_hdr(fd, KVW_TCP_NOTIFY, 0, 0, 0, 9);
    send_all(fd, "raw-after", 9);
    CHECK(wait_counter(&S.notes, n0 + 1, kvt_tmo_ms(5000)),
          "notification after a refused PUT missing: %s",
          "");
    pthread_mutex_lock(&S.mu);
    bool ok = strcmp(S.last_note, "raw-after") == 0;
    S.refuse_room = 0;
    pthread_mutex_unlock(&S.mu);
    CHECK(ok, "wrong notification '%s'", S.last_note);
    CHECK(get(&S.checks) == c0 + 1, "check_write called %zu times", get(&S.checks) - c0);
    uint8_t frame[KVW_TCP_HDR_LEN + 50];
    kvw_tcp_hdr_encode(frame, KVW_TCP_PUT, 2, REGION_ID, 20000, 50);
    for (int i = 0; i < 50; i++)
        frame[KVW_TCP_HDR_LEN + i] = (uint8_t)(200 + i);
    for (size_t i = 0; i < sizeof(frame); i++) {
        CHECK(send_all(fd, frame + i, 1) == 0, "send: %s", strerror(errno));
        if (i % 7 == 0)
            usleep(200);
    }
    send_hdr(fd, KVW_TCP_NOTIFY, 0, 0, 0, 0);
    CHECK(wait_counter(&S.notes, n0 + 2, kvt_tmo_ms(5000)),
          "notification after a dribbled PUT missing%s", "");
    memcpy(g_expect + GUARD + 20000, frame + KVW_TCP_HDR_LEN, 50);
    CHECK(get(&S.errs) == e, "the raw connection was dropped: %s", S.last_reason);
    close(fd);
    CHECK(wait_counter(&S.errs, e + 1, kvt_tmo_ms(5000)),
          "close of the raw connection not reported%s", "");
    return good_round();
}

/* Many frames packed into one stream, as a room's PUTs and NOTIFYs arrive: small PUTs
 * (copied out of the receiver's read buffer; runs of them checked with one
 * check_writes), large ones (read straight into place,
 * the frames behind them in the same read), refused ones (skipped) and notifications,
 * sent first as one write and then cut into pieces of 1 to 5,000 bytes, so that the
 * receiver's reads end anywhere (inside headers, payloads and notifications). Every
 * byte must land where its frame says, in order, the refused ones nowhere, every
 * notification must arrive in order, and the connection must stay up. */
/* A NOTIFY frame carrying `text`, written at stream + *at. */
static void pk_notify(uint8_t *stream, size_t *at, const char *text)
{
    size_t n = strlen(text);
    kvw_tcp_hdr_encode(stream + *at, KVW_TCP_NOTIFY, 0, 0, 0, n);
    memcpy(stream + *at + KVW_TCP_HDR_LEN, text, n);
    *at += KVW_TCP_HDR_LEN + n;
}

static int c_packed_stream(void)
{
    uint64_t s = 0x9e3779b97f4a7c15ull;
#define PK_NEXT() (s ^= s << 13, s ^= s >> 7, s ^= s << 17, s)
    static uint8_t stream[4u << 20];
    for (int pass = 0; pass < 2; pass++) {
        int fd = raw_hello();
        CHECK(fd >= 0, "raw handshake failed: %s", strerror(errno));
        size_t e = get(&S.errs), n0 = get(&S.notes), c0 = get(&S.checks), r0 = get(&S.runs);
        pthread_mutex_lock(&S.mu);
        S.refuse_room = 66;
        pthread_mutex_unlock(&S.mu);
        size_t at = 0, notes = 0, puts = 0;
        char last[32] = "";
        for (int f = 0; f < 400; f++) {
            uint64_t kind = PK_NEXT() % 100;
            if (kind < 12) { /* a notification */
                snprintf(last, sizeof(last), "pk %d.%d", pass, f);
                pk_notify(stream, &at, last);
                notes++;
                continue;
            }
            uint64_t len = kind < 20 ? 32768 + PK_NEXT() % 8000 : 1 + PK_NEXT() % 900;
            uint64_t off = PK_NEXT() % (REGION_LEN - len + 1);
            uint64_t room = kind >= 20 && kind < 26 ? 66 : 3; /* 66: refused */
            kvw_tcp_hdr_encode(stream + at, KVW_TCP_PUT, room, REGION_ID, off, len);
            at += KVW_TCP_HDR_LEN;
            for (uint64_t i = 0; i < len; i++)
                stream[at + i] = (uint8_t)PK_NEXT();
            if (room != 66)
                memcpy(g_expect + GUARD + off, stream + at, len);
            at += len;
            puts++;
        }
        snprintf(last, sizeof(last), "pk %d end", pass);
        pk_notify(stream, &at, last);
        notes++;
        CHECK(at <= sizeof(stream), "stream of %zu bytes", at);
        if (pass == 0) {
            CHECK(send_all(fd, stream, at) == 0, "send: %s", strerror(errno));
        } else {
            for (size_t i = 0; i < at;) {
                size_t n = KVW_MIN((size_t)(1 + PK_NEXT() % 5000), at - i);
                CHECK(send_all(fd, stream + i, n) == 0, "send: %s", strerror(errno));
                i += n;
                if (PK_NEXT() % 8 == 0)
                    usleep(100);
            }
        }
        CHECK(wait_counter(&S.notes, n0 + notes, kvt_tmo_ms(10000)),
              "pass %d: %zu of %zu notifications arrived", pass, get(&S.notes) - n0, notes);
        pthread_mutex_lock(&S.mu);
        bool ok = strcmp(S.last_note, last) == 0 && S.notes == n0 + notes;
        char got[64];
        snprintf(got, sizeof(got), "%s", S.last_note);
        S.refuse_room = 0;
        pthread_mutex_unlock(&S.mu);
        CHECK(ok, "pass %d: last notification '%s', want '%s'", pass, got, last);
        CHECK(get(&S.checks) == c0 + puts, "pass %d: check_write called %zu times, want %zu",
              pass, get(&S.checks) - c0, puts);
        CHECK(get(&S.errs) == e, "pass %d: the connection was dropped: %s", pass, S.last_reason);
        CHECK(pass == 1 || get(&S.runs) > r0, "pass %d: no run of PUTs was checked at once%s",
              pass, "");
        if (check_memory(pass ? "pass 1: " : "pass 0: ") != 0)
            return 1;
        close(fd);
        CHECK(wait_counter(&S.errs, e + 1, kvt_tmo_ms(5000)),
              "close of the raw connection not reported%s", "");
    }
#undef PK_NEXT
    return good_round();
}

/* Mutated headers after a good HELLO: the receiver survives all of them, drops the
 * connections that deserve it, and the good endpoint works at the end. The region's
 * expected contents are not tracked here (in-range fuzzed PUTs may legitimately
 * write), so the check is on the guards and on liveness. */
static int c_fuzz(void)
{
    uint64_t s = 0x2545f4914f6cdd1dull;
    pthread_mutex_lock(&S.mu);
    size_t errs0 = S.errs, conns = 0;
    pthread_mutex_unlock(&S.mu);
    for (int it = 0; it < 200; it++) {
        int fd = raw_hello();
        CHECK(fd >= 0, "raw handshake %d failed: %s", it, strerror(errno));
        conns += fd >= 0;
        /* Odd iterations pack their frames into one write, so that the receiver meets
         * the mutated header inside a run of frames in its read buffer. */
        uint8_t packed[8 * (KVW_TCP_HDR_LEN + 300)];
        size_t plen = 0;
        int nframes = it % 2 ? 8 : 4;
        for (int f = 0; f < nframes; f++) {
            uint8_t h[KVW_TCP_HDR_LEN];
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            uint8_t type = (uint8_t)(1 + s % 4);
            uint64_t off = (s >> 8) % (REGION_LEN + 64);
            uint64_t len = (s >> 24) % 300;
            kvw_tcp_hdr_encode(h, type, s >> 40, (s >> 3) % 3 ? REGION_ID : s, off, len);
            int nflip = (int)((s >> 50) % 4);
            for (int k = 0; k < nflip; k++)
                h[(s >> (k * 6)) % KVW_TCP_HDR_LEN] ^= (uint8_t)(1u << ((s >> (k * 3)) % 8));
            size_t paylen = (size_t)((s >> 33) % 300);
            if (it % 2) {
                memcpy(packed + plen, h, sizeof(h));
                memset(packed + plen + sizeof(h), 0x42, paylen);
                plen += sizeof(h) + paylen;
                continue;
            }
            if (send_all(fd, h, sizeof(h)) != 0)
                break;
            uint8_t pay[300];
            memset(pay, 0x42, sizeof(pay));
            if (send_all(fd, pay, paylen) != 0)
                break;
        }
        if (plen)
            send_all(fd, packed, plen);
        close(fd);
    }
    /* Every fuzzed connection ends in one on_ep_error, after which nothing of it lands:
     * only then is the region read (a fixed sleep raced the receive thread). */
    CHECK(wait_counter(&S.errs, errs0 + conns, kvt_tmo_ms(20000)),
          "not every fuzzed connection was dropped or closed (%zu connections)", conns);
    /* Fuzzed in-range PUTs may have written inside the region: resync the expectation
     * for the inside, but the guards must be intact. */
    for (size_t i = 0; i < GUARD; i++)
        CHECK(g_buf[i] == g_expect[i] && g_buf[GUARD + REGION_LEN + i] ==
                                             g_expect[GUARD + REGION_LEN + i],
              "guard byte %zu overwritten by fuzzed frames", i);
    memcpy(g_expect + GUARD, region(), REGION_LEN);
    return good_round();
}

/* ---------------------------------------------------------------- main */

static const struct {
    const char *name;
    case_fn fn;
} cases[] = {
    {"garbage", c_garbage},
    {"wrong_token", c_wrong_token},
    {"put_before_hello", c_put_before_hello},
    {"bad_version", c_bad_version},
    {"bad_magic", c_bad_magic},
    {"bad_flags", c_bad_flags},
    {"unknown_type", c_unknown_type},
    {"second_hello", c_second_hello},
    {"huge_notify", c_huge_notify},
    {"notify_with_fields", c_notify_with_fields},
    {"put_huge_len", c_put_huge_len},
    {"put_out_of_range", c_put_out_of_range},
    {"put_offset_past_end", c_put_offset_past_end},
    {"put_wrapping", c_put_wrapping},
    {"put_unknown_region", c_put_unknown_region},
    {"half_header", c_half_header},
    {"half_payload", c_half_payload},
    {"refused_and_dribbled", c_refused_and_dribbled},
    {"packed_stream", c_packed_stream},
    {"stalls", c_stalls},
    {"fuzz", c_fuzz},
};

int main(void)
{
    signal(SIGPIPE, SIG_IGN); /* the raw sockets write into dropped connections */
    alarm(kvt_tmo_s(240));
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&S.cv, &ca);
    T = kvw__tl_find("tcp");
    if (T == NULL) {
        fprintf(stderr, "FAIL: no tcp transport: %s\n", kvw_last_error());
        return 1;
    }
    g_buf = malloc(REGION_LEN + 2 * GUARD);
    g_expect = malloc(REGION_LEN + 2 * GUARD);
    for (size_t i = 0; i < REGION_LEN + 2 * GUARD; i++)
        g_buf[i] = (uint8_t)(i * 13 + 1);
    memcpy(g_expect, g_buf, REGION_LEN + 2 * GUARD);

    kvw_tl_params_t p = {.timeout_ms = TIMEOUT_MS};
    p.cb = (kvw_tl_callbacks_t){.on_notify = on_notify,
                                .on_ep_error = on_ep_error,
                                .check_write = check_write,
                                .check_writes = check_writes};
    kvw_tl_mem_h mem;
    uint8_t rkey[KVW_TL_MAX_RKEY];
    size_t rkey_len = sizeof(rkey);
    g_addr_len = sizeof(g_addr);
    kvw_tl_params_t ps = {.timeout_ms = TIMEOUT_MS};
    ps.cb.on_notify = on_notify; /* the sender's instance receives nothing here */
    if (T->init(&p, &g_rx) != KVW_OK || T->address(g_rx, g_addr, &g_addr_len) != KVW_OK ||
        T->mem_reg(g_rx, region(), REGION_LEN, KVW_MEM_HOST, REGION_ID, &mem, rkey, &rkey_len) !=
            KVW_OK ||
        T->init(&ps, &g_tx) != KVW_OK || T->connect(g_tx, g_addr, g_addr_len, &g_good) != KVW_OK ||
        T->rkey_unpack(g_good, rkey, rkey_len, &g_rkey) != KVW_OK ||
        kvw_tcp_addr_decode(g_addr, g_addr_len, &g_a) != 0) {
        fprintf(stderr, "FAIL: setup: %s\n", kvw_last_error());
        return 1;
    }
    int failures = 0;
    g_case = "setup";
    failures += good_round() != 0;
    for (size_t i = 0; i < KVW_ARRAY_SIZE(cases) && failures == 0; i++) {
        g_case = cases[i].name;
        int r = cases[i].fn();
        fprintf(stderr, "%s tcp_wire/%s\n", r == 0 ? "ok  " : "FAIL", g_case);
        failures += r != 0;
    }
    T->rkey_release(g_rkey);
    T->ep_close(g_good);
    T->fini(g_tx);
    T->close(g_rx);
    T->stop(g_rx);
    T->mem_dereg(g_rx, mem);
    T->fini(g_rx);
    free(g_buf);
    free(g_expect);
    pthread_cond_destroy(&S.cv);
    pthread_condattr_destroy(&ca);
    fprintf(stderr, "%s\n", failures ? "FAILED" : "all tcp wire cases passed");
    return failures ? 1 : 0;
}
