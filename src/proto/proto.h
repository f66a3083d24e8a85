/*
 * Protocol internals: contexts, peers, rooms, the bootstrap endpoint.
 *
 * The files of src/proto, one job each, by layer: a file calls functions of files in
 * lower layers only. The context's state is layered too: each sub-struct of struct
 * kvw_ctx has one owner file (the table at struct kvw_ctx), and the types of each
 * object have their own header (room.h, peer.h, stage.h, inst.h, bootstrap.h). Failure
 * runs one way: a peer that cannot take a frame is doomed and a failed room queues its
 * effects; the control thread runs both (kvw__run_deferred).
 *
 *  10 ctx.c        context create and destroy
 *   9 ctrl.c       the control thread: socket reads, deferred deaths and effects,
 *                  heartbeats, timeout scans, reaping
 *   9 sender.c     the prefill engine's kvw_sender_* calls
 *   8 dispatch.c   control frames, dispatched by type
 *   8 worker.c     prefill workers: mapped, direct and staged paths, GPU steps
 *   8 events.c     layer marks that wait on CUDA events
 *   7 sched.c      prefill rooms: REQs, which decode rank has work, layer marks
 *   7 recv.c       decode: kvw_receiver_* calls, post, page grants
 *   7 land.c       decode: completions, staged scatter, write checks, accounting
 *   6 room.c       room state machine, timeouts, the handle calls (poll, wait, ...)
 *   6 stage.c      decode: the staging area and its credits
 *   5 fail.c       peer death and room failure (marks, and the queue of their effects)
 *   4 inst.c       decode: prefill instances, their connecting threads, late aborts
 *   3 handshake.c  registration: HELLO/ACCEPT, authentication, decode connect
 *   2 peer.c       peer records: add, free, reap; the outgoing frame queue (send, doom,
 *                  flush); session tags; control wake-up
 *   1 roomtab.c    room table: find, new, unlink, free
 *   1 bootstrap.c  the bootstrap endpoint and its client
 *   1 codec.c      rank descriptions, page lists and the DONE frame
 *   0 workq.c      the workers' room queue
 *   0 ivlog.c      the log of written byte ranges (page-exact accounting)
 *   0 wire.c       frame buffers, frames on a socket, addresses (byte loops: core/sock.c)
 *   0 metrics.c    the context's counters (atomics) and kvw_ctx_metrics
 */
#ifndef KVW_PROTO_PROTO_H
#define KVW_PROTO_PROTO_H

#include <kvwire/xfer.h>

#include "core/hmap.h"
#include "core/lock.h"
#include "core/config.h"
#include "core/mask.h"
#include "exec/staged.h"
#include "plan/rank.h"
#include "proto/bootstrap.h"
#include "proto/inst.h"
#include "proto/ivlog.h"
#include "proto/metrics.h"
#include "proto/peer.h"
#include "proto/room.h"
#include "proto/stage.h"
#include "proto/wire.h"
#include "transport/transport.h"

#include <pthread.h>
#include <stdatomic.h>

/* Rank descriptions in frames (remote buffers get addr = NULL). */
void kvw__wire_put_rank(kvw_wbuf_t *w, kvw_rank_h rank);
kvw_status_t kvw__wire_get_rank(kvw_rbuf_t *r, kvw_rank_h *rank_p);
void kvw__wire_put_pages(kvw_wbuf_t *w, const kvw_pages_t *pl);
/* Page lists longer than max_pages are OUT_OF_RANGE (nothing allocated). */
kvw_status_t kvw__wire_get_pages(kvw_rbuf_t *r, kvw_pages_t *pl, uint32_t **store_p,
                                 uint64_t max_pages);
/* Reads past a page list (bounds-checked) and leaves *pl empty. */
kvw_status_t kvw__wire_skip_pages(kvw_rbuf_t *r, kvw_pages_t *pl);

/* The DONE frame (KVW_MSG_DONE): one step's completion, prefill -> decode through the
 * transport, after the step's bytes. */
