/*
 * The tcp transport: works between any two hosts.
 *
 * Sender: connect() opens one TCP connection per endpoint and says HELLO with the
 * receiver's token (taken from its address), so that rkeys and puts can never reach a
 * different instance that happens to reuse the port. put() checks every write against
 * the rkey's region locally, then writes PUT frames (header + payload) with sendmsg,
 * batching many frames per call; a per-endpoint mutex keeps the frames of concurrent
 * callers whole. notify() writes a NOTIFY frame on the same byte stream, so it is
 * delivered after every PUT written before it.
 *
 * Receiver: one thread (the socket server, sockserv.c) polls the listening socket and
 * every connection (non-blocking), and tcp runs a small state machine per connection over
 * what it reads (64 KiB at a time into one buffer, so that many small frames cost one
 * read). For each PUT header it checks that the region is registered and that
 * [off, off + len) lies inside it, asks cb.check_write (with the connection), and only
 * then lands the payload: copied from the buffer when small, received straight into the
 * registered memory from 32 KiB up (no intermediate copy); a refused payload is read and
 * discarded.
 * A frame that is malformed, truncated, out of range, or stalled longer than the
 * timeout drops that connection only (on_ep_error says why); the others keep going.
 *
 * The same thread watches connected (sending) endpoints: the receiver never sends
 * after HELLO_ACK, so readability there means the receiver went away, which is
 * reported through on_ep_error and makes later puts fail with CONN_CLOSED.
 *
 * Addresses carry the bound IP and port: listen on a concrete address that peers can
 * reach; a wildcard listen (0.0.0.0) publishes the wildcard, usable from the same
 * host only. listen_host may be a name; resolving it in init may block on DNS.
 *
 * Deregistration is safe against in-flight payloads: payload bytes are received or
 * copied with the region table's lock held (one bounded, non-blocking recv or one copy of
 * at most 64 KiB at a time), so once
 * mem_dereg returns no byte lands in that region any more; the rest of such a payload
 * is discarded.
 */
#include "transport/sockserv.h"
#include "transport/tcp/tcp_wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define TCP_MAX_BATCH 256          /* PUT frames per sendmsg batch (two iovecs each) */
#define TCP_RX_BUDGET (16u << 20)  /* bytes taken from one connection before the others */
#define TCP_RX_CHUNK (4u << 20)    /* largest single recv into registered memory */
#define TCP_RX_BUF (64u << 10)     /* the receive thread's read buffer */
#define TCP_RX_DIRECT (32u << 10)  /* payloads this large are read into place, not copied */
#define TCP_MAX_CONNS 4096         /* accepted connections at once; more are refused */
#define TCP_SOCKBUF (4 << 20)

typedef struct tcp_iface tcp_iface_t;

typedef struct tcp_region {
    kvw_hnode_t node; /* in tl->regions, under id */
    uint64_t id;
    uint8_t *addr;
    uint64_t len;
    unsigned refs; /* the table's reference + one per connection receiving into it */
    bool dead;     /* deregistered: no byte may land any more */
} tcp_region_t;

enum { RX_HELLO, RX_HDR, RX_PAYLOAD, RX_DISCARD, RX_NOTIFY };

typedef struct tcp_ep {
    kvw__sock_ep_t s;      /* fd, peer, peer_token (the receiver's), dead, tx_mu, ... */
    uint8_t *tx_hdrs;      /* TCP_MAX_BATCH headers */
    struct iovec *tx_iov;  /* 2 * TCP_MAX_BATCH + 2 (the frames and a NOTIFY) */

    /* Receive state, touched by the receive thread only. */
    int rx_state;
    uint8_t rx_hdr[KVW_TCP_HDR_LEN];
    size_t rx_hdr_got;
    tcp_region_t *rx_region; /* referenced while receiving a payload into it */
    uint8_t *rx_dst;
    uint64_t rx_left;
    uint8_t *rx_note;
    size_t rx_note_len, rx_note_got;
} tcp_ep_t;

typedef struct tcp_rkey {
    kvw__tl_rkey_t hd; /* ep, region_id, len; on srv.rkeys */
    tcp_iface_t *tl;
} tcp_rkey_t;

struct tcp_iface {
    kvw__sockserv_t srv; /* listener, endpoints, receive thread; srv.token names us */
    struct sockaddr_storage listen_addr;

    /* Under srv.reg_mu, as is every payload byte landing in these regions. */
    kvw_hmap_t regions;

    uint8_t rxbuf[TCP_RX_BUF]; /* receive thread only; emptied by every ep_rx */
};

static inline tcp_iface_t *to_iface(kvw_tl_h tl)
{
    return (tcp_iface_t *)(void *)tl;
}
static inline tcp_ep_t *to_ep(kvw_tl_ep_h ep)
{
    return (tcp_ep_t *)(void *)ep;
}
static inline tcp_ep_t *sock_to_ep(kvw__sock_ep_t *ep)
{
    return (tcp_ep_t *)(void *)ep;
}
static inline tcp_iface_t *ep_iface(const tcp_ep_t *ep)
{
    return (tcp_iface_t *)(void *)ep->s.srv;
}

/* srv.reg_mu held. */
static tcp_region_t *region_find(tcp_iface_t *tl, uint64_t id)
{
    kvw_hnode_t *n = kvw__hmap_find(&tl->regions, id);
    return n ? KVW_CONTAINER_OF(n, tcp_region_t, node) : NULL;
}

