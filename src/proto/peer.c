/* Peer records: adding, freeing and reaping peers (a dead peer gives back its socket,
 * keys and endpoint once no room names it), their outgoing queue, the session tag of
 * control frames, and the control thread's wake-up. Calls only wire.c of proto. */
#include "core/sha256.h"
#include "proto/proto.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void kvw__ctx_wake(struct kvw_ctx *ctx)
{
    if (write(ctx->wake_fd[1], "w", 1) < 0) {
        /* A full pipe already guarantees a wake-up. */
    }
}

void kvw__peer_doom(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_status_t status,
                    const char *reason)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (peer->dead || peer->doomed)
        return;
    peer->doomed = true;
    peer->doom_status = status;
    snprintf(peer->doom_why, sizeof(peer->doom_why), "%s", reason ? reason : "");
    kvw__peer_drop_out(peer);
    kvw__ctx_wake(ctx);
}

/* Tag of one control frame under a peer's session key: direction, sequence number,
 * frame type and payload. */
void kvw__frame_tag(const kvw_peer_t *peer, uint8_t dir, uint64_t seq, uint8_t type,
                    const uint8_t *payload, size_t n, uint8_t out[32])
{
    uint8_t head[10];
    head[0] = dir;
    head[1] = type;
    for (int i = 0; i < 8; i++)
        head[2 + i] = (uint8_t)(seq >> (8 * i));
    kvw_hmac_t h;
    kvw__hmac_init(&h, peer->skey, sizeof(peer->skey));
    kvw__hmac_update(&h, head, sizeof(head));
    if (n)
        kvw__hmac_update(&h, payload, n);
    kvw__hmac_final(&h, out);
}

/*
 * Queues a frame for a peer (mu held). When nothing is queued or being written for
 * that peer, the frame is first written right here with one non-blocking send: the
 * hop through the control thread (a wake-up and a context switch on each side of every
 * request and confirmation) is the largest part of a small room's latency. Whatever
 * the socket does not take at once is queued, and the control thread writes the rest,
 * in order: frames of one peer never interleave, because a direct write happens only
 * when the queue is empty and the control thread is not inside a write (tx_busy), both
 * checked under mu.
 */
static void kvw_peer_send(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w, bool now)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (peer->authed && !peer->dead && !w->oom) {
        uint8_t tag[32];
        kvw__frame_tag(peer, peer->tx_dir, peer->tx_seq++, w->p[5], w->p + KVW_WIRE_HDR,
                       w->len - KVW_WIRE_HDR, tag);
        for (int i = 0; i < KVW_TAG; i++)
            kvw__wb_u8(w, tag[i]);
    }
    if (peer->dead || peer->doomed || kvw__wb_finish(w) != KVW_OK) {
        kvw__wb_free(w);
        return;
    }
    size_t off = 0;
    if (now && peer->out_head == NULL && !peer->tx_busy && peer->fd >= 0) {
        while (off < w->len) {
            ssize_t k = send(peer->fd, w->p + off, w->len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k > 0) {
                off += (size_t)k;
                continue;
            }
            if (k < 0 && errno == EINTR)
                continue;
            /* EAGAIN: the rest waits for the control thread; a real error shows there
             * too (the next write fails and declares the peer dead). */
            break;
        }
        if (off == w->len) {
            peer->last_tx_ns = kvw__now_ns();
            kvw__wb_free(w);
            return;
        }
    }
    kvw_outmsg_t *m = malloc(sizeof(*m));
    bool full = peer->out_bytes + (w->len - off) > KVW_MAX_OUT_BYTES;
    if (m == NULL || full) {
        char why[160];
        snprintf(why, sizeof(why), full ? "stopped reading: more than %u MiB of frames queued"
                                        : "out of memory queueing a frame",
                 KVW_MAX_OUT_BYTES >> 20);
        free(m);
        kvw__wb_free(w);
        kvw__peer_doom(ctx, peer, full ? KVW_ERR_PEER_DEAD : KVW_ERR_NO_MEMORY, why);
        return;
    }
    m->w = *w;
    m->off = off;
    m->next = NULL;
    peer->out_bytes += w->len - off;
    if (peer->out_tail)
        peer->out_tail->next = m;
    else
        peer->out_head = m;
    peer->out_tail = m;
    if (now)
        kvw__ctx_wake(ctx);
}

void kvw__peer_send(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w)
{
    kvw_peer_send(ctx, peer, w, true);
}

void kvw__peer_send_later(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w)
{
    kvw_peer_send(ctx, peer, w, false);
}

void kvw__peer_flush_after(struct kvw_ctx *ctx, kvw_peer_t *peer)
{
    kvw__peer_flush(ctx, peer, false);
    pthread_mutex_lock(&ctx->mu);
    /* What the socket did not take (or another thread is writing) is the control
     * thread's, which polls for it once woken. */
    if (kvw__peer_tx_queued(peer) && !peer->dead)
        kvw__ctx_wake(ctx);
    pthread_mutex_unlock(&ctx->mu);
}

