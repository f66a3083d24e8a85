/*
 * A registration is bounded before it is authenticated (KVW_MAX_HELLO_KB, default 4 MiB).
 * With the shared secret on, a raw client takes the prefill rank's challenge and
 * announces a 64 MiB HELLO: the prefill rank refuses it at once, unread (REJECT naming
 * the setting, then the connection closes), so the 16 MiB the client then pushes are
 * never taken in (the process's resident memory grows by less than 8 MiB). The refusal
 * is counted in the prefill rank's registration refusals, and an honest decode rank
 * then registers and moves a room with every byte checked.
 *
 * Exit: 0 pass, 1 fail.
 */
#include "testkit.h"
#include "inproc.h"

#include <kvwire/xfer.h>

#include "core/le.h"
#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TOKENS 48
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)
#define SECRET "hello-bound-secret"

static kvt_model_t model;

static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, res = 0;
    if (f == NULL)
        return 0;
    if (fscanf(f, "%llu %llu", &size, &res) != 2)
        res = 0;
    fclose(f);
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Reads one frame from a non-blocking raw socket within timeout_ms (scaled by the
 * caller); its payload into buf (NUL-terminated). Returns the type, or -1. */
static int raw_frame(int fd, char *buf, size_t cap, uint32_t *len_p, int timeout_ms)
{
    uint8_t hdr[KVW_WIRE_HDR];
    size_t got = 0, want = sizeof(hdr);
    uint32_t len = 0;
    uint64_t end = kvt_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    bool in_payload = false;
    while (kvt_now_ns() < end) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0)
            continue;
        ssize_t k = in_payload ? recv(fd, buf + got, want - got, 0)
                               : recv(fd, hdr + got, want - got, 0);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            continue;
        if (k <= 0)
            return -1;
        got += (size_t)k;
        if (got < want)
            continue;
        if (!in_payload) {
            len = (uint32_t)hdr[8] | (uint32_t)hdr[9] << 8 | (uint32_t)hdr[10] << 16 |
                  (uint32_t)hdr[11] << 24;
            if (len + 1 > cap)
                return -1;
            *len_p = len;
            in_payload = true;
            got = 0;
            want = len;
            if (len == 0)
                break;
            continue;
        }
        break;
    }
    if (!in_payload || got < want)
        return -1;
    buf[len] = '\0';
    return hdr[5];
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_hello_bound", &model))
        return 1;
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
    p.field_mask |= KVW_CTX_FIELD_SECRET;
    p.secret = SECRET;
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    CHECK(kvw_ctx_create(&p, &pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (pctx == NULL)
        return 1;
    struct kvw_ctx *pc = pctx;

    uint64_t before = rss_bytes();
    int fd = ip_raw_connect(pc->listen_port);
    CHECK(fd >= 0, "no connection to the control port");
    char buf[2048];
    uint32_t len = 0;
    int type = fd >= 0 ? raw_frame(fd, buf, sizeof(buf), &len, (int)kvt_tmo_ms(5000)) : -1;
    CHECK(type == KVW_MSG_CHALLENGE, "no challenge (frame type %d)", type);
    /* The header of a 64 MiB HELLO. */
    uint8_t hdr[KVW_WIRE_HDR] = {0};
    kvw__le32_put(hdr, KVW_WIRE_MAGIC);
    hdr[4] = KVW_WIRE_VERSION;
    hdr[5] = KVW_MSG_HELLO;
    kvw__le32_put(hdr + 8, KVW_WIRE_MAX_PAYLOAD);
    CHECK(fd >= 0 && send(fd, hdr, sizeof(hdr), MSG_NOSIGNAL) == (ssize_t)sizeof(hdr),
          "header not sent");
    type = fd >= 0 ? raw_frame(fd, buf, sizeof(buf), &len, (int)kvt_tmo_ms(5000)) : -1;
    CHECK(type == KVW_MSG_REJECT && len > 8 &&
              kvt_contains(buf + 8, "is larger than the 4194304 bytes accepted here") &&
              kvt_contains(buf + 8, "KVW_MAX_HELLO_KB=4096"),
          "the oversized registration got frame type %d: '%s'", type,
          type == KVW_MSG_REJECT && len > 8 ? buf + 8 : "");
    /* Whatever the client pushes now is not taken in. */
    static char junk[1 << 20];
    memset(junk, 0x5a, sizeof(junk));
    size_t pushed = 0;
    uint64_t end = kvt_now_ns() + kvt_tmo_ns(3000000000ull);
    while (fd >= 0 && pushed < (16u << 20) && kvt_now_ns() < end) {
        ssize_t k = send(fd, junk, sizeof(junk), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0)
            pushed += (size_t)k;
        else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            break;
        else
            usleep(1000);
    }
    CHECK(fd < 0 || ip_closed_by_peer(fd, (int)kvt_tmo_ms(5000)),
          "the prefill rank kept the connection of the oversized registration");
    if (fd >= 0)
        close(fd);
    uint64_t after = rss_bytes();
    printf("pushed %zu bytes after the header; RSS %+.1f MiB\n", pushed,
           ((double)after - (double)before) / 1048576.0);
    CHECK(after < before + (8u << 20), "RSS grew by %llu MiB for one refused registration",
          (unsigned long long)((after - before) >> 20));
    pthread_mutex_lock(&pc->mu);
    uint64_t refusals = pc->hs.refusals;
    pthread_mutex_unlock(&pc->mu);
    CHECK(refusals == 1, "%llu registration refusals counted (want 1)",
          (unsigned long long)refusals);

    /* An honest registration and room. */
    char bs[128];
    ip_params_decode(&p, pctx, &dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, &dctx) == KVW_OK, "decode: %s", kvw_last_error());
    if (dctx) {
        ip_room_t room = {.id = 5, .tokens = TOKENS, .seed = 9, .deadline_ns = DEADLINE_NS,
                          .what = "honest room"};
        ip_room_verified(&model, pctx, &src, dctx, &dst, &room);
        kvw_ctx_destroy(dctx);
    }
    kvw_ctx_destroy(pctx);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_hello_bound");
}
