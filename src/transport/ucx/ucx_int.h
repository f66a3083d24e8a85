/*
 * The ucx transport: writes through UCX (UCP), between hosts over whatever UCX drives
 * there (tcp here; RDMA where present) and between processes on one host.
 *
 * One ucp_context and one ucp_worker (UCS_THREAD_MODE_MULTI) per instance, with
 * UCP_FEATURE_AM for data and control (and UCP_FEATURE_RMA on the "rma" path only), and
 * UCP_FEATURE_WAKEUP for the progress thread's event fd. mem_reg packs a key with the
 * region's base, length and id and the instance token; on "rma" it also maps the
 * caller's memory with ucp_mem_map and adds the packed UCX rkey.
 *
 * Two data paths (KVW_UCX_PUT), read by every instance at init; both sides must agree
 * (an "rma" sender cannot unpack the key of an "am" receiver, and says so).
 *  - "am" (default): one DATA active message per write. UCX sends small ones eagerly
 *    and the receiver copies them into place; large ones go by rendezvous and are
 *    received straight into place (ucp_am_recv_data_nbx: zero-copy, RDMA reads where
 *    the fabric has them). The receiver mediates every write (KVW_TL_CAP_MEDIATED):
 *    it checks it against its registered regions, then asks cb.check_write (with the
 *    room the message names and the connection) before a byte lands, eager or
 *    rendezvous; a refused write lands nowhere (a rendezvous one is received into scratch,
 *    up to UCX_DISCARD_MAX at once) and the connection stays. It drops the
 *    writes of a connection that failed, and reports that failure only once its
 *    rendezvous receives have ended, so nothing of a dead or misbehaving sender lands
 *    after on_ep_error. A NOTIFY is delivered only after the receives of its
 *    connection's earlier writes ended (a sender that notifies without flushing gets
 *    no earlier notice), and a queued NOTIFY is delivered before the worker handles
 *    what arrived after it. Without UCP_FEATURE_RMA and without UCX keys, no peer can
 *    write this process's memory one-sided.
 *  - "rma": ucp_put_nbx into the rkey, truly one-sided where UCX has RMA lanes for the
 *    memory (RDMA fabrics). UCX 1.13 emulates such puts in software on every transport
 *    of this machine, and its emulation aborts the target process (ucs_fatal in
 *    ucp_progress_rma_cmpl) when the initiator dies with puts in flight; nor can a
 *    receiver see, refuse or stop these writes: check_write is never called for them
 *    and the caps lack MEDIATED (any peer holding a key can write anywhere in that
 *    region). Hence "am" by default; use "rma" only where UCX has native RMA lanes and
 *    the peers are trusted.
 * On both, put() checks every write against the rkey's region (OUT_OF_RANGE, nothing
 * moved) and returns once every request completed locally, so the caller may reuse
 * the source memory. Overlapping writes land in the order they were posted: a write
 * that may overlap an earlier one of the same call waits for the requests in flight
 * ("am"; eager messages are applied in the order sent) or is preceded by
 * ucp_worker_fence ("rma", which also fences at the start of every call). notify()
 * flushes the endpoint (ucp_ep_flush_nbx) before it sends the NOTIFY message.
 *
 * Progress. The target must call ucp_worker_progress for emulated puts, rendezvous
 * and control messages, so each instance runs one progress thread. It sleeps on the
 * worker's event fd (ucp_worker_arm) and an eventfd of ours, at most UCX_POLL_MS at a
 * time, and stays off the worker while a caller progresses it (put, notify and
 * connect wait on their requests by progressing the worker themselves).
 *
 * Control messages are active messages on one AM id, always eager (whole and in
 * order), with a fixed header (see ucx_hdr_put) naming the instance token of destination
 * and source; anything else is dropped, and a receiver takes messages for a
 * connection only from the token and endpoint that opened it.
 *   sender -> receiver: HELLO (opens a connection), DATA, NOTIFY, RKEY_REQ (rkey_unpack
 *     asks whether the region is still registered with that base and length), PING
 *     (every UCX_HB_MS from the sender's progress thread), BYE (ep_close).
 *   receiver -> sender, on the reply endpoint from inside the AM callback: HELLO_ACK,
 *     RKEY_REP, and CLOSED (the answer to anything for a connection the receiver
 *     closed or does not know).
 * The receiver holds no UCX endpoints of its own: an endpoint it created back to a
 * sender gets matched with that sender's connection, and UCX 1.13 aborts when an
 * emulated put arrives on a failed endpoint that the user has not closed yet. The
 * endpoints UCX creates for incoming connections are destroyed by UCX when they fail.
 * So a receiver learns that a sender died from a failed rendezvous receive, from BYE,
 * or from UCX_HB_DEAD_MS without any message (heartbeat; a stall of the receiver's own
 * progress thread does not count).
 *
 * Callbacks. UCX callbacks (AM handlers, endpoint error handlers) may run in any
 * thread that progresses the worker, including a caller inside put(). They only look
 * up state under tl->mu, copy eager data, start receives, queue work, answer on the
 * reply endpoint and wake the progress thread, which alone calls on_notify and
 * on_ep_error, outside UCX callbacks, so user callbacks may call put, notify and
 * connect. Only the progress thread (and fini) frees endpoints. Locks: ep->rw, then
 * tl->mu, then tl->reg_mu; none is held across a call that progresses the worker.
 *
 * Failures. Endpoints use UCP_ERR_HANDLING_MODE_PEER (KVW_UCX_ERR_MODE=none turns it
 * off; both ends must agree): UCX reports a dead receiver to the sender's endpoint
 * (on_ep_error; put and notify fail with CONN_CLOSED). UCX 1.13 allows only tcp lanes
 * in this mode (its shared-memory transports cannot detect a dead peer), which costs
 * bandwidth on one host; with "none" UCX uses shared memory, but a dead receiver is
 * then only noticed through timeouts, and UCX does not survive some peer failures.
 * Every wait has a deadline (params.timeout_ms, else KVW_UCX_TIMEOUT_MS, else 10 s,
 * restarted by each completion in long put batches). A put or notify that times out,
 * or that close() interrupts (SHUTDOWN), force-closes the UCX endpoint before it
 * returns, which completes the requests in flight, so UCX no longer reads the
 * caller's buffers. A graceful close says BYE, flushes for at most UCX_GOODBYE_MS and
 * then force-closes: UCX 1.13 asserts when a worker is destroyed while an endpoint
 * still has requests.
 *
 * Confinement. On "am" the receiver refuses writes outside its registered regions
 * (on_ep_error OUT_OF_RANGE) and whatever check_write refuses (pages the room was not
 * granted, a connection not bound to the room's source). On "rma" it can do neither:
 * as for shm, only the sending library confines every write to the registered region
 * of its rkey, and the sending side's protocol to the pages granted to the room. A deregistered region cannot
 * be unpacked by a new endpoint; on "rma" a sender that already holds its rkey could
 * still write to it, so the protocol must stop granting pages of a region before
 * deregistering it.
 *
 * Limits. UCX itself prints warnings and errors to stderr (its own logger,
 * UCX_LOG_LEVEL). A worker address must fit KVW_TL_MAX_ADDR with our 16-byte header;
 * when it does not, init retries with UCX's compact address format (v2).
 *
 * Files, top down: ucx_iface.c (context and worker, progress thread, init and teardown,
 * the ops table), ucx_am.c (the active-message dispatcher), ucx_put.c (the data paths
 * and notify), ucx_mem.c (regions and remote keys), ucx_conn.c (endpoints, control
 * messages, connect and close), ucx_util.c (header, status mapping, waits); each calls
 * only the files below it. module.c is the module's entry point. This header holds what they share: the wire format, the
 * structures and the functions one file calls in another.
 */
