/*
 * The ucx transport: writes through UCX (UCP), between hosts over whatever UCX drives
 * there (tcp here; RDMA where present) and between processes on one host.
 *
 * One ucp_context and one ucp_worker (UCS_THREAD_MODE_MULTI) per instance, with
 * UCP_FEATURE_RMA and UCP_FEATURE_AM for data and control, and UCP_FEATURE_WAKEUP for
 * the progress thread's event fd. mem_reg maps the caller's memory with ucp_mem_map
 * and packs its rkey with the region's base, length and id and the instance token.
 *
 * Two data paths; the sender chooses (KVW_UCX_PUT), a receiver takes both.
 *  - "am" (default): one DATA active message per write. UCX sends small ones eagerly
 *    and the receiver copies them into place; large ones go by rendezvous and are
 *    received straight into place (ucp_am_recv_data_nbx: zero-copy, RDMA reads where
 *    the fabric has them). The receiver checks every write against its registered
 *    regions itself, drops the writes of a connection that failed, and reports that
 *    failure only once its rendezvous receives have ended, so nothing of a dead or
 *    misbehaving sender lands after on_ep_error.
 *  - "rma": ucp_put_nbx into the rkey, truly one-sided where UCX has RMA lanes for the
 *    memory (RDMA fabrics). UCX 1.13 emulates such puts in software on every transport
 *    of this machine, and its emulation aborts the target process (ucs_fatal in
 *    ucp_progress_rma_cmpl) when the initiator dies with puts in flight; nor can a
 *    receiver refuse or stop these writes. Hence "am" by default; use "rma" only where
 *    UCX has native RMA lanes.
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
 * order), with a fixed header (see hdr_put) naming the instance token of destination
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
 * Confinement. check_write is never called (caps lack KVW_TL_CAP_MEDIATED). As for
 * shm, the sending library confines every write to the registered region of its rkey,
 * and the protocol layer of the sending side confines writes to the pages granted to
 * the room. On the "am" path the receiver also refuses writes outside its registered
 * regions (on_ep_error OUT_OF_RANGE); on "rma" it cannot. A deregistered region cannot
 * be unpacked by a new endpoint; on "rma" a sender that already holds its rkey could
 * still write to it, so the protocol must stop granting pages of a region before
 * deregistering it.
 *
 * Limits. UCX itself prints warnings and errors to stderr (its own logger,
 * UCX_LOG_LEVEL). A worker address must fit KVW_TL_MAX_ADDR with our 16-byte header;
 * when it does not, init retries with UCX's compact address format (v2).
 */
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

#define UCX_VERSION 1
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
#define UCX_REGION_BUCKETS 256    /* region id hash for the receive path */
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
    uint64_t id, base, len;
    ucp_mem_h memh;    /* NULL for an empty region */
    unsigned inflight; /* under reg_mu: rendezvous receives writing into it */
    struct ucx_region *next; /* hash bucket, or tl->dead_regions */
} ucx_region_t;

/* A rendezvous DATA receive in flight. */
typedef struct ucx_recv {
    ucx_iface_t *tl;
    ucx_region_t *region;
    uint64_t acc_id;
    size_t len;
} ucx_recv_t;

typedef struct ucx_ep {
    ucx_iface_t *tl;
    uint64_t id;
    bool accepted;
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
    uint64_t peer_token;
    uint64_t remote_id;    /* connected: our id at the receiver; accepted: sender's ep id */
    char peer[64];
    struct ucx_ep *prev, *next; /* tl->eps, or a closing/zombie list (next only) */
} ucx_ep_t;

typedef struct ucx_rkey {
    ucx_iface_t *tl;
    ucx_ep_t *ep;
    uint64_t region_id, base, len;
    ucp_rkey_h urkey; /* NULL for an empty region */
    struct ucx_rkey *prev, *next;
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
    ucx_rkey_t *rkeys;
    ucx_op_t *ops;
    uint64_t next_id;
    unsigned num_accepted;
    unsigned num_err_pending;
    bool err_deferred; /* progress thread: a report waits for receives to end */

    pthread_mutex_t reg_mu; /* regions */
    ucx_region_t *regions[UCX_REGION_BUCKETS];
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

static uint64_t deadline_in(uint32_t ms)
{
    return kvw__now_ns() + (uint64_t)ms * 1000000ull;
}

/* ---------------------------------------------------------------- helpers */

static void hdr_put(uint8_t *p, const msg_hdr_t *h)
{
    kvw__le32_put(p, UCX_MSG_MAGIC);
    p[4] = UCX_VERSION;
    p[5] = h->type;
    kvw__le16_put(p + 6, 0);
    kvw__le64_put(p + 8, h->to);
    kvw__le64_put(p + 16, h->from);
    kvw__le64_put(p + 24, h->a);
    kvw__le64_put(p + 32, h->b);
    kvw__le64_put(p + 40, h->c);
    kvw__le64_put(p + 48, h->d);
    kvw__le64_put(p + 56, h->e);
    kvw__le64_put(p + 64, h->f);
}

static bool hdr_get(const void *buf, size_t len, msg_hdr_t *h)
{
    const uint8_t *p = buf;
    if (p == NULL || len != UCX_MSG_HDR || kvw__le32_get(p) != UCX_MSG_MAGIC ||
        p[4] != UCX_VERSION || kvw__le16_get(p + 6) != 0)
        return false;
    h->type = p[5];
    h->to = kvw__le64_get(p + 8);
    h->from = kvw__le64_get(p + 16);
    h->a = kvw__le64_get(p + 24);
    h->b = kvw__le64_get(p + 32);
    h->c = kvw__le64_get(p + 40);
    h->d = kvw__le64_get(p + 48);
    h->e = kvw__le64_get(p + 56);
    h->f = kvw__le64_get(p + 64);
    return true;
}

/* A UCX failure as a kvwire status: anything that means "the peer or the path is
 * gone" is CONN_CLOSED. */
static kvw_status_t map_ucs(ucs_status_t s)
{
    switch (s) {
    case UCS_OK:
        return KVW_OK;
    case UCS_ERR_NO_MEMORY:
        return KVW_ERR_NO_MEMORY;
    case UCS_ERR_TIMED_OUT:
        return KVW_ERR_TIMEOUT;
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NO_DEVICE:
        return KVW_ERR_CONN_CLOSED;
    default:
        return KVW_ERR_IO;
    }
}

/* reg_mu held. */
static ucx_region_t **region_slot(ucx_iface_t *tl, uint64_t id)
{
    ucx_region_t **pp = &tl->regions[(id * 0x9e3779b97f4a7c15ull) >> 56];
    while (*pp && (*pp)->id != id)
        pp = &(*pp)->next;
    return pp;
}

/* tl->mu held. */
static void cond_wait_ms(ucx_iface_t *tl, unsigned ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)ms * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&tl->cv, &tl->mu, &ts);
}

/*
 * Waits for a UCX request (NULL: done at once; an error pointer) to complete,
 * progressing the worker, until the deadline. Returns the request's status, or
 * UCS_ERR_TIMED_OUT (or, when `abortable` and the instance was closed meanwhile,
 * UCS_ERR_CANCELED) with the request released to UCX: it is freed when it completes,
 * and the caller must force-close the endpoint before its buffers go away.
 */
static ucs_status_t req_wait(ucx_iface_t *tl, void *req, uint64_t deadline, bool abortable)
{
    if (req == NULL)
        return UCS_OK;
    if (UCS_PTR_IS_ERR(req))
        return UCS_PTR_STATUS(req);
    ucs_status_t s;
    atomic_fetch_add(&tl->waiters, 1);
    while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
        if (ucp_worker_progress(tl->worker) != 0)
            continue;
        if (abortable && atomic_load(&tl->closed)) {
            s = UCS_ERR_CANCELED;
            break;
        }
        if (kvw__now_ns() >= deadline) {
            s = UCS_ERR_TIMED_OUT;
            break;
        }
        sched_yield();
    }
    atomic_fetch_sub(&tl->waiters, 1);
    ucp_request_free(req); /* still in flight: released when it completes */
    return s;
}

static void *uep_close_post(ucx_iface_t *tl, ucp_ep_h uep, bool force)
{
    /* FORCE needs UCP_ERR_HANDLING_MODE_PEER on both sides. */
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = force && tl->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    return ucp_ep_close_nbx(uep, &prm);
}

/* Closes a UCX endpoint and waits (bounded) for the close. Returns false when the
 * close did not complete: UCX may still call the endpoint's error handler. */
static bool uep_close_wait(ucx_iface_t *tl, ucp_ep_h uep, bool force)
{
    void *req = uep_close_post(tl, uep, force);
    return req_wait(tl, req, deadline_in(KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS)), false) !=
           UCS_ERR_TIMED_OUT;
}

static void ep_free(ucx_ep_t *ep)
{
    pthread_rwlock_destroy(&ep->rw);
    free(ep);
}

static ucx_ep_t *ep_new(ucx_iface_t *tl, bool accepted)
{
    ucx_ep_t *ep = calloc(1, sizeof(*ep));
    if (ep == NULL)
        return NULL;
    ep->tl = tl;
    ep->accepted = accepted;
    pthread_rwlock_init(&ep->rw, NULL);
    atomic_init(&ep->failed, 0);
    atomic_init(&ep->closing, false);
    atomic_init(&ep->dirty, false);
    return ep;
}

/* tl->mu held. */
static void ep_link(ucx_iface_t *tl, ucx_ep_t *ep)
{
    ep->prev = NULL;
    ep->next = tl->eps;
    if (tl->eps)
        tl->eps->prev = ep;
    tl->eps = ep;
    if (ep->accepted)
        tl->num_accepted++;
}

/* tl->mu held. */
static void ep_unlink(ucx_iface_t *tl, ucx_ep_t *ep)
{
    if (ep->prev)
        ep->prev->next = ep->next;
    else
        tl->eps = ep->next;
    if (ep->next)
        ep->next->prev = ep->prev;
    ep->prev = ep->next = NULL;
    if (ep->accepted)
        tl->num_accepted--;
    if (ep->err_pending) {
        ep->err_pending = false;
        tl->num_err_pending--;
    }
}

/* tl->mu held. The endpoint with this id, if it is of the expected side and peer. */
static ucx_ep_t *ep_find(ucx_iface_t *tl, uint64_t id, bool accepted, uint64_t peer_token)
{
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next)
        if (ep->id == id)
            return ep->accepted == accepted && ep->peer_token == peer_token ? ep : NULL;
    return NULL;
}

/* tl->mu held. Marks an endpoint failed (the first status sticks); when `report`,
 * queues on_ep_error for the progress thread. */
static void ep_fail_locked(ucx_ep_t *ep, kvw_status_t st, bool report, const char *fmt, ...)
    KVW_PRINTF(4, 5);
