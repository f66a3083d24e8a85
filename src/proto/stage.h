/*
 * Decode: the staging area, a registered host buffer that prefill ranks write staged
 * windows into, and its credits: spans granted to rooms, kept sorted by offset (first
 * fit), and requests that did not fit, waiting in FIFO order. Owned by stage.c.
 */
#ifndef KVW_PROTO_STAGE_H
#define KVW_PROTO_STAGE_H

#include "core/core.h"

#include <stdbool.h>
#include <stdint.h>

struct kvw_ctx;
struct kvw_peer;

/* The sizes a staging area may have (KVW_STAGING_MB's range, 1 MiB to 1 TiB): a
 * prefill rank refuses a registration that declares another (nonzero) one. */
#define KVW_STAGING_MIN (1ull << 20)
#define KVW_STAGING_MAX (1ull << 40)

/* A span of a decode rank's staging area granted to one room. */
typedef struct kvw_stage_span {
    uint64_t off, len;
    uint64_t room;
} kvw_stage_span_t;

/* A prefill rank waiting for staging space (decode side). */
typedef struct kvw_stage_wait {
    uint32_t peer;
    uint64_t room, len;
} kvw_stage_wait_t;

/* The context's staging area (ctx->stage; ctx->mu guards the spans and waiters). */
typedef struct kvw_stage {
    uint8_t *buf; /* NULL: no staging area */
    uint64_t len;
    bool shared;
    bool pinned; /* page-locked by ctx->mem for fast copies to the device */
    kvw_stage_span_t *spans;
    uint32_t num_spans, cap_spans;
    kvw_stage_wait_t *waits;
    uint32_t num_waits, cap_waits;
} kvw_stage_t;

/* Context create: allocates the area (KVW_STAGING_MB, 0: none; page-locked for device
 * buffers); the context registers it with the transport. Destroy: frees it all. */
kvw_status_t kvw__stage_init(struct kvw_ctx *ctx);
void kvw__stage_fini(struct kvw_ctx *ctx);

/* Readers (mu held for the spans): whether there is an area, its size, the window
 * [off, off + len) of it (false when outside), whether [off, off + len) is exactly a span
 * granted to `room`, the offset of the span of `room` that holds it (-1: none), and
 * whether prefill peer `peer` waits for space. */
bool kvw__stage_present(const struct kvw_ctx *ctx);
uint64_t kvw__stage_len(const struct kvw_ctx *ctx);
bool kvw__stage_window(const struct kvw_ctx *ctx, uint64_t off, uint64_t len, uint8_t **p);
bool kvw__stage_is_span(const struct kvw_ctx *ctx, uint64_t room, uint64_t off, uint64_t len);
int64_t kvw__stage_span_of(const struct kvw_ctx *ctx, uint64_t room, uint64_t off, uint64_t len);
bool kvw__stage_peer_waits(const struct kvw_ctx *ctx, uint32_t peer);

/* Decode: grant or queue staging space (mu held); frees a span and serves waiters. */
void kvw__stage_ask(struct kvw_ctx *ctx, struct kvw_peer *peer, uint64_t room, uint64_t len);
void kvw__stage_free(struct kvw_ctx *ctx, uint64_t off);
/* Frees every span a room holds (when it ends) and serves waiters. mu held. */
void kvw__stage_release_room(struct kvw_ctx *ctx, uint64_t room);

#endif
