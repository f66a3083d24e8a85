/*
 * kvwire transfer protocol: contexts (one per rank), senders (prefill) and receivers
 * (decode) per room, in the shape serving engines already use.
 *
 * A prefill instance exposes a bootstrap endpoint where its ranks register. Each
 * decode rank looks up the prefill ranks its routes need, connects to them and
 * registers (protocol version, model, parallel config, every buffer and its remote
 * key, transport address); the prefill rank answers ACCEPT or REJECT with a reason.
 * Every incompatibility is found there, before the first request.
 *
 * Per room: decode posts its destination pages; prefill sends chunks; decode reaches
 * SUCCESS only when every expected sender reported success and the byte counts match.
 * FAILED is sticky and carries a reason. Nothing waits forever: bootstrap, waiting for
 * the peer's half of a room and heartbeats all have timeouts.
 */
#ifndef KVWIRE_XFER_H
#define KVWIRE_XFER_H

#include <kvwire/kvwire.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvw_ctx *kvw_ctx_h;
typedef struct kvw_bootstrap *kvw_bootstrap_h;
typedef struct kvw_sender *kvw_sender_h;
typedef struct kvw_receiver *kvw_receiver_h;

typedef enum kvw_side { KVW_SIDE_PREFILL = 0, KVW_SIDE_DECODE = 1 } kvw_side_t;

/* Room states, monotonic; FAILED is reachable from every state and sticky. */
typedef enum kvw_room_state {
    KVW_ROOM_BOOTSTRAPPING = 0,
    KVW_ROOM_WAITING_FOR_INPUT = 1,
    KVW_ROOM_TRANSFERRING = 2,
    KVW_ROOM_SUCCESS = 3,
    KVW_ROOM_FAILED = 4
} kvw_room_state_t;

KVW_API const char *kvw_room_state_string(kvw_room_state_t state);

enum {
    KVW_CTX_FIELD_SIDE = 1u << 0,
    KVW_CTX_FIELD_RANK = 1u << 1,
    KVW_CTX_FIELD_TRANSPORT = 1u << 2,
    KVW_CTX_FIELD_BOOTSTRAP = 1u << 3,
    KVW_CTX_FIELD_HOST_BOOTSTRAP = 1u << 4,
    KVW_CTX_FIELD_LISTEN_HOST = 1u << 5,
    KVW_CTX_FIELD_TIMEOUTS = 1u << 6,
    KVW_CTX_FIELD_SECRET = 1u << 7,
    KVW_CTX_FIELD_PREFILL_SIZE = 1u << 8,
    KVW_CTX_FIELD_INSTANCE = 1u << 9,
    KVW_CTX_FIELD_BUSY_POLL = 1u << 10,
    KVW_CTX_FIELD_VERIFY = 1u << 11
};

#define KVW_CTX_FIELDS_ALL 0xfffull

