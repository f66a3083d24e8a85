/* The socket server under the tcp and shm transports; see sockserv.h. */
#include "core/config.h"
#include "core/dlist.h"
#include "transport/sockserv.h"
#include "transport/tl_util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#define SRV_POLL_MS 200      /* longest sleep of the receive thread */
#define SRV_STALL_EVERY_MS 50 /* stall checks run at most this often */
#define SRV_EVENTS 64        /* epoll events taken per wait */
#define SRV_LISTEN_PAUSE_NS 100000000ull /* out of descriptors: retry accept in 100 ms */

/* epoll user data of the two fixed descriptors; endpoints use their own address. */
static char wake_tag, listen_tag;

void *kvw__sockserv_new(const kvw__sockserv_ops_t *ops, const kvw_tl_params_t *params,
                        const kvw_tl_h *tl_p, size_t size, kvw_status_t *st_p)
{
    kvw_status_t st;
    if (params == NULL || tl_p == NULL) {
        *st_p = kvw__error(KVW_ERR_INVALID_PARAM, "%s init: params or tl_p is NULL", ops->name);
        return NULL;
    }
    if (params->cb.on_notify == NULL) {
        *st_p = kvw__error(KVW_ERR_INVALID_PARAM, "%s init: callbacks.on_notify is required",
                           ops->name);
        return NULL;
    }
    kvw__sockserv_t *srv = calloc(1, size);
    if (srv == NULL) {
        *st_p = kvw__error(KVW_ERR_NO_MEMORY, "%s init: no memory", ops->name);
        return NULL;
    }
    srv->ops = ops;
    srv->cb = params->cb;
    srv->timeout_ns = kvw__tl_timeout_ns(params);
    if (kvw__config_u64("KVW_DATA_HELLO_MS", &srv->hello_ms) != KVW_OK ||
        kvw__config_u64("KVW_MAX_CONN_PER_SOURCE", &srv->max_per_source) != KVW_OK) {
        *st_p = KVW_ERR_INVALID_PARAM; /* the message names the variable */
        free(srv);
        return NULL;
    }
    srv->listen_fd = srv->wake_fd = srv->epfd = -1;
    atomic_init(&srv->closed, false);
    pthread_mutex_init(&srv->mu, NULL);
    pthread_mutex_init(&srv->reg_mu, NULL);
    do
        st = kvw__random_bytes(&srv->token, sizeof(srv->token));
    while (st == KVW_OK && srv->token == 0);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &wake_tag};
    if (st != KVW_OK) {
        /* No random token: kvw__random_bytes said why. */
    } else if ((srv->wake_fd = kvw__tl_wake_open()) < 0)
        st = kvw__error(KVW_ERR_IO, "%s init: eventfd: %m", ops->name);
    else if ((srv->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0)
        st = kvw__error(KVW_ERR_IO, "%s init: epoll: %m", ops->name);
    else if (epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->wake_fd, &ev) != 0)
        st = kvw__error(KVW_ERR_IO, "%s init: epoll_ctl: %m", ops->name);
    else
        return srv;
    kvw__sockserv_delete(srv);
    *st_p = st;
    return NULL;
}

void kvw__sockserv_delete(kvw__sockserv_t *srv)
{
    if (srv->listen_fd >= 0)
        close(srv->listen_fd);
    if (srv->epfd >= 0)
        close(srv->epfd);
    if (srv->wake_fd >= 0)
        close(srv->wake_fd);
    pthread_mutex_destroy(&srv->mu);
    pthread_mutex_destroy(&srv->reg_mu);
    free(srv);
}

/* ---------------------------------------------------------------- endpoints */

void kvw__sock_ep_init(kvw__sock_ep_t *ep, kvw__sockserv_t *srv, int fd, bool accepted)
{
    kvw__tl_ep_init(&ep->hd, srv->ops->name, &srv->closed, accepted);
    ep->srv = srv;
    ep->fd = fd;
    atomic_init(&ep->dead, false);
    atomic_init(&ep->closing, false);
    if (!accepted)
        pthread_mutex_init(&ep->tx_mu, NULL);
}

/* srv->mu held. */
static void ep_link(kvw__sockserv_t *srv, kvw__sock_ep_t *ep)
{
    KVW_DLIST_PUSH(srv->eps, ep);
    if (ep->hd.accepted)
        srv->num_accepted++;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = ep};
    /* Without room in the epoll set the endpoint is not watched; a stall check or the
     * owner's next send finds a dead peer instead. */
    ep->polled = epoll_ctl(srv->epfd, EPOLL_CTL_ADD, ep->fd, &ev) == 0;
}

