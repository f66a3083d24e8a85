/*
 * Rooms: one transfer of one request's KV cache, seen from one side (prefill: the
 * decode ranks it writes; decode: the prefill ranks it reads from), and the prefill
 * workers' queue of rooms with work. The state machine and the handle calls are room.c's,
 * the table roomtab.c's, a room's failure fail.c's, the queue sched.c's.
 */
#ifndef KVW_PROTO_ROOM_H
#define KVW_PROTO_ROOM_H

#include <kvwire/xfer.h>

#include "core/hmap.h"
#include "exec/staged.h"
#include "plan/rank.h"
#include "proto/ivlog.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct kvw_ctx;

/* One chunk queued by the prefill engine. */
typedef struct kvw_qchunk {
    kvw_chunk_t c;
    kvw_side_pages_t pages;
    uint32_t *store;
    /* Streamed chunks (kvw_sender_send_streamed): one byte per layer of this rank's
     * stage, set once the engine marked the layer ready; NULL: every layer is ready. */
    uint8_t *ready;
    uint32_t unready; /* layers not marked yet */
} kvw_qchunk_t;

/* Prefill: one decode rank's half of a room. */
typedef struct kvw_room_dst {
    uint32_t peer;
    uint64_t num_tokens, prefix_len;
    kvw_side_pages_t pages;
    uint32_t *store;
    uint32_t next_chunk; /* chunks sent so far */
    /* Layers of chunk next_chunk already sent (streamed chunks; one byte per layer of
     * this rank's stage, allocated on first use, cleared when the chunk is done). */
    uint8_t *sent;
    bool last_sent;
    bool acked;          /* the decode rank confirmed every byte landed */
    bool busy;           /* a worker is sending to this decode rank */
    int64_t grant_off;   /* staging grant from the decode rank, -1 while waiting */
    uint64_t grant_len;
    /* KV verification: the decode rank's request asked for it; the digest of what this
     * rank sent it so far, per unit of its rank (plan/digest.h; allocated on the first
     * step), sent with the last chunk's final step (KVW_MSG_DIGEST). */
    bool verify;
    uint64_t *digest;
    uint32_t num_units;
} kvw_room_dst_t;

/* Decode: one prefill rank's half of a room. */
typedef struct kvw_room_src {
    uint32_t peer;
    uint64_t expected, got;
    uint32_t meta_expected; /* metadata bytes the final completion announced */
    bool meta_got;          /* ... and they arrived */
    bool done;
    bool quiet; /* the prefill rank confirmed it will not write this room any more */
    /* The staged stream of the chunk [scatter_begin, scatter_end) being scattered: one
     * plan for all its windows, taken out while a window is scattered. */
    kvw_staged_t *scatter;
    uint64_t scatter_begin, scatter_end;
    bool scatter_last;
    /* A verified room: the digest the prefill rank computed over its source pages
     * (KVW_MSG_DIGEST, one per unit of this rank), once it arrived. */
    uint64_t *digest;
    bool digest_got;
    /* ... and this rank's digest of the same pair over its destination pages, computed
     * once the room's landing is complete (NULL: not yet). */
    uint64_t *mine;
} kvw_room_src_t;