typedef struct kvw_ctx_params {
    uint64_t field_mask; /* KVW_CTX_FIELD_*; SIDE and RANK are required */
    kvw_side_t side;
    kvw_rank_h rank;       /* this rank's KV cache; must outlive the context */
    const char *transport; /* "tcp" (default), "shm", "ucx" */
    /* "host:port" of the prefill instance's bootstrap endpoint; an IPv6 host in
     * brackets ("[::1]:8998", "[fe80::1%eth0]:8998"). Optional on decode contexts whose
     * rooms all name their instance (kvw_receiver_create_from). */
    const char *bootstrap_addr;
    /* Prefill only: run the bootstrap endpoint inside this context, listening on
     * bootstrap_addr (port 0 picks one; kvw_ctx_bootstrap_addr tells which). */
    int host_bootstrap;
    /* Address the control and data listeners bind (IPv4 or IPv6, such as "::1" or "::",
     * brackets optional; advertised in brackets); default 127.0.0.1. */
    const char *listen_host;
    /* KVW_CTX_FIELD_TIMEOUTS: the four below. Each is read on its own: 0 in a field (or
     * the bit clear, then all four) keeps that field's default, so all-zero timeouts are
     * the defaults; no timeout can be turned off. */
    uint32_t heartbeat_ms;    /* interval of the heartbeats to every peer; default 200 */
    uint32_t peer_timeout_ms; /* a peer silent this long is dead; default 3000 */
    /* The longest kvw_ctx_create waits, in all: a decode for every prefill rank of its
     * instance at the bootstrap and for its registrations with them, a prefill rank for
     * its registration at the bootstrap; default 10000 */
    uint32_t bootstrap_timeout_ms;
    uint32_t wait_timeout_ms; /* a room waiting for its peer's half fails; default 30000 */
    /* Optional shared secret proven at the handshake; it also signs this prefill rank's
     * bootstrap registration, and a decode refuses bootstrap entries not signed with it. */
    const char *secret;
    /* Decode only (KVW_CTX_FIELD_PREFILL_SIZE): the prefill instance's TP, PP and DP
     * sizes, whose ranks kvw_ctx_create waits for at the bootstrap. Each is read on its
     * own: 0 in a field (or the bit clear, then all three) takes that size from the
     * ranks registered at the bootstrap, which must all declare the same geometry; the
     * context then waits until every rank of the declared geometry registered. A size
     * given that differs from the declared one fails with INCOMPATIBLE (naming both),
     * without waiting for the timeout. */
    uint32_t prefill_tp, prefill_pp, prefill_dp;
    /* Decode only: identifies the decode instance this rank belongs to. Every rank of
     * one decode instance passes the same value; when several decode instances share a
     * prefill instance, each needs its own (default 0). */
    uint64_t instance_id;
    /* Busy polling, for latency-critical deployments: the context's control thread, its
     * prefill workers and callers of kvw_room_wait spin this many microseconds for the next
     * event before they sleep. Each spinning thread costs a CPU core while it spins; 0
     * (default; also KVW_BUSY_POLL_US) sleeps at once, woken by the event itself. */
    uint32_t busy_poll_us;
    /* End-to-end KV verification (KVW_CTX_FIELD_VERIFY; NULL or the bit clear: the
     * KVW_VERIFY variable, default "off"): "off", "every" or "sample:F" (a fraction F of
     * rooms in [0, 1], chosen by room id). Decided by the decode, per room, and carried in
     * its request: the prefill computes what each room's request asks for. A verified
     * room reaches SUCCESS only if every decode rank's digest of its destination pages
     * equals the prefill ranks' digests of their source pages (a 64-bit sum of seeded
     * row hashes per layer, component and KV head: README "Verified rooms"); a mismatch
     * fails the room on both sides, the reason naming layer, component, head and
     * tokens. Host memory only: a context on GPU buffers refuses any mode but "off"
     * (UNSUPPORTED), and a prefill rank on GPU buffers fails the rooms that ask. */
    const char *verify;
} kvw_ctx_params_t;

/*
 * Creates a rank's context and starts its progress thread. Prefill: starts the
 * control and data listeners and registers with the bootstrap endpoint. Decode:
 * waits for the prefill ranks at the bootstrap, connects and registers with every
 * prefill rank its routes need; returns REJECTED with the prefill's reason (in
 * kvw_last_error) if any refuses. Errors: INVALID_PARAM, TIMEOUT, REJECTED, AUTH, IO.
 */
KVW_API kvw_status_t kvw_ctx_create(const kvw_ctx_params_t *params, kvw_ctx_h *ctx_p);

/* Fails every open room with "context destroyed", stops threads, frees everything. */
KVW_API void kvw_ctx_destroy(kvw_ctx_h ctx);

/* Transports this library can open by name (built in, or a module it found), as a
 * NULL-terminated list: "tcp", "shm", "ucx", "cuda_ipc", ... */
KVW_API const char *const *kvw_transport_names(void);

enum {
    KVW_CONFIG_VAR_FIELD_NAME = 1u << 0,
    KVW_CONFIG_VAR_FIELD_DEFAULT_VALUE = 1u << 1,
    KVW_CONFIG_VAR_FIELD_HELP = 1u << 2
};
#define KVW_CONFIG_VAR_FIELDS_ALL 0x7ull

/* One setting kvwire reads from the environment: its name, default and meaning. A
 * report: the library sets field_mask to the fields it filled. */
typedef struct kvw_config_var {
    uint64_t field_mask; /* KVW_CONFIG_VAR_FIELD_* */
    const char *name, *default_value, *help;
} kvw_config_var_t;