typedef struct kvw_done_msg {
    uint64_t room;
    uint32_t peer; /* the prefill rank's id at the decode side (its peer id there) */
    uint64_t chunk_begin, chunk_end;
    uint64_t bytes; /* bytes the step moved (a staged window: its length) */
    bool last_chunk;
    bool staged; /* a staged window: stream offset soff, length slen, at staging offset goff */
    uint64_t soff, slen, goff;
    bool final; /* the step completes the chunk for this decode rank */
    /* Metadata bytes the prefill rank sent on the control channel (the last chunk's final
     * completion only, else 0): the decode waits for them before Success. */
    uint32_t meta_len;
    /* A verified room's KV digest for this decode rank (plan/digest.h), whole room, one
     * value per unit: only in the last chunk's final completion, when it fits in one
     * notification (KVW_DONE_DIGEST_MAX units); otherwise it follows on the control
     * channel (KVW_MSG_DIGEST). digest_n 0: none. Encoding reads digest[0 .. digest_n);
     * decoding points digest_le at the values as they lie in the frame (little-endian). */
    uint32_t digest_n;
    const uint64_t *digest;
    const uint8_t *digest_le;
} kvw_done_msg_t;
/* The most digest units a DONE frame carries: the frame (header, fields, values, tag)
 * stays within one notification (KVW_TL_MAX_NOTIFY). */
#define KVW_DONE_DIGEST_MAX 480u
/* Starts w as a DONE frame holding m (the caller finishes it). */
/* With a session key (`key`, NULL: none) the frame ends in a tag (KVW_TAG bytes):
 * HMAC(key, "kvwire-done-4" | the fields and digest values), so only the prefill rank
 * of the session can complete a room, or vouch for its digest. */
void kvw__done_encode(kvw_wbuf_t *w, const kvw_done_msg_t *m, const uint8_t *key);
/* Reads a DONE frame's payload; MALFORMED (message set) unless it is exactly one, with
 * or without a tag. With `key` (the session key of the peer the frame names), the tag
 * must be there and right (AUTH otherwise). */
kvw_status_t kvw__done_decode(kvw_rbuf_t *r, kvw_done_msg_t *m);
kvw_status_t kvw__done_check_tag(const uint8_t *payload, size_t len, const uint8_t *key);
/* With a secret: the digest of a bootstrap entry's nonce and address that the
 * registration MACs bind (the decode's entry must be the prefill rank's own). */
void kvw__entry_bind(const uint8_t nonce[32], const char *addr, uint8_t out[32]);
/* With a secret: what a data connection's BIND carries for peer `peer_id` (handshake.c). */
void kvw__bind_proof(const uint8_t skey[32], uint32_t peer_id, const uint8_t dnonce[32],
                     uint8_t out[32]);

/* Plan without page lists: segments and byte count only (pages are not checked). */
/* kvw_plan_create on structs the library built itself (no field-mask checks). */
kvw_status_t kvw__plan_create(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                              const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                              kvw_plan_h *plan_p);
kvw_status_t kvw__plan_create_nopages(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                      kvw_plan_h *plan_p);

/* ------------------------------------------------------------ contexts */

#define KVW_MAX_HANDSHAKES 64 /* registrations served at once (prefill) */

/* Prefill: the registration connections being served (ctx->hs; handshake.c). A
 * connection that has not sent its registration yet can be displaced by a new one when
 * the slots are full. */
typedef struct kvw_hs_slots {
    struct {
        int fd; /* -1: free */
        uint64_t started_ns;
        bool heard;   /* its registration frame arrived */
        bool evicted; /* displaced: its thread is on its way out */
    } slot[2 * KVW_MAX_HANDSHAKES];
    uint32_t running;  /* registration threads still running */
    uint64_t admitted; /* registrations admitted so far: each one's order (kvw_hs_admit) */
    uint32_t pending;  /* admitted, not yet a peer nor released: count as live (mu) */
    uint64_t refusals; /* registrations refused, and the last reason */
    char last_refusal[480];
} kvw_hs_slots_t;

/* Layer marks waiting on CUDA events, and the thread that polls them (ctx->evw; started
 * on the first; events.c). */
typedef struct kvw_evwatch_set {
    struct kvw_evwatch *tab;
    uint32_t num, cap;
    pthread_t thread;
    bool started;
    pthread_cond_t cv;
} kvw_evwatch_set_t;

