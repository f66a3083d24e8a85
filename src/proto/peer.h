/*
 * Peers: the ranks on the other side, one record per control connection, with its
 * outgoing frame queue, its frame reader and (prefill) its data path; the data
 * connections bound to them (decode). Owned by peer.c.
 */
#ifndef KVW_PROTO_PEER_H
#define KVW_PROTO_PEER_H

#include "plan/rank.h"
#include "proto/wire.h"
#include "transport/transport.h"

#include <stdbool.h>
#include <stdint.h>

struct kvw_ctx;

#define KVW_TAG 16 /* bytes of a control frame's session tag */
#define KVW_MAX_OUT_BYTES (64u << 20) /* frames queued for one peer before it is dropped */

typedef struct kvw_outmsg {
    struct kvw_outmsg *next;
    kvw_wbuf_t w;
    size_t off; /* bytes already written (a direct send that the socket took in part) */
} kvw_outmsg_t;

typedef struct kvw_peer {
    uint32_t id;
    int fd;
    bool dead;
    char desc[320];
    kvw_rank_h remote;
    uint32_t dp, tp, pp;
    uint64_t instance; /* decode instance id (prefill side) */
    uint64_t admitted; /* prefill side: the order its registration was admitted in */
    bool needed;   /* the topology makes this peer and us exchange bytes */
    uint64_t last_rx_ns, last_tx_ns;
    kvw_outmsg_t *out_head, *out_tail;
    bool tx_busy; /* the control thread is writing the head frame (outside mu) */
    uint64_t out_bytes;   /* bytes queued and not yet written */
    uint64_t tx_stall_ns; /* when the socket last refused more bytes; 0 while it takes them */
    /* The queue could not take a frame, or a write failed: the control thread declares
     * the peer dead (kvw__run_deferred) with this status and reason; frames for it are
     * dropped meanwhile. */
    bool doomed;
    kvw_status_t doom_status;
    char doom_why[400];
    /* Decode side: the prefill instance (index into ctx->insts, and its connection
     * generation) this peer belongs to; registering: the handshake still runs on its
     * connecting thread, nobody else touches the socket. */
    uint32_t inst, inst_gen;
    bool registering;
    bool reaped; /* dead, and its socket and transport resources were released */
    /* Prefill: rooms its REQs and ABORTs created that no engine handle owns yet
     * (bounded by KVW_MAX_PEER_ROOMS; kvw__room_new_by_peer). */
    uint32_t pending_rooms;
    uint64_t rooms_refused; /* past that bound */
    /* With a shared secret: the session key from the handshake; every control frame
     * carries a tag under it (KVW_TAG bytes) over its direction and sequence number. */
    bool authed;
    uint8_t skey[32];
    uint8_t tx_dir;
    uint64_t tx_seq, rx_seq;
    /* Incremental frame reader. */
    uint8_t hdr[KVW_WIRE_HDR];
    uint32_t hdr_got;
    uint8_t *payload;
    uint32_t payload_len, payload_got;
    uint32_t payload_cap; /* allocated: grows with the bytes that arrive */
    /* Prefill side: the data path to this decode rank. */
    kvw_tl_ep_h ep;
    kvw_tl_rkey_h *rkeys;
    uint32_t num_rkeys;
    uint32_t id_at_remote; /* id the decode side gave us; carried in DONE */
    uint32_t remote_group_size; /* decode tp x pp */
    uint32_t remote_pp_size;    /* decode pp */
    kvw_rank_h mapped; /* prefill: the decode rank's buffers as mapped here (rkey_ptr) */
    kvw_tl_rkey_h staging_rkey; /* the decode rank's staging area, or NULL */
    uint64_t staging_len;
    /* Prefill: GPU memory on either side over a host transport: every byte goes through
     * the decode's staging area (there are no keys to the decode's GPU buffers). */
    bool must_stage;
    /* Decode: the challenge this rank sent in its registration. Only the prefill rank that
     * read it can bind a data connection to this peer (KVW_MSG_BIND). */
    uint8_t bind_nonce[32];
    /* Decode, with a secret: the one data connection that proved this session (its BIND
     * carried HMAC(session key, "kvwire-bind-3" | peer id | nonce)); NULL until one did. */
    kvw_tl_ep_h data_ep;
} kvw_peer_t;

