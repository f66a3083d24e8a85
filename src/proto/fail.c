/*
 * Peer death and room failure, one way:
 *  - a peer's death (kvw__peer_dead) fails the rooms that involve it;
 *  - a room's failure (kvw__room_fail) marks the room and queues what is left to do
 *    (give back its staging spans once no source can write them, tell its peers),
 *    which the control thread runs
 *    (kvw__run_deferred, ctrl.c). Nothing here sends a frame or touches the staging
 *    credits, so nothing below can fail a room or a peer in turn.
 */
#include "proto/proto.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

/* Marks a peer dead and fails every room that involves it. mu held. */
void kvw__peer_dead(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_status_t status,
                    const char *reason)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (peer->dead)
        return;
    peer->dead = true;
    if (!peer->registering)
        kvw__metrics_peer_died(ctx);
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
        /* A room that failed before (its spans held for this source) may be quiet now. */
        if (involved && r->state != KVW_ROOM_FAILED)
            kvw__room_fail(ctx, r, status, false, "%s: %s", peer->desc, reason);
        else
            kvw__room_release_quiet(ctx, r);
    }
}

/* A new effect of room `r` (NULL: out of memory; the peers then learn of the failure
 * through their own timeouts). */
static kvw_room_effect_t *kvw_effect_new(const kvw_room_t *r)
{
    kvw_room_effect_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        kvw__log(KVW_LOG_WARN, "room %llu: out of memory queueing its failure's effects",
                 (unsigned long long)r->id);
        return NULL;
    }
    e->room = r->id;
    snprintf(e->reason, sizeof(e->reason), "%s", r->reason);
    return e;
}

static void kvw_effect_frame(kvw_room_effect_t *e, uint32_t peer, uint8_t type,
                             kvw_status_t status, bool stopped)
{
    if (e->num_frames == e->cap_frames) {
        uint32_t cap = e->cap_frames ? e->cap_frames * 2 : 4;
        kvw_room_frame_t *n = realloc(e->frames, sizeof(*n) * cap);
        if (n == NULL) {
            kvw__log(KVW_LOG_WARN, "room %llu: out of memory queueing a frame of its failure",
                     (unsigned long long)e->room);
            return;
        }
        e->frames = n;
        e->cap_frames = cap;
    }
    e->frames[e->num_frames++] =
        (kvw_room_frame_t){.peer = peer, .type = type, .status = status, .stopped = stopped};
}

/* Queues an effect (mu held) and wakes the control thread to run it. */
static void kvw_effect_push(struct kvw_ctx *ctx, kvw_room_effect_t *e)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (e == NULL)
        return;
    if (!e->release_stage && e->num_frames == 0) {
        kvw__room_effect_free(e);
        return;
    }
    if (ctx->defer.tail)
        ctx->defer.tail->next = e;
    else
        ctx->defer.head = e;
    ctx->defer.tail = e;
    kvw__ctx_wake(ctx);
}

kvw_room_effect_t *kvw__room_effects_take(struct kvw_ctx *ctx)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_room_effect_t *list = ctx->defer.head;
    ctx->defer.head = ctx->defer.tail = NULL;
    return list;
}

void kvw__room_effect_free(kvw_room_effect_t *e)
{
    if (e) {
        free(e->frames);
        free(e);
    }
}

void kvw__room_effects_fini(struct kvw_ctx *ctx)
{
    while (ctx->defer.head) {
        kvw_room_effect_t *e = ctx->defer.head;
        ctx->defer.head = e->next;
        kvw__room_effect_free(e);
    }
    ctx->defer.tail = NULL;
}

/* Decode: whether no source of room r can still write into this rank (its pages or its
 * staging area): each one sent its last bytes, confirmed it stopped (ABORT_ACK) or is
 * gone. */
bool kvw__room_quiet(struct kvw_ctx *ctx, const kvw_room_t *r)
{
    KVW_ASSERT_HELD(&ctx->mu);
    for (uint32_t i = 0; i < r->num_srcs; i++) {
        const kvw_room_src_t *s = &r->srcs[i];
        if (!s->done && !s->quiet && !kvw__peer_at(ctx, s->peer)->dead)
            return false;
    }
    return true;
}

/*
 * Decode: a failed room's staging spans go back once it is quiet, not when it fails. A
 * prefill rank may be in the middle of writing a granted span when the room fails here
 * (a one-sided shm or ucx put cannot be stopped by the receiver), and a span granted to
 * another room meanwhile would take those late bytes. Called when a source confirms it
 * stopped or dies; the room's destruction gives back whatever is left in any case.
 */
void kvw__room_release_quiet(struct kvw_ctx *ctx, kvw_room_t *r)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (r->is_sender || r->state != KVW_ROOM_FAILED || !kvw__room_quiet(ctx, r))
        return;
    kvw_room_effect_t *e = kvw_effect_new(r);
    if (e == NULL)
        return; /* given back when the room is destroyed */
    e->release_stage = true;
    kvw_effect_push(ctx, e);
}

