/*
 * The prefill control port under silent connections: 70 raw connections that never send
 * a registration take the handshake slots (64), yet an honest decode rank still
 * registers (the oldest silent connection gives way), and every silent connection is
 * closed by the prefill rank within its handshake timeout (the test waits up to 60 s).
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"

#include <kvwire/xfer.h>

#include "proto/proto.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int failures;
#define CHECK(c, ...)                                                                    \
    do {                                                                                 \
        if (!(c)) {                                                                      \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #c);       \
            fprintf(stderr, __VA_ARGS__);                                                \
            fprintf(stderr, "\n");                                                       \
            failures++;                                                                  \
        }                                                                                \
    } while (0)

#define SILENT 70

static kvt_model_t model;

/* A raw connection to 127.0.0.1:port; -1 on failure. Waits up to 10 s. */
static int raw_connect(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int err = 0;
    socklen_t el = sizeof(err);
    if (poll(&p, 1, 10000) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Waits until the endpoint closed `fd` (EOF or reset), up to timeout_ms. */
static bool closed_by_peer(int fd, int timeout_ms)
{
    uint64_t end = kvt_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = kvt_now_ns();
        if (now >= end)
            return false;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)((end - now) / 1000000ull) + 1) < 0 && errno != EINTR)
            return false;
        char b[64];
        ssize_t k = recv(fd, b, sizeof(b), MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return true;
    }
}

static kvw_status_t make_rank(kvt_rank_t *r)
{
    kvt_rank_spec_t s = {.model = &model, .layout = KVW_LAYOUT_NHD, .page_size = {16, 16},
                         .num_pages = {8, 8}, .num_slots = 1};
    s.par = (kvw_parallel_t){.tp_size = 1, .tp_rank = 0, .pp_size = 1, .layer_begin = 0,
                             .layer_end = model.m.num_layers, .dp_size = 1};
    return kvt_rank_build(&s, r);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (kvt_model_preset("gpt-oss-120b", &model) || kvt_model_truncate(&model, 2)) {
        fprintf(stderr, "test_handshake_slots: no gpt-oss-120b preset\n");
        return 1;
    }
    kvt_rank_t src = {0}, dst = {0};
    CHECK(make_rank(&src) == KVW_OK && make_rank(&dst) == KVW_OK, "%s", kvw_last_error());
    if (failures)
        return 1;
    /* A long peer timeout (it bounds each handshake too): the silent connections would
     * hold their slots for the whole test if nothing displaced them. */
    kvw_ctx_h pctx = NULL, dctx = NULL;
    kvw_ctx_params_t p = {.field_mask = KVW_CTX_FIELD_SIDE | KVW_CTX_FIELD_RANK |
                                        KVW_CTX_FIELD_TRANSPORT | KVW_CTX_FIELD_BOOTSTRAP |
                                        KVW_CTX_FIELD_HOST_BOOTSTRAP | KVW_CTX_FIELD_TIMEOUTS,
                          .side = KVW_SIDE_PREFILL, .rank = src.h, .transport = "tcp",
                          .bootstrap_addr = "127.0.0.1:0", .host_bootstrap = 1,
                          .bootstrap_timeout_ms = 10000, .peer_timeout_ms = 15000,
                          .heartbeat_ms = 200};
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    uint16_t port = ((struct kvw_ctx *)pctx)->listen_port;
    int silent[SILENT], opened = 0;
    for (int i = 0; i < SILENT; i++)
        opened += (silent[i] = raw_connect(port)) >= 0;
    CHECK(opened == SILENT, "only %d of %d silent connections opened", opened, SILENT);
    /* Each silent connection was accepted once it holds the prefill's challenge. */
    for (int i = 0; i < SILENT; i++) {
        struct pollfd pf = {.fd = silent[i], .events = POLLIN};
        if (silent[i] >= 0)
            poll(&pf, 1, 10000);
    }

    char bs[128];
    snprintf(bs, sizeof(bs), "%s", kvw_ctx_bootstrap_addr(pctx));
    p.side = KVW_SIDE_DECODE;
    p.rank = dst.h;
    p.bootstrap_addr = bs;
    p.host_bootstrap = 0;
    p.peer_timeout_ms = 10000;
    kvw_status_t st = kvw_ctx_create(&p, &dctx);
    CHECK(st == KVW_OK, "an honest decode rank could not register beside %d silent "
          "connections: %s: %s", SILENT, kvw_status_string(st), kvw_last_error());

    int closed = 0;
    for (int i = 0; i < SILENT; i++)
        if (silent[i] >= 0) {
            closed += closed_by_peer(silent[i], 60000);
            close(silent[i]);
        }
    CHECK(closed == opened, "%d of %d silent connections were never closed", opened - closed,
          opened);
    if (dctx)
        kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    if (failures) {
        fprintf(stderr, "test_handshake_slots: %d failures\n", failures);
        return 1;
    }
    printf("test_handshake_slots: all checks passed\n");
    return 0;
}