static void ep_fail_locked(ucx_ep_t *ep, kvw_status_t st, bool report, const char *fmt, ...)
{
    int zero = 0;
    if (atomic_compare_exchange_strong(&ep->failed, &zero, (int)st))
        ep->failed_ns = kvw__now_ns();
    if (ep->err_reason[0] == '\0') {
        int n = snprintf(ep->err_reason, sizeof(ep->err_reason), "ucx %s %s: ",
                         ep->accepted ? "connection from" : "connection to", ep->peer);
        va_list ap;
        va_start(ap, fmt);
        if (n > 0 && (size_t)n < sizeof(ep->err_reason))
            vsnprintf(ep->err_reason + n, sizeof(ep->err_reason) - (size_t)n, fmt, ap);
        va_end(ap);
        ep->err_status = st;
    }
    if (report && ep->established && !ep->reported && !ep->err_pending &&
        !atomic_load(&ep->closing)) {
        ep->err_pending = true;
        ep->tl->num_err_pending++;
    }
}

/* UCX endpoint error handler (connected endpoints): any thread that progresses. */
static void ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t status)
{
    ucx_ep_t *ep = arg;
    ucx_iface_t *tl = ep->tl;
    (void)uep;
    pthread_mutex_lock(&tl->mu);
    ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true, "UCX reported %s (%d)",
                   ucs_status_string(status), (int)status);
    pthread_cond_broadcast(&tl->cv);
    pthread_mutex_unlock(&tl->mu);
    kvw__tl_wake(tl->wake_fd);
}

/* Posts an eager active message; `hdr` and `data` must stay valid until it completes. */
static void *am_post(ucp_ep_h uep, const uint8_t *hdr, const void *data, size_t len,
                     bool want_reply)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE,
        .flags = UCP_AM_SEND_FLAG_EAGER | (want_reply ? UCP_AM_SEND_FLAG_REPLY : 0),
        .memory_type = UCS_MEMORY_TYPE_HOST};
    return ucp_am_send_nbx(uep, UCX_AM_ID, hdr, UCX_MSG_HDR, data, len, &prm);
}

static void op_track(ucx_iface_t *tl, ucx_op_t *op, void *req, uint32_t ms);

/* Progress thread or fini: an op's request ended, or its deadline passed (then UCX may
 * still use its header, or call its endpoint's error handler: both live until the
 * worker is destroyed). A finished flush goes on to force-close its endpoint. */
static void op_finish(ucx_iface_t *tl, ucx_op_t *op, bool timed_out)
{
    if (op->close_uep) {
        ucp_ep_h uep = op->close_uep;
        op->close_uep = NULL;
        op_track(tl, op, uep_close_post(tl, uep, true), KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS));
        return;
    }
    if (!timed_out) {
        if (op->free_ep)
            ep_free(op->free_ep);
        free(op);
        return;
    }
    if (op->free_ep) {
        op->free_ep->next = tl->zombies;
        tl->zombies = op->free_ep;
        op->free_ep = NULL;
    }
    op->next = tl->dead_ops;
    tl->dead_ops = op;
}

/* Tracks a request to completion (under tl->mu: AM callbacks add to the list from any
 * thread); a request that is already done finishes the op at once. */
static void op_track(ucx_iface_t *tl, ucx_op_t *op, void *req, uint32_t ms)
{
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        op_finish(tl, op, false);
        return;
    }
    op->req = req;
    op->deadline = deadline_in(ms);
    pthread_mutex_lock(&tl->mu);
    op->next = tl->ops;
    tl->ops = op;
    pthread_mutex_unlock(&tl->mu);
}

/* Sends a header-only message without waiting; best effort (without memory the peer
 * learns what it needs from a timeout or the endpoint's end instead). */
static void send_msg(ucx_iface_t *tl, ucp_ep_h uep, const msg_hdr_t *h, bool want_reply)
{
    ucx_op_t *op = calloc(1, sizeof(*op));
    if (op == NULL)
        return;
    hdr_put(op->hdr, h);
    op_track(tl, op, am_post(uep, op->hdr, NULL, 0, want_reply), tl->timeout_ms);
}

/*
 * Progress thread: closes a UCX endpoint without waiting, and frees `free_ep` (if any)
 * once UCX is done with it. With `bye`: says it, flushes for at most UCX_GOODBYE_MS,
 * then force-closes. A close that only flushes could leave requests behind for ever
 * (a stopped peer), and UCX 1.13 asserts when the worker is destroyed with those;
 * without PEER mode, though, UCX allows only that kind of close.
 */
static void close_uep_async(ucx_iface_t *tl, ucp_ep_h uep, ucx_ep_t *free_ep,
                            const msg_hdr_t *bye)
{
    if (bye)
        send_msg(tl, uep, bye, false);
    ucx_op_t *op = calloc(1, sizeof(*op));
    if (op == NULL) {
        bool done = uep_close_wait(tl, uep, true);
        if (free_ep && done) {
            ep_free(free_ep);
        } else if (free_ep) {
            free_ep->next = tl->zombies;
            tl->zombies = free_ep;
        }
        return;
    }
    op->free_ep = free_ep;
    if (bye && tl->peer_mode) {
        ucp_request_param_t prm = {.op_attr_mask = 0};
        op->close_uep = uep;
        op_track(tl, op, ucp_ep_flush_nbx(uep, &prm), KVW_MIN(tl->timeout_ms, UCX_GOODBYE_MS));
    } else {
        op_track(tl, op, uep_close_post(tl, uep, true), KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS));
    }
}

/* Progress thread or fini: completes tracked requests. */
static void poll_ops(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    ucx_op_t *list = tl->ops;
    tl->ops = NULL;
    pthread_mutex_unlock(&tl->mu);
    if (list == NULL)
        return;
    uint64_t now = kvw__now_ns();
    ucx_op_t *keep = NULL, **tail = &keep;
    while (list) {
        ucx_op_t *op = list;
        list = op->next;
        ucs_status_t s = ucp_request_check_status(op->req);
        if (s == UCS_INPROGRESS && now < op->deadline) {
            *tail = op;
            tail = &op->next;
            continue;
        }
        ucp_request_free(op->req); /* released to UCX if still in flight */
        op->req = NULL;
        op_finish(tl, op, s == UCS_INPROGRESS);
    }
    *tail = NULL;
    if (keep) {
        pthread_mutex_lock(&tl->mu);
        *tail = tl->ops;
        tl->ops = keep;
        pthread_mutex_unlock(&tl->mu);
    }
}

/* ---------------------------------------------------------------- active messages */

/* Sender side: answers from the receiver, handled right here (no UCX calls). */
static void on_reply(ucx_iface_t *tl, const msg_hdr_t *h)
{
    pthread_mutex_lock(&tl->mu);
    if (h->type == MSG_RKEY_REP) {
        for (ucx_wait_t *w = tl->waits; w; w = w->next) {
            if (w->id == h->b && w->ep_id == h->a) {
                w->done = true;
                w->status = (int32_t)(uint32_t)h->c;
                break;
            }
        }
    } else {
        ucx_ep_t *ep = ep_find(tl, h->a, false, h->from);
        if (ep && h->type == MSG_HELLO_ACK && !ep->established) {
            ep->remote_id = h->b;
            ep->established = true;
        } else if (ep && h->type == MSG_CLOSED) {
            ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true,
                           "the receiver closed the connection");
        }
    }
    pthread_cond_broadcast(&tl->cv);
    pthread_mutex_unlock(&tl->mu);
    if (h->type == MSG_CLOSED)
        kvw__tl_wake(tl->wake_fd);
}

/* Receiver side: a message answered on the sender's reply endpoint. */
static void reply(ucx_iface_t *tl, ucp_ep_h reply_ep, uint8_t type, const msg_hdr_t *req,
                  uint64_t b, uint64_t c)
{
    if (reply_ep == NULL)
        return;
    msg_hdr_t h = {.type = type, .to = req->from, .from = tl->token, .a = req->b, .b = b,
                   .c = c};
    send_msg(tl, reply_ep, &h, false);
}

static void on_hello(ucx_iface_t *tl, const msg_hdr_t *h, ucp_ep_h reply_ep)
{
    if (reply_ep == NULL)
        return; /* cannot answer: the sender's connect times out */
    if (atomic_load(&tl->closed)) {
        reply(tl, reply_ep, MSG_CLOSED, h, 0, 0);
        return;
    }
    ucx_ep_t *ep = ep_new(tl, true);
    if (ep == NULL)
        return;
    ep->peer_token = h->from;
    ep->remote_id = h->b;
    ep->established = true;
    ep->last_rx_ns = kvw__now_ns();
    snprintf(ep->peer, sizeof(ep->peer), "pid %llu (sender %016llx)",
             (unsigned long long)h->c, (unsigned long long)h->from);
    pthread_mutex_lock(&tl->mu);
    bool full = tl->num_accepted >= UCX_MAX_ACCEPTED;
    if (!full) {
        ep->id = ++tl->next_id;
        ep_link(tl, ep);
    }
    uint64_t id = ep->id;
    pthread_mutex_unlock(&tl->mu);
    if (full) {
        ep_free(ep);
        return;
    }
    reply(tl, reply_ep, MSG_HELLO_ACK, h, id, 0);
}

static void on_sender_msg(ucx_iface_t *tl, const msg_hdr_t *h, const void *data, size_t len,
                          ucp_ep_h reply_ep)
{
    bool closed = atomic_load(&tl->closed);
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *ep = closed ? NULL : ep_find(tl, h->a, true, h->from);
    bool alive = ep && ep->remote_id == h->b && !ep->reported && !atomic_load(&ep->closing) &&
                 atomic_load(&ep->failed) == 0;
    if (alive)
        ep->last_rx_ns = kvw__now_ns();
    pthread_mutex_unlock(&tl->mu);
    if (!alive) {
        if (h->type != MSG_BYE)
            reply(tl, reply_ep, MSG_CLOSED, h, 0, 0);
        return;
    }
    if (h->type == MSG_PING)
        return;
    if (h->type == MSG_RKEY_REQ) {
        int32_t status = KVW_ERR_NOT_FOUND;
        pthread_mutex_lock(&tl->reg_mu);
        ucx_region_t *r = *region_slot(tl, h->d);
        if (r)
            status = r->base == h->e && r->len == h->f ? KVW_OK : KVW_ERR_REJECTED;
        pthread_mutex_unlock(&tl->reg_mu);
        reply(tl, reply_ep, MSG_RKEY_REP, h, h->c, (uint64_t)(uint32_t)status);
        return;
    }
    /* NOTIFY and BYE go to the progress thread, in arrival order. */
    bool oversized = len > (h->type == MSG_NOTIFY ? KVW_TL_MAX_NOTIFY : 0);
    size_t keep = oversized ? 0 : len;
    ucx_event_t *ev = malloc(sizeof(*ev) + keep);
    pthread_mutex_lock(&tl->mu);
    if (ev == NULL) {
        /* Cannot queue it: the connection is no longer whole. */
        ep = ep_find(tl, h->a, true, h->from);
        if (ep)
            ep_fail_locked(ep, KVW_ERR_NO_MEMORY, true,
                           "no memory to queue a message of %zu bytes", len);
    } else {
        ev->next = NULL;
        ev->type = h->type;
        ev->acc_id = h->a;
        ev->oversized = oversized;
        ev->len = len;
        if (keep)
            memcpy(ev->data, data, keep);
        if (tl->ev_tail)
            tl->ev_tail->next = ev;
        else
            tl->ev_head = ev;
        tl->ev_tail = ev;
    }
    pthread_mutex_unlock(&tl->mu);
    kvw__tl_wake(tl->wake_fd);
}