static void kvw_room_msg(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, uint64_t room,
                         kvw_status_t status, const char *reason, bool now)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_wbuf_t w;
    kvw__wb_init(&w, type);
    kvw__wb_u64(&w, room);
    kvw__wb_u32(&w, (uint32_t)(int32_t)status);
    /* At most the 255 bytes the reader takes (dispatch.c): a longer reason (a room's
     * holds 319, and failures quote each other) would make the whole frame malformed. */
    char cut[256];
    snprintf(cut, sizeof(cut), "%s", reason ? reason : "");
    kvw__wb_str(&w, cut);
    kvw_peer_send(ctx, peer, &w, now);
}

void kvw__send_room_msg(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, uint64_t room,
                        kvw_status_t status, const char *reason)
{
    kvw_room_msg(ctx, peer, type, room, status, reason, true);
}

void kvw__send_room_msg_later(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type,
                              uint64_t room, kvw_status_t status, const char *reason)
{
    kvw_room_msg(ctx, peer, type, room, status, reason, false);
}

/* Sends queued frames; called without mu, takes it only to pop. */
/*
 * Writes a peer's queued frames without blocking: what the socket does not take stays at
 * the head of the queue (m->off) and the control thread polls for POLLOUT. A peer that
 * stops reading therefore never holds the control thread; it is declared dead once its
 * queue made no progress for the peer timeout (see the control loop) or grew past
 * KVW_MAX_OUT_BYTES (kvw__peer_send). `blocking`: at shutdown, finish within the peer
 * timeout instead (the peer must not learn of a completion or an abort only from the
 * closed connection).
 */
void kvw__peer_flush(struct kvw_ctx *ctx, kvw_peer_t *peer, bool blocking)
{
    for (;;) {
        /* The head frame leaves the queue while it is written outside mu (a peer's death
         * meanwhile frees the queue, not this frame); tx_busy keeps direct sends out. */
        pthread_mutex_lock(&ctx->mu);
        /* One writer at a time: a frame being written by another thread (tx_busy) is
         * followed by the rest of the queue from that thread. */
        kvw_outmsg_t *m = peer->dead || peer->fd < 0 || peer->tx_busy ? NULL : peer->out_head;
        if (m) {
            peer->out_head = m->next;
            if (peer->out_head == NULL)
                peer->out_tail = NULL;
            peer->tx_busy = true;
        }
        pthread_mutex_unlock(&ctx->mu);
        if (m == NULL)
            return;
        size_t left = m->w.len - m->off;
        kvw_status_t st = KVW_OK;
        ssize_t k = 0;
        if (blocking) {
            st = kvw__sock_send_all(peer->fd, m->w.p + m->off, left,
                                    kvw__now_ns() + (uint64_t)ctx->peer_timeout_ms * 1000000ull);
            k = st == KVW_OK ? (ssize_t)left : 0;
        } else {
            do
                k = send(peer->fd, m->w.p + m->off, left, MSG_DONTWAIT | MSG_NOSIGNAL);
            while (k < 0 && errno == EINTR);
            if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
                st = kvw__error(KVW_ERR_CONN_CLOSED, "send: %s", strerror(errno));
        }
        pthread_mutex_lock(&ctx->mu);
        peer->tx_busy = false;
        bool keep = false;
        if (st != KVW_OK) {
            kvw__peer_doom(ctx, peer, st, kvw_last_error());
        } else {
            if (k > 0) {
                m->off += (size_t)k;
                peer->out_bytes -= KVW_MIN((uint64_t)k, peer->out_bytes);
                peer->tx_stall_ns = 0;
                peer->last_tx_ns = kvw__now_ns();
            } else if (peer->tx_stall_ns == 0) {
                peer->tx_stall_ns = kvw__now_ns(); /* the socket is full: wait for POLLOUT */
            }
            if (m->off < m->w.len && !peer->dead && !peer->doomed) {
                /* Back at the head, ahead of whatever was queued meanwhile. */
                m->next = peer->out_head;
                peer->out_head = m;
                if (peer->out_tail == NULL)
                    peer->out_tail = m;
                keep = true;
            }
        }
        bool again = st == KVW_OK && !keep;
        pthread_mutex_unlock(&ctx->mu);
        if (!keep) {
            kvw__wb_free(&m->w);
            free(m);
        }
        if (!again)
            return;
    }
}

bool kvw__peer_tx_stalled(const kvw_peer_t *p, uint64_t now, uint32_t limit_ms, char *why,
                          size_t cap)
{
    if (p->tx_stall_ns == 0 || now - p->tx_stall_ns <= (uint64_t)limit_ms * 1000000ull)
        return false;
    snprintf(why, cap, "stopped reading: %llu bytes of frames waited %u ms",
             (unsigned long long)p->out_bytes, limit_ms);
    return true;
}