#ifndef KVW_TRANSPORT_UCX_UCX_INT_H
#define KVW_TRANSPORT_UCX_UCX_INT_H

#include "transport/tl_base.h"
#include "transport/tl_util.h"

#include <ucp/api/ucp.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(size_t) == sizeof(uint64_t), "lengths are passed to UCX as size_t");

#define UCX_VERSION 2 /* 2: keys of "am" receivers carry no UCX key */
#define UCX_ADDR_MAGIC 0x4155564bu /* "KVUA" */
#define UCX_RKEY_MAGIC 0x5255564bu /* "KVUR" */
#define UCX_MSG_MAGIC 0x4d55564bu  /* "KVUM" */
#define UCX_ADDR_HDR 16
#define UCX_RKEY_HDR 48
#define UCX_MSG_HDR 72
#define UCX_AM_ID 7
#define UCX_MAX_PEER_ADDR 16384 /* largest worker address connect accepts */
#define UCX_DEFAULT_TIMEOUT_MS 10000
#define UCX_POLL_MS 100           /* longest sleep of the progress thread */
#define UCX_HB_MS 500             /* a sender pings each connection this often */
#define UCX_HB_DEAD_MS 3000       /* silence after which a sender counts as gone */
#define UCX_INFLIGHT 256          /* put requests in flight per call before waiting */
#define UCX_INFLIGHT_BYTES (64ull << 20) /* ... and bytes: bounds what queues ahead of a PING */
#define UCX_FENCE_SLOTS 8         /* rkeys whose order put() tracks within one call */
#define UCX_MAX_ACCEPTED 4096     /* accepted connections at once; more HELLOs go unanswered */
#define UCX_CLOSE_MS 2000         /* cap on waiting for one endpoint close */
#define UCX_GOODBYE_MS 1000       /* cap on sending BYE when the instance closes */

