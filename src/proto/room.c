/*
 * Rooms: the per-request state machines on both sides, the frames that drive them,
 * the prefill worker that moves bytes, and the decode side's transport callbacks.
 */
#include "core/config.h"
#include "cuda/module.h"
#include "plan/walk.h"
#include "proto/proto.h"

#include <kvwire/cuda.h>

#include <errno.h>
#include <stdio.h>
#include <time.h>
#include <string.h>

struct kvw_sender {
    kvw_room_t *room;
    struct kvw_ctx *ctx;
};
struct kvw_receiver {
    kvw_room_t *room;
    struct kvw_ctx *ctx;
};

#define KVW_PUT_BATCH 512

/* ------------------------------------------------------------ room table */

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
    free(r->srcs);
    for (int p = 0; p < KVW_NUM_POOLS; p++)
        free(r->granted[p]);
    free(r->post_store);
    free(r->meta);
    free(r->pend_store);
    kvw__ivlog_free(&r->writes);
    free(r);
}

/* ------------------------------------------------------------ staging (decode) */

static bool kvw_stage_try(struct kvw_ctx *ctx, kvw_peer_t *peer, uint64_t room, uint64_t len)
{
    /* First fit between the sorted spans; 64-byte aligned offsets keep copies fast. */
    uint64_t at = 0;
    uint32_t i = 0;
    for (; i <= ctx->num_spans; i++) {
        uint64_t end = i < ctx->num_spans ? ctx->spans[i].off : ctx->staging_len;
        if (end >= at && end - at >= len)
            break;
        if (i < ctx->num_spans)
            at = (ctx->spans[i].off + ctx->spans[i].len + 63) & ~(uint64_t)63;
    }
    if (i > ctx->num_spans)
        return false;
    if (ctx->num_spans == ctx->cap_spans) {
        uint32_t cap = ctx->cap_spans ? ctx->cap_spans * 2 : 16;
        kvw_stage_span_t *n = realloc(ctx->spans, sizeof(*n) * cap);
        if (n == NULL)
            return false;
        ctx->spans = n;
        ctx->cap_spans = cap;
    }
    memmove(&ctx->spans[i + 1], &ctx->spans[i], sizeof(*ctx->spans) * (ctx->num_spans - i));
    ctx->spans[i] = (kvw_stage_span_t){.off = at, .len = len, .room = room};
    ctx->num_spans++;
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
        len > ctx->staging_len) {
        if (r && !r->is_sender)
            kvw__room_fail(ctx, r, KVW_ERR_OUT_OF_RANGE, true,
                           "%s asked for %llu bytes of staging (the area has %llu)", peer->desc,
                           (unsigned long long)len, (unsigned long long)ctx->staging_len);
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
    for (uint32_t i = 0; i < ctx->num_waits; i++)
        if (ctx->waits[i].room == room && ctx->waits[i].peer == peer->id) {
            kvw__room_fail(ctx, r, KVW_ERR_MALFORMED, true,
                           "%s asked for staging space for room %llu again before its previous "
                           "request was granted", peer->desc, (unsigned long long)room);
            return;
        }
    /* Waiters are served in order, so a large request is not starved by small ones. */
    if (ctx->num_waits == 0 && kvw_stage_try(ctx, peer, room, len))
        return;
    if (ctx->num_waits == ctx->cap_waits) {
        uint32_t cap = ctx->cap_waits ? ctx->cap_waits * 2 : 16;
        kvw_stage_wait_t *n = realloc(ctx->waits, sizeof(*n) * cap);
        if (n == NULL) {
            kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory queuing staging");
            return;
        }
        ctx->waits = n;
        ctx->cap_waits = cap;
    }
    ctx->waits[ctx->num_waits++] = (kvw_stage_wait_t){.peer = peer->id, .room = room, .len = len};
}

void kvw__stage_free(struct kvw_ctx *ctx, uint64_t off)
{
    for (uint32_t i = 0; i < ctx->num_spans; i++)
        if (ctx->spans[i].off == off) {
            memmove(&ctx->spans[i], &ctx->spans[i + 1],
                    sizeof(*ctx->spans) * (ctx->num_spans - i - 1));
            ctx->num_spans--;
            break;
        }
    while (ctx->num_waits) {
        kvw_stage_wait_t w = ctx->waits[0];
        kvw_room_t *r = kvw__room_find(ctx, w.room);
        bool live = r && r->state != KVW_ROOM_FAILED && !ctx->peers[w.peer]->dead;
        if (live && !kvw_stage_try(ctx, ctx->peers[w.peer], w.room, w.len))
            break;
        memmove(&ctx->waits[0], &ctx->waits[1], sizeof(*ctx->waits) * (ctx->num_waits - 1));
        ctx->num_waits--;
    }
}

/* Frees every span a room holds (when it ends). */
static void kvw_stage_release_room(struct kvw_ctx *ctx, uint64_t room)
{
    for (uint32_t i = 0; i < ctx->num_spans;) {
        if (ctx->spans[i].room == room) {
            kvw__stage_free(ctx, ctx->spans[i].off);
            i = 0;
        } else {
            i++;
        }
    }
}

void kvw__room_touch(struct kvw_ctx *ctx, kvw_room_t *room)
{
    room->deadline_ns = kvw__now_ns() + (uint64_t)ctx->wait_timeout_ms * 1000000ull;
}

void kvw__room_advance(kvw_room_t *room, kvw_room_state_t state)
{
    /* Monotonic: never back, never out of a terminal state. */
    if (room->state == KVW_ROOM_FAILED || room->state == KVW_ROOM_SUCCESS || state <= room->state)
        return;
    room->state = state;
    if (state == KVW_ROOM_TRANSFERRING && !room->start_ns)
        room->start_ns = kvw__now_ns();
    if (state == KVW_ROOM_SUCCESS) {
        room->end_ns = kvw__now_ns();
        room->hop_ns[KVW_HOP_SUCCESS] = room->end_ns;
        if (room->ctx) {
            atomic_fetch_add_explicit(&room->ctx->done_gen, 1, memory_order_release);
            pthread_cond_broadcast(&room->ctx->done_cv);
        }
    }
}

