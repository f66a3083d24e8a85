/* The control thread: it owns every control socket (accepts, reads frames, writes
 * queued frames without blocking), sends heartbeats, declares silent or stalled peers
 * dead, scans for room timeouts and reaps dead peers. */
#include "core/sha256.h"
#include "proto/proto.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/* The largest payload a control frame of `type` may have (its session tag included):
 * page lists (REQ) may be long, metadata is bounded, every other frame is small. A peer
 * that announces more is dropped before anything is allocated. */
static uint32_t kvw_ctrl_max_payload(uint8_t type)
{
    switch (type) {
    case KVW_MSG_REQ:
        return KVW_WIRE_MAX_PAYLOAD;
    case KVW_MSG_META:
        return KVW_MAX_ROOM_METADATA + 64 + KVW_TAG;
    case KVW_MSG_DIGEST: /* room, count, count units (the decode checks count exactly) */
        return 12 + 8u * KVW_DIGEST_MAX_UNITS + KVW_TAG;
    case KVW_MSG_HEARTBEAT:
        return KVW_TAG;
    default: /* room messages: id, status and a reason (the reader keeps 255 bytes) */
        return 4096;
    }
}

/* A frame's payload buffer grows with the bytes that arrive (from 64 KiB, doubling): a
 * peer that announces a long frame and sends it slowly holds what it sent, not what it
 * announced. */
#define KVW_CTRL_FIRST_ALLOC (64u << 10)

/*
 * The reader runs without mu: a peer's socket and its reader state (hdr, payload, rx_seq)
 * belong to the control thread alone (registration hands the socket over before the peer
 * is polled, and only this thread closes it, when it reaps the peer), so the system
 * calls of a read need not hold up the workers and the receive threads, which take mu
 * for every job and completion. The frames a read completes are handled afterwards under
 * mu, in order (kvw_peer_handle). A pass takes at most KVW_CTRL_RX_FRAMES frames or
 * KVW_CTRL_RX_BYTES of payload from one peer (beyond one frame), then lets the others
 * have their turn; the poll is level-triggered, so what is left is read on the next pass.
 */
#define KVW_CTRL_RX_FRAMES 64
#define KVW_CTRL_RX_BYTES (1u << 20)

typedef struct kvw_rx_frame {
    uint8_t type;
    uint32_t len;
    uint8_t *p;
} kvw_rx_frame_t;

typedef struct kvw_rx_pass {
    /* One more than the bound: a frame without payload completes without a read. */
    kvw_rx_frame_t f[KVW_CTRL_RX_FRAMES + 1];
    uint32_t n;
    uint64_t bytes;
    bool got;          /* bytes arrived */
    kvw_status_t fail; /* the peer is dropped after its frames are handled (KVW_OK: not) */
    char why[200];
} kvw_rx_pass_t;

static void kvw_rx_fail(kvw_rx_pass_t *ps, kvw_status_t st, const char *why)
{
    ps->fail = st;
    snprintf(ps->why, sizeof(ps->why), "%s", why);
}

/* A peer's frame header is complete in peer->hdr: checks it and makes the payload's
 * buffer. False when the peer is to be dropped (ps->fail says why). */
static bool kvw_peer_header(kvw_peer_t *peer, kvw_rx_pass_t *ps)
{
    uint8_t type = 0;
    uint32_t len = 0;
    if (kvw__wire_header(peer->hdr, &type, &len) != KVW_OK) {
        kvw_rx_fail(ps, KVW_ERR_MALFORMED, kvw_last_error());
        return false;
    }
    if (len > kvw_ctrl_max_payload(type)) {
        char why[160];
        snprintf(why, sizeof(why), "a %u-byte control frame of type %u (at most %u "
                 "bytes for that type)", len, type, kvw_ctrl_max_payload(type));
        kvw_rx_fail(ps, KVW_ERR_MALFORMED, why);
        return false;
    }
    peer->payload_cap = KVW_MIN(len, KVW_CTRL_FIRST_ALLOC);
    peer->payload = malloc(peer->payload_cap ? peer->payload_cap : 1);
    if (peer->payload == NULL) {
        kvw_rx_fail(ps, KVW_ERR_NO_MEMORY, "out of memory reading a frame");
        return false;
    }
    peer->payload_len = len;
    peer->payload_got = 0;
    return true;
}