/* Every environment setting kvwire reads; *count_p gets how many. */
KVW_API const kvw_config_var_t *kvw_config_vars(size_t *count_p);

/* The bootstrap endpoint this context hosts ("host:port"), or NULL. */
KVW_API const char *kvw_ctx_bootstrap_addr(kvw_ctx_h ctx);

/* Prefill: how many decode registrations this context refused (incompatible model or
 * layout, wrong secret, malformed...), and the reason of the last one, copied into buf
 * ("" when none). The refused decode rank gets the same reason. */
KVW_API uint64_t kvw_ctx_refusals(kvw_ctx_h ctx, char *buf, size_t cap);

/*
 * Metrics: what a context did since it was created, for operators (Prometheus, logs).
 * Counters only grow; gauges (rooms_in_state, staging_in_use, peers_connected) go up and
 * down. Bytes are payload bytes: a prefill context counts what it sent, a decode context
 * what landed and was confirmed, each room's bytes once (the room's kvw_room_metrics
 * bytes add up to them). Failures are counted by the failed room's status (the one
 * kvw_room_status returns), at index -status of rooms_failed_by_status.
 *
 * Latency: from the room's post (decode: kvw_receiver_post; prefill: the last decode rank's pages
 * arrived, KVW_HOP_REQ_RX; the room's creation when neither happened) to Success, in a
 * histogram of KVW_CTX_METRICS_LATENCY_BUCKETS fixed buckets whose bounds are powers of
 * two microseconds: bucket i counts the rooms whose latency was below 2^i us and at least
 * 2^(i-1) us (bucket 0: below 1 us); the last bucket also takes everything longer. Each
 * Success adds one room to exactly one bucket, so the buckets add up to rooms_succeeded
 * and a percentile is read as the upper bound of the bucket where the running sum crosses
 * it (at most a factor of two high).
 */
#define KVW_CTX_METRICS_STATUS_SLOTS 64   /* rooms_failed_by_status[-status] */
#define KVW_CTX_METRICS_LATENCY_BUCKETS 32
#define KVW_CTX_METRICS_ACTIVE_STATES 3   /* Bootstrapping, WaitingForInput, Transferring */

enum {
    KVW_CTX_METRICS_FIELD_SIDE = 1u << 0,
    KVW_CTX_METRICS_FIELD_TRANSPORT = 1u << 1,
    KVW_CTX_METRICS_FIELD_ROOMS_IN_STATE = 1u << 2,
    KVW_CTX_METRICS_FIELD_ROOMS_SUCCEEDED = 1u << 3,
    KVW_CTX_METRICS_FIELD_ROOMS_FAILED = 1u << 4,
    KVW_CTX_METRICS_FIELD_ROOMS_FAILED_BY_STATUS = 1u << 5,
    KVW_CTX_METRICS_FIELD_BYTES_DIRECT = 1u << 6,
    KVW_CTX_METRICS_FIELD_BYTES_STAGED = 1u << 7,
    KVW_CTX_METRICS_FIELD_LATENCY_US_BUCKETS = 1u << 8,
    KVW_CTX_METRICS_FIELD_LATENCY_US_SUM = 1u << 9,
    KVW_CTX_METRICS_FIELD_STAGING_CAPACITY = 1u << 10,
    KVW_CTX_METRICS_FIELD_STAGING_IN_USE = 1u << 11,
    KVW_CTX_METRICS_FIELD_STAGING_HIGH_WATER = 1u << 12,
    KVW_CTX_METRICS_FIELD_PEERS_CONNECTED = 1u << 13,
    KVW_CTX_METRICS_FIELD_PEERS_DIED = 1u << 14,
    KVW_CTX_METRICS_FIELD_ROOMS_VERIFIED = 1u << 15,
    KVW_CTX_METRICS_FIELD_ROOMS_VERIFY_SKIPPED = 1u << 16,
    KVW_CTX_METRICS_FIELD_ROOMS_VERIFY_FAILED = 1u << 17
};
#define KVW_CTX_METRICS_FIELDS_ALL 0x3ffffull

/* Output: the caller sets field_mask to the fields it wants; kvw_ctx_metrics fills
 * exactly those, leaves the others untouched, and keeps field_mask as it was. */