/* srv.reg_mu held. */
/* Whether [off, off + len) lies inside region r (NULL: none). */
static bool region_inside(const tcp_region_t *r, uint64_t off, uint64_t len)
{
    return r && off <= r->len && len <= r->len - off;
}

static void region_unref(tcp_region_t *r)
{
    if (--r->refs == 0)
        free(r);
}

static void set_sock_opts(int fd)
{
    int one = 1, buf = TCP_SOCKBUF;
    /* Best effort: a smaller buffer or Nagle only costs speed, never correctness. */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

static void format_sockaddr(const struct sockaddr *sa, char *out, size_t cap)
{
    char host[INET6_ADDRSTRLEN] = "?";
    unsigned port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)(const void *)sa;
        inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
        port = ntohs(in->sin_port);
        snprintf(out, cap, "%s:%u", host, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)(const void *)sa;
        inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
        port = ntohs(in6->sin6_port);
        snprintf(out, cap, "[%s]:%u", host, port);
    } else {
        snprintf(out, cap, "(family %d)", sa->sa_family);
    }
}

/* Receive thread: drops the receive state's region reference. */
static void ep_rx_release(tcp_iface_t *tl, tcp_ep_t *ep)
{
    if (ep->rx_region) {
        pthread_mutex_lock(&tl->srv.reg_mu);
        region_unref(ep->rx_region);
        pthread_mutex_unlock(&tl->srv.reg_mu);
        ep->rx_region = NULL;
    }
}

/* Receive thread: a complete header is in ep->rx_hdr. */
static void on_header(tcp_iface_t *tl, tcp_ep_t *ep)
{
    kvw_tcp_hdr_t h;
    kvw_tcp_hdr_decode(ep->rx_hdr, &h);
    if (h.magic != KVW_TCP_FRAME_MAGIC) {
        kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED, "bad frame magic 0x%08x (expected 0x%08x)",
                          h.magic, KVW_TCP_FRAME_MAGIC);
        return;
    }
    if (h.version != KVW_TCP_VERSION) {
        kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                          "unsupported frame version %u (this side speaks %u)",
                          h.version, KVW_TCP_VERSION);
        return;
    }
    if (h.flags != 0) {
        kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                          "frame type %u with unknown flags 0x%04x", h.type,
                          h.flags);
        return;
    }
    if (ep->rx_state == RX_HELLO) {
        if (h.type != KVW_TCP_HELLO) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED, "expected HELLO first, got frame type %u",
                              h.type);
            return;
        }
        if (h.region != 0 || h.off != 0 || h.len != 0) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED, "HELLO with non-zero fields");
            return;
        }
        if (h.room != tl->srv.token) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_REJECTED,
                              "HELLO for receiver token %016llx, but this receiver is %016llx",
                              (unsigned long long)h.room, (unsigned long long)tl->srv.token);
            return;
        }
        uint8_t ack[KVW_TCP_ACK_LEN];
        kvw__le32_put(ack, KVW_TCP_FRAME_MAGIC);
        ack[4] = KVW_TCP_VERSION;
        ack[5] = KVW_TCP_HELLO_ACK;
        kvw__le16_put(ack + 6, 0);
        kvw__le64_put(ack + 8, tl->srv.token);
        /* A fresh socket's send buffer always has room for 16 bytes. */
        ssize_t r = send(ep->s.fd, ack, sizeof(ack), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r != (ssize_t)sizeof(ack)) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_IO, "cannot send HELLO_ACK: %s",
                              r < 0 ? strerror(errno) : "short write");
            return;
        }
        ep->rx_state = RX_HDR;
        return;
    }
    ep->s.greeted = true; /* a frame after HELLO */

    switch (h.type) {
    case KVW_TCP_PUT: {
        pthread_mutex_lock(&tl->srv.reg_mu);
        tcp_region_t *r = region_find(tl, h.region);
        uint64_t rlen = r ? r->len : 0;
        bool inside = region_inside(r, h.off, h.len);
        if (inside && h.len > 0)
            r->refs++;
        pthread_mutex_unlock(&tl->srv.reg_mu);
        if (r == NULL) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_OUT_OF_RANGE,
                              "PUT of %llu bytes for room %llu into unregistered region %llu",
                              (unsigned long long)h.len, (unsigned long long)h.room,
                              (unsigned long long)h.region);
            return;
        }
        if (!inside) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_OUT_OF_RANGE,
                              "PUT for room %llu at offset %llu, %llu bytes, outside region "
                              "%llu of %llu bytes",
                              (unsigned long long)h.room, (unsigned long long)h.off,
                              (unsigned long long)h.len, (unsigned long long)h.region,
                              (unsigned long long)rlen);
            return;
        }
        if (h.len == 0)
            return;
        kvw_status_t st = KVW_OK;
        if (tl->srv.cb.check_write)
            st = tl->srv.cb.check_write(tl->srv.cb.arg, (kvw_tl_ep_h)(void *)ep, h.room,
                                        h.region, h.off, h.len);
        if (st != KVW_OK) {
            pthread_mutex_lock(&tl->srv.reg_mu);
            region_unref(r);
            pthread_mutex_unlock(&tl->srv.reg_mu);
            ep->rx_state = RX_DISCARD;
            ep->rx_left = h.len;
            return;
        }
        /* The region cannot be freed while referenced; its address is fixed. */
        ep->rx_region = r;
        ep->rx_dst = r->addr + h.off;
        ep->rx_left = h.len;
        ep->rx_state = RX_PAYLOAD;
        return;
    }
    case KVW_TCP_NOTIFY:
        if (h.room != 0 || h.region != 0 || h.off != 0) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED, "NOTIFY with non-zero room/region/offset");
            return;
        }
        if (h.len > KVW_TL_MAX_NOTIFY) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                              "NOTIFY of %llu bytes exceeds the limit of %u bytes",
                              (unsigned long long)h.len, KVW_TL_MAX_NOTIFY);
            return;
        }
        if (h.len == 0) {
            if (!atomic_load(&ep->s.closing))
                tl->srv.cb.on_notify(tl->srv.cb.arg, (kvw_tl_ep_h)(void *)ep, "", 0);
            return;
        }
        if (ep->rx_note == NULL && (ep->rx_note = malloc(KVW_TL_MAX_NOTIFY)) == NULL) {
            kvw__sock_ep_fail(&ep->s, KVW_ERR_NO_MEMORY, "no memory for a notification buffer");
            return;
        }
        ep->rx_note_len = (size_t)h.len;
        ep->rx_note_got = 0;
        ep->rx_state = RX_NOTIFY;
        return;
    case KVW_TCP_HELLO:
        kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED, "second HELLO on one connection");
        return;
    default:
        kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED, "unknown frame type %u", h.type);
        return;
    }
}

