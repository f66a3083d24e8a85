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

void kvw__room_unlink(struct kvw_ctx *ctx, kvw_room_t *room)
{
    (void)kvw__hmap_remove(&ctx->rooms, &room->hnode);
    kvw__unqueue_room(ctx, room); /* drop it from the worker queue too */
}

void kvw__room_free(kvw_room_t *r)
{
    for (uint32_t i = 0; i < r->num_dsts; i++) {
        free(r->dsts[i].store);
        free(r->dsts[i].sent);
    }
    free(r->dsts);
    for (uint32_t i = 0; i < r->num_chunks; i++) {
        free(r->chunks[i].store);
        free(r->chunks[i].ready);
    }
    free(r->chunks);
    for (uint32_t i = 0; i < r->num_srcs; i++)
        kvw__staged_close(r->srcs[i].scatter); /* a chunk the room ended in the middle of */
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
        if (!r->engine_owned)
            kvw__room_free(r);
        else
            r->ctx = NULL;
    }
    kvw__hmap_fini(&ctx->rooms);
}