/* The ABORT_ACKs of kvw__room_quiesce, into effect e. */
static void kvw_quiesce_into(kvw_room_t *r, kvw_room_effect_t *e)
{
    if (!r->is_sender || r->state != KVW_ROOM_FAILED || r->inflight || r->quiesce_sent)
        return;
    r->quiesce_sent = true;
    for (uint32_t i = 0; e && i < r->num_dsts; i++)
        kvw_effect_frame(e, r->dsts[i].peer, KVW_MSG_ABORT_ACK, KVW_ERR_ABORTED, true);
}

/*
 * A failed prefill room tells its decode ranks, once no worker step runs on it any
 * more, that it will not write their pages again (ABORT_ACK). A decode rank destroying
 * a room waits for that before the engine may reuse the pages: one-sided transports
 * cannot be stopped by the receiver. The frames go through the effects queue, behind
 * the room's FAILED frames.
 */
void kvw__room_quiesce(struct kvw_ctx *ctx, kvw_room_t *r)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (!r->is_sender || r->state != KVW_ROOM_FAILED || r->inflight || r->quiesce_sent)
        return;
    kvw_room_effect_t *e = kvw_effect_new(r);
    kvw_quiesce_into(r, e);
    kvw_effect_push(ctx, e);
}

/* Marks the room failed and queues its effects: the control thread gives back its
 * staging spans and sends its frames (kvw__run_deferred). */
/* kvw__room_fail, and with `notify` on a decode room, no ABORT to source peer `skip`
 * (UINT32_MAX: none skipped). */
static void kvw_room_vfail(struct kvw_ctx *ctx, kvw_room_t *room, kvw_status_t status,
                           bool notify, uint32_t skip, const char *fmt, va_list ap)
{
    KVW_ASSERT_HELD(&ctx->mu);
    if (room->state == KVW_ROOM_FAILED || room->state == KVW_ROOM_SUCCESS)
        return;
    kvw__metrics_room_moves(room, KVW_ROOM_FAILED, status);
    room->state = KVW_ROOM_FAILED;
    room->status = status;
    room->end_ns = kvw__now_ns();
    vsnprintf(room->reason, sizeof(room->reason), fmt, ap);
    kvw__log(KVW_LOG_WARN, "%s room %llu failed (%s): %s", room->is_sender ? "prefill" : "decode",
             (unsigned long long)room->id, kvw_status_string(status), room->reason);
    kvw_room_effect_t *e = kvw_effect_new(room);
    /* Its staging spans go back now only if no source can still be writing them
     * (kvw__room_release_quiet gives them back later otherwise); a no-op without a
     * staging area. */
    if (e)
        e->release_stage = !room->is_sender && kvw__room_quiet(ctx, room);
    pthread_cond_broadcast(&ctx->cv);
    atomic_fetch_add_explicit(&ctx->done_gen, 1, memory_order_release);
    pthread_cond_broadcast(&ctx->done_cv);
    /* Tell the other side: prefill reports FAILED to its decode ranks; decode aborts
     * the room on its prefill ranks. */
    if (notify && room->is_sender) {
        for (uint32_t i = 0; e && i < room->num_dsts; i++)
            kvw_effect_frame(e, room->dsts[i].peer, KVW_MSG_FAILED, status, false);
    } else if (notify && room->num_srcs == 0 && room->inst < ctx->insts.num) {
        /* Not posted yet, or posted while its instance is being connected: no prefill
         * rank knows the room from this rank, but its sender may be waiting for it.
         * The ranks of the room's DP group hear of the abort now, or, while the
         * instance is being connected, once the connection is up. */
        const kvw_inst_t *in = kvw__inst_at(ctx, room->inst);
        uint32_t gen = room->pending ? room->inst_gen : in->gen;
        bool later = room->pending || in->state == KVW_INST_CONNECTING;
        for (uint32_t i = 0; e && !later && in->state == KVW_INST_READY && i < ctx->peers.num;
             i++) {
            const kvw_peer_t *p = ctx->peers.tab[i];
            if (p->dp == room->src_dp && p->inst == room->inst && p->inst_gen == gen &&
                !p->dead && !p->registering)
                kvw_effect_frame(e, i, KVW_MSG_ABORT, status, false);
        }
        if (later)
            kvw__late_abort_add(ctx, room->inst, gen, room->src_dp, room->id, status,
                                room->reason);
    } else if (notify) {
        for (uint32_t i = 0; e && i < room->num_srcs; i++)
            if (room->srcs[i].peer != skip)
                kvw_effect_frame(e, room->srcs[i].peer, KVW_MSG_ABORT, status, false);
    }
    kvw_quiesce_into(room, e);
    kvw_effect_push(ctx, e);
    if (notify)
        pthread_cond_broadcast(&ctx->cv);
}

void kvw__room_fail(struct kvw_ctx *ctx, kvw_room_t *room, kvw_status_t status, bool notify,
                    const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvw_room_vfail(ctx, room, status, notify, UINT32_MAX, fmt, ap);
    va_end(ap);
}

void kvw__room_fail_from(struct kvw_ctx *ctx, kvw_room_t *room, kvw_status_t status,
                         uint32_t from, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    /* A room not posted yet has no sources: nothing to tell (the branch for it aborts
     * on the whole DP group, which is not this failure's business). */
    kvw_room_vfail(ctx, room, status, !room->is_sender && room->num_srcs > 0, from, fmt, ap);
    va_end(ap);
}