/*
 * Receive thread: interprets one recv result. Returns true when r bytes arrived and
 * the caller should consume them; false when the socket is drained (EAGAIN) or the
 * endpoint failed.
 */
static bool rx_result(tcp_ep_t *ep, ssize_t r, size_t want)
{
    if (r > 0) {
        ep->s.last_rx_ns = kvw__now_ns();
        return true;
    }
    if (r == 0 && want > 0) {
        if (ep->rx_state == RX_HDR && ep->rx_hdr_got == 0)
            kvw__sock_ep_fail(&ep->s, KVW_ERR_CONN_CLOSED, "peer closed the connection");
        else if (ep->rx_state == RX_HELLO && ep->rx_hdr_got == 0)
            kvw__sock_ep_fail(&ep->s, KVW_ERR_CONN_CLOSED,
                              "peer closed the connection before HELLO");
        else if (ep->rx_state == RX_HELLO || ep->rx_state == RX_HDR)
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                              "truncated frame: peer closed after %zu of %u header bytes",
                              ep->rx_hdr_got, KVW_TCP_HDR_LEN);
        else
            kvw__sock_ep_fail(&ep->s, KVW_ERR_MALFORMED,
                              "truncated frame: peer closed with %llu payload bytes missing",
                              (unsigned long long)(ep->rx_state == RX_NOTIFY
                              ? ep->rx_note_len - ep->rx_note_got
                              : ep->rx_left));
        return false;
    }
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return false;
    if (r < 0 && errno == ECONNRESET)
        kvw__sock_ep_fail(&ep->s, KVW_ERR_CONN_CLOSED, "connection reset by peer");
    else if (r < 0)
        kvw__sock_ep_fail(&ep->s, KVW_ERR_IO, "recv: %s", strerror(errno));
    return false;
}

/* Receive thread: takes reg_mu to land payload bytes in the connection's region; false
 * (reg_mu not held, the rest of the payload to be discarded) when the region was
 * deregistered meanwhile. */
static bool rx_land_begin(tcp_iface_t *tl, tcp_ep_t *ep)
{
    pthread_mutex_lock(&tl->srv.reg_mu);
    if (!ep->rx_region->dead)
        return true;
    pthread_mutex_unlock(&tl->srv.reg_mu);
    ep_rx_release(tl, ep);
    ep->rx_state = RX_DISCARD;
    return false;
}

/* Receive thread: n more payload bytes landed (reg_mu let go); after the last, the next
 * header. */
static void rx_landed(tcp_iface_t *tl, tcp_ep_t *ep, size_t n)
{
    ep->rx_dst += n;
    ep->rx_left -= n;
    if (ep->rx_left == 0) {
        ep_rx_release(tl, ep);
        ep->rx_state = RX_HDR;
    }
}

/* Receive thread: a run of whole PUT frames at the start of `p` (n bytes, at a frame
 * boundary, after HELLO), landed together: their regions looked up under one hold of
 * reg_mu, the writes checked with one check_writes call (one lock of the receiver
 * instead of one per frame), the allowed payloads copied under one more hold of reg_mu.
 * The run stops before the first frame that is not a whole, well-formed PUT inside a
 * registered region (that one takes the frame-by-frame path, which reports it); returns
 * the bytes consumed, 0 when fewer than two frames qualify. */
