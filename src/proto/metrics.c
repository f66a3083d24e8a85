/* A context's metrics: the counters' bumps, called where the events happen, and
 * kvw_ctx_metrics, which reads them without a lock. Relaxed atomics: each counter is
 * exact on its own, and no reader orders one against another. */
#include "proto/proto.h"

#include <stddef.h>

#define KVW_M_ADD(field, n) atomic_fetch_add_explicit(&(field), (n), memory_order_relaxed)
#define KVW_M_SUB(field, n) atomic_fetch_sub_explicit(&(field), (n), memory_order_relaxed)
#define KVW_M_GET(field) atomic_load_explicit(&(field), memory_order_relaxed)

void kvw__metrics_room_new(struct kvw_ctx *ctx)
{
    KVW_M_ADD(ctx->metrics.in_state[KVW_ROOM_BOOTSTRAPPING], 1);
}

/* The bucket of a latency: the number of bits of `us` (below 2^i, at least 2^(i-1)). */
static unsigned kvw_latency_bucket(uint64_t us)
{
    unsigned i = us ? 64u - (unsigned)__builtin_clzll(us) : 0u;
    return i < KVW_CTX_METRICS_LATENCY_BUCKETS ? i : KVW_CTX_METRICS_LATENCY_BUCKETS - 1;
}

void kvw__metrics_room_moves(kvw_room_t *r, kvw_room_state_t to, kvw_status_t status)
{
    struct kvw_ctx *ctx = r->ctx;
    if (ctx == NULL || r->state == KVW_ROOM_SUCCESS || r->state == KVW_ROOM_FAILED ||
        to == r->state)
        return;
    kvw_metrics_t *m = &ctx->metrics;
    KVW_M_SUB(m->in_state[r->state], 1);
    if (to == KVW_ROOM_FAILED) {
        KVW_M_ADD(m->failed, 1);
        int64_t slot = -(int64_t)status;
        KVW_M_ADD(m->failed_by[slot > 0 && slot < KVW_CTX_METRICS_STATUS_SLOTS ? slot : 0], 1);
    } else if (to == KVW_ROOM_SUCCESS) {
        /* From the post (the decode's own, or its pages arriving at a prefill rank) to
         * the room's Success stamp, which kvw__room_advance takes just before. */
        uint64_t from = r->hop_ns[r->is_sender ? KVW_HOP_REQ_RX : KVW_HOP_POST];
        uint64_t now = r->end_ns;
        from = from ? from : r->created_ns;
        uint64_t us = now > from ? (now - from) / 1000u : 0;
        KVW_M_ADD(m->lat_us[kvw_latency_bucket(us)], 1);
        KVW_M_ADD(m->lat_us_sum, us);
        KVW_M_ADD(m->succeeded, 1);
    } else {
        KVW_M_ADD(m->in_state[to], 1);
    }
}

void kvw__metrics_bytes(struct kvw_ctx *ctx, bool staged, uint64_t n)
{
    KVW_M_ADD(*(staged ? &ctx->metrics.bytes_staged : &ctx->metrics.bytes_direct), n);
}

void kvw__metrics_staging(struct kvw_ctx *ctx, int64_t delta)
{
    kvw_metrics_t *m = &ctx->metrics;
    if (delta < 0) {
        KVW_M_SUB(m->stage_in_use, (uint64_t)-delta);
        return;
    }
    uint64_t now = KVW_M_ADD(m->stage_in_use, (uint64_t)delta) + (uint64_t)delta;
    uint64_t high = KVW_M_GET(m->stage_high);
    while (now > high && !atomic_compare_exchange_weak_explicit(
                             &m->stage_high, &high, now, memory_order_relaxed,
                             memory_order_relaxed)) {
    }
}

void kvw__metrics_verify(struct kvw_ctx *ctx, bool ok)
{
    if (ok)
        KVW_M_ADD(ctx->metrics.verified, 1);
    else
        KVW_M_ADD(ctx->metrics.verify_failed, 1);
}

void kvw__metrics_verify_skipped(struct kvw_ctx *ctx)
{
    KVW_M_ADD(ctx->metrics.verify_skipped, 1);
}

