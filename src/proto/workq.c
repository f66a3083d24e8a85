/*
 * The prefill workers' room queue (ctx->q): rooms with work, in order, under the queue's
 * own lock and condition variable. This file alone reads and writes ctx->q; it calls no
 * other file of proto.
 */
#include "proto/proto.h"

/*
 * The workers' room queue has its own mutex and condition variable (ctx->q.mu, q.cv):
 * a hand-off wakes the workers only, not every waiter on ctx->cv. Lock order: ctx->mu,
 * then q.mu; nothing else is taken under q.mu. A room's queued and qnext are q.mu's.
 */
void kvw__queue_init(struct kvw_ctx *ctx)
{
    pthread_mutex_init(&ctx->q.mu, NULL);
    pthread_cond_init(&ctx->q.cv, NULL);
}

void kvw__queue_fini(struct kvw_ctx *ctx)
{
    pthread_mutex_destroy(&ctx->q.mu);
    pthread_cond_destroy(&ctx->q.cv);
}

/* The context whose control thread runs on this thread (NULL on every other thread). */
static _Thread_local const struct kvw_ctx *kvw_ctrl_self;

void kvw__queue_ctrl_thread(struct kvw_ctx *ctx)
{
    kvw_ctrl_self = ctx;
}

bool kvw__queue_on_ctrl(const struct kvw_ctx *ctx)
{
    return kvw_ctrl_self == ctx;
}

void kvw__queue_room(struct kvw_ctx *ctx, kvw_room_t *room)
{
    KVW_ASSERT_HELD(&ctx->mu);
    pthread_mutex_lock(&ctx->q.mu);
    if (!room->queued) {
        room->queued = true;
        room->qnext = NULL;
        if (ctx->q.tail)
            ctx->q.tail->qnext = room;
        else
            ctx->q.head = room;
        ctx->q.tail = room;
        atomic_fetch_add_explicit(&ctx->q.gen, 1, memory_order_release);
        /* The control thread wakes the workers once it lets go of mu: a room it serves
         * itself meanwhile costs no worker a wake-up (and no fight for mu). */
        if (kvw_ctrl_self == ctx)
            ctx->q.wake_due = true;
        else
            pthread_cond_broadcast(&ctx->q.cv);
    }
    pthread_mutex_unlock(&ctx->q.mu);
}

void kvw__queue_kick(struct kvw_ctx *ctx)
{
    pthread_mutex_lock(&ctx->q.mu);
    if (ctx->q.wake_due && ctx->q.head)
        pthread_cond_broadcast(&ctx->q.cv);
    ctx->q.wake_due = false;
    pthread_mutex_unlock(&ctx->q.mu);
}

kvw_room_t *kvw__queue_head(struct kvw_ctx *ctx)
{
    KVW_ASSERT_HELD(&ctx->mu);
    pthread_mutex_lock(&ctx->q.mu);
    kvw_room_t *r = ctx->q.head;
    pthread_mutex_unlock(&ctx->q.mu);
    return r;
}

void kvw__unqueue_room(struct kvw_ctx *ctx, kvw_room_t *room)
{
    KVW_ASSERT_HELD(&ctx->mu);
    pthread_mutex_lock(&ctx->q.mu);
    for (kvw_room_t **pp = &ctx->q.head; *pp; pp = &(*pp)->qnext)
        if (*pp == room) {
            *pp = room->qnext;
            break;
        }
    ctx->q.tail = NULL;
    for (kvw_room_t *q = ctx->q.head; q; q = q->qnext)
        ctx->q.tail = q;
    room->queued = false;
    pthread_mutex_unlock(&ctx->q.mu);
}

kvw_room_t *kvw__dequeue_room(struct kvw_ctx *ctx)
{
    KVW_ASSERT_HELD(&ctx->mu);
    pthread_mutex_lock(&ctx->q.mu);
    kvw_room_t *r = ctx->q.head;
    if (r) {
        ctx->q.head = r->qnext;
        if (ctx->q.head == NULL)
            ctx->q.tail = NULL;
        r->queued = false;
    }
    pthread_mutex_unlock(&ctx->q.mu);
    return r;
}

bool kvw__queue_empty(struct kvw_ctx *ctx)
{
    pthread_mutex_lock(&ctx->q.mu);
    bool empty = ctx->q.head == NULL;
    pthread_mutex_unlock(&ctx->q.mu);
    return empty;
}

void kvw__queue_wait(struct kvw_ctx *ctx)
{
    KVW_ASSERT_HELD(&ctx->mu);
    /* q.mu is taken before mu is dropped: a room queued in between is seen. */
    pthread_mutex_lock(&ctx->q.mu);
    pthread_mutex_unlock(&ctx->mu);
    while (ctx->q.head == NULL && !ctx->q.stop)
        pthread_cond_wait(&ctx->q.cv, &ctx->q.mu);
    pthread_mutex_unlock(&ctx->q.mu);
    pthread_mutex_lock(&ctx->mu);
}

void kvw__queue_stop(struct kvw_ctx *ctx, bool stop)
{
    pthread_mutex_lock(&ctx->q.mu);
    ctx->q.stop = stop;
    pthread_cond_broadcast(&ctx->q.cv);
    pthread_mutex_unlock(&ctx->q.mu);
}

uint32_t kvw__queue_gen(struct kvw_ctx *ctx)
{
    return atomic_load_explicit(&ctx->q.gen, memory_order_acquire);
}

void kvw__queue_spin(struct kvw_ctx *ctx, uint32_t seen)
{
    kvw__busy_wait(ctx, &ctx->q.gen, seen);
}
