/*
 * The control thread reads a peer's frames in bounded passes (at most 64 frames or 1 MiB
 * of payload, then the other peers' turn) without the context's lock, and handles them
 * under it afterwards, in order. A decode rank's control connection gets bursts written
 * straight into it (heartbeats 20 s apart, so the context's own traffic wakes nothing):
 *  - 300 room confirmations for rooms the prefill does not have, each read together with
 *    the next frame's header, interleaved with frames without payload: all are taken
 *    (ignored), the peer stays, and a room posted afterwards succeeds with every byte
 *    checked;
 *  - 64 such confirmations and then, just past the pass's bound, a frame without payload
 *    that the prefill refuses (META, which only a decode rank reads), whose header came in
 *    with the 64th payload and with nothing after it on the socket: the prefill drops the
 *    peer for that frame ("unexpected frame type"), which a pass that stopped with the
 *    header read but the frame unhandled would not do until some other byte arrived;
 *  - on a fresh pair, 150 confirmations followed by a frame whose header is malformed:
 *    the frames before it are handled and the peer is dropped with the header's error.
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
#include <sys/socket.h>
#include <unistd.h>

#define TOKENS 40
#define DEADLINE_NS kvt_tmo_ns(30000000000ull)

static kvt_model_t model;

/* Appends one ROOM_DONE frame for room `id` (a room the prefill never had) to buf. */
static size_t put_room_done(uint8_t *buf, uint64_t id)
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_ROOM_DONE);
    kvw__wb_u64(&w, id);
    kvw__wb_u32(&w, 0);
    kvw__wb_str(&w, "");
    size_t n = 0;
    if (kvw__wb_finish(&w) == KVW_OK) {
        memcpy(buf, w.p, w.len);
        n = w.len;
    }
    kvw__wb_free(&w);
    return n;
}

/* A frame header of `type` announcing `len` payload bytes (magic as given). */
static size_t put_hdr(uint8_t *buf, uint32_t magic, uint8_t type, uint32_t len)
{
    memset(buf, 0, KVW_WIRE_HDR);
    kvw__le32_put(buf, magic);
    buf[4] = KVW_WIRE_VERSION;
    buf[5] = type;
    kvw__le32_put(buf + 8, len);
    return KVW_WIRE_HDR;
}

/* Writes buf into decode context d's control connection to its one prefill peer, when
 * none of the context's own frames is queued or being written (so that no frame of the
 * library is cut by these bytes). */
static bool inject(struct kvw_ctx *d, const uint8_t *buf, size_t len)
{
    uint64_t end = kvt_now_ns() + kvt_tmo_ns(5000000000ull);
    while (kvt_now_ns() < end) {
        pthread_mutex_lock(&d->mu);
        kvw_peer_t *p = d->peers.num ? d->peers.tab[0] : NULL;
        bool idle = p && !p->tx_busy && p->out_head == NULL && p->fd >= 0;
        size_t off = 0;
        while (idle && off < len) {
            ssize_t k = send(p->fd, buf + off, len - off, MSG_NOSIGNAL);
            if (k <= 0)
                break;
            off += (size_t)k;
        }
        pthread_mutex_unlock(&d->mu);
        if (idle)
            return off == len;
        usleep(1000);
    }
    return false;
}

/* Waits up to ns until the prefill's peer 0 is dead; whether it died. */
static bool wait_dead(struct kvw_ctx *pc, uint64_t ns)
{
    uint64_t end = kvt_now_ns() + ns;
    for (;;) {
        pthread_mutex_lock(&pc->mu);
        bool dead = pc->peers.num > 0 && pc->peers.tab[0]->dead;
        pthread_mutex_unlock(&pc->mu);
        if (dead)
            return true;
        if (kvt_now_ns() >= end)
            return false;
        usleep(2000);
    }
}

/* Every "peer ... is gone" warning of both contexts, in order (bounded). */
static char warns[8192];
static pthread_mutex_t warn_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    if (level != KVW_LOG_WARN || strstr(msg, "is gone") == NULL)
        return;
    pthread_mutex_lock(&warn_mu);
    size_t at = strlen(warns);
    snprintf(warns + at, sizeof(warns) - at, "%s\n", msg);
    pthread_mutex_unlock(&warn_mu);
}

/* Whether the prefill (its peer is a decode rank) logged a peer gone with `needle`. */
static bool warned(const char *needle)
{
    pthread_mutex_lock(&warn_mu);
    bool ok = false;
    for (const char *l = warns; *l && !ok;) {
        const char *e = strchr(l, '\n');
        size_t len = e ? (size_t)(e - l) : strlen(l);
        char line[1024];
        snprintf(line, sizeof(line), "%.*s", (int)len, l);
        ok = strncmp(line, "peer decode", 11) == 0 && strstr(line, needle) != NULL;
        l += len + (e != NULL);
    }
    pthread_mutex_unlock(&warn_mu);
    return ok;
}

