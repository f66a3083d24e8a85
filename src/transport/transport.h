/*
 * The transport contract. A transport moves bytes with one-sided writes into memory
 * that the receiving side registered, and delivers small notifications that are
 * ordered after every write posted before them on the same endpoint. The protocol
 * layer (src/proto) owns rooms, grants and state machines; transports know none of
 * that beyond a 64-bit room tag carried with every write, which the receiver's
 * `check_write` callback uses to confine writes to the pages granted to that room, and
 * to the connections bound to its sources, on the transports whose receiver mediates
 * writes (tcp, ucx on its default "am" data path: KVW_TL_CAP_MEDIATED). On the others
 * (shm, cuda_ipc, ucx "rma") the sending library confines writes itself and the
 * receiver sees none of them.
 *
 * Lifetime: init -> (mem_reg | connect | accept callbacks | put | notify)* -> close
 * (non-blocking: no new operations, pending ones fail) -> stop (waits for the
 * transport's threads and callbacks to finish; no callback runs after it returns) ->
 * fini (frees). After a failed init nothing needs to be released.
 *
 * Threads: every transport drives itself on its own threads (tcp and shm run one receive
 * thread, ucx a progress thread); the caller never has to poll it.
 * Callbacks run on those threads; they must not block for long and must not call
 * close/stop/fini. Every other slot is safe to call from any thread.
 *
 * Endpoints. A connected endpoint (from `connect`) belongs to the caller until it calls
 * ep_close, even after on_ep_error reported it; put/notify on a failed endpoint return
 * CONN_CLOSED. An accepted endpoint (first seen in a callback) belongs to the
 * transport: it is freed once on_ep_error for it has returned, or after ep_close. Call
 * ep_close on an accepted endpoint only while it is known to be alive (e.g. under the
 * lock that your on_ep_error also takes). Every accepted connection that ends, for any
 * reason other than ep_close, reports on_ep_error exactly once. Accepted endpoints only
 * receive: put/notify on them return UNSUPPORTED. When put or notify fails for any
 * reason other than its arguments (INVALID_PARAM, OUT_OF_RANGE, UNSUPPORTED), e.g.
 * CONN_CLOSED, IO or TIMEOUT, the endpoint is failed for good: later calls return
 * CONN_CLOSED (some of its earlier writes may or may not have landed).
 *
 * Sizes. A put of length 0 is valid when dst_off <= the region length; it moves
 * nothing and is not reported to check_write. A notification is 0..KVW_TL_MAX_NOTIFY
 * bytes.
 */
#ifndef KVW_TRANSPORT_TRANSPORT_H
#define KVW_TRANSPORT_TRANSPORT_H

#include "core/core.h"

#include <stddef.h>
#include <stdint.h>

#define KVW_TL_MAX_RKEY 256    /* bytes of one packed remote key */
#define KVW_TL_MAX_ADDR 256    /* bytes of one transport address */
#define KVW_TL_MAX_NOTIFY 4096 /* bytes of one notification */

typedef struct kvw_tl *kvw_tl_h;       /* one transport instance (per context) */
typedef struct kvw_tl_ep *kvw_tl_ep_h; /* a connection to one peer */
typedef struct kvw_tl_mem *kvw_tl_mem_h; /* registered local memory */
typedef struct kvw_tl_rkey *kvw_tl_rkey_h; /* unpacked remote key, bound to an ep */

/* Receive-side callbacks, given at init. All optional except on_notify. */
/* One mediated write, as check_writes asks about it. */
typedef struct kvw_tl_write {
    uint64_t room, region_id, off, len;
} kvw_tl_write_t;

typedef struct kvw_tl_callbacks {
    void *arg;
    /* A notification arrived; every write the peer posted before it on this
     * endpoint has landed. `msg` is valid during the call only. */
    void (*on_notify)(void *arg, kvw_tl_ep_h ep, const void *msg, size_t len);
    /* A mediated write from accepted endpoint `ep` is about to land at [off, off + len)
     * of registered region `region_id` for `room`; not one byte of it has landed yet.
     * Return KVW_OK to allow it; any error drops the write (the receiving protocol
     * fails that room itself where the write was the room's own sender's; tcp and ucx
     * then drop the write and keep the connection). */
    kvw_status_t (*check_write)(void *arg, kvw_tl_ep_h ep, uint64_t room, uint64_t region_id,
                                uint64_t off, uint64_t len);
    /* Optional: check_write's question for `n` writes from `ep` at once, in the order
     * they arrived (not one byte of any has landed yet), each answer in st[i]; one lock
     * for a run of small writes instead of one each. NULL: check_write per write. */
    void (*check_writes)(void *arg, kvw_tl_ep_h ep, const kvw_tl_write_t *w, size_t n,
                         kvw_status_t *st);
    /* An endpoint (accepted or connected) failed or closed; no more notifications
     * arrive from it. */
    void (*on_ep_error)(void *arg, kvw_tl_ep_h ep, kvw_status_t status, const char *reason);
} kvw_tl_callbacks_t;

