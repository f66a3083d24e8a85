/*
 * The socket server under the tcp and shm transports: one listening socket, the list of
 * endpoints (accepted connections and the instance's own connected ones), and one
 * receive thread that runs an epoll loop over them, with a wake-up channel and timers
 * (stall checks, the listener's pause when descriptors run out).
 *
 * The thread accepts connections (the transport decides whether to keep each one),
 * hands readable accepted connections to the transport's receive function, watches
 * connected endpoints for the receiver going away (the receiver never sends after its
 * handshake answer), fails accepted connections that stall, reports every failure once
 * (on_ep_error, unless the owner closed the endpoint) and frees endpoints that were
 * closed and accepted ones that failed. A transport supplies the wire format only: its
 * handshake, frames and data path.
 *
 * A transport puts kvw__sockserv_t first in its instance and kvw__sock_ep_t first in its
 * endpoint. Locks: srv->mu guards the endpoint list, the key list and each endpoint's
 * `polled`; it is never held across a callback. Endpoints are freed by the receive
 * thread only (or by fini after stop), so the thread may use them without the lock.
 */
#ifndef KVW_TRANSPORT_SOCKSERV_H
#define KVW_TRANSPORT_SOCKSERV_H

#include "transport/tl_base.h"

#include <sys/socket.h>

typedef struct kvw__sockserv kvw__sockserv_t;

/* The head of an endpoint of a socket transport. */
typedef struct kvw__sock_ep {
    kvw__tl_ep_t hd; /* name, accepted, peer, peer_token */
    kvw__sockserv_t *srv;
    int fd;
    atomic_bool dead;    /* failed: put/notify refuse with CONN_CLOSED */
    atomic_bool closing; /* ep_close was called: no callback, freed by the thread */
    bool reported;       /* thread only: the failure was handled (reported or not) */
    bool polled;         /* under srv->mu: in the thread's epoll set */
    uint64_t last_rx_ns; /* accepted, thread only: when bytes last arrived */
    uint64_t accepted_ns; /* accepted: when */
    uint64_t src;         /* accepted: its source address (IPv4 + 1; 0: not counted) */
    bool greeted;         /* accepted, thread only: HELLO and one frame after it arrived */
    pthread_mutex_t tx_mu; /* connected: one sender at a time */
    struct kvw__sock_ep *prev, *next;
} kvw__sock_ep_t;

/* What a transport plugs into the server. */
typedef struct kvw__sockserv_ops {
    const char *name;   /* "tcp": the prefix of every message */
    unsigned max_conns; /* accepted connections at once; more are closed at once */
    /* The transport sets ep->greeted once a connection said HELLO and sent its first
     * frame (tcp: the BIND); the server fails one that has not within KVW_DATA_HELLO_MS
     * of its accept. Accepted connections from one source address are capped at
     * KVW_MAX_CONN_PER_SOURCE. */
    bool greets;
    /* What a connected endpoint's watcher says when the receiver sends something. */
    const char *unexpected;
    /* A failed connected endpoint, in put's and notify's CONN_CLOSED message: the words
     * before and after the peer ("tcp put: " gone[0] peer gone[1]). */
    const char *gone[2];
    /* put and notify first ask the socket whether the receiver still holds its end
     * (poll for a hang-up), and fail the endpoint when it does not. */
    bool probe_hup;
    /* A new accepted socket (non-blocking): returns its endpoint, made with
     * kvw__sock_ep_init, or NULL to refuse it (the server closes fd). */
    kvw__sock_ep_t *(*accept)(kvw__sockserv_t *srv, int fd, const struct sockaddr *sa,
                              socklen_t sa_len);
    /* An accepted connection is readable (or hung up). Receive thread. */
    void (*rx)(kvw__sock_ep_t *ep);
    /* An accepted connection, not failed, has received nothing for longer than the
     * timeout: fails it (kvw__sock_ep_fail) when it is in the middle of something. */
    void (*stalled)(kvw__sock_ep_t *ep);
    /* Optional: an endpoint failed (receive thread, before the report). */
    void (*failed)(kvw__sock_ep_t *ep);
    /* Frees what the transport added to an endpoint, and the endpoint (its socket is
     * closed already). */
    void (*ep_free)(kvw__sock_ep_t *ep);
    /* Frees an unpacked key left over at fini. */
    void (*rkey_free)(kvw__tl_rkey_t *rk);
} kvw__sockserv_ops_t;

