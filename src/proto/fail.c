/*
 * One recursion, kept in one file because its functions call each other in a circle:
 *  - frames out to a peer (kvw__peer_send): a peer that cannot take one more is dead;
 *  - a peer's death (kvw__peer_dead) fails the rooms that involve it;
 *  - a room's failure (kvw__room_fail) tells its peers, by frames, and gives back the
 *    room's staging spans (decode);
 *  - the staging credits (decode): a span given back goes to the next waiter, by a
 *    frame (STAGE_GRANT); a STAGE_ASK that breaks the rules fails its room or peer.
 * Every other file of proto sits above or below this one (see proto.h).
 */
#include "proto/proto.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

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
void kvw__peer_send(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w)
{
    if (peer->authed && !peer->dead && !w->oom) {
        uint8_t tag[32];
        kvw__frame_tag(peer, peer->tx_dir, peer->tx_seq++, w->p[5], w->p + KVW_WIRE_HDR,
                       w->len - KVW_WIRE_HDR, tag);
        for (int i = 0; i < KVW_TAG; i++)
            kvw__wb_u8(w, tag[i]);
    }
    if (peer->dead || kvw__wb_finish(w) != KVW_OK) {
        kvw__wb_free(w);
        return;
    }
    size_t off = 0;
    if (peer->out_head == NULL && !peer->tx_busy && peer->fd >= 0) {
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
        kvw__peer_dead(ctx, peer, full ? KVW_ERR_PEER_DEAD : KVW_ERR_NO_MEMORY, why);
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
    kvw__ctx_wake(ctx);
}

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
    if (ctx->side == KVW_SIDE_DECODE && peer->inst < ctx->insts.num) {
        kvw_inst_t *in = &ctx->insts.tab[peer->inst];
        if (in->gen == peer->inst_gen && in->state == KVW_INST_READY) {
            in->state = KVW_INST_DOWN;
            snprintf(in->why, sizeof(in->why), "%s: %s", peer->desc, reason);
        }
    }
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

static bool kvw_stage_try(struct kvw_ctx *ctx, kvw_peer_t *peer, uint64_t room, uint64_t len)
{
    /* First fit between the sorted spans; 64-byte aligned offsets keep copies fast. */
    uint64_t at = 0;
    uint32_t i = 0;
    for (; i <= ctx->stage.num_spans; i++) {
        uint64_t end = i < ctx->stage.num_spans ? ctx->stage.spans[i].off : ctx->stage.len;
        if (end >= at && end - at >= len)
            break;
        if (i < ctx->stage.num_spans)
            at = (ctx->stage.spans[i].off + ctx->stage.spans[i].len + 63) & ~(uint64_t)63;
    }
    if (i > ctx->stage.num_spans)
        return false;
    if (ctx->stage.num_spans == ctx->stage.cap_spans) {
        uint32_t cap = ctx->stage.cap_spans ? ctx->stage.cap_spans * 2 : 16;
        kvw_stage_span_t *n = realloc(ctx->stage.spans, sizeof(*n) * cap);
        if (n == NULL)
            return false;
        ctx->stage.spans = n;
        ctx->stage.cap_spans = cap;
    }
    memmove(&ctx->stage.spans[i + 1], &ctx->stage.spans[i], sizeof(*ctx->stage.spans) * (ctx->stage.num_spans - i));
    ctx->stage.spans[i] = (kvw_stage_span_t){.off = at, .len = len, .room = room};
    ctx->stage.num_spans++;
    kvw_wbuf_t w;
    kvw__wb_init(&w, KVW_MSG_STAGE_GRANT);
    kvw__wb_u64(&w, room);
    kvw__wb_u64(&w, at);
    kvw__wb_u64(&w, len);
    kvw__peer_send(ctx, peer, &w);
    return true;
}

void kvw__stage_ask(struct kvw_ctx *ctx, kvw_peer_t *peer, uint64_t room, uint64_t len)
{
    kvw_room_t *r = kvw__room_find(ctx, room);
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED || len == 0 ||
        len > ctx->stage.len) {
        if (r && !r->is_sender)
            kvw__room_fail(ctx, r, KVW_ERR_OUT_OF_RANGE, true,
                           "%s asked for %llu bytes of staging (the area has %llu)", peer->desc,
                           (unsigned long long)len, (unsigned long long)ctx->stage.len);
        return;
    }
    /* Only a prefill rank that writes this room may ask for space for it (anyone else is
     * not speaking the protocol: its connection goes), and it asks for one window at a
     * time: a second request before the first was granted fails the room. This bounds
     * the waiting list by the rooms' sources. */
    bool src = false;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        src |= r->srcs[i].peer == peer->id;
    if (!src) {
        char why[96];
        snprintf(why, sizeof(why), "asked for staging space for room %llu, which it does not "
                 "write", (unsigned long long)room);
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, why);
        return;
    }
    for (uint32_t i = 0; i < ctx->stage.num_waits; i++)
        if (ctx->stage.waits[i].room == room && ctx->stage.waits[i].peer == peer->id) {
            kvw__room_fail(ctx, r, KVW_ERR_MALFORMED, true,
                           "%s asked for staging space for room %llu again before its previous "
                           "request was granted", peer->desc, (unsigned long long)room);
            return;
        }
    /* Waiters are served in order, so a large request is not starved by small ones. */
    if (ctx->stage.num_waits == 0 && kvw_stage_try(ctx, peer, room, len))
        return;
    if (ctx->stage.num_waits == ctx->stage.cap_waits) {
        uint32_t cap = ctx->stage.cap_waits ? ctx->stage.cap_waits * 2 : 16;
        kvw_stage_wait_t *n = realloc(ctx->stage.waits, sizeof(*n) * cap);
        if (n == NULL) {
            kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory queuing staging");
            return;
        }
        ctx->stage.waits = n;
        ctx->stage.cap_waits = cap;
    }
    ctx->stage.waits[ctx->stage.num_waits++] = (kvw_stage_wait_t){.peer = peer->id, .room = room, .len = len};
}