static void kvw_send_room_msg(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, uint64_t room,
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
static void kvw_room_quiesce(struct kvw_ctx *ctx, kvw_room_t *r)
{
    if (!r->is_sender || r->state != KVW_ROOM_FAILED || r->inflight || r->quiesce_sent)
        return;
    r->quiesce_sent = true;
    for (uint32_t i = 0; i < r->num_dsts; i++)
        kvw_send_room_msg(ctx, ctx->peers[r->dsts[i].peer], KVW_MSG_ABORT_ACK, r->id,
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
    if (!room->is_sender && ctx->staging)
        kvw_stage_release_room(ctx, room->id);
    pthread_cond_broadcast(&ctx->cv);
    atomic_fetch_add_explicit(&ctx->done_gen, 1, memory_order_release);
    pthread_cond_broadcast(&ctx->done_cv);
    if (!notify) {
        kvw_room_quiesce(ctx, room);
        return;
    }
    /* Tell the other side: prefill reports FAILED to its decode ranks; decode aborts
     * the room on its prefill ranks. */
    if (room->is_sender) {
        for (uint32_t i = 0; i < room->num_dsts; i++)
            kvw_send_room_msg(ctx, ctx->peers[room->dsts[i].peer], KVW_MSG_FAILED, room->id, status,
                              room->reason);
        kvw_room_quiesce(ctx, room);
    } else if (room->pending) {
        /* Posted while its instance is being connected: no prefill rank knows the room
         * yet. They hear of the abort once the connection is up. */
        if (ctx->num_late == ctx->cap_late) {
            uint32_t cap = ctx->cap_late ? ctx->cap_late * 2 : 16;
            kvw_late_abort_t *n = cap <= 65536 ? realloc(ctx->late, sizeof(*n) * cap) : NULL;
            if (n)
                ctx->late = n, ctx->cap_late = cap;
        }
        if (ctx->num_late < ctx->cap_late) {
            kvw_late_abort_t *a = &ctx->late[ctx->num_late++];
            *a = (kvw_late_abort_t){.inst = room->inst, .gen = room->inst_gen,
                                    .dp = room->src_dp, .room = room->id, .status = status};
            snprintf(a->reason, sizeof(a->reason), "%.150s", room->reason);
        }
    } else {
        for (uint32_t i = 0; i < room->num_srcs; i++)
            kvw_send_room_msg(ctx, ctx->peers[room->srcs[i].peer], KVW_MSG_ABORT, room->id, status,
                              room->reason);
    }
    pthread_cond_broadcast(&ctx->cv);
}

void kvw__late_aborts_flush(struct kvw_ctx *ctx, uint32_t inst, uint32_t gen, bool connected)
{
    uint32_t kept = 0;
    for (uint32_t i = 0; i < ctx->num_late; i++) {
        kvw_late_abort_t *a = &ctx->late[i];
        if (a->inst != inst || a->gen != gen) {
            ctx->late[kept++] = *a;
            continue;
        }
        for (uint32_t k = 0; connected && k < ctx->num_peers; k++) {
            kvw_peer_t *p = ctx->peers[k];
            if (p->inst == inst && p->inst_gen == gen && p->dp == a->dp && !p->dead &&
                !p->registering)
                kvw_send_room_msg(ctx, p, KVW_MSG_ABORT, a->room, a->status, a->reason);
        }
    }
    ctx->num_late = kept;
}

/* What a prefill room still waits for, for its timeout message. */
static void kvw_room_waiting(struct kvw_ctx *ctx, kvw_room_t *r, char *buf, size_t cap)
{
    if (r->dst_dp < 0) {
        snprintf(buf, cap, " (no decode rank posted the room)");
        return;
    }
    uint32_t group = 0, connected = 0, needed = 0;
    for (uint32_t i = 0; i < ctx->num_peers; i++)
        if (ctx->peers[i]->dp == (uint32_t)r->dst_dp && !ctx->peers[i]->dead &&
            ctx->peers[i]->instance == r->dst_instance) {
            group = ctx->peers[i]->remote_group_size;
            connected++;
            needed += ctx->peers[i]->needed;
        }
    snprintf(buf, cap, " (decode DP group %d: %u of %u ranks registered, %u of %u that need this "
             "rank posted)", r->dst_dp, connected, group, r->num_dsts, needed);
}

/* The layers a streamed chunk still waits for, as " (chunk [b, e) waits for layers 3,
 * 5-7 to be marked ready)", for the timeout message of a room whose engine never
 * marked them; "" when no streamed chunk waits. */
static void kvw_room_unready(struct kvw_ctx *ctx, const kvw_room_t *r, char *buf, size_t cap)
{
    buf[0] = '\0';
    if (!r->have_stream || r->chunks[r->stream_chunk].unready == 0)
        return;
    const kvw_qchunk_t *q = &r->chunks[r->stream_chunk];
    uint32_t lb = ctx->rank->par.layer_begin, n = ctx->rank->par.layer_end - lb;
    size_t len = (size_t)snprintf(buf, cap, " (chunk [%llu, %llu) waits for layer%s ",
                                  (unsigned long long)q->c.chunk_begin,
                                  (unsigned long long)q->c.chunk_end, q->unready > 1 ? "s" : "");
    const char *sep = "";
    for (uint32_t l = 0; l < n && len < cap; l++) {
        if (q->ready[l])
            continue;
        uint32_t e = l;
        while (e + 1 < n && !q->ready[e + 1])
            e++;
        if (e == l)
            len += (size_t)snprintf(buf + len, cap - len, "%s%u", sep, lb + l);
        else
            len += (size_t)snprintf(buf + len, cap - len, "%s%u-%u", sep, lb + l, lb + e);
        sep = ", ";
        l = e;
    }
    if (len < cap && r->event_waits)
        snprintf(buf + len, cap - len, " to be marked ready; %u CUDA event%s the engine named "
                 "for them never completed)", r->event_waits, r->event_waits > 1 ? "s" : "");
    else if (len < cap)
        snprintf(buf + len, cap - len, " to be marked ready)");
}

void kvw__check_timeouts(struct kvw_ctx *ctx, uint64_t now)
{
    for (int b = 0; b < KVW_ROOM_BUCKETS; b++) {
        kvw_room_t **pp = &ctx->rooms[b];
        while (*pp) {
            kvw_room_t *r = *pp;
            bool terminal = r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS;
            if (!terminal && now > r->deadline_ns) {
                char why[200] = "";
                if (r->is_sender && r->state == KVW_ROOM_BOOTSTRAPPING)
                    kvw_room_waiting(ctx, r, why, sizeof(why));
                else if (r->is_sender)
                    kvw_room_unready(ctx, r, why, sizeof(why));
                kvw__room_fail(ctx, r, KVW_ERR_TIMEOUT, true,
                               "room %llu timed out after %u ms in state %s%s",
                               (unsigned long long)r->id, ctx->wait_timeout_ms,
                               kvw_room_state_string(r->state), why);
            }
            /* Rooms no handle owns (a REQ or ABORT for a room the engine never opened)
             * are dropped once terminal and idle. */
            if (!r->engine_owned && r->inflight == 0 &&
                (r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS) &&
                now > r->end_ns + (uint64_t)ctx->wait_timeout_ms * 1000000ull) {
                *pp = r->next;
                kvw__room_unlink(ctx, r);
                kvw__room_free(r);
                continue;
            }
            pp = &r->next;
        }
    }
}

/* ------------------------------------------------------------ prefill */

void kvw__queue_room(struct kvw_ctx *ctx, kvw_room_t *room)
{
    if (room->queued)
        return;
    room->queued = true;
    room->qnext = NULL;
    if (ctx->q_tail)
        ctx->q_tail->qnext = room;
    else
        ctx->q_head = room;
    ctx->q_tail = room;
    atomic_fetch_add_explicit(&ctx->q_gen, 1, memory_order_release);
    pthread_cond_broadcast(&ctx->cv);
}

/* Decode ranks the room must serve are known once every rank position of the decode DP
 * group has registered at least once; until then the room keeps waiting. Positions are
 * counted over dead peers too: a decode rank that finished its own rooms and left does
 * not make the group incomplete again. Once known, the room remembers it (dsts_known),
 * so that no later departure of an unrelated decode rank can hold it back. mu held. */
static bool kvw_room_dsts_complete(struct kvw_ctx *ctx, kvw_room_t *r)
{
    if (r->dsts_known)
        return true;
    if (r->dst_dp < 0)
        return false;
    uint32_t group = 0;
    for (uint32_t i = 0; i < ctx->num_peers && !group; i++) {
        kvw_peer_t *p = ctx->peers[i];
        if (p->dp == (uint32_t)r->dst_dp && p->instance == r->dst_instance)
            group = p->remote_group_size;
    }
    if (group == 0)
        return false;
    /* One bit per rank position (pp * tp_size + tp) seen, one per position needing us. */
    size_t words = (group + 63) / 64;
    uint64_t stack_bits[2 * 16];
    uint64_t *seen = words <= 16 ? stack_bits : calloc(2 * words, sizeof(uint64_t));
    if (seen == NULL)
        return false;
    if (seen == stack_bits)
        memset(stack_bits, 0, sizeof(stack_bits));
    uint64_t *need = seen + words;
    uint32_t positions = 0, needed = 0;
    for (uint32_t i = 0; i < ctx->num_peers; i++) {
        kvw_peer_t *p = ctx->peers[i];
        if (p->dp != (uint32_t)r->dst_dp || p->instance != r->dst_instance ||
            p->remote_group_size != group)
            continue;
        uint32_t pos = p->pp * (group / KVW_MAX(p->remote_pp_size, 1)) + p->tp;
        if (pos >= group)
            continue;
        uint64_t bit = 1ull << (pos % 64);
        if (!(seen[pos / 64] & bit)) {
            seen[pos / 64] |= bit;
            positions++;
        }
        if (p->needed && !(need[pos / 64] & bit)) {
            need[pos / 64] |= bit;
            needed++;
        }
    }
    if (seen != stack_bits)
        free(seen);
    r->dsts_known = positions >= group && r->num_dsts >= needed;
    return r->dsts_known;
}

/* Whether decode rank `d` has something to be sent: a chunk it has not been sent whose
 * layers are all ready (plain chunks), or some of them ready and not sent yet
 * (streamed chunks). */
static bool kvw_dst_has_work(const struct kvw_ctx *ctx, const kvw_room_t *r,
                             const kvw_room_dst_t *d)
{
    if (d->next_chunk >= r->num_chunks)
        return false;
    const kvw_qchunk_t *q = &r->chunks[d->next_chunk];
    if (q->ready == NULL)
        return true;
    uint32_t n = ctx->rank->par.layer_end - ctx->rank->par.layer_begin;
    for (uint32_t l = 0; l < n; l++)
        if (q->ready[l] && (d->sent == NULL || !d->sent[l]))
            return true;
    return false;
}

/* A decode rank of the room with work (kvw_dst_has_work) that no worker serves yet, or
 * -1. */
static int kvw_room_next_dst(const struct kvw_ctx *ctx, const kvw_room_t *r)
{
    if (r->state == KVW_ROOM_FAILED)
        return -1;
    for (uint32_t i = 0; i < r->num_dsts; i++)
        if (!r->dsts[i].busy && kvw_dst_has_work(ctx, r, &r->dsts[i]))
            return (int)i;
    return -1;
}

static void kvw_sender_update(struct kvw_ctx *ctx, kvw_room_t *r)
{
    if (r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS)
        return;
    bool complete = kvw_room_dsts_complete(ctx, r);
    if (complete)
        kvw__room_advance(r, KVW_ROOM_WAITING_FOR_INPUT);
    if (complete && r->num_chunks)
        kvw__room_advance(r, KVW_ROOM_TRANSFERRING);
    if (complete && r->have_last) {
        /* Success only once every decode rank confirmed its bytes: the engine may reuse
         * this rank's pages right after, whatever the transport still had in flight. */
        bool all = true;
        for (uint32_t i = 0; i < r->num_dsts; i++)
            all &= r->dsts[i].last_sent && r->dsts[i].acked;
        if (all)
            kvw__room_advance(r, KVW_ROOM_SUCCESS);
    }
    /* Work exists when some decode rank that no worker serves has chunks it has not been
     * sent (a busy one's worker sends new chunks itself before it lets go). */
    if (kvw_room_next_dst(ctx, r) >= 0)
        kvw__queue_room(ctx, r);
}

static void kvw_handle_req(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb)
{
    uint64_t id = kvw__rb_u64(rb);
    uint32_t dp = kvw__rb_u32(rb);
    kvw_room_dst_t d = {.peer = peer->id};
    d.num_tokens = kvw__rb_u64(rb);
    d.prefix_len = kvw__rb_u64(rb);
    uint32_t *s1 = NULL, *s2 = NULL;
    /* Bounded by the decode rank's own pools. A pool the decode rank has no buffers in
     * (a PP stage without sliding-window or full-attention layers) receives nothing: its
     * list is read past and dropped, never kept. */
    const struct kvw_rank *dr = peer->remote;
    kvw_status_t st = dr->pool_page_size[KVW_POOL_FULL]
                          ? kvw__wire_get_pages(rb, &d.pages.full, &s1,
                                                dr->pool_capacity[KVW_POOL_FULL])
                          : kvw__wire_skip_pages(rb, &d.pages.full);
    if (st == KVW_OK)
        st = dr->pool_page_size[KVW_POOL_SWA]
                 ? kvw__wire_get_pages(rb, &d.pages.swa, &s2, dr->pool_capacity[KVW_POOL_SWA])
                 : kvw__wire_skip_pages(rb, &d.pages.swa);
    if (st == KVW_ERR_OUT_OF_RANGE) {
        /* Only this request is refused; the peer stays. */
        free(s1);
        kvw_send_room_msg(ctx, peer, KVW_MSG_FAILED, id, st, kvw_last_error());
        return;
    }
    if (st != KVW_OK) {
        free(s1);
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "malformed request frame");
        return;
    }
    d.pages.state_slot = (int64_t)kvw__rb_u64(rb);
    if (kvw__rb_done(rb, "request") != KVW_OK) {
        free(s1);
        free(s2);
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, kvw_last_error());
        return;
    }
    /* One allocation per destination keeps the room's frees simple. */
    d.store = malloc(sizeof(uint32_t) * ((size_t)d.pages.full.num_pages + d.pages.swa.num_pages + 1));
    if (d.store) {
        if (d.pages.full.num_pages) /* a skipped list has no storage at all */
            memcpy(d.store, s1, sizeof(uint32_t) * d.pages.full.num_pages);
        if (d.pages.swa.num_pages)
            memcpy(d.store + d.pages.full.num_pages, s2,
                   sizeof(uint32_t) * d.pages.swa.num_pages);
        d.pages.full.pages = d.store;
        d.pages.swa.pages = d.store + d.pages.full.num_pages;
    }
    free(s1);
    free(s2);
    kvw_room_t *r = kvw__room_find(ctx, id);
    if (r == NULL)
        r = kvw__room_new(ctx, id, true);
    if (r)
        kvw__room_hop(r, KVW_HOP_REQ_RX, false);
    if (r == NULL || d.store == NULL) {
        free(d.store);
        kvw_send_room_msg(ctx, peer, KVW_MSG_FAILED, id, KVW_ERR_NO_MEMORY,
                          "prefill rank out of memory accepting the request");
        return;
    }
    kvw_room_dst_t *nd = realloc(r->dsts, sizeof(*nd) * (r->num_dsts + 1));
    if (nd == NULL) {
        free(d.store);
        kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory accepting a request");
        return;
    }
    r->dsts = nd;
    if (!peer->needed) {
        /* A decode rank this rank sends nothing to still names the room's DP group,
         * so that a rank with nothing to send can finish. */
        free(d.store);
        if (r->dst_dp < 0) {
            r->dst_dp = (int32_t)dp;
            r->dst_instance = peer->instance;
        }
        if ((uint32_t)r->dst_dp != dp || r->dst_instance != peer->instance) {
            /* A second claimant fails the room for everyone, itself included. */
            char why[320];
            snprintf(why, sizeof(why), "room %llu: %.160s (decode instance %llu) posted for DP "
                     "group %u, but the room belongs to instance %llu group %d",
                     (unsigned long long)id, peer->desc, (unsigned long long)peer->instance,
                     dp, (unsigned long long)r->dst_instance, r->dst_dp);
            kvw__room_fail(ctx, r, KVW_ERR_INVALID_PARAM, true, "%s", why);
            kvw_send_room_msg(ctx, peer, KVW_MSG_FAILED, id, KVW_ERR_INVALID_PARAM, r->reason);
            return;
        }
        kvw_sender_update(ctx, r);
        return;
    }
    r->dsts[r->num_dsts++] = d;
    if (r->state == KVW_ROOM_FAILED) {
        /* Nothing will be written for a room that already failed. */
        kvw_send_room_msg(ctx, peer, KVW_MSG_FAILED, id, r->status, r->reason);
        kvw_send_room_msg(ctx, peer, KVW_MSG_ABORT_ACK, id, KVW_ERR_ABORTED, "stopped");
        return;
    }
    for (uint32_t i = 0; i + 1 < r->num_dsts; i++)
        if (r->dsts[i].peer == peer->id) {
            kvw__room_fail(ctx, r, KVW_ERR_INVALID_PARAM, true,
                           "%s posted room %llu twice", peer->desc, (unsigned long long)id);
            return;
        }
    if (r->dst_dp < 0) {
        r->dst_dp = (int32_t)dp;
        r->dst_instance = peer->instance;
    }
    if ((uint32_t)r->dst_dp != dp || r->dst_instance != peer->instance) {
        kvw__room_fail(ctx, r, KVW_ERR_INVALID_PARAM, true,
                       "room %llu: %s (decode instance %llu) posted for DP group %u, but the "
                       "room belongs to instance %llu group %d", (unsigned long long)id,
                       peer->desc, (unsigned long long)peer->instance, dp,
                       (unsigned long long)r->dst_instance, r->dst_dp);
        return;
    }
    kvw__room_touch(ctx, r);
    if (r->num_tokens && d.num_tokens != r->num_tokens) {
        kvw__room_fail(ctx, r, KVW_ERR_INVALID_PARAM, true,
                       "room %llu: decode expects %llu tokens, prefill sends %llu",
                       (unsigned long long)id, (unsigned long long)d.num_tokens,
                       (unsigned long long)r->num_tokens);
        return;
    }
    kvw_sender_update(ctx, r);
}

/* Worker: executes one (room, decode rank, chunk) step. Called with mu NOT held;
 * the room is pinned by inflight. */
typedef struct kvw_put_ctx {
    struct kvw_ctx *ctx;
    kvw_peer_t *peer;
    kvw_room_t *room;
    kvw_tl_put_t puts[KVW_PUT_BATCH];
    size_t n;
    uint64_t runs;
} kvw_put_ctx_t;

static kvw_status_t kvw_put_flush(kvw_put_ctx_t *pc)
{
    if (pc->n == 0)
        return KVW_OK;
    kvw_status_t st = pc->ctx->tl_ops->put(pc->peer->ep, pc->room->id, pc->puts, pc->n);
    pc->n = 0;
    return st;
}

static kvw_status_t kvw_put_run(void *arg, const kvw_run_t *run)
{
    kvw_put_ctx_t *pc = arg;
    const kvw_buffer_desc_t *sb = kvw_rank_buffer(pc->ctx->rank, run->src_buf);
    if (run->dst_buf >= pc->peer->num_rkeys || pc->peer->rkeys[run->dst_buf] == NULL)
        return kvw__error(KVW_ERR_INTERNAL, "run names destination buffer %u of %u, which "
                          "this rank holds no key to", run->dst_buf, pc->peer->num_rkeys);
    pc->puts[pc->n++] = (kvw_tl_put_t){.src = (const uint8_t *)sb->addr + run->src_off,
                                       .rkey = pc->peer->rkeys[run->dst_buf],
                                       .dst_off = run->dst_off, .len = run->len};
    pc->runs++;
    if (pc->n == KVW_PUT_BATCH) {
        /* Stop early when the room was aborted meanwhile. */
        pthread_mutex_lock(&pc->ctx->mu);
        bool failed = pc->room->state == KVW_ROOM_FAILED;
        pthread_mutex_unlock(&pc->ctx->mu);
        if (failed)
            return kvw__error(KVW_ERR_ABORTED, "room aborted");
        return kvw_put_flush(pc);
    }
    return KVW_OK;
}

/* Copies the part of a plan's byte stream inside [wb, we) between the staging buffer and
 * the ranks' buffers: gather reads the source, scatter writes the destination. Both
 * sides walk the same segments in the same order (kvw__seg_walk never coalesces across
 * chunks), so the stream is defined by the two ranks' geometry alone, never by page
 * indices: the decode side can scatter with its own pages only. */
typedef struct kvw_stage_io {
    const struct kvw_plan *plan;
    uint8_t *buf;
    uint64_t pos, wb, we;
    bool gather;
} kvw_stage_io_t;

static kvw_status_t kvw_stage_emit(void *arg, const kvw_seg_t *seg, uint64_t so, uint64_t doff,
                                   uint64_t len)
{
    kvw_stage_io_t *io = arg;
    uint64_t b = KVW_MAX(io->pos, io->wb), e = KVW_MIN(io->pos + len, io->we);
    if (b < e) {
        if (io->gather) {
            const uint8_t *src = kvw_rank_buffer(io->plan->src, seg->src_buf)->addr;
            memcpy(io->buf + (b - io->wb), src + so + (b - io->pos), e - b);
        } else {
            uint8_t *dst = kvw_rank_buffer(io->plan->dst, seg->dst_buf)->addr;
            memcpy(dst + doff + (b - io->pos), io->buf + (b - io->wb), e - b);
        }
    }
    io->pos += len;
    return io->pos >= io->we ? KVW_INPROGRESS : KVW_OK; /* INPROGRESS: window done */
}

static kvw_status_t kvw_stage_copy(const struct kvw_plan *plan, bool gather, uint8_t *buf,
                                   uint64_t wb, uint64_t we)
{
    kvw_stage_io_t io = {.plan = plan, .buf = buf, .wb = wb, .we = we, .gather = gather};
    for (uint32_t i = 0; i < plan->num_segs; i++) {
        /* Segments wholly before the window only move the position: a window late in
         * the stream (the last layers of a streamed chunk) does not walk every run
         * before it. */
        uint64_t sb = kvw__seg_bytes(&plan->segs[i]);
        if (io.pos + sb <= wb) {
            io.pos += sb;
            continue;
        }
        kvw_status_t st = kvw__seg_walk(plan, &plan->segs[i], kvw_stage_emit, &io);
        if (st == KVW_INPROGRESS)
            return KVW_OK;
        if (st != KVW_OK)
            return st;
    }
    if (io.pos < we)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, %llu) ends past the plan's "
                          "%llu bytes", (unsigned long long)wb, (unsigned long long)we,
                          (unsigned long long)io.pos);
    return KVW_OK;
}

/* Starts one staged window on this rank's GPU (see kvw__cuda_stage_launch): the gather
 * of the plan's source buffers into `buf`, or the scatter of `buf` into its destination
 * buffers. *slot_p: the executor slot to reap. */
