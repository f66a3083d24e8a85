/* Control frames: each frame a peer sent, dispatched by type to its handler (mu held). */
#include "proto/proto.h"

#include <stdio.h>

/* Decode: whether `peer` is one of the prefill ranks room `r` reads from: a rank it
 * expects bytes from, or another rank of the instance and DP group its request went to
 * (one that sends this rank nothing still fails the room when its own side fails). */
static bool kvw_is_source(const kvw_room_t *r, const kvw_peer_t *peer)
{
    if (r->is_sender)
        return false; /* a receiver names its instance and DP group from its creation on */
    for (uint32_t i = 0; i < r->num_srcs; i++)
        if (r->srcs[i].peer == peer->id)
            return true;
    return peer->inst == r->inst && peer->inst_gen == r->inst_gen && peer->dp == r->src_dp;
}

void kvw__handle_frame(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, const uint8_t *p,
                       uint32_t len)
{
    KVW_ASSERT_HELD(&ctx->mu);
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
        kvw__handle_req(ctx, peer, &rb);
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
            kvw__sender_update(ctx, r);
        return;
    }
    case KVW_MSG_META:
        if (ctx->side != KVW_SIDE_DECODE)
            break;
        kvw__handle_meta(ctx, peer, &rb);
        return;
    case KVW_MSG_DIGEST:
        if (ctx->side != KVW_SIDE_DECODE)
            break;
        kvw__handle_digest(ctx, peer, &rb);
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
            kvw__send_room_msg(ctx, peer, KVW_MSG_FAILED, id, KVW_ERR_REJECTED, why);
            kvw__send_room_msg(ctx, peer, KVW_MSG_ABORT_ACK, id, KVW_ERR_ABORTED, "refused");
        } else if (type == KVW_MSG_ABORT && ctx->side == KVW_SIDE_PREFILL) {
            /* Remembered so that a later sender fails; bounded per peer, like REQs. */
            if (r == NULL)
                (void)kvw__room_new_by_peer(ctx, id, peer, &r);
            /* Nobody owns the room yet: a decode rank aborts before it posted (an engine
             * dropping a request it never preallocated). The abort claims the room for
             * its instance and group, as a first REQ would (the first claim wins: with a
             * secret only a rank of the deployment can make one), and fails it at once,
             * so the prefill lets go of the request now instead of at its wait timeout; a
             * later REQ from another instance is a second claimant. */
            bool unclaimed = r && r->dst_dp < 0 && r->state != KVW_ROOM_FAILED;
            if (unclaimed) {
                r->dst_dp = (int32_t)peer->dp;
                r->dst_instance = peer->instance;
            }
            /* The room's other decode ranks hear of it too (FAILED). */
            if (r)
                kvw__room_fail(ctx, r, KVW_ERR_ABORTED, true, "aborted by %s%s: %s", peer->desc,
                               unclaimed ? " before any request" : "", reason);
            /* A decode rank this room writes gets its ABORT_ACK once the worker is out
             * of the room (kvw__room_quiesce); any other one can have it now. */
            bool dst = false;
            for (uint32_t i = 0; r && i < r->num_dsts; i++)
                dst |= r->dsts[i].peer == peer->id;
            if (!dst || (r && r->quiesce_sent))
                kvw__send_room_msg(ctx, peer, KVW_MSG_ABORT_ACK, id, KVW_ERR_ABORTED, "stopped");
        } else if (type == KVW_MSG_FAILED && ctx->side == KVW_SIDE_DECODE && r &&
                   kvw_is_source(r, peer)) {
            /* Only a rank the room reads from may fail it: a FAILED from any other (a
             * prefill instance the room does not read from) is ignored. The room's other
             * sources hear of it (ABORT): one whose part was fine would otherwise hold the
             * request until its wait timeout. */
            kvw__room_fail_from(ctx, r,
                                st == KVW_ERR_ABORTED ? KVW_ERR_ABORTED : KVW_ERR_REMOTE_FAILED,
                                peer->id, "%s failed the room: %s", peer->desc, reason);
        } else if (type == KVW_MSG_ABORT_ACK && ctx->side == KVW_SIDE_DECODE && r) {
            for (uint32_t i = 0; i < r->num_srcs; i++)
                if (r->srcs[i].peer == peer->id)
                    r->srcs[i].quiet = true;
            kvw__room_release_quiet(ctx, r);
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