/*
 * Address: u32 magic | u8 version | 3 zero | u64 token, then the UCX worker address.
 * Rkey: u32 magic | u8 version | 3 zero | u64 token | u64 region | u64 base | u64 len
 *   | u32 UCX rkey length | u32 zero, then the packed UCX rkey.
 * Message header (72 bytes): u32 magic | u8 version | u8 type | u16 zero | u64 to
 *   (destination token) | u64 from (source token) | u64 a | b | c | d | e | f.
 *   Sender -> receiver: a = the receiver's id for the connection (0 in HELLO), b = the
 *   sender's endpoint id, then HELLO c = sender pid; RKEY_REQ c = request id, d = region,
 *   e = base, f = length; DATA c = region, d = offset, e = room, with the bytes as data
 *   (eager or rendezvous). NOTIFY carries the notification as data; PING and BYE
 *   nothing more.
 *   Receiver -> sender: a = the sender's endpoint id, then HELLO_ACK b = the receiver's
 *   id for the connection; RKEY_REP b = request id, c = status (kvw_status_t, i32).
 */
enum {
    MSG_HELLO = 1,
    MSG_HELLO_ACK = 2,
    MSG_NOTIFY = 3,
    MSG_BYE = 4,
    MSG_RKEY_REQ = 5,
    MSG_RKEY_REP = 6,
    MSG_CLOSED = 7,
    MSG_PING = 8,
    MSG_DATA = 9
};

typedef struct msg_hdr {
    uint8_t type;
    uint64_t to, from, a, b, c, d, e, f;
} msg_hdr_t;

typedef struct ucx_iface ucx_iface_t;

typedef struct ucx_region {
    kvw_hnode_t node; /* in tl->regions, under id */
    uint64_t id, base, len;
    ucp_mem_h memh;    /* NULL for an empty region */
    unsigned inflight; /* under reg_mu: rendezvous receives writing into it */
    struct ucx_region *dead_next; /* on tl->dead_regions */
} ucx_region_t;

/* A rendezvous DATA receive in flight. */
typedef struct ucx_recv {
    ucx_iface_t *tl;
    ucx_region_t *region;
    uint64_t acc_id;
    size_t len;
    void *discard; /* a refused rendezvous write is received here and freed */
} ucx_recv_t;

/* Refused rendezvous writes received into scratch at once, in bytes, at most; more
 * (or a larger one) fails the connection instead of dropping the write. */
#define UCX_DISCARD_MAX (64ull << 20)