typedef struct kvw_tl_params {
    const char *listen_host; /* NULL: 127.0.0.1; receivers listen, senders may not */
    uint16_t listen_port;    /* 0: any free port */
    kvw_tl_callbacks_t cb;
    /* 0 keeps the default. Bound, in milliseconds, on
     * every blocking step: connect, a send that makes no progress, an rkey fetch, and
     * (receive side) a peer that stalls in the middle of a frame. */
    uint32_t timeout_ms;
} kvw_tl_params_t;

#define KVW_TL_DEFAULT_TIMEOUT_MS 30000

/* Capability bits of kvw_tl_ops_t.caps. */
enum {
    /* The receiver mediates every write: check_write runs before any byte lands, and
     * writes outside registered regions are refused by the receiver itself (tcp; ucx
     * on the "am" data path). Without it, the sending library confines writes to the
     * remote region (shm, cuda_ipc, ucx "rma"), and the receiver sees none of them. */
    KVW_TL_CAP_MEDIATED = 1u << 0,
    /* It moves device (GPU) memory to device memory itself, and only that: buffers on
     * both sides are device memory, with no host staging in between (cuda_ipc). */
    KVW_TL_CAP_DEVICE_MEM = 1u << 1,
    /* put and notify finish their work in the caller's thread, waiting on no other
     * thread of the transport (a socket write, a memcpy; tcp, shm): the prefill's control
     * thread may send a small room itself (kvw__ctrl_serve). */
    KVW_TL_CAP_SYNC_PUT = 1u << 2
};

/* One one-sided write. */
typedef struct kvw_tl_put {
    const void *src;     /* local source address (registered or not, transport-specific) */
    kvw_tl_rkey_h rkey;  /* destination region */
    uint64_t dst_off;    /* offset inside the destination region */
    uint64_t len;
} kvw_tl_put_t;

