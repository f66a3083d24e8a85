/*
 * The shm transport: one-sided writes between processes on one host.
 *
 * Data path. The sender writes straight into the receiver's registered memory:
 *  - memfd mode: when the region lies inside memory from kvw_mem_alloc_shared, the
 *    sender obtains the memory file once, at rkey_unpack, over a short Unix-socket
 *    exchange (SCM_RIGHTS; it needs no ptrace rights and no shared /proc), maps the
 *    pages that cover the region, and copies with memcpy;
 *  - cma mode: any other host memory is written with process_vm_writev into the
 *    receiver's process. The pid comes from SO_PEERCRED of the endpoint's socket (the
 *    kernel translates it into the sender's pid namespace), never from the key.
 *
 * Confinement. The receiver cannot see or refuse these writes, so check_write is never
 * called (ops.caps lacks KVW_TL_CAP_MEDIATED): the sending library checks every put
 * against the region of its rkey (OUT_OF_RANGE), and the protocol layer of the
 * sending side confines writes to the pages granted to the room. The memfd mapping
 * itself covers only the pages of the region. An fd is handed out only to a peer that
 * presents the region's random secret, which travels inside the rkey.
 *
 * Notifications travel over a SOCK_SEQPACKET Unix socket (abstract name derived from
 * the receiver's pid and a random token), one message each. Abstract names are public
 * and have no file permissions, so the receiver checks SO_PEERCRED on accept: only
 * its own user or root may connect. Which connection may complete which room is the
 * protocol layer's business (it binds each data connection to a control session). Puts complete
 * synchronously before put() returns, so a notification sent afterwards is naturally
 * ordered after them. The receiver runs one thread (the socket server, sockserv.c)
 * that accepts connections, answers
 * rkey fetches, reads notifications and reports failures; the same thread watches the
 * sender's connections for the receiver going away.
 *
 * Threads. put() takes no lock: each write is a synchronous memcpy or
 * process_vm_writev into a disjoint or caller-ordered range, so concurrent callers on
 * one endpoint are safe; notify() serializes on a per-endpoint mutex.
 *
 * Limits. A deregistered region is no longer handed out, but a sender that already
 * holds its rkey can still write until it releases it (as with any one-sided
 * transport): the protocol must stop granting pages of a region before deregistering
 * it. Abstract socket names are per network namespace, so both processes must share
 * one.
 */
#include "transport/shm/shm_mem.h"
#include "transport/sockserv.h"
#include "transport/tl_util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#define SHM_VERSION 1
#define SHM_ADDR_MAGIC 0x4153564bu /* "KVSA" */
#define SHM_RKEY_MAGIC 0x5253564bu /* "KVSR" */
#define SHM_MSG_MAGIC 0x4d53564bu  /* "KVSM" */
#define SHM_ADDR_LEN 32
#define SHM_RKEY_LEN 64
#define SHM_HDR_LEN 16
#define SHM_MAX_MSG (SHM_HDR_LEN + KVW_TL_MAX_NOTIFY)
#define SHM_RX_BUDGET 64 /* messages taken from one connection before the others */
#define SHM_MAX_CONNS 4096
/* rkey fetches: attempts when the receiver ends the connection without a reply, and how
 * long the receiver waits for room to send its reply. */
#define SHM_FETCH_TRIES 4
#define SHM_REPLY_STALL_NS (100ull * 1000000ull)
/* Regions up to this size are mapped with their page tables built (map_region). */
#define SHM_POPULATE_MAX (8ull << 20)
#define SHM_BATCH 1024 /* process_vm_writev iovecs per call */

/*
 * Address (32 bytes): u32 magic | u8 version | 3 zero | u64 token | u64 pid | u64 zero.
 * Rkey (64 bytes): u32 magic | u8 version | u8 mode | u16 zero | u64 token | u64 region
 *   | u64 len | u64 pid | u64 addr | u64 secret | u64 zero.
 * Message: 16-byte header u32 magic | u8 version | u8 type | u16 flags (zero)
 *   | u32 payload length | u32 zero, then the payload:
 *   HELLO     token u64 (the receiver's, from its address) | sender pid u64
 *   HELLO_ACK token u64
 *   NOTIFY    the notification (0..KVW_TL_MAX_NOTIFY bytes)
 *   FD_REQ    region u64 | secret u64
 *   FD_REP    status i32 | u32 zero | offset of the region in the file u64 | len u64,
 *             with the memory file attached (SCM_RIGHTS) when status is 0.
 */
enum { SHM_HELLO = 1, SHM_HELLO_ACK = 2, SHM_NOTIFY = 3, SHM_FD_REQ = 4, SHM_FD_REP = 5 };
enum { SHM_MODE_MEMFD = 1, SHM_MODE_CMA = 2 };
enum { CONN_NEW, CONN_EP, CONN_DONE };

typedef struct shm_iface shm_iface_t;

typedef struct shm_region {
    kvw_hnode_t node; /* in tl->regions, under id */
    uint64_t id;
    uint8_t *addr;
    uint64_t len;
    int memfd; /* own duplicate of the memory file, or -1 (cma mode) */
    uint64_t memfd_off;
    uint64_t secret;
} shm_region_t;

