/* Room table: the hash buckets of ctx->rooms and a room's allocation (find, new,
 * unlink, free). Calls only the write log (ivlog.c): every layer may use it. */
#include "proto/proto.h"

#include <stdlib.h>

static uint32_t kvw_room_bucket(uint64_t id)
{
    id ^= id >> 33;
    id *= 0xff51afd7ed558ccdull;
    id ^= id >> 33;
    return (uint32_t)(id % KVW_ROOM_BUCKETS);
}

kvw_room_t *kvw__room_find(struct kvw_ctx *ctx, uint64_t id)
{
    for (kvw_room_t *r = ctx->rooms[kvw_room_bucket(id)]; r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
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
    uint32_t b = kvw_room_bucket(id);
    r->next = ctx->rooms[b];
    ctx->rooms[b] = r;
    return r;
}

void kvw__room_unlink(struct kvw_ctx *ctx, kvw_room_t *room)
{
    for (kvw_room_t **pp = &ctx->rooms[kvw_room_bucket(room->id)]; *pp; pp = &(*pp)->next)
        if (*pp == room) {
            *pp = room->next;
            break;
        }
    /* Drop it from the worker queue too. */
    for (kvw_room_t **pp = &ctx->q_head; *pp; pp = &(*pp)->qnext)
        if (*pp == room) {
            *pp = room->qnext;
            break;
        }
    ctx->q_tail = NULL;
    for (kvw_room_t *q = ctx->q_head; q; q = q->qnext)
        ctx->q_tail = q;
    room->queued = false;
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