/*
 * A context is a composition: the fields at the top are set at creation and read-only
 * afterwards (but `stopping`); each sub-struct below them has one owner file, which
 * alone reads and writes its fields (the context's create and destroy set them up and
 * tear them down):
 *   stage  stage.c     staging area and credits (decode)
 *   peers  peer.c      the peer table; each peer's outgoing frame queue
 *   insts  inst.c      prefill instances, their connecting threads, late aborts (decode)
 *   q      workq.c     the workers' room queue (prefill)
 *   binds  land.c      data connections bound to peers (decode)
 *   hs     handshake.c registration slots (prefill)
 *   evw    events.c    layer marks waiting on CUDA events
 *   defer  fail.c      failed rooms' effects, run by the control thread (ctrl.c)
 *   metrics metrics.c  counters and gauges (atomics, bumped from any file)
 */
struct kvw_ctx {
    kvw_side_t side;
    kvw_rank_h rank;
    const kvw_tl_ops_t *tl_ops;
    kvw_tl_h tl;
    kvw_tl_mem_h *mems;
    uint32_t num_mems;
    char listen_host[64];
    char bootstrap_addr[128];
    kvw_bootstrap_t *bs;
    uint32_t heartbeat_ms, peer_timeout_ms, bootstrap_timeout_ms, wait_timeout_ms;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_cond_t done_cv; /* a room turned terminal (CLOCK_MONOTONIC; kvw_room_wait) */
    /* Busy polling (0: off): spinners watch these counters instead of the guarded
     * fields, so that they never read what others write under mu. */
    uint64_t busy_poll_ns;
    _Atomic uint32_t done_gen; /* bumped whenever a room turns terminal */
    bool stopping;

    int listen_fd;
    uint16_t listen_port;
    int bs_fd; /* prefill: the connection that holds this rank's bootstrap entry */
    /* Prefill, with a secret: the digest of the entry it holds there (its nonce and
     * address, kvw__entry_bind); every registration's MACs cover it. */
    uint8_t bs_bind[32];
    bool bs_bound; /* bs_bind is set (a registration arriving before waits for it) */
    int wake_fd[2];

    kvw_hmap_t rooms; /* by id */

    pthread_t ctrl_thread;
    pthread_t workers[16];
    uint32_t num_workers; /* started */
    bool ctrl_started;

    /* The memory kind of this rank's buffers, and their device (-1: host memory). */
    const kvw_memops_t *mem;
    int mem_dev;
    /* This rank's buffers are device memory on a host transport (tcp, shm, ucx): they
     * are gathered (prefill) or scattered (decode) on the device through host staging. */
    bool staged_dev;
    int path_mode; /* 0 auto, 1 always direct, 2 always staged */
    /* The KVW_* variables the context uses, read once when it is created
     * (kvw__ctx_cfg_read; core/config.c checks and documents them). */
    struct {
        uint64_t workers;      /* KVW_WORKERS */
        uint64_t gpu_inflight; /* KVW_GPU_INFLIGHT */
        uint64_t gpu_batch;    /* KVW_GPU_BATCH */
        uint64_t verify_inline; /* KVW_VERIFY_INLINE_KB, in bytes */
        uint64_t gpu_warm;     /* KVW_GPU_WARM */
        uint64_t staging_mb;   /* KVW_STAGING_MB */
        uint64_t busy_poll_us; /* KVW_BUSY_POLL_US */
        int path_mode;         /* KVW_PATH */
        uint64_t max_peer_rooms; /* KVW_MAX_PEER_ROOMS */
        uint64_t max_hello;      /* KVW_MAX_HELLO_KB, in bytes */
        uint64_t max_peers;      /* KVW_MAX_PEERS */
        int verify;              /* KVW_VERIFY (or the params' verify): KVW_VERIFY_* */
        uint32_t verify_ppm;     /* rooms verified per million (sample) */
    } cfg;
    uint64_t room_serial;
    char secret[256]; /* shared secret, "" when none */
    uint64_t instance_id;
    /* Decode: what a registration sends (keys of our buffers and staging area, data
     * address). */
    uint8_t *hello_rkeys;
    size_t *hello_rkey_lens;
    uint8_t hello_addr[KVW_TL_MAX_ADDR];
    size_t hello_addr_len;
    uint64_t hello_staging_len; /* the staging area's size (0: none) */

    kvw_stage_t stage;
    kvw_peers_t peers;
    kvw_insts_t insts;
    kvw_workq_t q;
    kvw_binds_t binds;
    uint64_t foreign_writes; /* decode: writes refused as not from a room's source (mu) */
    kvw_hs_slots_t hs;
    kvw_evwatch_set_t evw;
    kvw_effects_t defer;
    kvw_metrics_t metrics;
};

