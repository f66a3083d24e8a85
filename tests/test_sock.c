/*
 * The bounded socket loops of src/core/sock.c, which the protocol's sockets and the
 * socket transports share, over socketpairs: bytes arrive whole and in order (a large
 * vector send that fills the socket many times over, received by another thread), and
 * every way a wait ends gives its status and message: the peer's EOF (with the bytes
 * received so far), a send to a closed peer, an absolute deadline that passes, a stall
 * window of 0 (no wait at all), and a socket that is ready at once under both limits.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "check.h"
#include "timeout.h"

#include "core/sock.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define BIG (4u << 20) /* many socket buffers' worth */

static bool contains(const char *s, const char *needle)
{
    return s != NULL && strstr(s, needle) != NULL;
}

static void pair(int sv[2])
{
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        exit(1);
    }
}

typedef struct {
    int fd;
    uint8_t *buf;
    kvw_status_t st;
    char err[256];
} reader_t;

static void *reader_main(void *arg)
{
    reader_t *r = arg;
    r->st = kvw__sock_recv_all(r->fd, r->buf, BIG, kvw__now_ns() + kvt_tmo_ns(60000000000ull));
    snprintf(r->err, sizeof(r->err), "%s", kvw_last_error());
    return NULL;
}

/* A send of BIG bytes in three vectors (one empty) against a reader thread. */
static void big_transfer(void)
{
    cur_case = "big transfer";
    int sv[2];
    pair(sv);
    uint8_t *src = malloc(BIG), *dst = malloc(BIG + 16);
    if (src == NULL || dst == NULL)
        exit(1);
    for (uint32_t i = 0; i < BIG; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 24);
    memset(dst, 0xA5, BIG + 16);
    reader_t r = {.fd = sv[1], .buf = dst + 8};
    pthread_t t;
    if (pthread_create(&t, NULL, reader_main, &r) != 0)
        exit(1);
    struct iovec iov[3] = {{src, 1000}, {src + 1000, 0}, {src + 1000, BIG - 1000}};
    kvw_status_t st = kvw__sock_send_iov(sv[0], iov, 3, KVW_SOCK_NO_DEADLINE,
                                         kvt_tmo_ns(30000000000ull), "test send");
    CHECK(st == KVW_OK, "send_iov: %s", kvw_last_error());
    pthread_join(t, NULL);
    CHECK(r.st == KVW_OK, "recv_all: %s", r.err);
    CHECK(memcmp(dst + 8, src, BIG) == 0, "received bytes differ from those sent");
    bool guards = true;
    for (int i = 0; i < 8; i++)
        guards &= dst[i] == 0xA5 && dst[8 + BIG + i] == 0xA5;
    CHECK(guards, "bytes around the destination were written");
    CHECK(iov[0].iov_len == 0 && iov[2].iov_len == 0, "the vectors were not consumed");
    close(sv[0]);
    close(sv[1]);
    free(src);
    free(dst);
}

static void eof_and_closed(void)
{
    cur_case = "eof";
    int sv[2];
    pair(sv);
    CHECK(send(sv[0], "abc", 3, 0) == 3, "send: %s", strerror(errno));
    close(sv[0]);
    uint8_t buf[8];
    kvw_status_t st = kvw__sock_recv_exact(sv[1], buf, sizeof(buf), KVW_SOCK_NO_DEADLINE,
                                           kvt_tmo_ns(30000000000ull), "test recv");
    CHECK(st == KVW_ERR_CONN_CLOSED && memcmp(buf, "abc", 3) == 0, "%s: %s",
          kvw_status_string(st), kvw_last_error());
    CHECK(contains(kvw_last_error(), "test recv: peer closed the connection after 3 of 8 bytes"),
          "message: %s", kvw_last_error());
    close(sv[1]);

    cur_case = "send to a closed peer";
    pair(sv);
    close(sv[1]);
    st = kvw__sock_send_all(sv[0], "abc", 3, kvw__now_ns() + kvt_tmo_ns(30000000000ull));
    CHECK(st == KVW_ERR_CONN_CLOSED, "%s: %s", kvw_status_string(st), kvw_last_error());
    CHECK(contains(kvw_last_error(), "sending to a peer: peer closed the connection (fd "),
          "message: %s", kvw_last_error());
    close(sv[0]);
}

static void limits(void)
{
    int sv[2];
    pair(sv);
    uint8_t buf[4];

    cur_case = "deadline passed";
    uint64_t t0 = kvw__now_ns();
    kvw_status_t st = kvw__sock_recv_all(sv[1], buf, sizeof(buf), t0 + 20000000ull);
    CHECK(st == KVW_ERR_TIMEOUT, "%s: %s", kvw_status_string(st), kvw_last_error());
    CHECK(contains(kvw_last_error(), "timed out waiting for a peer's reply"), "message: %s",
          kvw_last_error());
    CHECK(kvw__now_ns() - t0 >= 20000000ull, "returned before the deadline");

    cur_case = "stall window 0";
    st = kvw__sock_wait(sv[1], POLLIN, KVW_SOCK_NO_DEADLINE, 0, "test wait");
    char want[96];
    snprintf(want, sizeof(want), "test wait: no progress on fd %d within 0 ms", sv[1]);
    CHECK(st == KVW_ERR_TIMEOUT && contains(kvw_last_error(), want), "%s: %s",
          kvw_status_string(st), kvw_last_error());

    cur_case = "deadline before the window";
    st = kvw__sock_wait(sv[1], POLLIN, kvw__now_ns(), kvt_tmo_ns(30000000000ull), "test wait");
    CHECK(st == KVW_ERR_TIMEOUT && contains(kvw_last_error(), "timed out test wait"), "%s: %s",
          kvw_status_string(st), kvw_last_error());

    cur_case = "ready at once";
    CHECK(send(sv[0], "wxyz", 4, 0) == 4, "send: %s", strerror(errno));
    st = kvw__sock_recv_exact(sv[1], buf, sizeof(buf), kvw__now_ns(), 0, "test recv");
    CHECK(st == KVW_OK && memcmp(buf, "wxyz", 4) == 0, "%s: %s", kvw_status_string(st),
          kvw_last_error());
    st = kvw__sock_wait(sv[0], POLLOUT, kvw__now_ns() + kvt_tmo_ns(30000000000ull),
                        KVW_SOCK_NO_STALL, "test wait");
    CHECK(st == KVW_OK, "an empty socket is not writable: %s", kvw_last_error());
    close(sv[0]);
    close(sv[1]);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    big_transfer();
    eof_and_closed();
    limits();
    if (failures) {
        fprintf(stderr, "test_sock: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("test_sock: all %d checks passed\n", checks);
    return 0;
}
