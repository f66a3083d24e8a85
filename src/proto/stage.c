/*
 * Decode: the staging area and its credits. The area is one registered host buffer
 * (shared memory when it can be: kvw_mem_alloc_shared); prefill ranks ask for a
 * window of it per staged step (STAGE_ASK) and are granted a span (STAGE_GRANT), first
 * fit between the spans already granted; a request that does not fit waits, in FIFO
 * order, until spans are given back. This file alone reads and writes ctx->stage.
 */
#include "proto/proto.h"

#include <kvwire/mem.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kvw_status_t kvw__stage_init(struct kvw_ctx *ctx)
{
    ctx->stage.len = ctx->cfg.staging_mb << 20;
    if (ctx->staged_dev && ctx->stage.len == 0)
        return kvw__error(KVW_ERR_INVALID_PARAM, "this rank's buffers are %s memory, which "
                          "'%s' writes through the staging area, but KVW_STAGING_MB=0 "
                          "leaves none", ctx->mem->name, ctx->tl_ops->name);
    if (ctx->stage.len == 0)
        return KVW_OK;
    void *sa = NULL;
    if (kvw_mem_alloc_shared(ctx->stage.len, &sa) == KVW_OK) {
        ctx->stage.shared = true;
    } else if (posix_memalign(&sa, 4096, ctx->stage.len) != 0) {
        return kvw__error(KVW_ERR_NO_MEMORY, "cannot allocate %llu bytes of staging",
                          (unsigned long long)ctx->stage.len);
    }
    ctx->stage.buf = sa;
    /* Page-locked for the copies of staged windows to the device; without it they
     * still work, through the driver's own bounce buffers. */
    if (ctx->staged_dev)
        ctx->stage.pinned = ctx->mem->pin(ctx->stage.buf, ctx->stage.len) == KVW_OK;
    return KVW_OK;
}

void kvw__stage_fini(struct kvw_ctx *ctx)
{
    if (ctx->stage.buf) {
        if (ctx->stage.pinned)
            ctx->mem->unpin(ctx->stage.buf);
        if (ctx->stage.shared)
            kvw_mem_free_shared(ctx->stage.buf);
        else
            free(ctx->stage.buf);
    }
    free(ctx->stage.spans);
    free(ctx->stage.waits);
    memset(&ctx->stage, 0, sizeof(ctx->stage));
}

bool kvw__stage_present(const struct kvw_ctx *ctx)
{
    return ctx->stage.buf != NULL;
}

uint64_t kvw__stage_len(const struct kvw_ctx *ctx)
{
    return ctx->stage.len;
}

bool kvw__stage_window(const struct kvw_ctx *ctx, uint64_t off, uint64_t len, uint8_t **p)
{
    if (off > ctx->stage.len || len > ctx->stage.len - off)
        return false;
    *p = ctx->stage.buf + off;
    return true;
}

bool kvw__stage_is_span(const struct kvw_ctx *ctx, uint64_t room, uint64_t off, uint64_t len)
{
    bool ok = false;
    for (uint32_t i = 0; i < ctx->stage.num_spans; i++)
        ok |= ctx->stage.spans[i].off == off && ctx->stage.spans[i].len == len &&
              ctx->stage.spans[i].room == room;
    return ok;
}

int64_t kvw__stage_span_of(const struct kvw_ctx *ctx, uint64_t room, uint64_t off, uint64_t len)
{
    for (uint32_t i = 0; i < ctx->stage.num_spans; i++) {
        const kvw_stage_span_t *s = &ctx->stage.spans[i];
        if (s->room == room && off >= s->off && off - s->off <= s->len &&
            len <= s->len - (off - s->off))
            return (int64_t)s->off;
    }
    return -1;
}

bool kvw__stage_peer_waits(const struct kvw_ctx *ctx, uint32_t peer)
{
    for (uint32_t i = 0; i < ctx->stage.num_waits; i++)
        if (ctx->stage.waits[i].peer == peer)
            return true;
    return false;
}

static bool kvw_stage_try(struct kvw_ctx *ctx, kvw_peer_t *peer, uint64_t room, uint64_t len)
{
    KVW_ASSERT_HELD(&ctx->mu);
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
    kvw__metrics_staging(ctx, (int64_t)len);
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
    KVW_ASSERT_HELD(&ctx->mu);
    kvw_room_t *r = kvw__room_find(ctx, room);
    if (r == NULL || r->is_sender)
        return; /* a room that ended or was destroyed here meanwhile */
    /* Only a prefill rank that writes this room may ask for space for it (anyone else is
     * not speaking the protocol: its connection goes, and the room carries on), and it
     * asks for one window at a time: a second request before the first was granted
     * fails the room. This bounds the waiting list by the rooms' sources. */
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
    /* Space only for a room that still takes bytes: a room at Success (or failed) has
     * nothing left to stage, and a span granted to it would never be given back. */
    if (r->state != KVW_ROOM_WAITING_FOR_INPUT && r->state != KVW_ROOM_TRANSFERRING)
        return;
    if (len == 0 || len > ctx->stage.len) {
        kvw__room_fail(ctx, r, KVW_ERR_OUT_OF_RANGE, true,
                       "%s asked for %llu bytes of staging (the area has %llu)", peer->desc,
                       (unsigned long long)len, (unsigned long long)ctx->stage.len);
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
    KVW_ASSERT_HELD(&ctx->mu);
    for (uint32_t i = 0; i < ctx->stage.num_spans; i++)
        if (ctx->stage.spans[i].off == off) {
            kvw__metrics_staging(ctx, -(int64_t)ctx->stage.spans[i].len);
            memmove(&ctx->stage.spans[i], &ctx->stage.spans[i + 1],
                    sizeof(*ctx->stage.spans) * (ctx->stage.num_spans - i - 1));
            ctx->stage.num_spans--;
            break;
        }
    while (ctx->stage.num_waits) {
        kvw_stage_wait_t w = ctx->stage.waits[0];
        kvw_room_t *r = kvw__room_find(ctx, w.room);
        bool live = r && !r->is_sender &&
                    (r->state == KVW_ROOM_WAITING_FOR_INPUT ||
                     r->state == KVW_ROOM_TRANSFERRING) &&
                    !kvw__peer_at(ctx, w.peer)->dead;
        if (live && !kvw_stage_try(ctx, kvw__peer_at(ctx, w.peer), w.room, w.len))
            break;
        memmove(&ctx->stage.waits[0], &ctx->stage.waits[1], sizeof(*ctx->stage.waits) * (ctx->stage.num_waits - 1));
        ctx->stage.num_waits--;
    }
}

/* Frees every span a room holds (when it ends). */
void kvw__stage_release_room(struct kvw_ctx *ctx, uint64_t room)
{
    KVW_ASSERT_HELD(&ctx->mu);
    for (uint32_t i = 0; i < ctx->stage.num_spans;) {
        if (ctx->stage.spans[i].room == room) {
            kvw__stage_free(ctx, ctx->stage.spans[i].off);
            i = 0;
        } else {
            i++;
        }
    }
}