typedef struct kvw_room {
    kvw_hnode_t hnode; /* in ctx->rooms, under the room's id */
    struct kvw_ctx *ctx;
    uint64_t id;
    bool is_sender;
    bool engine_owned; /* a handle exists (a prefill room can exist from a REQ alone) */
    /* 1 + the peer whose REQ or ABORT created the room before a handle did (0: none);
     * the room counts in that peer's pending_rooms until a handle takes it or it is
     * freed (kvw__room_new_by_peer). */
    uint32_t opener;
    kvw_room_state_t state;
    kvw_status_t status;
    char reason[320];
    uint64_t created_ns, deadline_ns, start_ns, end_ns;
    uint64_t bytes, runs;
    uint32_t inflight; /* worker jobs running on this room */
    uint32_t waiters;  /* threads in kvw_room_wait on this room (mu) */
    bool quiesce_sent; /* prefill: told every decode rank it stopped writing */
    bool queued; /* in the workers' queue (queued and qnext: ctx->q.mu) */
    struct kvw_room *qnext;
    /* prefill */
    int32_t dst_dp; /* -1 until the first REQ */
    bool dsts_known; /* every decode rank the room serves has posted it (latched) */
    uint64_t dst_instance;
    kvw_room_dst_t *dsts;
    uint32_t num_dsts;
    kvw_qchunk_t *chunks;
    uint32_t num_chunks, cap_chunks;
    bool have_last;
    uint64_t serial;      /* unique in the context: tells a reused id apart */
    uint32_t event_waits; /* layer marks waiting on a CUDA event (kvw__event_watch) */
    bool have_stream;     /* some chunk was streamed; stream_chunk is the latest */
    uint32_t stream_chunk;
    uint64_t num_tokens;
    /* decode */
    uint32_t src_dp;
    kvw_room_src_t *srcs;
    uint32_t num_srcs;
    uint32_t *granted[KVW_NUM_POOLS]; /* sorted pages the room may write */
    uint32_t num_granted[KVW_NUM_POOLS];
    uint64_t prefix_len;
    /* Decode: the room is verified (decided at the post: KVW_VERIFY, by room id when
     * sampled); its request says so to the prefill ranks. */
    bool verify;
    uint64_t landed; /* decode: bytes the receiver saw land (mediated transports) */
    kvw_ivlog_t writes;     /* decode: where they landed (direct, and staged until scattered) */
    uint64_t staged_exact;  /* decode: staged bytes whose window was covered exactly once */
    kvw_side_pages_t post_pages; /* the decode's pages, for scattering staged data */
    uint32_t *post_store;
    const char *path;            /* "direct" or "staged" (what the last chunk used) */
    uint64_t hop_ns[KVW_HOP_COUNT]; /* kvw_hop_t stamps of this side */
    /* Metadata: prefill, what the engine attached; decode, what the first prefill rank
     * sent (any other must send the same bytes). */
    uint8_t *meta;
    uint32_t meta_len;
    bool has_meta;
    /* Decode: the prefill instance the room reads from, and a post made while that
     * instance was still being connected (sent once it is). */
    uint32_t inst, inst_gen;
    bool pending;
    kvw_recv_post_t pend;
    uint32_t *pend_store;
} kvw_room_t;

/* What a room's failure still has to do, queued by fail.c and run by the control thread
 * (kvw__run_deferred) in order: give back the room's staging spans (decode), then send
 * the frames, each to one peer. Taken from the room when it failed, so that the room may
 * be gone by then. */
typedef struct kvw_room_frame {
    uint32_t peer;
    uint8_t type;        /* KVW_MSG_FAILED, _ABORT or _ABORT_ACK */
    kvw_status_t status;
    bool stopped;        /* reason "stopped" (ABORT_ACK) instead of the room's */
} kvw_room_frame_t;

typedef struct kvw_room_effect {
    struct kvw_room_effect *next;
    uint64_t room;
    bool release_stage;
    char reason[320];
    uint32_t num_frames, cap_frames;
    kvw_room_frame_t *frames;
} kvw_room_effect_t;

/* The queue of those effects (ctx->defer; fail.c's, mu held). */
typedef struct kvw_effects {
    kvw_room_effect_t *head, *tail;
} kvw_effects_t;

/* Prefill: the rooms with work for the workers, in order (ctx->q; workq.c). Its own
 * lock and condition variable guard it (taken after ctx->mu, never before). */
typedef struct kvw_workq {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a room was queued, or stop was set */
    kvw_room_t *head, *tail;
    bool stop; /* the workers leave (context teardown) */
    _Atomic uint32_t gen; /* bumped whenever a room is queued for the workers */
    /* Rooms queued by the control thread wake the workers only when it lets go of mu
     * (kvw__queue_kick): it may serve a small room itself first (kvw__ctrl_serve). */
    bool wake_due;
} kvw_workq_t;

/* Stamps hop `h` of a room now (mu held); `first`: keep an earlier stamp. */
static inline void kvw__room_hop(kvw_room_t *r, kvw_hop_t h, bool first)
{
    if (!first || r->hop_ns[h] == 0)
        r->hop_ns[h] = kvw__now_ns();
}

/* A sender or a receiver handle is its room under a typed name (struct kvw_sender and
 * struct kvw_receiver are never defined): the public kvw_room_h is the room itself, so
 * kvw_sender_room and kvw_receiver_room only convert. */
