/* Room table: ctx->rooms (a hash map by id) and a room's allocation (find, iterate,
 * new, unlink, free). Calls only the write log (ivlog.c): every layer may use it. */
#include "proto/proto.h"

#include <stdlib.h>

static kvw_room_t *kvw_room_of(kvw_hnode_t *n)
{
    return n ? KVW_CONTAINER_OF(n, kvw_room_t, hnode) : NULL;
}

kvw_room_t *kvw__room_find(struct kvw_ctx *ctx, uint64_t id)
{
    return kvw_room_of(kvw__hmap_find(&ctx->rooms, id));
}

kvw_room_t *kvw__room_first(struct kvw_ctx *ctx)
{
    return kvw_room_of(kvw__hmap_first(&ctx->rooms));
}

kvw_room_t *kvw__room_next(struct kvw_ctx *ctx, const kvw_room_t *r)
{
    return kvw_room_of(kvw__hmap_next(&ctx->rooms, &r->hnode));
}

kvw_room_t *kvw__room_new(struct kvw_ctx *ctx, uint64_t id, bool is_sender)
{
    kvw_room_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    r->ctx = ctx;
    r->serial = ++ctx->room_serial;
    r->id = id;
    r->is_sender = is_sender;
    r->dst_dp = -1;
    r->state = KVW_ROOM_BOOTSTRAPPING;
    r->created_ns = kvw__now_ns();
    r->deadline_ns = r->created_ns + (uint64_t)ctx->wait_timeout_ms * 1000000ull;
    kvw__hmap_insert(&ctx->rooms, &r->hnode, id);
    kvw__metrics_room_new(ctx);
    return r;
}

kvw_status_t kvw__room_new_by_peer(struct kvw_ctx *ctx, uint64_t id, kvw_peer_t *peer,
                                   kvw_room_t **room_p)
{
    *room_p = NULL;
    if (peer->pending_rooms >= ctx->cfg.max_peer_rooms) {
        /* Logged on the 1st, 2nd, 4th, ... refusal: a flood does not flood the log. */
        uint64_t n = ++peer->rooms_refused;
        if ((n & (n - 1)) == 0)
            kvw__log(KVW_LOG_WARN, "%s: %llu rooms refused, %u pending (KVW_MAX_PEER_ROOMS)",
                     peer->desc, (unsigned long long)n, peer->pending_rooms);
        return kvw__error(KVW_ERR_BUSY, "room %llu refused: %.160s already has %u rooms "
                          "this prefill rank's engine has not opened (KVW_MAX_PEER_ROOMS=%llu)",
                          (unsigned long long)id, peer->desc, peer->pending_rooms,
                          (unsigned long long)ctx->cfg.max_peer_rooms);
    }
    kvw_room_t *r = kvw__room_new(ctx, id, true);
    if (r == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "prefill rank out of memory accepting room %llu",
                          (unsigned long long)id);
    r->opener = peer->id + 1;
    peer->pending_rooms++;
    *room_p = r;
    return KVW_OK;
}

/* The peer that created the room no longer answers for it. */
static void kvw_room_drop_opener(struct kvw_ctx *ctx, kvw_room_t *r)
{
    if (r->opener && ctx && r->opener - 1 < kvw__peer_count(ctx)) {
        kvw_peer_t *p = kvw__peer_at(ctx, r->opener - 1);
        if (p->pending_rooms)
            p->pending_rooms--;
    }
    r->opener = 0;
}

void kvw__room_adopt(struct kvw_ctx *ctx, kvw_room_t *room)
{
    kvw_room_drop_opener(ctx, room);
    room->engine_owned = true;
}

void kvw__room_unlink(struct kvw_ctx *ctx, kvw_room_t *room)
{
    (void)kvw__hmap_remove(&ctx->rooms, &room->hnode);
    kvw__unqueue_room(ctx, room); /* drop it from the worker queue too */
}

void kvw__room_free(kvw_room_t *r)
{
    kvw_room_drop_opener(r->ctx, r);
    for (uint32_t i = 0; i < r->num_dsts; i++) {
        free(r->dsts[i].store);
        free(r->dsts[i].sent);
        free(r->dsts[i].digest);
    }
    free(r->dsts);
    for (uint32_t i = 0; i < r->num_chunks; i++) {
        free(r->chunks[i].store);
        free(r->chunks[i].ready);
    }
    free(r->chunks);
    for (uint32_t i = 0; i < r->num_srcs; i++) {
        kvw__staged_close(r->srcs[i].scatter); /* a chunk the room ended in the middle of */
        free(r->srcs[i].digest);
        free(r->srcs[i].mine);
    }
    free(r->srcs);
    for (int p = 0; p < KVW_NUM_POOLS; p++)
        free(r->granted[p]);
    free(r->post_store);
    free(r->meta);
    free(r->pend_store);
    kvw__ivlog_free(&r->writes);
    free(r);
}

void kvw__rooms_release(struct kvw_ctx *ctx)
{
    for (kvw_room_t *r = kvw__room_first(ctx), *next; r; r = next) {
        next = kvw__room_next(ctx, r);
        r->opener = 0; /* the peers are gone already */
        if (!r->engine_owned)
            kvw__room_free(r);
        else
            r->ctx = NULL;
    }
    kvw__hmap_fini(&ctx->rooms);
}