#define TCP_RUN_MAX 64
static size_t rx_put_run(tcp_iface_t *tl, tcp_ep_t *ep, const uint8_t *p, size_t n)
{
    kvw_tl_write_t w[TCP_RUN_MAX];
    tcp_region_t *reg[TCP_RUN_MAX];
    kvw_status_t st[TCP_RUN_MAX];
    size_t at[TCP_RUN_MAX], cnt = 0, pos = 0;
    if (tl->srv.cb.check_writes == NULL)
        return 0;
    while (cnt < TCP_RUN_MAX && n - pos >= KVW_TCP_HDR_LEN) {
        kvw_tcp_hdr_t h;
        kvw_tcp_hdr_decode(p + pos, &h);
        if (h.magic != KVW_TCP_FRAME_MAGIC || h.version != KVW_TCP_VERSION || h.flags != 0 ||
            h.type != KVW_TCP_PUT || h.len == 0 || h.len > n - pos - KVW_TCP_HDR_LEN)
            break;
        w[cnt] = (kvw_tl_write_t){.room = h.room, .region_id = h.region, .off = h.off,
                                  .len = h.len};
        at[cnt++] = pos + KVW_TCP_HDR_LEN;
        pos += KVW_TCP_HDR_LEN + (size_t)h.len;
    }
    if (cnt < 2)
        return 0;
    pthread_mutex_lock(&tl->srv.reg_mu);
    for (size_t i = 0; i < cnt; i++) {
        tcp_region_t *r = region_find(tl, w[i].region_id);
        if (!region_inside(r, w[i].off, w[i].len)) {
            cnt = i; /* this one fails its connection on the frame-by-frame path */
            break;
        }
        r->refs++;
        reg[i] = r;
    }
    pthread_mutex_unlock(&tl->srv.reg_mu);
    if (cnt == 0)
        return 0;
    ep->s.greeted = true;
    tl->srv.cb.check_writes(tl->srv.cb.arg, (kvw_tl_ep_h)(void *)ep, w, cnt, st);
    pthread_mutex_lock(&tl->srv.reg_mu);
    for (size_t i = 0; i < cnt; i++) {
        if (st[i] == KVW_OK && !reg[i]->dead)
            memcpy(reg[i]->addr + w[i].off, p + at[i], (size_t)w[i].len);
        region_unref(reg[i]);
    }
    pthread_mutex_unlock(&tl->srv.reg_mu);
    return at[cnt - 1] + (size_t)w[cnt - 1].len;
}

/* Receive thread: runs `n` bytes the connection sent (read into tl->rxbuf) through its
 * state machine: header bytes into rx_hdr, payload bytes copied into the registered
 * memory (under reg_mu, as every landing byte), notification bytes into rx_note,
 * refused payloads skipped. Consumes them all unless the endpoint fails: nothing is left
 * in the buffer for later (the poll, level-triggered, knows only of the socket's bytes). */
static void rx_consume(tcp_iface_t *tl, tcp_ep_t *ep, const uint8_t *p, size_t n)
{
    while (n > 0 && !ep->s.reported && !atomic_load(&ep->s.closing)) {
        size_t take;
        switch (ep->rx_state) {
        case RX_HDR:
            if (ep->rx_hdr_got == 0 && (take = rx_put_run(tl, ep, p, n)) > 0)
                break;
            /* fall through */
        case RX_HELLO:
            take = KVW_MIN(n, KVW_TCP_HDR_LEN - ep->rx_hdr_got);
            memcpy(ep->rx_hdr + ep->rx_hdr_got, p, take);
            ep->rx_hdr_got += take;
            if (ep->rx_hdr_got == KVW_TCP_HDR_LEN) {
                ep->rx_hdr_got = 0;
                on_header(tl, ep);
            }
            break;
        case RX_PAYLOAD:
            take = (size_t)KVW_MIN((uint64_t)n, ep->rx_left);
            if (!rx_land_begin(tl, ep))
                continue; /* discarded: the rest of it, these bytes first */
            memcpy(ep->rx_dst, p, take);
            pthread_mutex_unlock(&tl->srv.reg_mu);
            rx_landed(tl, ep, take);
            break;
        case RX_DISCARD:
            take = (size_t)KVW_MIN((uint64_t)n, ep->rx_left);
            ep->rx_left -= take;
            if (ep->rx_left == 0)
                ep->rx_state = RX_HDR;
            break;
        case RX_NOTIFY:
            take = KVW_MIN(n, ep->rx_note_len - ep->rx_note_got);
            memcpy(ep->rx_note + ep->rx_note_got, p, take);
            ep->rx_note_got += take;
            if (ep->rx_note_got == ep->rx_note_len) {
                ep->rx_state = RX_HDR;
                if (!atomic_load(&ep->s.closing))
                    tl->srv.cb.on_notify(tl->srv.cb.arg, (kvw_tl_ep_h)(void *)ep, ep->rx_note,
                                         ep->rx_note_len);
            }
            break;
        default:
            kvw__sock_ep_fail(&ep->s, KVW_ERR_INTERNAL, "bad receive state %d", ep->rx_state);
            return;
        }
        p += take;
        n -= take;
    }
}

/* Receive thread: reads what an accepted connection has, up to TCP_RX_BUDGET bytes.
 * Frames are read TCP_RX_BUF bytes at a time into one buffer and taken apart there, so
 * a room of many small PUTs and its NOTIFY cost one or two reads, not one per frame; a
 * payload of TCP_RX_DIRECT bytes or more is read straight into the registered memory
 * (no copy), the buffer taking what follows it in the same call. A read that returns
 * less than it asked for found the socket drained: it returns then, without the further
 * recv that would only say EAGAIN (the poll is level-triggered, so bytes that arrive
 * meanwhile are seen at once). */
