/*
 * Peer death and room failure:
 *  - a peer's death (kvw__peer_dead) fails the rooms that involve it;
 *  - a room's failure (kvw__room_fail) tells its peers, by frames, and gives back the
 *    room's staging spans (decode, stage.c, whose credits may in turn fail a room).
 * Every other file of proto sits above or below this one (see proto.h).
 */
#include "proto/proto.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

/* Marks a peer dead and fails every room that involves it. mu held. */
void kvw__peer_dead(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_status_t status,
                    const char *reason)
{
    if (peer->dead)
        return;
    peer->dead = true;
    kvw__log(KVW_LOG_WARN, "peer %s is gone (%s): %s", peer->desc, kvw_status_string(status),
             reason ? reason : "");
    if (peer->fd >= 0) {
        shutdown(peer->fd, SHUT_RDWR);
    }
    /* Decode: a prefill instance with a dead rank is down; the next room that names it
     * connects again (a restarted instance). */
    if (ctx->side == KVW_SIDE_DECODE)
        kvw__inst_peer_down(ctx, peer, reason);
    kvw__peer_drop_out(peer);
    for (kvw_room_t *r = kvw__room_first(ctx); r; r = kvw__room_next(ctx, r)) {
        bool involved = false;
        /* A decode rank that already confirmed its bytes is no longer waited on. */
        for (uint32_t i = 0; i < r->num_dsts; i++)
            involved |= r->dsts[i].peer == peer->id && !r->dsts[i].acked;
        for (uint32_t i = 0; i < r->num_srcs; i++)
            involved |= r->srcs[i].peer == peer->id && !r->srcs[i].done;
        if (involved)
            kvw__room_fail(ctx, r, status, false, "%s: %s", peer->desc, reason);
    }
}

/*
 * A failed prefill room tells its decode ranks, once no worker step runs on it any
 * more, that it will not write their pages again (ABORT_ACK). A decode rank destroying
 * a room waits for that before the engine may reuse the pages: one-sided transports
 * cannot be stopped by the receiver.
 */
void kvw__room_quiesce(struct kvw_ctx *ctx, kvw_room_t *r)
{
    if (!r->is_sender || r->state != KVW_ROOM_FAILED || r->inflight || r->quiesce_sent)
        return;
    r->quiesce_sent = true;
    for (uint32_t i = 0; i < r->num_dsts; i++)
        kvw__send_room_msg(ctx, kvw__peer_at(ctx, r->dsts[i].peer), KVW_MSG_ABORT_ACK, r->id,
                           KVW_ERR_ABORTED, "stopped");
}

void kvw__room_fail(struct kvw_ctx *ctx, kvw_room_t *room, kvw_status_t status, bool notify,
                    const char *fmt, ...)
{
    if (room->state == KVW_ROOM_FAILED || room->state == KVW_ROOM_SUCCESS)
        return;
    room->state = KVW_ROOM_FAILED;
    room->status = status;
    room->end_ns = kvw__now_ns();
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(room->reason, sizeof(room->reason), fmt, ap);
    va_end(ap);
    kvw__log(KVW_LOG_WARN, "%s room %llu failed (%s): %s", room->is_sender ? "prefill" : "decode",
             (unsigned long long)room->id, kvw_status_string(status), room->reason);
    if (!room->is_sender && kvw__stage_present(ctx))
        kvw__stage_release_room(ctx, room->id);
    pthread_cond_broadcast(&ctx->cv);
    atomic_fetch_add_explicit(&ctx->done_gen, 1, memory_order_release);
    pthread_cond_broadcast(&ctx->done_cv);
    if (!notify) {
        kvw__room_quiesce(ctx, room);
        return;
    }
    /* Tell the other side: prefill reports FAILED to its decode ranks; decode aborts
     * the room on its prefill ranks. */
    if (room->is_sender) {
        for (uint32_t i = 0; i < room->num_dsts; i++)
            kvw__send_room_msg(ctx, kvw__peer_at(ctx, room->dsts[i].peer), KVW_MSG_FAILED, room->id, status,
                               room->reason);
        kvw__room_quiesce(ctx, room);
    } else if (room->pending) {
        /* Posted while its instance is being connected: no prefill rank knows the room
         * yet. They hear of the abort once the connection is up. */
        kvw__late_abort_add(ctx, room->inst, room->inst_gen, room->src_dp, room->id, status,
                            room->reason);
    } else {
        for (uint32_t i = 0; i < room->num_srcs; i++)
            kvw__send_room_msg(ctx, kvw__peer_at(ctx, room->srcs[i].peer), KVW_MSG_ABORT, room->id, status,
                               room->reason);
    }
    pthread_cond_broadcast(&ctx->cv);
}