typedef struct shm_ep {
    kvw__sock_ep_t s; /* fd, peer, peer_token (the receiver's), dead, tx_mu, ... */
    /* accepted: thread only */
    int state;
    /* connected */
    pid_t peer_pid;
    struct sockaddr_un peer_sun;
    socklen_t peer_sun_len;
} shm_ep_t;

typedef struct shm_rkey {
    kvw__tl_rkey_t hd; /* ep, region_id, len; on srv.rkeys */
    shm_iface_t *tl;
    int mode;
    void *map;      /* memfd mode: the mapping */
    size_t map_len;
    uint8_t *dst;   /* memfd mode: the region's first byte in the mapping */
    uint64_t raddr; /* cma mode: the region's address in the receiver */
} shm_rkey_t;

struct shm_iface {
    kvw__sockserv_t srv; /* listener, endpoints, receive thread; srv.token names us */
    struct sockaddr_un sun;
    socklen_t sun_len;

    kvw_hmap_t regions; /* srv.reg_mu */

    uint8_t rxbuf[SHM_MAX_MSG + 8]; /* receive thread only */
};

static inline shm_iface_t *to_iface(kvw_tl_h tl)
{
    return (shm_iface_t *)(void *)tl;
}
static inline shm_ep_t *to_ep(kvw_tl_ep_h ep)
{
    return (shm_ep_t *)(void *)ep;
}
static inline shm_ep_t *sock_to_ep(kvw__sock_ep_t *ep)
{
    return (shm_ep_t *)(void *)ep;
}
static inline shm_iface_t *ep_iface(const shm_ep_t *ep)
{
    return (shm_iface_t *)(void *)ep->s.srv;
}

static void hdr_encode(uint8_t *p, uint8_t type, uint32_t len)
{
    kvw__le32_put(p, SHM_MSG_MAGIC);
    p[4] = SHM_VERSION;
    p[5] = type;
    kvw__le16_put(p + 6, 0);
    kvw__le32_put(p + 8, len);
    kvw__le32_put(p + 12, 0);
}

static void make_sun(uint64_t pid, uint64_t token, struct sockaddr_un *sun, socklen_t *len_p)
{
    memset(sun, 0, sizeof(*sun));
    sun->sun_family = AF_UNIX;
    /* Abstract namespace (leading NUL): nothing to clean up if the process dies. */
    int n = snprintf(sun->sun_path + 1, sizeof(sun->sun_path) - 1, "kvwire-shm-%llu-%016llx",
                     (unsigned long long)pid, (unsigned long long)token);
    *len_p = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Sends one message (header + payload, optionally with an fd) on a non-blocking
 * SOCK_SEQPACKET socket, waiting up to stall_ns for room (0: not at all). */
static kvw_status_t send_msg(int fd, uint8_t type, const void *payload, uint32_t len, int pass_fd,
                             uint64_t stall_ns, const char *what)
{
    uint8_t h[SHM_HDR_LEN];
    hdr_encode(h, type, len);
    struct iovec iov[2] = {{.iov_base = h, .iov_len = sizeof(h)},
                           {.iov_base = (void *)payload, .iov_len = len}};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } cm;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = len ? 2 : 1};
    if (pass_fd >= 0) {
        memset(&cm, 0, sizeof(cm));
        msg.msg_control = cm.buf;
        msg.msg_controllen = sizeof(cm.buf);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    for (;;) {
        ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r >= 0)
            return KVW_OK; /* a SOCK_SEQPACKET message goes whole or not at all */
        kvw_status_t st;
        if (kvw__sock_retry(fd, POLLOUT, KVW_SOCK_NO_DEADLINE, stall_ns, what, &st))
            continue;
        if (st != KVW_OK)
            return st;
        if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN)
            return kvw__error(KVW_ERR_CONN_CLOSED, "%s: the peer closed the connection: %m",
                              what);
        return kvw__error(KVW_ERR_IO, "%s: sendmsg: %m", what);
    }
}

/* Closes every descriptor carried by a received message's SCM_RIGHTS data. */
static void close_passed_fds(struct msghdr *msg)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            close(fd);
        }
    }
}

/*
 * Receives one whole message of the expected type within stall_ns. The payload must
 * be exactly `len` bytes. When fd_p is given, the one attached descriptor is returned
 * there (or -1 if none came); any other descriptor is closed.
 */