void kvw__stage_free(struct kvw_ctx *ctx, uint64_t off)
{
    for (uint32_t i = 0; i < ctx->stage.num_spans; i++)
        if (ctx->stage.spans[i].off == off) {
            memmove(&ctx->stage.spans[i], &ctx->stage.spans[i + 1],
                    sizeof(*ctx->stage.spans) * (ctx->stage.num_spans - i - 1));
            ctx->stage.num_spans--;
            break;
        }
    while (ctx->stage.num_waits) {
        kvw_stage_wait_t w = ctx->stage.waits[0];
        kvw_room_t *r = kvw__room_find(ctx, w.room);
        bool live = r && r->state != KVW_ROOM_FAILED && !ctx->peers.tab[w.peer]->dead;
        if (live && !kvw_stage_try(ctx, ctx->peers.tab[w.peer], w.room, w.len))
            break;
        memmove(&ctx->stage.waits[0], &ctx->stage.waits[1], sizeof(*ctx->stage.waits) * (ctx->stage.num_waits - 1));
        ctx->stage.num_waits--;
    }
}

/* Frees every span a room holds (when it ends). */
static void kvw_stage_release_room(struct kvw_ctx *ctx, uint64_t room)
{
    for (uint32_t i = 0; i < ctx->stage.num_spans;) {
        if (ctx->stage.spans[i].room == room) {
            kvw__stage_free(ctx, ctx->stage.spans[i].off);
            i = 0;
        } else {
            i++;
        }
    }
}

void kvw__send_room_msg(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, uint64_t room,
                        kvw_status_t status, const char *reason)
{
    kvw_wbuf_t w;
    kvw__wb_init(&w, type);
    kvw__wb_u64(&w, room);
    kvw__wb_u32(&w, (uint32_t)(int32_t)status);
    kvw__wb_str(&w, reason);
    kvw__peer_send(ctx, peer, &w);
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
        kvw__send_room_msg(ctx, ctx->peers.tab[r->dsts[i].peer], KVW_MSG_ABORT_ACK, r->id,
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
    if (!room->is_sender && ctx->stage.buf)
        kvw_stage_release_room(ctx, room->id);
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
            kvw__send_room_msg(ctx, ctx->peers.tab[room->dsts[i].peer], KVW_MSG_FAILED, room->id, status,
                               room->reason);
        kvw__room_quiesce(ctx, room);
    } else if (room->pending) {
        /* Posted while its instance is being connected: no prefill rank knows the room
         * yet. They hear of the abort once the connection is up. */
        if (ctx->insts.num_late == ctx->insts.cap_late) {
            uint32_t cap = ctx->insts.cap_late ? ctx->insts.cap_late * 2 : 16;
            kvw_late_abort_t *n = cap <= 65536 ? realloc(ctx->insts.late, sizeof(*n) * cap) : NULL;
            if (n)
                ctx->insts.late = n, ctx->insts.cap_late = cap;
        }
        if (ctx->insts.num_late < ctx->insts.cap_late) {
            kvw_late_abort_t *a = &ctx->insts.late[ctx->insts.num_late++];
            *a = (kvw_late_abort_t){.inst = room->inst, .gen = room->inst_gen,
                                    .dp = room->src_dp, .room = room->id, .status = status};
            snprintf(a->reason, sizeof(a->reason), "%.150s", room->reason);
        }
    } else {
        for (uint32_t i = 0; i < room->num_srcs; i++)
            kvw__send_room_msg(ctx, ctx->peers.tab[room->srcs[i].peer], KVW_MSG_ABORT, room->id, status,
                               room->reason);
    }
    pthread_cond_broadcast(&ctx->cv);
}