static void recv_done(void *request, ucs_status_t status, size_t length, void *user_data)
{
    ucx_recv_t *rc = user_data;
    ucx_iface_t *tl = rc->tl;
    (void)length;
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *ep;
    for (ep = tl->eps; ep && !(ep->accepted && ep->id == rc->acc_id); ep = ep->next)
        ;
    if (ep) {
        ep->inflight--;
        if (status != UCS_OK)
            ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true,
                           "receiving %zu bytes into region %llu failed: %s", rc->len,
                           (unsigned long long)rc->region->id, ucs_status_string(status));
    }
    pthread_mutex_unlock(&tl->mu);
    pthread_mutex_lock(&tl->reg_mu);
    rc->region->inflight--;
    pthread_mutex_unlock(&tl->reg_mu);
    if (status != UCS_OK || ep)
        kvw__tl_wake(tl->wake_fd); /* a deferred report may be due */
    free(rc);
    if (request)
        ucp_request_free(request);
}

/*
 * Receiver side: one write (put() in the default "am" mode). The receiver checks the
 * connection, the region and the bounds, then copies an eager message into place, or
 * receives a rendezvous message straight into the destination. Bad writes land
 * nowhere and fail the connection. Once a connection has failed, its writes are
 * dropped, and its failure is reported only after its rendezvous receives ended (see
 * dispatch_errors), so that nothing of it lands after on_ep_error. The region cannot
 * go away meanwhile: eager copies run under reg_mu, and mem_dereg waits for the
 * region's rendezvous receives. Locks: tl->mu, then reg_mu.
 */
static ucs_status_t on_data(ucx_iface_t *tl, const msg_hdr_t *h, void *data, size_t len,
                            bool rndv)
{
    bool closed = atomic_load(&tl->closed);
    uint64_t end;
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *ep = closed ? NULL : ep_find(tl, h->a, true, h->from);
    if (ep == NULL || ep->remote_id != h->b || ep->reported || atomic_load(&ep->closing) ||
        atomic_load(&ep->failed) != 0) {
        pthread_mutex_unlock(&tl->mu);
        return rndv ? UCS_ERR_NOT_CONNECTED : UCS_OK; /* dropped */
    }
    ep->last_rx_ns = kvw__now_ns();
    pthread_mutex_lock(&tl->reg_mu);
    ucx_region_t *r = *region_slot(tl, h->c);
    if (r == NULL || !kvw__add_u64(h->d, len, &end) || end > r->len) {
        if (r)
            ep_fail_locked(ep, KVW_ERR_OUT_OF_RANGE, true,
                           "write of %zu bytes at offset %llu is outside region %llu of %llu "
                           "bytes",
                           len, (unsigned long long)h->d, (unsigned long long)h->c,
                           (unsigned long long)r->len);
        else
            ep_fail_locked(ep, KVW_ERR_OUT_OF_RANGE, true,
                           "write of %zu bytes into region %llu, which is not registered "
                           "(deregistered?)",
                           len, (unsigned long long)h->c);
        pthread_mutex_unlock(&tl->reg_mu);
        pthread_mutex_unlock(&tl->mu);
        kvw__tl_wake(tl->wake_fd);
        return rndv ? UCS_ERR_REJECTED : UCS_OK;
    }
    uint8_t *dst = (uint8_t *)(uintptr_t)r->base + h->d;
    if (!rndv) {
        if (len)
            memcpy(dst, data, len);
        pthread_mutex_unlock(&tl->reg_mu);
        pthread_mutex_unlock(&tl->mu);
        return UCS_OK;
    }
    ucx_recv_t *rc = malloc(sizeof(*rc));
    if (rc == NULL) {
        ep_fail_locked(ep, KVW_ERR_NO_MEMORY, true, "no memory to receive %zu bytes", len);
        pthread_mutex_unlock(&tl->reg_mu);
        pthread_mutex_unlock(&tl->mu);
        kvw__tl_wake(tl->wake_fd);
        return UCS_ERR_NO_MEMORY;
    }
    r->inflight++;
    ep->inflight++;
    pthread_mutex_unlock(&tl->reg_mu);
    pthread_mutex_unlock(&tl->mu);
    *rc = (ucx_recv_t){.tl = tl, .region = r, .acc_id = h->a, .len = len};
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .cb.recv_am = recv_done,
        .user_data = rc,
        .memory_type = UCS_MEMORY_TYPE_HOST};
    void *req = ucp_am_recv_data_nbx(tl->worker, data, dst, len, &prm);
    if (!UCS_PTR_IS_ERR(req))
        return UCS_INPROGRESS; /* recv_done finishes it */
    recv_done(NULL, UCS_PTR_STATUS(req), 0, rc); /* counts down and fails the connection */
    return UCS_PTR_STATUS(req);
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param)
{
    ucx_iface_t *tl = arg;
    msg_hdr_t h;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (!hdr_get(header, header_length, &h) || h.to != tl->token)
        return rndv ? UCS_ERR_REJECTED : UCS_OK; /* not from a kvwire peer of ours */
    if (h.type == MSG_DATA)
        return on_data(tl, &h, data, length, rndv);
    if (rndv)
        return UCS_ERR_REJECTED; /* control messages are always eager */
    ucp_ep_h reply_ep =
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    switch (h.type) {
    case MSG_HELLO_ACK:
    case MSG_RKEY_REP:
    case MSG_CLOSED:
        if (length == 0)
            on_reply(tl, &h);
        break;
    case MSG_HELLO:
        if (length == 0)
            on_hello(tl, &h, reply_ep);
        break;
    case MSG_NOTIFY:
    case MSG_BYE:
    case MSG_RKEY_REQ:
    case MSG_PING:
        on_sender_msg(tl, &h, data, length, reply_ep);
        break;
    default:
        break;
    }
    return UCS_OK;
}

/* ---------------------------------------------------------------- progress thread */

/* Hands an endpoint over to the closing list (once); the progress thread frees it. */
static void ep_to_closing(ucx_iface_t *tl, ucx_ep_t *ep, bool graceful)
{
    pthread_mutex_lock(&tl->mu);
    if (!atomic_load(&ep->closing)) {
        atomic_store(&ep->closing, true);
        ep_unlink(tl, ep);
        ep->graceful = graceful;
        ep->next = tl->closing;
        tl->closing = ep;
    }
    pthread_mutex_unlock(&tl->mu);
}

/* Progress thread: delivers on_ep_error once, unless the owner closed the endpoint or
 * the instance is closing. Accepted endpoints are released afterwards. */
static void report(ucx_iface_t *tl, ucx_ep_t *ep, kvw_status_t st, const char *reason)
{
    pthread_mutex_lock(&tl->mu);
    bool go = !ep->reported && !atomic_load(&ep->closing) && !atomic_load(&tl->closed);
    ep->reported = true;
    if (ep->err_pending) {
        ep->err_pending = false;
        tl->num_err_pending--;
    }
    pthread_mutex_unlock(&tl->mu);
    if (go && tl->cb.on_ep_error)
        tl->cb.on_ep_error(tl->cb.arg, (kvw_tl_ep_h)(void *)ep, st, reason);
    if (ep->accepted)
        ep_to_closing(tl, ep, false);
}

static void dispatch_events(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    ucx_event_t *ev = tl->ev_head;
    tl->ev_head = tl->ev_tail = NULL;
    pthread_mutex_unlock(&tl->mu);
    while (ev) {
        ucx_event_t *next = ev->next;
        pthread_mutex_lock(&tl->mu);
        ucx_ep_t *ep;
        for (ep = tl->eps; ep && !(ep->accepted && ep->id == ev->acc_id); ep = ep->next)
            ;
        /* Nothing is delivered from a connection that failed, even before its
         * failure is reported. */
        if (ep && (ep->reported || atomic_load(&ep->closing) || atomic_load(&ep->failed)))
            ep = NULL;
        bool deliver = false;
        if (ep && ev->type == MSG_BYE)
            ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true, "the sender closed the connection");
        else if (ep && ev->oversized)
            ep_fail_locked(ep, KVW_ERR_MALFORMED, true, "notification of %zu bytes (limit %u)",
                           ev->len, KVW_TL_MAX_NOTIFY);
        else
            deliver = ep != NULL;
        pthread_mutex_unlock(&tl->mu);
        if (deliver && !atomic_load(&tl->closed))
            tl->cb.on_notify(tl->cb.arg, (kvw_tl_ep_h)(void *)ep,
                             ev->len ? ev->data : (const void *)"", ev->len);
        free(ev);
        ev = next;
    }
}

/*
 * Progress thread: reports pending failures. An accepted connection is reported only
 * once its rendezvous receives have ended (failed or landed), so that nothing of it
 * lands after on_ep_error; a receive that neither lands nor fails within the timeout
 * (a sender that stopped mid-transfer) no longer holds the report back, and the reason
 * says so.
 */
static void dispatch_errors(ucx_iface_t *tl)
{
    uint64_t now = kvw__now_ns(), limit = (uint64_t)tl->timeout_ms * 1000000ull;
    tl->err_deferred = false;
    for (;;) {
        char reason[sizeof(((ucx_ep_t *)NULL)->err_reason) + 64];
        kvw_status_t st = KVW_ERR_CONN_CLOSED;
        pthread_mutex_lock(&tl->mu);
        ucx_ep_t *ep = NULL;
        if (tl->num_err_pending > 0) {
            for (ep = tl->eps; ep; ep = ep->next) {
                if (!ep->err_pending)
                    continue;
                if (ep->accepted && ep->inflight > 0 && now - ep->failed_ns < limit) {
                    tl->err_deferred = true;
                    continue;
                }
                break;
            }
        }
        if (ep) {
            if (ep->accepted && ep->inflight > 0)
                snprintf(reason, sizeof(reason), "%s (%u receives still in flight)",
                         ep->err_reason, ep->inflight);
            else
                snprintf(reason, sizeof(reason), "%s", ep->err_reason);
            st = ep->err_status;
            ep->err_pending = false;
            tl->num_err_pending--;
        }
        pthread_mutex_unlock(&tl->mu);
        if (ep == NULL)
            return;
        report(tl, ep, st, reason);
    }
}

/* Progress thread: closes (and eventually frees) what ep_close and teardown handed
 * over. A graceful close says BYE and lets UCX flush it before the endpoint goes. */