static kvw_status_t recv_msg(int fd, uint8_t type, void *payload, uint32_t len, int *fd_p,
                             uint64_t stall_ns, const char *what)
{
    uint8_t buf[SHM_HDR_LEN + 64];
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(4 * sizeof(int))];
    } cm;
    if (fd_p)
        *fd_p = -1;
    for (;;) {
        struct iovec iov = {.iov_base = buf, .iov_len = sizeof(buf)};
        struct msghdr msg = {.msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = cm.buf,
                             .msg_controllen = sizeof(cm.buf)};
        ssize_t r = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        kvw_status_t st;
        if (r < 0 && kvw__sock_retry(fd, POLLIN, KVW_SOCK_NO_DEADLINE, stall_ns, what, &st))
            continue;
        if (r < 0 && st != KVW_OK)
            return st;
        if (r < 0)
            return kvw__error(errno == ECONNRESET ? KVW_ERR_CONN_CLOSED : KVW_ERR_IO,
                              "%s: recvmsg: %m", what);
        if (r == 0)
            return kvw__error(KVW_ERR_CONN_CLOSED, "%s: the peer closed the connection", what);
        int got_fd = -1;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
                c->cmsg_len == CMSG_LEN(sizeof(int)) && got_fd < 0 && fd_p) {
                memcpy(&got_fd, CMSG_DATA(c), sizeof(int));
            } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < n; i++) {
                    int extra;
                    memcpy(&extra, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                    close(extra);
                }
            }
        }
        bool ok = !(msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) &&
                  (size_t)r == SHM_HDR_LEN + (size_t)len &&
                  kvw__le32_get(buf) == SHM_MSG_MAGIC && buf[4] == SHM_VERSION &&
                  buf[5] == type && kvw__le16_get(buf + 6) == 0 &&
                  kvw__le32_get(buf + 8) == len && kvw__le32_get(buf + 12) == 0;
        if (!ok) {
            if (got_fd >= 0)
                close(got_fd);
            return kvw__error(KVW_ERR_MALFORMED,
                              "%s: unexpected reply (%zd bytes, type %u, version %u)", what, r,
                              r >= 6 ? buf[5] : 0, r >= 5 ? buf[4] : 0);
        }
        memcpy(payload, buf + SHM_HDR_LEN, len);
        if (fd_p)
            *fd_p = got_fd;
        return KVW_OK;
    }
}

/* Opens a connection to a receiver's abstract socket, retrying while its backlog is
 * full, within stall_ns. */
static kvw_status_t connect_sun(const struct sockaddr_un *sun, socklen_t sun_len,
                                uint64_t stall_ns, const char *what, int *fd_p)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvw__error(KVW_ERR_IO, "%s: socket: %m", what);
    uint64_t deadline = kvw__now_ns() + stall_ns;
    for (;;) {
        if (connect(fd, (const struct sockaddr *)sun, sun_len) == 0)
            break;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN && kvw__now_ns() < deadline) {
            usleep(1000); /* backlog full: the receiver is busy accepting */
            continue;
        }
        kvw_status_t st =
            errno == ECONNREFUSED || errno == ENOENT
                ? kvw__error(KVW_ERR_CONN_CLOSED,
                             "%s: no shm receiver listens at @%s (process gone?): %m", what,
                             sun->sun_path + 1)
                : kvw__error(errno == EAGAIN ? KVW_ERR_TIMEOUT : KVW_ERR_IO,
                             "%s: connect to @%s: %m", what, sun->sun_path + 1);
        close(fd);
        return st;
    }
    *fd_p = fd;
    return KVW_OK;
}

/* ---------------------------------------------------------------- endpoints */

/* Receive thread: answers an rkey fetch. Every outcome ends the connection quietly;
 * the requester learns the status from the reply. */
static void serve_fd_req(shm_iface_t *tl, shm_ep_t *ep, const uint8_t *p)
{
    uint64_t id = kvw__le64_get(p), secret = kvw__le64_get(p + 8);
    uint8_t rep[24] = {0};
    int fd = -1;
    int32_t status = KVW_ERR_NOT_FOUND;
    pthread_mutex_lock(&tl->srv.reg_mu);
    kvw_hnode_t *n = kvw__hmap_find(&tl->regions, id);
    const shm_region_t *r = n ? KVW_CONTAINER_OF(n, shm_region_t, node) : NULL;
    if (r && (r->memfd < 0 || r->secret != secret)) {
        status = KVW_ERR_REJECTED;
    } else if (r) {
        fd = fcntl(r->memfd, F_DUPFD_CLOEXEC, 0);
        status = fd >= 0 ? KVW_OK : KVW_ERR_IO;
        kvw__le64_put(rep + 8, r->memfd_off);
        kvw__le64_put(rep + 16, r->len);
    }
    pthread_mutex_unlock(&tl->srv.reg_mu);
    kvw__le32_put(rep, (uint32_t)status);
    /* The reply is small and the socket fresh: room is waited for briefly only. */
    if (send_msg(ep->s.fd, SHM_FD_REP, rep, sizeof(rep), fd, SHM_REPLY_STALL_NS,
                 "shm fd reply") != KVW_OK)
        kvw__log(KVW_LOG_WARN, "shm: answering an rkey fetch for region %llu: %s",
                 (unsigned long long)id, kvw_last_error());
    if (fd >= 0)
        close(fd);
    ep->state = CONN_DONE;
    kvw__sock_ep_fail(&ep->s, KVW_OK, "rkey fetch served");
}