typedef struct kvw_ctx_metrics {
    uint64_t field_mask; /* KVW_CTX_METRICS_FIELD_* wanted */
    kvw_side_t side;
    const char *transport; /* the context's transport ("tcp", "shm", ...); static storage */
    /* Rooms not finished, by state (index: kvw_room_state_t). */
    uint64_t rooms_in_state[KVW_CTX_METRICS_ACTIVE_STATES];
    uint64_t rooms_succeeded, rooms_failed; /* finished, by outcome */
    /* Failed rooms by status: index -status (KVW_ERR_ABORTED: 21, KVW_ERR_TIMEOUT: 20, see
     * KVW_STATUS_TABLE); index 0 takes any status outside the table's range. */
    uint64_t rooms_failed_by_status[KVW_CTX_METRICS_STATUS_SLOTS];
    /* Payload bytes by path: direct (one put per run, or a kernel writing mapped device
     * buffers) and staged (through the decode's staging area). */
    uint64_t bytes_direct, bytes_staged;
    uint64_t latency_us_buckets[KVW_CTX_METRICS_LATENCY_BUCKETS]; /* post to Success */
    uint64_t latency_us_sum; /* microseconds, over every room counted in the buckets */
    /* Decode: the staging area's size, the bytes granted to rooms now, and the most
     * granted at once (0 on a prefill context and without a staging area). */
    uint64_t staging_capacity, staging_in_use, staging_high_water;
    /* Peers registered and alive now (decode: prefill ranks; prefill: decode ranks), and
     * peers declared dead since the context was created. */
    uint64_t peers_connected, peers_died;
    /* Decode, KV verification (kvw_ctx_params_t.verify): rooms whose digests matched
     * (each also counts in rooms_succeeded), rooms that succeeded unverified because
     * sampling left them out, and rooms failed by a digest mismatch (also in rooms_failed,
     * status BYTE_MISMATCH). 0 on a prefill context. */
    uint64_t rooms_verified, rooms_verify_skipped, rooms_verify_failed;
} kvw_ctx_metrics_t;

/*
 * Fills the fields metrics_p->field_mask asks for. Cheap and lock-free: it reads
 * counters that the library keeps with atomic operations, never taking the context's
 * lock, so it may be called at any rate from any thread. Each field is read atomically,
 * but the fields are not one snapshot: a room that moves during the call may be seen in
 * two places or none. Errors: INVALID_PARAM (NULL argument, bits unknown to this
 * library).
 */
KVW_API kvw_status_t kvw_ctx_metrics(kvw_ctx_h ctx, kvw_ctx_metrics_t *metrics_p);

/*
 * A standalone bootstrap endpoint ("address:port"; port 0 picks one): prefill ranks
 * register there (contexts with host_bootstrap = 0 and this bootstrap_addr), decode
 * ranks look their instance up. It runs on its own thread until stopped and outlives
 * the ranks: a restarted rank registers again and replaces its entry; a registration
 * that declares another instance geometry replaces the whole instance. To refuse
 * registrations not signed with the ranks' shared secret, start it with
 * kvw_bootstrap_start_ex.
 */
KVW_API kvw_status_t kvw_bootstrap_start(const char *addr, kvw_bootstrap_h *bootstrap_p);

enum {
    KVW_BOOTSTRAP_FIELD_ADDR = 1u << 0,
    KVW_BOOTSTRAP_FIELD_SECRET = 1u << 1
};
#define KVW_BOOTSTRAP_FIELDS_ALL 0x3ull

typedef struct kvw_bootstrap_params {
    uint64_t field_mask; /* KVW_BOOTSTRAP_FIELD_*; ADDR is required */
    const char *addr;    /* "address:port" or "[IPv6 address]:port"; port 0 picks one */
    /* The shared secret of the ranks that register here (NULL or "": none). With it, the
     * endpoint refuses (AUTH, with a reason) any registration without a valid MAC. */
    const char *secret;
} kvw_bootstrap_params_t;

/* kvw_bootstrap_start with parameters. Errors: INVALID_PARAM, IO. */
KVW_API kvw_status_t kvw_bootstrap_start_ex(const kvw_bootstrap_params_t *params,
                                            kvw_bootstrap_h *bootstrap_p);