typedef struct ucx_ep {
    kvw__tl_ep_t hd; /* accepted, peer, peer_token */
    ucx_iface_t *tl;
    uint64_t id;
    /* Connected endpoints: read-locked by every call that uses uep, write-locked to
     * close it. Accepted endpoints have no UCX endpoint (see the file comment). */
    pthread_rwlock_t rw;
    ucp_ep_h uep;          /* NULL once closed */
    atomic_int failed;     /* 0, or the kvw_status_t that failed the endpoint */
    atomic_bool closing;   /* ep_close or teardown: on the closing list, no callbacks */
    atomic_bool dirty;     /* connected: puts posted since the last fence */
    bool close_incomplete; /* a UCX close did not finish: free only after the worker */
    bool graceful;         /* closing: say BYE first */
    /* under tl->mu */
    bool established;      /* connected: HELLO_ACK arrived; accepted: always */
    bool reported;         /* on_ep_error delivered or suppressed */
    bool err_pending;      /* an asynchronous failure waits to be reported */
    kvw_status_t err_status;
    char err_reason[224];
    uint64_t last_rx_ns;   /* accepted: last message from the sender */
    unsigned inflight;     /* accepted: rendezvous receives writing for it */
    uint64_t failed_ns;    /* accepted: when the failure was found */
    uint64_t remote_id;    /* connected: our id at the receiver; accepted: sender's ep id */
    struct ucx_ep *prev, *next; /* tl->eps, or a closing/zombie list (next only) */
} ucx_ep_t;

typedef struct ucx_rkey {
    kvw__tl_rkey_t hd; /* ep, region_id, len; on tl->rkeys */
    ucx_iface_t *tl;
    uint64_t base;
    ucp_rkey_h urkey; /* NULL for an empty region */
} ucx_rkey_t;

/* A NOTIFY or BYE queued by the AM handler for the progress thread. */
typedef struct ucx_event {
    struct ucx_event *next;
    uint8_t type;
    uint64_t acc_id;
    bool oversized; /* the notification exceeded KVW_TL_MAX_NOTIFY and was not kept */
    size_t len;
    uint8_t data[];
} ucx_event_t;

/* An rkey check waiting for the receiver's answer (lives on the caller's stack). */
typedef struct ucx_wait {
    struct ucx_wait *next;
    uint64_t id, ep_id;
    bool done;
    int32_t status;
} ucx_wait_t;

/* A send, flush or endpoint close tracked to completion. */
typedef struct ucx_op {
    struct ucx_op *next;
    void *req;
    ucp_ep_h close_uep; /* a flush: force-close this endpoint when it ends */
    ucx_ep_t *free_ep;  /* close: free this endpoint when done */
    uint64_t deadline;
    uint8_t hdr[UCX_MSG_HDR];
} ucx_op_t;

struct ucx_iface {
    kvw_tl_callbacks_t cb;
    uint32_t timeout_ms;
    bool peer_mode;
    bool rma;       /* put() posts ucp_put_nbx instead of DATA messages */
    uint64_t token;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_address_t *waddr;
    size_t waddr_len;
    int efd;     /* the worker's event fd, or -1 (then the thread polls) */
    int wake_fd; /* our eventfd */
    atomic_int waiters; /* user threads progressing the worker right now */
    pthread_t thread;
    bool thread_started;
    atomic_bool closed;

    pthread_mutex_t mu; /* see the file comment */
    pthread_cond_t cv;
    ucx_ep_t *eps;
    ucx_ep_t *closing;
    ucx_event_t *ev_head, *ev_tail;
    ucx_wait_t *waits;
    kvw__tl_rkey_t *rkeys;
    ucx_op_t *ops;
    uint64_t next_id;
    unsigned num_accepted;
    unsigned num_err_pending;
    bool err_deferred; /* progress thread: a report waits for receives to end */
    bool ev_held;      /* a queued NOTIFY waits for its connection's receives to end */
    atomic_bool ev_new; /* a message was queued since the progress thread last looked */
    uint64_t discard_bytes; /* mu: refused rendezvous writes being received into scratch */