typedef struct kvw_tl_ops {
    const char *name;

    /* Creates an instance and, when listen is requested, starts accepting peers.
     * May block briefly (bind/listen). */
    kvw_status_t (*init)(const kvw_tl_params_t *params, kvw_tl_h *tl_p);

    /* This instance's address for peers (opaque bytes, <= KVW_TL_MAX_ADDR). */
    kvw_status_t (*address)(kvw_tl_h tl, void *buf, size_t *len_p);

    /* Registers [addr, addr+len). Writes the packed remote key (<= KVW_TL_MAX_RKEY) to
     * rkey_buf and its length to *rkey_len_p. The region stays owned by the caller and
     * must outlive the registration. `region_id` is chosen by the caller, unique per
     * instance, and is what check_write reports. */
    kvw_status_t (*mem_reg)(kvw_tl_h tl, void *addr, uint64_t len, kvw_mem_kind_t kind,
                            uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                            size_t *rkey_len_p);
    void (*mem_dereg)(kvw_tl_h tl, kvw_tl_mem_h mem);

    /* Connects to a peer's address. May block up to the connect timeout. */
    kvw_status_t (*connect)(kvw_tl_h tl, const void *addr, size_t len, kvw_tl_ep_h *ep_p);

    /* Unpacks a remote key received from the peer behind ep. Validates it. */
    kvw_status_t (*rkey_unpack)(kvw_tl_ep_h ep, const void *rkey, size_t len,
                                kvw_tl_rkey_h *rkey_p);
    void (*rkey_release)(kvw_tl_rkey_h rkey);

    /* Posts writes tagged with `room`. Source memory may be reused when the call
     * returns (tcp, shm copy synchronously; asynchronous transports copy or wait).
     * Errors: CONN_CLOSED, IO, OUT_OF_RANGE (outside the remote region). */
    kvw_status_t (*put)(kvw_tl_ep_h ep, uint64_t room, const kvw_tl_put_t *puts, size_t n);

    /* Sends a notification delivered after every put posted before it on ep. */
    kvw_status_t (*notify)(kvw_tl_ep_h ep, const void *msg, size_t len);

    /* Optional (NULL when absent): put(ep, room, puts, n) then notify(ep, msg, len) in
     * one call, with the same checks and errors, so that a transport can hand both to
     * the kernel at once (tcp: one sendmsg for a small room's frames and its
     * completion). */
    kvw_status_t (*put_notify)(kvw_tl_ep_h ep, uint64_t room, const kvw_tl_put_t *puts,
                               size_t n, const void *msg, size_t len);

    /* Closes one endpoint; non-blocking; on_ep_error is not called for it. */
    void (*ep_close)(kvw_tl_ep_h ep);

    void (*close)(kvw_tl_h tl); /* non-blocking: stop accepting, fail pending */
    void (*stop)(kvw_tl_h tl);  /* waits until no thread or callback runs */
    /* Frees everything, including endpoints, registrations and rkeys not yet released;
     * every handle of the instance is invalid afterwards. */
    void (*fini)(kvw_tl_h tl);

    /* KVW_TL_CAP_* bits (0 when a table leaves it out). */
    uint64_t caps;

    /* Optional (NULL when absent): a pointer through which this process can write the
     * remote region directly (an opened CUDA IPC handle), or NULL for this key. The
     * protocol then runs its plan executor straight into the peer's memory instead of
     * posting runs, and must complete those writes before it notifies. */
    void *(*rkey_ptr)(kvw_tl_rkey_h rkey);

    /* Optional (NULL when absent): this instance's KVW_TL_CAP_* bits, for transports
     * whose settings, read at init, decide them (ucx: MEDIATED on the "am" data path
     * only); `caps` then holds the bits every instance has. Without it every instance
     * has `caps`. Ask kvw__tl_caps. */
    uint64_t (*instance_caps)(kvw_tl_h tl);
} kvw_tl_ops_t;

/* The capability bits of instance `tl` of `ops`. */
static inline uint64_t kvw__tl_caps(const kvw_tl_ops_t *ops, kvw_tl_h tl)
{
    return ops->instance_caps && tl ? ops->instance_caps(tl) : ops->caps;
}

/*
 * Every transport names its slot functions after itself (tcp_init, tcp_put, ...); a
 * table lists them with these (name and caps, and rkey_ptr where there is one, apart):
 *   KVW_TL_OPS_SLOTS(p)         init, address, mem_reg, mem_dereg, connect, rkey_unpack,
 *                               rkey_release, put, notify and fini
 *   KVW_TL_OPS_THREAD_SLOTS(p)  ep_close, close and stop (transports that run
 *                               on the socket server take these from sockserv.h)
 */
#define KVW_TL_OPS_SLOTS(p)                                                                 \
    .init = p##_init, .address = p##_address, .mem_reg = p##_mem_reg,                      \
    .mem_dereg = p##_mem_dereg, .connect = p##_connect, .rkey_unpack = p##_rkey_unpack,    \
    .rkey_release = p##_rkey_release, .put = p##_put, .notify = p##_notify, .fini = p##_fini
#define KVW_TL_OPS_THREAD_SLOTS(p)                                                          \
    .ep_close = p##_ep_close, .close = p##_close, .stop = p##_stop

/* Transports compiled into this library, looked up by name ("tcp", "shm", "ucx"), then
 * names that the installed resolver claims (see kvw__tl_set_resolver). */
const kvw_tl_ops_t *kvw__tl_find(const char *name);

/*
 * A resolver for transport names outside the library's table: names that start with
 * `prefix` are handed to `find`, which returns a table or NULL with an error. The test
 * kit's fault-injecting wrapper (tests/fault) installs one for "fault:NAME", so that
 * tests and the soak can select it by name while the shipped library holds no fault
 * code. The struct must outlive every lookup (static storage); NULL removes it. Install
 * it before contexts exist: it is read without a lock on every lookup.
 */
typedef struct kvw_tl_resolver {
    const char *prefix;
    const kvw_tl_ops_t *(*find)(const char *name);
} kvw_tl_resolver_t;

void kvw__tl_set_resolver(const kvw_tl_resolver_t *resolver);

/* Names of the compiled-in transports, NULL-terminated. */
const char *const *kvw__tl_names(void);

#endif