static kvw_status_t kvw_stage_gpu_launch(struct kvw_ctx *ctx, const struct kvw_plan *plan,
                                         bool gather, uint8_t *buf, uint64_t wb, uint64_t we,
                                         int *slot_p)
{
    kvw_cuda_profile_t prof = {.steps = 1, .bytes = we - wb, .first_start_ns = kvw__now_ns()};
    *slot_p = -1;
    /* Only the segments the window overlaps go to the device (segments lie in stream
     * order): a window of a long chunk's plan flattens and uploads a few segments, not
     * the whole plan, and its offsets become relative to the first one kept. */
    struct kvw_plan sub = *plan;
    uint64_t pos = 0, base = 0;
    uint32_t i0 = plan->num_segs, i1 = 0;
    for (uint32_t i = 0; i < plan->num_segs && pos < we; i++) {
        uint64_t b = kvw__seg_bytes(&plan->segs[i]);
        if (pos + b > wb && b) {
            if (i0 == plan->num_segs)
                i0 = i, base = pos;
            i1 = i + 1;
        }
        pos += b;
    }
    if (i0 == plan->num_segs)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, %llu) lies past the "
                          "plan's %llu bytes", (unsigned long long)wb, (unsigned long long)we,
                          (unsigned long long)pos);
    sub.segs = &plan->segs[i0];
    sub.num_segs = i1 - i0;
    sub.bytes = 0;
    for (uint32_t i = 0; i < sub.num_segs; i++)
        sub.bytes += kvw__seg_bytes(&sub.segs[i]);
    kvw_status_t st = kvw_cuda_set_device(ctx->cuda_dev);
    if (st == KVW_OK)
        st = kvw__cuda_stage_launch(&sub, !gather, buf, wb - base, we - base, slot_p, &prof);
    kvw__cuda_profile_add(&prof);
    return st;
}

/* Waits for a staged window started by kvw_stage_gpu_launch (nothing when slot < 0). */
static kvw_status_t kvw_stage_gpu_wait(int slot)
{
    if (slot < 0)
        return KVW_OK;
    kvw_cuda_profile_t prof = {0};
    int done = 0;
    kvw_status_t st = kvw__cuda_step_reap(slot, 1, &done, &prof);
    prof.last_done_ns = kvw__now_ns();
    kvw__cuda_profile_add(&prof);
    return st;
}

/* Moves one staged window between `buf` and this rank's own buffers: on the CPU for
 * host memory, on the GPU (waiting for it) for GPU memory on a host transport. */
static kvw_status_t kvw_stage_move(struct kvw_ctx *ctx, const struct kvw_plan *plan, bool gather,
                                   uint8_t *buf, uint64_t wb, uint64_t we)
{
    if (!ctx->staged_cuda)
        return kvw_stage_copy(plan, gather, buf, wb, we);
    int slot = -1;
    kvw_status_t st = kvw_stage_gpu_launch(ctx, plan, gather, buf, wb, we, &slot);
    kvw_status_t st2 = kvw_stage_gpu_wait(slot);
    return st != KVW_OK ? st : st2;
}

/* The calling worker's host buffer for gathered windows, at least `size` bytes: kept
 * for the thread's life (grown when a larger window comes), so a step neither allocates
 * nor faults in up to 16 MiB of fresh pages. Released when the thread exits. */
static pthread_key_t kvw_wbuf_key;
static pthread_once_t kvw_wbuf_once = PTHREAD_ONCE_INIT;

typedef struct kvw_worker_buf {
    uint8_t *p;
    uint64_t cap;
} kvw_worker_buf_t;

static void kvw_wbuf_free(void *arg)
{
    kvw_worker_buf_t *b = arg;
    free(b->p);
    free(b);
}

static void kvw_wbuf_init(void)
{
    (void)pthread_key_create(&kvw_wbuf_key, kvw_wbuf_free);
}