/* srv->mu held. */
static void ep_unlink(kvw__sockserv_t *srv, kvw__sock_ep_t *ep)
{
    KVW_DLIST_REMOVE(srv->eps, ep);
    if (ep->hd.accepted)
        srv->num_accepted--;
}

/* srv->mu held. The thread stops watching the endpoint, which is freed by the next reap
 * when it is closing or an accepted one that failed. */
static void ep_unpoll(kvw__sockserv_t *srv, kvw__sock_ep_t *ep)
{
    if (ep->polled)
        (void)epoll_ctl(srv->epfd, EPOLL_CTL_DEL, ep->fd, NULL);
    ep->polled = false;
    srv->reap_due = true;
}

static void ep_free(kvw__sock_ep_t *ep)
{
    if (ep->fd >= 0)
        close(ep->fd);
    if (!ep->hd.accepted)
        pthread_mutex_destroy(&ep->tx_mu);
    ep->srv->ops->ep_free(ep);
}

kvw_status_t kvw__sock_check_sendable(const char *name, kvw__sock_ep_t *ep, const char *what)
{
    kvw_status_t st = kvw__tl_check_sendable(name, ep ? &ep->hd : NULL, what);
    if (st == KVW_ERR_UNSUPPORTED) {
        /* An accepted endpoint belongs to the receive thread, which frees it after it
         * failed (reap takes srv->mu first). This caller read it while it was alive;
         * passing through srv->mu orders that read before the free also for checkers
         * that cannot follow the causality through the sockets (ThreadSanitizer). */
        pthread_mutex_lock(&ep->srv->mu);
        pthread_mutex_unlock(&ep->srv->mu);
    }
    if (st != KVW_OK)
        return st;
    const kvw__sockserv_ops_t *ops = ep->srv->ops;
    if (ops->probe_hup && !atomic_load(&ep->dead)) {
        struct pollfd pfd = {.fd = ep->fd, .events = POLLRDHUP};
        if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)))
            atomic_store(&ep->dead, true);
    }
    if (atomic_load(&ep->dead))
        return kvw__error(KVW_ERR_CONN_CLOSED, "%s %s: %s%s%s", name, what, ops->gone[0],
                          ep->hd.peer, ops->gone[1]);
    return KVW_OK;
}

void kvw__sock_ep_add(kvw__sock_ep_t *ep)
{
    pthread_mutex_lock(&ep->srv->mu);
    ep_link(ep->srv, ep);
    pthread_mutex_unlock(&ep->srv->mu);
}

void kvw__sock_ep_fail(kvw__sock_ep_t *ep, kvw_status_t status, const char *fmt, ...)
{
    kvw__sockserv_t *srv = ep->srv;
    if (ep->reported)
        return;
    ep->reported = true;
    atomic_store(&ep->dead, true);
    if (srv->ops->failed)
        srv->ops->failed(ep);
    pthread_mutex_lock(&srv->mu);
    ep_unpoll(srv, ep);
    pthread_mutex_unlock(&srv->mu);
    if (status == KVW_OK || atomic_load(&ep->closing) || srv->cb.on_ep_error == NULL)
        return;
    char reason[384];
    va_list ap;
    va_start(ap, fmt);
    kvw__tl_format_reason(&ep->hd, reason, sizeof(reason), fmt, ap);
    va_end(ap);
    srv->cb.on_ep_error(srv->cb.arg, (kvw_tl_ep_h)(void *)ep, status, reason);
}

void kvw__sockserv_ep_close(kvw_tl_ep_h ep_h)
{
    kvw__sock_ep_t *ep = (kvw__sock_ep_t *)(void *)ep_h;
    if (ep == NULL)
        return;
    kvw__sockserv_t *srv = ep->srv;
    pthread_mutex_lock(&srv->mu);
    atomic_store(&ep->closing, true);
    ep_unpoll(srv, ep);
    pthread_mutex_unlock(&srv->mu);
    kvw__tl_wake(srv->wake_fd);
}

/* ---------------------------------------------------------------- receive thread */

/* Frees endpoints that were closed, and accepted ones that failed. */
static void reap(kvw__sockserv_t *srv)
{
    kvw__sock_ep_t *dead = NULL;
    pthread_mutex_lock(&srv->mu);
    if (srv->reap_due) {
        srv->reap_due = false;
        for (kvw__sock_ep_t *ep = srv->eps, *next; ep; ep = next) {
            next = ep->next;
            if (atomic_load(&ep->closing) || (ep->hd.accepted && ep->reported)) {
                ep_unlink(srv, ep);
                ep->next = dead;
                dead = ep;
            }
        }
    }
    pthread_mutex_unlock(&srv->mu);
    while (dead) {
        kvw__sock_ep_t *next = dead->next;
        ep_free(dead);
        dead = next;
    }
}