/* Receive thread: reads the messages an accepted connection has. */
static void ep_rx(shm_iface_t *tl, shm_ep_t *ep)
{
    for (int k = 0; k < SHM_RX_BUDGET && !ep->s.reported && !atomic_load(&ep->s.closing); k++) {
        struct iovec iov = {.iov_base = tl->rxbuf, .iov_len = sizeof(tl->rxbuf)};
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(4 * sizeof(int))];
        } cm;
        struct msghdr msg = {.msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = cm.buf,
                             .msg_controllen = sizeof(cm.buf)};
        ssize_t r = recvmsg(ep->s.fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return;
            kvw__sock_ep_fail(&ep->s, errno == ECONNRESET ? KVW_ERR_CONN_CLOSED : KVW_ERR_IO,
                              "recvmsg: %s", strerror(errno));
            return;
        }
        if (msg.msg_controllen > 0)
            close_passed_fds(&msg); /* nobody may push descriptors at the receiver */
        if (r == 0) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_CONN_CLOSED, "%s",
                              ep->state == CONN_NEW ? "peer closed the connection before HELLO"
                              : "peer closed the connection");
            return;
        }
        ep->s.last_rx_ns = kvw__now_ns();
        const uint8_t *b = tl->rxbuf;
        if ((msg.msg_flags & MSG_TRUNC) || (size_t)r > SHM_MAX_MSG) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED, "message of more than %u bytes",
                              SHM_MAX_MSG);
            return;
        }
        if (r < SHM_HDR_LEN) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                              "message of %zd bytes is shorter than a header",
                              r);
            return;
        }
        uint32_t magic = kvw__le32_get(b), len = kvw__le32_get(b + 8);
        if (magic != SHM_MSG_MAGIC || b[4] != SHM_VERSION || kvw__le16_get(b + 6) != 0 ||
            kvw__le32_get(b + 12) != 0) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                              "bad message header (magic 0x%08x, version %u; this side speaks "
                              "%u)",
                              magic, b[4], SHM_VERSION);
            return;
        }
        if ((size_t)len != (size_t)r - SHM_HDR_LEN) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                              "message says %u payload bytes but carries %zd",
                              len, r - SHM_HDR_LEN);
            return;
        }
        const uint8_t *p = b + SHM_HDR_LEN;
        uint8_t type = b[5];
        if (ep->state == CONN_NEW && type == SHM_HELLO && len == 16) {
            uint64_t token = kvw__le64_get(p);
            if (token != tl->srv.token) {
                kvw__sock_ep_fail(&ep->s, KVW_ERR_REJECTED,
                                  "HELLO for receiver token %016llx, but this receiver is %016llx",
                                  (unsigned long long)token, (unsigned long long)tl->srv.token);
                return;
            }
            uint8_t ack[8];
            kvw__le64_put(ack, tl->srv.token);
            kvw_status_t st = send_msg(ep->s.fd, SHM_HELLO_ACK, ack, sizeof(ack), -1, 0,
                                       "shm HELLO_ACK");
            if (st != KVW_OK) {
                kvw__sock_ep_fail(&ep->s, st, "cannot answer HELLO: %s", kvw_last_error());
                return;
            }
            ep->state = CONN_EP;
        } else if (ep->state == CONN_NEW && type == SHM_FD_REQ && len == 16) {
            serve_fd_req(tl, ep, p);
            return;
        } else if (ep->state == CONN_EP && type == SHM_NOTIFY) {
            tl->srv.cb.on_notify(tl->srv.cb.arg, (kvw_tl_ep_h)(void *)ep,
                                 len ? p : (const void *)"", len);
        } else {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                              "unexpected message type %u (%u bytes) %s", type,
                              len, ep->state == CONN_NEW ? "before HELLO" : "after HELLO");
            return;
        }
    }
}

/* ---------------------------------------------------------------- socket server hooks */

static kvw__sock_ep_t *srv_accept(kvw__sockserv_t *srv, int fd, const struct sockaddr *sa,
                                  socklen_t sa_len)
{
    (void)sa;
    (void)sa_len;
    /* Abstract socket names are visible to every local user (/proc/net/unix) and carry
     * no permissions: only the receiver's own user, or root, may connect. Anyone else
     * is closed before a byte is read. */
    struct ucred cr;
    socklen_t cl = sizeof(cr);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0 ||
        (cr.uid != geteuid() && cr.uid != 0))
        return NULL;
    shm_ep_t *ep = calloc(1, sizeof(*ep));
    if (ep == NULL)
        return NULL;
    kvw__sock_ep_init(&ep->s, srv, fd, true);
    snprintf(ep->s.hd.peer, sizeof(ep->s.hd.peer), "pid %d", (int)cr.pid);
    ep->state = CONN_NEW;
    return &ep->s;
}

static void srv_rx(kvw__sock_ep_t *s)
{
    shm_ep_t *ep = sock_to_ep(s);
    ep_rx(ep_iface(ep), ep);
}

/* A connection must say HELLO (or ask for an rkey) within the timeout. */
static void srv_stalled(kvw__sock_ep_t *s)
{
    shm_ep_t *ep = sock_to_ep(s);
    if (ep->state == CONN_NEW)
        kvw__sock_ep_fail(&ep->s, KVW_ERR_TIMEOUT, "no HELLO within %llu ms",
                          (unsigned long long)(ep_iface(ep)->srv.timeout_ns / 1000000ull));
}

static void srv_ep_free(kvw__sock_ep_t *s)
{
    free(sock_to_ep(s));
}

static void rkey_free(shm_rkey_t *rk);

static void srv_rkey_free(kvw__tl_rkey_t *rk)
{
    rkey_free((shm_rkey_t *)(void *)rk);
}

static const kvw__sockserv_ops_t shm_srv_ops = {
    .name = "shm",
    .max_conns = SHM_MAX_CONNS,
    .unexpected = "unexpected message from the receiver",
    /* Checked right now, so that a cma write never lands in a process that reused a
     * dead receiver's pid. */
    .probe_hup = true,
    .gone = {"the receiver (", ") is gone"},
    .accept = srv_accept,
    .rx = srv_rx,
    .stalled = srv_stalled,
    .ep_free = srv_ep_free,
    .rkey_free = srv_rkey_free,
};