static void ep_rx(tcp_iface_t *tl, tcp_ep_t *ep)
{
    size_t budget = TCP_RX_BUDGET;
    while (budget > 0 && !ep->s.reported && !atomic_load(&ep->s.closing)) {
        ssize_t r;
        if (ep->rx_state == RX_PAYLOAD && ep->rx_left >= TCP_RX_DIRECT) {
            size_t want = (size_t)KVW_MIN(ep->rx_left, (uint64_t)TCP_RX_CHUNK);
            struct iovec iov[2] = {{.iov_base = ep->rx_dst, .iov_len = want},
                                   {.iov_base = tl->rxbuf, .iov_len = sizeof(tl->rxbuf)}};
            struct msghdr msg = {.msg_iov = iov, .msg_iovlen = want == ep->rx_left ? 2 : 1};
            size_t asked = want + (msg.msg_iovlen == 2 ? sizeof(tl->rxbuf) : 0);
            if (!rx_land_begin(tl, ep))
                continue;
            r = recvmsg(ep->s.fd, &msg, 0);
            pthread_mutex_unlock(&tl->srv.reg_mu);
            if (!rx_result(ep, r, want))
                return;
            budget -= KVW_MIN((size_t)r, budget);
            size_t into = KVW_MIN((size_t)r, want);
            rx_landed(tl, ep, into);
            rx_consume(tl, ep, tl->rxbuf, (size_t)r - into);
            if ((size_t)r < asked)
                return; /* drained (see above) */
            continue;
        }
        r = recv(ep->s.fd, tl->rxbuf, sizeof(tl->rxbuf), 0);
        if (!rx_result(ep, r, sizeof(tl->rxbuf)))
            return;
        budget -= KVW_MIN((size_t)r, budget);
        rx_consume(tl, ep, tl->rxbuf, (size_t)r);
        if ((size_t)r < sizeof(tl->rxbuf))
            return; /* drained (see above) */
    }
}

/* ---------------------------------------------------------------- socket server hooks */

static kvw__sock_ep_t *srv_accept(kvw__sockserv_t *srv, int fd, const struct sockaddr *sa,
                                  socklen_t sa_len)
{
    (void)sa_len;
    tcp_ep_t *ep = calloc(1, sizeof(*ep));
    if (ep == NULL)
        return NULL;
    set_sock_opts(fd);
    kvw__sock_ep_init(&ep->s, srv, fd, true);
    ep->rx_state = RX_HELLO;
    format_sockaddr(sa, ep->s.hd.peer, sizeof(ep->s.hd.peer));
    return &ep->s;
}

static void srv_rx(kvw__sock_ep_t *s)
{
    tcp_ep_t *ep = sock_to_ep(s);
    ep_rx(ep_iface(ep), ep);
}

/* Accepted connections that stopped in the middle of a frame (or never said HELLO). */
static void srv_stalled(kvw__sock_ep_t *s)
{
    tcp_ep_t *ep = sock_to_ep(s);
    if (ep->rx_state == RX_HDR && ep->rx_hdr_got == 0)
        return; /* idle between frames */
    kvw__sock_ep_fail(&ep->s, KVW_ERR_TIMEOUT, "peer stalled %s for more than %llu ms",
                      ep->rx_state == RX_HELLO ? "before HELLO" : "in the middle of a frame",
                      (unsigned long long)(ep_iface(ep)->srv.timeout_ns / 1000000ull));
}

static void srv_failed(kvw__sock_ep_t *s)
{
    tcp_ep_t *ep = sock_to_ep(s);
    ep_rx_release(ep_iface(ep), ep);
    if (!ep->s.hd.accepted)
        shutdown(ep->s.fd, SHUT_RDWR); /* wakes a sender blocked on this socket */
}

static void srv_ep_free(kvw__sock_ep_t *s)
{
    tcp_ep_t *ep = sock_to_ep(s);
    ep_rx_release(ep_iface(ep), ep);
    free(ep->tx_hdrs);
    free(ep->tx_iov);
    free(ep->rx_note);
    free(ep);
}

static void srv_rkey_free(kvw__tl_rkey_t *rk)
{
    free(rk);
}

static const kvw__sockserv_ops_t tcp_srv_ops = {
    .name = "tcp",
    .max_conns = TCP_MAX_CONNS,
    .greets = true,
    .unexpected = "unexpected bytes from the receiver",
    .gone = {"the connection to ", " has failed"},
    .accept = srv_accept,
    .rx = srv_rx,
    .stalled = srv_stalled,
    .failed = srv_failed,
    .ep_free = srv_ep_free,
    .rkey_free = srv_rkey_free,
};

/* ---------------------------------------------------------------- ops */

