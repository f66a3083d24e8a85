/*
 * Layer marks that wait on CUDA events (kvw_sender_layers_ready_event).
 *
 * A GPU engine records an event on its forward stream after writing a layer group's KV
 * and hands it over without waiting. A thread of the context polls every pending event
 * (cudaEventQuery) and marks the layers ready once it completed, so the transfer of a
 * group starts as soon as the GPU has written it, and neither the engine's stream, the
 * host thread that called, nor kvwire's executor streams ever wait on the engine.
 *
 * Why polling and not cudaStreamWaitEvent on the executor's stream: an event that never
 * completes (an engine stuck, or one that aborted its forward pass) would then block
 * that stream, and every later room of the worker behind it. Polled, it only leaves its
 * room's layers unmarked, and the room fails at its timeout naming the layers and the
 * event (kvw_room_unready). The poll costs one cudaEventQuery per pending event every
 * KVW_EVENT_POLL_NS while any is pending, and nothing otherwise.
 */
#include "cuda/module.h"
#include "proto/proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#define KVW_EVENT_POLL_NS 20000ull

typedef struct kvw_evwatch {
    uint64_t room, serial; /* the room, and its serial (ids may be reused) */
    uint32_t chunk;        /* the streamed chunk the layers belong to */
    uint32_t begin, end;
    void *event;
    int done; /* during a poll: 1 completed, -1 failed */
    char why[200];
} kvw_evwatch_t;

/* Drops entry i (mu held), keeping the others in order. */
static void kvw_evw_drop(struct kvw_ctx *ctx, uint32_t i)
{
    kvw_room_t *r = kvw__room_find(ctx, ctx->evw.tab[i].room);
    if (r && r->serial == ctx->evw.tab[i].serial && r->event_waits)
        r->event_waits--;
    memmove(&ctx->evw.tab[i], &ctx->evw.tab[i + 1], sizeof(*ctx->evw.tab) * (ctx->evw.num - i - 1));
    ctx->evw.num--;
}

