/* Room state machine: the states' names, moving a room forward, its inactivity
 * deadline and timeouts (with what a timed-out room still waited for), and the calls of
 * the engine on any room handle (poll, failure, status, metrics, wait, abort, destroy). A room's
 * failure itself is in fail.c. */
#include "proto/proto.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

const char *kvw_room_state_string(kvw_room_state_t s)
{
    static const char *n[] = {"Bootstrapping", "WaitingForInput", "Transferring", "Success",
                              "Failed"};
    return (unsigned)s < KVW_ARRAY_SIZE(n) ? n[s] : "unknown";
}

void kvw__room_touch(struct kvw_ctx *ctx, kvw_room_t *room)
{
    KVW_ASSERT_HELD(&ctx->mu);
    room->deadline_ns = kvw__now_ns() + (uint64_t)ctx->wait_timeout_ms * 1000000ull;
}

/* A thread that completes rooms under mu and lets go of it right after (the decode's
 * landing, on the transport's receive thread) wakes their waiters once it let go
 * (kvw__room_wake_after): woken under mu, a waiter would only run into the lock held
 * and sleep again. */
static _Thread_local struct kvw_ctx *kvw_wake_ctx;
static _Thread_local bool kvw_wake_defer, kvw_wake_owed;

void kvw__room_wake_defer(struct kvw_ctx *ctx)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_wake_ctx = ctx;
    kvw_wake_defer = true;
    kvw_wake_owed = false;
}

void kvw__room_wake_after(struct kvw_ctx *ctx)
{
    bool owed = kvw_wake_defer && kvw_wake_ctx == ctx && kvw_wake_owed;
    kvw_wake_defer = kvw_wake_owed = false;
    kvw_wake_ctx = NULL;
    if (owed)
        pthread_cond_broadcast(&ctx->done_cv);
}

void kvw__room_advance(kvw_room_t *room, kvw_room_state_t state)
{
    /* Monotonic: never back, never out of a terminal state. */
    if (room->state == KVW_ROOM_FAILED || room->state == KVW_ROOM_SUCCESS || state <= room->state)
        return;
    /* One clock reading for the Success stamp and the latency counter (metrics.c): two
     * readings a preemption apart would disagree on a loaded host. */
    if (state == KVW_ROOM_SUCCESS)
        room->end_ns = kvw__now_ns();
    kvw__metrics_room_moves(room, state, KVW_OK);
    room->state = state;
    if (state == KVW_ROOM_TRANSFERRING && !room->start_ns)
        room->start_ns = kvw__now_ns();
    if (state == KVW_ROOM_SUCCESS) {
        room->hop_ns[KVW_HOP_SUCCESS] = room->end_ns;
        if (room->ctx) {
            atomic_fetch_add_explicit(&room->ctx->done_gen, 1, memory_order_release);
            if (kvw_wake_defer && kvw_wake_ctx == room->ctx)
                kvw_wake_owed = true;
            else
                pthread_cond_broadcast(&room->ctx->done_cv);
        }
    }
}

/* What a prefill room still waits for, for its timeout message. */
static void kvw_room_waiting(struct kvw_ctx *ctx, kvw_room_t *r, char *buf, size_t cap)
{
    if (r->dst_dp < 0) {
        snprintf(buf, cap, " (no decode rank posted the room)");
        return;
    }
    uint32_t group = 0, connected = 0, needed = 0;
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++)
        if (kvw__peer_at(ctx, i)->dp == (uint32_t)r->dst_dp && !kvw__peer_at(ctx, i)->dead &&
            kvw__peer_at(ctx, i)->instance == r->dst_instance) {
            group = kvw__peer_at(ctx, i)->remote_group_size;
            connected++;
            needed += kvw__peer_at(ctx, i)->needed;
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
    KVW_ASSERT_HELD(&ctx->mu);
    for (kvw_room_t *r = kvw__room_first(ctx), *next; r; r = next) {
        next = kvw__room_next(ctx, r);
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
            kvw__room_unlink(ctx, r);
            kvw__room_free(r);
        }
    }
}

/* Decode: until every prefill rank that may still write the room's pages confirmed it
 * stopped, died, or the peer timeout passed. mu held. */