/* Reads what is available on a peer's socket (fd) into ps: the frames it completes, and
 * whether the peer must go. mu not held.
 * The read that completes a frame's payload also takes the next frame's header, and a
 * read that comes back short found the socket drained: the reader returns then instead
 * of asking again only to hear EAGAIN (the control thread's poll is level-triggered, so
 * bytes that arrive meanwhile are seen at once). A small frame costs two reads, not
 * three, and frames back to back one each. */
static void kvw_peer_read(kvw_peer_t *peer, int fd, kvw_rx_pass_t *ps)
{
    ps->n = 0, ps->bytes = 0, ps->got = false, ps->fail = KVW_OK, ps->why[0] = '\0';
    for (;;) {
        /* A frame without payload whose header is in completes without a read; any
         * other step reads, and the pass's bound comes first. */
        bool empty_frame = peer->hdr_got == KVW_WIRE_HDR && peer->payload_len == 0;
        if (!empty_frame && (ps->n >= KVW_CTRL_RX_FRAMES || ps->bytes >= KVW_CTRL_RX_BYTES))
            return;
        ssize_t k;
        size_t asked = 0, ahead = 0;
        uint8_t next[KVW_WIRE_HDR];
        if (peer->hdr_got < KVW_WIRE_HDR) {
            asked = KVW_WIRE_HDR - peer->hdr_got;
            k = recv(fd, peer->hdr + peer->hdr_got, asked, MSG_DONTWAIT);
        } else {
            if (peer->payload_got == peer->payload_cap && peer->payload_cap < peer->payload_len) {
                uint32_t cap = (uint32_t)KVW_MIN((uint64_t)peer->payload_cap * 2,
                                                 (uint64_t)peer->payload_len);
                uint8_t *np = realloc(peer->payload, cap);
                if (np == NULL) {
                    kvw_rx_fail(ps, KVW_ERR_NO_MEMORY, "out of memory reading a frame");
                    return;
                }
                peer->payload = np;
                peer->payload_cap = cap;
            }
            size_t want = peer->payload_cap - peer->payload_got;
            bool last = peer->payload_got + want == peer->payload_len;
            struct iovec iov[2] = {{.iov_base = peer->payload + peer->payload_got,
                                    .iov_len = want},
                                   {.iov_base = next, .iov_len = sizeof(next)}};
            struct msghdr msg = {.msg_iov = iov, .msg_iovlen = last ? 2 : 1};
            asked = want + (last ? sizeof(next) : 0);
            if (peer->payload_len == 0) {
                k = 0, errno = 0;
            } else {
                k = recvmsg(fd, &msg, MSG_DONTWAIT);
                if (k > 0 && (size_t)k > want)
                    ahead = (size_t)k - want, k = (ssize_t)want;
            }
        }
        bool drained = k >= 0 && (size_t)k + ahead < asked;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        if (k < 0 || (k == 0 && !empty_frame)) {
            kvw_rx_fail(ps, KVW_ERR_CONN_CLOSED, k == 0 ? "closed the connection" : strerror(errno));
            return;
        }
        ps->got = true;
        if (peer->hdr_got < KVW_WIRE_HDR) {
            peer->hdr_got += (uint32_t)k;
            if (peer->hdr_got < KVW_WIRE_HDR) {
                if (drained)
                    return;
                continue;
            }
            if (!kvw_peer_header(peer, ps))
                return;
        } else {
            peer->payload_got += (uint32_t)k;
        }
        if (peer->payload_got == peer->payload_len) {
            uint8_t *payload = peer->payload;
            uint32_t plen = peer->payload_len;
            peer->payload = NULL;
            peer->hdr_got = 0;
            if (peer->authed) {
                /* A frame without the right tag for this direction and position was not
                 * sent by the peer that authenticated: drop the connection. */
                uint8_t want[32];
                bool ok = plen >= KVW_TAG;
                if (ok) {
                    plen -= KVW_TAG;
                    kvw__frame_tag(peer, peer->tx_dir == 1 ? 2 : 1, peer->rx_seq++, peer->hdr[5],
                                   payload, plen, want);
                    ok = kvw__ct_equal(payload + plen, want, KVW_TAG);
                }
                if (!ok) {
                    free(payload);
                    kvw_rx_fail(ps, KVW_ERR_AUTH, "a control frame failed its session "
                                "authentication (forged, altered or replayed)");
                    return;
                }
            }
            ps->f[ps->n++] = (kvw_rx_frame_t){.type = peer->hdr[5], .len = plen, .p = payload};
            ps->bytes += plen;
            /* The next frame's header bytes that came with this payload. */
            memcpy(peer->hdr, next, ahead);
            peer->hdr_got = (uint32_t)ahead;
            if (ahead == KVW_WIRE_HDR && !kvw_peer_header(peer, ps))
                return;
            if (drained && !(peer->hdr_got == KVW_WIRE_HDR && peer->payload_len == 0))
                return;
        } else if (drained) {
            return;
        }
    }
}

