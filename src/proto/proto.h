/*
 * Protocol internals: contexts, peers, rooms, the bootstrap endpoint.
 *
 * The files of src/proto, one job each, by layer: a file calls functions of
 * files in lower layers only (every layer takes ctx->mu and reads the shared
 * structs below; only the calls are layered).
 *
 *   7 ctx.c        context create and destroy
 *   6 ctrl.c       the control thread: socket reads and writes, heartbeats, timeout scans
 *   6 sender.c     the prefill engine's kvw_sender_* calls
 *   5 dispatch.c   control frames, dispatched by type
 *   5 worker.c     prefill workers: mapped, direct and staged paths, GPU steps
 *   5 events.c     layer marks that wait on CUDA events
 *   4 sched.c      prefill rooms: REQs, which decode rank has work, layer marks
 *   4 recv.c       decode: kvw_receiver_* calls, post, page grants, prefill instances
 *   4 land.c       decode: completions, staged scatter, write checks, accounting
 *   3 room.c       room state machine, timeouts, the handle calls (poll, wait, ...)
 *   3 handshake.c  registration: HELLO/ACCEPT, authentication, decode connect
 *   2 fail.c       one recursion: frames out, peer death, room failure, staging credits
 *   1 roomtab.c    room table: find, new, unlink, free
 *   1 peer.c       peer records: add, free, reap; session tags; control wake-up
 *   1 bootstrap.c  the bootstrap endpoint and its client
 *   1 codec.c      rank descriptions and page lists in frames
 *   0 ivlog.c      the log of written byte ranges (page-exact accounting)
 *   0 wire.c       frame buffers, blocking socket helpers
 */
#ifndef KVW_PROTO_PROTO_H
#define KVW_PROTO_PROTO_H

#include <kvwire/xfer.h>

#include "core/hmap.h"
#include "core/mask.h"
#include "exec/staged.h"
#include "plan/rank.h"
#include "proto/ivlog.h"
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

/* Plan without page lists: segments and byte count only (pages are not checked). */
/* kvw_plan_create on structs the library built itself (no field-mask checks). */
kvw_status_t kvw__plan_create(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                              const kvw_side_pages_t *sp, const kvw_side_pages_t *dp,
                              kvw_plan_h *plan_p);
kvw_status_t kvw__plan_create_nopages(kvw_rank_h src, kvw_rank_h dst, const kvw_chunk_t *chunk,
                                      kvw_plan_h *plan_p);

/* ------------------------------------------------------------ bootstrap */

typedef struct kvw_bs_entry {
    uint32_t dp, tp, pp;
    uint32_t dp_size, tp_size, pp_size;
    char addr[128]; /* control endpoint host:port */
    /* With a shared secret: mac = HMAC(secret, "kvwire-bootstrap-entry-1" | nonce | the
     * fields above), nonce being the endpoint's challenge to the registering connection
     * (kvw__bootstrap_entry_mac). The entry carries both; a decode recomputes the MAC. */
    bool has_mac;
    uint8_t nonce[32], mac[32];
    uint64_t owner;      /* endpoint side: the connection holding the entry (0: none) */
    uint64_t expires_ns; /* endpoint side: one-shot entries expire then (0: held) */
} kvw_bs_entry_t;

typedef struct kvw_bootstrap kvw_bootstrap_t;

/* A one-shot registration (KVW_MSG_BS_REGISTER) stays this long; a held one as long as
 * its connection. */
#define KVW_BS_ONESHOT_TTL_MS 60000u

/* secret: NULL or "" accepts registrations without a MAC; otherwise every registration
 * must carry a valid one. */
kvw_status_t kvw__bootstrap_start(const char *host, uint16_t port, const char *secret,
                                  kvw_bootstrap_t **bs_p);
const char *kvw__bootstrap_addr(kvw_bootstrap_t *bs);
void kvw__bootstrap_stop(kvw_bootstrap_t *bs);
/* Tests: the lifetime of one-shot entries registered from now on. */
void kvw__bootstrap_set_ttl(kvw_bootstrap_t *bs, uint32_t ttl_ms);
/* The MAC of an entry (its nonce and fields) under `secret`. */
void kvw__bootstrap_entry_mac(const char *secret, const kvw_bs_entry_t *e, uint8_t out[32]);
/* An entry as it travels in registrations and tables. */
void kvw__bootstrap_put_entry(kvw_wbuf_t *w, const kvw_bs_entry_t *e);
/* With a non-empty secret, a registration first asks the endpoint for a challenge on
 * the same connection and carries the MAC over it. */
