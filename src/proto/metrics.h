/*
 * A context's metrics (ctx->metrics; metrics.c's): counters and gauges kept with atomic
 * operations, bumped where the events happen (one call each, most with ctx->mu held but
 * none needing it) and read by kvw_ctx_metrics without any lock.
 */
#ifndef KVW_PROTO_METRICS_H
#define KVW_PROTO_METRICS_H

#include <kvwire/xfer.h>

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct kvw_ctx;
struct kvw_room;

typedef struct kvw_metrics {
    _Atomic uint64_t in_state[KVW_CTX_METRICS_ACTIVE_STATES];
    _Atomic uint64_t succeeded, failed;
    _Atomic uint64_t failed_by[KVW_CTX_METRICS_STATUS_SLOTS];
    _Atomic uint64_t bytes_direct, bytes_staged;
    _Atomic uint64_t lat_us[KVW_CTX_METRICS_LATENCY_BUCKETS];
    _Atomic uint64_t lat_us_sum;
    _Atomic uint64_t stage_in_use, stage_high;
    _Atomic uint64_t peers_up, peers_died;
    _Atomic uint64_t verified, verify_skipped, verify_failed;
} kvw_metrics_t;

/* A room was created (it starts Bootstrapping). */
void kvw__metrics_room_new(struct kvw_ctx *ctx);
/* Room r leaves its state (r->state, not terminal) for `to`, before r->state changes;
 * `status` is the failure's (to == KVW_ROOM_FAILED). Success adds its latency, up to
 * r->end_ns (the caller stamps it first). Rooms detached from their context (r->ctx
 * NULL) are not counted. */
void kvw__metrics_room_moves(struct kvw_room *r, kvw_room_state_t to, kvw_status_t status);
/* `n` payload bytes moved on the staged or the direct path. */
void kvw__metrics_bytes(struct kvw_ctx *ctx, bool staged, uint64_t n);
/* Staging granted (delta > 0) or given back (delta < 0). */
void kvw__metrics_staging(struct kvw_ctx *ctx, int64_t delta);
/* Decode: a verified room's digests matched (ok) or not; a room sampling left out. */
void kvw__metrics_verify(struct kvw_ctx *ctx, bool ok);
void kvw__metrics_verify_skipped(struct kvw_ctx *ctx);
/* A peer finished its registration; a registered peer was declared dead. */
void kvw__metrics_peer_up(struct kvw_ctx *ctx);
void kvw__metrics_peer_died(struct kvw_ctx *ctx);

#endif