static uint8_t *kvw_worker_buf(uint64_t size)
{
    pthread_once(&kvw_wbuf_once, kvw_wbuf_init);
    kvw_worker_buf_t *b = pthread_getspecific(kvw_wbuf_key);
    if (b == NULL) {
        if ((b = calloc(1, sizeof(*b))) == NULL)
            return NULL;
        if (pthread_setspecific(kvw_wbuf_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    if (size > b->cap) {
        free(b->p);
        b->cap = 0;
        if ((b->p = malloc(size)) == NULL)
            return NULL;
        b->cap = size;
    }
    return b->p;
}

/* Head-slice plans make many small runs; one bulk write per window beats one write per
 * run: on tcp and ucx (a frame or a put per run) and on shm too, unless the decode's KV
 * buffers are shared memory (then each run is one memcpy, and staging would copy twice).
 * Measured on this project's demo: staged 3.4x faster than direct on tcp, 2.7x on shm
 * with malloc'd decode buffers. */
static bool kvw_choose_staged(struct kvw_ctx *ctx, kvw_peer_t *peer, const struct kvw_plan *plan)
{
    if (peer->must_stage)
        return true;
    if (peer->staging_rkey == NULL || plan->num_segs == 0 || ctx->path_mode == KVW_PATH_DIRECT)
        return false;
    if (ctx->path_mode == KVW_PATH_STAGED)
        return true;
    kvw_box_t b;
    const kvw_seg_t *s0 = &plan->segs[0];
    kvw__box_make(s0, KVW_MIN(s0->src.page_size, s0->dst.page_size), &b);
    return b.chunk < (16u << 10);
}

static void kvw_put_done(kvw_wbuf_t *w, uint64_t room, uint32_t id, const kvw_chunk_t *c,
                         uint64_t bytes, bool staged, uint64_t soff, uint64_t slen, uint64_t goff,
                         bool final, uint32_t meta_len)
{
    kvw__wb_init(w, KVW_MSG_DONE);
    kvw__wb_u64(w, room);
    kvw__wb_u32(w, id);
    kvw__wb_u64(w, c->chunk_begin);
    kvw__wb_u64(w, c->chunk_end);
    kvw__wb_u64(w, bytes);
    kvw__wb_u8(w, (uint8_t)(c->last_chunk != 0));
    kvw__wb_u8(w, (uint8_t)staged);
    kvw__wb_u64(w, soff);
    kvw__wb_u64(w, slen);
    kvw__wb_u64(w, goff);
    kvw__wb_u8(w, (uint8_t)final);
    /* Metadata bytes this rank sent on the control channel (final completions only):
     * the decode waits for them before Success. */
    kvw__wb_u32(w, final && c->last_chunk ? meta_len : 0);
}

/* Hands a chunk's completion to the transport; *out_ns_p: when (KVW_HOP_BYTES_OUT). */
static kvw_status_t kvw_notify_done(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w,
                                    uint64_t *out_ns_p)
{
    kvw_status_t st = kvw__wb_finish(w);
    *out_ns_p = kvw__now_ns();
    if (st == KVW_OK)
        st = ctx->tl_ops->notify(peer->ep, w->p, w->len);
    kvw__wb_free(w);
    return st;
}

/* Whether a step moves segment `s`: every segment (take NULL), or those of the layers
 * taken (one byte per layer of the stage starting at layer_begin). */
static bool kvw_seg_taken(const kvw_seg_t *s, const uint8_t *take, uint32_t layer_begin)
{
    return take == NULL || (s->layer >= layer_begin && take[s->layer - layer_begin]);
}

/*
 * Sends one staged step: ask for space, gather, one bulk put, notify; repeat. A plain
 * chunk is one byte range, the whole plan's stream; a streamed step moves, for each run
 * of consecutive segments of the layers it takes, that run's range of the stream.
 * Windows are formed per range (per layer group) and never straddle two, and their
 * offsets stay those of the whole chunk's stream: the decode rank scatters a window by
 * its offset in the chunk's plan and needs to know nothing of the layers. Only the last
 * window of a step that completes the chunk is final.
 */
static kvw_status_t kvw_send_staged(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t di,
                                    kvw_peer_t *peer, const struct kvw_plan *plan,
                                    const kvw_chunk_t *c, const uint8_t *take, bool final,
                                    uint64_t *bytes_p, uint64_t *runs_p, uint64_t *out_ns_p,
                                    uint32_t meta_len)
{
    uint32_t lb = ctx->rank->par.layer_begin;
    uint64_t total = 0, piece_max = KVW_MIN(peer->staging_len / 4, 16ull << 20);
    for (uint32_t i = 0; i < plan->num_segs; i++)
        if (kvw_seg_taken(&plan->segs[i], take, lb))
            total += kvw__seg_bytes(&plan->segs[i]);
    *bytes_p = total;
    if (total == 0) {
        /* None of this step's layers holds bytes for this decode rank (SWA layers of an
         * early chunk): only the completion goes, which may be the final one. */
        kvw_wbuf_t w;
        kvw_put_done(&w, r->id, peer->id_at_remote, c, 0, false, 0, 0, 0, final, meta_len);
        return kvw_notify_done(ctx, peer, &w, out_ns_p);
    }
    /* The windows, in stream order: each range of taken segments cut into pieces. */
    uint32_t nwin = 0, cap = 16;
    uint64_t (*win)[2] = malloc(sizeof(*win) * cap);
    if (win == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory for staging");
    uint64_t pos = 0;
    for (uint32_t i = 0; i < plan->num_segs;) {
        if (!kvw_seg_taken(&plan->segs[i], take, lb)) {
            pos += kvw__seg_bytes(&plan->segs[i++]);
            continue;
        }
        uint64_t range_begin = pos;
        while (i < plan->num_segs && kvw_seg_taken(&plan->segs[i], take, lb))
            pos += kvw__seg_bytes(&plan->segs[i++]);
        for (uint64_t wpos = range_begin; wpos < pos; wpos += KVW_MIN(pos - wpos, piece_max)) {
            if (nwin == cap) {
                void *n = realloc(win, sizeof(*win) * (cap *= 2));
                if (n == NULL) {
                    free(win);
                    return kvw__error(KVW_ERR_NO_MEMORY, "out of memory for staging");
                }
                win = n;
            }
            win[nwin][0] = wpos;
            win[nwin++][1] = wpos + KVW_MIN(pos - wpos, piece_max);
        }
    }
    /* Host memory: one buffer, gathered on the CPU after each grant. GPU memory: two
     * pinned buffers of this worker, and the gather of window k + 1 runs on the GPU
     * while window k is on the wire (the decode scatters window k - 1 meanwhile). */
    bool gpu = ctx->staged_cuda;
    uint8_t *buf[2] = {NULL, NULL};
    int slot[2] = {-1, -1};
    kvw_status_t st = KVW_OK;
    uint64_t wmax = KVW_MAX(KVW_MIN(total, piece_max), 1);
    if (!gpu) {
        buf[0] = buf[1] = kvw_worker_buf(wmax);
        if (buf[0] == NULL)
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory for staging");
    } else {
        for (int k = 0; k < 2 && st == KVW_OK; k++)
            st = kvw__cuda_stage_buf(k, wmax, (void **)&buf[k]);
        if (st == KVW_OK && nwin)
            st = kvw_stage_gpu_launch(ctx, plan, true, buf[0], win[0][0], win[0][1], &slot[0]);
    }
    uint64_t sent = 0;
    for (uint32_t k = 0; k < nwin && st == KVW_OK; k++) {
        uint64_t wpos = win[k][0], len = win[k][1] - win[k][0];
        uint8_t *wb = buf[k % 2];
        pthread_mutex_lock(&ctx->mu);
        r->dsts[di].grant_off = -1;
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_STAGE_ASK);
        kvw__wb_u64(&w, r->id);
        kvw__wb_u64(&w, len);
        kvw__peer_send(ctx, peer, &w);
        /* Credits: wait until the decode rank grants space (back-pressure). The room's
         * own timeout and peer failure both wake this wait. */
        while (r->dsts[di].grant_off < 0 && r->state != KVW_ROOM_FAILED && !ctx->stopping &&
               !peer->dead)
            pthread_cond_wait(&ctx->cv, &ctx->mu);
        int64_t goff = r->dsts[di].grant_off;
        uint64_t glen = r->dsts[di].grant_len;
        bool failed = r->state == KVW_ROOM_FAILED || ctx->stopping || peer->dead;
        pthread_mutex_unlock(&ctx->mu);
        if (failed) {
            st = kvw__error(KVW_ERR_ABORTED, "the room ended while waiting for staging space");
            break;
        }
        if (glen != len || (uint64_t)goff + len > peer->staging_len) {
            st = kvw__error(KVW_ERR_MALFORMED, "staging grant [%lld, +%llu) does not match "
                            "the %llu bytes asked", (long long)goff, (unsigned long long)glen,
                            (unsigned long long)len);
            break;
        }
        if (gpu) {
            st = kvw_stage_gpu_wait(slot[k % 2]);
            slot[k % 2] = -1;
            if (st == KVW_OK && k + 1 < nwin)
                st = kvw_stage_gpu_launch(ctx, plan, true, buf[(k + 1) % 2], win[k + 1][0],
                                          win[k + 1][1], &slot[(k + 1) % 2]);
        } else {
            st = kvw_stage_copy(plan, true, wb, wpos, wpos + len);
        }
        if (st != KVW_OK)
            break;
        kvw_tl_put_t put = {.src = wb, .rkey = peer->staging_rkey, .dst_off = (uint64_t)goff,
                            .len = len};
        if ((st = ctx->tl_ops->put(peer->ep, r->id, &put, 1)) != KVW_OK)
            break;
        sent += len;
        kvw_wbuf_t dw;
        kvw_put_done(&dw, r->id, peer->id_at_remote, c, len, true, wpos, len, (uint64_t)goff,
                     final && sent == total, meta_len);
        st = kvw_notify_done(ctx, peer, &dw, out_ns_p);
        (*runs_p)++;
    }
    /* A gather still running on an error path must finish before its buffer is reused. */
    for (int k = 0; k < 2; k++)
        (void)kvw_stage_gpu_wait(slot[k]);
    free(win);
    return st;
}

/*
 * GPU steps in flight on one worker: the kernel runs on the worker's own stream while
 * the worker prepares the next job; each step's DONE goes out once its kernel completed,
 * in launch order (so one decode rank's chunks stay in order). A job (room, decode
 * rank) whose steps are still in flight keeps the room pinned (inflight) and its decode
 * rank busy until its last step is reaped.
 */
typedef struct kvw_gpu_step {
    kvw_room_t *r;
    uint32_t di;
    kvw_peer_t *peer;
    int slot;        /* executor slot; -1: nothing launched, the DONE waits its turn */
    bool closes_job; /* releases the (room, decode rank) once reaped */
    uint64_t seq;
    kvw_wbuf_t done; /* the DONE message, finished */
} kvw_gpu_step_t;

typedef struct kvw_gpu_q {
    kvw_gpu_step_t q[KVWC_EXEC_SLOTS];
    uint32_t head, n;
    uint32_t depth; /* steps in flight at most: KVW_GPU_INFLIGHT, 1..KVWC_EXEC_SLOTS */
    uint64_t seq, reaped; /* last sequence number given out and reaped */
} kvw_gpu_q_t;

static void kvw_sender_update(struct kvw_ctx *ctx, kvw_room_t *r);
static void kvw_job_release(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t di);

/* Reaps finished steps in order, sending their DONEs; with `block`, waits for the
 * oldest first. Called without ctx->mu. */
static void kvw_gpu_reap(struct kvw_ctx *ctx, kvw_gpu_q_t *g, bool block)
{
    while (g->n) {
        kvw_gpu_step_t *e = &g->q[g->head];
        kvw_cuda_profile_t prof = {0};
        int done = 1;
        kvw_status_t st = KVW_OK;
        if (e->slot >= 0)
            st = kvw__cuda_step_reap(e->slot, block, &done, &prof);
        if (!done)
            return;
        block = false;
        uint64_t t0 = kvw__now_ns();
        if (st == KVW_OK) {
            st = ctx->tl_ops->notify(e->peer->ep, e->done.p, e->done.len);
            prof.last_done_ns = kvw__now_ns();
            prof.notify_ns = prof.last_done_ns - t0;
        }
        char msg[512] = "";
        if (st != KVW_OK)
            snprintf(msg, sizeof(msg), "%s", kvw_last_error());
        kvw__cuda_profile_add(&prof);
        kvw__wb_free(&e->done);
        kvw_gpu_step_t done_e = *e;
        g->head = (g->head + 1) % KVWC_EXEC_SLOTS;
        g->n--;
        g->reaped = done_e.seq;
        pthread_mutex_lock(&ctx->mu);
        if (st == KVW_OK)
            done_e.r->hop_ns[KVW_HOP_BYTES_OUT] = t0;
        if (st != KVW_OK) {
            if (done_e.r->state != KVW_ROOM_FAILED)
                kvw__room_fail(ctx, done_e.r, st, true, "sending to %s failed: %s",
                               done_e.peer->desc, msg);
            if (st == KVW_ERR_CONN_CLOSED || st == KVW_ERR_IO)
                kvw__peer_dead(ctx, done_e.peer, st, msg);
        }
        if (done_e.closes_job)
            kvw_job_release(ctx, done_e.r, done_e.di);
        pthread_mutex_unlock(&ctx->mu);
    }
}

/* `take` (NULL: every layer) names the layers this step moves, one byte per layer of
 * this rank's stage; `final`: the step completes the chunk for this decode rank. */
static kvw_status_t kvw_worker_step(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t di,
                                    const kvw_room_dst_t *d, const kvw_qchunk_t *q,
                                    const uint8_t *take, bool final, kvw_peer_t *peer,
                                    uint64_t *bytes_p, uint64_t *runs_p, bool *staged_p,
                                    uint64_t *out_ns_p, uint32_t meta_len, kvw_gpu_q_t *g,
                                    uint64_t *seq_p)
{
    uint32_t lb = ctx->rank->par.layer_begin, nl = ctx->rank->par.layer_end - lb;
    kvw_chunk_t c = q->c;
    c.prefix_len = d->prefix_len;
    if (c.prefix_len > c.num_tokens)
        return kvw__error(KVW_ERR_INVALID_PARAM, "decode prefix %llu exceeds %llu tokens",
                          (unsigned long long)c.prefix_len, (unsigned long long)c.num_tokens);
    kvw_plan_h plan;
    kvw_status_t st;
    if (peer->mapped) {
        /* The decode buffers are mapped here (CUDA IPC): one fused kernel writes them
         * directly, and the notification goes out only after it completed. */
        uint64_t t0 = kvw__now_ns();
        if ((st = kvw_plan_create(ctx->rank, peer->mapped, &c, &q->pages, &d->pages, &plan)) !=
            KVW_OK)
            return st;
        if (take)
            kvw__plan_keep_layers(plan, take, lb, nl);
        *bytes_p = plan->bytes;
        *runs_p = plan->num_segs;
        int dev = kvw__rank_cuda_device(ctx->rank);
        if (dev < 0) {
            st = kvw_plan_exec_cpu(plan);
            if (st == KVW_OK) {
                kvw_wbuf_t w;
                kvw_put_done(&w, r->id, peer->id_at_remote, &c, plan->bytes, false, 0, 0, 0,
                             final, meta_len);
                st = kvw_notify_done(ctx, peer, &w, out_ns_p);
            }
            kvw_plan_destroy(plan);
            return st;
        }
        /* On the GPU: launch on this worker's stream and queue the DONE behind the
         * kernel; kvw_gpu_reap sends it once the bytes have landed. */
        kvw_cuda_profile_t prof = {.steps = 1, .bytes = plan->bytes,
                                   .plan_ns = kvw__now_ns() - t0, .first_start_ns = t0};
        if (g->n >= g->depth)
            kvw_gpu_reap(ctx, g, true); /* as many in flight as allowed: wait for the oldest */
        kvw_gpu_step_t *e = &g->q[(g->head + g->n) % KVWC_EXEC_SLOTS];
        *e = (kvw_gpu_step_t){.r = r, .di = di, .peer = peer, .slot = -1};
        if ((st = kvw_cuda_set_device(dev)) == KVW_OK)
            st = kvw__cuda_step_launch(plan, &e->slot, &prof);
        if (st == KVW_OK) {
            kvw_put_done(&e->done, r->id, peer->id_at_remote, &c, plan->bytes, false, 0, 0, 0,
                         final, meta_len);
            if ((st = kvw__wb_finish(&e->done)) != KVW_OK)
                kvw__wb_free(&e->done);
        }
        kvw__cuda_profile_add(&prof);
        kvw_plan_destroy(plan);
        if (st != KVW_OK) {
            if (e->slot >= 0) {
                /* Launched, but no DONE can follow: let the kernel finish first. */
                kvw_cuda_profile_t p2 = {0};
                int done = 0;
                (void)kvw__cuda_step_reap(e->slot, 1, &done, &p2);
            }
            return st;
        }
        e->seq = ++g->seq;
        *seq_p = e->seq;
        g->n++;
        return KVW_OK;
    }
    st = kvw_plan_create(ctx->rank, peer->remote, &c, &q->pages, &d->pages, &plan);
    if (st != KVW_OK)
        return st;
    /* Staged or direct is decided on the whole chunk's plan, so that every step of a
     * streamed chunk takes the same path. */
    *staged_p = plan->bytes > 0 && kvw_choose_staged(ctx, peer, plan);
    if (*staged_p) {
        st = kvw_send_staged(ctx, r, di, peer, plan, &c, take, final, bytes_p, runs_p, out_ns_p,
                             meta_len);
        kvw_plan_destroy(plan);
        return st;
    }
    if (take)
        kvw__plan_keep_layers(plan, take, lb, nl);
    *bytes_p = plan->bytes;
    kvw_put_ctx_t *pc = malloc(sizeof(*pc));
    if (pc == NULL) {
        kvw_plan_destroy(plan);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory sending");
    }
    pc->ctx = ctx, pc->peer = peer, pc->room = r, pc->n = 0, pc->runs = 0;
    st = kvw_plan_expand(plan, kvw_put_run, pc);
    if (st == KVW_OK)
        st = kvw_put_flush(pc);
    if (st == KVW_OK) {
        kvw_wbuf_t w;
        kvw_put_done(&w, r->id, peer->id_at_remote, &c, plan->bytes, false, 0, 0, 0, final,
                     meta_len);
        st = kvw_notify_done(ctx, peer, &w, out_ns_p);
    }
    *runs_p = pc->runs;
    free(pc);
    kvw_plan_destroy(plan);
    return st;
}


/*
 * Workers take (room, decode rank) jobs: several workers serve the decode ranks of one
 * room in parallel (a TP1 prefill rank feeding four decode ranks gathers for all four
 * at once), while the chunks for one decode rank go out in order, from one worker.
 */
/* A job (room, decode rank) is over: the decode rank may be served again. */
static void kvw_job_release(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t di)
{
    r->dsts[di].busy = false;
    r->inflight--;
    kvw_room_quiesce(ctx, r);
    kvw_sender_update(ctx, r);
    pthread_cond_broadcast(&ctx->cv);
}

void *kvw__worker_main(void *arg)
{
    struct kvw_ctx *ctx = arg;
    kvw_gpu_q_t g;
    memset(&g, 0, sizeof(g));
    /* Kernels in flight per worker (default all slots); 1 waits for each kernel before
     * the next launch, as a step that synchronises would. */
    uint64_t depth; /* checked when the context was created */
    kvw__config_u64("KVW_GPU_INFLIGHT", &depth);
    g.depth = (uint32_t)(depth < 1 ? 1 : depth > KVWC_EXEC_SLOTS ? KVWC_EXEC_SLOTS : depth);
    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        while (!ctx->stopping && ctx->q_head == NULL) {
            if (g.n) {
                /* Nothing else to do: wait for this worker's oldest kernel. */
                pthread_mutex_unlock(&ctx->mu);
                kvw_gpu_reap(ctx, &g, true);
                pthread_mutex_lock(&ctx->mu);
                continue;
            }
            if (ctx->busy_poll_ns) {
                uint32_t seen = atomic_load_explicit(&ctx->q_gen, memory_order_acquire);
                pthread_mutex_unlock(&ctx->mu);
                kvw__busy_wait(ctx, &ctx->q_gen, seen);
                pthread_mutex_lock(&ctx->mu);
                if (ctx->stopping || ctx->q_head != NULL)
                    break;
            }
            pthread_cond_wait(&ctx->cv, &ctx->mu);
        }
        if (ctx->stopping) {
            while (g.n) {
                pthread_mutex_unlock(&ctx->mu);
                kvw_gpu_reap(ctx, &g, true);
                pthread_mutex_lock(&ctx->mu);
            }
            break;
        }
        if (g.n) {
            /* Send the DONEs of kernels that finished meanwhile. */
            pthread_mutex_unlock(&ctx->mu);
            kvw_gpu_reap(ctx, &g, false);
            pthread_mutex_lock(&ctx->mu);
            if (ctx->q_head == NULL)
                continue;
        }
        kvw_room_t *r = ctx->q_head;
        ctx->q_head = r->qnext;
        if (ctx->q_head == NULL)
            ctx->q_tail = NULL;
        r->queued = false;
        int di = kvw_room_next_dst(ctx, r);
        if (di < 0) {
            kvw_sender_update(ctx, r);
            continue;
        }
        uint32_t i = (uint32_t)di;
        r->dsts[i].busy = true;
        r->inflight++;
        kvw__room_hop(r, KVW_HOP_WORKER, true);
        if (!r->start_ns)
            r->start_ns = kvw__now_ns();
        if (kvw_room_next_dst(ctx, r) >= 0)
            kvw__queue_room(ctx, r); /* another worker takes the next decode rank */
        uint64_t job_seq = 0; /* this job's last GPU step still to be reaped, if any */
        uint32_t nl = ctx->rank->par.layer_end - ctx->rank->par.layer_begin;
        while (r->dsts[i].next_chunk < r->num_chunks && r->state != KVW_ROOM_FAILED) {
            kvw_room_dst_t *d = &r->dsts[i];
            kvw_peer_t *peer = ctx->peers[d->peer];
            kvw_qchunk_t q = r->chunks[d->next_chunk];
            /* A streamed chunk: take the layers marked ready and not sent to this decode
             * rank yet, as one step; the step completes the chunk when no layer is left.
             * With none ready, the job ends here and kvw_sender_layers_ready queues the
             * room again. */
            uint8_t *take = NULL;
            bool final = true;
            if (q.ready) {
                if (d->sent == NULL && (d->sent = calloc(nl, 1)) == NULL) {
                    kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory streaming");
                    break;
                }
                if ((take = calloc(nl, 1)) == NULL) {
                    kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory streaming");
                    break;
                }
                uint32_t taken = 0, done = 0;
                for (uint32_t l = 0; l < nl; l++) {
                    done += d->sent[l];
                    if (q.ready[l] && !d->sent[l])
                        take[l] = 1, taken++;
                }
                if (taken == 0) {
                    free(take);
                    break;
                }
                final = done + taken == nl;
            }
            kvw_room_dst_t dcopy = *d;
            /* The room's metadata goes out on the control channel before the last
             * chunk's final completion, which announces its length. */
            uint32_t meta_len = 0;
            if (q.c.last_chunk && final && r->has_meta) {
                meta_len = r->meta_len;
                kvw_wbuf_t mw;
                kvw__wb_init(&mw, KVW_MSG_META);
                kvw__wb_u64(&mw, r->id);
                kvw__wb_bytes(&mw, r->meta, r->meta_len);
                kvw__peer_send(ctx, peer, &mw);
            }
            pthread_mutex_unlock(&ctx->mu);
            uint64_t bytes = 0, runs = 0, out_ns = 0;
            bool staged = false;
            uint64_t seq = 0;
            kvw_status_t st = kvw_worker_step(ctx, r, i, &dcopy, &q, take, final, peer, &bytes,
                                              &runs, &staged, &out_ns, meta_len, &g, &seq);
            if (seq)
                job_seq = seq;
            char msg[512];
            snprintf(msg, sizeof(msg), "%s", kvw_last_error());
            pthread_mutex_lock(&ctx->mu);
            d = &r->dsts[i];
            if (st != KVW_OK) {
                free(take);
                if (r->state != KVW_ROOM_FAILED)
                    kvw__room_fail(ctx, r, st, true, "sending to %s failed: %s", peer->desc, msg);
                if (st == KVW_ERR_CONN_CLOSED || st == KVW_ERR_IO)
                    kvw__peer_dead(ctx, peer, st, msg);
                break;
            }
            if (take) {
                for (uint32_t l = 0; l < nl; l++)
                    d->sent[l] |= take[l];
                free(take);
                if (final)
                    memset(d->sent, 0, nl); /* the next chunk starts with none sent */
            }
            r->bytes += bytes;
            r->runs += runs;
            r->path = staged ? "staged" : "direct";
            if (out_ns) /* GPU steps stamp it when their completion goes out */
                r->hop_ns[KVW_HOP_BYTES_OUT] = out_ns;
            kvw__room_touch(ctx, r);
            if (!final)
                continue;
            if (q.c.last_chunk)
                d->last_sent = true;
            d->next_chunk++;
        }
        if (job_seq > g.reaped) {
            /* Its last step is still in flight: released when that one is reaped. */
            for (uint32_t k = 0; k < g.n; k++)
                if (g.q[(g.head + k) % KVWC_EXEC_SLOTS].seq == job_seq)
                    g.q[(g.head + k) % KVWC_EXEC_SLOTS].closes_job = true;
        } else {
            kvw_job_release(ctx, r, i);
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    return NULL;
}

kvw_status_t kvw_sender_create(kvw_ctx_h ctx, uint64_t room, kvw_sender_h *sender_p)
{
    if (ctx == NULL || sender_p == NULL || ctx->side != KVW_SIDE_PREFILL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "senders exist on prefill contexts only");
    struct kvw_sender *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a sender");
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = kvw__room_find(ctx, room);
    if (r && r->engine_owned) {
        pthread_mutex_unlock(&ctx->mu);
        free(s);
        return kvw__error(KVW_ERR_BUSY, "room %llu already has a sender on this rank",
                          (unsigned long long)room);
    }
    if (r == NULL)
        r = kvw__room_new(ctx, room, true);
    if (r == NULL) {
        pthread_mutex_unlock(&ctx->mu);
        free(s);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a sender");
    }
    r->engine_owned = true;
    /* The wait timeout counts from the engine's side of the room. */
    r->deadline_ns = kvw__now_ns() + (uint64_t)ctx->wait_timeout_ms * 1000000ull;
    kvw_sender_update(ctx, r);
    pthread_mutex_unlock(&ctx->mu);
    s->room = r;
    s->ctx = ctx;
    *sender_p = s;
    return KVW_OK;
}

kvw_status_t kvw_sender_set_metadata(kvw_sender_h s, const void *data, size_t len)
{
    if (s == NULL || s->room->ctx == NULL || (data == NULL && len))
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_sender_set_metadata: NULL argument or no "
                          "context");
    if (len > KVW_MAX_ROOM_METADATA)
        return kvw__error(KVW_ERR_INVALID_PARAM, "room metadata of %zu bytes exceeds the %u "
                          "allowed", len, KVW_MAX_ROOM_METADATA);
    uint8_t *copy = malloc(len ? len : 1);
    if (copy == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory copying room metadata");
    if (len)
        memcpy(copy, data, len);
    struct kvw_ctx *ctx = s->room->ctx;
    kvw_room_t *r = s->room;
    pthread_mutex_lock(&ctx->mu);
    /* A streamed last chunk is not over before its last layer is marked: its final
     * completion (which carries the metadata's length) cannot go out before that, and
     * what engines attach (the first output token) is known only at the end of the
     * forward pass. */
    const kvw_qchunk_t *sq = r->have_stream ? &r->chunks[r->stream_chunk] : NULL;
    bool streaming_last = sq && sq->c.last_chunk && sq->unready;
    if (r->have_last && !streaming_last) {
        pthread_mutex_unlock(&ctx->mu);
        free(copy);
        return kvw__error(KVW_ERR_INVALID_PARAM, "room %llu: metadata must be attached before "
                          "the last chunk is sent (a streamed one: before its last layer is "
                          "marked ready)", (unsigned long long)r->id);
    }
    free(r->meta);
    r->meta = copy;
    r->meta_len = (uint32_t)len;
    r->has_meta = true;
    pthread_mutex_unlock(&ctx->mu);
    return KVW_OK;
}

kvw_status_t kvw_receiver_metadata(kvw_receiver_h rv, void *buf, size_t cap, size_t *len_p)
{
    if (rv == NULL || len_p == NULL || (buf == NULL && cap))
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_receiver_metadata: NULL argument");
    struct kvw_ctx *ctx = rv->room->ctx;
    kvw_room_t *r = rv->room;
    if (ctx)
        pthread_mutex_lock(&ctx->mu);
    kvw_status_t st = KVW_OK;
    *len_p = 0;
    if (r->state == KVW_ROOM_FAILED)
        st = kvw__error(r->status, "room %llu failed: %s", (unsigned long long)r->id, r->reason);
    else if (r->state != KVW_ROOM_SUCCESS)
        st = kvw__error(KVW_INPROGRESS, "room %llu has not reached Success yet",
                        (unsigned long long)r->id);
    else if (r->has_meta) {
        *len_p = r->meta_len;
        if (r->meta_len > cap)
            st = kvw__error(KVW_ERR_BUFFER_TOO_SMALL, "room %llu: metadata of %u bytes, buffer "
                            "of %zu", (unsigned long long)r->id, r->meta_len, cap);
        else if (r->meta_len)
            memcpy(buf, r->meta, r->meta_len);
    }
    if (ctx)
        pthread_mutex_unlock(&ctx->mu);
    return st;
}

static void kvw_receiver_done(struct kvw_ctx *ctx, kvw_room_t *r);

/* Decode: tells a prefill rank that every byte it owes the room, and the metadata it
 * announced, arrived. On tcp (mediated) the confirmation waits for the room-wide check
 * of where the bytes landed instead (kvw_receiver_done): a sender's own count cannot
 * vouch for that. mu held. */
static void kvw_src_confirm(struct kvw_ctx *ctx, const kvw_room_t *r, const kvw_room_src_t *s)
{
    if (s->done && s->got == s->expected && (!s->meta_expected || s->meta_got) &&
        !(ctx->tl_ops->caps & KVW_TL_CAP_MEDIATED))
        kvw_send_room_msg(ctx, ctx->peers[s->peer], KVW_MSG_ROOM_DONE, r->id, KVW_OK, "");
}

/* Decode: a prefill rank's metadata for a room (mu held). Accepted only from a prefill
 * rank that writes the room, once, bounded; several ranks must agree byte for byte. */
static void kvw_handle_meta(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb)
{
    uint64_t id = kvw__rb_u64(rb);
    size_t got = 0;
    const void *data = kvw__rb_bytes(rb, KVW_MAX_ROOM_METADATA, &got);
    uint32_t len = (uint32_t)got;
    if (data == NULL || kvw__rb_done(rb, "metadata") != KVW_OK) {
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "malformed metadata frame");
        return;
    }
    kvw_room_t *r = kvw__room_find(ctx, id);
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS)
        return; /* a room that ended or was destroyed here meanwhile */
    kvw_room_src_t *s = NULL;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].peer == peer->id)
            s = &r->srcs[i];
    if (s == NULL || s->meta_got) {
        kvw__room_fail(ctx, r, KVW_ERR_MALFORMED, true, "room %llu: %s sent metadata %s",
                       (unsigned long long)id, peer->desc,
                       s ? "twice" : "but does not write this room");
        return;
    }
    if (r->has_meta && (r->meta_len != len || (len && memcmp(r->meta, data, len)))) {
        kvw__room_fail(ctx, r, KVW_ERR_INCOMPATIBLE, true, "room %llu: prefill ranks disagree "
                       "on the room's metadata (%u bytes from one, %u from %s)",
                       (unsigned long long)id, r->meta_len, len, peer->desc);
        return;
    }
    if (!r->has_meta) {
        r->meta = malloc(len ? len : 1);
        if (r->meta == NULL) {
            kvw__room_fail(ctx, r, KVW_ERR_NO_MEMORY, true, "out of memory for room metadata");
            return;
        }
        if (len)
            memcpy(r->meta, data, len);
        r->meta_len = len;
        r->has_meta = true;
    }
    s->meta_got = true;
    kvw_src_confirm(ctx, r, s);
    kvw_receiver_done(ctx, r);
}