    pthread_mutex_t reg_mu; /* regions */
    kvw_hmap_t regions; /* by id: the receive path looks writes up here */
    ucx_region_t *dead_regions; /* deregistered while a receive still wrote into them */

    /* progress thread only (fini after stop) */
    ucx_op_t *dead_ops; /* past their deadline: released after the worker */
    ucx_ep_t *zombies;  /* close incomplete: freed after the worker */
    ucx_ep_t **snap;    /* scratch list for heartbeats */
    size_t snap_cap;
    uint64_t last_hb_ns, last_loop_ns;
};

static inline ucx_iface_t *to_iface(kvw_tl_h tl)
{
    return (ucx_iface_t *)(void *)tl;
}
static inline ucx_ep_t *to_ep(kvw_tl_ep_h ep)
{
    return (ucx_ep_t *)(void *)ep;
}

static inline uint64_t deadline_in(uint32_t ms)
{
    return kvw__now_ns() + (uint64_t)ms * 1000000ull;
}

typedef bool (*wait_pred_t)(ucx_ep_t *ep, void *arg);

/* ucx_util.c: the message header, status mapping, bounded waits */

void ucx_hdr_put(uint8_t *p, const msg_hdr_t *h);

bool ucx_hdr_get(const void *buf, size_t len, msg_hdr_t *h);

/* A UCX failure as a kvwire status: anything that means "the peer or the path is
 * gone" is CONN_CLOSED. */
kvw_status_t ucx_map_ucs(ucs_status_t s);

/* tl->mu held. */
void ucx_cond_wait_ms(ucx_iface_t *tl, unsigned ms);

/*
 * Waits for a UCX request (NULL: done at once; an error pointer) to complete,
 * progressing the worker, until the deadline. Returns the request's status, or
 * UCS_ERR_TIMED_OUT (or, when `abortable` and the instance was closed meanwhile,
 * UCS_ERR_CANCELED) with the request released to UCX: it is freed when it completes,
 * and the caller must force-close the endpoint before its buffers go away.
 */
ucs_status_t ucx_req_wait(ucx_iface_t *tl, void *req, uint64_t deadline, bool abortable);

/* ucx_conn.c: endpoints, control messages, connect and close */

/* Hands an endpoint over to the closing list (once); the progress thread frees it. */
void ucx_ep_to_closing(ucx_iface_t *tl, ucx_ep_t *ep, bool graceful);

/* A new endpoint record (accepted: the receiver's side), not linked yet; NULL without
 * memory. */
ucx_ep_t *ucx_ep_new(ucx_iface_t *tl, bool accepted);

/* tl->mu held. Links an endpoint into the instance's tables under its id. */
void ucx_ep_link(ucx_iface_t *tl, ucx_ep_t *ep);

/* Closes a UCX endpoint and waits (bounded) for the close. Returns false when the
 * close did not complete: UCX may still call the endpoint's error handler. */
bool ucx_uep_close_wait(ucx_iface_t *tl, ucp_ep_h uep, bool force);

void ucx_ep_free(ucx_ep_t *ep);

/* tl->mu held. */
void ucx_ep_unlink(ucx_iface_t *tl, ucx_ep_t *ep);

/* tl->mu held. The endpoint with this id, if it is of the expected side and peer. */
ucx_ep_t *ucx_ep_find(ucx_iface_t *tl, uint64_t id, bool accepted, uint64_t peer_token);

/* tl->mu held. Marks an endpoint failed (the first status sticks); when `report`,
 * queues on_ep_error for the progress thread. */
void ucx_ep_fail_locked(ucx_ep_t *ep, kvw_status_t st, bool report, const char *fmt, ...)
    KVW_PRINTF(4, 5);

/* Posts an eager active message; `hdr` and `data` must stay valid until it completes. */
void *ucx_am_post(ucp_ep_h uep, const uint8_t *hdr, const void *data, size_t len,
                  bool want_reply);