void kvw__peer_drop_out(kvw_peer_t *peer)
{
    while (peer->out_head) {
        kvw_outmsg_t *m = peer->out_head;
        peer->out_head = m->next;
        kvw__wb_free(&m->w);
        free(m);
    }
    peer->out_tail = NULL;
    peer->out_bytes = 0;
}

kvw_peer_t *kvw__peer_add(struct kvw_ctx *ctx, int fd)
{
    if (ctx->peers.num == ctx->peers.cap) {
        uint32_t cap = ctx->peers.cap ? ctx->peers.cap * 2 : 16;
        kvw_peer_t **n = realloc(ctx->peers.tab, sizeof(*n) * cap);
        if (n == NULL)
            return NULL;
        ctx->peers.tab = n;
        ctx->peers.cap = cap;
    }
    kvw_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->id = ctx->peers.num;
    p->fd = fd;
    p->last_rx_ns = p->last_tx_ns = kvw__now_ns();
    ctx->peers.tab[ctx->peers.num++] = p;
    return p;
}

/* Whether a dead peer can give up its resources: no room still names it (as a decode
 * rank it writes or a prefill rank it reads from), no staging request of its waits,
 * nothing of it is being written. mu held. */
static bool kvw_peer_reapable(struct kvw_ctx *ctx, const kvw_peer_t *p, kvw_peer_busy_fn busy)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (!p->dead || p->reaped || p->registering || p->tx_busy)
        return false;
    if (busy && busy(ctx, p->id))
        return false;
    for (const kvw_room_t *r = kvw__room_first(ctx); r; r = kvw__room_next(ctx, r)) {
        for (uint32_t i = 0; i < r->num_dsts; i++)
            if (r->dsts[i].peer == p->id)
                return false;
        for (uint32_t i = 0; i < r->num_srcs; i++)
            if (r->srcs[i].peer == p->id)
                return false;
    }
    return true;
}

/* Moves a peer's socket, keys, endpoint, ranks and payload into *res (its outgoing
 * queue is dropped). */
static void kvw_peer_detach(kvw_peer_t *p, kvw_peer_res_t *res)
{
    kvw__peer_drop_out(p);
    *res = (kvw_peer_res_t){.fd = p->fd, .rkeys = p->rkeys, .num_rkeys = p->num_rkeys,
                            .staging_rkey = p->staging_rkey, .ep = p->ep, .remote = p->remote,
                            .mapped = p->mapped, .payload = p->payload};
    p->fd = -1, p->rkeys = NULL, p->num_rkeys = 0, p->staging_rkey = NULL, p->ep = NULL;
    p->remote = p->mapped = NULL, p->payload = NULL;
}

/* Releases what kvw_peer_detach moved (not res itself). */
static void kvw_peer_res_close(struct kvw_ctx *ctx, kvw_peer_res_t *res)
{
    if (res->fd >= 0)
        close(res->fd);
    for (uint32_t i = 0; i < res->num_rkeys; i++)
        if (res->rkeys[i])
            ctx->tl_ops->rkey_release(res->rkeys[i]);
    free(res->rkeys);
    if (res->staging_rkey)
        ctx->tl_ops->rkey_release(res->staging_rkey);
    if (res->ep)
        ctx->tl_ops->ep_close(res->ep);
    kvw_rank_destroy(res->remote);
    kvw_rank_destroy(res->mapped);
    free(res->payload);
}

/* Detaches the resources of every dead peer nothing refers to any more (mu held);
 * the caller releases the list with kvw__peer_res_release after unlocking. The peer's
 * small record stays (its id indexes the peer table). */
kvw_peer_res_t *kvw__peers_reap(struct kvw_ctx *ctx, kvw_peer_busy_fn busy)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_peer_res_t *list = NULL;
    for (uint32_t i = 0; i < ctx->peers.num; i++) {
        kvw_peer_t *p = ctx->peers.tab[i];
        if (!kvw_peer_reapable(ctx, p, busy))
            continue;
        kvw_peer_res_t *res = calloc(1, sizeof(*res));
        if (res == NULL)
            break;
        kvw_peer_detach(p, res);
        res->next = list;
        p->reaped = true;
        list = res;
    }
    return list;
}

void kvw__peer_res_release(struct kvw_ctx *ctx, kvw_peer_res_t *list)
{
    while (list) {
        kvw_peer_res_t *res = list;
        list = res->next;
        kvw_peer_res_close(ctx, res);
        free(res);
    }
}

void kvw__peer_free(struct kvw_ctx *ctx, kvw_peer_t *p)
{
    kvw_peer_res_t res;
    kvw_peer_detach(p, &res);
    kvw_peer_res_close(ctx, &res);
    free(p);
}