static void reap_closing(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    ucx_ep_t *list = tl->closing;
    tl->closing = NULL;
    pthread_mutex_unlock(&tl->mu);
    while (list) {
        ucx_ep_t *ep = list;
        list = ep->next;
        pthread_rwlock_wrlock(&ep->rw); /* a put that is timing out may still hold it */
        ucp_ep_h uep = ep->uep;
        ep->uep = NULL;
        pthread_rwlock_unlock(&ep->rw);
        if (uep == NULL) {
            if (ep->close_incomplete) {
                ep->next = tl->zombies;
                tl->zombies = ep;
            } else {
                ep_free(ep);
            }
            continue;
        }
        bool alive = atomic_load(&ep->failed) == 0;
        msg_hdr_t bye = {.type = MSG_BYE, .to = ep->peer_token, .from = tl->token,
                         .a = ep->remote_id, .b = ep->id};
        close_uep_async(tl, uep, ep, alive && ep->graceful ? &bye : NULL);
    }
}

/* Progress thread: the endpoints of the instance, for work outside tl->mu (only this
 * thread frees endpoints, so the pointers stay valid meanwhile). Returns the count. */
static size_t snapshot(ucx_iface_t *tl, bool accepted)
{
    pthread_mutex_lock(&tl->mu);
    size_t n = 0;
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next)
        n += ep->accepted == accepted;
    if (n > tl->snap_cap) {
        ucx_ep_t **v = realloc(tl->snap, n * sizeof(*v));
        if (v) {
            tl->snap = v;
            tl->snap_cap = n;
        }
    }
    size_t k = 0;
    for (ucx_ep_t *ep = tl->eps; ep && k < tl->snap_cap; ep = ep->next)
        if (ep->accepted == accepted)
            tl->snap[k++] = ep;
    pthread_mutex_unlock(&tl->mu);
    return k;
}

/* Progress thread: pings every live connection, and fails accepted connections whose
 * sender went quiet. A stall of this thread itself (a slow callback, a stopped
 * process) must not count as the senders' silence. */
static void heartbeat(ucx_iface_t *tl, uint64_t now)
{
    if (now - tl->last_hb_ns < (uint64_t)UCX_HB_MS * 1000000ull)
        return;
    tl->last_hb_ns = now;
    size_t n = snapshot(tl, false);
    for (size_t i = 0; i < n; i++) {
        ucx_ep_t *ep = tl->snap[i];
        if (pthread_rwlock_tryrdlock(&ep->rw) != 0)
            continue; /* being closed */
        pthread_mutex_lock(&tl->mu);
        bool go = ep->established && !atomic_load(&ep->closing);
        pthread_mutex_unlock(&tl->mu);
        if (go && ep->uep && atomic_load(&ep->failed) == 0) {
            msg_hdr_t h = {.type = MSG_PING, .to = ep->peer_token, .from = tl->token,
                           .a = ep->remote_id, .b = ep->id};
            send_msg(tl, ep->uep, &h, true);
        }
        pthread_rwlock_unlock(&ep->rw);
    }
    bool stalled = now - tl->last_loop_ns > (uint64_t)UCX_HB_MS * 1000000ull;
    pthread_mutex_lock(&tl->mu);
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next) {
        if (!ep->accepted || ep->reported || atomic_load(&ep->closing))
            continue;
        if (stalled)
            ep->last_rx_ns = now;
        else if (now - ep->last_rx_ns > (uint64_t)UCX_HB_DEAD_MS * 1000000ull)
            ep_fail_locked(ep, KVW_ERR_CONN_CLOSED, true,
                           "no message or heartbeat from the sender for %u ms (process gone "
                           "or stopped?)",
                           UCX_HB_DEAD_MS);
    }
    pthread_mutex_unlock(&tl->mu);
}

/* Progress thread, once, when the instance closes: suppresses further callbacks,
 * releases accepted connections, and says BYE on connected ones. Those stay the
 * owner's (ep_close/fini free them, after the worker: their close is not tracked). */
static void shutdown_connected(ucx_iface_t *tl, ucx_ep_t *ep)
{
    pthread_rwlock_wrlock(&ep->rw);
    ucp_ep_h uep = ep->uep;
    ep->uep = NULL;
    int zero = 0;
    bool alive = atomic_compare_exchange_strong(&ep->failed, &zero, (int)KVW_ERR_SHUTDOWN);
    if (uep)
        ep->close_incomplete = true;
    pthread_rwlock_unlock(&ep->rw);
    if (uep == NULL)
        return;
    msg_hdr_t bye = {.type = MSG_BYE, .to = ep->peer_token, .from = tl->token,
                     .a = ep->remote_id, .b = ep->id};
    close_uep_async(tl, uep, NULL, alive ? &bye : NULL);
}

static void begin_shutdown(ucx_iface_t *tl)
{
    pthread_mutex_lock(&tl->mu);
    for (ucx_ep_t *ep = tl->eps; ep; ep = ep->next) {
        ep->reported = true;
        if (ep->err_pending) {
            ep->err_pending = false;
            tl->num_err_pending--;
        }
    }
    pthread_mutex_unlock(&tl->mu);
    size_t n = snapshot(tl, true);
    for (size_t i = 0; i < n; i++)
        ep_to_closing(tl, tl->snap[i], false);
    n = snapshot(tl, false);
    for (size_t i = 0; i < n; i++)
        shutdown_connected(tl, tl->snap[i]);
    reap_closing(tl);
}

static void *progress_thread(void *arg)
{
    ucx_iface_t *tl = arg;
    uint64_t shutdown_deadline = 0;
    tl->last_loop_ns = tl->last_hb_ns = kvw__now_ns();
    for (;;) {
        /* While a user thread waits on a request it progresses the worker itself;
         * progressing here as well would only fight over the worker's lock. Whatever
         * its progress hands over wakes this thread through wake_fd. */
        bool backoff = atomic_load(&tl->waiters) > 0;
        unsigned busy = 0;
        while (!backoff && busy < 64 && ucp_worker_progress(tl->worker) != 0)
            busy++;
        bool closed = atomic_load(&tl->closed);
        if (closed && shutdown_deadline == 0) {
            begin_shutdown(tl);
            shutdown_deadline = deadline_in(KVW_MIN(tl->timeout_ms, UCX_GOODBYE_MS));
        }
        dispatch_events(tl); /* after close: only frees them */
        if (!closed) {
            dispatch_errors(tl);
            uint64_t now = kvw__now_ns();
            heartbeat(tl, now);
            tl->last_loop_ns = now;
        }
        reap_closing(tl);
        poll_ops(tl);
        pthread_mutex_lock(&tl->mu);
        bool ops = tl->ops != NULL;
        bool pending = tl->ev_head != NULL || tl->closing != NULL ||
                       (tl->num_err_pending > 0 && !closed && !tl->err_deferred);
        pthread_mutex_unlock(&tl->mu);
        if (closed && (!ops || kvw__now_ns() >= shutdown_deadline))
            break;
        if (busy == 64 || pending)
            continue;
        int ms = ops || closed || tl->err_deferred || backoff ? 1 : UCX_POLL_MS;
        struct pollfd pfd[2] = {{.fd = tl->wake_fd, .events = POLLIN},
                                {.fd = tl->efd, .events = POLLIN}};
        nfds_t nfds = 1;
        if (tl->efd >= 0 && !backoff) {
            ucs_status_t s = ucp_worker_arm(tl->worker);
            if (s == UCS_ERR_BUSY)
                continue;
            if (s == UCS_OK)
                nfds = 2;
            else
                ms = 1; /* no wake-up support: poll often */
        } else {
            ms = 1;
        }
        if (poll(pfd, nfds, ms) > 0 && pfd[0].revents)
            kvw__tl_wake_drain(tl->wake_fd);
    }
    return NULL;
}

/* ---------------------------------------------------------------- ops */

static uint32_t timeout_from(const kvw_tl_params_t *params)
{
    if (params->timeout_ms)
        return params->timeout_ms;
    const char *env = getenv("KVW_UCX_TIMEOUT_MS");
    if (env && *env) {
        char *end;
        unsigned long v = strtoul(env, &end, 10);
        if (*end == '\0' && v > 0 && v <= UINT32_MAX)
            return (uint32_t)v;
    }
    return UCX_DEFAULT_TIMEOUT_MS;
}

/* Creates the context and worker; `v2` asks for UCX's compact address format. */
static kvw_status_t ucx_open(ucx_iface_t *tl, bool v2)
{
    ucp_config_t *cfg;
    ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
    if (s != UCS_OK)
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx init: cannot read the UCX configuration: %s",
                          ucs_status_string(s));
    if (v2)
        (void)ucp_config_modify(cfg, "ADDRESS_VERSION", "v2");
    ucp_params_t p = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
        .name = "kvwire",
    };
    s = ucp_init(&p, cfg, &tl->ctx);
    ucp_config_release(cfg);
    if (s != UCS_OK)
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx init: ucp_init failed: %s (UCX_TLS=%s)",
                          ucs_status_string(s), getenv("UCX_TLS") ? getenv("UCX_TLS") : "");
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_MULTI};
    s = ucp_worker_create(tl->ctx, &wp, &tl->worker);
    if (s != UCS_OK) {
        ucp_cleanup(tl->ctx);
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx init: ucp_worker_create failed: %s",
                          ucs_status_string(s));
    }
    ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE |
                                          UCP_WORKER_ATTR_FIELD_ADDRESS};
    s = ucp_worker_query(tl->worker, &wa);
    kvw_status_t st = KVW_OK;
    if (s != UCS_OK)
        st = kvw__error(KVW_ERR_IO, "ucx init: ucp_worker_query failed: %s",
                        ucs_status_string(s));
    else if (wa.thread_mode != UCS_THREAD_MODE_MULTI)
        st = kvw__error(KVW_ERR_UNSUPPORTED,
                        "ucx init: this UCX was built without multi-thread support");
    if (st != KVW_OK) {
        if (s == UCS_OK)
            ucp_worker_release_address(tl->worker, wa.address);
        ucp_worker_destroy(tl->worker);
        ucp_cleanup(tl->ctx);
        return st;
    }
    tl->waddr = wa.address;
    tl->waddr_len = wa.address_length;
    return KVW_OK;
}

static void ucx_shut(ucx_iface_t *tl)
{
    ucp_worker_release_address(tl->worker, tl->waddr);
    ucp_worker_destroy(tl->worker);
    ucp_cleanup(tl->ctx);
    tl->waddr = NULL;
    tl->worker = NULL;
    tl->ctx = NULL;
}