kvw_status_t kvw__bootstrap_register(const char *bs_addr, const kvw_bs_entry_t *e,
                                     const char *secret, uint64_t deadline_ns);
/* Registers and keeps the connection (*fd_p): the endpoint drops the entry as soon as
 * the connection closes, so a rank that dies or is destroyed leaves no stale entry. */
kvw_status_t kvw__bootstrap_hold(const char *bs_addr, const kvw_bs_entry_t *e,
                                 const char *secret, uint64_t deadline_ns, int *fd_p);
/* Waits until the table holds every rank of the instance (sizes from the entries or
 * the expected sizes when non-zero). *entries_p is malloc'd. With a non-empty secret,
 * an entry without a valid MAC fails the lookup at once (AUTH, naming the rank). */
kvw_status_t kvw__bootstrap_lookup(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                   const char *secret, uint64_t deadline_ns,
                                   kvw_bs_entry_t **entries_p, uint32_t *count_p);
/* The same, for a connection made on demand: an endpoint that cannot be reached (refused,
 * unreachable) fails at once instead of being retried until the deadline, and `cancel`
 * (when non-NULL and set) stops the wait. A bad address always fails at once. */
kvw_status_t kvw__bootstrap_lookup_ex(const char *bs_addr, uint32_t tp, uint32_t pp, uint32_t dp,
                                      const char *secret, uint64_t deadline_ns, bool fail_fast,
                                      const _Atomic bool *cancel, kvw_bs_entry_t **entries_p,
                                      uint32_t *count_p);

/* ------------------------------------------------------------ contexts */

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
    bool needed;   /* the topology makes this peer and us exchange bytes */
    uint64_t last_rx_ns, last_tx_ns;
    kvw_outmsg_t *out_head, *out_tail;
    bool tx_busy; /* the control thread is writing the head frame (outside mu) */
    uint64_t out_bytes;   /* bytes queued and not yet written */
    uint64_t tx_stall_ns; /* when the socket last refused more bytes; 0 while it takes them */
    /* Decode side: the prefill instance (index into ctx->insts, and its connection
     * generation) this peer belongs to; registering: the handshake still runs on its
     * connecting thread, nobody else touches the socket. */
    uint32_t inst, inst_gen;
    bool registering;
    bool reaped; /* dead, and its socket and transport resources were released */
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
} kvw_peer_t;

/* Decode: a data connection (accepted transport endpoint) and the peer it claimed to be
 * in its BIND; checked against that peer's nonce when a completion arrives. */
typedef struct kvw_bind {
    kvw_tl_ep_h ep;
    uint32_t peer;
    uint8_t nonce[32];
} kvw_bind_t;

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
} kvw_room_src_t;