/* Sends a header-only message without waiting; best effort (without memory the peer
 * learns what it needs from a timeout or the endpoint's end instead). */
void ucx_send_msg(ucx_iface_t *tl, ucp_ep_h uep, const msg_hdr_t *h, bool want_reply);

/*
 * Progress thread: closes a UCX endpoint without waiting, and frees `free_ep` (if any)
 * once UCX is done with it. With `bye`: says it, flushes for at most UCX_GOODBYE_MS,
 * then force-closes. A close that only flushes could leave requests behind for ever
 * (a stopped peer), and UCX 1.13 asserts when the worker is destroyed with those;
 * without PEER mode, though, UCX allows only that kind of close.
 */
void ucx_close_uep_async(ucx_iface_t *tl, ucp_ep_h uep, ucx_ep_t *free_ep,
                         const msg_hdr_t *bye);

/* Progress thread or fini: completes tracked requests. */
void ucx_poll_ops(ucx_iface_t *tl);

bool ucx_wait_reply(ucx_ep_t *ep, wait_pred_t done, void *arg, uint64_t deadline);

/* Fails a connected endpoint for good after a put/notify error and, when requests
 * may still be in flight, closes the UCX endpoint with FORCE so that they complete
 * before the caller's buffers go away. Not called with ep->rw held. */
void ucx_ep_fail_sync(ucx_ep_t *ep, kvw_status_t st, bool kill);

kvw_status_t ucx_connect(kvw_tl_h tl_h, const void *addr, size_t len, kvw_tl_ep_h *ep_p);

/* ep->rw read-locked. */
kvw_status_t ucx_check_alive(ucx_ep_t *ep, const char *what);

void ucx_ep_close(kvw_tl_ep_h ep_h);

/* ucx_am.c: the active-message dispatcher (registered with the worker by ucx_iface.c) */

ucs_status_t ucx_am_cb(void *arg, const void *header, size_t header_length, void *data,
                       size_t length, const ucp_am_recv_param_t *param);

/* ucx_mem.c: regions and remote keys */

/* The registered region `id`, or NULL. reg_mu held. */
ucx_region_t *ucx_region_find(ucx_iface_t *tl, uint64_t id);

kvw_status_t ucx_mem_reg(kvw_tl_h tl_h, void *addr, uint64_t len, kvw_mem_kind_t kind,
                         uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                         size_t *rkey_len_p);

void ucx_mem_dereg(kvw_tl_h tl_h, kvw_tl_mem_h mem);

kvw_status_t ucx_rkey_unpack(kvw_tl_ep_h ep_h, const void *buf, size_t len,
                             kvw_tl_rkey_h *rkey_p);

void ucx_rkey_release(kvw_tl_rkey_h rkey);

/* Frees an unpacked key (off the instance's list: release, or fini). */
void ucx_rkey_free(kvw__tl_rkey_t *hd);

/* ucx_put.c: the data paths (put, DATA receive) and notify */

/*
 * Receiver side: one write (put() in the default "am" mode). The receiver checks the
 * connection, the region and the bounds, then asks cb.check_write (no lock of ours
 * held: it takes the protocol's), then copies an eager message into place, or receives
 * a rendezvous message straight into the destination. Bad or refused writes land
 * nowhere and fail the connection. Once a connection has failed, its writes are
 * dropped, and its failure is reported only after its rendezvous receives ended (see
 * dispatch_errors), so that nothing of it lands after on_ep_error. The region cannot
 * go away meanwhile: eager copies run under reg_mu, and mem_dereg waits for the
 * region's rendezvous receives. Locks: tl->mu, then reg_mu.
 */
ucs_status_t ucx_on_data(ucx_iface_t *tl, const msg_hdr_t *h, void *data, size_t len,
                         bool rndv);

kvw_status_t ucx_put(kvw_tl_ep_h ep_h, uint64_t room, const kvw_tl_put_t *puts, size_t n);

kvw_status_t ucx_notify(kvw_tl_ep_h ep_h, const void *msg, size_t len);

extern const kvw_tl_ops_t kvw_tl_ucx_ops;

#endif