static kvw_status_t tcp_init(const kvw_tl_params_t *params, kvw_tl_h *tl_p)
{
    kvw_status_t st;
    tcp_iface_t *tl = kvw__sockserv_new(&tcp_srv_ops, params, tl_p, sizeof(*tl), &st);
    if (tl == NULL)
        return st;

    const char *host = params->listen_host ? params->listen_host : "127.0.0.1";
    char port[8];
    snprintf(port, sizeof(port), "%u", (unsigned)params->listen_port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai != 0) {
        st = kvw__error(KVW_ERR_INVALID_PARAM, "tcp init: cannot resolve listen host '%s': %s",
                        host, gai_strerror(gai));
        goto err_delete;
    }
    int last_errno = 0;
    for (struct addrinfo *ai = res; ai && tl->srv.listen_fd < 0; ai = ai->ai_next) {
        if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6)
            continue;
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        int buf = TCP_SOCKBUF; /* inherited by accepted sockets before the handshake */
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 512) != 0) {
            last_errno = errno;
            close(fd);
            continue;
        }
        tl->srv.listen_fd = fd;
    }
    freeaddrinfo(res);
    if (tl->srv.listen_fd < 0) {
        errno = last_errno;
        st = kvw__error(KVW_ERR_IO, "tcp init: cannot listen on %s port %u: %m", host,
                        (unsigned)params->listen_port);
        goto err_delete;
    }
    socklen_t sl = sizeof(tl->listen_addr);
    if (getsockname(tl->srv.listen_fd, (struct sockaddr *)&tl->listen_addr, &sl) != 0) {
        st = kvw__error(KVW_ERR_IO, "tcp init: getsockname: %m");
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

static kvw_status_t tcp_address(kvw_tl_h tl_h, void *buf, size_t *len_p)
{
    tcp_iface_t *tl = to_iface(tl_h);
    kvw_status_t st = kvw__tl_check_address("tcp", tl, buf, len_p, KVW_TCP_ADDR_LEN);
    if (st != KVW_OK)
        return st;
    kvw_tcp_addr_t a = {.token = tl->srv.token};
    int v6 = tl->listen_addr.ss_family == AF_INET6;
    if (v6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)(const void *)&tl->listen_addr;
        memcpy(a.ip, &in6->sin6_addr, 16);
        a.port = ntohs(in6->sin6_port);
    } else {
        const struct sockaddr_in *in = (const struct sockaddr_in *)(const void *)&tl->listen_addr;
        memcpy(a.ip, &in->sin_addr, 4);
        a.port = ntohs(in->sin_port);
    }
    kvw_tcp_addr_encode(buf, &a, v6);
    *len_p = KVW_TCP_ADDR_LEN;
    return KVW_OK;
}

static kvw_status_t tcp_mem_reg(kvw_tl_h tl_h, void *addr, uint64_t len, kvw_mem_kind_t kind,
                                uint64_t region_id, kvw_tl_mem_h *mem_p, void *rkey_buf,
                                size_t *rkey_len_p)
{
    tcp_iface_t *tl = to_iface(tl_h);
    kvw_status_t st = kvw__tl_check_mem_reg("tcp", tl, addr, len, kind, region_id, mem_p,
                                            rkey_buf, rkey_len_p);
    if (st != KVW_OK)
        return st;
    tcp_region_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "tcp mem_reg: no memory");
    r->id = region_id;
    r->addr = addr;
    r->len = len;
    r->refs = 1;
    pthread_mutex_lock(&tl->srv.reg_mu);
    st = kvw__tl_region_link("tcp", &tl->regions, &r->node, region_id);
    pthread_mutex_unlock(&tl->srv.reg_mu);
    if (st != KVW_OK) {
        free(r);
        return st;
    }

    uint8_t *p = rkey_buf;
    kvw__tl_pack_head(p, KVW_TCP_RKEY_LEN, KVW_TCP_RKEY_MAGIC, KVW_TCP_VERSION, KVW_TCP_RKEY_KIND,
                      tl->srv.token);
    kvw__le64_put(p + 16, region_id);
    kvw__le64_put(p + 24, len);
    *rkey_len_p = KVW_TCP_RKEY_LEN;
    *mem_p = (kvw_tl_mem_h)(void *)r;
    return KVW_OK;
}

static void tcp_mem_dereg(kvw_tl_h tl_h, kvw_tl_mem_h mem)
{
    tcp_iface_t *tl = to_iface(tl_h);
    tcp_region_t *r = (tcp_region_t *)(void *)mem;
    if (tl == NULL || r == NULL)
        return;
    pthread_mutex_lock(&tl->srv.reg_mu);
    if (kvw__hmap_remove(&tl->regions, &r->node) == 0) {
        r->dead = true;
        region_unref(r);
    }
    pthread_mutex_unlock(&tl->srv.reg_mu);
}