struct kvw__sockserv {
    const kvw__sockserv_ops_t *ops;
    kvw_tl_callbacks_t cb;
    uint64_t timeout_ns; /* stall window of every blocking step (kvw__tl_timeout_ns) */
    uint64_t hello_ms;        /* KVW_DATA_HELLO_MS (ops->greets) */
    uint64_t max_per_source;  /* KVW_MAX_CONN_PER_SOURCE */
    uint64_t refused_sources; /* connections refused for their source's cap */
    uint64_t token; /* random, non-zero: names this instance to its peers */
    int listen_fd, wake_fd, epfd;
    pthread_t thread;
    bool thread_started;
    atomic_bool closed;

    pthread_mutex_t mu; /* eps, rkeys, num_accepted, reap_due, every ep->polled */
    /* The transport's registered regions (the server only creates and destroys it):
     * a lock the receive hooks take, so it lives as long as the thread. */
    pthread_mutex_t reg_mu;
    kvw__sock_ep_t *eps;
    kvw__tl_rkey_t *rkeys;
    unsigned num_accepted;
    bool reap_due; /* an endpoint waits to be freed */
};

/*
 * init, first half: checks init's arguments, allocates a zeroed instance of `size`
 * bytes (the transport's struct, with the server first) and sets up the server in it:
 * callbacks, timeout, token, locks, wake-up channel, epoll set. NULL with *st_p set on
 * failure. The transport then opens its listening socket into srv->listen_fd.
 */
void *kvw__sockserv_new(const kvw__sockserv_ops_t *ops, const kvw_tl_params_t *params,
                        const kvw_tl_h *tl_p, size_t size, kvw_status_t *st_p);

/* init, second half: starts serving srv->listen_fd (non-blocking, listening) on the
 * receive thread. On failure the caller deletes the instance. */
kvw_status_t kvw__sockserv_start(kvw__sockserv_t *srv);

/* Frees an instance from kvw__sockserv_new that is not running (never started, or
 * after kvw__sockserv_fini): its descriptors, locks and memory. */
void kvw__sockserv_delete(kvw__sockserv_t *srv);

/* Fills an endpoint's head: not failed, not closing, connected ones with a tx lock. */
void kvw__sock_ep_init(kvw__sock_ep_t *ep, kvw__sockserv_t *srv, int fd, bool accepted);

/* kvw__tl_check_sendable for a socket endpoint, then: not failed (CONN_CLOSED, see
 * ops->gone and ops->probe_hup). */
kvw_status_t kvw__sock_check_sendable(const char *name, kvw__sock_ep_t *ep, const char *what);

/* Adds a connected endpoint made with kvw__sock_ep_init; the thread watches it. */
void kvw__sock_ep_add(kvw__sock_ep_t *ep);

/* Receive thread: an endpoint failed. Marks it dead, stops watching it and reports
 * "<name> connection from|to <peer>: <fmt...>" once, unless the owner closed it or
 * status is KVW_OK (an ending that is no failure). Accepted endpoints are freed soon
 * after; connected ones stay until their owner calls ep_close. */
void kvw__sock_ep_fail(kvw__sock_ep_t *ep, kvw_status_t status, const char *fmt, ...)
    KVW_PRINTF(3, 4);

/* The ops slots that are the same for every socket transport: their handles are the
 * server (instance) and kvw__sock_ep_t (endpoint). */
void kvw__sockserv_ep_close(kvw_tl_ep_h ep);
void kvw__sockserv_close(kvw_tl_h tl);
void kvw__sockserv_stop(kvw_tl_h tl);
/* Those slots in an ops table (see KVW_TL_OPS_SLOTS). */
#define KVW__SOCKSERV_OPS_SLOTS KVW_TL_OPS_THREAD_SLOTS(kvw__sockserv)

/* fini, first half: stops the thread and frees every endpoint and key. The transport
 * then frees its regions and calls kvw__sockserv_delete. */
void kvw__sockserv_fini(kvw__sockserv_t *srv);

#endif
