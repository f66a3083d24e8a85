/*
 * fuzz_tcp_rx: the bytes a hostile peer writes on a tcp data connection, into the real
 * tcp transport's receiver (src/transport/tcp/tcp.c: its read buffer, the frame state
 * machine, runs of PUTs checked with check_writes, payloads copied or received in place,
 * notifications).
 *
 * One receiver for the whole run, with one registered region (id 5, 64 KiB between 4 KiB
 * guards) and callbacks that refuse writes for room 66 and count every check. Input: u8
 * flags (bit 0: the harness says a valid HELLO first and reads its acknowledgement, so
 * the rest reaches the frame states; without it the stream itself must greet), u8 seed
 * of the write sizes, then the stream, written in pieces of 1 to 8,192 bytes drawn from
 * the seed, then the connection is shut down for writing.
 *
 * Oracles: the guards stay untouched; every write check asks about a range inside the
 * region; every notification is at most KVW_TL_MAX_NOTIFY bytes; the receiver reports
 * the connection (on_ep_error) within 10 s of the stream's end; and AddressSanitizer sees no
 * access outside the region and the receiver's buffers.
 */
#include "fuzz_common.h"
#include "transport/tcp/tcp_wire.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#define FZT_REGION_ID 5
#define FZT_REGION_LEN 65536
#define FZT_GUARD 4096

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t errs, checks, notes;
} fzt_s = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static const kvw_tl_ops_t *fzt_T;
static kvw_tl_h fzt_rx;
static uint8_t *fzt_buf; /* guard | region | guard */
static kvw_tcp_addr_t fzt_a;

static void fzt_on_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    (void)arg;
    (void)ep;
    (void)msg;
    if (len > KVW_TL_MAX_NOTIFY)
        fzc_fail("a notification of %zu bytes was delivered", len);
    pthread_mutex_lock(&fzt_s.mu);
    fzt_s.notes++;
    pthread_mutex_unlock(&fzt_s.mu);
}

static kvw_status_t fzt_check_write(void *arg, kvw_tl_ep_h ep, uint64_t room, uint64_t region,
                                    uint64_t off, uint64_t len)
{
    (void)arg;
    (void)ep;
    if (region != FZT_REGION_ID || len == 0 || off > FZT_REGION_LEN ||
        len > FZT_REGION_LEN - off)
        fzc_fail("check_write asked about region %llu [%llu, +%llu)", (unsigned long long)region,
                 (unsigned long long)off, (unsigned long long)len);
    pthread_mutex_lock(&fzt_s.mu);
    fzt_s.checks++;
    pthread_mutex_unlock(&fzt_s.mu);
    return room == 66 ? KVW_ERR_REJECTED : KVW_OK;
}

static void fzt_check_writes(void *arg, kvw_tl_ep_h ep, const kvw_tl_write_t *w, size_t n,
                             kvw_status_t *st)
{
    for (size_t i = 0; i < n; i++)
        st[i] = fzt_check_write(arg, ep, w[i].room, w[i].region_id, w[i].off, w[i].len);
}

static void fzt_on_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason)
{
    (void)arg;
    (void)ep;
    (void)status;
    FZC_SAY("dropped: %s\n", reason);
    pthread_mutex_lock(&fzt_s.mu);
    fzt_s.errs++;
    pthread_cond_broadcast(&fzt_s.cv);
    pthread_mutex_unlock(&fzt_s.mu);
}

static uint8_t fzt_guard_byte(size_t i)
{
    return (uint8_t)(i * 131 + 7);
}

static void fzt_setup(void)
{
    if (fzt_rx)
        return;
    fzt_T = kvw__tl_find("tcp");
    fzt_buf = malloc(FZT_REGION_LEN + 2 * FZT_GUARD);
    if (fzt_T == NULL || fzt_buf == NULL)
        fzc_fail("no tcp transport");
    for (size_t i = 0; i < FZT_REGION_LEN + 2 * FZT_GUARD; i++)
        fzt_buf[i] = fzt_guard_byte(i);
    kvw_tl_params_t p = {.timeout_ms = 2000};
    p.cb = (kvw_tl_callbacks_t){.on_notify = fzt_on_notify,
                                .check_write = fzt_check_write,
                                .check_writes = fzt_check_writes,
                                .on_ep_error = fzt_on_ep_error};
    uint8_t addr[KVW_TL_MAX_ADDR], rkey[KVW_TL_MAX_RKEY];
    size_t addr_len = sizeof(addr), rkey_len = sizeof(rkey);
    kvw_tl_mem_h mem;
    if (fzt_T->init(&p, &fzt_rx) != KVW_OK || fzt_T->address(fzt_rx, addr, &addr_len) != KVW_OK ||
        fzt_T->mem_reg(fzt_rx, fzt_buf + FZT_GUARD, FZT_REGION_LEN, KVW_MEM_HOST, FZT_REGION_ID,
                       &mem, rkey, &rkey_len) != KVW_OK ||
        kvw_tcp_addr_decode(addr, addr_len, &fzt_a) != 0)
        fzc_fail("cannot start a tcp receiver: %s", kvw_last_error());
}

