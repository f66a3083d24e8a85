/*
 * The decode's tcp data port under a flood of connections that never say HELLO, from one
 * source (127.0.0.2): at most KVW_MAX_CONN_PER_SOURCE (256) of them are kept, the rest
 * are closed at once, and those kept are closed once KVW_DATA_HELLO_MS (set to 3 s here,
 * scaled) passes without HELLO and a first frame. Meanwhile a new connection from
 * another source (127.0.0.1) still gets its HELLO_ACK, and the honest pair's room
 * succeeds with every byte checked. (Without the cap 4,096 flood connections were kept
 * for 30 s and the new connection was closed unanswered.)
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "core/le.h"
#include "proto/proto.h"
#include "transport/sockserv.h"
#include "transport/tcp/tcp_wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#define TOKENS 48
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)
#define FLOOD 4200
#define BATCH 200

static kvt_model_t model;

/* A non-blocking connection from `from` (127.0.0.x) to 127.0.0.1:port, or -1. */
static int connect_from(const char *from, uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in me = {.sin_family = AF_INET};
    inet_pton(AF_INET, from, &me.sin_addr);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&me, sizeof(me)) != 0 ||
        (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 && errno != EINPROGRESS)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* How many of fds[0..n) the other end has closed (non-blocking probe). */
static int count_closed(const int *fds, int n)
{
    int closed = 0;
    for (int i = 0; i < n; i++) {
        if (fds[i] < 0) {
            closed++;
            continue;
        }
        char b;
        ssize_t k = recv(fds[i], &b, 1, MSG_DONTWAIT);
        closed += k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
    }
    return closed;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_data_port_flood", &model))
        return 1;
    char hello_ms[32];
    snprintf(hello_ms, sizeof(hello_ms), "%llu", (unsigned long long)kvt_tmo_ms(3000));
    setenv("KVW_DATA_HELLO_MS", hello_ms, 1);
    int flood = FLOOD;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 2 * FLOOD + 256) {
        flood = (int)(rl.rlim_cur - 256) / 2; /* still far above the per-source cap */
        printf("descriptor limit %llu: a flood of %d connections\n",
               (unsigned long long)rl.rlim_cur, flood);
    }
    CHECK(flood > 400, "too few descriptors for the test (%d)", flood);
    if (failures)
        return ip_summary("test_data_port_flood");

    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank(&model, 1, 0, 8, 1, &src) == KVW_OK &&
              ip_rank(&model, 1, 0, 8, 1, &dst) == KVW_OK,
          "%s", kvw_last_error());
    if (failures)
        return 1;
    kvt_rank_fill(&src, 1);
    kvt_rank_fill(&dst, 2);
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, &src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (dctx == NULL)
        return 1;
    kvw__sockserv_t *srv = (kvw__sockserv_t *)(void *)((struct kvw_ctx *)dctx)->tl;
    struct sockaddr_in la;
    socklen_t ll = sizeof(la);
    CHECK(getsockname(srv->listen_fd, (struct sockaddr *)&la, &ll) == 0, "getsockname: %m");
    uint16_t port = ntohs(la.sin_port);

    /* The flood: connections that never send a byte. */
    /* In batches, each connected before the next starts: a slow receive thread (a
     * sanitizer build) would otherwise let the accept queue overflow and leave some
     * connects pending in SYN retries past the checks below. */
    int *fds = calloc((size_t)flood, sizeof(int));
    struct pollfd *pw_all = calloc(BATCH, sizeof(*pw_all));
    int opened = 0;
    for (int i = 0; fds && pw_all && i < flood; i += BATCH) {
        int nb = KVW_MIN(BATCH, flood - i);
        for (int j = 0; j < nb; j++) {
            fds[i + j] = connect_from("127.0.0.2", port);
            opened += fds[i + j] >= 0;
        }
        uint64_t until = kvt_now_ns() + kvt_tmo_ns(20000000000ull);
        for (int j = 0; j < nb; j++) {
            pw_all[0] = (struct pollfd){.fd = fds[i + j], .events = POLLOUT};
            while (fds[i + j] >= 0 && poll(pw_all, 1, 100) == 0 && kvt_now_ns() < until) {
            }
        }
    }
    free(pw_all);
    CHECK(opened == flood, "%d of %d flood connections opened", opened, flood);
    usleep((useconds_t)kvt_tmo_ms(500) * 1000);
    int closed = 0;
    uint64_t end = kvt_now_ns() + kvt_tmo_ns(5000000000ull);
    while ((closed = count_closed(fds, flood)) < flood - 256 && kvt_now_ns() < end)
        usleep(50000);
    printf("flood of %d: %d closed at once\n", flood, closed);
    CHECK(closed >= flood - 256 && closed < flood, "%d of %d flood connections closed at once "
          "(the cap keeps 256 of one source)", closed, flood);

    /* A new connection from another source is answered. */
    int fd = connect_from("127.0.0.1", port);
    struct pollfd pw = {.fd = fd, .events = POLLOUT};
    CHECK(fd >= 0 && poll(&pw, 1, (int)kvt_tmo_ms(5000)) == 1, "no new connection");
    uint8_t hello[KVW_TCP_HDR_LEN], ack[KVW_TCP_ACK_LEN];
    kvw_tcp_hdr_encode(hello, KVW_TCP_HELLO, srv->token, 0, 0, 0);
    CHECK(fd >= 0 && send(fd, hello, sizeof(hello), MSG_NOSIGNAL) == (ssize_t)sizeof(hello),
          "HELLO not sent");
    size_t got = 0;
    end = kvt_now_ns() + kvt_tmo_ns(5000000000ull);
    while (fd >= 0 && got < sizeof(ack) && kvt_now_ns() < end) {
        struct pollfd pr = {.fd = fd, .events = POLLIN};
        if (poll(&pr, 1, 50) != 1)
            continue;
        ssize_t k = recv(fd, ack + got, sizeof(ack) - got, 0);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    CHECK(got == sizeof(ack) && ack[5] == KVW_TCP_HELLO_ACK &&
              kvw__le64_get(ack + 8) == srv->token,
          "the new connection got %zu bytes of HELLO_ACK", got);

    /* The honest pair's room, while the flood's survivors are still open. */
    ip_room_t room = {.id = 5, .tokens = TOKENS, .seed = 9, .deadline_ns = DEADLINE_NS,
                      .what = "honest room"};
    ip_room_verified(&model, pctx, &src, dctx, &dst, &room);

    /* The survivors never said HELLO: closed once the deadline passes. The connection
     * that said HELLO and nothing else is closed too. */
    end = kvt_now_ns() + kvt_tmo_ns(3000000000ull) + kvt_tmo_ns(5000000000ull);
    while ((closed = count_closed(fds, flood)) < flood && kvt_now_ns() < end)
        usleep(100000);
    CHECK(closed == flood, "%d of %d flood connections open after KVW_DATA_HELLO_MS",
          flood - closed, flood);
    CHECK(fd < 0 || ip_closed_by_peer(fd, (int)kvt_tmo_ms(5000)),
          "a connection with HELLO and no first frame stayed open");
    if (fd >= 0)
        close(fd);
    for (int i = 0; fds && i < flood; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free(fds);

    /* And the pair still works afterwards. */
    room.id = 6;
    room.seed = 10;
    ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_data_port_flood");
}