static inline kvw_room_t *kvw__sender_room(kvw_sender_h s)
{
    return (kvw_room_t *)(void *)s;
}

static inline kvw_room_t *kvw__receiver_room(kvw_receiver_h rv)
{
    return (kvw_room_t *)(void *)rv;
}

/* Pushes a room's inactivity deadline forward (mu held): rooms fail after
 * wait_timeout_ms without progress, not after wait_timeout_ms in total. */
void kvw__room_touch(struct kvw_ctx *ctx, kvw_room_t *room);

/* Room table (ctx->mu held). */
kvw_room_t *kvw__room_find(struct kvw_ctx *ctx, uint64_t id);
/* Every room, in no particular order: for (r = kvw__room_first(ctx); r; r =
 * kvw__room_next(ctx, r)). The loop may unlink the room it stands on (take the next one
 * first when it frees it too), and must not create rooms. */
kvw_room_t *kvw__room_first(struct kvw_ctx *ctx);
kvw_room_t *kvw__room_next(struct kvw_ctx *ctx, const kvw_room_t *r);
/* Context teardown: frees the rooms no handle owns, detaches the others from the
 * context (their destroy calls free them) and releases the table. */
void kvw__rooms_release(struct kvw_ctx *ctx);
kvw_room_t *kvw__room_new(struct kvw_ctx *ctx, uint64_t id, bool is_sender);
/* Prefill: a room created by a peer's REQ or ABORT, before the engine opened it. Such
 * rooms are bounded per peer (KVW_MAX_PEER_ROOMS): past the bound BUSY (NO_MEMORY
 * when out of memory), with a message, and *room_p NULL. The engine's handle takes the
 * room over (kvw__room_adopt), which no longer counts it for the peer. mu held. */
kvw_status_t kvw__room_new_by_peer(struct kvw_ctx *ctx, uint64_t id, struct kvw_peer *peer,
                                   kvw_room_t **room_p);
void kvw__room_adopt(struct kvw_ctx *ctx, kvw_room_t *room);
void kvw__room_unlink(struct kvw_ctx *ctx, kvw_room_t *room);
void kvw__room_free(kvw_room_t *room);
/* Fails a room (sticky) with a reason; tells peers when `notify` is set. mu held. */
void kvw__room_fail(struct kvw_ctx *ctx, kvw_room_t *room, kvw_status_t status, bool notify,
                    const char *fmt, ...) KVW_PRINTF(5, 6);
/* Decode: fails a room that its source `from` (a peer id) failed, and aborts it on the
 * room's other sources, which would otherwise hold it until their wait timeout. mu held. */
void kvw__room_fail_from(struct kvw_ctx *ctx, kvw_room_t *room, kvw_status_t status,
                         uint32_t from, const char *fmt, ...) KVW_PRINTF(5, 6);
void kvw__room_advance(kvw_room_t *room, kvw_room_state_t state);
bool kvw__room_quiet(struct kvw_ctx *ctx, const kvw_room_t *r);
void kvw__room_release_quiet(struct kvw_ctx *ctx, kvw_room_t *r);
/* From here (mu held) to kvw__room_wake_after (called once mu is let go), rooms that
 * this thread moves to Success wake their waiters (kvw_room_wait) only then: woken
 * under mu, a waiter would run into the lock and sleep again. */
void kvw__room_wake_defer(struct kvw_ctx *ctx);
void kvw__room_wake_after(struct kvw_ctx *ctx);

/*
 * A failed prefill room tells its decode ranks, once no worker step runs on it any
 * more, that it will not write their pages again (ABORT_ACK). A decode rank destroying
 * a room waits for that before the engine may reuse the pages: one-sided transports
 * cannot be stopped by the receiver.
 */
void kvw__room_quiesce(struct kvw_ctx *ctx, kvw_room_t *r);

/* The control thread takes the queued effects, a list oldest first (NULL: none; mu
 * held), and frees each it ran; the context's destroy drops what is left. */
kvw_room_effect_t *kvw__room_effects_take(struct kvw_ctx *ctx);
void kvw__room_effect_free(kvw_room_effect_t *e);
void kvw__room_effects_fini(struct kvw_ctx *ctx);

#endif