/* Handles the frames a read collected, in order, then drops the peer if the read said
 * so. mu held. */
static void kvw_peer_handle(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rx_pass_t *ps)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (ps->got)
        peer->last_rx_ns = kvw__now_ns();
    for (uint32_t i = 0; i < ps->n; i++) {
        /* A frame may end the peer (malformed, refused): the ones after it are dropped. */
        if (!peer->dead)
            kvw__handle_frame(ctx, peer, ps->f[i].type, ps->f[i].p, ps->f[i].len);
        free(ps->f[i].p);
    }
    ps->n = 0;
    if (ps->fail != KVW_OK)
        kvw__peer_dead(ctx, peer, ps->fail, ps->why);
}

void kvw__run_deferred(struct kvw_ctx *ctx)
{
    KVW_ASSERT_HELD(&ctx->mu);
    for (bool again = true; again;) {
        again = false;
        for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
            kvw_peer_t *p = kvw__peer_at(ctx, i);
            if (p->doomed && !p->dead) {
                kvw__peer_dead(ctx, p, p->doom_status, p->doom_why);
                again = true;
            }
        }
        kvw_room_effect_t *e = kvw__room_effects_take(ctx);
        while (e) {
            kvw_room_effect_t *next = e->next;
            if (e->release_stage)
                kvw__stage_release_room(ctx, e->room);
            for (uint32_t i = 0; i < e->num_frames; i++) {
                const kvw_room_frame_t *f = &e->frames[i];
                if (f->peer < kvw__peer_count(ctx))
                    kvw__send_room_msg(ctx, kvw__peer_at(ctx, f->peer), f->type, e->room,
                                       f->status, f->stopped ? "stopped" : e->reason);
            }
            kvw__room_effect_free(e);
            e = next;
            again = true;
        }
    }
}