/* ---------------------------------------------------------------- ops */

static kvw_status_t shm_init(const kvw_tl_params_t *params, kvw_tl_h *tl_p)
{
    kvw_status_t st;
    shm_iface_t *tl = kvw__sockserv_new(&shm_srv_ops, params, tl_p, sizeof(*tl), &st);
    if (tl == NULL)
        return st;
    /* listen_host and listen_port do not apply: the socket is named by pid and token. */
    make_sun((uint64_t)getpid(), tl->srv.token, &tl->sun, &tl->sun_len);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        st = kvw__error(KVW_ERR_IO, "shm init: socket: %m");
        goto err_delete;
    }
    tl->srv.listen_fd = fd;
    if (bind(fd, (struct sockaddr *)&tl->sun, tl->sun_len) != 0 || listen(fd, 512) != 0) {
        st = kvw__error(KVW_ERR_IO, "shm init: cannot listen on @%s: %m", tl->sun.sun_path + 1);
        goto err_delete;
    }
    if ((st = kvw__sockserv_start(&tl->srv)) != KVW_OK)
        goto err_delete;
    *tl_p = (kvw_tl_h)(void *)tl;
    return KVW_OK;

err_delete:
    kvw__sockserv_delete(&tl->srv);
    return st;
}

static kvw_status_t shm_address(kvw_tl_h tl_h, void *buf, size_t *len_p)
{
    shm_iface_t *tl = to_iface(tl_h);
    kvw_status_t st = kvw__tl_check_address("shm", tl, buf, len_p, SHM_ADDR_LEN);
    if (st != KVW_OK)
        return st;
    uint8_t *p = buf;
    kvw__tl_pack_head(p, SHM_ADDR_LEN, SHM_ADDR_MAGIC, SHM_VERSION, 0, tl->srv.token);
    kvw__le64_put(p + 16, (uint64_t)getpid());
    *len_p = SHM_ADDR_LEN;
    return KVW_OK;
}

/* A region that is not (or no longer) in the table, or any at fini. */
static void region_free(void *arg, kvw_hnode_t *n)
{
    shm_region_t *r = KVW_CONTAINER_OF(n, shm_region_t, node);
    (void)arg;
    if (r->memfd >= 0)
        close(r->memfd);
    free(r);
}

static kvw_status_t shm_mem_reg(kvw_tl_h tl_h, void *addr, uint64_t len, kvw_mem_kind_t kind,
                                uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                                size_t *rkey_len_p)
{
    shm_iface_t *tl = to_iface(tl_h);
    kvw_status_t st = kvw__tl_check_mem_reg("shm", tl, addr, len, kind, region_id, mem_p,
                                            rkey_buf, rkey_len_p);
    if (st != KVW_OK)
        return st;
    shm_region_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "shm mem_reg: no memory");
    r->id = region_id;
    r->addr = addr;
    r->len = len;
    r->memfd = -1;
    if (len > 0 && kvw__shm_mem_lookup(addr, len, &r->memfd, &r->memfd_off)) {
        st = kvw__random_bytes(&r->secret, sizeof(r->secret));
        if (st != KVW_OK) {
            region_free(NULL, &r->node);
            return st;
        }
    }
    pthread_mutex_lock(&tl->srv.reg_mu);
    st = kvw__tl_region_link("shm", &tl->regions, &r->node, region_id);
    pthread_mutex_unlock(&tl->srv.reg_mu);
    if (st != KVW_OK) {
        region_free(NULL, &r->node);
        return st;
    }

    uint8_t *p = rkey_buf;
    kvw__tl_pack_head(p, SHM_RKEY_LEN, SHM_RKEY_MAGIC, SHM_VERSION,
                      r->memfd >= 0 ? SHM_MODE_MEMFD : SHM_MODE_CMA, tl->srv.token);
    kvw__le64_put(p + 16, region_id);
    kvw__le64_put(p + 24, len);
    kvw__le64_put(p + 32, (uint64_t)getpid());
    kvw__le64_put(p + 40, (uint64_t)(uintptr_t)addr);
    kvw__le64_put(p + 48, r->secret);
    *rkey_len_p = SHM_RKEY_LEN;
    *mem_p = (kvw_tl_mem_h)(void *)r;
    return KVW_OK;
}

static void shm_mem_dereg(kvw_tl_h tl_h, kvw_tl_mem_h mem)
{
    shm_iface_t *tl = to_iface(tl_h);
    shm_region_t *r = (shm_region_t *)(void *)mem;
    if (tl == NULL || r == NULL)
        return;
    pthread_mutex_lock(&tl->srv.reg_mu);
    bool found = kvw__hmap_remove(&tl->regions, &r->node) == 0;
    pthread_mutex_unlock(&tl->srv.reg_mu);
    if (found)
        region_free(NULL, &r->node);
}