typedef struct kvw_room {
    kvw_hnode_t hnode; /* in ctx->rooms, under the room's id */
    struct kvw_ctx *ctx;
    uint64_t id;
    bool is_sender;
    bool engine_owned; /* a handle exists (a prefill room can exist from a REQ alone) */
    kvw_room_state_t state;
    kvw_status_t status;
    char reason[320];
    uint64_t created_ns, deadline_ns, start_ns, end_ns;
    uint64_t bytes, runs;
    uint32_t inflight; /* worker jobs running on this room */
    bool quiesce_sent; /* prefill: told every decode rank it stopped writing */
    bool queued;
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

/* Stamps hop `h` of a room now (mu held); `first`: keep an earlier stamp. */
static inline void kvw__room_hop(kvw_room_t *r, kvw_hop_t h, bool first)
{
    if (!first || r->hop_ns[h] == 0)
        r->hop_ns[h] = kvw__now_ns();
}

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

#define KVW_TAG 16 /* bytes of a control frame's session tag */
#define KVW_MAX_OUT_BYTES (64u << 20) /* frames queued for one peer before it is dropped */

/* Decode side: one prefill instance, named by its bootstrap address. Connected on the
 * first room that names it (or at context creation for the context's own address),
 * cached, and connected again after it went down. */
enum { KVW_INST_CONNECTING = 0, KVW_INST_READY = 1, KVW_INST_DOWN = 2 };
#define KVW_MAX_INSTANCES 1024
typedef struct kvw_inst {
    char addr[128];
    uint32_t gen; /* bumped on every (re)connection; peers and rooms carry it */
    int state;
    char why[400]; /* why it went down */
} kvw_inst_t;
#define KVW_MAX_HANDSHAKES 64 /* registrations served at once (prefill) */

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
    _Atomic uint32_t q_gen;    /* bumped whenever a room is queued for the workers */
    _Atomic uint32_t done_gen; /* bumped whenever a room turns terminal */
    bool stopping;

    int listen_fd;
    uint16_t listen_port;
    int bs_fd; /* prefill: the connection that holds this rank's bootstrap entry */
    int wake_fd[2];
    kvw_peer_t **peers;
    uint32_t num_peers, cap_peers;

    kvw_hmap_t rooms; /* by id */
    kvw_room_t *q_head, *q_tail; /* prefill rooms with work for the worker */

    pthread_t ctrl_thread;
    pthread_t workers[16];
    uint32_t num_workers; /* started */
    bool ctrl_started;

    /* Staged path. Decode: the registered staging area and its allocations, kept sorted
     * by offset (first fit); requests that did not fit wait in FIFO order. */
    uint8_t *staging;
    uint64_t staging_len;
    bool staging_shared;
    bool staging_pinned; /* page-locked by `mem` for fast copies to the device */
    /* The memory kind of this rank's buffers, and their device (-1: host memory). */
    const kvw_memops_t *mem;
    int mem_dev;
    /* This rank's buffers are device memory on a host transport (tcp, shm, ucx): they
     * are gathered (prefill) or scattered (decode) on the device through host staging. */
    bool staged_dev;
    kvw_stage_span_t *spans;
    uint32_t num_spans, cap_spans;
    kvw_stage_wait_t *waits;
    uint32_t num_waits, cap_waits;
    int path_mode; /* 0 auto, 1 always direct, 2 always staged */
    /* Layer marks waiting on CUDA events, and the thread that polls them (started on
     * the first; see events.c). */
    struct kvw_evwatch *evw;
    uint32_t num_evw, cap_evw;
    pthread_t evw_thread;
    bool evw_started;
    pthread_cond_t evw_cv;
    uint64_t room_serial;
    char secret[256]; /* shared secret, "" when none */
    uint64_t instance_id;
    uint32_t handshakes; /* registration threads still running (prefill) */
    uint64_t refusals;       /* prefill: registrations refused, and the last reason */
    char last_refusal[480];
    /* Decode: prefill instances, the threads connecting to them, and what a
     * registration sends (keys of our buffers and staging area, data address). */
    kvw_inst_t *insts;
    uint32_t num_insts, cap_insts;
    uint32_t connecting;
    _Atomic bool cancel_connects;
    /* Decode: rooms that ended while their instance was still being connected; their
     * prefill ranks are told (ABORT) once it is. */
    struct kvw_late_abort *late;
    uint32_t num_late, cap_late;
    uint8_t *hello_rkeys;
    size_t *hello_rkey_lens;
    uint8_t hello_addr[KVW_TL_MAX_ADDR];
    size_t hello_addr_len;
    /* Prefill: the connections those threads serve. A connection that has not sent its
     * registration yet can be displaced by a new one when the slots are full. */
    struct {
        int fd; /* -1: free */
        uint64_t started_ns;
        bool heard;   /* its registration frame arrived */
        bool evicted; /* displaced: its thread is on its way out */
    } hs[2 * KVW_MAX_HANDSHAKES];
    kvw_bind_t *binds; /* decode: data connections bound to peers (see KVW_MSG_BIND) */
    uint32_t num_binds, cap_binds;
};

typedef struct kvw_late_abort {
    uint32_t inst, gen, dp;
    uint64_t room;
    kvw_status_t status;
    char reason[160];
} kvw_late_abort_t;

/* Decode: sends the ABORTs of rooms that ended while instance `inst` (generation `gen`)
 * was being connected, now that it is (connected) or drops them (not). mu held. */
void kvw__late_aborts_flush(struct kvw_ctx *ctx, uint32_t inst, uint32_t gen, bool connected);

/* Decode: the instance for a bootstrap address, added when new (-1: table full or out
 * of memory, message set). mu held. */
int kvw__inst_find_or_add(struct kvw_ctx *ctx, const char *addr);
/* Decode: makes sure instance `i` is connected or being connected (a down instance is
 * connected again); returns its state. mu held. */