/* The source address an accepted connection is counted under: IPv4 and IPv6 hosts
 * (IPv6: a hash), 0 for local sockets (not counted: their peer is checked otherwise). */
static uint64_t source_of(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return (uint64_t)ntohl(((const struct sockaddr_in *)ss)->sin_addr.s_addr) + 1;
    if (ss->ss_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)ss)->sin6_addr.s6_addr;
        uint64_t h = 1469598103934665603ull;
        for (int i = 0; i < 16; i++)
            h = (h ^ a[i]) * 1099511628211ull;
        return h | (1ull << 63);
    }
    return 0;
}

static const char *source_name(const struct sockaddr_storage *ss)
{
    static __thread char buf[64];
    buf[0] = '\0';
    if (ss->ss_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)ss)->sin_addr, buf, sizeof(buf));
    else if (ss->ss_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)ss)->sin6_addr, buf, sizeof(buf));
    return buf[0] ? buf : "?";
}

/* Accepts what the listener has. Out of descriptors or memory, the listener pauses
 * (*pause_until_p) instead of waking the loop at once again. */
static void accept_all(kvw__sockserv_t *srv, uint64_t *pause_until_p)
{
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        int fd = accept4(srv->listen_fd, (struct sockaddr *)&ss, &sl,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                *pause_until_p = kvw__now_ns() + SRV_LISTEN_PAUSE_NS;
            return;
        }
        uint64_t src = source_of(&ss);
        pthread_mutex_lock(&srv->mu);
        bool full = srv->num_accepted >= srv->ops->max_conns;
        uint64_t same = 0;
        for (kvw__sock_ep_t *o = srv->eps; src && o && !full; o = o->next)
            same += o->hd.accepted && o->src == src && !o->reported;
        bool capped = same >= srv->max_per_source;
        uint64_t refused = capped ? ++srv->refused_sources : 0;
        pthread_mutex_unlock(&srv->mu);
        if (capped && (refused & (refused - 1)) == 0) /* the 1st, 2nd, 4th, ... */
            kvw__log(KVW_LOG_WARN, "%s: refused %llu connection(s): source %s already holds %llu "
                     "(KVW_MAX_CONN_PER_SOURCE)", srv->ops->name, (unsigned long long)refused,
                     source_name(&ss), (unsigned long long)same);
        kvw__sock_ep_t *ep = full || capped ? NULL
                                            : srv->ops->accept(srv, fd, (struct sockaddr *)&ss, sl);
        if (ep == NULL) {
            close(fd);
            continue;
        }
        ep->last_rx_ns = ep->accepted_ns = kvw__now_ns();
        ep->src = src;
        kvw__sock_ep_add(ep);
    }
}

/* A connected (sending) endpoint became readable: the receiver sends nothing after
 * its handshake answer, so this is the receiver closing, or a protocol violation. */
static void ep_watch(kvw__sock_ep_t *ep)
{
    uint8_t b[16];
    ssize_t r = recv(ep->fd, b, sizeof(b), MSG_DONTWAIT);
    if (r == 0)
        kvw__sock_ep_fail(ep, KVW_ERR_CONN_CLOSED, "receiver closed the connection");
    else if (r > 0)
        kvw__sock_ep_fail(ep, KVW_ERR_MALFORMED, "%s", ep->srv->ops->unexpected);
    else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        kvw__sock_ep_fail(ep,
                          errno == ECONNRESET || errno == EPIPE ? KVW_ERR_CONN_CLOSED
                                                                : KVW_ERR_IO,
                          "%s", strerror(errno));
}

/* Offers the transport every accepted connection that has received nothing for longer
 * than the timeout. Endpoints are linked at the head only, and unlinked and freed by
 * this thread only, so the list can be walked from its head without the lock. */