static void *kvw_event_main(void *arg)
{
    struct kvw_ctx *ctx = arg;
    kvw__thread_name("kvw-events");
    /* The poll interval is short: without this, the default 50 us timer slack would
     * stretch each nap to about 70 us, and every layer's start with it. */
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    kvw_evwatch_t *snap = NULL;
    uint32_t cap = 0;
    pthread_mutex_lock(&ctx->mu);
    while (!ctx->stopping) {
        if (ctx->evw.num == 0) {
            pthread_cond_wait(&ctx->evw.cv, &ctx->mu);
            continue;
        }
        /* Query outside the lock: a snapshot of the entries. */
        uint32_t n = ctx->evw.num;
        if (n > cap) {
            kvw_evwatch_t *m = realloc(snap, sizeof(*snap) * n);
            if (m == NULL) {
                pthread_mutex_unlock(&ctx->mu);
                nanosleep(&(struct timespec){0, (long)KVW_EVENT_POLL_NS}, NULL);
                pthread_mutex_lock(&ctx->mu);
                continue;
            }
            snap = m;
            cap = n;
        }
        memcpy(snap, ctx->evw.tab, sizeof(*snap) * n);
        pthread_mutex_unlock(&ctx->mu);
        bool any = false;
        for (uint32_t i = 0; i < n; i++) {
            kvw_status_t st = kvw__cuda_event_query(snap[i].event);
            snap[i].done = st == KVW_OK ? 1 : st == KVW_INPROGRESS ? 0 : -1;
            if (snap[i].done < 0)
                snprintf(snap[i].why, sizeof(snap[i].why), "%s", kvw_last_error());
            any |= snap[i].done != 0;
        }
        pthread_mutex_lock(&ctx->mu);
        /* Apply in snapshot order; entries added meanwhile sit after the snapshot's. */
        for (uint32_t i = 0, k = 0; any && i < n; i++) {
            while (k < ctx->evw.num && (ctx->evw.tab[k].room != snap[i].room ||
                                        ctx->evw.tab[k].serial != snap[i].serial ||
                                        ctx->evw.tab[k].event != snap[i].event ||
                                        ctx->evw.tab[k].begin != snap[i].begin))
                k++;
            if (k == ctx->evw.num || snap[i].done == 0)
                continue;
            kvw_room_t *r = kvw__room_find(ctx, snap[i].room);
            bool live = r && r->serial == snap[i].serial && r->state != KVW_ROOM_FAILED &&
                        r->state != KVW_ROOM_SUCCESS && r->have_stream &&
                        r->stream_chunk == snap[i].chunk;
            kvw_evw_drop(ctx, k);
            if (!live)
                continue;
            if (snap[i].done > 0)
                kvw__sender_mark_ready(ctx, r, snap[i].chunk, snap[i].begin, snap[i].end);
            else
                kvw__room_fail(ctx, r, KVW_ERR_INTERNAL, true, "room %llu: the CUDA event "
                               "marking layers [%u, %u) failed: %s",
                               (unsigned long long)r->id, snap[i].begin, snap[i].end,
                               snap[i].why);
        }
        /* Rooms that ended meanwhile drop their entries: their events may be gone. */
        for (uint32_t i = 0; i < ctx->evw.num;) {
            kvw_room_t *r = kvw__room_find(ctx, ctx->evw.tab[i].room);
            if (r == NULL || r->serial != ctx->evw.tab[i].serial || r->state == KVW_ROOM_FAILED ||
                r->state == KVW_ROOM_SUCCESS)
                kvw_evw_drop(ctx, i);
            else
                i++;
        }
        if (ctx->evw.num && !ctx->stopping) {
            pthread_mutex_unlock(&ctx->mu);
            nanosleep(&(struct timespec){0, (long)KVW_EVENT_POLL_NS}, NULL);
            pthread_mutex_lock(&ctx->mu);
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    free(snap);
    return NULL;
}

kvw_status_t kvw__event_watch(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t b, uint32_t e,
                              void *cuda_event)
{
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_status_t st = kvw__cuda_event_query(cuda_event);
    if (st == KVW_OK) {
        /* Already complete: no need for the thread. */
        kvw__sender_mark_ready(ctx, r, r->stream_chunk, b, e);
        return KVW_OK;
    }
    if (st != KVW_INPROGRESS)
        return st;
    if (!ctx->evw.started) {
        pthread_cond_init(&ctx->evw.cv, NULL);
        if (pthread_create(&ctx->evw.thread, NULL, kvw_event_main, ctx) != 0) {
            pthread_cond_destroy(&ctx->evw.cv);
            return kvw__error(KVW_ERR_IO, "cannot start the CUDA event thread");
        }
        ctx->evw.started = true;
    }
    if (ctx->evw.num == ctx->evw.cap) {
        uint32_t cap = ctx->evw.cap ? ctx->evw.cap * 2 : 16;
        kvw_evwatch_t *n = realloc(ctx->evw.tab, sizeof(*n) * cap);
        if (n == NULL)
            return kvw__error(KVW_ERR_NO_MEMORY, "out of memory watching a CUDA event");
        ctx->evw.tab = n;
        ctx->evw.cap = cap;
    }
    ctx->evw.tab[ctx->evw.num++] = (kvw_evwatch_t){.room = r->id, .serial = r->serial,
                                               .chunk = r->stream_chunk, .begin = b, .end = e,
                                               .event = cuda_event};
    r->event_waits++;
    pthread_cond_signal(&ctx->evw.cv);
    return KVW_OK;
}

void kvw__event_stop(struct kvw_ctx *ctx)
{
    if (!ctx->evw.started)
        return;
    pthread_mutex_lock(&ctx->mu);
    pthread_cond_broadcast(&ctx->evw.cv);
    pthread_mutex_unlock(&ctx->mu);
    pthread_join(ctx->evw.thread, NULL);
    pthread_cond_destroy(&ctx->evw.cv);
    ctx->evw.started = false;
    free(ctx->evw.tab);
    ctx->evw.tab = NULL;
    ctx->evw.num = ctx->evw.cap = 0;
}