static void kvw_room_wait_quiet(struct kvw_ctx *ctx, kvw_room_t *r)
{
    if (r->is_sender)
        return;
    uint64_t deadline = kvw__now_ns() + (uint64_t)ctx->peer_timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = kvw__now_ns();
        if (kvw__room_quiet(ctx, r) || now >= deadline || ctx->stopping)
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

/* ---------------------------------------------------------------- the room handle */

kvw_room_h kvw_sender_room(kvw_sender_h sender)
{
    return kvw__sender_room(sender);
}

kvw_room_h kvw_receiver_room(kvw_receiver_h receiver)
{
    return kvw__receiver_room(receiver);
}

uint64_t kvw_room_id(kvw_room_h h)
{
    return h ? h->id : 0;
}

kvw_side_t kvw_room_side(kvw_room_h h)
{
    return h && !h->is_sender ? KVW_SIDE_DECODE : KVW_SIDE_PREFILL;
}

kvw_room_state_t kvw_room_poll(kvw_room_h h)
{
    if (h == NULL)
        return KVW_ROOM_FAILED;
    if (h->ctx == NULL)
        return h->state;
    pthread_mutex_lock(&h->ctx->mu);
    kvw_room_state_t s = h->state;
    pthread_mutex_unlock(&h->ctx->mu);
    return s;
}

const char *kvw_room_failure(kvw_room_h h)
{
    if (h == NULL)
        return "NULL handle";
    return kvw_room_poll(h) == KVW_ROOM_FAILED ? h->reason : "";
}

kvw_status_t kvw_room_status(kvw_room_h h)
{
    kvw_room_state_t s = kvw_room_poll(h);
    return s == KVW_ROOM_FAILED ? (h ? h->status : KVW_ERR_INVALID_PARAM)
           : s == KVW_ROOM_SUCCESS ? KVW_OK
                                   : KVW_INPROGRESS;
}

kvw_status_t kvw_room_metrics(kvw_room_h h, kvw_room_metrics_t *m)
{
    kvw_status_t st = kvw__mask_query_check(&kvw__spec_room_metrics, h, m, "kvw_room_metrics");
    if (st != KVW_OK)
        return st;
    kvw_room_metrics_t all = {0};
    if (h->ctx)
        pthread_mutex_lock(&h->ctx->mu);
    all.bytes = h->bytes;
    all.runs = h->runs;
    all.start_ns = h->start_ns;
    all.end_ns = h->end_ns;
    all.path = h->path ? h->path : "none";
    memcpy(all.hop_ns, h->hop_ns, sizeof(all.hop_ns));
    if (h->ctx)
        pthread_mutex_unlock(&h->ctx->mu);
    kvw__mask_copy(&kvw__spec_room_metrics, m->field_mask, &all, m);
    return KVW_OK;
}

kvw_room_state_t kvw_room_wait(kvw_room_h h, uint32_t timeout_ms)
{
    if (h == NULL)
        return KVW_ROOM_FAILED;
    struct kvw_ctx *ctx = h->ctx;
    if (ctx == NULL)
        return h->state;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(timeout_ms / 1000u);
    ts.tv_nsec += (long)(timeout_ms % 1000u) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&ctx->mu);
    h->waiters++;
    if (ctx->busy_poll_ns && timeout_ms && h->state != KVW_ROOM_SUCCESS &&
        h->state != KVW_ROOM_FAILED) {
        uint32_t seen_ = atomic_load_explicit(&ctx->done_gen, memory_order_acquire);
        pthread_mutex_unlock(&ctx->mu);
        kvw__busy_wait(ctx, &ctx->done_gen, seen_);
        pthread_mutex_lock(&ctx->mu);
    }
    while (h->state != KVW_ROOM_SUCCESS && h->state != KVW_ROOM_FAILED &&
           timeout_ms &&
           pthread_cond_timedwait(&ctx->done_cv, &ctx->mu, &ts) != ETIMEDOUT) {
    }
    kvw_room_state_t s = h->state;
    h->waiters--;
    pthread_mutex_unlock(&ctx->mu);
    return s;
}

void kvw_room_abort(kvw_room_h h)
{
    if (h == NULL || h->ctx == NULL)
        return;
    pthread_mutex_lock(&h->ctx->mu);
    kvw__room_fail(h->ctx, h, KVW_ERR_ABORTED, true, "aborted by the %s engine",
                   h->is_sender ? "prefill" : "decode");
    pthread_mutex_unlock(&h->ctx->mu);
}

void kvw_room_destroy(kvw_room_h h)
{
    if (h == NULL)
        return;
    struct kvw_ctx *ctx = h->ctx;
    if (ctx) {
        pthread_mutex_lock(&ctx->mu);
        kvw__room_fail(ctx, h, KVW_ERR_ABORTED, true,
                       "the room was destroyed before it finished");
        while (h->inflight)
            pthread_cond_wait(&ctx->cv, &ctx->mu);
        kvw_room_wait_quiet(ctx, h);
        /* Whatever state the room ended in, its staging spans go with it. */
        if (!h->is_sender && kvw__room_find(ctx, h->id) == h)
            kvw__stage_release_room(ctx, h->id);
        kvw__room_unlink(ctx, h);
        pthread_mutex_unlock(&ctx->mu);
    }
    kvw__room_free(h);
}

