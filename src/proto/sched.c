/* Prefill rooms between the engine and the workers: the requests (REQ) that name a
 * room's decode ranks, when those are all known, which decode rank has work next, the
 * room's progress to Success, and layers of streamed chunks marked ready. */
#include "proto/proto.h"

#include <stdio.h>
#include <string.h>

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
    for (uint32_t i = 0; i < kvw__peer_count(ctx) && !group; i++) {
        kvw_peer_t *p = kvw__peer_at(ctx, i);
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
    for (uint32_t i = 0; i < kvw__peer_count(ctx); i++) {
        kvw_peer_t *p = kvw__peer_at(ctx, i);
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
int kvw__room_next_dst(const struct kvw_ctx *ctx, const kvw_room_t *r)
{
    if (r->state == KVW_ROOM_FAILED)
        return -1;
    for (uint32_t i = 0; i < r->num_dsts; i++)
        if (!r->dsts[i].busy && kvw_dst_has_work(ctx, r, &r->dsts[i]))
            return (int)i;
    return -1;
}

void kvw__sender_update(struct kvw_ctx *ctx, kvw_room_t *r)
{
    KVW_ASSERT_HELD(&ctx->mu);
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
    if (kvw__room_next_dst(ctx, r) >= 0)
        kvw__queue_room(ctx, r);
}

/* The first REQ for a room makes its instance and group the owner (an ABORT before
 * any REQ claims it too, and fails it: dispatch.c). mu held. */
static void kvw_claim(kvw_room_t *r, const kvw_peer_t *peer, uint32_t dp)
{
    r->dst_dp = (int32_t)dp;
    r->dst_instance = peer->instance;
}

/* With a secret, a room belongs to the decode instance (and DP group) whose REQ came
 * first: a REQ from another one, which holds the secret too, is refused alone (FAILED
 * to it) and the owner's room carries on. Without a secret instance ids are only claims,
 * and a second claimant fails the room for everyone (the owner learns of it). Returns
 * whether the claim was refused here. mu held. */
static bool kvw_refuse_claim(struct kvw_ctx *ctx, kvw_room_t *r, kvw_peer_t *peer, uint32_t dp)
{
    if (!ctx->secret[0] || !peer->authed)
        return false;
    char why[320];
    snprintf(why, sizeof(why), "room %llu belongs to decode instance %llu group %d: a request "
             "from %.120s (instance %llu group %u) is refused", (unsigned long long)r->id,
             (unsigned long long)r->dst_instance, r->dst_dp, peer->desc,
             (unsigned long long)peer->instance, dp);
    kvw__send_room_msg(ctx, peer, KVW_MSG_FAILED, r->id, KVW_ERR_REJECTED, why);
    kvw__send_room_msg(ctx, peer, KVW_MSG_ABORT_ACK, r->id, KVW_ERR_ABORTED, "refused");
    return true;
}

void kvw__handle_req(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb)
{
    KVW_ASSERT_HELD(&ctx->mu);
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
        kvw__send_room_msg(ctx, peer, KVW_MSG_FAILED, id, st, kvw_last_error());
        return;
    }
    if (st != KVW_OK) {
        free(s1);
        kvw__peer_dead(ctx, peer, KVW_ERR_MALFORMED, "malformed request frame");
        return;
    }
    d.pages.state_slot = (int64_t)kvw__rb_u64(rb);
    /* Flags (optional, one byte): bit 0 asks for the room's KV digest. */
    uint8_t flags = rb->pos < rb->len ? kvw__rb_u8(rb) : 0;
    d.verify = flags & 1;
    if (kvw__rb_done(rb, "request") != KVW_OK || (flags & ~1u)) {
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
    kvw_status_t why = KVW_OK;
    if (r == NULL && d.store != NULL && (why = kvw__room_new_by_peer(ctx, id, peer, &r))) {
        /* Past the peer's bound (or out of memory): only this request is refused. */
        char reason[320];
        snprintf(reason, sizeof(reason), "%s", kvw_last_error());
        free(d.store);
        kvw__send_room_msg(ctx, peer, KVW_MSG_FAILED, id, why, reason);
        return;
    }
    if (r)
        kvw__room_hop(r, KVW_HOP_REQ_RX, false);
    if (r == NULL || d.store == NULL) {
        free(d.store);
        kvw__send_room_msg(ctx, peer, KVW_MSG_FAILED, id, KVW_ERR_NO_MEMORY,
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
        if (r->dst_dp < 0)
            kvw_claim(r, peer, dp);
        if ((uint32_t)r->dst_dp != dp || r->dst_instance != peer->instance) {
            /* A second claimant fails the room for everyone, itself included; with a
             * secret it is refused alone (kvw_refuse_claim). */
            if (kvw_refuse_claim(ctx, r, peer, dp))
                return;
            char why[320];
            snprintf(why, sizeof(why), "room %llu: %.160s (decode instance %llu) posted for DP "
                     "group %u, but the room belongs to instance %llu group %d",
                     (unsigned long long)id, peer->desc, (unsigned long long)peer->instance,
                     dp, (unsigned long long)r->dst_instance, r->dst_dp);
            kvw__room_fail(ctx, r, KVW_ERR_INVALID_PARAM, true, "%s", why);
            kvw__send_room_msg(ctx, peer, KVW_MSG_FAILED, id, KVW_ERR_INVALID_PARAM, r->reason);
            return;
        }
        kvw__sender_update(ctx, r);
        return;
    }
    r->dsts[r->num_dsts++] = d;
    if (r->state == KVW_ROOM_FAILED) {
        /* Nothing will be written for a room that already failed. */
        kvw__send_room_msg(ctx, peer, KVW_MSG_FAILED, id, r->status, r->reason);
        kvw__send_room_msg(ctx, peer, KVW_MSG_ABORT_ACK, id, KVW_ERR_ABORTED, "stopped");
        return;
    }
    for (uint32_t i = 0; i + 1 < r->num_dsts; i++)
        if (r->dsts[i].peer == peer->id) {
            kvw__room_fail(ctx, r, KVW_ERR_INVALID_PARAM, true,
                           "%s posted room %llu twice", peer->desc, (unsigned long long)id);
            return;
        }
    if (r->dst_dp < 0)
        kvw_claim(r, peer, dp);
    if ((uint32_t)r->dst_dp != dp || r->dst_instance != peer->instance) {
        if (kvw_refuse_claim(ctx, r, peer, dp)) {
            free(r->dsts[--r->num_dsts].store);
            return;
        }
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
    kvw__sender_update(ctx, r);
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
        kvw__sender_update(ctx, r);
    }
}
