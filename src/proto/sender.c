/* The prefill engine's calls on a room (kvw_sender_*): create, attach metadata, queue
 * chunks (whole or streamed) and mark layers of a streamed chunk ready (at once or once
 * a CUDA event completed). */
#include "proto/proto.h"

#include <stdio.h>
#include <string.h>

kvw_status_t kvw_sender_create(kvw_ctx_h ctx, uint64_t room, kvw_sender_h *sender_p)
{
    if (ctx == NULL || sender_p == NULL || ctx->side != KVW_SIDE_PREFILL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "senders exist on prefill contexts only");
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = kvw__room_find(ctx, room);
    if (r && r->engine_owned) {
        pthread_mutex_unlock(&ctx->mu);
        return kvw__error(KVW_ERR_BUSY, "room %llu already has a sender on this rank",
                          (unsigned long long)room);
    }
    if (r == NULL)
        r = kvw__room_new(ctx, room, true);
    if (r == NULL) {
        pthread_mutex_unlock(&ctx->mu);
        return kvw__error(KVW_ERR_NO_MEMORY, "out of memory creating a sender");
    }
    kvw__room_adopt(ctx, r);
    /* The wait timeout counts from the engine's side of the room. */
    r->deadline_ns = kvw__now_ns() + (uint64_t)ctx->wait_timeout_ms * 1000000ull;
    kvw__sender_update(ctx, r);
    pthread_mutex_unlock(&ctx->mu);
    *sender_p = (kvw_sender_h)(void *)r;
    return KVW_OK;
}

kvw_status_t kvw_sender_set_metadata(kvw_sender_h s, const void *data, size_t len)
{
    if (s == NULL || kvw__sender_room(s)->ctx == NULL || (data == NULL && len))
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
    struct kvw_ctx *ctx = kvw__sender_room(s)->ctx;
    kvw_room_t *r = kvw__sender_room(s);
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

/* Queues a chunk; `streamed`: none of its layers is ready yet (kvw_sender_layers_ready
 * marks them). */
static kvw_status_t kvw_sender_queue(kvw_sender_h s, const kvw_send_chunk_t *chunk,
                                     bool streamed, const char *fn)
{
    if (s == NULL || chunk == NULL || kvw__sender_room(s)->ctx == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s: NULL argument or no context", fn);
    char where[64];
    kvw_send_chunk_t norm;
    snprintf(where, sizeof(where), "%s: chunk", fn);
    kvw_status_t nst = kvw__send_chunk_norm(chunk, where, &norm);
    if (nst != KVW_OK)
        return nst;
    chunk = &norm;
    if (chunk->chunk_begin > chunk->chunk_end || chunk->chunk_end > chunk->num_tokens ||
        (chunk->last_chunk && chunk->chunk_end != chunk->num_tokens))
        return kvw__error(KVW_ERR_INVALID_PARAM, "chunk [%llu, %llu) of a %llu-token request%s",
                          (unsigned long long)chunk->chunk_begin,
                          (unsigned long long)chunk->chunk_end,
                          (unsigned long long)chunk->num_tokens,
                          chunk->last_chunk ? " cannot be the last one" : " is out of range");
    struct kvw_ctx *ctx = kvw__sender_room(s)->ctx;
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
    kvw_room_t *r = kvw__sender_room(s);
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
    kvw__sender_update(ctx, r);
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

/* Marks layers now (event NULL) or once the CUDA event completes. */
static kvw_status_t kvw_layers_ready(kvw_sender_h s, uint32_t layer_begin, uint32_t layer_end,
                                     void *cuda_event, const char *fn)
{
    if (s == NULL || kvw__sender_room(s)->ctx == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "%s: NULL argument or no context", fn);
    struct kvw_ctx *ctx = kvw__sender_room(s)->ctx;
    pthread_mutex_lock(&ctx->mu);
    kvw_room_t *r = kvw__sender_room(s);
    kvw_status_t st = kvw_stream_check(ctx, r, layer_begin, layer_end);
    if (st == KVW_OK && cuda_event == NULL)
        kvw__sender_mark_ready(ctx, r, r->stream_chunk, layer_begin, layer_end);
    else if (st == KVW_OK)
        st = kvw__event_watch(ctx, r, layer_begin, layer_end, cuda_event);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

kvw_status_t kvw_sender_layers_ready(kvw_sender_h s, uint32_t layer_begin, uint32_t layer_end)
{
    return kvw_layers_ready(s, layer_begin, layer_end, NULL, "kvw_sender_layers_ready");
}

kvw_status_t kvw_sender_layers_ready_event(kvw_sender_h s, uint32_t layer_begin,
                                           uint32_t layer_end, void *cuda_event)
{
    if (cuda_event == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "kvw_sender_layers_ready_event: NULL event");
    return kvw_layers_ready(s, layer_begin, layer_end, cuda_event,
                            "kvw_sender_layers_ready_event");
}