int kvw__inst_use(struct kvw_ctx *ctx, uint32_t i);
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

/* Decode: grant or queue staging space (mu held); frees a span and serves waiters. */
void kvw__stage_ask(struct kvw_ctx *ctx, kvw_peer_t *peer, uint64_t room, uint64_t len);
void kvw__stage_free(struct kvw_ctx *ctx, uint64_t off);

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
kvw_room_t *kvw__room_new(struct kvw_ctx *ctx, uint64_t id, bool is_sender);
void kvw__room_unlink(struct kvw_ctx *ctx, kvw_room_t *room);
void kvw__room_free(kvw_room_t *room);
/* Fails a room (sticky) with a reason; tells peers when `notify` is set. mu held. */
void kvw__room_fail(struct kvw_ctx *ctx, kvw_room_t *room, kvw_status_t status, bool notify,
                    const char *fmt, ...) KVW_PRINTF(5, 6);
void kvw__room_advance(kvw_room_t *room, kvw_room_state_t state);

/* Queues a frame for a peer; the control thread sends it. mu held; takes w. */
void kvw__peer_send(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_wbuf_t *w);
void kvw__ctx_wake(struct kvw_ctx *ctx);
void kvw__peer_dead(struct kvw_ctx *ctx, kvw_peer_t *peer, kvw_status_t status,
                    const char *reason);

/* Frame handlers (mu held). */
void kvw__handle_frame(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, const uint8_t *p,
                       uint32_t len);
void kvw__check_timeouts(struct kvw_ctx *ctx, uint64_t now);
void *kvw__worker_main(void *arg);
void kvw__queue_room(struct kvw_ctx *ctx, kvw_room_t *room);

/* Prefill: handles a HELLO on a fresh connection (blocking, before polling it). */
kvw_status_t kvw__prefill_handshake(struct kvw_ctx *ctx, int fd, kvw_peer_t **peer_p);
/* Prefill: the registration frame of handshake connection `fd` arrived (takes mu). */
void kvw__handshake_heard(struct kvw_ctx *ctx, int fd);

/* Transport callbacks (decode). */
void kvw__on_notify(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len);
kvw_status_t kvw__check_write(void *arg, uint64_t room, uint64_t region, uint64_t off,
                              uint64_t len);
void kvw__on_ep_error(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason);

/* ------------------------------------------------------------ between the files above */

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

/* peer.c */

/* Tag of one control frame under a peer's session key: direction, sequence number,
 * frame type and payload. */
void kvw__frame_tag(const kvw_peer_t *peer, uint8_t dir, uint64_t seq, uint8_t type,
                    const uint8_t *payload, size_t n, uint8_t out[32]);

void kvw__peer_drop_out(kvw_peer_t *peer);

kvw_peer_t *kvw__peer_add(struct kvw_ctx *ctx, int fd);

/* Detaches the resources of every dead peer nothing refers to any more (mu held);
 * the caller releases the list with kvw__peer_res_release after unlocking. The peer's
 * small record stays (its id indexes the peer table). */
kvw_peer_res_t *kvw__peers_reap(struct kvw_ctx *ctx);

void kvw__peer_res_release(struct kvw_ctx *ctx, kvw_peer_res_t *list);

void kvw__peer_free(struct kvw_ctx *ctx, kvw_peer_t *p);

/* fail.c */

void kvw__send_room_msg(struct kvw_ctx *ctx, kvw_peer_t *peer, uint8_t type, uint64_t room,
                        kvw_status_t status, const char *reason);

/*
 * A failed prefill room tells its decode ranks, once no worker step runs on it any
 * more, that it will not write their pages again (ABORT_ACK). A decode rank destroying
 * a room waits for that before the engine may reuse the pages: one-sided transports
 * cannot be stopped by the receiver.
 */
void kvw__room_quiesce(struct kvw_ctx *ctx, kvw_room_t *r);

/* handshake.c */

/* Registers with one prefill rank; BUSY means this rank's previous registration is not
 * known dead there yet (a restart): back off and try again until the deadline. */
kvw_status_t kvw__decode_connect_retry(struct kvw_ctx *ctx, const kvw_bs_entry_t *e,
                                       uint32_t inst, uint32_t gen, uint64_t deadline);

void kvw__start_handshake(struct kvw_ctx *ctx, int fd);

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

/* ctrl.c */

void *kvw__ctrl_main(void *arg);

#endif