KVW_API const char *kvw_bootstrap_address(kvw_bootstrap_h bootstrap);
KVW_API void kvw_bootstrap_stop(kvw_bootstrap_h bootstrap);

/* ---------------------------------------------------------------- prefill side */

/* Creates the sender of `room`. Errors: BUSY (room already open here). */
KVW_API kvw_status_t kvw_sender_create(kvw_ctx_h ctx, uint64_t room, kvw_sender_h *sender_p);

/* One chunk: token range, the pages holding it on this rank, and whether it is the
 * last (the last chunk also carries the SWA window and state slots). The page arrays
 * are copied; the KV bytes must stay in place until the room leaves TRANSFERRING. In
 * GPU memory they must also be written when the chunk is queued: kvwire's streams do
 * not wait for the engine's, so an engine that has not synchronized its forward pass
 * queues the chunk with kvw_sender_send_streamed and marks its layers with
 * kvw_sender_layers_ready_event on an event recorded after the writes. */
enum {
    KVW_SEND_CHUNK_FIELD_NUM_TOKENS = 1u << 0,  /* required */
    KVW_SEND_CHUNK_FIELD_CHUNK_BEGIN = 1u << 1, /* default 0 */
    KVW_SEND_CHUNK_FIELD_CHUNK_END = 1u << 2,   /* default num_tokens */
    KVW_SEND_CHUNK_FIELD_LAST_CHUNK = 1u << 3,  /* default: chunk_end == num_tokens */
    KVW_SEND_CHUNK_FIELD_PAGES = 1u << 4        /* required */
};
#define KVW_SEND_CHUNK_FIELDS_ALL 0x1full

typedef struct kvw_send_chunk {
    uint64_t field_mask; /* KVW_SEND_CHUNK_FIELD_* */
    uint64_t num_tokens;
    uint64_t chunk_begin, chunk_end;
    int last_chunk;
    kvw_side_pages_t pages;
} kvw_send_chunk_t;

KVW_API kvw_status_t kvw_sender_send(kvw_sender_h sender, const kvw_send_chunk_t *chunk);

/*
 * Layer-wise streaming: the KV of a chunk leaves layer by layer while the forward pass
 * still computes the next layers. kvw_sender_send_streamed queues a chunk (as
 * kvw_sender_send) none of whose layers is ready yet; kvw_sender_layers_ready marks the
 * global layers [layer_begin, layer_end) of the room's latest streamed chunk ready, and
 * the workers send each decode rank those layers at once, in their own step (staged
 * windows are formed per layer group). Layers may be marked in any order and in ranges
 * of any size; marking a layer again does nothing (idempotent). The decode's rule is
 * unchanged: Success only once every layer of every chunk arrived, byte-exact. A room
 * whose layers are not all marked fails when its wait timeout passes without progress,
 * naming the layers missing. The next chunk (streamed or not) may be queued only once
 * every layer of the streamed one was marked. Errors: INVALID_PARAM (an empty range,
 * layers outside this rank's pipeline stage, no streamed chunk, the previous streamed
 * chunk incomplete), the room's status once it failed (an abort stops the stream).
 */
KVW_API kvw_status_t kvw_sender_send_streamed(kvw_sender_h sender, const kvw_send_chunk_t *chunk);
KVW_API kvw_status_t kvw_sender_layers_ready(kvw_sender_h sender, uint32_t layer_begin,
                                             uint32_t layer_end);
/*
 * For GPU engines: the layers [layer_begin, layer_end) of the latest streamed chunk
 * become ready when `cuda_event` (a cudaEvent_t the engine recorded on its forward
 * stream after writing those layers' KV) completes. Returns at once: neither the
 * engine's stream nor the host waits. A thread of the context polls the event
 * (cudaEventQuery) and marks the layers as kvw_sender_layers_ready does; an event that
 * never completes leaves them unmarked, and the room fails at its wait timeout naming
 * the layers and the event. The event must stay valid until the room ends. Errors as
 * kvw_sender_layers_ready, plus UNSUPPORTED without the CUDA module, NO_MEMORY.
 */
KVW_API kvw_status_t kvw_sender_layers_ready_event(kvw_sender_h sender, uint32_t layer_begin,
                                                   uint32_t layer_end, void *cuda_event);