static kvw_status_t shm_connect(kvw_tl_h tl_h, const void *addr, size_t len, kvw_tl_ep_h *ep_p)
{
    shm_iface_t *tl = to_iface(tl_h);
    const uint8_t *a = addr;
    if (tl == NULL || ep_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "shm connect: NULL argument");
    if (atomic_load(&tl->srv.closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "shm connect: the transport is closed");
    if (a == NULL || len != SHM_ADDR_LEN || kvw__le32_get(a) != SHM_ADDR_MAGIC ||
        a[4] != SHM_VERSION)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "shm connect: %zu bytes are not an shm address of version %u", len,
                          SHM_VERSION);
    uint64_t token = kvw__le64_get(a + 8), pid = kvw__le64_get(a + 16);
    shm_ep_t *ep = calloc(1, sizeof(*ep));
    if (ep == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "shm connect: no memory");
    make_sun(pid, token, &ep->peer_sun, &ep->peer_sun_len);
    kvw_status_t st = connect_sun(&ep->peer_sun, ep->peer_sun_len, tl->srv.timeout_ns,
                                  "shm connect", &ep->s.fd);
    if (st != KVW_OK)
        goto err_free;
    uint8_t hello[16];
    kvw__le64_put(hello, token);
    kvw__le64_put(hello + 8, (uint64_t)getpid());
    st = send_msg(ep->s.fd, SHM_HELLO, hello, sizeof(hello), -1, tl->srv.timeout_ns, "shm HELLO");
    if (st != KVW_OK)
        goto err_close_socket;
    uint8_t ack[8];
    st = recv_msg(ep->s.fd, SHM_HELLO_ACK, ack, sizeof(ack), NULL, tl->srv.timeout_ns,
                  "shm HELLO_ACK");
    if (st == KVW_ERR_CONN_CLOSED)
        st = kvw__error(KVW_ERR_REJECTED,
                        "shm connect to @%s: the receiver closed the connection during the "
                        "handshake (wrong token or version?)",
                        ep->peer_sun.sun_path + 1);
    if (st != KVW_OK)
        goto err_close_socket;
    if (kvw__le64_get(ack) != token) {
        st = kvw__error(KVW_ERR_MALFORMED, "shm connect: HELLO_ACK for another receiver");
        goto err_close_socket;
    }
    struct ucred cr;
    socklen_t cl = sizeof(cr);
    if (getsockopt(ep->s.fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0 || cr.pid <= 0) {
        st = kvw__error(KVW_ERR_IO, "shm connect: cannot identify the receiving process: %m");
        goto err_close_socket;
    }
    kvw__sock_ep_init(&ep->s, &tl->srv, ep->s.fd, false);
    ep->peer_pid = cr.pid;
    ep->s.hd.peer_token = token;
    snprintf(ep->s.hd.peer, sizeof(ep->s.hd.peer), "pid %d", (int)cr.pid);
    kvw__sock_ep_add(&ep->s);
    *ep_p = (kvw_tl_ep_h)(void *)ep;
    return KVW_OK;

err_close_socket:
    close(ep->s.fd);
err_free:
    free(ep);
    return st;
}

/* Fetches and maps the memory file behind a memfd-mode region. */
static kvw_status_t map_region(shm_ep_t *ep, shm_rkey_t *rk, uint64_t secret)
{
    uint64_t tmo = ep_iface(ep)->srv.timeout_ns;
    int sock, memfd = -1;
    uint8_t req[16], rep[24];
    kvw__le64_put(req, rk->hd.region_id);
    kvw__le64_put(req + 8, secret);
    kvw_status_t st = KVW_OK;
    /* A fetch only asks for a descriptor, so a connection that ended without a reply is
     * asked again (a few times): on a loaded host the receiver's reply was seen to be
     * lost about once in a hundred start-ups of many ranks. */
    for (int attempt = 0; attempt < SHM_FETCH_TRIES; attempt++) {
        if (attempt)
            usleep(1000u << attempt);
        st = connect_sun(&ep->peer_sun, ep->peer_sun_len, tmo, "shm rkey fetch", &sock);
        if (st != KVW_OK)
            return st;
        st = send_msg(sock, SHM_FD_REQ, req, sizeof(req), -1, tmo, "shm rkey fetch");
        if (st == KVW_OK)
            st = recv_msg(sock, SHM_FD_REP, rep, sizeof(rep), &memfd, tmo, "shm rkey fetch");
        close(sock);
        if (st != KVW_ERR_CONN_CLOSED)
            break;
    }
    if (st != KVW_OK)
        return st;
    int32_t status = (int32_t)kvw__le32_get(rep);
    uint64_t off = kvw__le64_get(rep + 8), len = kvw__le64_get(rep + 16);
    if (status != KVW_OK || memfd < 0) {
        st = kvw__error(status == KVW_ERR_NOT_FOUND ? KVW_ERR_NOT_FOUND : KVW_ERR_REJECTED,
                        "shm rkey_unpack: the receiver refused the memory of region %llu: %s",
                        (unsigned long long)rk->hd.region_id,
                        status != KVW_OK ? kvw_status_string((kvw_status_t)status)
                                         : "no descriptor attached");
        goto err_close_fd;
    }
    /* The file must be sealed against shrinking, or the receiver could turn our writes
     * into SIGBUS; and it must really hold the region. */
    struct stat sb;
    int seals = fcntl(memfd, F_GET_SEALS);
    uint64_t end;
    if (len != rk->hd.len || fstat(memfd, &sb) != 0 || !kvw__add_u64(off, len, &end) ||
        end > (uint64_t)sb.st_size || seals < 0 || !(seals & F_SEAL_SHRINK)) {
        st = kvw__error(KVW_ERR_REJECTED,
                        "shm rkey_unpack: region %llu: the memory file does not hold "
                        "[%llu, +%llu) or is not sealed against shrinking",
                        (unsigned long long)rk->hd.region_id, (unsigned long long)off,
                        (unsigned long long)len);
        goto err_close_fd;
    }
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t map_off = off / pg * pg;
    uint64_t map_len = (end - map_off + pg - 1) / pg * pg;
    if (map_len > SIZE_MAX) {
        st = kvw__error(KVW_ERR_OUT_OF_RANGE, "shm rkey_unpack: region too large to map");
        goto err_close_fd;
    }
    /* A small region's page tables are built now (MAP_POPULATE), at handshake time,
     * instead of taking a fault per page on its first transfer. A large one is left to
     * fault in the pages that are written: populating costs time and page tables for
     * every page of the region for every pair of ranks (a decode rank's 64 MiB staging
     * area took 90% of the start-up of 48 prefill ranks x 8 decode ranks on one host,
     * docs/SCALING.md), where a rank pair writes only the pages of its rooms. */
    int populate = map_len <= SHM_POPULATE_MAX ? MAP_POPULATE : 0;
    void *m = mmap(NULL, (size_t)map_len, PROT_READ | PROT_WRITE, MAP_SHARED | populate,
                   memfd, (off_t)map_off);
    if (m == MAP_FAILED) {
        st = kvw__error(errno == ENOMEM ? KVW_ERR_NO_MEMORY : KVW_ERR_IO,
                        "shm rkey_unpack: mmap of region %llu (%llu bytes): %m",
                        (unsigned long long)rk->hd.region_id, (unsigned long long)map_len);
        goto err_close_fd;
    }
    close(memfd);
    rk->map = m;
    rk->map_len = (size_t)map_len;
    rk->dst = (uint8_t *)m + (off - map_off);
    return KVW_OK;

err_close_fd:
    if (memfd >= 0)
        close(memfd);
    return st;
}

static kvw_status_t shm_rkey_unpack(kvw_tl_ep_h ep_h, const void *buf, size_t len,
                                    kvw_tl_rkey_h *rkey_p)
{
    shm_ep_t *ep = to_ep(ep_h);
    const uint8_t *p = buf;
    kvw_status_t st = kvw__tl_check_unpack("shm", ep ? &ep->s.hd : NULL, buf, rkey_p);
    if (st != KVW_OK)
        return st;
    if (len != SHM_RKEY_LEN || kvw__le32_get(p) != SHM_RKEY_MAGIC || p[4] != SHM_VERSION ||
        (p[5] != SHM_MODE_MEMFD && p[5] != SHM_MODE_CMA))
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "shm rkey_unpack: %zu bytes are not an shm remote key of version %u",
                          len, SHM_VERSION);
    if ((st = kvw__tl_check_key_token(&ep->s.hd, kvw__le64_get(p + 8))) != KVW_OK)
        return st;
    shm_rkey_t *rk = calloc(1, sizeof(*rk));
    if (rk == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "shm rkey_unpack: no memory");
    rk->tl = ep_iface(ep);
    rk->hd.ep = &ep->s.hd;
    rk->mode = p[5];
    rk->hd.region_id = kvw__le64_get(p + 16);
    rk->hd.len = kvw__le64_get(p + 24);
    rk->raddr = kvw__le64_get(p + 40);
    uint64_t end;
    if (!kvw__add_u64(rk->raddr, rk->hd.len, &end)) {
        free(rk);
        return kvw__error(KVW_ERR_INVALID_PARAM, "shm rkey_unpack: region wraps the address space");
    }
    if (rk->mode == SHM_MODE_MEMFD && rk->hd.len > 0) {
        st = map_region(ep, rk, kvw__le64_get(p + 48));
        if (st != KVW_OK) {
            free(rk);
            return st;
        }
    }
    kvw__tl_rkey_link(&rk->tl->srv.mu, &rk->tl->srv.rkeys, &rk->hd);
    *rkey_p = (kvw_tl_rkey_h)(void *)rk;
    return KVW_OK;
}