/* The context's peer table (ctx->peers; ctx->mu guards it). Peers are never freed
 * before the context: an id indexes the table for the context's lifetime. */
typedef struct kvw_peers {
    kvw_peer_t **tab;
    uint32_t num, cap;
} kvw_peers_t;

/* Decode: a data connection (accepted transport endpoint) and the peer it claimed to be
 * in its BIND; checked against that peer's nonce when a completion arrives. */
typedef struct kvw_bind {
    kvw_tl_ep_h ep;
    uint32_t peer;
    uint8_t nonce[32];
} kvw_bind_t;

/* Decode: the data connections bound to peers (ctx->binds; see KVW_MSG_BIND). */
typedef struct kvw_binds {
    kvw_bind_t *tab;
    uint32_t num, cap;
} kvw_binds_t;

/* A dead peer's resources, detached under mu and released after it (closing a
 * transport endpoint may wait for its flush). */
typedef struct kvw_peer_res {
    struct kvw_peer_res *next;
    int fd;
    kvw_tl_rkey_h *rkeys;
    uint32_t num_rkeys;
    kvw_tl_rkey_h staging_rkey;
    kvw_tl_ep_h ep;
    kvw_rank_h remote, mapped;
    uint8_t *payload;
} kvw_peer_res_t;

/* Queues a frame for a peer; the control thread sends it. mu held; takes w. A peer that
 * cannot take one more frame is doomed (kvw__peer_doom). */
void kvw__peer_send(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w);
void kvw__ctx_wake(struct kvw_ctx *ctx);
/* Marks a peer for death (the first reason stays) and wakes the control thread, which
 * runs it (kvw__peer_dead). mu held. */
void kvw__peer_doom(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_status_t status,
                    const char *reason);
void kvw__peer_dead(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_status_t status,
                    const char *reason);

/* Tag of one control frame under a peer's session key: direction, sequence number,
 * frame type and payload. */
void kvw__frame_tag(const kvw_peer_t *peer, uint8_t dir, uint64_t seq, uint8_t type,
                    const uint8_t *payload, size_t n, uint8_t out[32]);

void kvw__peer_drop_out(kvw_peer_t *peer);

/* The control thread writes a peer's queued frames (mu not held; takes it to pop). */
void kvw__peer_flush(struct kvw_ctx *ctx, kvw_peer_t *peer, bool blocking);

/* Whether frames wait in a peer's outgoing queue (mu held). */
static inline bool kvw__peer_tx_queued(const kvw_peer_t *p)
{
    return p->out_head != NULL;
}

/* Whether a peer's socket refused its queued frames for longer than limit_ms (mu
 * held); *why says so. */
bool kvw__peer_tx_stalled(const kvw_peer_t *p, uint64_t now, uint32_t limit_ms, char *why,
                          size_t cap);

kvw_peer_t *kvw__peer_add(struct kvw_ctx *ctx, int fd);

/* Detaches the resources of every dead peer nothing refers to any more (mu held): no
 * room names it and `busy` (when given: the staging credits' waiters) does not; the
 * caller releases the list with kvw__peer_res_release after unlocking. The peer's small
 * record stays (its id indexes the peer table). */
typedef bool (*kvw_peer_busy_fn)(const struct kvw_ctx *ctx, uint32_t peer);
kvw_peer_res_t *kvw__peers_reap(struct kvw_ctx *ctx, kvw_peer_busy_fn busy);

void kvw__peer_res_release(struct kvw_ctx *ctx, kvw_peer_res_t *list);

void kvw__peer_free(struct kvw_ctx *ctx, kvw_peer_t *p);

void kvw__send_room_msg(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, uint64_t room,
                        kvw_status_t status, const char *reason);
/* As kvw__peer_send and kvw__send_room_msg, but the frame only joins the peer's queue
 * (in order with every other frame to it) and nothing is written or woken: the caller
 * writes it with kvw__peer_flush_after once it let go of mu (decode: a room's
 * confirmation goes out after its waiter was woken). */
void kvw__peer_send_later(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w);
void kvw__send_room_msg_later(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type,
                              uint64_t room, kvw_status_t status, const char *reason);
/* Writes the peer's queued frames without blocking (mu not held); what is left, or
 * another thread is writing, is the control thread's (woken for it). */
void kvw__peer_flush_after(struct kvw_ctx *ctx, kvw_peer_t *peer);

#endif