/* The peer table (peer.c's): peer `id` (< kvw__peer_count) and how many there are (mu
 * held). */
static inline kvw_peer_t *kvw__peer_at(const struct kvw_ctx *ctx, uint32_t id)
{
    return ctx->peers.tab[id];
}

static inline uint32_t kvw__peer_count(const struct kvw_ctx *ctx)
{
    return ctx->peers.num;
}

/* The instance table (inst.c's): instance `i` (< its count), its address or "?", and
 * whether connecting threads are told to stop (context teardown). mu held, but for the
 * last. */
static inline const kvw_inst_t *kvw__inst_at(const struct kvw_ctx *ctx, uint32_t i)
{
    return &ctx->insts.tab[i];
}

static inline const char *kvw__inst_name(const struct kvw_ctx *ctx, uint32_t i)
{
    return i < ctx->insts.num ? ctx->insts.tab[i].addr : "?";
}

static inline bool kvw__insts_cancelled(struct kvw_ctx *ctx)
{
    return atomic_load(&ctx->insts.cancel);
}

/* Decode: sends a posted room's pages to its prefill ranks (mu held); fails the room on
 * error. Used by kvw_receiver_post and, for posts made while the instance was being
 * connected, once it is. */
kvw_status_t kvw__receiver_post_locked(struct kvw_ctx *ctx, kvw_room_t *r,
                                       const kvw_recv_post_t *post);

/* Spins up to ctx->busy_poll_ns while *gen still equals `seen` (mu not held). */
static inline void kvw__busy_wait(const struct kvw_ctx *ctx, _Atomic uint32_t *gen, uint32_t seen)
{
    if (ctx->busy_poll_ns == 0)
        return;
    uint64_t end = kvw__now_ns() + ctx->busy_poll_ns;
    while (atomic_load_explicit(gen, memory_order_acquire) == seen && kvw__now_ns() < end) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}

#define KVW_PATH_AUTO 0
#define KVW_PATH_DIRECT 1
#define KVW_PATH_STAGED 2

/* Streaming (sched.c): marks layers [b, e) of a room's queued chunk `chunk` ready (mu
 * held, range checked). */
void kvw__sender_mark_ready(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t chunk, uint32_t b,
                            uint32_t e);
/* events.c: marks layers [b, e) of the room's latest streamed chunk ready once the CUDA
 * event completes, polled by the context's event thread so that neither the engine nor
 * an executor stream ever waits on it (mu held). Stops the thread (ctx->stopping set). */
kvw_status_t kvw__event_watch(struct kvw_ctx *ctx, kvw_room_t *r, uint32_t b, uint32_t e,
                              void *cuda_event);
void kvw__event_stop(struct kvw_ctx *ctx);

/* Frame handlers (mu held). */
void kvw__handle_frame(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, const uint8_t *p,
                       uint32_t len);
void kvw__check_timeouts(struct kvw_ctx *ctx, uint64_t now);
void *kvw__worker_main(void *arg);
/* The workers' room queue (workq.c; mu held, the queue's own lock taken inside): queue a
 * room (once), drop it, take the head (NULL: empty), whether it is empty; wait until a
 * room is queued or the queue is stopped (drops mu meanwhile); stop or restart the
 * workers' waits; its generation, bumped on every queueing, and a spin until it moves
 * (busy polling; mu not held). */
void kvw__queue_init(struct kvw_ctx *ctx);
void kvw__queue_fini(struct kvw_ctx *ctx);
void kvw__queue_room(struct kvw_ctx *ctx, kvw_room_t *room);
void kvw__unqueue_room(struct kvw_ctx *ctx, kvw_room_t *room);
kvw_room_t *kvw__dequeue_room(struct kvw_ctx *ctx);
bool kvw__queue_empty(struct kvw_ctx *ctx);
void kvw__queue_wait(struct kvw_ctx *ctx);
void kvw__queue_stop(struct kvw_ctx *ctx, bool stop);
/* The control thread: marks this thread as ctx's control thread (rooms it queues wake
 * the workers only at kvw__queue_kick, when it lets go of mu); whether this thread is
 * it; the wake-up owed; the head of the queue, left queued (NULL: empty; mu held). */