static void rkey_free(shm_rkey_t *rk)
{
    if (rk->map)
        munmap(rk->map, rk->map_len);
    free(rk);
}

static void shm_rkey_release(kvw_tl_rkey_h rkey)
{
    shm_rkey_t *rk = (shm_rkey_t *)(void *)rkey;
    if (rk == NULL)
        return;
    kvw__tl_rkey_unlink(&rk->tl->srv.mu, &rk->tl->srv.rkeys, &rk->hd);
    rkey_free(rk);
}

static kvw_status_t check_sendable(shm_ep_t *ep, const char *what)
{
    return kvw__sock_check_sendable("shm", ep ? &ep->s : NULL, what);
}

static kvw_status_t cma_flush(shm_ep_t *ep, struct iovec *l, struct iovec *r, size_t cnt)
{
    size_t i = 0;
    while (i < cnt) {
        ssize_t w = process_vm_writev(ep->peer_pid, l + i, cnt - i, r + i, cnt - i, 0);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            int err = errno;
            if (err == ESRCH) {
                atomic_store(&ep->s.dead, true);
                return kvw__error(KVW_ERR_CONN_CLOSED, "shm put: receiver %s is gone: %m",
                                  ep->s.hd.peer);
            }
            if (err == EPERM)
                return kvw__error(KVW_ERR_IO,
                                  "shm put: process_vm_writev into %s not permitted (%m): "
                                  "needs the same user or CAP_SYS_PTRACE, and Yama "
                                  "ptrace_scope <= 1; or register memory from "
                                  "kvw_mem_alloc_shared",
                                  ep->s.hd.peer);
            return kvw__error(err == ENOMEM ? KVW_ERR_NO_MEMORY : KVW_ERR_IO,
                              "shm put: process_vm_writev into %s at 0x%llx: %m", ep->s.hd.peer,
                              (unsigned long long)(uintptr_t)r[i].iov_base);
        }
        if (w == 0)
            return kvw__error(KVW_ERR_IO, "shm put: process_vm_writev into %s made no progress",
                              ep->s.hd.peer);
        size_t left = (size_t)w;
        while (i < cnt && left >= l[i].iov_len) {
            left -= l[i].iov_len;
            i++;
        }
        if (left > 0) {
            l[i].iov_base = (char *)l[i].iov_base + left;
            l[i].iov_len -= left;
            r[i].iov_base = (char *)r[i].iov_base + left;
            r[i].iov_len -= left;
        }
    }
    return KVW_OK;
}