static kvw_status_t tcp_connect(kvw_tl_h tl_h, const void *addr, size_t len, kvw_tl_ep_h *ep_p)
{
    tcp_iface_t *tl = to_iface(tl_h);
    kvw_tcp_addr_t a;
    if (tl == NULL || ep_p == NULL)
        return kvw__error(KVW_ERR_INVALID_PARAM, "tcp connect: NULL argument");
    if (atomic_load(&tl->srv.closed))
        return kvw__error(KVW_ERR_SHUTDOWN, "tcp connect: the transport is closed");
    if (kvw_tcp_addr_decode(addr, len, &a) != 0)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "tcp connect: %zu bytes are not a tcp address of version %u", len,
                          KVW_TCP_VERSION);
    struct sockaddr_storage ss;
    socklen_t sl = kvw_tcp_addr_sockaddr(&a, &ss);
    char peer[64];
    format_sockaddr((struct sockaddr *)&ss, peer, sizeof(peer));

    kvw_status_t st;
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return kvw__error(KVW_ERR_IO, "tcp connect to %s: socket: %m", peer);
    set_sock_opts(fd);
    if (connect(fd, (struct sockaddr *)&ss, sl) != 0) {
        if (errno != EINPROGRESS) {
            st = kvw__error(errno == ECONNREFUSED ? KVW_ERR_CONN_CLOSED : KVW_ERR_IO,
                            "tcp connect to %s: %m", peer);
            goto err_close_socket;
        }
        st = kvw__sock_wait(fd, POLLOUT, KVW_SOCK_NO_DEADLINE, tl->srv.timeout_ns, "tcp connect");
        if (st != KVW_OK)
            goto err_close_socket;
        int soerr = 0;
        socklen_t el = sizeof(soerr);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &el) != 0)
            soerr = errno;
        if (soerr != 0) {
            errno = soerr;
            st = kvw__error(soerr == ECONNREFUSED ? KVW_ERR_CONN_CLOSED : KVW_ERR_IO,
                            "tcp connect to %s: %m", peer);
            goto err_close_socket;
        }
    }
    uint8_t hello[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(hello, KVW_TCP_HELLO, a.token, 0, 0, 0);
    struct iovec iov = {.iov_base = hello, .iov_len = sizeof(hello)};
    st = kvw__sock_send_iov(fd, &iov, 1, KVW_SOCK_NO_DEADLINE, tl->srv.timeout_ns,
                            "tcp connect: HELLO");
    if (st != KVW_OK)
        goto err_close_socket;
    uint8_t ack[KVW_TCP_ACK_LEN];
    st = kvw__sock_recv_exact(fd, ack, sizeof(ack), KVW_SOCK_NO_DEADLINE, tl->srv.timeout_ns,
                              "tcp connect: HELLO_ACK");
    if (st == KVW_ERR_CONN_CLOSED)
        st = kvw__error(KVW_ERR_REJECTED,
                        "tcp connect to %s: the receiver closed the connection during the "
                        "handshake (wrong token or version: is the address stale?)",
                        peer);
    if (st != KVW_OK)
        goto err_close_socket;
    if (kvw__le32_get(ack) != KVW_TCP_FRAME_MAGIC || ack[4] != KVW_TCP_VERSION ||
        ack[5] != KVW_TCP_HELLO_ACK || kvw__le64_get(ack + 8) != a.token) {
        st = kvw__error(KVW_ERR_MALFORMED, "tcp connect to %s: bad HELLO_ACK", peer);
        goto err_close_socket;
    }

    tcp_ep_t *ep = calloc(1, sizeof(*ep));
    if (ep == NULL) {
        st = kvw__error(KVW_ERR_NO_MEMORY, "tcp connect: no memory");
        goto err_close_socket;
    }
    ep->tx_hdrs = malloc((size_t)TCP_MAX_BATCH * KVW_TCP_HDR_LEN);
    ep->tx_iov = malloc((2 * (size_t)TCP_MAX_BATCH + 2) * sizeof(struct iovec));
    if (ep->tx_hdrs == NULL || ep->tx_iov == NULL) {
        free(ep->tx_hdrs);
        free(ep->tx_iov);
        free(ep);
        st = kvw__error(KVW_ERR_NO_MEMORY, "tcp connect: no memory");
        goto err_close_socket;
    }
    kvw__sock_ep_init(&ep->s, &tl->srv, fd, false);
    ep->s.hd.peer_token = a.token;
    snprintf(ep->s.hd.peer, sizeof(ep->s.hd.peer), "%s", peer);
    kvw__sock_ep_add(&ep->s);
    *ep_p = (kvw_tl_ep_h)(void *)ep;
    return KVW_OK;

err_close_socket:
    close(fd);
    return st;
}

static kvw_status_t tcp_rkey_unpack(kvw_tl_ep_h ep_h, const void *buf, size_t len,
                                    kvw_tl_rkey_h *rkey_p)
{
    tcp_ep_t *ep = to_ep(ep_h);
    const uint8_t *p = buf;
    kvw_status_t st = kvw__tl_check_unpack("tcp", ep ? &ep->s.hd : NULL, buf, rkey_p);
    if (st != KVW_OK)
        return st;
    if (len != KVW_TCP_RKEY_LEN || kvw__le32_get(p) != KVW_TCP_RKEY_MAGIC ||
        p[4] != KVW_TCP_VERSION || p[5] != KVW_TCP_RKEY_KIND || kvw__le16_get(p + 6) != 0)
        return kvw__error(KVW_ERR_INVALID_PARAM,
                          "tcp rkey_unpack: %zu bytes are not a tcp remote key of version %u",
                          len, KVW_TCP_VERSION);
    if ((st = kvw__tl_check_key_token(&ep->s.hd, kvw__le64_get(p + 8))) != KVW_OK)
        return st;
    tcp_rkey_t *rk = calloc(1, sizeof(*rk));
    if (rk == NULL)
        return kvw__error(KVW_ERR_NO_MEMORY, "tcp rkey_unpack: no memory");
    rk->tl = ep_iface(ep);
    rk->hd.ep = &ep->s.hd;
    rk->hd.region_id = kvw__le64_get(p + 16);
    rk->hd.len = kvw__le64_get(p + 24);
    kvw__tl_rkey_link(&rk->tl->srv.mu, &rk->tl->srv.rkeys, &rk->hd);
    *rkey_p = (kvw_tl_rkey_h)(void *)rk;
    return KVW_OK;
}

static void tcp_rkey_release(kvw_tl_rkey_h rkey)
{
    tcp_rkey_t *rk = (tcp_rkey_t *)(void *)rkey;
    if (rk == NULL)
        return;
    kvw__tl_rkey_unlink(&rk->tl->srv.mu, &rk->tl->srv.rkeys, &rk->hd);
    free(rk);
}

static kvw_status_t check_sendable(tcp_ep_t *ep, const char *what)
{
    return kvw__sock_check_sendable("tcp", ep ? &ep->s : NULL, what);
}

/* tx_mu held. Sends iov; on failure the stream may hold half a frame, so the
 * connection is marked dead and shut down (the receiver then drops it too). */