static int fzt_connect(void)
{
    int fd = socket(fzt_a.family == 6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        fzc_fail("socket: %s", strerror(errno));
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_storage ss;
    socklen_t sl = kvw_tcp_addr_sockaddr(&fzt_a, &ss);
    /* libFuzzer's timers interrupt system calls (no SA_RESTART): an interrupted connect
     * goes on in the background, so it is waited for. */
    if (connect(fd, (struct sockaddr *)&ss, sl) != 0) {
        if (errno != EINTR && errno != EINPROGRESS)
            fzc_fail("connect to the receiver: %s", strerror(errno));
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int err = 0;
        socklen_t el = sizeof(err);
        int r;
        while ((r = poll(&p, 1, 5000)) < 0 && errno == EINTR) {
        }
        if (r != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0)
            fzc_fail("connect to the receiver: %s", err ? strerror(err) : "timed out");
    }
    return fd;
}

/* False when the receiver dropped the connection (it may, at any byte). */
static bool fzt_send(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
        p += r;
        n -= (size_t)r;
    }
    return true;
}

int kvw_fuzz_tcp_rx(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    fzt_setup();
    fzc_in_t in = {data, size, 0};
    uint8_t flags = fzc_u8(&in);
    uint64_t seed = (uint64_t)fzc_u8(&in) * 0x9e3779b97f4a7c15ull + 1;
    pthread_mutex_lock(&fzt_s.mu);
    uint64_t errs0 = fzt_s.errs;
    pthread_mutex_unlock(&fzt_s.mu);
    int fd = fzt_connect();
    bool up = true;
    if (flags & 1) {
        uint8_t h[KVW_TCP_HDR_LEN], ack[KVW_TCP_ACK_LEN];
        kvw_tcp_hdr_encode(h, KVW_TCP_HELLO, fzt_a.token, 0, 0, 0);
        size_t got = 0;
        up = fzt_send(fd, h, sizeof(h));
        while (up && got < sizeof(ack)) {
            ssize_t r = recv(fd, ack + got, sizeof(ack) - got, 0);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0)
                fzc_fail("no HELLO_ACK for a valid HELLO: %s",
                         r == 0 ? "connection closed" : strerror(errno));
            got += (size_t)r;
        }
        if (up && (ack[5] != KVW_TCP_HELLO_ACK || kvw__le64_get(ack + 8) != fzt_a.token))
            fzc_fail("a wrong HELLO_ACK");
    }
    size_t n;
    uint8_t *stream = fzc_take(&in, fzc_left(&in), &n);
    for (size_t at = 0; up && at < n;) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        size_t k = KVW_MIN((size_t)(1 + seed % 8192), n - at);
        up = fzt_send(fd, stream + at, k);
        at += k;
    }
    free(stream);
    /* The end of the stream ends the connection whatever state it was in: it must be
     * reported. Then the socket is reset rather than closed, so that no port of the
     * harness waits in TIME_WAIT (tens of thousands of connections a run would use up
     * the ephemeral ports). */
    shutdown(fd, SHUT_WR);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 10;
    pthread_mutex_lock(&fzt_s.mu);
    while (fzt_s.errs == errs0 && pthread_cond_timedwait(&fzt_s.cv, &fzt_s.mu, &dl) == 0) {
    }
    bool reported = fzt_s.errs != errs0;
    FZC_SAY("checks %llu, notifications %llu\n", (unsigned long long)fzt_s.checks,
            (unsigned long long)fzt_s.notes);
    pthread_mutex_unlock(&fzt_s.mu);
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
    if (!reported)
        fzc_fail("a finished connection was not reported within 10 s");
    for (size_t i = 0; i < FZT_GUARD; i++) {
        size_t j = FZT_GUARD + FZT_REGION_LEN + i;
        if (fzt_buf[i] != fzt_guard_byte(i))
            fzc_fail("guard byte %zu before the region was written", i);
        if (fzt_buf[j] != fzt_guard_byte(j))
            fzc_fail("guard byte %zu after the region was written", i);
    }
    return 0;
}

#ifndef KVW_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    return kvw_fuzz_tcp_rx(data, size);
}
#endif