/* Queues a chunk; `streamed`: none of its layers is ready yet (kvw_sender_layers_ready
 * marks them). */
static kvw_status_t kvw_sender_queue(kvw_sender_h s, const kvw_send_chunk_t *chunk,
                                     bool streamed, const char *fn)
{
    if (s == NULL || chunk == NULL || s->room->ctx == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s: NULL argument or no context", fn);
    if (chunk->chunk_begin > chunk->chunk_end || chunk->chunk_end > chunk->num_tokens ||
        (chunk->last_chunk && chunk->chunk_end != chunk->num_tokens))
        return kvw__error(KVW_ERR_INVALID_PARAM, "chunk [%llu, %llu) of a %llu-token request%s",
                          (unsigned long long)chunk->chunk_begin,
                          (unsigned long long)chunk->chunk_end,
                          (unsigned long long)chunk->num_tokens,
                          chunk->last_chunk ? " cannot be the last one" : " is out of range");
    struct kvw_ctx *ctx = s->room->ctx;
    kvw_qchunk_t q = {.c = {.num_tokens = chunk->num_tokens, .chunk_begin = chunk->chunk_begin,
                            .chunk_end = chunk->chunk_end, .last_chunk = chunk->last_chunk}};
    q.pages = chunk->pages;
    q.store = malloc(sizeof(uint32_t) *
                     ((size_t)chunk->pages.full.num_pages + chunk->pages.swa.num_pages + 1));
    if (q.store == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory queuing a chunk");
    if (chunk->pages.full.num_pages)
        memcpy(q.store, chunk->pages.full.pages, sizeof(uint32_t) * chunk->pages.full.num_pages);
    if (chunk->pages.swa.num_pages)
        memcpy(q.store + chunk->pages.full.num_pages, chunk->pages.swa.pages,
               sizeof(uint32_t) * chunk->pages.swa.num_pages);
    q.pages.full.pages = q.store;
    q.pages.swa.pages = q.store + chunk->pages.full.num_pages;
    uint32_t nl = ctx->rank->par.layer_end - ctx->rank->par.layer_begin;
    if (streamed) {
        q.unready = nl;
        if ((q.ready = calloc(KVW_MAX(nl, 1), 1)) == NULL) {
            free(q.store);
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory queuing a chunk");
        }
    }

    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = s->room;
    kvw_status_t st = KVW_OK;
    const kvw_qchunk_t *cur = r->have_stream ? &r->chunks[r->stream_chunk] : NULL;
    if (r->state == KVW_ROOM_FAILED)
        st = kvw__error(r->status ? r->status : KVW_ERR_ABORTED, "room %llu already failed: %s",
                        (unsigned long long)r->id, r->reason);
    else if (r->have_last)
        st = kvw__error(KVW_ERR_INVALID_PARAM, "room %llu already sent its last chunk",
                        (unsigned long long)r->id);
    else if (cur && cur->unready)
        /* Marks name layers, not chunks: they apply to the latest streamed chunk, so the
         * next chunk may come only once its forward pass is over. */
        st = kvw__error(KVW_ERR_INVALID_PARAM, "room %llu: streamed chunk [%llu, %llu) still "
                        "waits for %u of its %u layers; mark them ready before queuing the "
                        "next chunk", (unsigned long long)r->id,
                        (unsigned long long)cur->c.chunk_begin,
                        (unsigned long long)cur->c.chunk_end, cur->unready, nl);
    else if (r->num_tokens && r->num_tokens != chunk->num_tokens)
        st = kvw__error(KVW_ERR_INVALID_PARAM, "room %llu: chunk says %llu tokens, earlier ones %llu",
                        (unsigned long long)r->id, (unsigned long long)chunk->num_tokens,
                        (unsigned long long)r->num_tokens);
    if (st == KVW_OK && r->num_chunks == r->cap_chunks) {
        uint32_t cap = r->cap_chunks ? r->cap_chunks * 2 : 4;
        kvw_qchunk_t *n = realloc(r->chunks, sizeof(*n) * cap);
        if (n == NULL)
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory queuing a chunk");
        else
            r->chunks = n, r->cap_chunks = cap;
    }
    if (st != KVW_OK) {
        pthread_mutex_unlock(&ctx->mu);
        free(q.store);
        free(q.ready);
        return st;
    }
    r->num_tokens = chunk->num_tokens;
    for (uint32_t i = 0; i < r->num_dsts; i++)
        if (r->dsts[i].num_tokens != chunk->num_tokens) {
            kvw__room_fail(ctx, r, KVW_ERR_INVALID_PARAM, true,
                           "room %llu: decode expects %llu tokens, prefill sends %llu",
                           (unsigned long long)r->id, (unsigned long long)r->dsts[i].num_tokens,
                           (unsigned long long)chunk->num_tokens);
            break;
        }
    if (streamed) {
        r->have_stream = true;
        r->stream_chunk = r->num_chunks;
    }
    r->chunks[r->num_chunks++] = q;
    r->have_last |= chunk->last_chunk != 0;
    if (chunk->last_chunk && !streamed)
        kvw__room_hop(r, KVW_HOP_SEND, false);
    kvw__room_touch(ctx, r);
    kvw_sender_update(ctx, r);
    pthread_mutex_unlock(&ctx->mu);
    return KVW_OK;
}

kvw_status_t kvw_sender_send(kvw_sender_h s, const kvw_send_chunk_t *chunk)
{
    return kvw_sender_queue(s, chunk, false, "kvw_sender_send");
}

kvw_status_t kvw_sender_send_streamed(kvw_sender_h s, const kvw_send_chunk_t *chunk)
{
    return kvw_sender_queue(s, chunk, true, "kvw_sender_send_streamed");
}

/* Checks a layer range against the room's stream (mu held): INVALID_PARAM or the room's
 * failure, with a message. */
static kvw_status_t kvw_stream_check(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t layer_begin,
                                     uint32_t layer_end)
{
    uint32_t lb = ctx->rank->par.layer_begin, le = ctx->rank->par.layer_end;
    if (layer_begin >= layer_end || layer_begin < lb || layer_end > le)
        return kvw__error(KVW_ERR_INVALID_PARAM, "layers [%u, %u) %s this rank's pipeline "
                          "stage, layers [%u, %u)", layer_begin, layer_end,
                          layer_begin >= layer_end ? "are an empty range of" : "lie outside",
                          lb, le);
    if (r->state == KVW_ROOM_FAILED)
        return kvw__error(r->status ? r->status : KVW_ERR_ABORTED, "room %llu already failed: %s",
                          (unsigned long long)r->id, r->reason);
    if (!r->have_stream)
        return kvw__error(KVW_ERR_INVALID_PARAM, "room %llu has no streamed chunk to mark "
                          "layers of (kvw_sender_send_streamed)", (unsigned long long)r->id);
    return KVW_OK;
}

void kvw__sender_mark_ready(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t chunk,
                            uint32_t layer_begin, uint32_t layer_end)
{
    /* Idempotent: a layer marked again is already ready and nothing more happens (per-
     * layer hooks of an engine may report a layer twice; readiness is a set). */
    uint32_t lb = ctx->rank->par.layer_begin;
    kvw_qchunk_t *q = &r->chunks[chunk];
    uint32_t fresh = 0;
    for (uint32_t l = layer_begin; l < layer_end; l++)
        if (!q->ready[l - lb]) {
            q->ready[l - lb] = 1;
            fresh++;
        }
    q->unready -= fresh;
    if (fresh) {
        /* For a streamed last chunk, the engine has handed everything over once its last
         * layer is ready. */
        if (q->unready == 0 && q->c.last_chunk)
            kvw__room_hop(r, KVW_HOP_SEND, false);
        kvw__room_touch(ctx, r);
        kvw_sender_update(ctx, r);
    }
}

kvw_status_t kvw_sender_layers_ready(kvw_sender_h s, uint32_t layer_begin, uint32_t layer_end)
{
    if (s == NULL || s->room->ctx == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "kvw_sender_layers_ready: NULL argument or no context");
    struct kvw_ctx *ctx = s->room->ctx;
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = s->room;
    kvw_status_t st = kvw_stream_check(ctx, r, layer_begin, layer_end);
    if (st == KVW_OK)
        kvw__sender_mark_ready(ctx, r, r->stream_chunk, layer_begin, layer_end);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

kvw_status_t kvw_sender_layers_ready_event(kvw_sender_h s, uint32_t layer_begin,
                                           uint32_t layer_end, void *cuda_event)
{
    if (s == NULL || s->room->ctx == NULL || cuda_event == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "kvw_sender_layers_ready_event: NULL argument or no context");
    struct kvw_ctx *ctx = s->room->ctx;
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = s->room;
    kvw_status_t st = kvw_stream_check(ctx, r, layer_begin, layer_end);
    if (st == KVW_OK)
        st = kvw__event_watch(ctx, r, layer_begin, layer_end, cuda_event);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

/* ------------------------------------------------------------ decode */

static int kvw_u32_cmp(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Pages of one pool that a room may have written: those covering [tb, te). */
static kvw_status_t kvw_grant(kvw_room_t *r, int pool, const kvw_pages_t *pl, uint32_t ps,
                              uint64_t capacity, uint64_t tb, uint64_t te)
{
    r->num_granted[pool] = 0;
    if (tb >= te || ps == 0)
        return KVW_OK;
    if (pl->first_token > tb || pl->first_token % ps ||
        pl->first_token + (uint64_t)pl->num_pages * ps < te)
        return kvw__error(KVW_ERR_OUT_OF_RANGE,
                          "room %llu: the %s page list (%u pages of %u tokens from token %llu) "
                          "does not cover tokens [%llu, %llu)", (unsigned long long)r->id,
                          pool == KVW_POOL_FULL ? "full-attention" : "sliding-window",
                          pl->num_pages, ps, (unsigned long long)pl->first_token,
                          (unsigned long long)tb, (unsigned long long)te);
    uint64_t i0 = (tb - pl->first_token) / ps, i1 = (te - pl->first_token + ps - 1) / ps;
    r->granted[pool] = malloc(sizeof(uint32_t) * (i1 - i0));
    if (r->granted[pool] == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory granting pages");
    memcpy(r->granted[pool], pl->pages + i0, sizeof(uint32_t) * (i1 - i0));
    qsort(r->granted[pool], i1 - i0, sizeof(uint32_t), kvw_u32_cmp);
    r->num_granted[pool] = (uint32_t)(i1 - i0);
    /* Checked here, at post, so the decode engine hears of its own mistake at once. */
    const char *name = pool == KVW_POOL_FULL ? "full-attention" : "sliding-window";
    for (uint32_t i = 0; i < r->num_granted[pool]; i++) {
        uint32_t pg = r->granted[pool][i];
        if (pg >= capacity)
            return kvw__error(KVW_ERR_OUT_OF_RANGE, "room %llu: %s page %u is outside the pool's "
                              "%llu pages", (unsigned long long)r->id, name, pg,
                              (unsigned long long)capacity);
        if (i && pg == r->granted[pool][i - 1])
            return kvw__error(KVW_ERR_INVALID_PARAM, "room %llu: %s page %u is listed twice",
                              (unsigned long long)r->id, name, pg);
    }
    return KVW_OK;
}

kvw_status_t kvw_receiver_create(kvw_ctx_h ctx, uint64_t room, uint32_t prefill_dp,
                                 kvw_receiver_h *receiver_p)
{
    return kvw_receiver_create_from(ctx, room, NULL, prefill_dp, receiver_p);
}

kvw_status_t kvw_receiver_create_from(kvw_ctx_h ctx, uint64_t room, const char *bootstrap_addr,
                                      uint32_t prefill_dp, kvw_receiver_h *receiver_p)
{
    if (ctx == NULL || receiver_p == NULL || ctx->side != KVW_SIDE_DECODE)
        return kvw__error(KVW_ERR_INVALID_PARAM, "receivers exist on decode contexts only");
    if ((bootstrap_addr == NULL || !bootstrap_addr[0]) && !ctx->bootstrap_addr[0])
        return kvw__error(KVW_ERR_INVALID_PARAM, "room %llu names no prefill instance, and this "
                          "decode context has none of its own (kvw_receiver_create_from)",
                          (unsigned long long)room);
    if (bootstrap_addr == NULL || !bootstrap_addr[0])
        bootstrap_addr = ctx->bootstrap_addr;
    struct kvw_receiver *rv = calloc(1, sizeof(*rv));
    if (rv == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a receiver");
    pthread_mutex_lock(&ctx->mu);
    int inst = kvw__inst_find_or_add(ctx, bootstrap_addr);
    if (inst < 0) {
        kvw_status_t st = kvw__error(KVW_ERR_INVALID_PARAM, "%s", kvw_last_error());
        pthread_mutex_unlock(&ctx->mu);
        free(rv);
        return st;
    }
    kvw_room_t *r = kvw__room_find(ctx, room);
    if (r) {
        pthread_mutex_unlock(&ctx->mu);
        free(rv);
        return kvw__error(KVW_ERR_BUSY, "room %llu already has a receiver on this rank",
                          (unsigned long long)room);
    }
    r = kvw__room_new(ctx, room, false);
    if (r == NULL) {
        pthread_mutex_unlock(&ctx->mu);
        free(rv);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a receiver");
    }
    r->engine_owned = true;
    r->src_dp = prefill_dp;
    /* The first room naming an instance starts connecting to it, without blocking. */
    r->inst = (uint32_t)inst;
    kvw__inst_use(ctx, r->inst);
    r->inst_gen = ctx->insts[r->inst].gen;
    pthread_mutex_unlock(&ctx->mu);
    rv->room = r;
    rv->ctx = ctx;
    *receiver_p = rv;
    return KVW_OK;
}

kvw_status_t kvw_receiver_post(kvw_receiver_h rv, const kvw_recv_post_t *post)
{
    if (rv == NULL || post == NULL || rv->room->ctx == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_receiver_post: NULL argument or no context");
    struct kvw_ctx *ctx = rv->room->ctx;
    kvw_room_t *r = rv->room;
    if (post->prefix_len > post->num_tokens)
        return kvw__error(KVW_ERR_INVALID_PARAM, "prefix %llu exceeds the request's %llu tokens",
                          (unsigned long long)post->prefix_len,
                          (unsigned long long)post->num_tokens);
    pthread_mutex_lock(&ctx->mu);
    kvw_status_t st = KVW_OK;
    if (r->state != KVW_ROOM_BOOTSTRAPPING || r->pending) {
        st = r->state == KVW_ROOM_FAILED
                 ? kvw__error(r->status, "room %llu already failed: %s", (unsigned long long)r->id,
                              r->reason)
                 : kvw__error(KVW_ERR_INVALID_PARAM, "room %llu was already posted",
                              (unsigned long long)r->id);
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    /* An instance that went down since the room was created is connected again. */
    if (kvw__inst_use(ctx, r->inst) == KVW_INST_CONNECTING &&
        r->inst_gen != ctx->insts[r->inst].gen)
        r->inst_gen = ctx->insts[r->inst].gen;
    if (ctx->insts[r->inst].state == KVW_INST_CONNECTING) {
        /* Kept (pages copied) until the connection is up; the room stays Bootstrapping. */
        size_t nf = post->pages.full.num_pages, ns = post->pages.swa.num_pages;
        r->pend_store = malloc(sizeof(uint32_t) * (nf + ns + 1));
        if (r->pend_store == NULL) {
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory posting a room");
            kvw__room_fail(ctx, r, st, false, "%s", kvw_last_error());
        } else {
            if (nf)
                memcpy(r->pend_store, post->pages.full.pages, sizeof(uint32_t) * nf);
            if (ns)
                memcpy(r->pend_store + nf, post->pages.swa.pages, sizeof(uint32_t) * ns);
            r->pend = *post;
            r->pend.pages.full.pages = r->pend_store;
            r->pend.pages.swa.pages = r->pend_store + nf;
            r->pending = true;
        }
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    if (ctx->insts[r->inst].state == KVW_INST_DOWN) {
        st = kvw__error(KVW_ERR_PEER_DEAD, "room %llu: prefill instance %s is down: %s",
                        (unsigned long long)r->id, ctx->insts[r->inst].addr,
                        ctx->insts[r->inst].why);
        kvw__room_fail(ctx, r, st, false, "%s", kvw_last_error());
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    st = kvw__receiver_post_locked(ctx, r, post);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

kvw_status_t kvw__receiver_post_locked(struct kvw_ctx *ctx, kvw_room_t *r,
                                       const kvw_recv_post_t *post)
{
    kvw_rank_h me = ctx->rank;
    kvw_status_t st = KVW_OK;
    /* Senders: every prefill rank of the chosen DP group that sends this rank bytes. */
    kvw_chunk_t whole = {.num_tokens = post->num_tokens, .chunk_begin = 0,
                         .chunk_end = post->num_tokens, .prefix_len = post->prefix_len,
                         .last_chunk = 1};
    r->srcs = calloc(ctx->num_peers ? ctx->num_peers : 1, sizeof(*r->srcs));
    if (r->srcs == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory posting a room");
        goto out;
    }
    for (uint32_t i = 0; i < ctx->num_peers; i++) {
        kvw_peer_t *p = ctx->peers[i];
        if (p->dp != r->src_dp || !p->needed || p->inst != r->inst ||
            p->inst_gen != r->inst_gen || p->registering)
            continue;
        if (p->dead) {
            st = kvw__error(KVW_ERR_PEER_DEAD, "room %llu needs %s, which is gone",
                            (unsigned long long)r->id, p->desc);
            goto out;
        }
        kvw_plan_h plan;
        if ((st = kvw__plan_create_nopages(p->remote, me, &whole, &plan)) != KVW_OK)
            goto out;
        r->srcs[r->num_srcs++] = (kvw_room_src_t){.peer = i, .expected = plan->bytes};
        kvw_plan_destroy(plan);
    }
    if (r->num_srcs == 0) {
        st = kvw__error(KVW_ERR_NOT_FOUND, "no prefill rank of DP group %u sends to this rank",
                        r->src_dp);
        goto out;
    }
    /* Grants: the pages the transfer may write, so stray writes are refused. */
    uint64_t max_window = 0; /* the widest window starts earliest */
    const kvw_model_t *m = kvw_rank_model(me);
    const kvw_parallel_t *par = kvw_rank_parallel(me);
    bool state = false;
    for (uint32_t l = par->layer_begin; l < par->layer_end; l++) {
        if (m->layers[l].kind == KVW_LAYER_SWA)
            max_window = KVW_MAX(max_window, m->layers[l].window);
        state |= m->layers[l].kind == KVW_LAYER_STATE;
    }
    uint64_t n = post->num_tokens;
    if ((st = kvw_grant(r, KVW_POOL_FULL, &post->pages.full, me->pool_page_size[KVW_POOL_FULL],
                        me->pool_capacity[KVW_POOL_FULL], post->prefix_len, n)) != KVW_OK)
        goto out;
    if (max_window) {
        uint64_t ws = n > max_window ? n - max_window : 0;
        if ((st = kvw_grant(r, KVW_POOL_SWA, &post->pages.swa, me->pool_page_size[KVW_POOL_SWA],
                            me->pool_capacity[KVW_POOL_SWA], KVW_MAX(ws, post->prefix_len),
                            n)) != KVW_OK)
            goto out;
    }
    if (state) {
        if (post->pages.state_slot < 0 ||
            (uint64_t)post->pages.state_slot >= me->pool_capacity[KVW_POOL_STATE]) {
            st = kvw__error(KVW_ERR_OUT_OF_RANGE, "room %llu: state slot %lld outside the %llu "
                            "slots", (unsigned long long)r->id, (long long)post->pages.state_slot,
                            (unsigned long long)me->pool_capacity[KVW_POOL_STATE]);
            goto out;
        }
        r->granted[KVW_POOL_STATE] = malloc(sizeof(uint32_t));
        if (r->granted[KVW_POOL_STATE] == NULL) {
            st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory granting pages");
            goto out;
        }
        r->granted[KVW_POOL_STATE][0] = (uint32_t)post->pages.state_slot;
        r->num_granted[KVW_POOL_STATE] = 1;
    }
    r->num_tokens = n;
    r->prefix_len = post->prefix_len;
    r->post_pages = post->pages;
    r->post_store = malloc(sizeof(uint32_t) *
                           ((size_t)post->pages.full.num_pages + post->pages.swa.num_pages + 1));
    if (r->post_store == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "out of memory posting a room");
        goto out;
    }
    if (post->pages.full.num_pages)
        memcpy(r->post_store, post->pages.full.pages, sizeof(uint32_t) * post->pages.full.num_pages);
    if (post->pages.swa.num_pages)
        memcpy(r->post_store + post->pages.full.num_pages, post->pages.swa.pages,
               sizeof(uint32_t) * post->pages.swa.num_pages);
    r->post_pages.full.pages = r->post_store;
    r->post_pages.swa.pages = r->post_store + post->pages.full.num_pages;
    kvw__room_hop(r, KVW_HOP_POST, false);
    /* Every prefill rank of the group hears of the room, even one that sends this rank
     * nothing: it learns the room's DP group from it. */
    for (uint32_t i = 0; i < ctx->num_peers; i++) {
        kvw_peer_t *p = ctx->peers[i];
        if (p->dp != r->src_dp || p->dead || p->inst != r->inst || p->inst_gen != r->inst_gen ||
            p->registering)
            continue;
        kvw_wbuf_t w;
        kvw__wb_init(&w, KVW_MSG_REQ);
        kvw__wb_u64(&w, r->id);
        kvw__wb_u32(&w, par->dp_rank);
        kvw__wb_u64(&w, n);
        kvw__wb_u64(&w, post->prefix_len);
        kvw__wire_put_pages(&w, &post->pages.full);
        kvw__wire_put_pages(&w, &post->pages.swa);
        kvw__wb_u64(&w, (uint64_t)post->pages.state_slot);
        kvw__peer_send(ctx, ctx->peers[i], &w);
    }
    r->deadline_ns = kvw__now_ns() + (uint64_t)ctx->wait_timeout_ms * 1000000ull;
    kvw__room_advance(r, KVW_ROOM_WAITING_FOR_INPUT);
out:
    if (st != KVW_OK)
        kvw__room_fail(ctx, r, st, false, "%s", kvw_last_error());
    return st;
}

static void kvw_receiver_done(struct kvw_ctx *ctx, kvw_room_t *r)
{
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (!r->srcs[i].done || (r->srcs[i].meta_expected && !r->srcs[i].meta_got))
            return;
    /* On transports whose receiver sees every write (tcp), the bytes that actually landed
     * must match too: a sender's own count cannot vouch for writes lost on the way. */
    if (ctx->tl_ops->caps & KVW_TL_CAP_MEDIATED) {
        uint64_t want = 0;
        for (uint32_t i = 0; i < r->num_srcs; i++)
            want += r->srcs[i].expected;
        /* Page-exact: no byte written twice, and the distinct bytes (direct writes plus
         * staged windows each covered exactly once) are what the plans imply. A byte
         * count alone let one page written twice stand in for one never written. */
        kvw_iv_t a, b;
        uint64_t distinct = 0;
        if (!kvw__ivlog_check(&r->writes, &a, &b, &distinct)) {
            kvw__room_fail(ctx, r, KVW_ERR_BYTE_MISMATCH, true,
                           "room %llu: buffer %llu bytes [%llu, %llu) were written twice "
                           "(overlapping writes [%llu, %llu) and [%llu, %llu))",
                           (unsigned long long)r->id, (unsigned long long)b.region,
                           (unsigned long long)b.lo,
                           (unsigned long long)(b.hi < a.hi ? b.hi : a.hi),
                           (unsigned long long)a.lo, (unsigned long long)a.hi,
                           (unsigned long long)b.lo, (unsigned long long)b.hi);
            return;
        }
        if (distinct + r->staged_exact != want) {
            kvw__room_fail(ctx, r, KVW_ERR_BYTE_MISMATCH, true,
                           "room %llu: %llu distinct bytes landed, the plans expect %llu "
                           "(part of the room's pages was never written)",
                           (unsigned long long)r->id,
                           (unsigned long long)(distinct + r->staged_exact),
                           (unsigned long long)want);
            return;
        }
        if (r->landed != want) {
            kvw__room_fail(ctx, r, KVW_ERR_BYTE_MISMATCH, true,
                           "room %llu: %llu bytes landed, the plans expect %llu",
                           (unsigned long long)r->id, (unsigned long long)r->landed,
                           (unsigned long long)want);
            return;
        }
    }
    /* Fail closed: every sender's byte count must be exactly what the plan implies. */
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].got != r->srcs[i].expected) {
            kvw__room_fail(ctx, r, KVW_ERR_BYTE_MISMATCH, true,
                           "%s delivered %llu bytes, the plan expects %llu",
                           ctx->peers[r->srcs[i].peer]->desc,
                           (unsigned long long)r->srcs[i].got,
                           (unsigned long long)r->srcs[i].expected);
            return;
        }
    if (ctx->tl_ops->caps & KVW_TL_CAP_MEDIATED)
        for (uint32_t i = 0; i < r->num_srcs; i++)
            kvw_send_room_msg(ctx, ctx->peers[r->srcs[i].peer], KVW_MSG_ROOM_DONE, r->id, KVW_OK,
                              "");
    kvw__room_advance(r, KVW_ROOM_SUCCESS);
}

/* Scatters one staged window of a room's chunk from the staging area (no mu held;
 * the room is pinned by inflight). */
static kvw_status_t kvw_scatter(struct kvw_ctx *ctx, kvw_rank_h src, kvw_room_t *r,
                                const kvw_chunk_t *c, uint64_t soff, uint64_t slen, uint64_t goff)
{
    if (goff > ctx->staging_len || slen > ctx->staging_len - goff)
        return kvw__error(KVW_ERR_OUT_OF_RANGE, "staged window [%llu, +%llu) outside the staging "
                          "area", (unsigned long long)goff, (unsigned long long)slen);
    /* The source's page indices do not matter to the byte stream, only its geometry:
     * give the plan all-zero source page lists covering the request. */
    const kvw_parallel_t *sp = kvw_rank_parallel(src);
    (void)sp;
    uint32_t ps_full = KVW_MAX(src->pool_page_size[KVW_POOL_FULL], 1);
    uint32_t ps_swa = KVW_MAX(src->pool_page_size[KVW_POOL_SWA], 1);
    uint64_t nf = (c->num_tokens + ps_full - 1) / ps_full + 1;
    uint64_t ns = (c->num_tokens + ps_swa - 1) / ps_swa + 1;
    uint32_t *zeros = calloc(KVW_MAX(nf, ns), sizeof(uint32_t));
    if (zeros == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory scattering");
    kvw_side_pages_t fake = {.full = {zeros, (uint32_t)nf, 0}, .swa = {zeros, (uint32_t)ns, 0},
                             .state_slot = 0};
    kvw_plan_h plan;
    kvw_status_t st = kvw_plan_create(src, ctx->rank, c, &fake, &r->post_pages, &plan);
    if (st == KVW_OK) {
        st = kvw_stage_move(ctx, plan, false, ctx->staging + goff, soff, soff + slen);
        kvw_plan_destroy(plan);
    }
    free(zeros);
    return st;
}

/* A data connection says which peer it belongs to (KVW_MSG_BIND, its first message).
 * The claim is only recorded here; kvw_bound checks it against the peer's nonce when a
 * completion arrives, since the BIND can overtake the registration that creates the peer. */
static void kvw_on_bind(struct kvw_ctx *ctx, kvw_tl_ep_h ep, kvw_rbuf_t *rb)
{
    kvw_bind_t b = {.ep = ep};
    b.peer = kvw__rb_u32(rb);
    for (size_t i = 0; i < sizeof(b.nonce); i++)
        b.nonce[i] = kvw__rb_u8(rb);
    if (kvw__rb_done(rb, "bind") != KVW_OK)
        return;
    pthread_mutex_lock(&ctx->mu);
    bool known = false;
    for (uint32_t i = 0; i < ctx->num_binds; i++)
        known |= ctx->binds[i].ep == ep;
    if (!known && ctx->num_binds == ctx->cap_binds) {
        uint32_t cap = ctx->cap_binds ? ctx->cap_binds * 2 : 16;
        kvw_bind_t *v = realloc(ctx->binds, sizeof(*v) * cap);
        if (v) {
            ctx->binds = v;
            ctx->cap_binds = cap;
        }
    }
    /* One claim per connection: a second BIND cannot re-point it. */
    if (!known && ctx->num_binds < ctx->cap_binds)
        ctx->binds[ctx->num_binds++] = b;
    pthread_mutex_unlock(&ctx->mu);
}

/* Whether `ep` is the data connection of peer `peer_id` (mu held). */
static bool kvw_bound(struct kvw_ctx *ctx, kvw_tl_ep_h ep, uint32_t peer_id)
{
    if (peer_id >= ctx->num_peers)
        return false;
    const kvw_peer_t *p = ctx->peers[peer_id];
    for (uint32_t i = 0; i < ctx->num_binds; i++) {
        const kvw_bind_t *b = &ctx->binds[i];
        if (b->ep != ep)
            continue;
        uint8_t diff = (uint8_t)(b->peer != peer_id);
        for (size_t k = 0; k < sizeof(b->nonce); k++)
            diff |= b->nonce[k] ^ p->bind_nonce[k];
        return diff == 0;
    }
    return false;
}

void kvw__on_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len)
{
    struct kvw_ctx *ctx = arg;
    (void)ep;
    if (len < KVW_WIRE_HDR)
        return;
    uint8_t type = 0;
    uint32_t plen;
    if (kvw__wire_header(msg, &type, &plen) != KVW_OK ||
        (type != KVW_MSG_DONE && type != KVW_MSG_BIND) || plen != len - KVW_WIRE_HDR)
        return;
    kvw_rbuf_t rb;
    kvw__rb_init(&rb, (const uint8_t *)msg + KVW_WIRE_HDR, plen);
    if (type == KVW_MSG_BIND) {
        kvw_on_bind(ctx, ep, &rb);
        return;
    }
    uint64_t id = kvw__rb_u64(&rb);
    uint32_t peer_id = kvw__rb_u32(&rb);
    kvw_chunk_t c = {0};
    c.chunk_begin = kvw__rb_u64(&rb);
    c.chunk_end = kvw__rb_u64(&rb);
    uint64_t bytes = kvw__rb_u64(&rb);
    c.last_chunk = kvw__rb_u8(&rb) != 0;
    bool staged = kvw__rb_u8(&rb) != 0;
    uint64_t soff = kvw__rb_u64(&rb), slen = kvw__rb_u64(&rb), goff = kvw__rb_u64(&rb);
    bool final = kvw__rb_u8(&rb) != 0;
    uint32_t meta_len = kvw__rb_u32(&rb);
    if (kvw__rb_done(&rb, "done") != KVW_OK || meta_len > KVW_MAX_ROOM_METADATA)
        return;
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = kvw__room_find(ctx, id);
    kvw_room_src_t *s = NULL;
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED || r->state == KVW_ROOM_SUCCESS)
        goto out;
    /* A completion counts only on the data connection its peer bound (any local process
     * can reach a shm socket, any host a tcp port): anything else is refused, and the
     * room carries on waiting for its real sender. */
    if (!kvw_bound(ctx, ep, peer_id))
        goto out;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].peer == peer_id)
            s = &r->srcs[i];
    if (s == NULL || s->done || c.chunk_begin > c.chunk_end || c.chunk_end > r->num_tokens ||
        (c.last_chunk && c.chunk_end != r->num_tokens)) {
        kvw__room_fail(ctx, r, KVW_ERR_MALFORMED, true,
                       "room %llu: bad completion from peer %u (chunk [%llu, %llu))",
                       (unsigned long long)id, peer_id, (unsigned long long)c.chunk_begin,
                       (unsigned long long)c.chunk_end);
        goto out;
    }
    kvw__room_hop(r, KVW_HOP_DONE_RX, false);
    kvw__room_advance(r, KVW_ROOM_TRANSFERRING);
    kvw__room_touch(ctx, r);
    if (staged) {
        /* The window must be exactly a span this room was granted. */
        bool ok = false;
        for (uint32_t i = 0; i < ctx->num_spans; i++)
            ok |= ctx->spans[i].off == goff && ctx->spans[i].len == slen && ctx->spans[i].room == id;
        if (!ok) {
            kvw__room_fail(ctx, r, KVW_ERR_OUT_OF_RANGE, true,
                           "room %llu: staged data at [%llu, +%llu) was never granted",
                           (unsigned long long)id, (unsigned long long)goff,
                           (unsigned long long)slen);
            goto out;
        }
        /* On tcp the window must have been written exactly once, all of it, before it is
         * scattered: stale staging bytes would otherwise land in the room's pages. */
        if (ctx->tl_ops->caps & KVW_TL_CAP_MEDIATED) {
            uint64_t got = 0;
            if (!kvw__ivlog_take(&r->writes, KVW_IV_STAGED | goff, goff, goff + slen, &got) ||
                got != slen) {
                kvw__room_fail(ctx, r, KVW_ERR_BYTE_MISMATCH, true,
                               "room %llu: staged window [%llu, +%llu) was %s",
                               (unsigned long long)id, (unsigned long long)goff,
                               (unsigned long long)slen,
                               got == slen ? "partly written twice" : "not written exactly once");
                goto out;
            }
            r->staged_exact += slen;
        }
        c.num_tokens = r->num_tokens;
        c.prefix_len = r->prefix_len;
        kvw_rank_h src = ctx->peers[peer_id]->remote;
        r->inflight++;
        pthread_mutex_unlock(&ctx->mu);
        kvw_status_t st = kvw_scatter(ctx, src, r, &c, soff, slen, goff);
        char why[400];
        snprintf(why, sizeof(why), "%s", kvw_last_error());
        pthread_mutex_lock(&ctx->mu);
        r->inflight--;
        pthread_cond_broadcast(&ctx->cv);
        kvw__stage_free(ctx, goff);
        if (st != KVW_OK) {
            kvw__room_fail(ctx, r, st, true, "room %llu: scattering staged data failed: %s",
                           (unsigned long long)id, why);
            goto out;
        }
        if (r->state == KVW_ROOM_FAILED)
            goto out;
        bytes = slen;
        r->path = "staged";
    } else {
        r->path = "direct";
    }
    s->got += bytes;
    r->bytes += bytes;
    if (final) {
        s->done = c.last_chunk;
        if (c.last_chunk)
            s->meta_expected = meta_len;
    }
    kvw_src_confirm(ctx, r, s);
    kvw_receiver_done(ctx, r);
out:
    pthread_mutex_unlock(&ctx->mu);
}

static bool kvw_granted(const kvw_room_t *r, int pool, uint32_t page)
{
    const uint32_t *g = r->granted[pool];
    uint32_t lo = 0, hi = r->num_granted[pool];
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (g[mid] == page)
            return true;
        if (g[mid] < page)
            lo = mid + 1;
        else
            hi = mid;
    }
    return false;
}

/* Records an admitted write (mu held). More bytes than the plans imply fail the room at
 * once, which also bounds the record's size by the room's own byte count. */
static kvw_status_t kvw_note_write(struct kvw_ctx *ctx, kvw_room_t *r, uint64_t key,
                                   uint64_t off, uint64_t len)
{
    uint64_t want = 0;
    for (uint32_t i = 0; i < r->num_srcs; i++)
        want += r->srcs[i].expected;
    kvw_status_t st = KVW_OK;
    if (len > want - KVW_MIN(r->landed, want))
        st = kvw__error(KVW_ERR_BYTE_MISMATCH, "room %llu: writes exceed the %llu bytes the "
                        "plans expect", (unsigned long long)r->id, (unsigned long long)want);
    else
        st = kvw__ivlog_add(&r->writes, key, off, len);
    if (st != KVW_OK) {
        kvw__room_fail(ctx, r, st, true, "%s", kvw_last_error());
        return st;
    }
    r->landed += len;
    return KVW_OK;
}

kvw_status_t kvw__check_write(void *arg, uint64_t room, uint64_t region, uint64_t off,
                              uint64_t len)
{
    struct kvw_ctx *ctx = arg;
    kvw_status_t st = KVW_OK;
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = kvw__room_find(ctx, room);
    const kvw_buffer_desc_t *b = kvw_rank_buffer(ctx->rank, (uint32_t)region);
    bool staging = region == ctx->rank->num_bufs && ctx->staging;
    if (r == NULL || r->is_sender || r->state == KVW_ROOM_FAILED ||
        r->state == KVW_ROOM_SUCCESS || r->state == KVW_ROOM_BOOTSTRAPPING ||
        (b == NULL && !staging)) {
        st = KVW_ERR_OUT_OF_RANGE;
        if (r && !r->is_sender)
            kvw__room_fail(ctx, r, st, true, "a write arrived for room %llu in state %s",
                           (unsigned long long)room, kvw_room_state_string(r->state));
        goto out;
    }
    if (region == ctx->rank->num_bufs && ctx->staging) {
        /* The staging area: only inside a span granted to this room. */
        for (uint32_t i = 0; i < ctx->num_spans; i++)
            if (ctx->spans[i].room == room && off >= ctx->spans[i].off &&
                off - ctx->spans[i].off <= ctx->spans[i].len &&
                len <= ctx->spans[i].len - (off - ctx->spans[i].off)) {
                st = kvw_note_write(ctx, r, KVW_IV_STAGED | ctx->spans[i].off, off, len);
                goto out;
            }
        st = KVW_ERR_OUT_OF_RANGE;
        kvw__room_fail(ctx, r, st, true, "room %llu: a staged write to [%llu, +%llu) lies outside "
                       "its staging grant", (unsigned long long)room, (unsigned long long)off,
                       (unsigned long long)len);
        goto out;
    }
    const kvw_comp_view_t *v = NULL;
    for (uint32_t i = 0; i < ctx->rank->num_views; i++)
        if (ctx->rank->views[i].buf == region) {
            v = &ctx->rank->views[i];
            break;
        }
    if (v == NULL || len == 0) {
        st = KVW_ERR_OUT_OF_RANGE;
        goto out;
    }
    uint64_t ps = v->view.page_stride;
    for (uint64_t p = off / ps; p <= (off + len - 1) / ps; p++)
        if (p > UINT32_MAX || !kvw_granted(r, (int)v->pool, (uint32_t)p)) {
            st = KVW_ERR_OUT_OF_RANGE;
            kvw__room_fail(ctx, r, st, true,
                           "room %llu: a write to buffer %llu bytes [%llu, %llu) touches page "
                           "%llu, which this room was not granted", (unsigned long long)room,
                           (unsigned long long)region, (unsigned long long)off,
                           (unsigned long long)(off + len), (unsigned long long)p);
            break;
        }
    if (st == KVW_OK)
        st = kvw_note_write(ctx, r, region, off, len);
out:
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

void kvw__on_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason)
{
    /* The control channel of the same peer notices the failure (closed socket or missing
     * heartbeats) and fails its rooms with a name. Here the connection only loses its
     * binding: the transport frees the endpoint after this returns, and its address may
     * be reused by a later connection. */
    struct kvw_ctx *ctx = arg;
    (void)status;
    (void)reason;
    pthread_mutex_lock(&ctx->mu);
    for (uint32_t i = 0; i < ctx->num_binds; i++)
        if (ctx->binds[i].ep == ep) {
            ctx->binds[i] = ctx->binds[--ctx->num_binds];
            break;
        }
    pthread_mutex_unlock(&ctx->mu);
}

/* ------------------------------------------------------------ frames */

void kvw__handle_frame(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, const uint8_t *p,
                       uint32_t len)
{
    kvw_rbuf_t rb;
    kvw__rb_init(&rb, p, len);
    switch (type) {
    case KVW_MSG_HEARTBEAT:
        if (len)
            kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "heartbeat with a payload");
        return;
    case KVW_MSG_REQ:
        if (ctx->side != KVW_SIDE_PREFILL)
            break;
        kvw_handle_req(ctx, peer, &rb);
        return;
    case KVW_MSG_STAGE_ASK: {
        uint64_t id = kvw__rb_u64(&rb), want = kvw__rb_u64(&rb);
        if (ctx->side != KVW_SIDE_DECODE || kvw__rb_done(&rb, "staging request") != KVW_OK)
            break;
        kvw__stage_ask(ctx, peer, id, want);
        return;
    }
    case KVW_MSG_STAGE_GRANT: {
        uint64_t id = kvw__rb_u64(&rb), off = kvw__rb_u64(&rb), glen = kvw__rb_u64(&rb);
        if (ctx->side != KVW_SIDE_PREFILL || kvw__rb_done(&rb, "staging grant") != KVW_OK ||
            off > INT64_MAX)
            break;
        kvw_room_t *r = kvw__room_find(ctx, id);
        for (uint32_t i = 0; r && i < r->num_dsts; i++)
            if (r->dsts[i].peer == peer->id) {
                r->dsts[i].grant_off = (int64_t)off;
                r->dsts[i].grant_len = glen;
            }
        pthread_cond_broadcast(&ctx->cv);
        return;
    }
    case KVW_MSG_ROOM_DONE: {
        uint64_t id = kvw__rb_u64(&rb);
        (void)kvw__rb_u32(&rb);
        char unused[8];
        kvw__rb_str(&rb, unused, sizeof(unused));
        if (ctx->side != KVW_SIDE_PREFILL || kvw__rb_done(&rb, "room done") != KVW_OK)
            break;
        kvw_room_t *r = kvw__room_find(ctx, id);
        for (uint32_t i = 0; r && i < r->num_dsts; i++)
            if (r->dsts[i].peer == peer->id) {
                r->dsts[i].acked = true;
                kvw__room_hop(r, KVW_HOP_ACK_RX, false);
            }
        if (r)
            kvw_sender_update(ctx, r);
        return;
    }
    case KVW_MSG_META:
        if (ctx->side != KVW_SIDE_DECODE)
            break;
        kvw_handle_meta(ctx, peer, &rb);
        return;
    case KVW_MSG_ABORT:
    case KVW_MSG_FAILED:
    case KVW_MSG_ABORT_ACK: {
        uint64_t id = kvw__rb_u64(&rb);
        kvw_status_t st = (kvw_status_t)(int32_t)kvw__rb_u32(&rb);
        char reason[256];
        kvw__rb_str(&rb, reason, sizeof(reason));
        if (kvw__rb_done(&rb, "room message") != KVW_OK) {
            kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, kvw_last_error());
            return;
        }
        if (st >= 0 || st < -100)
            st = KVW_ERR_REMOTE_FAILED;
        kvw_room_t *r = kvw__room_find(ctx, id);
        if (type == KVW_MSG_ABORT && ctx->side == KVW_SIDE_PREFILL && r && r->dst_dp >= 0 &&
            (peer->instance != r->dst_instance || peer->dp != (uint32_t)r->dst_dp)) {
            /* Only the decode instance and DP group that own a room may abort it: without
             * a secret any decode can send this frame. The owner's room carries on; the
             * sender learns why (and is not left waiting for an acknowledgement). */
            char why[320];
            snprintf(why, sizeof(why), "room %llu belongs to decode instance %llu group %d: "
                     "an abort from %.120s (instance %llu group %u) is refused",
                     (unsigned long long)id, (unsigned long long)r->dst_instance, r->dst_dp,
                     peer->desc, (unsigned long long)peer->instance, peer->dp);
            kvw_send_room_msg(ctx, peer, KVW_MSG_FAILED, id, KVW_ERR_REJECTED, why);
            kvw_send_room_msg(ctx, peer, KVW_MSG_ABORT_ACK, id, KVW_ERR_ABORTED, "refused");
        } else if (type == KVW_MSG_ABORT && ctx->side == KVW_SIDE_PREFILL) {
            if (r == NULL)
                r = kvw__room_new(ctx, id, true); /* remembered so a later sender fails */
            /* The room's other decode ranks hear of it too (FAILED). */
            if (r)
                kvw__room_fail(ctx, r, KVW_ERR_ABORTED, true, "aborted by %s: %s", peer->desc,
                               reason);
            /* A decode rank this room writes gets its ABORT_ACK once the worker is out
             * of the room (kvw_room_quiesce); any other one can have it now. */
            bool dst = false;
            for (uint32_t i = 0; r && i < r->num_dsts; i++)
                dst |= r->dsts[i].peer == peer->id;
            if (!dst || (r && r->quiesce_sent))
                kvw_send_room_msg(ctx, peer, KVW_MSG_ABORT_ACK, id, KVW_ERR_ABORTED, "stopped");
        } else if (type == KVW_MSG_FAILED && ctx->side == KVW_SIDE_DECODE && r) {
            kvw__room_fail(ctx, r, st == KVW_ERR_ABORTED ? KVW_ERR_ABORTED : KVW_ERR_REMOTE_FAILED,
                           false, "%s failed the room: %s", peer->desc, reason);
        } else if (type == KVW_MSG_ABORT_ACK && ctx->side == KVW_SIDE_DECODE && r) {
            for (uint32_t i = 0; i < r->num_srcs; i++)
                if (r->srcs[i].peer == peer->id)
                    r->srcs[i].quiet = true;
            pthread_cond_broadcast(&ctx->cv);
        }
        return;
    }
    default:
        break;
    }
    char why[96];
    snprintf(why, sizeof(why), "unexpected frame type %u on the control channel", type);
    kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, why);
}

/* ------------------------------------------------------------ handles */

/* Decode: until every prefill rank that may still write the room's pages confirmed it
 * stopped, died, or the peer timeout passed. mu held. */
static void kvw_room_wait_quiet(struct kvw_ctx *ctx, kvw_room_t *r)
{
    if (r->is_sender)
        return;
    uint64_t deadline = kvw__now_ns() + (uint64_t)ctx->peer_timeout_ms * 1000000ull;
    for (;;) {
        bool busy = false;
        for (uint32_t i = 0; i < r->num_srcs; i++) {
            kvw_room_src_t *s = &r->srcs[i];
            busy |= !s->done && !s->quiet && !ctx->peers[s->peer]->dead;
        }
        uint64_t now = kvw__now_ns();
        if (!busy || now >= deadline || ctx->stopping)
            return;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t wait = KVW_MIN(deadline - now, 50000000ull);
        ts.tv_nsec += (long)(wait % 1000000000ull);
        ts.tv_sec += (time_t)(wait / 1000000000ull) + ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&ctx->cv, &ctx->mu, &ts);
    }
}

#define KVW_HANDLE_FNS(kind, T)                                                          \
    kvw_room_state_t kvw_##kind##_poll(T h)                                              \
    {                                                                                    \
        if (h == NULL)                                                                   \
            return KVW_ROOM_FAILED;                                                      \
        if (h->room->ctx == NULL)                                                              \
            return h->room->state;                                                       \
        pthread_mutex_lock(&h->room->ctx->mu);                                                 \
        kvw_room_state_t s = h->room->state;                                             \
        pthread_mutex_unlock(&h->room->ctx->mu);                                               \
        return s;                                                                        \
    }                                                                                    \
    const char *kvw_##kind##_failure(T h)                                                \
    {                                                                                    \
        if (h == NULL)                                                                   \
            return "NULL handle";                                                        \
        return kvw_##kind##_poll(h) == KVW_ROOM_FAILED ? h->room->reason : "";           \
    }                                                                                    \
    kvw_status_t kvw_##kind##_status(T h)                                                \
    {                                                                                    \
        kvw_room_state_t s = kvw_##kind##_poll(h);                                       \
        return s == KVW_ROOM_FAILED ? (h ? h->room->status : KVW_ERR_INVALID_PARAM)      \
               : s == KVW_ROOM_SUCCESS ? KVW_OK                                          \
                                       : KVW_INPROGRESS;                                 \
    }                                                                                    \
    void kvw_##kind##_metrics(T h, kvw_room_metrics_t *m)                                \
    {                                                                                    \
        if (h == NULL || m == NULL)                                                      \
            return;                                                                      \
        if (h->room->ctx)                                                                      \
            pthread_mutex_lock(&h->room->ctx->mu);                                             \
        m->bytes = h->room->bytes;                                                       \
        m->runs = h->room->runs;                                                         \
        m->start_ns = h->room->start_ns;                                                 \
        m->end_ns = h->room->end_ns;                                                     \
        m->path = h->room->path ? h->room->path : "none";                                \
        memcpy(m->hop_ns, h->room->hop_ns, sizeof(m->hop_ns));                           \
        if (h->room->ctx)                                                                      \
            pthread_mutex_unlock(&h->room->ctx->mu);                                           \
    }                                                                                    \
    kvw_room_state_t kvw_##kind##_wait(T h, uint32_t timeout_ms)                         \
    {                                                                                    \
        if (h == NULL)                                                                   \
            return KVW_ROOM_FAILED;                                                      \
        struct kvw_ctx *ctx = h->room->ctx;                                              \
        if (ctx == NULL)                                                                 \
            return h->room->state;                                                       \
        struct timespec ts;                                                              \
        clock_gettime(CLOCK_MONOTONIC, &ts);                                             \
        ts.tv_sec += (time_t)(timeout_ms / 1000u);                                       \
        ts.tv_nsec += (long)(timeout_ms % 1000u) * 1000000L;                             \
        if (ts.tv_nsec >= 1000000000L) {                                                 \
            ts.tv_sec++;                                                                 \
            ts.tv_nsec -= 1000000000L;                                                   \
        }                                                                                \
        pthread_mutex_lock(&ctx->mu);                                                    \
        if (ctx->busy_poll_ns && timeout_ms && h->room->state != KVW_ROOM_SUCCESS &&      \
            h->room->state != KVW_ROOM_FAILED) {                                         \
            uint32_t seen_ = atomic_load_explicit(&ctx->done_gen, memory_order_acquire); \
            pthread_mutex_unlock(&ctx->mu);                                              \
            kvw__busy_wait(ctx, &ctx->done_gen, seen_);                                  \
            pthread_mutex_lock(&ctx->mu);                                                \
        }                                                                                \
        while (h->room->state != KVW_ROOM_SUCCESS && h->room->state != KVW_ROOM_FAILED &&  \
               timeout_ms &&                                                             \
               pthread_cond_timedwait(&ctx->done_cv, &ctx->mu, &ts) != ETIMEDOUT) {      \
        }                                                                                \
        kvw_room_state_t s = h->room->state;                                             \
        pthread_mutex_unlock(&ctx->mu);                                                  \
        return s;                                                                        \
    }                                                                                    \
    void kvw_##kind##_abort(T h)                                                         \
    {                                                                                    \
        if (h == NULL || h->room->ctx == NULL)                                                 \
            return;                                                                      \
        pthread_mutex_lock(&h->room->ctx->mu);                                                 \
        kvw__room_fail(h->room->ctx, h->room, KVW_ERR_ABORTED, true, "aborted by the %s engine", \
                       h->room->is_sender ? "prefill" : "decode");                       \
        pthread_mutex_unlock(&h->room->ctx->mu);                                               \
    }                                                                                    \
    void kvw_##kind##_destroy(T h)                                                       \
    {                                                                                    \
        if (h == NULL)                                                                   \
            return;                                                                      \
        struct kvw_ctx *ctx = h->room->ctx;                                                    \
        if (ctx) {                                                                       \
            pthread_mutex_lock(&ctx->mu);                                                \
            kvw__room_fail(ctx, h->room, KVW_ERR_ABORTED, true,                          \
                           "the room was destroyed before it finished");                 \
            while (h->room->inflight)                                                    \
                pthread_cond_wait(&ctx->cv, &ctx->mu);                                   \
            kvw_room_wait_quiet(ctx, h->room);                                           \
            kvw__room_unlink(ctx, h->room);                                              \
            pthread_mutex_unlock(&ctx->mu);                                              \
        }                                                                                \
        kvw__room_free(h->room);                                                         \
        free(h);                                                                         \
    }

KVW_HANDLE_FNS(sender, kvw_sender_h)
KVW_HANDLE_FNS(receiver, kvw_receiver_h)