void kvw__metrics_peer_up(struct kvw_ctx *ctx)
{
    KVW_M_ADD(ctx->metrics.peers_up, 1);
}

void kvw__metrics_peer_died(struct kvw_ctx *ctx)
{
    KVW_M_SUB(ctx->metrics.peers_up, 1);
    KVW_M_ADD(ctx->metrics.peers_died, 1);
}

/* ---------------------------------------------------------------- the public call */

#define KVW_CTX_METRICS_LIST(X, T)                                                       \
    X(T, side) X(T, transport) X(T, rooms_in_state) X(T, rooms_succeeded)                 \
    X(T, rooms_failed) X(T, rooms_failed_by_status) X(T, bytes_direct) X(T, bytes_staged) \
    X(T, latency_us_buckets) X(T, latency_us_sum) X(T, staging_capacity)                  \
    X(T, staging_in_use) X(T, staging_high_water) X(T, peers_connected) X(T, peers_died)  \
    X(T, rooms_verified) X(T, rooms_verify_skipped) X(T, rooms_verify_failed)
#define KVW_M_NAME(T, f) #f,
#define KVW_M_PLACE(T, f) {offsetof(T, f), sizeof(((T *)0)->f)},

static const char *const kvw_ctx_metrics_fields[] = {
    KVW_CTX_METRICS_LIST(KVW_M_NAME, kvw_ctx_metrics_t) NULL};
static const kvw_mask_field_t kvw_ctx_metrics_layout[] = {
    KVW_CTX_METRICS_LIST(KVW_M_PLACE, kvw_ctx_metrics_t)};
static const kvw_mask_spec_t kvw_spec_ctx_metrics = {"kvw_ctx_metrics_t", kvw_ctx_metrics_fields,
                                                     0, kvw_ctx_metrics_layout};

kvw_status_t kvw_ctx_metrics(kvw_ctx_h ctx, kvw_ctx_metrics_t *out)
{
    kvw_status_t st = kvw__mask_query_check(&kvw_spec_ctx_metrics, ctx, out, "kvw_ctx_metrics");
    if (st != KVW_OK)
        return st;
    uint64_t want = out->field_mask;
    kvw_metrics_t *m = &ctx->metrics;
    kvw_ctx_metrics_t all = {.side = ctx->side, .transport = ctx->tl_ops->name};
    for (unsigned i = 0; i < KVW_CTX_METRICS_ACTIVE_STATES; i++)
        all.rooms_in_state[i] = KVW_M_GET(m->in_state[i]);
    all.rooms_succeeded = KVW_M_GET(m->succeeded);
    all.rooms_failed = KVW_M_GET(m->failed);
    if (want & KVW_CTX_METRICS_FIELD_ROOMS_FAILED_BY_STATUS)
        for (unsigned i = 0; i < KVW_CTX_METRICS_STATUS_SLOTS; i++)
            all.rooms_failed_by_status[i] = KVW_M_GET(m->failed_by[i]);
    all.bytes_direct = KVW_M_GET(m->bytes_direct);
    all.bytes_staged = KVW_M_GET(m->bytes_staged);
    if (want & KVW_CTX_METRICS_FIELD_LATENCY_US_BUCKETS)
        for (unsigned i = 0; i < KVW_CTX_METRICS_LATENCY_BUCKETS; i++)
            all.latency_us_buckets[i] = KVW_M_GET(m->lat_us[i]);
    all.latency_us_sum = KVW_M_GET(m->lat_us_sum);
    all.staging_capacity = ctx->hello_staging_len;
    all.staging_in_use = KVW_M_GET(m->stage_in_use);
    all.staging_high_water = KVW_M_GET(m->stage_high);
    all.peers_connected = KVW_M_GET(m->peers_up);
    all.peers_died = KVW_M_GET(m->peers_died);
    all.rooms_verified = KVW_M_GET(m->verified);
    all.rooms_verify_skipped = KVW_M_GET(m->verify_skipped);
    all.rooms_verify_failed = KVW_M_GET(m->verify_failed);
    kvw__mask_copy(&kvw_spec_ctx_metrics, want, &all, out);
    return KVW_OK;
}