static kvw_status_t ep_send(tcp_ep_t *ep, struct iovec *iov, size_t cnt, const char *what)
{
    kvw_status_t st = kvw__sock_send_iov(ep->s.fd, iov, cnt, KVW_SOCK_NO_DEADLINE,
                                         ep_iface(ep)->srv.timeout_ns, what);
    if (st != KVW_OK) {
        atomic_store(&ep->s.dead, true);
        shutdown(ep->s.fd, SHUT_RDWR);
    }
    return st;
}

/* Writes PUT frames for `puts` and then, with msg (NULL: none), one NOTIFY frame, in
 * batches of TCP_MAX_BATCH frames per sendmsg: the notification goes in the last
 * batch, so a small room's bytes and its completion leave in one call (and usually
 * reach the receive thread in one wake-up). */
static kvw_status_t tcp_send_frames(tcp_ep_t *ep, uint64_t room, const kvw_tl_put_t *puts,
                                    size_t n, const void *msg, size_t len)
{
    /* Check every write before sending any, so a bad batch moves nothing. */
    kvw_status_t st =
        kvw__tl_check_puts(check_sendable(ep, "put"), ep ? &ep->s.hd : NULL, puts, n);
    if (st == KVW_OK && msg)
        st = kvw__tl_check_notify(KVW_OK, &ep->s.hd, msg, len);
    if (st != KVW_OK)
        return st;
    uint8_t nh[KVW_TCP_HDR_LEN];
    if (msg)
        kvw_tcp_hdr_encode(nh, KVW_TCP_NOTIFY, 0, 0, 0, len);
    pthread_mutex_lock(&ep->s.tx_mu);
    st = check_sendable(ep, msg && n == 0 ? "notify" : "put");
    size_t i = 0;
    bool note = msg != NULL;
    while (st == KVW_OK && (i < n || note)) {
        size_t cnt = 0, frames = 0;
        for (; i < n && frames < TCP_MAX_BATCH; i++) {
            const tcp_rkey_t *rk = (const tcp_rkey_t *)(const void *)puts[i].rkey;
            if (puts[i].len == 0)
                continue;
            uint8_t *h = ep->tx_hdrs + frames * KVW_TCP_HDR_LEN;
            kvw_tcp_hdr_encode(h, KVW_TCP_PUT, room, rk->hd.region_id, puts[i].dst_off,
                               puts[i].len);
            ep->tx_iov[cnt++] = (struct iovec){.iov_base = h, .iov_len = KVW_TCP_HDR_LEN};
            ep->tx_iov[cnt++] =
                (struct iovec){.iov_base = (void *)puts[i].src, .iov_len = (size_t)puts[i].len};
            frames++;
        }
        if (i == n && note) {
            ep->tx_iov[cnt++] = (struct iovec){.iov_base = nh, .iov_len = sizeof(nh)};
            if (len > 0)
                ep->tx_iov[cnt++] = (struct iovec){.iov_base = (void *)msg, .iov_len = len};
            note = false;
        }
        if (cnt > 0)
            st = ep_send(ep, ep->tx_iov, cnt, msg ? "tcp put+notify" : "tcp put");
    }
    pthread_mutex_unlock(&ep->s.tx_mu);
    return st;
}

static kvw_status_t tcp_put(kvw_tl_ep_h ep_h, uint64_t room, const kvw_tl_put_t *puts, size_t n)
{
    return tcp_send_frames(to_ep(ep_h), room, puts, n, NULL, 0);
}

static kvw_status_t tcp_put_notify(kvw_tl_ep_h ep_h, uint64_t room, const kvw_tl_put_t *puts,
                                   size_t n, const void *msg, size_t len)
{
    return tcp_send_frames(to_ep(ep_h), room, puts, n, msg, len);
}

static kvw_status_t tcp_notify(kvw_tl_ep_h ep_h, const void *msg, size_t len)
{
    tcp_ep_t *ep = to_ep(ep_h);
    kvw_status_t st =
        kvw__tl_check_notify(check_sendable(ep, "notify"), ep ? &ep->s.hd : NULL, msg, len);
    if (st != KVW_OK)
        return st;
    uint8_t h[KVW_TCP_HDR_LEN];
    kvw_tcp_hdr_encode(h, KVW_TCP_NOTIFY, 0, 0, 0, len);
    struct iovec iov[2] = {{.iov_base = h, .iov_len = sizeof(h)},
                           {.iov_base = (void *)msg, .iov_len = len}};
    pthread_mutex_lock(&ep->s.tx_mu);
    st = check_sendable(ep, "notify");
    if (st == KVW_OK)
        st = ep_send(ep, iov, len > 0 ? 2 : 1, "tcp notify");
    pthread_mutex_unlock(&ep->s.tx_mu);
    return st;
}

/* fini: a region left registered (the receive thread has stopped). */
static void region_free(void *arg, kvw_hnode_t *n)
{
    (void)arg;
    free(KVW_CONTAINER_OF(n, tcp_region_t, node));
}

static void tcp_fini(kvw_tl_h tl_h)
{
    tcp_iface_t *tl = to_iface(tl_h);
    if (tl == NULL)
        return;
    kvw__sockserv_fini(&tl->srv);
    kvw__tl_regions_free(&tl->regions, region_free, NULL);
    kvw__sockserv_delete(&tl->srv);
}

const kvw_tl_ops_t kvw_tl_tcp_ops = {
    .name = "tcp",
    KVW_TL_OPS_SLOTS(tcp),
    KVW__SOCKSERV_OPS_SLOTS,
    .put_notify = tcp_put_notify,
    .caps = KVW_TL_CAP_MEDIATED | KVW_TL_CAP_SYNC_PUT,
};
