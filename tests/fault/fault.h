/*
 * A fault-injecting wrapper around any transport, for tests and soak runs: it delays,
 * drops, truncates, reorders, duplicates, corrupts or fails puts and notifications,
 * and closes endpoints at chosen points. Faults are injected on the sending side (the
 * endpoints this instance connects); everything else is passed through unchanged.
 *
 * Spec: comma-separated key=value pairs (spaces allowed), e.g.
 *   "seed=1,drop_put=0.01,fail_notify=0.02,delay_ms=5,dup_notify=0.01,close_after_puts=1000"
 *
 *   seed=N               PRNG seed (default 1); each instance derives its own stream
 *   delay=P delay_ms=N   with probability P (default 1 when only delay_ms is given) a put
 *                        or notify call first sleeps a uniform 0..N ms (default N = 5)
 *   drop_put=P           each put of a batch is silently skipped (the call succeeds)
 *   trunc_put=P          each put of a batch moves only a random prefix of its bytes
 *   dup_put=P            a batch is posted twice
 *   reorder_put=P        the puts of a batch are posted in a shuffled order
 *   mislay_put=P         a put lands on the destination of an earlier put of the same
 *                        batch and length: same byte count, one range twice, one never
 *   fail_put=P           the call fails with IO and the endpoint is closed for good
 *   drop_notify=P        a notification is silently dropped
 *   dup_notify=P         a notification is delivered twice
 *   reorder_notify=P     a notification is held back and delivered after the next one
 *                        on the same endpoint (or after reorder_ms, default 20)
 *   corrupt_notify=P     one random byte of a notification is changed
 *   fail_notify=P        the call fails with IO and the endpoint is closed for good
 *   close_after_puts=N   the endpoint closes at its N-th put call (CONN_CLOSED)
 *   close_after_notifies=N   the same at its N-th notification
 *   fail_connect=P       connect fails with IO
 *
 * A transport with put_notify (puts and their notification in one call: tcp) keeps it:
 * an endpoint whose spec changes no put and no notification (delays aside) calls the
 * inner put_notify, counted as "put_notify calls"; otherwise the call is a put then a
 * notify, each with its faults.
 *
 * Probabilities are in [0, 1]. An unknown key or a bad value is an INVALID_PARAM error.
 * Dropping or truncating puts silently is the fault a correct protocol must catch by
 * itself (byte counts, checks): the transport reports success.
 *
 * Selection: kvw__tl_fault_find("fault:tcp") wraps the transport "tcp" with the spec
 * in the environment variable KVW_FAULTS ("fault:tcp@SPEC" gives the spec inline).
 * After kvw__tl_fault_register(), the library's own lookup (kvw__tl_find, hence a
 * context's transport name) finds these names too. The wrapper keeps the inner
 * transport's name, so a wrapped and an unwrapped side still agree at the handshake.
 *
 * This code is linked into tests and the soak's CLI (kvwire-faults) only, never into
 * libkvwire: the library reaches it through the resolver hook of transport.h.
 */
#ifndef KVW_TESTS_FAULT_FAULT_H
#define KVW_TESTS_FAULT_FAULT_H

#include "transport/transport.h"

/* Kinds of injected faults (and three plain counters), for kvw__tl_fault_stats. */
#define KVW_FAULT_KINDS(X)                                                                \
    X(PUT_CALLS, "put calls")                                                             \
    X(NOTIFY_CALLS, "notify calls")                                                       \
    X(PUT_NOTIFY_CALLS, "put_notify calls")                                               \
    X(DELAY, "delay")                                                                     \
    X(DROP_PUT, "drop_put")                                                               \
    X(TRUNC_PUT, "trunc_put")                                                             \
    X(DUP_PUT, "dup_put")                                                                 \
    X(REORDER_PUT, "reorder_put")                                                         \
    X(MISLAY_PUT, "mislay_put")                                                           \
    X(FAIL_PUT, "fail_put")                                                               \
    X(DROP_NOTIFY, "drop_notify")                                                         \
    X(DUP_NOTIFY, "dup_notify")                                                           \
    X(REORDER_NOTIFY, "reorder_notify")                                                   \
    X(CORRUPT_NOTIFY, "corrupt_notify")                                                   \
    X(FAIL_NOTIFY, "fail_notify")                                                         \
    X(CLOSE_EP, "close_ep")                                                               \
    X(FAIL_CONNECT, "fail_connect")

typedef enum kvw_fault_kind {
#define KVW_FAULT_X(name, text) KVW_FAULT_##name,
    KVW_FAULT_KINDS(KVW_FAULT_X)
#undef KVW_FAULT_X
        KVW_FAULT_NUM_KINDS
} kvw_fault_kind_t;

/* Short name of a kind ("drop_put", ...). */
const char *kvw__tl_fault_kind_name(kvw_fault_kind_t kind);

/*
 * A transport table that behaves like `inner` with the faults of `spec`. Tables are
 * cached: the same (inner, spec) gives the same table. At most 8 distinct tables per
 * process. Returns NULL with an error (INVALID_PARAM for a bad spec, BUSY when the
 * table slots are used up).
 */
const kvw_tl_ops_t *kvw__tl_fault_wrap(const kvw_tl_ops_t *inner, const char *spec);

/* "fault:NAME" or "fault:NAME@SPEC": wraps kvw__tl_find(NAME) with SPEC or, without
 * one, with $KVW_FAULTS (empty: no faults). NULL with an error otherwise. */
const kvw_tl_ops_t *kvw__tl_fault_find(const char *name);

/* Whether `ops` is a table made by kvw__tl_fault_wrap. */
bool kvw__tl_fault_is(const kvw_tl_ops_t *ops);

/*
 * Wraps an instance of the inner transport that was already initialized (with its own
 * callbacks) in an instance of the fault table `ops`, with the faults of `spec` (NULL:
 * the table's): the caller then uses `ops` with *tl_p, and close/stop/fini reach the
 * inner instance through it. For callers that cannot choose the transport table before
 * init, and for per-instance specs. Errors: INVALID_PARAM, NO_MEMORY.
 */
kvw_status_t kvw__tl_fault_attach(const kvw_tl_ops_t *ops, kvw_tl_h inner, const char *spec,
                                  kvw_tl_h *tl_p);

/* Makes kvw__tl_find resolve "fault:NAME[@SPEC]" through kvw__tl_fault_find. Call it
 * before creating contexts. */
void kvw__tl_fault_register(void);

/*
 * Receive side: every instance the wrapper starts itself (a context created on a
 * "fault:NAME" transport, not one attached after creation) passes each notification
 * to `hook` first, with the callbacks' own argument (the receiving context), then on
 * to the receiver. Tests use it to act between the landing of a sender's bytes and the
 * completion that announces them (every write posted before a notification has landed
 * when it arrives). NULL: none. Process-wide; set it before the contexts exist.
 */
typedef void (*kvw_fault_notify_hook_t)(void *arg, const void *msg, size_t len);
void kvw__tl_fault_set_notify_hook(kvw_fault_notify_hook_t hook);

/* Process-wide counters of injected faults since start (or the last reset). */
void kvw__tl_fault_stats(uint64_t counts[KVW_FAULT_NUM_KINDS]);
void kvw__tl_fault_stats_reset(void);

#endif