static void check_stalls(kvw__sockserv_t *srv)
{
    uint64_t now = kvw__now_ns(), limit = srv->timeout_ns;
    pthread_mutex_lock(&srv->mu);
    kvw__sock_ep_t *ep = srv->eps;
    pthread_mutex_unlock(&srv->mu);
    for (; ep; ep = ep->next) {
        if (!ep->hd.accepted || ep->reported || atomic_load(&ep->closing))
            continue;
        if (srv->ops->greets && !ep->greeted && now - ep->accepted_ns > srv->hello_ms * 1000000ull)
            kvw__sock_ep_fail(ep, KVW_ERR_TIMEOUT, "no HELLO and first frame within %llu ms "
                              "of the connection (KVW_DATA_HELLO_MS)",
                              (unsigned long long)srv->hello_ms);
        else if (now - ep->last_rx_ns > limit)
            srv->ops->stalled(ep);
    }
}

/* Turns the listener on or off in the epoll set. */
static void listen_watch(kvw__sockserv_t *srv, bool on)
{
    struct epoll_event ev = {.events = on ? EPOLLIN : 0, .data.ptr = &listen_tag};
    (void)epoll_ctl(srv->epfd, EPOLL_CTL_MOD, srv->listen_fd, &ev);
}

static void *srv_thread(void *arg)
{
    kvw__sockserv_t *srv = arg;
    kvw__thread_name("kvw-rx-%s", srv->ops->name);
    struct epoll_event evs[SRV_EVENTS];
    uint64_t listen_pause_until = 0, next_stall_check = 0;

    while (!atomic_load(&srv->closed)) {
        uint64_t now = kvw__now_ns();
        int timeout = SRV_POLL_MS;
        if (listen_pause_until != 0) {
            if (now >= listen_pause_until) {
                listen_pause_until = 0;
                listen_watch(srv, true);
            } else {
                timeout = (int)KVW_MIN((listen_pause_until - now) / 1000000ull + 1,
                                       (uint64_t)timeout);
            }
        }
        int n = epoll_wait(srv->epfd, evs, SRV_EVENTS, timeout);
        if (n < 0 && errno != EINTR)
            usleep(1000); /* ENOMEM: back off instead of spinning */
        for (int i = 0; i < n; i++) {
            void *tag = evs[i].data.ptr;
            if (tag == &wake_tag) {
                kvw__tl_wake_drain(srv->wake_fd);
            } else if (tag == &listen_tag) {
                accept_all(srv, &listen_pause_until);
                if (listen_pause_until != 0)
                    listen_watch(srv, false);
            } else {
                kvw__sock_ep_t *ep = tag; /* freed only by this thread, in reap below */
                if (ep->reported || atomic_load(&ep->closing))
                    continue;
                if (ep->hd.accepted)
                    srv->ops->rx(ep);
                else
                    ep_watch(ep);
            }
        }
        now = kvw__now_ns();
        if (now >= next_stall_check) {
            next_stall_check = now + SRV_STALL_EVERY_MS * 1000000ull;
            check_stalls(srv);
        }
        reap(srv);
    }
    return NULL;
}

kvw_status_t kvw__sockserv_start(kvw__sockserv_t *srv)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listen_tag};
    if (epoll_ctl(srv->epfd, EPOLL_CTL_ADD, srv->listen_fd, &ev) != 0)
        return kvw__error(KVW_ERR_IO, "%s init: epoll_ctl: %m", srv->ops->name);
    int err = pthread_create(&srv->thread, NULL, srv_thread, srv);
    if (err != 0) {
        errno = err;
        return kvw__error(KVW_ERR_INTERNAL, "%s init: cannot start the receive thread: %m",
                          srv->ops->name);
    }
    srv->thread_started = true;
    return KVW_OK;
}

/* ---------------------------------------------------------------- teardown */

static kvw__sockserv_t *to_srv(kvw_tl_h tl)
{
    return (kvw__sockserv_t *)(void *)tl;
}

void kvw__sockserv_close(kvw_tl_h tl)
{
    kvw__sockserv_t *srv = to_srv(tl);
    if (srv == NULL)
        return;
    atomic_store(&srv->closed, true);
    kvw__tl_wake(srv->wake_fd);
}

void kvw__sockserv_stop(kvw_tl_h tl)
{
    kvw__sockserv_t *srv = to_srv(tl);
    if (srv == NULL)
        return;
    kvw__sockserv_close(tl);
    if (srv->thread_started) {
        pthread_join(srv->thread, NULL);
        srv->thread_started = false;
    }
}

void kvw__sockserv_fini(kvw__sockserv_t *srv)
{
    kvw__sockserv_stop((kvw_tl_h)(void *)srv);
    while (srv->eps) {
        kvw__sock_ep_t *ep = srv->eps;
        srv->eps = ep->next;
        ep_free(ep);
    }
    kvw__tl_rkeys_free(&srv->rkeys, srv->ops->rkey_free);
}