void kvw__queue_ctrl_thread(struct kvw_ctx *ctx);
bool kvw__queue_on_ctrl(const struct kvw_ctx *ctx);
void kvw__queue_kick(struct kvw_ctx *ctx);
kvw_room_t *kvw__queue_head(struct kvw_ctx *ctx);
/* Prefill, on the control thread (mu held, dropped around each put): serves small rooms
 * at the head of the workers' queue itself, on the direct path of a host transport,
 * instead of waking a worker for each (the wake-up and the fight for mu were the largest
 * part of a small room's time on a small host). Anything else stays for the workers. */
void kvw__ctrl_serve(struct kvw_ctx *ctx);
uint32_t kvw__queue_gen(struct kvw_ctx *ctx);
void kvw__queue_spin(struct kvw_ctx *ctx, uint32_t seen);

/* Prefill: handles a HELLO on a fresh connection (blocking, before polling it). */
kvw_status_t kvw__prefill_handshake(struct kvw_ctx *ctx, int fd, kvw_peer_t **peer_p);
/* Prefill: the registration frame of handshake connection `fd` arrived (takes mu). */
void kvw__handshake_heard(struct kvw_ctx *ctx, int fd);

/* Transport callbacks (decode). */
void kvw__on_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len);
kvw_status_t kvw__check_write(void *arg, kvw_tl_ep_h ep, uint64_t room, uint64_t region,
                              uint64_t off, uint64_t len);
void kvw__check_writes(void *arg, kvw_tl_ep_h ep, const kvw_tl_write_t *w, size_t n,
                       kvw_status_t *st);
void kvw__on_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason);

/* ------------------------------------------------------------ between the files above */

/* handshake.c */

/* Registers with one prefill rank; BUSY means this rank's previous registration is not
 * known dead there yet (a restart): back off and try again until the deadline. */
kvw_status_t kvw__decode_connect_retry(struct kvw_ctx *ctx, const kvw_bs_entry_t *e,
                                       uint32_t inst, uint32_t gen, uint64_t deadline);

/* Registers with every rank of `entries` (kvw__decode_connect_retry each), up to
 * KVW_PAR_REGISTRATIONS at once; the first failure is the result. */
#define KVW_PAR_REGISTRATIONS 8
kvw_status_t kvw__decode_connect_all(struct kvw_ctx *ctx, const kvw_bs_entry_t *entries,
                                     uint32_t n, uint32_t inst, uint32_t gen, uint64_t deadline);

void kvw__start_handshake(struct kvw_ctx *ctx, int fd);

/* Context create: every registration slot free. Destroy: registration threads still
 * running (mu held). */
void kvw__hs_init(struct kvw_ctx *ctx);
uint32_t kvw__hs_running(const struct kvw_ctx *ctx);

/* sched.c */

/* A decode rank of the room with work (kvw_dst_has_work) that no worker serves yet, or
 * -1. */
int kvw__room_next_dst(const struct kvw_ctx *ctx, const kvw_room_t *r);

void kvw__sender_update(struct kvw_ctx *ctx, kvw_room_t *r);

void kvw__handle_req(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb);

/* land.c */

/* Decode: a prefill rank's metadata for a room (mu held). Accepted only from a prefill
 * rank that writes the room, once, bounded; several ranks must agree byte for byte. */
void kvw__handle_meta(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb);

/* Decode: a prefill rank's KV digest for a verified room (mu held): accepted from a
 * source of the room, once, with one value per unit of this rank. */
void kvw__handle_digest(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_rbuf_t *rb);

/* Context destroy: forgets the data connections' bindings. */
void kvw__binds_fini(struct kvw_ctx *ctx);

/* ctx.c: reads the context's KVW_* variables into ctx->cfg (after kvw__config_check,
 * so that the getters cannot fail). */
void kvw__ctx_cfg_read(struct kvw_ctx *ctx);

/* ctrl.c */

void *kvw__ctrl_main(void *arg);
/* Runs what failures left to do (mu held): the deaths of doomed peers (kvw__peer_send
 * could not queue a frame), then the queued effects of failed rooms, until none is left.
 * The control thread on every pass; the context's destroy once its threads are gone. */
void kvw__run_deferred(struct kvw_ctx *ctx);

#endif