/* Largest per-room metadata payload. */
#define KVW_MAX_ROOM_METADATA (64u << 10)

/*
 * Attaches an opaque payload to the room (what engines call "aux" data: the first
 * output token, logprobs, hidden states for speculative decoding), 0..
 * KVW_MAX_ROOM_METADATA bytes, copied. Call it before the last chunk is sent (a streamed
 * last chunk: before its last layer is marked ready); calling it again replaces the
 * payload. Every decode rank this prefill rank writes receives
 * it, and reaches Success only once it did (fail-closed, like the KV bytes). Errors:
 * INVALID_PARAM (after the last chunk, or too long).
 */
KVW_API kvw_status_t kvw_sender_set_metadata(kvw_sender_h sender, const void *data, size_t len);

/* ---------------------------------------------------------------- decode side */

/* Creates the receiver of `room`, fed by the prefill DP group `prefill_dp_rank` of the
 * context's own prefill instance (its bootstrap_addr). */
KVW_API kvw_status_t kvw_receiver_create(kvw_ctx_h ctx, uint64_t room, uint32_t prefill_dp_rank,
                                         kvw_receiver_h *receiver_p);

/*
 * The same, from the prefill instance whose bootstrap endpoint is `bootstrap_addr`
 * ("host:port"; NULL or "": the context's own). One decode context serves any number
 * of prefill instances: the first room that names an instance starts connecting to it
 * in the background (bootstrap lookup, registration with every rank) without blocking
 * the caller; the room stays Bootstrapping meanwhile and a post made then is sent once
 * the connection is up. The connection is cached per address. An instance that cannot
 * be reached, or whose registration is refused, fails the rooms waiting for it with the
 * reason; an instance with a dead rank fails only its own rooms, and the next room that
 * names it connects again (a restarted instance). Sizes (TP, PP, DP) are taken from what
 * the instance's ranks declare.
 */
KVW_API kvw_status_t kvw_receiver_create_from(kvw_ctx_h ctx, uint64_t room,
                                              const char *bootstrap_addr,
                                              uint32_t prefill_dp_rank,
                                              kvw_receiver_h *receiver_p);

enum {
    KVW_RECV_POST_FIELD_NUM_TOKENS = 1u << 0, /* required */
    KVW_RECV_POST_FIELD_PREFIX_LEN = 1u << 1, /* default 0 */
    KVW_RECV_POST_FIELD_PAGES = 1u << 2       /* required */
};
#define KVW_RECV_POST_FIELDS_ALL 0x7ull

typedef struct kvw_recv_post {
    uint64_t field_mask; /* KVW_RECV_POST_FIELD_* */
    uint64_t num_tokens;
    uint64_t prefix_len; /* tokens this rank already holds; they are not sent */
    kvw_side_pages_t pages;
} kvw_recv_post_t;

/* Tells the prefill ranks where to write. Page arrays are copied. */
KVW_API kvw_status_t kvw_receiver_post(kvw_receiver_h receiver, const kvw_recv_post_t *post);

/*
 * The room's metadata (see kvw_sender_set_metadata), once the room reached Success:
 * copies it to buf and sets *len_p (0: the prefill attached none). When several
 * prefill ranks attached metadata, they must agree byte for byte, or the room fails.
 * Errors: INPROGRESS (not Success yet), the room's status (Failed), BUFFER_TOO_SMALL
 * (*len_p tells the size needed).
 */
KVW_API kvw_status_t kvw_receiver_metadata(kvw_receiver_h receiver, void *buf, size_t cap,
                                           size_t *len_p);

/* ---------------------------------------------------------------- both sides */

/* The hops of a room, in the order they happen; each side stamps its own (monotonic
 * clock, CLOCK_MONOTONIC, comparable between processes of one host; 0: not reached on
 * this side). Where a hop repeats (several chunks or decode ranks) the last one counts,
 * except KVW_HOP_WORKER, the first. */
