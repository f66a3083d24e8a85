/* Peer records: adding, freeing and reaping peers (a dead peer gives back its socket,
 * keys and endpoint once no room names it), their outgoing queue, the session tag of
 * control frames, and the control thread's wake-up. Calls only wire.c of proto. */
#include "core/sha256.h"
#include "proto/proto.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

void kvw__ctx_wake(struct kvw_ctx *ctx)
{
    if (write(ctx->wake_fd[1], "w", 1) < 0) {
        /* A full pipe already guarantees a wake-up. */
    }
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
static bool kvw_peer_reapable(struct kvw_ctx *ctx, const kvw_peer_t *p)
{
    if (!p->dead || p->reaped || p->registering || p->tx_busy)
        return false;
    for (uint32_t i = 0; i < ctx->stage.num_waits; i++)
        if (ctx->stage.waits[i].peer == p->id)
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
kvw_peer_res_t *kvw__peers_reap(struct kvw_ctx *ctx)
{
    kvw_peer_res_t *list = NULL;
    for (uint32_t i = 0; i < ctx->peers.num; i++) {
        kvw_peer_t *p = ctx->peers.tab[i];
        if (!kvw_peer_reapable(ctx, p))
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