void *kvw__ctrl_main(void *arg)
{
    struct kvw_ctx *ctx = arg;
    kvw__thread_name("kvw-ctrl");
    struct pollfd *pfd = NULL;
    kvw_peer_t **flush = NULL, **polled = NULL;
    kvw_rx_pass_t *pass = malloc(sizeof(*pass));
    uint32_t cap = 0;
    uint64_t last_timeout_scan = 0, last_reap = 0;
    kvw__queue_ctrl_thread(ctx);
    for (;;) {
        pthread_mutex_lock(&ctx->mu);
        kvw__run_deferred(ctx);
        kvw__queue_kick(ctx);
        if (ctx->stopping) {
            /* Send what is queued (a room's completion, an abort) before leaving: the
             * peer must not learn of it only through the closed connection. */
            pthread_mutex_unlock(&ctx->mu);
            for (uint32_t i = 0;; i++) {
                pthread_mutex_lock(&ctx->mu);
                kvw_peer_t *p = i < kvw__peer_count(ctx) ? kvw__peer_at(ctx, i) : NULL;
                pthread_mutex_unlock(&ctx->mu);
                if (p == NULL)
                    break;
                kvw__peer_flush(ctx, p, true);
            }
            break;
        }
        uint32_t need = kvw__peer_count(ctx) + 2;
        if (need > cap) {
            cap = need * 2;
            pfd = realloc(pfd, sizeof(*pfd) * cap);
            flush = realloc(flush, sizeof(*flush) * cap);
            polled = realloc(polled, sizeof(*polled) * cap);
            if (pfd == NULL || flush == NULL || polled == NULL || pass == NULL) {
                pthread_mutex_unlock(&ctx->mu);
                break; /* cannot happen in practice; rooms then time out */
            }
        }
        nfds_t n = 0;
        pfd[n++] = (struct pollfd){.fd = ctx->wake_fd[0], .events = POLLIN};
        if (ctx->listen_fd >= 0)
            pfd[n++] = (struct pollfd){.fd = ctx->listen_fd, .events = POLLIN};
        uint32_t first_peer = (uint32_t)n;
        for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
            if (kvw__peer_at(ctx, i)->dead || kvw__peer_at(ctx, i)->registering)
                continue;
            polled[n] = kvw__peer_at(ctx, i); /* peers are never freed before the context */
            pfd[n++] = (struct pollfd){.fd = kvw__peer_at(ctx, i)->fd,
                                       .events = POLLIN | (kvw__peer_tx_queued(kvw__peer_at(ctx, i)) ? POLLOUT : 0)};
        }
        pthread_mutex_unlock(&ctx->mu);

        int timeout = (int)KVW_MAX(ctx->heartbeat_ms / 2, 10);
        int ready = 0;
        if (ctx->busy_poll_ns) {
            /* Busy polling: look without sleeping until something arrives or the spin
             * time is over, then sleep as usual. */
            uint64_t end = kvw__now_ns() + ctx->busy_poll_ns;
            while ((ready = poll(pfd, n, 0)) == 0 && kvw__now_ns() < end) {
            }
        }
        if (ready == 0 && poll(pfd, n, timeout) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents) {
            char buf[64];
            while (read(ctx->wake_fd[0], buf, sizeof(buf)) > 0) {
            }
        }
        if (ctx->listen_fd >= 0 && pfd[1].revents) {
            int fd = accept4(ctx->listen_fd, NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0) {
                kvw__sock_nodelay(fd);
                kvw__start_handshake(ctx, fd);
            }
        }
        /* Each ready peer read without mu, its frames handled under it. A peer that
         * died since the poll set was made reads its shut-down socket's end, which is
         * ignored then. */
        for (nfds_t i = first_peer; i < n; i++) {
            if (!pfd[i].revents)
                continue;
            kvw_peer_read(polled[i], pfd[i].fd, pass);
            pthread_mutex_lock(&ctx->mu);
            kvw_peer_handle(ctx, polled[i], pass);
            pthread_mutex_unlock(&ctx->mu);
        }
        pthread_mutex_lock(&ctx->mu);
        uint64_t now = kvw__now_ns();
        for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
            kvw_peer_t *p = kvw__peer_at(ctx, i);
            if (p->dead || p->registering)
                continue;
            char stall[128];
            if (kvw__peer_tx_stalled(p, now, ctx->peer_timeout_ms, stall, sizeof(stall))) {
                kvw__peer_dead(ctx, p, KVW_ERR_PEER_DEAD, stall);
                continue;
            }
            if (now - p->last_rx_ns > (uint64_t)ctx->peer_timeout_ms * 1000000ull) {
                char why[96];
                snprintf(why, sizeof(why), "no heartbeat for %u ms", ctx->peer_timeout_ms);
                kvw__peer_dead(ctx, p, KVW_ERR_PEER_DEAD, why);
                continue;
            }
            if (now - p->last_tx_ns > (uint64_t)ctx->heartbeat_ms * 1000000ull &&
                !kvw__peer_tx_queued(p)) {
                kvw_wbuf_t w;
                kvw__wb_init(&w, KVW_MSG_HEARTBEAT);
                kvw__peer_send(ctx, p, &w);
            }
        }
        /* Timeouts have millisecond granularity; scanning every room on every event
         * would cost more than the events themselves at high request rates. */
        kvw_peer_res_t *reaped = NULL;
        if (now - last_timeout_scan > 10000000ull) {
            kvw__check_timeouts(ctx, now);
            last_timeout_scan = now;
            /* Dead peers give their sockets, mappings and endpoints back as soon as
             * no room refers to them: under decode churn a prefill context must not
             * keep every departed peer's resources until it is destroyed. */
            if (now - last_reap > 100000000ull) {
                reaped = kvw__peers_reap(ctx, kvw__stage_peer_waits);
                last_reap = now;
            }
        }
        kvw__run_deferred(ctx);
        /* Small rooms that the requests just read made ready go out from here, without
         * a worker's wake-up; whatever is left wakes the workers. */
        if (!kvw__queue_empty(ctx)) {
            kvw__ctrl_serve(ctx);
            kvw__run_deferred(ctx);
        }
        kvw__queue_kick(ctx);
        /* Peers with queued frames, copied under the lock: registration threads may
         * grow the peer table meanwhile. Peers are never freed before the context. */
        uint32_t nf = 0;
        for (uint32_t i = 0; i < kvw__peer_count(ctx) && nf < cap; i++)
            if (kvw__peer_tx_queued(kvw__peer_at(ctx, i)) && !kvw__peer_at(ctx, i)->dead)
                flush[nf++] = kvw__peer_at(ctx, i);
        pthread_mutex_unlock(&ctx->mu);
        kvw__peer_res_release(ctx, reaped);
        for (uint32_t i = 0; i < nf; i++)
            kvw__peer_flush(ctx, flush[i], false);
    }
    free(pfd);
    free(flush);
    free(polled);
    free(pass);
    return NULL;
}