typedef enum kvw_hop {
    KVW_HOP_POST = 0,  /* decode: kvw_receiver_post sent the room's pages */
    KVW_HOP_REQ_RX,    /* prefill: a decode rank's pages arrived */
    KVW_HOP_SEND,      /* prefill: the engine handed over the last chunk */
    KVW_HOP_WORKER,    /* prefill: a worker took the room */
    KVW_HOP_BYTES_OUT, /* prefill: bytes and completion handed to the transport */
    KVW_HOP_DONE_RX,   /* decode: a prefill rank's completion arrived */
    KVW_HOP_ACK_RX,    /* prefill: a decode rank confirmed every byte landed */
    KVW_HOP_SUCCESS,   /* either side: the room reached Success */
    KVW_HOP_COUNT
} kvw_hop_t;

enum {
    KVW_ROOM_METRICS_FIELD_BYTES = 1u << 0,
    KVW_ROOM_METRICS_FIELD_RUNS = 1u << 1,
    KVW_ROOM_METRICS_FIELD_START_NS = 1u << 2,
    KVW_ROOM_METRICS_FIELD_END_NS = 1u << 3,
    KVW_ROOM_METRICS_FIELD_PATH = 1u << 4,
    KVW_ROOM_METRICS_FIELD_HOP_NS = 1u << 5
};
#define KVW_ROOM_METRICS_FIELDS_ALL 0x3full

/* Output: the caller sets field_mask to the fields it wants; kvw_room_metrics fills
 * exactly those, leaves the others untouched, and keeps field_mask as it was. */
typedef struct kvw_room_metrics {
    uint64_t field_mask;   /* KVW_ROOM_METRICS_FIELD_* wanted */
    uint64_t bytes;        /* payload bytes sent (prefill) or confirmed (decode) */
    uint64_t runs;         /* coalesced runs posted (prefill) */
    uint64_t start_ns, end_ns; /* monotonic clock: first data moved, terminal state */
    const char *path;      /* "direct", "staged" or "none" (static storage) */
    uint64_t hop_ns[KVW_HOP_COUNT]; /* see kvw_hop_t */
} kvw_room_metrics_t;

/*
 * One room handle serves both sides: kvw_sender_room and kvw_receiver_room give the
 * room of a sender or a receiver (NULL for NULL), and the calls below work on either.
 * The room handle is the same object as the sender or receiver handle it came from:
 * it stays valid exactly as long, and kvw_room_destroy ends both.
 */
typedef struct kvw_room *kvw_room_h;

KVW_API kvw_room_h kvw_sender_room(kvw_sender_h sender);
KVW_API kvw_room_h kvw_receiver_room(kvw_receiver_h receiver);

/* The room's id as passed to kvw_sender_create / kvw_receiver_create (0 for NULL), and
 * its side: KVW_SIDE_PREFILL for a sender's room, KVW_SIDE_DECODE for a receiver's. */
KVW_API uint64_t kvw_room_id(kvw_room_h room);
KVW_API kvw_side_t kvw_room_side(kvw_room_h room);

/* Never blocks. NULL: FAILED. */
KVW_API kvw_room_state_t kvw_room_poll(kvw_room_h room);

/* Blocks until the room is terminal (Success or Failed) or timeout_ms passed, woken by
 * the state change itself (no polling); returns the state then. timeout_ms 0: poll. */
KVW_API kvw_room_state_t kvw_room_wait(kvw_room_h room, uint32_t timeout_ms);

/* Why the room failed ("" unless FAILED). Valid until the room is destroyed. */
KVW_API const char *kvw_room_failure(kvw_room_h room);

/* OK once Success, INPROGRESS before, the failure's status once Failed. */
KVW_API kvw_status_t kvw_room_status(kvw_room_h room);

/* Fills the fields metrics_p->field_mask asks for (see kvw_room_metrics_t). Errors:
 * INVALID_PARAM (NULL argument, bits unknown to this library). */
KVW_API kvw_status_t kvw_room_metrics(kvw_room_h room, kvw_room_metrics_t *metrics_p);

/* Aborts the room locally and tells the peers; they stop and acknowledge. */
KVW_API void kvw_room_abort(kvw_room_h room);

/* Destroys the room and with it the sender or receiver handle it came from. Destroying
 * a room that is not terminal aborts it first. A decode room is destroyed only once no
 * prefill rank can still write its pages (each confirmed it stopped, or was declared
 * dead, or the peer timeout passed), so the engine may reuse them at once. */
KVW_API void kvw_room_destroy(kvw_room_h room);

#ifdef __cplusplus
}
#endif

#endif