static bool make_pair(kvt_rank_t *src, kvt_rank_t *dst, kvw_ctx_h *pctx, kvw_ctx_h *dctx)
{
    kvw_ctx_params_t p = ip_params(KVW_SIDE_PREFILL, src, "tcp", "127.0.0.1:0", true);
    p.bootstrap_timeout_ms = kvt_tmo_ms(10000);
    p.wait_timeout_ms = kvt_tmo_ms(20000);
    p.heartbeat_ms = 20000;
    p.peer_timeout_ms = 60000;
    CHECK(kvw_ctx_create(&p, pctx) == KVW_OK, "prefill: %s", kvw_last_error());
    if (*pctx == NULL)
        return false;
    char bs[128];
    ip_params_decode(&p, *pctx, dst, bs, sizeof(bs));
    CHECK(kvw_ctx_create(&p, dctx) == KVW_OK, "decode: %s", kvw_last_error());
    return *dctx != NULL;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (ip_model("test_ctrl_burst", &model))
        return 1;
    kvw_set_log_handler(on_log, NULL, KVW_LOG_WARN);
    kvt_rank_t src = {0}, dst = {0};
    CHECK(ip_rank_pair(&model, &src, &dst) == KVW_OK, "%s", kvw_last_error());
    if (failures)
        return 1;
    size_t cap = 1u << 20;
    uint8_t *buf = malloc(cap);
    CHECK(buf != NULL, "no memory");
    if (buf == NULL)
        return 1;

    kvw_ctx_h pctx = NULL, dctx = NULL;
    if (!make_pair(&src, &dst, &pctx, &dctx))
        return ip_summary("test_ctrl_burst");
    ip_room_t room = {.id = 11, .tokens = TOKENS, .seed = 5, .deadline_ns = DEADLINE_NS,
                      .what = "the room before the bursts"};
    ip_room_verified(&model, pctx, &src, dctx, &dst, &room);

    /* 1: 300 confirmations of unknown rooms, every fifth followed by a frame without
     * payload of a type the prefill ignores empty (a heartbeat). */
    size_t n = 0;
    for (uint32_t i = 0; i < 300; i++) {
        n += put_room_done(buf + n, 1000000 + i);
        if (i % 5 == 4)
            n += put_hdr(buf + n, KVW_WIRE_MAGIC, KVW_MSG_HEARTBEAT, 0);
    }
    CHECK(inject(dctx, buf, n), "the first burst could not be written");
    usleep(200000);
    CHECK(!wait_dead(pctx, 0), "the peer was dropped for a burst of valid frames");
    room.id = 12, room.seed = 6, room.what = "the room after a burst of 360 frames";
    ip_room_verified(&model, pctx, &src, dctx, &dst, &room);

    /* 2: a pass's worth of frames with payload, then a frame without payload that the
     * prefill must refuse (a decode-bound META), its header read with the 64th payload,
     * nothing after it. */
    n = 0;
    for (uint32_t i = 0; i < 64; i++)
        n += put_room_done(buf + n, 2000000 + i);
    n += put_hdr(buf + n, KVW_WIRE_MAGIC, KVW_MSG_META, 0);
    CHECK(inject(dctx, buf, n), "the second burst could not be written");
    CHECK(wait_dead(pctx, kvt_tmo_ns(3000000000ull)),
          "a frame the prefill refuses, at the end of a pass's bound, left the peer alive");
    CHECK(warned("unexpected frame type"), "the prefill dropped the peer for another "
          "reason: %s", warns);
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);

    /* 3: a fresh pair; 150 confirmations, then a malformed header. */
    pctx = dctx = NULL;
    if (make_pair(&src, &dst, &pctx, &dctx)) {
        n = 0;
        for (uint32_t i = 0; i < 150; i++)
            n += put_room_done(buf + n, 3000000 + i);
        n += put_hdr(buf + n, 0xdeadbeefu, KVW_MSG_HEARTBEAT, 0);
        CHECK(inject(dctx, buf, n), "the third burst could not be written");
        CHECK(wait_dead(pctx, kvt_tmo_ns(3000000000ull)),
              "a malformed header after 150 frames left the peer alive");
        CHECK(warned("bad frame magic"), "the prefill dropped the peer for another reason: %s",
              warns);
    }
    kvw_ctx_destroy(dctx);
    kvw_ctx_destroy(pctx);
    free(buf);
    kvt_rank_free(&src);
    kvt_rank_free(&dst);
    return ip_summary("test_ctrl_burst");
}