static kvw_status_t ucx_init(const kvw_tl_params_t *params, kvw_tl_h *tl_p)
{
    if (params == NULL || tl_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx init: params or tl_p is NULL");
    if (params->cb.on_notify == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx init: callbacks.on_notify is required");
    const char *mode = getenv("KVW_UCX_ERR_MODE");
    if (mode && *mode && strcmp(mode, "peer") != 0 && strcmp(mode, "none") != 0)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx init: KVW_UCX_ERR_MODE='%s' (expected 'peer' or 'none')", mode);
    const char *put = getenv("KVW_UCX_PUT");
    if (put && *put && strcmp(put, "am") != 0 && strcmp(put, "rma") != 0)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx init: KVW_UCX_PUT='%s' (expected 'am' or 'rma')", put);
    ucx_iface_t *tl = calloc(1, sizeof(*tl));
    if (tl == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx init: no memory");
    kvw_status_t st;
    tl->cb = params->cb;
    tl->timeout_ms = timeout_from(params);
    tl->peer_mode = !(mode && strcmp(mode, "none") == 0);
    tl->rma = put && strcmp(put, "rma") == 0;
    tl->efd = -1;
    atomic_init(&tl->closed, false);
    atomic_init(&tl->waiters, 0);
    pthread_mutex_init(&tl->mu, NULL);
    pthread_mutex_init(&tl->reg_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&tl->cv, &ca);
    pthread_condattr_destroy(&ca);
    do
        kvw__tl_random(&tl->token, sizeof(tl->token));
    while (tl->token == 0);

    tl->wake_fd = kvw__tl_wake_open();
    if (tl->wake_fd < 0) {
        st = kvw__error(KVW_ERR_IO, "ucx init: eventfd: %m");
        goto err_free;
    }
    st = ucx_open(tl, false);
    if (st != KVW_OK)
        goto err_close_wake;
    if (UCX_ADDR_HDR + tl->waddr_len > KVW_TL_MAX_ADDR && getenv("UCX_ADDRESS_VERSION") == NULL) {
        /* Many devices make long addresses; UCX's v2 format is more compact. */
        ucx_shut(tl);
        st = ucx_open(tl, true);
        if (st != KVW_OK)
            goto err_close_wake;
    }
    if (UCX_ADDR_HDR + tl->waddr_len > KVW_TL_MAX_ADDR) {
        st = kvw__error(KVW_ERR_UNSUPPORTED,
                        "ucx init: the UCX worker address takes %zu bytes, more than the %u "
                        "a transport address may have (KVW_TL_MAX_ADDR); limit the devices "
                        "with UCX_NET_DEVICES or UCX_TLS",
                        UCX_ADDR_HDR + tl->waddr_len, KVW_TL_MAX_ADDR);
        goto err_shut;
    }
    ucp_am_handler_param_t ap = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = UCX_AM_ID,
                                 .flags = UCP_AM_FLAG_WHOLE_MSG,
                                 .cb = am_cb,
                                 .arg = tl};
    ucs_status_t s = ucp_worker_set_am_recv_handler(tl->worker, &ap);
    if (s != UCS_OK) {
        st = kvw__error(KVW_ERR_IO, "ucx init: cannot set the active message handler: %s",
                        ucs_status_string(s));
        goto err_shut;
    }
    if (ucp_worker_get_efd(tl->worker, &tl->efd) != UCS_OK)
        tl->efd = -1; /* the thread then polls every millisecond */
    int err = pthread_create(&tl->thread, NULL, progress_thread, tl);
    if (err != 0) {
        errno = err;
        st = kvw__error(KVW_ERR_INTERNAL, "ucx init: cannot start the progress thread: %m");
        goto err_shut;
    }
    tl->thread_started = true;
    *tl_p = (kvw_tl_h)(void *)tl;
    return KVW_OK;

err_shut:
    ucx_shut(tl);
err_close_wake:
    close(tl->wake_fd);
err_free:
    pthread_mutex_destroy(&tl->mu);
    pthread_mutex_destroy(&tl->reg_mu);
    pthread_cond_destroy(&tl->cv);
    free(tl);
    return st;
}

static kvw_status_t ucx_address(kvw_tl_h tl_h, void *buf, size_t *len_p)
{
    ucx_iface_t *tl = to_iface(tl_h);
    if (tl == NULL || buf == NULL || len_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx address: NULL argument");
    size_t need = UCX_ADDR_HDR + tl->waddr_len;
    if (*len_p < need)
        return kvw__error(KVW_ERR_BUFFER_TOO_SMALL, "ucx address: needs %zu bytes, buffer has %zu",
                          need, *len_p);
    uint8_t *p = buf;
    memset(p, 0, UCX_ADDR_HDR);
    kvw__le32_put(p, UCX_ADDR_MAGIC);
    p[4] = UCX_VERSION;
    kvw__le64_put(p + 8, tl->token);
    memcpy(p + UCX_ADDR_HDR, tl->waddr, tl->waddr_len);
    *len_p = need;
    return KVW_OK;
}

static kvw_status_t ucx_mem_reg(kvw_tl_h tl_h, void *addr, uint64_t len, kvw_mem_kind_t kind,
                                uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                                size_t *rkey_len_p)
{
    ucx_iface_t *tl = to_iface(tl_h);
    uint64_t end;
    if (tl == NULL || mem_p == NULL || rkey_buf == NULL || rkey_len_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx mem_reg: NULL argument");
    if (kind != KVW_MEM_HOST)
        return kvw__error(KVW_ERR_UNSUPPORTED,
                          "ucx mem_reg: region %llu: only host memory can be registered "
                          "(memory kind %d)",
                          (unsigned long long)region_id, (int)kind);
    if ((addr == NULL && len > 0) || !kvw__add_u64((uint64_t)(uintptr_t)addr, len, &end))
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx mem_reg: region %llu: bad range %p + %llu",
                          (unsigned long long)region_id, addr, (unsigned long long)len);
    pthread_mutex_lock(&tl->reg_mu);
    bool dup = *region_slot(tl, region_id) != NULL;
    pthread_mutex_unlock(&tl->reg_mu);
    if (dup)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx mem_reg: region id %llu is already registered",
                          (unsigned long long)region_id);
    ucx_region_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx mem_reg: no memory");
    r->id = region_id;
    r->base = (uint64_t)(uintptr_t)addr;
    r->len = len;
    kvw_status_t st;
    void *packed = NULL;
    size_t plen = 0;
    if (len > 0) {
        ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                                 UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                                 UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                                   .address = addr,
                                   .length = (size_t)len,
                                   .memory_type = UCS_MEMORY_TYPE_HOST};
        ucs_status_t s = ucp_mem_map(tl->ctx, &mp, &r->memh);
        if (s != UCS_OK) {
            st = kvw__error(s == UCS_ERR_NO_MEMORY ? KVW_ERR_NO_MEMORY : KVW_ERR_IO,
                            "ucx mem_reg: region %llu: ucp_mem_map of %p + %llu failed: %s",
                            (unsigned long long)region_id, addr, (unsigned long long)len,
                            ucs_status_string(s));
            goto err_free;
        }
        s = ucp_rkey_pack(tl->ctx, r->memh, &packed, &plen);
        if (s != UCS_OK) {
            st = kvw__error(KVW_ERR_IO, "ucx mem_reg: region %llu: ucp_rkey_pack failed: %s",
                            (unsigned long long)region_id, ucs_status_string(s));
            goto err_unmap;
        }
        if (UCX_RKEY_HDR + plen > KVW_TL_MAX_RKEY) {
            st = kvw__error(KVW_ERR_UNSUPPORTED,
                            "ucx mem_reg: region %llu: the packed UCX key takes %zu bytes, more "
                            "than the %u a remote key may have (KVW_TL_MAX_RKEY)",
                            (unsigned long long)region_id, UCX_RKEY_HDR + plen,
                            KVW_TL_MAX_RKEY);
            goto err_release;
        }
    }
    pthread_mutex_lock(&tl->reg_mu);
    ucx_region_t **slot = region_slot(tl, region_id);
    if (*slot) { /* registered concurrently */
        pthread_mutex_unlock(&tl->reg_mu);
        st = kvw__error(KVW_ERR_INVALID_PARAM, "ucx mem_reg: region id %llu is already registered",
                        (unsigned long long)region_id);
        goto err_release;
    }
    *slot = r; /* r->next is NULL: the end of the bucket */
    pthread_mutex_unlock(&tl->reg_mu);

    uint8_t *p = rkey_buf;
    memset(p, 0, UCX_RKEY_HDR);
    kvw__le32_put(p, UCX_RKEY_MAGIC);
    p[4] = UCX_VERSION;
    kvw__le64_put(p + 8, tl->token);
    kvw__le64_put(p + 16, region_id);
    kvw__le64_put(p + 24, r->base);
    kvw__le64_put(p + 32, len);
    kvw__le32_put(p + 40, (uint32_t)plen);
    if (plen)
        memcpy(p + UCX_RKEY_HDR, packed, plen);
    if (packed)
        ucp_rkey_buffer_release(packed);
    *rkey_len_p = UCX_RKEY_HDR + plen;
    *mem_p = (kvw_tl_mem_h)(void *)r;
    return KVW_OK;

err_release:
    if (packed)
        ucp_rkey_buffer_release(packed);
err_unmap:
    if (r->memh)
        ucp_mem_unmap(tl->ctx, r->memh);
err_free:
    free(r);
    return st;
}

static void ucx_mem_dereg(kvw_tl_h tl_h, kvw_tl_mem_h mem)
{
    ucx_iface_t *tl = to_iface(tl_h);
    ucx_region_t *r = (ucx_region_t *)(void *)mem;
    if (tl == NULL || r == NULL)
        return;
    pthread_mutex_lock(&tl->reg_mu);
    ucx_region_t **pp = region_slot(tl, r->id);
    bool found = *pp == r;
    if (found)
        *pp = r->next;
    pthread_mutex_unlock(&tl->reg_mu);
    if (!found)
        return;
    /* No new write can start; wait for the rendezvous receives already writing. */
    uint64_t deadline = deadline_in(tl->timeout_ms);
    for (;;) {
        pthread_mutex_lock(&tl->reg_mu);
        unsigned busy = r->inflight;
        pthread_mutex_unlock(&tl->reg_mu);
        if (busy == 0)
            break;
        if (kvw__now_ns() >= deadline) {
            /* Keep the registration until fini rather than let UCX write into memory
             * that is no longer mapped for it. */
            pthread_mutex_lock(&tl->reg_mu);
            r->next = tl->dead_regions;
            tl->dead_regions = r;
            pthread_mutex_unlock(&tl->reg_mu);
            return;
        }
        if (ucp_worker_progress(tl->worker) == 0)
            sched_yield();
    }
    if (r->memh)
        ucp_mem_unmap(tl->ctx, r->memh);
    free(r);
}

/* Waits for an answer that the AM handler records under tl->mu. The waiting thread
 * progresses the worker itself, so this also works on the progress thread (from a
 * user callback). `done` runs under tl->mu. */
typedef bool (*wait_pred_t)(ucx_ep_t *ep, void *arg);

static bool wait_reply(ucx_ep_t *ep, wait_pred_t done, void *arg, uint64_t deadline)
{
    ucx_iface_t *tl = ep->tl;
    for (;;) {
        unsigned n = ucp_worker_progress(tl->worker);
        pthread_mutex_lock(&tl->mu);
        bool ok = done(ep, arg);
        bool stop = ok || atomic_load(&ep->failed) != 0 || atomic_load(&tl->closed) ||
                    kvw__now_ns() >= deadline;
        if (!stop && n == 0)
            cond_wait_ms(tl, 1);
        pthread_mutex_unlock(&tl->mu);
        if (stop)
            return ok;
    }
}

static bool hello_acked(ucx_ep_t *ep, void *arg)
{
    (void)arg;
    return ep->established;
}

static bool rkey_answered(ucx_ep_t *ep, void *arg)
{
    (void)ep;
    return ((ucx_wait_t *)arg)->done;
}

/* Fails a connected endpoint for good after a put/notify error and, when requests
 * may still be in flight, closes the UCX endpoint with FORCE so that they complete
 * before the caller's buffers go away. Not called with ep->rw held. */
static void ep_fail_sync(ucx_ep_t *ep, kvw_status_t st, bool kill)
{
    ucx_iface_t *tl = ep->tl;
    pthread_mutex_lock(&tl->mu);
    ep_fail_locked(ep, st, false, "%s", kvw_status_string(st));
    pthread_mutex_unlock(&tl->mu);
    if (!kill)
        return;
    pthread_rwlock_wrlock(&ep->rw);
    ucp_ep_h uep = ep->uep;
    ep->uep = NULL;
    if (uep && !uep_close_wait(tl, uep, true))
        ep->close_incomplete = true;
    pthread_rwlock_unlock(&ep->rw);
}

static kvw_status_t ucx_connect(kvw_tl_h tl_h, const void *addr, size_t len, kvw_tl_ep_h *ep_p)
{
    ucx_iface_t *tl = to_iface(tl_h);
    const uint8_t *a = addr;
    if (tl == NULL || ep_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx connect: NULL argument");
    if (atomic_load(&tl->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "ucx connect: the transport is closed");
    if (a == NULL || len <= UCX_ADDR_HDR || len > UCX_ADDR_HDR + UCX_MAX_PEER_ADDR ||
        kvw__le32_get(a) != UCX_ADDR_MAGIC || a[4] != UCX_VERSION || a[5] || a[6] || a[7])
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx connect: %zu bytes are not a ucx address of version %u", len,
                          UCX_VERSION);
    uint64_t token = kvw__le64_get(a + 8);
    ucx_ep_t *ep = ep_new(tl, false);
    void *waddr = malloc(len - UCX_ADDR_HDR); /* aligned copy for UCX */
    if (ep == NULL || waddr == NULL) {
        if (ep)
            ep_free(ep);
        free(waddr);
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx connect: no memory");
    }
    memcpy(waddr, a + UCX_ADDR_HDR, len - UCX_ADDR_HDR);
    kvw_status_t st;
    ep->peer_token = token;
    snprintf(ep->peer, sizeof(ep->peer), "receiver %016llx", (unsigned long long)token);
    pthread_mutex_lock(&tl->mu);
    ep->id = ++tl->next_id;
    ep_link(tl, ep);
    pthread_mutex_unlock(&tl->mu);

    uint64_t deadline = deadline_in(tl->timeout_ms);
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = waddr,
        .err_mode = tl->peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
    };
    if (tl->peer_mode) {
        p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        p.err_handler.cb = ep_err_cb;
        p.err_handler.arg = ep;
    }
    uint8_t hdr[UCX_MSG_HDR];
    /* Read-locked like every user of uep: close() may shut the endpoint down. */
    pthread_rwlock_rdlock(&ep->rw);
    ucs_status_t s = ucp_ep_create(tl->worker, &p, &ep->uep);
    free(waddr);
    if (s != UCS_OK) {
        ep->uep = NULL;
        pthread_rwlock_unlock(&ep->rw);
        st = kvw__error(s == UCS_ERR_INVALID_PARAM ? KVW_ERR_INVALID_PARAM : map_ucs(s),
                        "ucx connect to %s: ucp_ep_create failed: %s", ep->peer,
                        ucs_status_string(s));
        goto err_unlink;
    }
    msg_hdr_t h = {.type = MSG_HELLO, .to = token, .from = tl->token, .b = ep->id,
                   .c = (uint64_t)getpid()};
    hdr_put(hdr, &h);
    s = req_wait(tl, am_post(ep->uep, hdr, NULL, 0, true), deadline, true);
    if (s == UCS_OK)
        wait_reply(ep, hello_acked, NULL, deadline);
    pthread_rwlock_unlock(&ep->rw);
    pthread_mutex_lock(&tl->mu);
    bool acked = ep->established;
    int failed = atomic_load(&ep->failed);
    if (failed != 0)
        st = kvw__error((kvw_status_t)failed, "ucx connect: %s",
                        ep->err_reason[0] ? ep->err_reason : kvw_status_string(failed));
    pthread_mutex_unlock(&tl->mu);
    if (acked && failed == 0) {
        *ep_p = (kvw_tl_ep_h)(void *)ep;
        return KVW_OK;
    }
    if (failed == 0 && atomic_load(&tl->closed))
        st = kvw__error(KVW_ERR_SHUTDOWN, "ucx connect to %s: the transport was closed",
                        ep->peer);
    else if (failed == 0 && s != UCS_OK && s != UCS_ERR_TIMED_OUT)
        st = kvw__error(map_ucs(s), "ucx connect to %s: HELLO failed: %s", ep->peer,
                        ucs_status_string(s));
    else if (failed == 0)
        st = kvw__error(KVW_ERR_TIMEOUT, "ucx connect to %s: no answer within %u ms", ep->peer,
                        tl->timeout_ms);
    pthread_rwlock_wrlock(&ep->rw);
    ucp_ep_h uep = ep->uep; /* NULL if close() already shut it down */
    ep->uep = NULL;
    if (uep && !uep_close_wait(tl, uep, true))
        ep->close_incomplete = true;
    pthread_rwlock_unlock(&ep->rw);
err_unlink:
    /* Only the progress thread (or fini) frees endpoints: it may hold this one. */
    ep_to_closing(tl, ep, false);
    kvw__tl_wake(tl->wake_fd);
    return st;
}

static kvw_status_t check_sendable(ucx_ep_t *ep, const char *what)
{
    if (ep == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx %s: endpoint is NULL", what);
    if (ep->accepted)
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx %s: accepted endpoints only receive", what);
    if (atomic_load(&ep->tl->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "ucx %s: the transport is closed", what);
    return KVW_OK;
}

/* ep->rw read-locked. */
static kvw_status_t check_alive(ucx_ep_t *ep, const char *what)
{
    if (atomic_load(&ep->failed) == 0 && ep->uep != NULL)
        return KVW_OK;
    pthread_mutex_lock(&ep->tl->mu);
    kvw_status_t st = kvw__error(KVW_ERR_CONN_CLOSED, "ucx %s: the endpoint failed earlier: %s",
                                 what, ep->err_reason[0] ? ep->err_reason : "closed");
    pthread_mutex_unlock(&ep->tl->mu);
    return st;
}

static void wait_link(ucx_iface_t *tl, ucx_wait_t *w, bool link)
{
    pthread_mutex_lock(&tl->mu);
    if (link) {
        w->id = ++tl->next_id;
        w->next = tl->waits;
        tl->waits = w;
    } else {
        for (ucx_wait_t **pp = &tl->waits; *pp; pp = &(*pp)->next)
            if (*pp == w) {
                *pp = w->next;
                break;
            }
    }
    pthread_mutex_unlock(&tl->mu);
}

/* ep->rw read-locked. Asks the receiver whether the region is still registered as
 * the key says; sets *kill_p when the request may still use this stack frame. */
static kvw_status_t rkey_check(ucx_ep_t *ep, uint64_t region, uint64_t base, uint64_t rlen,
                               bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    ucx_wait_t w = {.ep_id = ep->id};
    wait_link(tl, &w, true);
    uint8_t hdr[UCX_MSG_HDR];
    msg_hdr_t h = {.type = MSG_RKEY_REQ, .to = ep->peer_token, .from = tl->token,
                   .a = ep->remote_id, .b = ep->id, .c = w.id, .d = region, .e = base,
                   .f = rlen};
    hdr_put(hdr, &h);
    uint64_t deadline = deadline_in(tl->timeout_ms);
    ucs_status_t s = req_wait(tl, am_post(ep->uep, hdr, NULL, 0, true), deadline, true);
    bool answered = s == UCS_OK && wait_reply(ep, rkey_answered, &w, deadline);
    wait_link(tl, &w, false);
    if (s == UCS_ERR_TIMED_OUT || s == UCS_ERR_CANCELED) {
        *kill_p = true; /* the request may still read `hdr` */
        if (atomic_load(&tl->closed))
            return kvw__error(KVW_ERR_SHUTDOWN, "ucx rkey_unpack: the transport was closed");
        if (s == UCS_ERR_TIMED_OUT)
            return kvw__error(KVW_ERR_TIMEOUT,
                              "ucx rkey_unpack: region %llu: request not sent within %u ms",
                              (unsigned long long)region, tl->timeout_ms);
    }
    if (s != UCS_OK)
        return kvw__error(map_ucs(s), "ucx rkey_unpack: region %llu: request failed: %s",
                          (unsigned long long)region, ucs_status_string(s));
    if (!answered) {
        pthread_mutex_lock(&tl->mu);
        kvw_status_t st =
            atomic_load(&ep->failed) != 0
                ? kvw__error(KVW_ERR_CONN_CLOSED, "ucx rkey_unpack: region %llu: %s",
                             (unsigned long long)region, ep->err_reason)
                : kvw__error(KVW_ERR_TIMEOUT,
                             "ucx rkey_unpack: region %llu: no answer from %s within %u ms",
                             (unsigned long long)region, ep->peer, tl->timeout_ms);
        pthread_mutex_unlock(&tl->mu);
        return st;
    }
    if (w.status == KVW_ERR_NOT_FOUND)
        return kvw__error(KVW_ERR_NOT_FOUND,
                          "ucx rkey_unpack: region %llu is not registered at %s (deregistered?)",
                          (unsigned long long)region, ep->peer);
    if (w.status != KVW_OK)
        return kvw__error(KVW_ERR_REJECTED,
                          "ucx rkey_unpack: %s registers region %llu at another address or "
                          "length than the key says (0x%llx + %llu)",
                          ep->peer, (unsigned long long)region, (unsigned long long)base,
                          (unsigned long long)rlen);
    return KVW_OK;
}

static kvw_status_t ucx_rkey_unpack(kvw_tl_ep_h ep_h, const void *buf, size_t len,
                                    kvw_tl_rkey_h *rkey_p)
{
    ucx_ep_t *ep = to_ep(ep_h);
    const uint8_t *p = buf;
    if (ep == NULL || buf == NULL || rkey_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx rkey_unpack: NULL argument");
    if (ep->accepted)
        return kvw__error(KVW_ERR_UNSUPPORTED, "ucx rkey_unpack: accepted endpoints only receive");
    if (len < UCX_RKEY_HDR || kvw__le32_get(p) != UCX_RKEY_MAGIC || p[4] != UCX_VERSION ||
        p[5] || p[6] || p[7] || kvw__le32_get(p + 44) != 0 ||
        len != UCX_RKEY_HDR + (size_t)kvw__le32_get(p + 40))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx rkey_unpack: %zu bytes are not a ucx remote key of version %u",
                          len, UCX_VERSION);
    uint64_t token = kvw__le64_get(p + 8);
    if (token != ep->peer_token)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx rkey_unpack: the key was packed by receiver %016llx, but this "
                          "endpoint leads to receiver %016llx",
                          (unsigned long long)token, (unsigned long long)ep->peer_token);
    uint64_t region = kvw__le64_get(p + 16), base = kvw__le64_get(p + 24),
             rlen = kvw__le64_get(p + 32), end;
    size_t ulen = len - UCX_RKEY_HDR;
    if (!kvw__add_u64(base, rlen, &end) || (rlen > 0) != (ulen > 0))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "ucx rkey_unpack: region %llu: inconsistent key (base 0x%llx, %llu "
                          "bytes, %zu key bytes)",
                          (unsigned long long)region, (unsigned long long)base,
                          (unsigned long long)rlen, ulen);
    ucx_iface_t *tl = ep->tl;
    if (atomic_load(&tl->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "ucx rkey_unpack: the transport is closed");
    ucx_rkey_t *rk = calloc(1, sizeof(*rk));
    void *copy = ulen ? malloc(ulen) : NULL; /* aligned copy for UCX */
    if (rk == NULL || (ulen && copy == NULL)) {
        free(rk);
        free(copy);
        return kvw__error(KVW_ERR_NO_MEMORY, "ucx rkey_unpack: no memory");
    }
    rk->tl = tl;
    rk->ep = ep;
    rk->region_id = region;
    rk->base = base;
    rk->len = rlen;

    bool kill = false;
    pthread_rwlock_rdlock(&ep->rw);
    kvw_status_t st = check_alive(ep, "rkey_unpack");
    if (st == KVW_OK)
        st = rkey_check(ep, region, base, rlen, &kill);
    if (st == KVW_OK && ulen > 0) {
        memcpy(copy, p + UCX_RKEY_HDR, ulen);
        ucs_status_t s = ucp_ep_rkey_unpack(ep->uep, copy, &rk->urkey);
        if (s != UCS_OK)
            st = kvw__error(KVW_ERR_INVALID_PARAM,
                            "ucx rkey_unpack: region %llu: UCX cannot unpack the key: %s",
                            (unsigned long long)region, ucs_status_string(s));
    }
    pthread_rwlock_unlock(&ep->rw);
    free(copy);
    if (kill)
        ep_fail_sync(ep, KVW_ERR_TIMEOUT, true);
    if (st != KVW_OK) {
        free(rk);
        return st;
    }
    pthread_mutex_lock(&tl->mu);
    rk->next = tl->rkeys;
    if (rk->next)
        rk->next->prev = rk;
    tl->rkeys = rk;
    pthread_mutex_unlock(&tl->mu);
    *rkey_p = (kvw_tl_rkey_h)(void *)rk;
    return KVW_OK;
}

static void ucx_rkey_release(kvw_tl_rkey_h rkey)
{
    ucx_rkey_t *rk = (ucx_rkey_t *)(void *)rkey;
    if (rk == NULL)
        return;
    ucx_iface_t *tl = rk->tl;
    pthread_mutex_lock(&tl->mu);
    if (rk->prev)
        rk->prev->next = rk->next;
    else
        tl->rkeys = rk->next;
    if (rk->next)
        rk->next->prev = rk->prev;
    pthread_mutex_unlock(&tl->mu);
    if (rk->urkey)
        ucp_rkey_destroy(rk->urkey);
    free(rk);
}

/* Waits for the oldest requests first (they usually complete in order); the deadline
 * restarts whenever one completes, so a long stream is bounded per step, not in
 * total. Releases every request it was given, even on failure. */
static ucs_status_t wait_all(ucx_iface_t *tl, void **reqs, size_t n)
{
    ucs_status_t first = UCS_OK;
    size_t i = 0;
    uint64_t deadline = deadline_in(tl->timeout_ms);
    atomic_fetch_add(&tl->waiters, 1);
    while (i < n) {
        ucs_status_t s = ucp_request_check_status(reqs[i]);
        if (s != UCS_INPROGRESS) {
            ucp_request_free(reqs[i++]);
            if (s != UCS_OK && first == UCS_OK)
                first = s;
            deadline = deadline_in(tl->timeout_ms);
            continue;
        }
        if (first == UCS_OK && atomic_load(&tl->closed))
            first = UCS_ERR_CANCELED; /* close(): pending calls fail */
        if (first != UCS_OK || kvw__now_ns() >= deadline) {
            /* Give up: the rest go back to UCX (the caller force-closes). */
            while (i < n)
                ucp_request_free(reqs[i++]);
            if (first == UCS_OK)
                first = UCS_ERR_TIMED_OUT;
            break;
        }
        if (ucp_worker_progress(tl->worker) == 0)
            sched_yield();
    }
    atomic_fetch_sub(&tl->waiters, 1);
    return first;
}

/* The highest offset written to one rkey so far in a put() call. */
typedef struct fence_slot {
    const ucx_rkey_t *rk;
    uint64_t hi;
} fence_slot_t;

/* The outcome of a batch of UCX requests as a kvwire status (ep->rw read-locked). */
static kvw_status_t puts_status(ucx_ep_t *ep, ucs_status_t s, bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    if (s == UCS_OK)
        return KVW_OK;
    *kill_p = true; /* requests may still reference the caller's buffers */
    if (s == UCS_ERR_CANCELED && atomic_load(&tl->closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "ucx put: the transport was closed");
    if (s == UCS_ERR_TIMED_OUT)
        return kvw__error(KVW_ERR_TIMEOUT,
                          "ucx put to %s: no put completed within %u ms (receiver stalled?)",
                          ep->peer, tl->timeout_ms);
    pthread_mutex_lock(&tl->mu);
    kvw_status_t st = atomic_load(&ep->failed) != 0
                          ? kvw__error(KVW_ERR_CONN_CLOSED, "ucx put: %s", ep->err_reason)
                          : kvw__error(map_ucs(s), "ucx put to %s: %s", ep->peer,
                                       ucs_status_string(s));
    pthread_mutex_unlock(&tl->mu);
    return st;
}

/*
 * ep->rw read-locked. The default data path: one DATA message per write, which the
 * receiver applies itself (see on_data). UCX sends small ones eagerly (the receiver
 * copies them) and large ones by rendezvous (received straight into place, with RDMA
 * where the fabric has it). Eager messages are applied in the order they were sent; a
 * rendezvous write has landed when its request completes. So a write that may overlap
 * an earlier one of the call waits for the outstanding requests first.
 */
static kvw_status_t post_am_puts(ucx_ep_t *ep, uint64_t room, const kvw_tl_put_t *puts,
                                 size_t n, bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    uint8_t hdrs[UCX_INFLIGHT][UCX_MSG_HDR]; /* live until their request completes */
    void *reqs[UCX_INFLIGHT];
    size_t nreq = 0;
    uint64_t inflight = 0;
    fence_slot_t slots[UCX_FENCE_SLOTS];
    size_t nslots = 0;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                               .memory_type = UCS_MEMORY_TYPE_HOST};
    ucs_status_t s = UCS_OK;
    for (size_t i = 0; i < n && s == UCS_OK; i++) {
        const ucx_rkey_t *rk = (const ucx_rkey_t *)(const void *)puts[i].rkey;
        if (puts[i].len == 0)
            continue;
        size_t k = 0;
        while (k < nslots && slots[k].rk != rk)
            k++;
        if ((k < nslots && puts[i].dst_off < slots[k].hi) ||
            (k == nslots && nslots == UCX_FENCE_SLOTS)) {
            s = wait_all(tl, reqs, nreq);
            nreq = 0;
            inflight = 0;
            nslots = 0;
            k = 0;
            if (s != UCS_OK)
                break;
        }
        if (k == nslots)
            slots[nslots++] = (fence_slot_t){.rk = rk, .hi = 0};
        slots[k].hi = KVW_MAX(slots[k].hi, puts[i].dst_off + puts[i].len);
        msg_hdr_t h = {.type = MSG_DATA, .to = ep->peer_token, .from = tl->token,
                       .a = ep->remote_id, .b = ep->id, .c = rk->region_id,
                       .d = puts[i].dst_off, .e = room};
        hdr_put(hdrs[nreq], &h);
        void *req = ucp_am_send_nbx(ep->uep, UCX_AM_ID, hdrs[nreq], UCX_MSG_HDR, puts[i].src,
                                    (size_t)puts[i].len, &prm);
        if (UCS_PTR_IS_ERR(req)) {
            s = UCS_PTR_STATUS(req);
            break;
        }
        if (req == NULL)
            continue; /* done: its header slot is free again */
        reqs[nreq++] = req;
        inflight += puts[i].len;
        if (nreq == UCX_INFLIGHT || inflight >= UCX_INFLIGHT_BYTES) {
            s = wait_all(tl, reqs, nreq);
            nreq = 0;
            inflight = 0;
        }
    }
    ucs_status_t w = wait_all(tl, reqs, nreq);
    return puts_status(ep, s != UCS_OK ? s : w, kill_p);
}

/* ep->rw read-locked. The "rma" data path (KVW_UCX_PUT=rma): ucp_put_nbx per write,
 * waiting for local completion. */
static kvw_status_t post_rma_puts(ucx_ep_t *ep, const kvw_tl_put_t *puts, size_t n,
                                  bool *kill_p)
{
    ucx_iface_t *tl = ep->tl;
    void *reqs[UCX_INFLIGHT];
    size_t nreq = 0;
    uint64_t inflight = 0;
    fence_slot_t slots[UCX_FENCE_SLOTS];
    size_t nslots = 0;
    bool posted = false;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                               .memory_type = UCS_MEMORY_TYPE_HOST};
    ucs_status_t s = UCS_OK;
    if (atomic_exchange(&ep->dirty, false))
        (void)ucp_worker_fence(tl->worker); /* after the writes of earlier calls */
    for (size_t i = 0; i < n && s == UCS_OK; i++) {
        const ucx_rkey_t *rk = (const ucx_rkey_t *)(const void *)puts[i].rkey;
        if (puts[i].len == 0)
            continue;
        /* Order against earlier writes of this call that may overlap. */
        size_t k = 0;
        while (k < nslots && slots[k].rk != rk)
            k++;
        if (posted && ((k < nslots && puts[i].dst_off < slots[k].hi) ||
                       (k == nslots && nslots == UCX_FENCE_SLOTS))) {
            (void)ucp_worker_fence(tl->worker);
            nslots = 0;
            k = 0;
        }
        if (k == nslots)
            slots[nslots++] = (fence_slot_t){.rk = rk, .hi = 0};
        slots[k].hi = KVW_MAX(slots[k].hi, puts[i].dst_off + puts[i].len);
        void *req = ucp_put_nbx(ep->uep, puts[i].src, (size_t)puts[i].len,
                                rk->base + puts[i].dst_off, rk->urkey, &prm);
        posted = true;
        if (UCS_PTR_IS_ERR(req)) {
            s = UCS_PTR_STATUS(req);
            break;
        }
        if (req != NULL) {
            reqs[nreq++] = req;
            inflight += puts[i].len;
            if (nreq == UCX_INFLIGHT || inflight >= UCX_INFLIGHT_BYTES) {
                s = wait_all(tl, reqs, nreq);
                nreq = 0;
                inflight = 0;
            }
        }
    }
    if (posted)
        atomic_store(&ep->dirty, true);
    ucs_status_t w = wait_all(tl, reqs, nreq);
    return puts_status(ep, s != UCS_OK ? s : w, kill_p);
}

static kvw_status_t ucx_put(kvw_tl_ep_h ep_h, uint64_t room, const kvw_tl_put_t *puts, size_t n)
{
    ucx_ep_t *ep = to_ep(ep_h);
    kvw_status_t st = check_sendable(ep, "put");
    if (st != KVW_OK)
        return st;
    if (n > 0 && puts == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx put: puts is NULL");
    /* Check everything before moving a byte. */
    for (size_t i = 0; i < n; i++) {
        const ucx_rkey_t *rk = (const ucx_rkey_t *)(const void *)puts[i].rkey;
        if (rk == NULL || rk->ep != ep)
            return kvw__error(KVW_ERR_INVALID_PARAM,
                              "ucx put %zu of %zu: the rkey is NULL or was unpacked on another "
                              "endpoint",
                              i, n);
        if (puts[i].dst_off > rk->len || puts[i].len > rk->len - puts[i].dst_off)
            return kvw__error(KVW_ERR_OUT_OF_RANGE,
                              "ucx put %zu of %zu: offset %llu + %llu bytes is outside remote "
                              "region %llu of %llu bytes",
                              i, n, (unsigned long long)puts[i].dst_off,
                              (unsigned long long)puts[i].len, (unsigned long long)rk->region_id,
                              (unsigned long long)rk->len);
        if (puts[i].src == NULL && puts[i].len > 0)
            return kvw__error(KVW_ERR_INVALID_PARAM, "ucx put %zu of %zu: src is NULL", i, n);
    }
    bool kill = false;
    pthread_rwlock_rdlock(&ep->rw);
    st = check_alive(ep, "put");
    bool was_alive = st == KVW_OK;
    if (st == KVW_OK)
        st = ep->tl->rma ? post_rma_puts(ep, puts, n, &kill)
                         : post_am_puts(ep, room, puts, n, &kill);
    pthread_rwlock_unlock(&ep->rw);
    if (st != KVW_OK && was_alive)
        ep_fail_sync(ep, st, kill); /* the contract: a failed put fails the endpoint */
    return st;
}

static kvw_status_t ucx_notify(kvw_tl_ep_h ep_h, const void *msg, size_t len)
{
    ucx_ep_t *ep = to_ep(ep_h);
    kvw_status_t st = check_sendable(ep, "notify");
    if (st != KVW_OK)
        return st;
    if (len > KVW_TL_MAX_NOTIFY || (msg == NULL && len > 0))
        return kvw__error(KVW_ERR_INVALID_PARAM, "ucx notify: %zu bytes (limit %u), msg %p", len,
                          KVW_TL_MAX_NOTIFY, msg);
    ucx_iface_t *tl = ep->tl;
    uint8_t hdr[UCX_MSG_HDR];
    bool kill = false;
    pthread_rwlock_rdlock(&ep->rw);
    st = check_alive(ep, "notify");
    bool was_alive = st == KVW_OK;
    if (st == KVW_OK) {
        /* Every put posted before this call must have landed before the message. */
        ucp_request_param_t prm = {.op_attr_mask = 0};
        ucs_status_t s = req_wait(tl, ucp_ep_flush_nbx(ep->uep, &prm),
                                  deadline_in(tl->timeout_ms), true);
        const char *step = "flush";
        if (s == UCS_OK) {
            atomic_store(&ep->dirty, false);
            msg_hdr_t h = {.type = MSG_NOTIFY, .to = ep->peer_token, .from = tl->token,
                           .a = ep->remote_id, .b = ep->id};
            hdr_put(hdr, &h);
            s = req_wait(tl, am_post(ep->uep, hdr, msg, len, true), deadline_in(tl->timeout_ms),
                         true);
            step = "send";
        }
        if (s != UCS_OK) {
            kill = true; /* `hdr` and `msg` may still be in use */
            pthread_mutex_lock(&tl->mu);
            if (s == UCS_ERR_CANCELED && atomic_load(&tl->closed))
                st = kvw__error(KVW_ERR_SHUTDOWN, "ucx notify: the transport was closed");
            else if (s == UCS_ERR_TIMED_OUT)
                st = kvw__error(KVW_ERR_TIMEOUT,
                                "ucx notify to %s: %s did not complete within %u ms (receiver "
                                "stalled?)",
                                ep->peer, step, tl->timeout_ms);
            else if (atomic_load(&ep->failed) != 0)
                st = kvw__error(KVW_ERR_CONN_CLOSED, "ucx notify: %s", ep->err_reason);
            else
                st = kvw__error(map_ucs(s), "ucx notify to %s: %s failed: %s", ep->peer, step,
                                ucs_status_string(s));
            pthread_mutex_unlock(&tl->mu);
        }
    }
    pthread_rwlock_unlock(&ep->rw);
    if (st != KVW_OK && was_alive)
        ep_fail_sync(ep, st, kill);
    return st;
}

static int ucx_progress(kvw_tl_h tl)
{
    (void)tl;
    return 0;
}

static void ucx_ep_close(kvw_tl_ep_h ep_h)
{
    ucx_ep_t *ep = to_ep(ep_h);
    if (ep == NULL)
        return;
    ucx_iface_t *tl = ep->tl;
    pthread_mutex_lock(&tl->mu);
    bool graceful = !ep->reported;
    pthread_mutex_unlock(&tl->mu);
    ep_to_closing(tl, ep, graceful);
    kvw__tl_wake(tl->wake_fd);
}

static void ucx_close(kvw_tl_h tl_h)
{
    ucx_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    atomic_store(&tl->closed, true);
    kvw__tl_wake(tl->wake_fd);
}

static void ucx_stop(kvw_tl_h tl_h)
{
    ucx_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    ucx_close(tl_h);
    if (tl->thread_started) {
        pthread_join(tl->thread, NULL);
        tl->thread_started = false;
    }
}

/* fini: closes an endpoint's UCX endpoint (if any) and frees it, or keeps it until the
 * worker is gone when UCX may still call its error handler. */
static void fini_ep(ucx_iface_t *tl, ucx_ep_t *ep)
{
    if (ep->uep) {
        if (!uep_close_wait(tl, ep->uep, true))
            ep->close_incomplete = true;
        ep->uep = NULL;
    }
    if (ep->close_incomplete) {
        ep->next = tl->zombies;
        tl->zombies = ep;
    } else {
        ep_free(ep);
    }
}

static void ucx_fini(kvw_tl_h tl_h)
{
    ucx_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    ucx_stop(tl_h);
    while (tl->rkeys) {
        ucx_rkey_t *rk = tl->rkeys;
        tl->rkeys = rk->next;
        if (rk->urkey)
            ucp_rkey_destroy(rk->urkey);
        free(rk);
    }
    /* Let the closes and goodbyes the thread started finish, briefly. */
    uint64_t deadline = deadline_in(KVW_MIN(tl->timeout_ms, UCX_CLOSE_MS));
    while (tl->ops && kvw__now_ns() < deadline) {
        if (ucp_worker_progress(tl->worker) == 0)
            sched_yield();
        poll_ops(tl);
    }
    while (tl->closing) {
        ucx_ep_t *ep = tl->closing;
        tl->closing = ep->next;
        fini_ep(tl, ep);
    }
    while (tl->eps) {
        ucx_ep_t *ep = tl->eps;
        tl->eps = ep->next;
        fini_ep(tl, ep);
    }
    /* Anything still in flight goes back to UCX; the worker's end releases it. A flush
     * still running turns into a forced close now: UCX must not find requests on an
     * endpoint when the worker goes. */
    while (tl->ops) {
        ucx_op_t *op = tl->ops;
        tl->ops = op->next;
        ucp_request_free(op->req);
        if (op->close_uep && !uep_close_wait(tl, op->close_uep, true) && op->free_ep) {
            op->free_ep->next = tl->zombies;
            tl->zombies = op->free_ep;
            op->free_ep = NULL;
        }
        op->close_uep = NULL;
        if (op->free_ep) {
            op->free_ep->next = tl->zombies;
            tl->zombies = op->free_ep;
        }
        op->next = tl->dead_ops;
        tl->dead_ops = op;
    }
    /* Destroying the worker may still complete receives (recv_done touches their
     * regions), so the registrations go after it, before the context. */
    ucp_worker_release_address(tl->worker, tl->waddr);
    ucp_worker_destroy(tl->worker);
    for (size_t b = 0; b <= UCX_REGION_BUCKETS; b++) {
        ucx_region_t **head = b < UCX_REGION_BUCKETS ? &tl->regions[b] : &tl->dead_regions;
        while (*head) {
            ucx_region_t *r = *head;
            *head = r->next;
            if (r->memh)
                ucp_mem_unmap(tl->ctx, r->memh);
            free(r);
        }
    }
    ucp_cleanup(tl->ctx);
    /* Nothing in UCX refers to these any more. */
    while (tl->ev_head) {
        ucx_event_t *ev = tl->ev_head;
        tl->ev_head = ev->next;
        free(ev);
    }
    while (tl->dead_ops) {
        ucx_op_t *op = tl->dead_ops;
        tl->dead_ops = op->next;
        free(op);
    }
    while (tl->zombies) {
        ucx_ep_t *ep = tl->zombies;
        tl->zombies = ep->next;
        ep_free(ep);
    }
    free(tl->snap);
    close(tl->wake_fd);
    pthread_mutex_destroy(&tl->mu);
    pthread_mutex_destroy(&tl->reg_mu);
    pthread_cond_destroy(&tl->cv);
    free(tl);
}

const kvw_tl_ops_t kvw_tl_ucx_ops = {
    .name = "ucx",
    .init = ucx_init,
    .address = ucx_address,
    .mem_reg = ucx_mem_reg,
    .mem_dereg = ucx_mem_dereg,
    .connect = ucx_connect,
    .rkey_unpack = ucx_rkey_unpack,
    .rkey_release = ucx_rkey_release,
    .put = ucx_put,
    .notify = ucx_notify,
    .progress = ucx_progress,
    .ep_close = ucx_ep_close,
    .close = ucx_close,
    .stop = ucx_stop,
    .fini = ucx_fini,
    .caps = KVW_TL_CAP_OWN_THREAD,
};