static kvw_status_t shm_put(kvw_tl_ep_h ep_h, uint64_t room, const kvw_tl_put_t *puts, size_t n)
{
    shm_ep_t *ep = to_ep(ep_h);
    (void)room; /* one-sided: the receiver never sees it (see the file comment) */
    kvw_status_t st =
        kvw__tl_check_puts(check_sendable(ep, "put"), ep ? &ep->s.hd : NULL, puts, n);
    if (st != KVW_OK)
        return st;
    for (size_t i = 0; i < n; i++) {
        if (puts[i].len > (uint64_t)SSIZE_MAX)
            return kvw__error(KVW_ERR_INVALID_PARAM, "shm put %zu of %zu: %llu bytes is too large",
                              i, n, (unsigned long long)puts[i].len);
    }
    struct iovec l[SHM_BATCH], r[SHM_BATCH];
    size_t cnt = 0;
    for (size_t i = 0; i < n && st == KVW_OK; i++) {
        const shm_rkey_t *rk = (const shm_rkey_t *)(const void *)puts[i].rkey;
        if (puts[i].len == 0)
            continue;
        if (rk->mode == SHM_MODE_MEMFD) {
            if (cnt > 0) { /* keep the order of overlapping writes */
                st = cma_flush(ep, l, r, cnt);
                cnt = 0;
                if (st != KVW_OK)
                    break;
            }
            memcpy(rk->dst + puts[i].dst_off, puts[i].src, (size_t)puts[i].len);
            continue;
        }
        l[cnt] = (struct iovec){.iov_base = (void *)puts[i].src, .iov_len = (size_t)puts[i].len};
        r[cnt] = (struct iovec){.iov_base = (void *)(uintptr_t)(rk->raddr + puts[i].dst_off),
                                .iov_len = (size_t)puts[i].len};
        if (++cnt == SHM_BATCH) {
            st = cma_flush(ep, l, r, cnt);
            cnt = 0;
        }
    }
    if (st == KVW_OK && cnt > 0)
        st = cma_flush(ep, l, r, cnt);
    if (st != KVW_OK)
        atomic_store(&ep->s.dead, true); /* same rule as every transport: see transport.h */
    return st;
}

static kvw_status_t shm_notify(kvw_tl_ep_h ep_h, const void *msg, size_t len)
{
    shm_ep_t *ep = to_ep(ep_h);
    kvw_status_t st =
        kvw__tl_check_notify(check_sendable(ep, "notify"), ep ? &ep->s.hd : NULL, msg, len);
    if (st != KVW_OK)
        return st;
    /* The writes before this call were plain stores into shared pages (or completed
     * inside the kernel): make them visible before the message that announces them. */
    atomic_thread_fence(memory_order_seq_cst);
    pthread_mutex_lock(&ep->s.tx_mu);
    st = send_msg(ep->s.fd, SHM_NOTIFY, msg, (uint32_t)len, -1, ep_iface(ep)->srv.timeout_ns,
                  "shm notify");
    if (st != KVW_OK)
        atomic_store(&ep->s.dead, true);
    pthread_mutex_unlock(&ep->s.tx_mu);
    return st;
}

static void shm_fini(kvw_tl_h tl_h)
{
    shm_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    kvw__sockserv_fini(&tl->srv);
    kvw__tl_regions_free(&tl->regions, region_free, NULL);
    kvw__sockserv_delete(&tl->srv);
}

const kvw_tl_ops_t kvw_tl_shm_ops = {
    .name = "shm",
    KVW_TL_OPS_SLOTS(shm),
    KVW__SOCKSERV_OPS_SLOTS,
    .caps = KVW_TL_CAP_SYNC_PUT, /* not mediated: the sending library confines its writes */
};
